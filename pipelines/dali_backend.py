"""DALI backend: the records of `spec.EpochOrder`'s batches → the graph of `dali_graph` → `Batch`.

One DALI pipeline per loader, built once and fed through one `fn.external_source`: per batch the host
reads the records' encoded images (and the masks of the samples that draw background removal) with
positioned reads (`shards.ShardReader`), takes the images' sizes from their headers, and draws every
parameter with the reference's laws and generator calls (`dali_graph.draw_inputs`, seeded with
`EpochOrder.batch_seed`: a batch's draws are the torch reference's draws for the same batch). Order,
rank sharding, the reshuffle per epoch and the resume position are therefore `EpochOrder`'s, as in every
backend. The pipeline's prefetch queue reads ahead along `EpochOrder.schedule`, across epoch boundaries;
the pipeline is rebuilt only when the position jumps (a resume, a `set_epoch` to another epoch). DALI's
own checkpoint is kept only where the graph draws something itself (DACL's Binary Mixup masks).

Outputs land on the training device without a round trip: each view output is copied with DALI's
`feed_ndarray` straight into the batch tensor (device to device on a GPU, on the current torch stream;
into a reused host buffer, `batch.ReusedBuffers`, on the CPU). Labels, indices, lam and partners are
known on the host and never enter the graph.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import torch
from nvidia.dali import Pipeline, fn, pipeline_def
from nvidia.dali.backend import TensorListGPU
from nvidia.dali.plugin.pytorch import feed_ndarray

from pipelines.augment import saliency_usable
from pipelines.batch import Batch, ReusedBuffers
from pipelines.dali_graph import NO_MASK_PNG, Draws, Outputs, dali_type, draw_inputs, graph, input_specs
from pipelines.shards import ShardReader, image_size, scan_shards
from pipelines.spec import DatasetInfo, EpochLoader, EpochOrder, LoaderSpec, Stream, derive_seed
from pipelines.views import FIELDS

_NO_MASK = np.frombuffer(NO_MASK_PNG, np.uint8)      # the mask of a sample that composites in no view


@dataclass
class _Fed:
    """A batch handed to the pipeline and not yet returned by it."""

    epoch: int
    k: int                                  # batch number in the epoch
    index: np.ndarray                       # (B,) int64 dataset indices
    draws: Draws


def _host(tl) -> np.ndarray | list[np.ndarray]:
    """A debug output on the host: one array, or a list of the samples where their shapes differ."""
    tl = tl.as_cpu() if isinstance(tl, TensorListGPU) else tl
    return tl.as_array() if tl.is_dense_tensor() else [np.array(t) for t in tl]


def _feed(tls: list, dev: torch.device, buffers: ReusedBuffers, channels_last: bool) -> torch.Tensor | None:
    """Copy V view outputs (DALI batches of (3, S, S), or (S, S, 3) channels-last, float32 samples) into
    one (V, B, 3, S, S) tensor on `dev`, one `feed_ndarray` per view: GPU outputs device to device on
    the current stream, CPU outputs into a reused host buffer. Channels-last: a permuted view of a
    (V, B, S, S, 3) tensor, so that each view is a channels-last (B, 3, S, S) tensor without a copy."""
    if not tls:
        return None
    dense = [tl.as_tensor() for tl in tls]                                 # (B, ...) each
    shape = (len(dense), *dense[0].shape())
    on_gpu = isinstance(tls[0], TensorListGPU)
    out = torch.empty(shape, dtype=torch.float32, device=dev) if on_gpu else buffers.take(shape)
    stream = torch.cuda.current_stream(dev) if on_gpu else None
    for v, t in enumerate(dense):
        feed_ndarray(t, out[v], cuda_stream=stream)
    out = out.to(dev, non_blocking=True)
    return out.permute(0, 1, 4, 2, 3) if channels_last else out


class DaliLoader(EpochLoader):
    """The DALI `Loader` of one rank (see `pipelines.spec.Loader`)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo, *, debug: bool = False, gpu_branches: bool = False) -> None:
        self.spec, self.info, self.debug, self.gpu_branches = spec, info, debug, gpu_branches
        records = scan_shards(info.dir / spec.split, info.count)
        self.reader = ShardReader(records)
        self.labels = np.array([r.label for r in records], np.int64)
        self.usable = saliency_usable(torch.tensor([r.coverage for r in records]))
        self.masks = info.reads_masks(spec.recipe)
        self.order = EpochOrder(spec, info.count)
        self.input_names = [name for name, _, _ in input_specs(spec, self.masks)]
        self.draws_in_graph = spec.mix.kind == "dacl" and "binary" in spec.mix.dacl_noises   # a DALI checkpoint matters
        self._buffers = ReusedBuffers()              # CPU device: the views land in reused host memory
        self._pipe, self._pipe_at, self._fields, self._debug_names = None, None, [], []
        self._fed: deque[_Fed] = deque()
        self._schedule: Iterator | None = None
        self._dali_state: bytes | None = None        # DALI checkpoint to build the next pipeline from
        self.last_draws: Draws | None = None         # the draws of the last batch handed out
        self.last_debug: dict[str, np.ndarray] = {}  # debug: the graph's own draws of that batch

    def state_dict(self) -> dict:
        dali = self._dali_state
        if self.draws_in_graph and self._pipe is not None and self._pipe_at == self._position():
            dali = self._pipe.checkpoint()
        return {**super().state_dict(), "dali": dali}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._pipe, self._dali_state = None, state.get("dali")

    def operator_counts(self) -> dict[str, dict[str, int]]:
        """Operators per iteration of this loader's graph, by device ("cpu", "gpu", "mixed"), as defined
        on the CPU (`cpu_graph`) and for a GPU (`gpu_graph`, defined without one)."""
        counts = {}
        for name, device in (("cpu_graph", "cpu"), ("gpu_graph", "cuda")):
            pipe, _ = define_pipeline(replace(self.spec, device=device), self.masks, self.info.mean, self.info.std, None)
            counts[name] = dict(Counter(op.device for op in graph_operators(pipe)[0]))
        return counts

    def _position(self) -> tuple[int, int]:
        return self.order.epoch, self.order.batches_done

    def _next_batch(self, info=None) -> list:
        """The external source's callback: the next batch of the schedule, read and drawn on the host."""
        epoch, k, index = next(self._schedule)
        data = [self.reader.image(int(i)) for i in index]
        hw = torch.tensor([image_size(b) for b in data], dtype=torch.long)             # (B, 2)
        gen = torch.Generator().manual_seed(self.order.batch_seed(k, epoch=epoch))
        draws = draw_inputs(self.spec, hw, self.usable[index], self.masks, gen)
        self._fed.append(_Fed(epoch, k, index, draws))
        fed = [[np.frombuffer(b, np.uint8) for b in data]]
        if self.masks:       # the masks of samples that composite in some view; a 1-px stand-in for the rest
            fed.append([np.frombuffer(self.reader.mask(int(i)), np.uint8) if n else _NO_MASK
                        for i, n in zip(index, draws.reads_mask)])
        return fed + [draws.inputs[name] for name in self.input_names]

    def _pipeline(self):
        """The pipeline, rebuilt when the position it reads next is not the loader's."""
        if self._pipe is not None and self._pipe_at == self._position():
            return self._pipe
        s = self.spec
        device_id = None
        if s.device.startswith("cuda"):
            index = torch.device(s.device).index
            device_id = torch.cuda.current_device() if index is None else index
        ckpt, self._dali_state = (self._dali_state if self.draws_in_graph else None), None
        self._fed.clear()
        self._schedule = self.order.schedule()
        self._pipe, out = define_pipeline(s, self.masks, self.info.mean, self.info.std, device_id, self._next_batch,
                                          debug=self.debug, checkpoint=ckpt, gpu_branches=self.gpu_branches)
        self._pipe.build()
        self._fields, self._debug_names = out.fields, out.debug
        self._pipe_at = self._position()
        return self._pipe

    def __iter__(self) -> Iterator[Batch]:
        o, s = self.order, self.spec
        dev = torch.device(s.device)
        epoch = o.epoch
        while o.epoch == epoch and len(o):
            pipe = self._pipeline()
            # The stream is run()'s positional-only argument: DALI takes a keyword for a pipeline input
            # (and refuses it with prefetching). One call on both devices, so the CPU tests run it too.
            outs = pipe.run(torch.cuda.current_stream(dev) if dev.type == "cuda" else None)
            fed = self._fed.popleft()
            views: dict[str, list] = {}
            for name, tl in zip(self._fields, outs):
                views.setdefault(name, []).append(tl)
            d = fed.draws
            self.last_draws = d
            self.last_debug = {n: _host(tl) for n, tl in zip(self._debug_names, outs[len(self._fields):])}
            fields = {f: _feed(views.get(f, []), dev, self._buffers, s.channels_last)
                      for f in (*FIELDS, "mixed")}
            index = torch.from_numpy(fed.index.astype(np.int64))
            batch = Batch(**fields, index=index.to(dev, non_blocking=True),
                          label=torch.from_numpy(self.labels[fed.index]).to(dev, non_blocking=True),
                          mix_lam=None if d.mix_lam is None else d.mix_lam.to(dev, non_blocking=True),
                          mix_partner=None if d.mix is None else d.mix.partner.long().to(dev, non_blocking=True))
            o.advance()
            self._pipe_at = self._position()
            yield batch


def define_pipeline(spec: LoaderSpec, masks: bool, mean, std, device_id: int | None, source=None, *,
                    debug: bool = False, checkpoint: bytes | None = None,
                    gpu_branches: bool = False) -> tuple[Pipeline, Outputs]:
    """The (unbuilt) DALI pipeline of `spec`: one external source of the encoded images (and masks) and
    the `dali_graph.input_specs` inputs, then `dali_graph.graph`.

    With `device_id=None` a graph of a "cuda" spec is defined (and can be serialised, its operators
    looked up) on a machine without a GPU; only building it needs the device.

    Args:
        masks: the graph reads masks (`DatasetInfo.reads_masks`).
        mean, std: the dataset's statistics. device_id: the GPU, or None.
        source: the external source's callback (None: a graph that is only defined).
        checkpoint: a DALI checkpoint to start from (the in-graph draws' state).
        gpu_branches: a CPU graph takes the GPU graph's branches (`dali_graph.colour_ops`).

    Returns:
        (pipeline, the graph's `Outputs`).
    """
    kinds = [("image", np.uint8, 1)] + ([("mask", np.uint8, 1)] if masks else []) + input_specs(spec, masks)
    seed = derive_seed(spec.seed, spec.rank, Stream.DALI_GRAPH) % (2**31 - 1)
    in_graph = spec.mix.kind == "dacl" and "binary" in spec.mix.dacl_noises
    built: dict = {}

    @pipeline_def(batch_size=spec.batch_size, num_threads=max(1, spec.num_workers), device_id=device_id, seed=seed,
                  prefetch_queue_depth=2, enable_conditionals=True, enable_checkpointing=in_graph,
                  checkpoint=checkpoint)
    def pipe():
        if source is None:         # defined only: one named input per output of the callback
            nodes = [fn.external_source(name=name, dtype=dali_type(t), ndim=n) for name, t, n in kinds]
        else:
            nodes = fn.external_source(source=source, num_outputs=len(kinds), batch=True, batch_info=True,
                                       dtype=[dali_type(t) for _, t, _ in kinds], ndim=[n for _, _, n in kinds])
        out = built["out"] = graph(spec, dict(zip([name for name, _, _ in kinds], nodes)), masks, mean, std,
                                   channels_last=spec.channels_last, debug=debug, seed=seed,
                                   gpu_branches=gpu_branches)
        return tuple(out.nodes)

    p = pipe()
    p._build_graph()           # defines the graph (DALI's own validation), without a device or data
    return p, built["out"]


@dataclass(frozen=True)
class GraphOperator:
    """One operator of a defined pipeline, as DALI serialises it."""

    schema: str                                  # DALI's operator schema, e.g. "Resize", "decoders__Image"
    device: str                                  # "cpu" | "gpu" | "mixed"
    inputs: tuple[tuple[str, bool], ...]         # per input: (device, whether it is an argument input)


def _wire_fields(buf: bytes) -> Iterator[tuple[int, object]]:
    """(field number, value) of a serialised protobuf message: ints for varints, bytes otherwise."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        out = shift = 0
        while True:
            byte = buf[pos]
            pos += 1
            out |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return out

    while pos < len(buf):
        key = varint()
        kind = key & 7
        if kind == 0:
            value = varint()
        elif kind == 2:
            n = varint()
            value, pos = buf[pos:pos + n], pos + n
        else:                                    # fixed 64 (1) or 32 (5) bits
            n = 8 if kind == 1 else 4
            value, pos = buf[pos:pos + n], pos + n
        yield key >> 3, value


def graph_operators(pipe: Pipeline) -> tuple[list[GraphOperator], list[str]]:
    """The operators of a defined pipeline and the device of each of its outputs, read from
    `pipe.serialize()` (DALI's `dali.proto`: PipelineDef.op = 5, .pipe_outputs = 7; OpDef.name = 1,
    .input = 2, .args = 4; InputOutput.device = 2, .is_argument_input = 3; Argument.name = 1,
    .strings = 5), so that the graph can be checked without a device.

    Returns:
        (operators, output devices).
    """
    def io(msg: bytes) -> dict[int, object]:
        return dict(_wire_fields(msg))

    ops, outputs = [], []
    for num, value in _wire_fields(pipe.serialize()):
        if num == 7:
            outputs.append(io(value)[2].decode())
        elif num == 5:
            name, device, inputs = "", "", []
            for f, v in _wire_fields(value):
                if f == 1:
                    name = v.decode()
                elif f == 2:
                    d = io(v)
                    inputs.append((d[2].decode(), bool(d.get(3, 0))))
                elif f == 4:
                    arg = list(_wire_fields(v))
                    if dict(arg).get(1) == b"device":
                        device = next(x for k, x in arg if k == 5).decode()
            ops.append(GraphOperator(name, device, tuple(inputs)))
    return ops, outputs


def build(spec: LoaderSpec, info: DatasetInfo, *, debug: bool = False) -> DaliLoader:
    """The DALI loader of `spec` (called by `pipelines.loader.build_loader`); `spec.device` "cuda[:i]"
    decodes with nvJPEG and runs the ops on that GPU ("cuda": the current device).

    Args:
        debug: also keep the graph's own draws of the last batch in `loader.last_debug`.

    Raises:
        schema.DatasetError: shards or index files missing or not matching the manifest.
    """
    return DaliLoader(spec, info, debug=debug)
