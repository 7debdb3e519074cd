"""FFCV backend: the `.beton` file → decode once → every view of the recipe → `Batch` on the device.

The wiring of FFCV's `Loader`: its traversal order is `pipelines.spec.EpochOrder`'s, its image
field goes through our decode-once multi-crop operation (`ffcv_decode.DecodeViews`), label, index
and coverage through a numpy gather (`Scalars`), masks through FFCV's `BytesDecoder`; FFCV compiles
none of them (`python_stages`: the decoder's kernel is compiled once per machine). After the crops,
two paths, one semantics (the reference order of `augment.finish_views`: flip, saliency composite,
colour jitter in a per-view random order with torchvision's per-op clamping and HSV hue, grayscale,
Gaussian blur, solarize, staged views; then mixes):
- CPU device (`ops`): the per-view ops run compiled inside the decode operation
  (`pipelines.ffcv_ops`), parallel over samples in numba's threads; views that drew saliency are
  finished on the host once their masks are decoded (`ffcv_ops.finish_salient`); each `Batch` field is
  normalised straight from the rows in one compiled pass into reused buffers.
- Other devices: the uint8 crops go to `spec.device` and `augment.finish_views` runs there, batched,
  from one host generator seeded per (seed, rank, epoch, batch).
Either way a mid-epoch resume only skips batches. Mixes: on the compiled path, from the normalised
views into a reused buffer where the mix is affine in the pixels (`_mix_normalized`); otherwise
`pipelines.batch.mix_batch` on `spec.device`.

Deviations:
- crops are resized by libffcv's `resize` (OpenCV INTER_AREA) whatever the recipe's `interpolation`
  says (libffcv exposes no other filter; relicv2 asks for bicubic);
- compiled path: the Gaussian window is truncated at radius min(kernel_px // 2, ceil(4 sigma)) and
  renormalised (< 0.02 of a uint8 level), and each view is rounded to uint8 before normalisation;
  views agree with `augment`'s ops within one uint8 level (tests/pipelines/test_ffcv_backend.py);
  on a dataset without masks no view draws saliency (`ffcv_ops.group_table`);
- the two paths draw from different generators (a counter hash in the compiled path, a host
  `torch.Generator` on other devices), so a CPU and a GPU run see different, equally distributed,
  parameters.
"""

from __future__ import annotations

import queue
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import cv2
import numpy as np
import torch
from ffcv.fields.basics import BasicDecoder
from ffcv.fields.bytes import BytesDecoder
from ffcv.loader import Loader
from ffcv.loader import loader as ffcv_loader_module
from ffcv.memory_managers.os_cache import OSCacheContext, OSCacheManager
from ffcv.pipeline import PipelineSpec
from ffcv.pipeline.compiler import Compiler
from ffcv.traversal_order.base import TraversalOrder
from torch import Tensor

from pipelines import ffcv_ops, schema
from pipelines.augment import ViewParams, draw_color_params, finish_views, saliency_usable
from pipelines.batch import Batch, ReusedBuffers, mix_batch, normalize
from pipelines.mixing import affine_in_pixels, mix_views
from pipelines.ffcv_decode import CropLayout, DecodeViews, Rows
from pipelines.spec import DatasetInfo, EpochLoader, EpochOrder, LoaderError, LoaderSpec, Stream
from pipelines.views import ViewGroup


class _EpochTraversal(TraversalOrder):
    """FFCV's traversal order: the records `EpochOrder` has left in this epoch (FFCV calls
    `order(loader)` on the instance it is given)."""

    def __init__(self, order: EpochOrder) -> None:        # TraversalOrder.__init__ runs in __call__
        self.epoch_order = order

    def __call__(self, loader) -> "_EpochTraversal":
        TraversalOrder.__init__(self, loader)
        return self

    def sample_order(self, epoch: int) -> np.ndarray:
        left = [idx for _, idx in self.epoch_order.remaining()]
        return np.concatenate(left).astype(np.uint64) if left else np.zeros(0, np.uint64)


class LeanOSCacheManager(OSCacheManager):
    """FFCV's OS-cache memory manager without the per-record maps its base class builds: a Python loop
    over every record into a set per record and a dict per allocation (at ImageNet's 1,281,167 records
    13 s and 980 MiB of a rank's memory before the first batch, docs/benchmarks.md). Only FFCV's
    quasi-random order and process cache read those maps; the OS cache reads its allocations through
    `ptrs` and `sizes` (sorted by address, searched), the same arrays as FFCV's."""

    def __init__(self, reader) -> None:           # MemoryManager.__init__ skipped on purpose
        self.reader = reader
        table = reader.alloc_table
        order = np.argsort(table["ptr"])
        self.ptrs, self.sizes = table["ptr"][order], table["size"][order]
        self.context = OSCacheContext(self)


@contextmanager
def lean_memory_manager() -> Iterator[None]:
    """Build an FFCV `Loader` whose OS cache is `LeanOSCacheManager` (FFCV picks its manager by the name in
    its loader module, so the name is swapped while the `Loader` is built)."""
    was = ffcv_loader_module.OSCacheManager
    ffcv_loader_module.OSCacheManager = LeanOSCacheManager
    try:
        yield
    finally:
        ffcv_loader_module.OSCacheManager = was


@contextmanager
def python_stages() -> Iterator[None]:
    """Build an FFCV `Loader` whose pipeline stages stay Python functions.

    FFCV compiles each operation's code and its file reader with numba for every `Loader` (1.5-1.8
    CPU-s on 2 cores, 3.3-3.7 s for a process's first), paid by every process and every loader (a
    run's train and evaluation loaders, each rank, each test). Here every operation does its
    per-batch work in code compiled once: the decoder in `ffcv_decode.decode_rows` (numba's on-disk
    cache), the scalar fields in numpy (`Scalars`), the masks in libffcv's memcpy (FFCV's own
    `BytesDecoder`, a call per sample).
    FFCV's switch is global, so it is set only while the `Loader` is built (where FFCV compiles).
    """
    was = Compiler.is_enabled
    Compiler.set_enabled(False)
    try:
        yield
    finally:
        Compiler.set_enabled(was)


class Scalars(BasicDecoder):
    """FFCV's decoder of a scalar field (int64 or float64), one numpy gather a batch."""

    def __init__(self, dtype: str) -> None:
        super().__init__()
        self.dtype = np.dtype(dtype)

    def generate_code(self):
        def decode(indices, destination, metadata, storage_state):
            destination[:len(indices), 0] = metadata[indices]
            return destination[:len(indices)]

        return decode


def _next_guarded(it) -> tuple | None:
    """`next()` on an FFCV EpochIterator that raises instead of hanging when its thread died.

    FFCV's epoch thread swallows nothing: an exception in the compiled pipeline kills the thread and
    the plain `next()` then waits forever on the output queue.
    """
    while True:
        try:
            item = it.output_queue.get(timeout=1.0)
            break
        except queue.Empty:
            if not it.is_alive():
                raise LoaderError("the FFCV pipeline thread died (its traceback is printed above); "
                                  "check the .beton file and the recipe") from None
    if item is None:
        it.close()
        return None
    slot, result = item
    if torch.cuda.is_available():
        torch.cuda.current_stream().wait_stream(it.cuda_streams[slot])
    return result


@dataclass(frozen=True)
class Decoded:
    """One batch of the FFCV loader with what its views drew (`FFCVLoader.decoded`)."""

    batch: Batch
    windows: dict[str, Tensor]          # crop group -> (count, B, 4) int64 crop windows: y0, x0, h, w in source px
    params: dict[str, ViewParams]       # group -> the parameters its views were finished with (count * B views)


class FFCVLoader(EpochLoader):
    """The FFCV loader of one rank (see the module docstring and `pipelines.spec.Loader`)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo, ops: bool | None = None) -> None:
        """Args: ops: run the per-view pixel ops compiled inside FFCV's pipeline (True) or as torch ops
        on `spec.device` (False); None: compiled exactly on a CPU device (tests force either path)."""
        self.spec, self.info = spec, info
        self.device = torch.device(spec.device)
        self.ops = self.device.type == "cpu" if ops is None else ops
        self.layout = CropLayout.of(spec.recipe, ops=self.ops)
        self.masks = info.reads_masks(spec.recipe)
        self.laws = ffcv_ops.group_table(self.layout.all_groups, saliency=self.masks)     # (G, F) float64
        if self.ops:
            ffcv_ops.compiled()                      # every kernel compiled now, before FFCV's threads
        self.order = EpochOrder(spec, info.count)
        self.key = np.zeros(2, np.uint64)            # read by the compiled decoder through its address
        # normalize() of every uint8 level per channel: the compiled path normalises by table lookup.
        levels = torch.arange(256, dtype=torch.uint8).expand(3, 1, 256)                 # (3, 1, 256)
        self._norm_lut = np.ascontiguousarray(normalize(levels, info.mean, info.std).numpy())  # (3, 1, 256)
        self._buffers = ReusedBuffers()              # the compiled path's normalised outputs
        self._epoch_it = None
        pipelines = {
            schema.IMAGE: PipelineSpec(schema.IMAGE, decoder=DecodeViews(self.layout, self.key, self.laws)),
            **{name: PipelineSpec(name, decoder=Scalars(dtype))
               for name, dtype in ((schema.LABEL, "<i8"), (schema.INDEX, "<i8"), (schema.COVERAGE, "<f8"))},
            schema.MASK: [BytesDecoder()] if self.masks else None,
        }
        # os_cache: the page cache serves every rank on a node from one copy of the file (and the
        # decoder reads it as FFCV's `OSCacheManager` lays it out).
        with python_stages(), lean_memory_manager():
            self.loader = Loader(str(info.dir / f"{spec.split}.beton"), batch_size=spec.batch_size,
                                 num_workers=max(1, spec.num_workers), os_cache=True,
                                 order=_EpochTraversal(self.order), pipelines=pipelines, drop_last=spec.drop_last,
                                 batches_ahead=2)

    def __iter__(self) -> Iterator[Batch]:
        return (d.batch for d in self.decoded())

    def decoded(self) -> Iterator[Decoded]:
        """The batches of this epoch (as `iter`), each with its crop windows and drawn parameters."""
        o = self.order
        if not o.remaining():
            return
        self.key[0] = np.uint64(o.batch_seed(0, Stream.FFCV_KEY_LO))    # per (seed, rank, epoch)
        self.key[1] = np.uint64(o.batch_seed(0, Stream.FFCV_KEY_HI))
        self._stop()
        it = self._epoch_it = iter(self.loader)
        try:
            while (out := _next_guarded(it)) is not None:
                decoded = self._decode(out)
                o.advance()
                yield decoded
        finally:
            self._stop()

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        """End FFCV's epoch thread of an abandoned or finished epoch, so that no thread outlives it
        (CPython 3.11's `ast` raised "recursion depth mismatch" when FFCV generated code in one thread
        while an old epoch thread still ran)."""
        it, self._epoch_it = self._epoch_it, None
        if it is None:
            return
        it.close()
        # FFCV's thread ends an epoch with a put(None) that blocks without a timeout: on the full
        # queue of an abandoned epoch it would wait forever (and each `join(10 s)` for 10 s), so
        # empty the queue until the thread is gone.
        deadline = time.monotonic() + 30.0
        while it.is_alive() and time.monotonic() < deadline:
            try:
                it.output_queue.get(timeout=0.05)
            except queue.Empty:
                pass
        it.join(timeout=1.0)

    def _decode(self, out: tuple) -> Decoded:
        """FFCV's output of one batch (the rows, label, index, masks, coverage) as a `Batch`."""
        s, dev, o = self.spec, self.device, self.order
        rows, labels, indices = out[0], out[1], out[2]
        coverage = torch.from_numpy(np.asarray(out[-1], np.float64).reshape(-1))
        masks = out[3] if self.masks else None
        read = self.layout.read(torch.from_numpy(rows))
        gen = torch.Generator().manual_seed(o.batch_seed(o.batches_done, Stream.FFCV_MIXES))
        views, params = read.views, read.params
        if self.ops:
            if masks is not None:
                self._finish_salient(rows, read, masks, coverage)
            fields = {name: self._normalize_rows(rows, groups) if groups else None
                      for name, groups in s.recipe.fields.items()}
        else:
            params = draw_color_params(s.recipe, coverage.shape[0], gen)
            views = self._finish_torch(views, read.windows, params, masks, coverage)
            fields = {name: normalize(torch.cat([views[g.name] for g in groups]), self.info.mean, self.info.std)
                      if groups else None for name, groups in s.recipe.fields.items()}
        if self.ops and affine_in_pixels(s.mix):
            mixed, lam, partner = self._mix_normalized(rows, fields, gen)
        else:
            mixed, lam, partner = mix_batch(views, s.recipe, s.mix, gen, self.info.mean, self.info.std, dev)
        batch = Batch(**fields, mixed=mixed, mix_lam=lam, mix_partner=partner,
                      index=torch.from_numpy(indices.reshape(-1).astype(np.int64)).to(dev, non_blocking=True),
                      label=torch.from_numpy(labels.reshape(-1).astype(np.int64)).to(dev, non_blocking=True))
        return Decoded(batch, read.windows, params)

    def _mix_normalized(self, rows: np.ndarray, fields: dict[str, Tensor | None], gen: torch.Generator
                        ) -> tuple[Tensor, Tensor, Tensor]:
        """The compiled path's mixes, made from the normalised views into a reused buffer: the mix of
        normalised views is the normalised mix for `mixing.affine_in_pixels` mixes, so a mixed pixel
        costs one pass (byol+sdmp at 224 px: 2.5 ms per image through `mix_batch` before).

        Returns:
            `pipelines.batch.mix_batch`'s (mixed, lam, partner).
        """
        s = self.spec
        if s.mix.source == "global":                       # the sources are the Batch's global views
            src = fields["global_views"]
        else:                                              # the whole image, twice (`mix_source_views`)
            image = next(g for g in s.recipe.groups if g.role == "image")
            src = self._normalize_rows(rows, (image,)).expand(2, -1, -1, -1, -1)
        out = mix_views(src, s.mix, gen, out=self._buffers.take(tuple(src.shape)))
        return out.mixed, out.lam, out.partner

    def _crop_masks(self, g: ViewGroup, windows: Tensor, masks, want: list[tuple[int, int]],
                    flips: Tensor | None) -> dict:
        """{(view, sample): (S, S) float32 mask in [0, 1]} for the views `want` of group g: each
        sample's mask decoded once, cropped with the view's window (`windows`: (count, B, 4), y0, x0, h, w),
        resized like the image (bilinear) and flipped with the view when `flips` (N,) says so."""
        size, b = g.size_px, len(masks)
        decoded: dict[int, np.ndarray] = {}
        out = {}
        for v, i in want:
            if i not in decoded:
                decoded[i] = cv2.imdecode(masks[i], cv2.IMREAD_GRAYSCALE)
            y0, x0, h, w = windows[v, i].tolist()
            m = cv2.resize(decoded[i][y0:y0 + h, x0:x0 + w], (size, size), interpolation=cv2.INTER_LINEAR)
            m = m.astype(np.float32) / 255.0
            out[v, i] = m[:, ::-1] if flips is not None and bool(flips[v * b + i]) else m
        return out

    def _finish_salient(self, rows: np.ndarray, read: Rows, masks, coverage: Tensor) -> None:
        """Compiled path: finish, in the rows, the views the decoder left raw because they drew
        saliency: composite (where the sample's mask passes the gate) then the view's ops.

        Args:
            rows: (B, row_bytes) uint8. read: the rows read back (windows, drawn parameters).
            masks: B encoded masks. coverage: (B,) float64.
        """
        usable = saliency_usable(coverage)
        b = rows.shape[0]
        finish = ffcv_ops.compiled().finish_salient
        for k, g in enumerate(self.layout.groups):
            p = read.params[g.name]
            hits = [(v, i) for v in range(g.count) for i in range(b) if bool(p.saliency[v * b + i])]
            if not hits:
                continue
            v0, s = self.layout.first_view[k], g.size_px
            cropped = self._crop_masks(g, read.windows[g.name], masks, [(v, i) for v, i in hits if bool(usable[i])],
                                       p.flip)
            buf, tmp = np.empty(3 * s * s, np.float32), np.empty(3 * s * s, np.float32)
            pad = np.empty(3 * (3 * s + 2), np.float32)
            no_mask = np.zeros(s * s, np.float32)
            for v, i in hits:
                start = self.layout.offsets[v0 + v]
                crop = rows[i, start:start + 3 * s * s]
                assert crop.flags.c_contiguous
                drawn = np.ascontiguousarray(read.drawn[v0 + v, i].numpy())
                mask = cropped.get((v, i))
                mask = np.ascontiguousarray(mask, np.float32).reshape(-1) if mask is not None else no_mask
                finish(crop.ctypes.data, s, drawn.ctypes.data, self.laws[k].ctypes.data, mask.ctypes.data,
                       int((v, i) in cropped), buf.ctypes.data, tmp.ctypes.data, pad.ctypes.data)

    def _normalize_rows(self, rows: np.ndarray, groups: tuple[ViewGroup, ...]) -> Tensor:
        """One `Batch` field of the compiled path: the groups' uint8 views straight from the rows,
        normalised in one compiled pass (`ffcv_ops.normalize_views`) into a reused buffer.

        Returns:
            (V, B, 3, S, S) float32 on `spec.device`.
        """
        b, size = rows.shape[0], groups[0].size_px
        out = self._buffers.take((sum(g.count for g in groups), b, 3, size, size))  # (V, B, 3, S, S)
        rows = np.ascontiguousarray(rows)
        k = 0
        for g in groups:
            v0 = self.layout.first_view_of(g.name)
            ffcv_ops.compiled().normalize_views(rows.ctypes.data, rows.shape[1], b, self.layout.offsets[v0], g.count,
                                                size, self._norm_lut.ctypes.data, out[k].data_ptr())
            k += g.count
        return out.to(self.device, non_blocking=True)

    def _finish_torch(self, views: dict[str, Tensor], windows: dict[str, Tensor], params: dict[str, ViewParams],
                      masks, coverage: Tensor) -> dict[str, Tensor]:
        """`augment.finish_views` on `spec.device` for the uint8 crops of the rows, with the crops' `windows`
        (for the masks) and the parameters drawn for them (`augment.draw_color_params`).

        Returns:
            {group name: (count, B, 3, S, S) float in [0, 1]}.
        """
        dev, b = self.device, coverage.shape[0]
        crops = {g.name: views[g.name].to(dev, non_blocking=True).float().div_(255.0) for g in self.layout.groups}

        def crop_masks(g: ViewGroup, use: Tensor) -> Tensor:
            want = [(v, i) for v in range(g.count) for i in range(b) if bool(use[v * b + i])]
            got = self._crop_masks(g, windows[g.name], masks, want, None)
            m = torch.ones(g.count, b, 1, g.size_px, g.size_px)
            for (v, i), mask in got.items():
                m[v, i, 0] = torch.from_numpy(mask)
            return m.to(dev, non_blocking=True)

        return finish_views(crops, saliency_usable(coverage), self.spec.recipe, params,
                            crop_masks if masks is not None else None)


def build(spec: LoaderSpec, info: DatasetInfo) -> FFCVLoader:
    """The FFCV loader of `spec` (called by `pipelines.loader.build_loader`).

    Raises:
        schema.DatasetError: the `.beton` file is missing (the manifest check caught the rest).
    """
    beton = info.dir / f"{spec.split}.beton"
    if not beton.is_file():
        raise schema.DatasetError(f"FFCV file {beton} not found (the dataset was written without ffcv "
                                  "installed?); install it (pip install 'viewmill[ffcv]') and re-run preprocessing with --force")
    return FFCVLoader(spec, info)
