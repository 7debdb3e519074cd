"""FFCV's decode-once multi-crop operation: one `.beton` image field → every crop view of the recipe.

FFCV 1.0.2 maps each stored field to exactly one pipeline, so multi-crop through FFCV's own
`RandomResizedCropRGBImageDecoder` would decode the image once per view. `DecodeViews` is a decoder
of our own, written with FFCV's `Operation` API and its compiled primitives (libffcv's turbojpeg
`imdecode` and `resize`, i.e. OpenCV's `cv::resize` with INTER_AREA on a window): it decodes each
image once and writes every crop of every crop group (the crop law of `pipelines.augment`) into one
flat uint8 row per sample, followed by the crop windows it drew as int64 (`CropLayout`), so that
saliency masks are cropped with exactly the image's window on the host.

With `ops` (CPU loaders), right after each crop is resized into its row, the compiled kernels of
`pipelines.ffcv_ops` draw the view's parameters (draws `ffcv_ops.FIRST_DRAW`.. of the view, after
the crop draws) and apply flip, jitter, grayscale, blur and solarize; staged views (RSA) take their
parent's finished float view, so one crop gives two outputs. The drawn parameters follow the
windows in the row as float32. `CropLayout.read` reads a batch of rows back as one typed record
(`Rows`: the views, the windows, the parameters as `augment.ViewParams`). A view
that draws saliency is left as its raw crop, with its parameters: its mask arrives in another
field, after this operation, and the reference order composites the background before the ops;
the loader finishes it on the host (`ffcv_ops.finish_salient`).

Randomness is counter-based: a parameter is a hash of (key, dataset index, view, draw), the key
mixed from (seed, rank, epoch) by the loader, so it depends neither on FFCV's thread scheduling nor
on the batch a sample lands in.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import llvmlite.binding as llvm
import numba
import numpy as np
import torch
from ffcv.fields.rgb_image import IMAGE_MODES
from ffcv.libffcv import ctypes_imdecode, ctypes_memcopy, ctypes_resize
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.operation import Operation
from torch import Tensor

from pipelines import ffcv_ops
from pipelines.augment import CROP_DRAWS, ViewParams
from pipelines.views import Recipe, ViewGroup

WINDOW_BYTES = 4 * 8             # per crop view: y0, x0, h, w as int64, the crop kernel's own box


@dataclass(frozen=True)
class CropLayout:
    """Where each view lives in the flat per-sample row `DecodeViews` writes.

    Views are numbered over the crop groups in recipe order; with compiled ops (`staged` set, CPU
    loaders) the staged groups' views follow them, and a block of drawn per-view parameters
    (columns `ffcv_ops.Param`, float32) follows the crop windows (int64).
    """

    groups: tuple[ViewGroup, ...]     # crop groups, recipe order
    first_view: tuple[int, ...]       # per group: number of its first view
    offsets: tuple[int, ...]          # per view (crop, then staged): byte offset of its (S, S, 3) pixels
    sizes: tuple[int, ...]            # per view: S
    windows_offset: int               # byte offset of the (crop views, 4) int64 windows
    row_bytes: int
    staged: tuple[ViewGroup, ...] = ()        # staged groups written by the compiled ops, recipe order
    staged_first_view: tuple[int, ...] = ()   # per staged group: number of its first view
    params_offset: int = -1                   # byte offset of the (views, N_PARAMS) float32 parameters

    @staticmethod
    def of(recipe: Recipe, ops: bool) -> "CropLayout":
        groups = recipe.crop_groups
        staged = recipe.by_role("staged") if ops else ()
        first, offsets, sizes, pos = [], [], [], 0
        for g in groups + staged:
            first.append(len(offsets))
            for _ in range(g.count):
                offsets.append(pos)
                sizes.append(g.size_px)
                pos += g.size_px * g.size_px * 3
        n_crop = sum(g.count for g in groups)
        windows_end = pos + WINDOW_BYTES * n_crop
        if not ops:
            return CropLayout(groups, tuple(first[:len(groups)]), tuple(offsets[:n_crop]),
                              tuple(sizes[:n_crop]), pos, windows_end)
        return CropLayout(groups, tuple(first[:len(groups)]), tuple(offsets), tuple(sizes), pos,
                          windows_end + ffcv_ops.PARAM_BYTES * len(offsets), staged,
                          tuple(first[len(groups):]), windows_end)

    @property
    def num_crop_views(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def all_groups(self) -> tuple[ViewGroup, ...]:
        """Crop groups, then the staged groups of the compiled ops (view-number order)."""
        return self.groups + self.staged

    @property
    def all_first_views(self) -> tuple[int, ...]:
        return self.first_view + self.staged_first_view

    def first_view_of(self, name: str) -> int:
        return next(v0 for g, v0 in zip(self.all_groups, self.all_first_views) if g.name == name)

    def read(self, rows: Tensor) -> Rows:
        """A (B, row_bytes) uint8 batch of rows as views, crop windows and drawn parameters."""
        b = rows.shape[0]
        views = {}
        for g, v0 in zip(self.all_groups, self.all_first_views):
            s = g.size_px
            start = self.offsets[v0]
            block = rows[:, start:start + g.count * s * s * 3].reshape(b, g.count, s, s, 3)  # (B, count, S, S, 3)
            views[g.name] = block.permute(1, 0, 4, 2, 3)                                       # (count, B, 3, S, S)
        n = self.num_crop_views
        boxes = rows[:, self.windows_offset:self.windows_offset + WINDOW_BYTES * n].clone()   # aligned copy
        boxes = boxes.view(torch.int64).reshape(b, n, 4).permute(1, 0, 2)                     # (V, B, 4)
        windows = {g.name: boxes[v0:v0 + g.count] for g, v0 in zip(self.groups, self.first_view)}
        if self.params_offset < 0:
            return Rows(views, windows)
        nv = len(self.offsets)
        raw = rows[:, self.params_offset:self.params_offset + ffcv_ops.PARAM_BYTES * nv].clone()   # aligned copy
        drawn = raw.view(torch.float32).reshape(b, nv, ffcv_ops.N_PARAMS).permute(1, 0, 2)       # (V, B, N_PARAMS)
        params = {g.name: view_params(drawn[v0:v0 + g.count].reshape(g.count * b, -1))
                  for g, v0 in zip(self.all_groups, self.all_first_views)}
        return Rows(views, windows, drawn, params)


@dataclass(frozen=True)
class Rows:
    """A batch of `DecodeViews` rows read back (`CropLayout.read`)."""

    views: dict[str, Tensor]          # group -> (count, B, 3, S, S) uint8, views into the rows
    windows: dict[str, Tensor]        # crop group -> (count, B, 4) int64 crop windows: y0, x0, h, w in source px
    drawn: Tensor | None = None       # (views, B, N_PARAMS) float32 as the compiled ops drew them; None without
    params: dict[str, ViewParams] = field(default_factory=dict)   # group -> `drawn` as ViewParams (count * B views)


def view_params(q: Tensor) -> ViewParams:
    """The drawn parameters of N views, as `augment.ViewParams` (what the compiled ops applied).

    Args:
        q: (N, N_PARAMS) float32, columns `ffcv_ops.Param`.
    """
    q, P = q.float(), ffcv_ops.Param
    return ViewParams(flip=q[:, P.FLIP] > 0.5, jitter=q[:, P.JITTER] > 0.5,
                      factors=q[:, P.FACTORS:P.FACTORS + 4].clone(), order=q[:, P.ORDER:P.ORDER + 4].long(),
                      gray=q[:, P.GRAY] > 0.5, blur=q[:, P.BLUR] > 0.5, sigma=q[:, P.SIGMA].clone(),
                      solarize=q[:, P.SOLARIZE] > 0.5, saliency=q[:, P.SALIENCY] > 0.5,
                      gray_level=q[:, P.GRAY_LEVEL].clone())


_JPG = IMAGE_MODES["jpg"]

# The C functions the decode kernel calls, by name: libffcv's turbojpeg decode, resize (OpenCV INTER_AREA) and
# memcpy, and the compiled ops (`ffcv_ops.compiled`). Numba links a name at load time (`_link` gives each
# its address in this process), so the kernel, unlike one holding addresses, goes into numba's on-disk
# cache. Pointers are passed as integers (the C calling convention passes both alike). The cache is renewed
# when this file changes, so the kernel reads nothing from other modules but these signatures (here) and
# its arguments: the numbers it shares with them come in its `DecodePlan`.
_P, _I64, _U64, _U32 = numba.types.uintp, numba.types.int64, numba.types.uint64, numba.types.uint32
_C_FUNCTIONS = {
    "imdecode": (ctypes_imdecode, numba.types.int32(_P, _U64, _U32, _U32, _P, _U32, _U32, _U32, _U32, _U32, _U32,
                                                    numba.types.boolean, numba.types.boolean)),
    "resize": (ctypes_resize, numba.types.int32(*[_I64] * 11)),
    "memcpy": (ctypes_memcopy, numba.types.void(_P, _P, _U64)),
    "draw_crop": ("draw_crop", numba.types.void(_U64, _U64, _I64, _I64, _I64, _I64, _P, _P, _P)),
    "draw_uniforms": ("draw_uniforms", numba.types.void(_U64, _U64, _I64, _I64, _I64, _I64, _P)),
    "finish_view": ("finish_view", numba.types.void(_P, _I64, _P, _P, _P, _P, _P, _P, _I64)),
    "finish_staged": ("finish_staged", numba.types.void(_P, _I64, _P, _P, _P, _P, _P, _P, _P)),
}
_c = {name: numba.types.ExternalFunction(f"viewmill_ffcv_{name}", sig) for name, (_, sig) in _C_FUNCTIONS.items()}
imdecode_c, resize_c, memcpy_c = _c["imdecode"], _c["resize"], _c["memcpy"]
draw_crop_c, draw_uniforms_c, finish_view_c, finish_staged_c = (
    _c["draw_crop"], _c["draw_uniforms"], _c["finish_view"], _c["finish_staged"])


@functools.lru_cache(maxsize=None)
def _link() -> None:
    """Give the decode kernel's C functions (`_C_FUNCTIONS`) their addresses in this process, before the
    kernel is compiled or loaded from the cache."""
    ops = ffcv_ops.compiled()
    for name, (fn, _) in _C_FUNCTIONS.items():
        fn = getattr(ops, fn) if isinstance(fn, str) else fn
        llvm.add_symbol(f"viewmill_ffcv_{name}", ctypes.cast(fn, ctypes.c_void_p).value)


class DecodePlan(NamedTuple):
    """What the decode kernel needs of a `CropLayout` and its laws, as arrays and numbers."""

    n_views: int                  # crop views
    view_group: np.ndarray        # (crop views,) its crop group
    offsets: np.ndarray           # (views,) byte offset of each view's pixels in the row
    sizes: np.ndarray             # (views,) S
    crop_laws: np.ndarray         # (crop groups, ffcv_ops.CROP_LAW) float64, `ffcv_ops.crop_law`
    windows_offset: int
    with_ops: bool                # the compiled per-view ops run after each crop
    laws: np.ndarray              # (all groups, F) float64, `ffcv_ops.group_table`
    all_view_group: np.ndarray    # (views,) its group among `CropLayout.all_groups`
    staged_parent: np.ndarray     # (staged views + 1,) each staged view's parent view; -1 ends it
    params_offset: int
    side: int                     # the largest view side with ops (scratch buffers), else 0
    jpg: int                      # FFCV's image mode of a JPEG
    n_draws: int                  # `ffcv_ops.N_PARAMS`: the uniforms of a view's ops ...
    first_draw: int               # ... from its draw `ffcv_ops.FIRST_DRAW` on
    param_bytes: int              # `ffcv_ops.PARAM_BYTES` of the drawn parameters of a view
    crop_draws: int               # `augment.CROP_DRAWS`: the uniforms of a crop
    window_bytes: int             # `WINDOW_BYTES`

    @staticmethod
    def of(lay: CropLayout, laws: np.ndarray) -> "DecodePlan":
        with_ops = lay.params_offset >= 0
        staged_parent = [lay.first_view_of(g.parent) + k for g in lay.staged for k in range(g.count)]
        return DecodePlan(
            lay.num_crop_views, np.repeat(np.arange(len(lay.groups)), [g.count for g in lay.groups]),
            np.array(lay.offsets, np.int64), np.array(lay.sizes, np.int64),
            np.array([ffcv_ops.crop_law(g) for g in lay.groups], np.float64), lay.windows_offset, with_ops,
            np.ascontiguousarray(laws, np.float64),
            np.repeat(np.arange(len(lay.all_groups)), [g.count for g in lay.all_groups]),
            np.array(staged_parent + [-1], np.int64), lay.params_offset, max(lay.sizes) if with_ops else 0,
            _JPG, ffcv_ops.N_PARAMS, ffcv_ops.FIRST_DRAW, ffcv_ops.PARAM_BYTES, CROP_DRAWS, WINDOW_BYTES)


@numba.njit(nogil=True, parallel=True, cache=True)
def decode_rows(batch_indices, destination, temp_storage, data_ptr, heights, widths, modes, file, file_ptrs,
                file_sizes, key, plan):
    """Decode each sample of the batch once and write its row (see `CropLayout`): every crop view (drawn,
    resized), its window and, with ops, the finished views and their drawn parameters. Parallel over
    the samples; `file`, `file_ptrs`, `file_sizes` are FFCV's page-cache state of the `.beton` file (its
    `OSCacheManager` reader: a sample's bytes start at its pointer and run for the stored size)."""
    law_bytes, crop_law_bytes = plan.laws.shape[1] * 8, plan.crop_laws.shape[1] * 8
    n_staged = plan.staged_parent.shape[0] - 1
    scratch = 3 * plan.side * plan.side                       # float32 scratch of one view
    pad_len = 3 * (3 * plan.side + 2)                         # one padded row: the blur radius <= side + 1
    for dst_ix in numba.prange(len(batch_indices)):
        sample = batch_indices[dst_ix]
        ptr = data_ptr[sample]
        data = file[ptr:ptr + file_sizes[np.searchsorted(file_ptrs, ptr)]]
        height, width = heights[sample], widths[sample]
        img = data.ctypes.data
        if modes[sample] == plan.jpg:
            img = temp_storage[dst_ix].ctypes.data
            imdecode_c(data.ctypes.data, data.size, height, width, img, height, width, 0, 0, 1, 1, False, False)
        out = destination[dst_ix].ctypes.data
        u = np.empty(plan.n_draws, np.float64)
        uc = np.empty(plan.crop_draws, np.float64)
        box = np.empty(4, np.int64)
        buf = np.empty(scratch, np.float32)
        child = np.empty(scratch, np.float32)
        tmp = np.empty(scratch, np.float32)
        pad = np.empty(pad_len, np.float32)
        for v in range(plan.n_views):
            g = plan.view_group[v]
            draw_crop_c(key[0], key[1], sample, v, height, width, plan.crop_laws.ctypes.data + crop_law_bytes * g,
                        uc.ctypes.data, box.ctypes.data)
            y0, x0, h, w = box[0], box[1], box[2], box[3]
            s = plan.sizes[v]
            resize_c(0, img, height, width, y0, y0 + h, x0, x0 + w, out + plan.offsets[v], s, s)
            memcpy_c(box.ctypes.data, out + plan.windows_offset + plan.window_bytes * v, plan.window_bytes)
            if not plan.with_ops:
                continue
            # The view's own ops on its crop, in place, then each staged view on the finished float
            # crop (one crop, two outputs); the parameters go into the row.
            draw_uniforms_c(key[0], key[1], sample, v, plan.first_draw, plan.n_draws, u.ctypes.data)
            has_child = False
            for k in range(n_staged):
                if plan.staged_parent[k] == v:
                    has_child = True
            finish_view_c(out + plan.offsets[v], s, u.ctypes.data, plan.laws.ctypes.data + law_bytes * g,
                          out + plan.params_offset + plan.param_bytes * v, buf.ctypes.data, tmp.ctypes.data,
                          pad.ctypes.data, 1 if has_child else 0)
            for k in range(n_staged):
                if plan.staged_parent[k] != v:
                    continue
                sv = plan.n_views + k
                draw_uniforms_c(key[0], key[1], sample, sv, plan.first_draw, plan.n_draws, u.ctypes.data)
                finish_staged_c(buf.ctypes.data, s, u.ctypes.data,
                                plan.laws.ctypes.data + law_bytes * plan.all_view_group[sv],
                                out + plan.params_offset + plan.param_bytes * sv, out + plan.offsets[sv],
                                child.ctypes.data, tmp.ctypes.data, pad.ctypes.data)


class DecodeViews(Operation):
    """Decode each image once and write all the recipe's crops into one row (see `CropLayout`).

    FFCV compiles an operation's code for every `Loader` (1.5-1.8 CPU-s a loader on 2 cores); this one
    hands FFCV a Python function (build the `Loader` with `ffcv_backend.python_stages`) that calls
    `decode_rows`, compiled once per machine (numba's on-disk cache) whatever the recipe.
    """

    def __init__(self, layout: CropLayout, key: np.ndarray, laws: np.ndarray) -> None:
        """Args: key: (2,) uint64, updated in place per epoch; laws: `ffcv_ops.group_table` of
        `layout.all_groups` (used with compiled ops)."""
        super().__init__()
        self.layout, self.key, self.plan = layout, key, DecodePlan.of(layout, laws)

    def declare_state_and_memory(self, previous_state):
        n = int(self.metadata["width"].max()) * int(self.metadata["height"].max()) * 3
        row = (self.layout.row_bytes,)
        return (replace(previous_state, jit_mode=False, shape=row, dtype=np.dtype("u1")),
                (AllocationQuery(row, np.dtype("u1")), AllocationQuery((n,), np.dtype("u1"))))

    def generate_code(self):
        _link()
        key, plan = self.key, self.plan

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, temp_storage = my_storage
            file, file_ptrs, file_sizes = storage_state
            # Samples go to the kernel's threads one at a time: their cost varies with the crop sizes
            # and the drawn ops, and two fixed halves of the batch left a core idle ~10 % of the
            # time (CPU use 1.80 -> 1.95 of 2 cores on relicv2).
            chunk = numba.set_parallel_chunksize(1)
            try:
                decode_rows(batch_indices, destination, temp_storage, metadata["data_ptr"], metadata["height"],
                            metadata["width"], metadata["mode"], file, file_ptrs, file_sizes, key, plan)
            finally:
                numba.set_parallel_chunksize(chunk)
            return destination[:len(batch_indices)]

        return decode
