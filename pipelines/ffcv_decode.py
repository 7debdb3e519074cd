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
on the batch a sample lands in. The key reaches the compiled code through a fixed address (numba
freezes arrays captured by a closure, so the key array is read with `memcpy` from its address on
each call).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numba
import numpy as np
import torch
from ffcv.fields.rgb_image import IMAGE_MODES
from ffcv.libffcv import ctypes_imdecode, ctypes_memcopy, ctypes_resize
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.compiler import Compiler
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


class DecodeViews(Operation):
    """Decode each image once and write all the recipe's crops into one row (see `CropLayout`)."""

    def __init__(self, layout: CropLayout, key: np.ndarray, laws: np.ndarray) -> None:
        """Args: key: (2,) uint64, updated in place per epoch and read through its address; laws:
        `ffcv_ops.group_table` of `layout.all_groups` (used with compiled ops)."""
        super().__init__()
        self.layout, self.key, self.laws = layout, key, laws

    def declare_state_and_memory(self, previous_state):
        n = int(self.metadata["width"].max()) * int(self.metadata["height"].max()) * 3
        row = (self.layout.row_bytes,)
        return (replace(previous_state, jit_mode=True, shape=row, dtype=np.dtype("u1")),
                (AllocationQuery(row, np.dtype("u1")), AllocationQuery((n,), np.dtype("u1"))))

    def generate_code(self):
        lay, laws = self.layout, self.laws
        mem_read = self.memory_read
        my_range = Compiler.get_iterator()
        memcpy, resize, imdecode = ctypes_memcopy, ctypes_resize, ctypes_imdecode
        set_chunksize = numba.set_parallel_chunksize
        key_address = np.uint64(self.key.ctypes.data)
        jpg = _JPG
        n_views = lay.num_crop_views
        view_group = np.repeat(np.arange(len(lay.groups)), [g.count for g in lay.groups])
        offsets = np.array(lay.offsets, np.int64)
        sizes = np.array(lay.sizes, np.int64)
        crop_laws = np.array([ffcv_ops.crop_law(g) for g in lay.groups], np.float64)       # (G, 5)
        crop_law_bytes = crop_laws.shape[1] * 8
        windows_offset, window_bytes = lay.windows_offset, WINDOW_BYTES
        crop_draws = CROP_DRAWS
        # The draws and the per-view ops are C functions compiled once per process (`ffcv_ops.compiled`),
        # so this loop is all that each pipeline compiles. Group laws, each staged view's parent view:
        with_ops = lay.params_offset >= 0
        ops = ffcv_ops.compiled()
        draw_crop, draw_uniforms = ops.draw_crop, ops.draw_uniforms
        finish_view, finish_staged = ops.finish_view, ops.finish_staged
        law_bytes = laws.shape[1] * 8
        all_view_group = np.repeat(np.arange(len(lay.all_groups)), [g.count for g in lay.all_groups])
        staged_parent = np.array([lay.first_view_of(g.parent) + k for g in lay.staged for k in range(g.count)]
                                 + [-1], np.int64)                                # (staged views + 1,)
        n_staged = len(staged_parent) - 1
        params_offset = lay.params_offset
        n_draws, first_draw, param_bytes = ffcv_ops.N_PARAMS, ffcv_ops.FIRST_DRAW, ffcv_ops.PARAM_BYTES
        side = max(lay.sizes) if with_ops else 0
        scratch = 3 * side * side                            # float32 scratch of one view
        pad_len = 3 * (3 * side + 2)                         # one padded row: the blur radius <= side + 1

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, temp_storage = my_storage
            # Samples go to FFCV's threads one at a time: their cost varies with the crop sizes
            # and the drawn ops, and two fixed halves of the batch left a core idle ~10 % of the
            # time (CPU use 1.80 -> 1.95 of 2 cores on relicv2).
            chunk = set_chunksize(1)
            for dst_ix in my_range(len(batch_indices)):
                sample = batch_indices[dst_ix]
                field = metadata[sample]
                data = mem_read(field["data_ptr"], storage_state)
                height, width = field["height"], field["width"]
                if field["mode"] == jpg:
                    # libffcv's turbojpeg decode, called through ctypes directly.
                    imdecode(data.ctypes.data, data.size, height, width, temp_storage[dst_ix].ctypes.data,
                             height, width, 0, 0, 1, 1, False, False)
                    img = temp_storage[dst_ix][:3 * height * width].reshape(height, width, 3)
                else:
                    img = data.reshape(height, width, 3)
                key = np.empty(2, np.uint64)
                memcpy(key_address, key.ctypes.data, 16)
                out = destination[dst_ix]
                u = np.empty(n_draws, np.float64)
                uc = np.empty(crop_draws, np.float64)
                box = np.empty(4, np.int64)
                buf = np.empty(scratch, np.float32)
                child = np.empty(scratch, np.float32)
                tmp = np.empty(scratch, np.float32)
                pad = np.empty(pad_len, np.float32)
                for v in range(n_views):
                    g = view_group[v]
                    draw_crop(key[0], key[1], sample, v, height, width, crop_laws.ctypes.data + crop_law_bytes * g,
                              uc.ctypes.data, box.ctypes.data)
                    y0, x0, h, w = box[0], box[1], box[2], box[3]
                    s = sizes[v]
                    resize(0, img.ctypes.data, height, width, y0, y0 + h, x0, x0 + w, out.ctypes.data + offsets[v], s, s)
                    memcpy(box.ctypes.data, out.ctypes.data + windows_offset + window_bytes * v, window_bytes)
                    if not with_ops:
                        continue
                    # The view's own ops on its crop, in place, then each staged view on the
                    # finished float crop (one crop, two outputs); the parameters go into the row.
                    draw_uniforms(key[0], key[1], sample, v, first_draw, n_draws, u.ctypes.data)
                    has_child = False
                    for k in range(n_staged):
                        if staged_parent[k] == v:
                            has_child = True
                    row = out.ctypes.data
                    finish_view(row + offsets[v], s, u.ctypes.data, laws.ctypes.data + law_bytes * g,
                                row + params_offset + param_bytes * v, buf.ctypes.data, tmp.ctypes.data,
                                pad.ctypes.data, 1 if has_child else 0)
                    for k in range(n_staged):
                        if staged_parent[k] != v:
                            continue
                        sv = n_views + k
                        draw_uniforms(key[0], key[1], sample, sv, first_draw, n_draws, u.ctypes.data)
                        finish_staged(buf.ctypes.data, s, u.ctypes.data, laws.ctypes.data + law_bytes * all_view_group[sv],
                                      row + params_offset + param_bytes * sv, row + offsets[sv],
                                      child.ctypes.data, tmp.ctypes.data, pad.ctypes.data)
            set_chunksize(chunk)
            return destination[:len(batch_indices)]

        decode.is_parallel = True
        return decode
