"""FFCV backend: the `.beton` file → decode once → every view of the recipe → `Batch` on the device.

FFCV 1.0.2 maps each stored field to exactly one pipeline, so multi-crop through FFCV's own
`RandomResizedCropRGBImageDecoder` would decode the image once per view. `DecodeViews` (in
`_ffcv_ops`) is a decoder of our own, written with FFCV's `Operation` API and its compiled primitives
(libffcv's turbojpeg `imdecode` and `resize`, i.e. OpenCV's `cv::resize` with INTER_AREA on a window):
it decodes each image once and writes every crop of every crop group (random resized crop: area ~
U(area) of the image, log(w/h) ~ U(log ratio), torchvision's 10 tries then a centre crop) into one
flat uint8 row per sample, followed by the crop windows it drew. The windows are kept so that the
saliency mask is cropped with exactly the image's window (`FFCVLoader.last_windows` exposes them).

Randomness is counter-based: a parameter is a hash of (seed, rank, epoch, dataset index, view, draw),
so it depends neither on FFCV's thread scheduling nor on the batch a sample lands in. The epoch key
reaches the compiled code through a fixed address (numba freezes arrays captured by a closure, so the
key array is read with `memcpy` from its address on each call).

After the crops, two paths, one semantics (`pipelines.torch_backend`'s ops: flip, colour jitter in a
per-view random order with torchvision's per-op clamping and HSV hue, grayscale, Gaussian blur,
solarize, saliency composite, staged views, mixes):
- CPU device (`compiled_ops`): right after each crop is resized into its row, `pipelines.ffcv_ops`
  draws the view's parameters (draws 41-56 of the view, after the crop draws 0-40) and applies flip,
  jitter, grayscale, blur and solarize in float32, rounding to uint8 once per view; a staged group's
  views (RSA) take their parent's finished float view, so one crop gives two outputs. This runs
  compiled, parallel over samples in FFCV's threads. The drawn parameters follow the windows in the
  row (`FFCVLoader.last_params`, as `augment.ViewParams`); saliency uses them on the host, and
  each `Batch` field is normalised straight from the rows in one compiled pass.
- Other devices: the uint8 crops go to `spec.device` and the ops run there, batched, with
  `torch_backend`'s public ops, from one host generator seeded per (seed, rank, epoch, batch).
Either way a mid-epoch resume only skips batches. Mixes run in torch on `spec.device` in both paths.

Measured on the idle 2-core CPU machine, 2,000 JPEGs of ~500x375 at quality 90, batch 32, 2 threads,
`python -m pipelines.bench --backends dali,ffcv,torchvision,torch --batches 10 --repeats 3` (medians
of 3 rounds): relicv2 352 img/s (2,110 views/s), 6.1x the torchvision baseline, 1.19x below the
decode + crops ceiling (419 img/s, uint8 crops only); rsa 717 img/s, 6.7x, 1.19x below its ceiling.
Per 224-px view on one core: load and store of the float view 0.04 ms, the four jitter ops ~0.16 ms
together (hue 0.07), blur 0.15 / 0.21 / 0.36 ms at sigma 0.5 / 1 / 2, libffcv's resize ~0.67 ms (the
largest share; torchvision's antialiased bilinear takes the same, bicubic 1.0 ms); normalising a
32-image relicv2 batch 9 ms into a reused buffer, 41 ms into fresh memory. What got it there, from
204 img/s: vectorised load/store (0.18 -> 0.04 ms per view), reused output buffers
(`ReusedBuffers`), samples handed to FFCV's two threads one at a time instead of in two fixed halves
(CPU use 1.80 -> 1.95 of 2 cores), hue and blur rewritten as vectorisable loops. Before the compiled
path (colour ops as CPU torch ops) ffcv was slower than the baseline.

Deviations:
- crops are resized by libffcv's `resize` (OpenCV INTER_AREA) whatever the recipe's `interpolation`
  says (libffcv exposes no other filter; relicv2 asks for bicubic);
- compiled path: the Gaussian window is truncated at radius min(kernel_px // 2, ceil(4 sigma)) and
  renormalised (< 0.02 of a uint8 level), and each view is rounded to uint8 before normalisation;
  views agree with `torch_backend`'s ops within one uint8 level (tests/pipelines/test_ffcv_backend.py);
- the two paths draw from different generators (a counter hash in the compiled path, a host
  `torch.Generator` on other devices), so a CPU and a GPU run see different, equally distributed,
  parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from pipelines import augment, schema, torch_backend
from pipelines.batch import Batch, ReusedBuffers, normalize
from pipelines.loader import LoaderSpec
from pipelines.views import Recipe, ViewGroup

_PARAM_BYTES = 8                 # per view: y0, x0, h, w as little-endian uint16 (FFCV sides < 65536)
_CROP_TRIES = 10                 # torchvision's RandomResizedCrop tries before the centre-crop fallback


class FFCVBackendError(ValueError):
    """A dataset, recipe or spec the FFCV backend cannot use, with the fix in the message."""


@dataclass(frozen=True)
class CropLayout:
    """Where each view lives in the flat per-sample row `DecodeViews` writes.

    Views are numbered over the crop groups (groups without a parent) in recipe order; with compiled
    ops (`staged` set, CPU loaders) the staged groups' views follow them, and a block of drawn per-view
    parameters (`pipelines.ffcv_ops.PARAM_FIELDS`, float32) follows the crop windows.
    """

    groups: tuple[ViewGroup, ...]     # crop groups, recipe order
    first_view: tuple[int, ...]       # per group: number of its first view
    offsets: tuple[int, ...]          # per view (crop, then staged): byte offset of its (S, S, 3) pixels
    sizes: tuple[int, ...]            # per view: S
    params_offset: int                # byte offset of the (crop views, 4) uint16 windows
    row_bytes: int
    staged: tuple[ViewGroup, ...] = ()        # staged groups written by the compiled ops, recipe order
    staged_first_view: tuple[int, ...] = ()   # per staged group: number of its first view
    colour_offset: int = -1                   # byte offset of the (views, N_PARAMS) float32 parameters

    @staticmethod
    def of(recipe: Recipe, compiled_ops: bool = False) -> "CropLayout":
        groups = tuple(g for g in recipe.groups if g.parent is None)
        staged = tuple(g for g in recipe.groups if g.parent is not None) if compiled_ops else ()
        first, offsets, sizes, pos = [], [], [], 0
        for g in groups + staged:
            first.append(len(offsets))
            for _ in range(g.count):
                offsets.append(pos)
                sizes.append(g.size_px)
                pos += g.size_px * g.size_px * 3
        n_crop = sum(g.count for g in groups)
        windows_end = pos + _PARAM_BYTES * n_crop
        if not compiled_ops:
            return CropLayout(groups, tuple(first[:len(groups)]), tuple(offsets[:n_crop]),
                              tuple(sizes[:n_crop]), pos, windows_end)
        from pipelines.ffcv_ops import PARAM_BYTES

        return CropLayout(groups, tuple(first[:len(groups)]), tuple(offsets), tuple(sizes), pos,
                          windows_end + PARAM_BYTES * len(offsets), staged, tuple(first[len(groups):]),
                          windows_end)

    @property
    def num_views(self) -> int:
        """Crop views (the ones with a window)."""
        return sum(g.count for g in self.groups)

    @property
    def all_groups(self) -> tuple[ViewGroup, ...]:
        """Crop groups, then the staged groups of the compiled ops (view-number order)."""
        return self.groups + self.staged

    @property
    def all_first_views(self) -> tuple[int, ...]:
        return self.first_view + self.staged_first_view

    def split(self, rows: Tensor) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
        """Cut a (B, row_bytes) uint8 batch into per-group views, crop windows and drawn parameters.

        Returns:
            ({group name: (count, B, 3, S, S) uint8}, (crop views, B, 4) int64 windows (y0, x0, h, w),
            (views, B, N_PARAMS) float32 parameters, or None without compiled ops).
        """
        b = rows.shape[0]
        views = {}
        for g, v0 in zip(self.all_groups, self.all_first_views):
            s = g.size_px
            start = self.offsets[v0]
            block = rows[:, start:start + g.count * s * s * 3]
            block = block.reshape(b, g.count, s, s, 3)                     # (B, count, S, S, 3)
            views[g.name] = block.permute(1, 0, 4, 2, 3)                     # (count, B, 3, S, S)
        end = self.params_offset + _PARAM_BYTES * self.num_views
        p = rows[:, self.params_offset:end].reshape(b, self.num_views, 4, 2).long()  # (B, V, 4, 2) bytes
        windows = (p[..., 0] | (p[..., 1] << 8)).permute(1, 0, 2)            # (V, B, 4)
        params = None
        if self.colour_offset >= 0:
            from pipelines.ffcv_ops import N_PARAMS

            n = len(self.offsets)
            raw = rows[:, self.colour_offset:self.colour_offset + 4 * N_PARAMS * n].clone()  # aligned copy
            params = raw.view(torch.float32).reshape(b, n, N_PARAMS).permute(1, 0, 2)  # (V, B, N_PARAMS)
        return views, windows, params


@functools.lru_cache(maxsize=None)
def _ffcv_ops():
    """Define the FFCV operations (FFCV and numba are imported lazily, on first use)."""
    import numba
    from ffcv.fields.rgb_image import IMAGE_MODES
    from ffcv.libffcv import ctypes_imdecode, ctypes_memcopy, ctypes_resize
    from ffcv.pipeline.allocation_query import AllocationQuery
    from ffcv.pipeline.compiler import Compiler
    from ffcv.pipeline.operation import Operation

    from pipelines import ffcv_ops

    jpg = IMAGE_MODES["jpg"]
    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    golden = np.uint64(0x9E3779B97F4A7C15)
    s11, s27, s30, s31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)

    def compiled_helpers():
        """A fresh numba dispatcher for one pipeline (sharing dispatchers between FFCV's epoch threads
        raced in numba's type inference when two loaders compiled at once)."""

        def mix64(z):
            """splitmix64's finaliser: a bijective scramble of a 64-bit word."""
            z = (z ^ (z >> s30)) * m1
            z = (z ^ (z >> s27)) * m2
            return z ^ (z >> s31)

        mix64_c = Compiler.compile(mix64)

        def uniform(k0, k1, sample, view, draw):
            """U[0, 1) from the counter (key, sample, view, draw); 53 random bits."""
            z = mix64_c(k0 + np.uint64(sample) * golden)
            z = mix64_c(z ^ (k1 + np.uint64(view * 64 + draw) * golden))
            return np.float64(z >> s11) * (1.0 / 9007199254740992.0)

        return Compiler.compile(uniform)

    class DecodeFull(Operation):
        """Decode whole images into rows of max_h * max_w * 3 bytes (variable sizes allowed)."""

        def declare_state_and_memory(self, previous_state):
            n = int(self.metadata["width"].max()) * int(self.metadata["height"].max()) * 3
            return (replace(previous_state, jit_mode=True, shape=(n,), dtype=np.dtype("u1")),
                    AllocationQuery((n,), np.dtype("u1")))

        def generate_code(self):
            mem_read = self.memory_read
            my_range = Compiler.get_iterator()
            memcpy = ctypes_memcopy

            def decode(batch_indices, destination, metadata, storage_state):
                for dst_ix in my_range(len(batch_indices)):
                    field = metadata[batch_indices[dst_ix]]
                    data = mem_read(field["data_ptr"], storage_state)
                    height, width = field["height"], field["width"]
                    dst = destination[dst_ix]
                    if field["mode"] == jpg:
                        # libffcv's turbojpeg decode, called through ctypes directly.
                        ctypes_imdecode(data.ctypes.data, data.size, height, width, dst.ctypes.data,
                                        height, width, 0, 0, 1, 1, False, False)
                    else:
                        memcpy(data.ctypes.data, dst.ctypes.data, data.size)
                return destination[:len(batch_indices)]

            decode.is_parallel = True
            return decode

    class DecodeViews(Operation):
        """Decode each image once and write all the recipe's crops into one row (see `CropLayout`)."""

        def __init__(self, layout: CropLayout, key: np.ndarray) -> None:
            super().__init__()
            self.layout = layout
            self.key = key            # (2,) uint64, updated in place per epoch; read through its address

        def declare_state_and_memory(self, previous_state):
            n = int(self.metadata["width"].max()) * int(self.metadata["height"].max()) * 3
            row = (self.layout.row_bytes,)
            return (replace(previous_state, jit_mode=True, shape=row, dtype=np.dtype("u1")),
                    (AllocationQuery(row, np.dtype("u1")), AllocationQuery((n,), np.dtype("u1"))))

        def generate_code(self):
            lay = self.layout
            mem_read = self.memory_read
            my_range = Compiler.get_iterator()
            uniform_c = compiled_helpers()
            memcpy, resize = ctypes_memcopy, ctypes_resize
            set_chunksize = numba.set_parallel_chunksize
            key_address = np.uint64(self.key.ctypes.data)
            n_views = lay.num_views
            view_group = np.repeat(np.arange(len(lay.groups)), [g.count for g in lay.groups])
            offsets = np.array(lay.offsets, np.int64)
            sizes = np.array(lay.sizes, np.int64)
            crop_p = np.array([g.crop_p for g in lay.groups], np.float64)
            area = np.array([g.area for g in lay.groups], np.float64)                # (G, 2)
            log_ratio = np.log(np.array([g.ratio for g in lay.groups], np.float64))  # (G, 2)
            params_offset = lay.params_offset
            tries = _CROP_TRIES
            # Compiled per-view ops (CPU loaders): group laws, and each staged view's parent view.
            with_ops = lay.colour_offset >= 0
            ops = ffcv_ops.compiled()
            finish_view, finish_staged = ops.finish_view, ops.finish_staged
            all_groups = lay.all_groups
            laws = ffcv_ops.group_table(all_groups)                                   # (G_all, F)
            law_bytes = laws.shape[1] * 8
            all_view_group = np.repeat(np.arange(len(all_groups)), [g.count for g in all_groups])
            by_name = {g.name: v0 for g, v0 in zip(all_groups, lay.all_first_views)}
            staged_parent = np.array([by_name[g.parent] + k for g in lay.staged for k in range(g.count)]
                                     + [-1], np.int64)                                # (staged views + 1,)
            n_staged = len(staged_parent) - 1
            colour_offset = lay.colour_offset
            n_draws, first_draw, param_bytes = ffcv_ops.N_PARAMS, ffcv_ops.FIRST_DRAW, ffcv_ops.PARAM_BYTES
            side = max(lay.sizes) if with_ops else 0
            scratch = 3 * side * side                            # float32 scratch of one view
            pad_len = 3 * (3 * side + 2)                         # one padded row: the blur radius <= side + 1

            def decode(batch_indices, my_storage, metadata, storage_state):
                destination, temp_storage = my_storage
                # Samples go to FFCV's threads one at a time: their cost varies with the crop sizes
                # and the drawn ops, and two fixed halves of the batch left a core idle ~10 % of
                # the time (CPU use 1.80 -> 1.95 of 2 cores on relicv2).
                chunk = set_chunksize(1)
                for dst_ix in my_range(len(batch_indices)):
                    sample = batch_indices[dst_ix]
                    field = metadata[sample]
                    data = mem_read(field["data_ptr"], storage_state)
                    height, width = field["height"], field["width"]
                    if field["mode"] == jpg:
                        # libffcv's turbojpeg decode, called through ctypes directly.
                        ctypes_imdecode(data.ctypes.data, data.size, height, width,
                                        temp_storage[dst_ix].ctypes.data, height, width, 0, 0, 1, 1, False, False)
                        img = temp_storage[dst_ix][:3 * height * width].reshape(height, width, 3)
                    else:
                        img = data.reshape(height, width, 3)
                    key = np.empty(2, np.uint64)
                    memcpy(key_address, key.ctypes.data, 16)
                    out = destination[dst_ix]
                    u = np.empty(n_draws, np.float64)
                    buf = np.empty(scratch, np.float32)
                    child = np.empty(scratch, np.float32)
                    tmp = np.empty(scratch, np.float32)
                    pad = np.empty(pad_len, np.float32)
                    for v in range(n_views):
                        g = view_group[v]
                        y0, x0, h, w = 0, 0, height, width
                        if uniform_c(key[0], key[1], sample, v, 0) < crop_p[g]:
                            # torchvision RandomResizedCrop.get_params: area ~ U(area) * H * W,
                            # log(w / h) ~ U(log ratio); 10 tries, then the centre crop below.
                            found = False
                            for t in range(tries):
                                a = area[g, 0] + (area[g, 1] - area[g, 0]) * uniform_c(key[0], key[1], sample, v, 1 + 4 * t)
                                lr = log_ratio[g, 0] + (log_ratio[g, 1] - log_ratio[g, 0]) * uniform_c(key[0], key[1], sample, v, 2 + 4 * t)
                                target = a * height * width
                                aspect = np.exp(lr)
                                cw = int(np.round(np.sqrt(target * aspect)))
                                ch = int(np.round(np.sqrt(target / aspect)))
                                if 0 < cw <= width and 0 < ch <= height:
                                    y0 = int(uniform_c(key[0], key[1], sample, v, 3 + 4 * t) * (height - ch + 1))
                                    x0 = int(uniform_c(key[0], key[1], sample, v, 4 + 4 * t) * (width - cw + 1))
                                    h, w = ch, cw
                                    found = True
                                    break
                            if not found:
                                in_ratio = width / height
                                if in_ratio < np.exp(log_ratio[g, 0]):
                                    w = width
                                    h = int(np.round(w / np.exp(log_ratio[g, 0])))
                                elif in_ratio > np.exp(log_ratio[g, 1]):
                                    h = height
                                    w = int(np.round(h * np.exp(log_ratio[g, 1])))
                                y0 = (height - h) // 2
                                x0 = (width - w) // 2
                        s = sizes[v]
                        resize(0, img.ctypes.data, height, width, y0, y0 + h, x0, x0 + w,
                               out.ctypes.data + offsets[v], s, s)
                        p8 = params_offset + 8 * v
                        out[p8], out[p8 + 1] = y0 & 255, y0 >> 8
                        out[p8 + 2], out[p8 + 3] = x0 & 255, x0 >> 8
                        out[p8 + 4], out[p8 + 5] = h & 255, h >> 8
                        out[p8 + 6], out[p8 + 7] = w & 255, w >> 8
                        if not with_ops:
                            continue
                        # The view's own ops on its crop, in place, then each staged view on the
                        # finished float crop (one crop, two outputs); the parameters go into the row.
                        for d in range(n_draws):
                            u[d] = uniform_c(key[0], key[1], sample, v, first_draw + d)
                        has_child = False
                        for k in range(n_staged):
                            if staged_parent[k] == v:
                                has_child = True
                        row = out.ctypes.data
                        finish_view(row + offsets[v], s, u.ctypes.data, laws.ctypes.data + law_bytes * g,
                                    row + colour_offset + param_bytes * v, buf.ctypes.data, tmp.ctypes.data,
                                    pad.ctypes.data, 1 if has_child else 0)
                        for k in range(n_staged):
                            if staged_parent[k] != v:
                                continue
                            sv = n_views + k
                            for d in range(n_draws):
                                u[d] = uniform_c(key[0], key[1], sample, sv, first_draw + d)
                            finish_staged(buf.ctypes.data, s, u.ctypes.data,
                                          laws.ctypes.data + law_bytes * all_view_group[sv],
                                          row + colour_offset + param_bytes * sv, row + offsets[sv],
                                          child.ctypes.data, tmp.ctypes.data, pad.ctypes.data)
                set_chunksize(chunk)
                return destination[:len(batch_indices)]

            decode.is_parallel = True
            return decode

    return DecodeFull, DecodeViews


def _ffcv_loader_classes():
    """FFCV's loader pieces, imported lazily."""
    from ffcv.fields.basics import FloatDecoder, IntDecoder
    from ffcv.fields.bytes import BytesDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.pipeline import PipelineSpec
    from ffcv.traversal_order.base import TraversalOrder

    return Loader, OrderOption, PipelineSpec, TraversalOrder, IntDecoder, FloatDecoder, BytesDecoder


def _next_guarded(it) -> tuple | None:
    """`next()` on an FFCV EpochIterator that raises instead of hanging when its thread died.

    FFCV's epoch thread swallows nothing: an exception in the compiled pipeline kills the thread and
    the plain `next()` then waits forever on the output queue.
    """
    import queue

    while True:
        try:
            item = it.output_queue.get(timeout=1.0)
            break
        except queue.Empty:
            if not it.is_alive():
                raise FFCVBackendError("the FFCV pipeline thread died (its traceback is printed above); "
                                       "check the .beton file and the recipe") from None
    if item is None:
        it.close()
        return None
    slot, result = item
    if torch.cuda.is_available():
        torch.cuda.current_stream().wait_stream(it.cuda_streams[slot])
    return result


def _manifest(dataset_dir: Path):
    """The dataset's manifest, verified by `pipelines.schema.read_manifest`."""
    if not hasattr(schema, "read_manifest"):
        raise FFCVBackendError("pipelines.schema.read_manifest is missing; the dataset cannot be verified")
    return schema.read_manifest(dataset_dir)


def _stats(manifest) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) in [0, 1] units from a manifest given as a mapping or an object."""
    get = manifest.get if isinstance(manifest, dict) else (lambda k: getattr(manifest, k, None))
    mean, std = get("mean"), get("std")
    if mean is None or std is None:
        from pipelines.batch import IMAGENET_MEAN, IMAGENET_STD
        return IMAGENET_MEAN, IMAGENET_STD
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def read_records(dataset_dir: str | Path, split: str, *,
                 batch_size: int = 32) -> Iterator[tuple[list[np.ndarray], np.ndarray, np.ndarray]]:
    """Read a split's `.beton` back in index order, for round-trip checks.

    Args:
        dataset_dir: `<root>/<dataset>` with a valid manifest.
        split: "train" or "val".
        batch_size: records per yielded chunk.

    Yields:
        (images, labels, indices): a list of (H, W, 3) uint8 arrays (sizes may differ), and (n,) int64
        labels and indices, in index order.
    """
    dataset_dir = Path(dataset_dir)
    _manifest(dataset_dir)
    yield from read_beton(dataset_dir / f"{split}.beton", batch_size=batch_size)


def read_beton(path: str | Path, *, batch_size: int = 32
               ) -> Iterator[tuple[list[np.ndarray], np.ndarray, np.ndarray]]:
    """`read_records` on one `.beton` file, without the manifest check (see `read_records`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"FFCV file {path} not found; run `python -m preprocess` first")
    Loader, OrderOption, PipelineSpec, _, IntDecoder, _, _ = _ffcv_loader_classes()
    decode_full, _ = _ffcv_ops()
    loader = Loader(str(path), batch_size=batch_size, num_workers=1, order=OrderOption.SEQUENTIAL,
                    drop_last=False, pipelines={
                        schema.IMAGE: PipelineSpec(schema.IMAGE, decoder=decode_full()),
                        schema.LABEL: [IntDecoder()], schema.INDEX: [IntDecoder()],
                        schema.MASK: None, schema.COVERAGE: None})
    meta = loader.reader.metadata[f"f{schema.FFCV_FIELDS.index(schema.IMAGE)}"]
    it = iter(loader)
    while (out := _next_guarded(it)) is not None:
        rows, labels, indices = out
        indices = indices.reshape(-1).astype(np.int64)
        images = [rows[k, :int(meta["height"][i]) * int(meta["width"][i]) * 3]
                  .reshape(int(meta["height"][i]), int(meta["width"][i]), 3).copy()
                  for k, i in enumerate(indices)]
        yield images, labels.reshape(-1).astype(np.int64).copy(), indices.copy()


def read_masks(path: str | Path) -> tuple[list[np.ndarray | None], np.ndarray]:
    """All masks and coverages of a `.beton` file in index order (None where no mask is stored).

    Returns:
        (masks, coverage): (H, W) uint8 arrays or None, and (N,) float64 coverages.
    """
    import cv2

    Loader, OrderOption, _, _, _, FloatDecoder, BytesDecoder = _ffcv_loader_classes()
    loader = Loader(str(path), batch_size=64, num_workers=1, order=OrderOption.SEQUENTIAL,
                    drop_last=False, pipelines={
                        schema.IMAGE: None, schema.LABEL: None, schema.INDEX: None,
                        schema.MASK: [BytesDecoder()], schema.COVERAGE: [FloatDecoder()]})
    masks, cover = [], []
    it = iter(loader)
    while (out := _next_guarded(it)) is not None:
        data, coverage = out
        for k in range(len(coverage)):
            c = float(coverage[k, 0])
            masks.append(None if c == schema.NO_MASK_COVERAGE
                         else cv2.imdecode(data[k], cv2.IMREAD_GRAYSCALE))
            cover.append(c)
    return masks, np.array(cover)


# ----------------------------------------------------------------------------------------------
# Everything after the crops (flip, colour ops, saliency composite, mixes) is torch_backend's public
# ops, so that every backend augments with one implementation.


def _key(*parts: int) -> int:
    """A 63-bit seed mixed from integer parts (seed, rank, epoch, batch, ...)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 % (1 << 64)
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def split_groups(recipe: Recipe) -> tuple[list[ViewGroup], list[ViewGroup], list[ViewGroup]]:
    """(global, local, weak) groups of the `Batch` fields, as every backend sorts them."""
    from pipelines.torchvision_backend import split_groups as shared

    return shared(recipe)


def view_params(q: Tensor) -> augment.ViewParams:
    """The drawn parameters of N views as `augment.ViewParams` (what the compiled ops applied).

    Args:
        q: (N, N_PARAMS) float32, columns `pipelines.ffcv_ops.PARAM_FIELDS`.
    """
    q = q.float()
    return augment.ViewParams(
        flip=q[:, 0] > 0.5, jitter=q[:, 1] > 0.5, factors=q[:, 2:6].clone(), order=q[:, 6:10].long(),
        gray=q[:, 10] > 0.5, blur=q[:, 11] > 0.5, sigma=q[:, 12].clone(), solarize=q[:, 13] > 0.5,
        saliency=q[:, 14] > 0.5, gray_level=q[:, 15].clone())


class FFCVLoader:
    """The FFCV loader of one rank (see the module docstring); follows `pipelines.loader.Loader`."""

    def __init__(self, spec: LoaderSpec, beton: Path, mean: tuple[float, ...], std: tuple[float, ...],
                 compiled_ops: bool | None = None) -> None:
        """Args: compiled_ops: run the per-view pixel ops inside FFCV's pipeline (True) or as torch ops
        on `spec.device` (False); None: compiled exactly on a CPU device (tests force either path)."""
        Loader, OrderOption, PipelineSpec, TraversalOrder, IntDecoder, FloatDecoder, BytesDecoder = \
            _ffcv_loader_classes()
        _, decode_views = _ffcv_ops()
        self.spec, self.mean, self.std = spec, tuple(mean), tuple(std)
        self.device = torch.device(spec.device)
        # On the CPU the per-view pixel ops run compiled inside FFCV's pipeline (see the module
        # docstring). A staged group's parent must then finish inside it too, so a parent that draws
        # saliency (composited in torch afterwards) keeps the torch path.
        parents = {g.parent for g in spec.recipe.groups}
        can_compile = not any(g.saliency_p > 0 for g in spec.recipe.groups if g.name in parents)
        self.compiled_ops = can_compile and (self.device.type == "cpu" if compiled_ops is None else compiled_ops)
        self.layout = CropLayout.of(spec.recipe, compiled_ops=self.compiled_ops)
        self.global_groups, self.local_groups, self.weak_groups = split_groups(spec.recipe)
        large_px = max(g.size_px for g in self.layout.groups)
        self.saliency_groups = {g.name for g in self.layout.groups
                                if g.saliency_p > 0 and g.size_px == large_px}
        self.epoch, self.skip, self._done = 0, 0, 0
        self.key = np.zeros(2, np.uint64)            # read by the compiled decoder through its address
        self.last_windows: dict[str, Tensor] = {}    # group → (count, B, 4) crop windows of the last batch
        self.last_params: dict[str, augment.ViewParams] = {}   # group → drawn parameters (compiled ops)
        self._salient: dict[str, tuple[Tensor, Tensor, Tensor]] = {}  # group → (mask, use, gray level)
        # normalize() of every uint8 level per channel: the compiled path normalises by table lookup.
        levels = torch.arange(256, dtype=torch.uint8).expand(3, 1, 256)                 # (3, 1, 256)
        self._norm_lut = np.ascontiguousarray(normalize(levels, self.mean, self.std).numpy())  # (3, 1, 256)
        self._buffers = ReusedBuffers()              # the compiled path's normalised outputs
        from ffcv.reader import Reader

        reader = Reader(str(beton))
        self._n = int(reader.num_samples)
        has_masks = bool(np.any(reader.metadata[f"f{schema.FFCV_FIELDS.index(schema.COVERAGE)}"] >= 0))
        if not has_masks:
            self.saliency_groups = set()
        if spec.drop_last and self._n < spec.world_size * spec.batch_size:
            raise FFCVBackendError(
                f"{spec.split} split has {self._n} records, fewer than world_size × batch_size = "
                f"{spec.world_size * spec.batch_size}; lower the batch size or use drop_last=False")
        owner = self

        class _RankOrder(TraversalOrder):
            """This rank's records for `owner.epoch`, from batch `owner.skip` on."""

            def __call__(self, loader):          # FFCV calls `order(loader)` on order instances
                TraversalOrder.__init__(self, loader)
                return self

            def sample_order(self, epoch: int):
                return owner._rank_order()[owner.skip * spec.batch_size:]

        self._rank_order_cache: tuple[int, np.ndarray] | None = None
        pipelines = {
            schema.IMAGE: PipelineSpec(schema.IMAGE, decoder=decode_views(self.layout, self.key)),
            schema.LABEL: [IntDecoder()], schema.INDEX: [IntDecoder()],
            schema.MASK: [BytesDecoder()] if self.saliency_groups else None,
            schema.COVERAGE: [FloatDecoder()],
        }
        order = _RankOrder.__new__(_RankOrder)
        # os_cache: the page cache serves every rank on a node from one copy of the file.
        self.loader = Loader(str(beton), batch_size=spec.batch_size, num_workers=max(1, spec.num_workers),
                             os_cache=True, order=order, indices=self._rank_order(), pipelines=pipelines,
                             drop_last=spec.drop_last, batches_ahead=2)
        self._mask_field = schema.MASK in pipelines and pipelines[schema.MASK] is not None

    def _rank_order(self) -> np.ndarray:
        """Dataset indices this rank reads in `self.epoch`, in reading order."""
        if self._rank_order_cache is not None and self._rank_order_cache[0] == self.epoch:
            return self._rank_order_cache[1]
        s, n = self.spec, self._n
        if s.shuffle:
            order = np.random.default_rng(_key(s.seed, self.epoch, 7)).permutation(n)
        else:
            order = np.arange(n)
        if s.drop_last:
            per_rank = n // (s.world_size * s.batch_size) * s.batch_size
            mine = order[s.rank * per_rank:(s.rank + 1) * per_rank]
        else:
            mine = np.array_split(order, s.world_size)[s.rank]
        mine = mine.astype(np.uint64)
        self._rank_order_cache = (self.epoch, mine)
        return mine

    def __len__(self) -> int:
        s = self.spec
        if s.drop_last:
            return self._n // (s.world_size * s.batch_size)
        return -(-len(np.array_split(np.arange(self._n), s.world_size)[s.rank]) // s.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.skip = int(epoch), 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self._done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.skip = int(state["epoch"]), int(state["batches_done"])

    def __iter__(self) -> Iterator[Batch]:
        s = self.spec
        self.key[0] = np.uint64(_key(s.seed, s.rank, self.epoch, 1))
        self.key[1] = np.uint64(_key(s.seed, s.rank, self.epoch, 2))
        self._done = self.skip
        if self._done >= len(self):
            self.skip = 0
            return
        self._stop()
        it = self._epoch_it = iter(self.loader)
        try:
            while (out := _next_guarded(it)) is not None:
                batch = self._to_batch(out, self._done)
                self._done += 1
                yield batch
        finally:
            self._stop()
        self.skip = 0

    def _stop(self) -> None:
        """End FFCV's epoch thread of an abandoned or finished epoch, so that no thread outlives it
        (CPython 3.11's `ast` raised "recursion depth mismatch" when FFCV generated code in one thread
        while an old epoch thread still ran)."""
        it, self._epoch_it = getattr(self, "_epoch_it", None), None
        if it is not None:
            it.close()
            it.join(timeout=10.0)

    def _to_batch(self, out: tuple, step: int) -> Batch:
        s, dev = self.spec, self.device
        rows, labels, indices = out[0], out[1], out[2]
        coverage = out[-1].reshape(-1)
        masks = out[3] if self._mask_field else None
        # The FFCV buffers are reused a few batches later: copy now (host→device copies the data).
        rows_t = torch.from_numpy(rows)
        index = torch.from_numpy(indices.reshape(-1).astype(np.int64))
        views, windows, params = self.layout.split(rows_t)
        self.last_windows = {g.name: windows[v0:v0 + g.count].clone()
                             for g, v0 in zip(self.layout.groups, self.layout.first_view)}
        if self.compiled_ops:
            finished = self._finish_compiled(views, params, masks, coverage)
        else:
            finished = self._finish_torch(views, masks, coverage, step)

        def field(groups: list[ViewGroup]) -> Tensor | None:
            if not groups:
                return None
            if not self.compiled_ops:
                x = torch.cat([finished[g.name] for g in groups])                   # (V, B, 3, S, S)
                return normalize(x, self.mean, self.std)
            return self._normalize_rows(rows, groups)

        global_views = field(self.global_groups)
        mixed = mix_lam = mix_partner = None
        if s.mix.kind != "none":
            mix_gen = torch.Generator().manual_seed(_key(s.seed, s.rank, self.epoch, step, 5))
            as_float = {k: x.to(dev).float().div_(255.0) if x.dtype == torch.uint8 else x
                        for k, x in finished.items()}                                # compiled path: uint8 views
            mixed, mix_lam, mix_partner = self._mix(as_float, mix_gen)
        return Batch(global_views=global_views, local_views=field(self.local_groups),
                     weak_views=field(self.weak_groups), mixed=mixed, mix_lam=mix_lam,
                     mix_partner=mix_partner, index=index.to(dev, non_blocking=True),
                     label=torch.from_numpy(labels.reshape(-1).astype(np.int64)).to(dev, non_blocking=True))

    def _finish_torch(self, views: dict[str, Tensor], masks, coverage: np.ndarray, step: int
                      ) -> dict[str, Tensor]:
        """Flip, colour ops, saliency and staged views with torch_backend's ops on `spec.device`.

        Returns:
            {group name: (V, B, 3, S, S) float in [0, 1]}.
        """
        s, dev = self.spec, self.device
        # All parameters come from one host generator per (seed, rank, epoch, batch), as in torch_backend.
        host_gen = torch.Generator().manual_seed(_key(s.seed, s.rank, self.epoch, step, 4))
        finished: dict[str, Tensor] = {}
        for g in self.layout.groups:
            x = views[g.name].to(dev, non_blocking=True)                          # (V, B, 3, S, S) uint8
            v, b = x.shape[:2]
            x = x.reshape(v * b, *x.shape[2:]).float().div_(255.0)               # (V*B, 3, S, S)
            p = augment.sample_color_params(v * b, g, host_gen)
            sel = torch.nonzero(p.flip).squeeze(1).to(dev)
            x[sel] = x[sel].flip(-1)
            x = augment.apply_color_ops(x, p, g)
            if g.name in self.saliency_groups and masks is not None:
                x = self._saliency(x, g, p, masks, coverage, self.last_windows[g.name])
            finished[g.name] = x.reshape(v, b, *x.shape[1:])                      # (V, B, 3, S, S)
        for g in s.recipe.groups:
            if g.parent is not None:           # staged: the parent's finished view + its own ops
                x = finished[g.parent]
                p = augment.sample_color_params(x.shape[0] * x.shape[1], g, host_gen)
                y = augment.apply_color_ops(x.reshape(-1, *x.shape[2:]), p, g)   # (V*B, 3, S, S)
                finished[g.name] = y.reshape(x.shape)                                  # (V, B, 3, S, S)
        return finished

    def _finish_compiled(self, views: dict[str, Tensor], params: Tensor, masks, coverage: np.ndarray
                         ) -> dict[str, Tensor]:
        """The rows already hold the finished pixels (compiled ops): read the drawn parameters back and
        find the saliency masks that apply (composited by `_normalize_rows`).

        Args:
            views: {group name: (V, B, 3, S, S) uint8}, staged groups included.
            params: (views, B, N_PARAMS) float32 drawn parameters (`pipelines.ffcv_ops.PARAM_FIELDS`).

        Returns:
            {group name: (V, B, 3, S, S) uint8 views of the rows}.
        """
        self.last_params, self._salient = {}, {}
        for g, v0 in zip(self.layout.all_groups, self.layout.all_first_views):
            v, b = views[g.name].shape[:2]
            p = view_params(params[v0:v0 + v].reshape(v * b, -1))
            self.last_params[g.name] = p
            if g.name in self.saliency_groups and masks is not None:
                hit = self._saliency_mask(g, p, masks, coverage, self.last_windows[g.name])
                if hit is not None:
                    self._salient[g.name] = (*hit, p.gray_level)
        return dict(views)

    def _normalize_rows(self, rows: np.ndarray, groups: list[ViewGroup]) -> Tensor:
        """One `Batch` field of the compiled path: the groups' uint8 views straight from the rows,
        normalised in one compiled pass (`ffcv_ops.normalize_views`), then `augment.apply_saliency`
        with the view's gray level, normalised, where `_finish_compiled` found a mask.

        Returns:
            (V, B, 3, S, S) float32 on `spec.device`.
        """
        from pipelines import ffcv_ops

        b, size = rows.shape[0], groups[0].size_px
        out = self._buffers.take((sum(g.count for g in groups), b, 3, size, size))  # (V, B, 3, S, S)
        rows = np.ascontiguousarray(rows)
        ops, lut = ffcv_ops.compiled(), self._norm_lut
        k = 0
        for g in groups:
            v0 = self.layout.all_first_views[self.layout.all_groups.index(g)]
            ops.normalize_views(rows.ctypes.data, rows.shape[1], b, self.layout.offsets[v0], g.count, size,
                                lut.ctypes.data, out[k].data_ptr())
            if g.name in self._salient:
                mask, use, level = self._salient[g.name]
                x = out[k:k + g.count].view(g.count * b, 3, size, size)           # (V*B, 3, S, S)
                gray = normalize(level.view(-1, 1, 1, 1).expand(-1, 3, 1, 1), self.mean, self.std)
                x.copy_(augment.apply_saliency(x, mask, use, gray.view(-1, 3)))
            k += g.count
        return out.to(self.device, non_blocking=True)

    def _saliency(self, x: Tensor, g: ViewGroup, p, masks: np.ndarray, coverage: np.ndarray,
                  windows: Tensor) -> Tensor:
        """RELICv2 App. A.2 background removal on the (flipped, colour-transformed) large crops of `g`:
        `augment.apply_saliency` with the masks of `_saliency_mask`.

        Args:
            x: (V*B, 3, S, S) views in [0, 1]. The rest: see `_saliency_mask`.
        """
        hit = self._saliency_mask(g, p, masks, coverage, windows)
        if hit is None:
            return x
        mask, use = hit
        return augment.apply_saliency(x, mask.to(x.device, non_blocking=True), use, p.gray_level)

    def _saliency_mask(self, g: ViewGroup, p, masks: np.ndarray, coverage: np.ndarray,
                       windows: Tensor) -> tuple[Tensor, Tensor] | None:
        """Which views of `g` lose their background, and their masks.

        A view is masked when its draw `p.saliency` hits and the sample's mask covers >= 5 %; its mask
        is cropped with the view's own window, resized like the image and flipped with the view;
        pixels with mask < 0.5 then take the view's `p.gray_level`. Only the masks of views that are
        hit are decoded.

        Args:
            g: the group. p: `augment.ViewParams` of the group. masks: B encoded masks.
            coverage: (B,) mask coverages. windows: (V, B, 4) crop windows (y0, x0, h, w).

        Returns:
            ((V*B, 1, S, S) float masks on the CPU, (V*B,) bool use), or None when no view is hit.
        """
        import cv2

        count, b = windows.shape[:2]
        cov = torch.from_numpy(np.asarray(coverage, np.float64)).repeat(count)          # (V*B,)
        use = p.saliency & (cov >= augment.SALIENCY_MIN_COVERAGE)
        if not bool(use.any()):
            return None
        size = g.size_px
        mask = torch.ones(count * b, 1, size, size)                                    # (V*B, 1, S, S)
        decoded: dict[int, np.ndarray] = {}
        for n in use.nonzero().squeeze(1).tolist():
            v, i = divmod(n, b)
            if i not in decoded:
                decoded[i] = cv2.imdecode(masks[i], cv2.IMREAD_GRAYSCALE)
            y0, x0, h, w = windows[v, i].tolist()
            crop = cv2.resize(decoded[i][y0:y0 + h, x0:x0 + w], (size, size), interpolation=cv2.INTER_LINEAR)
            m = torch.from_numpy(crop).float().div_(255.0)
            mask[n, 0] = m.flip(-1) if bool(p.flip[n]) else m
        return mask, use

    def _mix(self, finished: dict[str, Tensor], gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """Intra-batch mixes of `spec.mix` (DESIGN §4) by `torch_backend.mix_views`, normalised afterwards.

        Args:
            finished: {group name: (V, B, 3, S, S) views in [0, 1]}. gen: host generator of the batch.

        Returns:
            (mixed (Vm, B, 3, H, W) normalised, lam (Vm, B), partner (Vm, B) long).
        """
        mix = self.spec.mix
        views = torch.cat([finished[g.name] for g in self.global_groups])                # (V, B, 3, H, W)
        image = None
        if mix.kind == "dacl" and mix.source == "image":
            whole = [g for g in self.layout.groups if g.crop_p == 0]
            if not whole:
                raise FFCVBackendError("mix source 'image' needs a recipe group with crop_p: 0 "
                                       "(the whole resized image); add one or use source 'global'")
            image = finished[whole[0].name][0]                                            # (B, 3, H, W)
        try:
            mixed, lam, partner = torch_backend.mix_views(views, mix, gen, image=image)
        except torch_backend.TorchBackendError as e:
            raise FFCVBackendError(str(e)) from None
        return normalize(mixed, self.mean, self.std), lam, partner


def build(spec: LoaderSpec) -> FFCVLoader:
    """Build the FFCV loader for `spec` (see `pipelines.loader.build_loader`).

    Raises:
        FFCVBackendError: bad batch size or rank, or a split too small for one batch per rank.
        FileNotFoundError: the `.beton` file is missing.
    """
    if spec.batch_size < 1 or spec.batch_size % 2:
        raise FFCVBackendError(f"batch_size must be a positive even number, got {spec.batch_size}")
    if not 0 <= spec.rank < spec.world_size:
        raise FFCVBackendError(f"rank {spec.rank} is outside world_size {spec.world_size}")
    if not any(g.parent is None for g in spec.recipe.groups):
        raise FFCVBackendError(f"recipe {spec.recipe.name!r} has no crop group; add a group without parent")
    dataset_dir = Path(spec.root) / spec.dataset
    manifest = _manifest(dataset_dir)
    beton = dataset_dir / f"{spec.split}.beton"
    if not beton.is_file():
        raise FileNotFoundError(f"FFCV file {beton} not found; run `python -m preprocess` first")
    mean, std = _stats(manifest)
    return FFCVLoader(spec, beton, mean, std)
