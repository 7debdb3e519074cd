"""DALI backend: the records of `spec.EpochOrder`'s batches → the graph of `dali_graph` → `Batch`.

One DALI pipeline per loader, built once and fed through one parallel `fn.external_source`: per batch
a `BatchSource`, in DALI's Python worker processes, reads the records' encoded images (and the masks
of the samples that draw background removal) with positioned reads (`shards.ShardReader`), takes the
images' sizes from their headers, and draws every parameter with the reference's laws and generator
calls (`dali_graph.draw_inputs`, seeded with `EpochOrder.batch_seed`: a batch's draws are the torch
reference's draws for the same batch). The source is a pure function of the batch's place in the
schedule, (epoch, batch number), computed from the pipeline's start position and DALI's iteration
number (`BatchInfo.iteration`), so any worker may make any batch and a resumed pipeline makes the same
ones. Order, rank sharding, the reshuffle per epoch and the resume position are therefore
`EpochOrder`'s, as in every backend. The pipeline's prefetch queue reads ahead along
`EpochOrder.schedule`, across epoch boundaries; the pipeline is rebuilt only when the position jumps (a
resume, a `set_epoch` to another epoch). DALI's own checkpoint is kept only where the graph draws
something itself (DACL's Binary Mixup masks).

One run of the graph may make several training batches (`LoaderSpec.graph_batches`: its batch that many
times the training batch), each read and drawn as alone, so that the graph's per-operator set-up is
paid once for them all; the loader hands them out one by one, and they are the batches of runs of one
(a mix's partner is moved to its batch's place in the run). A graph that draws itself refuses it: its
state resumes at a run's start only.

The training loop's thread only takes finished batches: the reading and drawing never run there, and
neither do DALI's run (feeding the source's outputs into the pipeline, waiting for the iteration) nor
the copies into the batch, which a taker thread does for the next batch while the loop trains on this
one (`DaliLoader._taker`). Where the graph draws something itself, the taker thread first takes the
DALI checkpoint of the position handed out, which a state dict then names (the pipeline's own would
be one batch ahead). docs/benchmarks.md has the loop's CPU per batch before and after each step.
The workers are forked while CUDA is not
initialised in the process (a test or a CPU run), and forked by a fork server once it is (a GPU run:
DALI refuses to fork then; `worker_start_method`); either way they follow `pipelines.processes`' rules.

With `LoaderSpec.gpu_tail="torch"` the graph hands out its crops as uint8 and the taker thread finishes
them on the training device (`pipelines.dali_tail`: batched torch ops, on a GPU on a CUDA stream of its
own, which the consumer's stream waits for when it takes the batch), with the mixes; the per-pixel draws
of DACL's mixes then come from seeds the source drew, so no DALI checkpoint is kept.

Outputs land on the training device without a round trip: each view output is copied with DALI's
`feed_ndarray` straight into the batch tensor (device to device on a GPU, on the current torch stream;
into a reused host buffer, `batch.ReusedBuffers`, on the CPU). The index, label, lam and partner of the
batch's samples come out of the pipeline beside its views: the source's outputs passed through the
graph (copied to the device on a GPU).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections import Counter
from concurrent.futures import Future, wait
from dataclasses import dataclass, fields as dataclass_fields, replace
from functools import cached_property
from typing import Iterator, NamedTuple

import numpy as np
import torch

# DALI's image decoders (nvImageCodec) load every codec extension they ship when a pipeline is built.
# Log level 1 keeps their log to fatal errors (a decode that fails still raises in Python); a level the
# user set is kept. It does not silence the extensions' own "Failed to load" lines for a codec whose
# library is absent (nvTIFF, nvJPEG2000; measured on an H200, 29 Nov 2026): `pip install
# nvidia-dali-cuda130` brings both libraries (`nvidia-nvimgcodec-cu13[all]`), and then nothing is printed.
os.environ.setdefault("DALI_NVIMGCODEC_LOG_LEVEL", "1")

from nvidia.dali import Pipeline, fn, pipeline_def  # noqa: E402  (after the log level it reads)
from nvidia.dali import backend as dali_backend_lib  # noqa: E402
from nvidia.dali.backend import TensorListGPU  # noqa: E402
from nvidia.dali.plugin.pytorch import feed_ndarray  # noqa: E402

from pipelines.augment import saliency_usable
from pipelines.batch import Batch, ReusedBuffers, channels_last_views, normalize
from pipelines.dali_graph import (NO_MASK_PNG, Draws, Outputs, dali_type, draw_inputs, graph, input_specs, is_partner,
                                  torch_tail)
from pipelines.dali_tail import finish
from pipelines.processes import (end_with_creator, fork_server, forking_workers, leave_signals_to_creator,
                                 proc_stat, running, worker_died)
from pipelines.shards import ShardReader, image_size
from pipelines.spec import DatasetInfo, EpochLoader, EpochOrder, LoaderError, LoaderSpec, Stream, derive_seed
from pipelines.views import FIELDS


def draws_in_graph(spec: LoaderSpec, gpu: bool) -> bool:
    """Whether the graph draws something itself (DACL's Binary Mixup masks and the Gaussian-noise
    baseline's delta, from DALI's random operators), so that a resume needs DALI's checkpoint of it;
    never with the torch tail (`dali_graph.torch_tail`), which makes them from the batch's seeds.
    `gpu`: the GPU graph, or its branches on the CPU."""
    return (spec.mix.kind == "dacl" and bool({"binary", "gaussian"} & set(spec.mix.dacl_noises))
            and not torch_tail(spec, gpu))


def host_workers(spec: LoaderSpec) -> int:
    """DALI Python workers of a loader: a quarter of its CPU threads, 1 to 4 (a batch of 256 ImageNet
    records takes one worker about 24 ms to read and draw on an H200's host: 4 make 40,000 img/s)."""
    return max(1, min(4, spec.num_workers // 4))


# Batches the pipeline keeps ahead (its prefetch queue); its external source keeps `max(2, workers)`.
PIPELINE_PREFETCH = 2
# What a sample's drawn inputs and pass-through outputs add to its encoded files in a source batch, rounded
# up: the `dali_graph.input_specs` of multicrop8 with SDMP's mixes and masks, the most of the presets, are
# 854 bytes a sample (relicv2 575), the ids and lam under 100 more.
INPUTS_BYTES_PER_SAMPLE = 4096
MIN_CHUNK_BYTES = 1 << 20          # DALI's smallest shared-memory chunk (`WorkerPool.from_groups`)


def shared_memory_bytes(spec: LoaderSpec, info: DatasetInfo) -> int:
    """/dev/shm a loader of `spec` fills at most. DALI's parallel external source hands each batch from
    its worker in a shared-memory chunk, and keeps one chunk per batch in the source's and the
    pipeline's prefetch queues; a chunk too small for a batch is grown to twice its size or the batch's,
    so a chunk may reach twice the largest batch (it starts at `MIN_CHUNK_BYTES`). A batch holds its encoded images padded to its
    largest (`_pack_bytes`), likewise its masks, and the drawn inputs: bounded here by the split's
    largest file of each (the record table's sizes)."""
    reader = ShardReader.open(info.dir / spec.split, info.count)
    largest = int(reader.cols[:, 2].max()) + (int(reader.cols[:, 4].max()) if info.reads_masks(spec.recipe) else 0)
    chunks = PIPELINE_PREFETCH + max(2, host_workers(spec))
    samples = spec.batch_size * spec.graph_batches                 # a source batch: one run of the graph
    return chunks * max(MIN_CHUNK_BYTES, 2 * samples * (largest + INPUTS_BYTES_PER_SAMPLE))


def worker_start_method() -> str:
    """How DALI starts a pipeline's workers: "fork" while CUDA is not initialised in this process (a test,
    a CPU run: cheap), else "forkserver" (a GPU run, whose model is on the device before its loader is
    built: DALI refuses to fork then). The fork server is started once per process, by exec, and imports
    torch and DALI once (no CUDA there); it forks every pipeline's workers, where "spawn" would import
    torch again in each worker of each pipeline (3-7 s). It ends when this process ends, and the workers
    with it (`_received`)."""
    if not dali_backend_lib.IsDriverInitialized():
        return "fork"
    fork_server(__name__)          # what the server imports when this process first starts it
    return "forkserver"


def _received(state: dict, creator: int) -> "BatchSource":
    """A `BatchSource` unpickled in a DALI worker started by the fork server, which ends with `creator`,
    the process that built the pipeline (`pipelines.processes`, rule 2; a worker forked from it gets
    that from the at-fork hook). DALI unpickles it with the worker's arguments, before multiprocessing
    knows the worker's parent process: the pid travels with it."""
    if creator != os.getpid():     # a worker (not a copy made here)
        end_with_creator(creator)
        leave_signals_to_creator(creator)  # rule 4 (a forked worker: `forking_workers`), before it reports started
    source = BatchSource.__new__(BatchSource)
    source.__dict__.update(state)
    return source


def _pack_bytes(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Encoded files as one (B, L) uint8 array, each row zero-padded to the longest, and their (B, 1)
    int32 lengths: one output instead of B (the pipeline's feeding costs the training thread ~10 µs a
    sample), cut back to the bytes in the graph (`_unpack`)."""
    lengths = np.array([len(b) for b in items], np.int32)
    out = np.zeros((len(items), int(lengths.max())), np.uint8)
    for row, b in zip(out, items):
        row[:len(b)] = np.frombuffer(b, np.uint8)
    return out, lengths[:, None]


def source_outputs(spec: LoaderSpec, masks: bool, gpu: bool) -> list[tuple[str, np.dtype, int, list[str]]]:
    """The outputs of the external source (`BatchSource`), in order, as (name, dtype, sample ndim,
    members): "image" and "image_bytes" (`_pack_bytes`), "mask" and "mask_bytes" (when the graph reads
    masks), then the `dali_graph.input_specs` inputs grouped by dtype and sample shape (members: the
    inputs stacked along the sample's first axis, one output per group instead of one per input:
    relicv2's 42 inputs are 6 outputs; an input whose samples differ in shape, the blur kernels of
    `gpu_blur="filter"`, an output of its own), then the pass-through outputs "ids" (index, label and, with a
    mix, the partner of each mixed view), with a mix "lam" (of each mixed view), and with the torch tail
    "tail" (`dali_graph.tail_params`) and with a mix "tail_mix" (`dali_tail.tail_mix_draws`). `gpu`: the
    GPU graph's inputs (`dali_graph.draw_inputs`)."""
    out = [("image", np.dtype(np.uint8), 1, []), ("image_bytes", np.dtype(np.int32), 1, [])]
    if masks:
        out += [("mask", np.dtype(np.uint8), 1, []), ("mask_bytes", np.dtype(np.int32), 1, [])]
    groups: dict[tuple, list[str]] = {}
    ragged = []
    for name, dtype, shape in input_specs(spec, masks, gpu):
        if isinstance(shape, int):          # samples of different shapes: an output of its own, a list of arrays
            ragged.append((f"group/{name}", np.dtype(dtype), shape, [name]))
        else:
            groups.setdefault((np.dtype(dtype), shape), []).append(name)
    out += [(f"group/{dtype}" + "".join(f"x{n}" for n in shape), dtype, len(shape) + (len(names) > 1), names)
            for (dtype, shape), names in groups.items()] + ragged
    out.append(("ids", np.dtype(np.int64), 1, []))
    mixed = spec.mix.kind != "none"
    out += [("lam", np.dtype(np.float32), 1, [])] if mixed else []
    if torch_tail(spec, gpu):
        out += [("tail", np.dtype(np.float32), 2, [])] + ([("tail_mix", np.dtype(np.int64), 1, [])] if mixed else [])
    return out


class BatchSource:
    """The parallel external source's callback: batch `BatchInfo.iteration` of a pipeline that starts at
    loader position `start`, read and drawn (module docstring), as the numpy arrays of
    `source_outputs`."""

    def __init__(self, spec: LoaderSpec, reader: ShardReader, masks: bool, gpu: bool, start: tuple[int, int],
                 first_iteration: int = 0) -> None:
        self.spec, self.reader, self.masks = spec, reader, masks
        self.gpu, self.order = gpu, EpochOrder(spec, len(reader))
        self.start, self.first_iteration = start, first_iteration
        self.groups = [members for name, _, _, members in source_outputs(spec, masks, gpu) if name.startswith("group/")]
        self._indices: tuple[int, np.ndarray] | None = None      # the last epoch's order, cached
        self._pid = os.getpid()                                    # the process that made it

    @cached_property
    def usable(self) -> torch.Tensor:
        """(N,) bool: the records whose mask background removal may use (`augment.saliency_usable`),
        made where the source runs (a worker is sent the reader, not N flags)."""
        return saliency_usable(torch.from_numpy(self.reader.coverage))

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "usable"}
        return _received, ({**state, "_indices": None, "_pid": None}, os.getpid())

    def position(self, iteration: int, j: int = 0) -> tuple[int, int]:
        """(epoch, batch number) of the pipeline's iteration `iteration`, or of its training batch j where
        an iteration makes several (`LoaderSpec.graph_batches`), in `EpochOrder.schedule`'s order."""
        return self.order.after(self.start, (iteration - self.first_iteration) * self.spec.graph_batches + j)

    def batch(self, epoch: int, k: int) -> tuple[np.ndarray, list[bytes], Draws]:
        """(index (B,) int64, the encoded images, the draws) of batch k of `epoch`."""
        if self._indices is None or self._indices[0] != epoch:
            self._indices = (epoch, self.order.indices(epoch))
        bs = self.spec.batch_size
        index = self._indices[1][k * bs:(k + 1) * bs]
        data = [self.reader.image(int(i)) for i in index]
        hw = torch.tensor([image_size(b) for b in data], dtype=torch.long)               # (B, 2)
        gen = torch.Generator().manual_seed(self.order.batch_seed(k, epoch=epoch))
        return index, data, draw_inputs(self.spec, hw, self.usable[index], self.masks, gen, self.gpu)

    def __call__(self, info) -> list[np.ndarray]:
        if self._pid != os.getpid():      # a worker: one torch thread (as DataLoader workers; OpenMP after fork)
            torch.set_num_threads(1)
            self._pid = os.getpid()
        # The iteration's training batches one after the other (one, unless `graph_batches` says more),
        # each read and drawn as alone; a mix's partner, an index into the graph's batch, is moved to
        # its training batch's place there (the pass-through partners stay the training batch's own).
        made = [self.batch(*self.position(info.iteration, j)) for j in range(self.spec.graph_batches)]
        index = np.concatenate([m[0] for m in made])
        fed = [*_pack_bytes([b for m in made for b in m[1]])]
        if self.masks:       # the masks of samples that composite in some view; a 1-px stand-in for the rest
            fed += _pack_bytes([self.reader.mask(int(i)) if n else NO_MASK_PNG
                                for i, n in zip(index, np.concatenate([m[2].reads_mask for m in made]))])
        bs = self.spec.batch_size
        inputs = [{n: a + j * bs if is_partner(n) else a for n, a in m[2].inputs.items()} for j, m in enumerate(made)]
        for names in self.groups:
            a = [_rows([d[n] for d in inputs]) for n in names]
            fed.append(np.stack(a, 1) if len(a) > 1 else a[0])                             # (B, n, ...)
        draws = [m[2] for m in made]
        mixed, tail = draws[0].mix is not None, draws[0].tail is not None
        ids = [index[:, None].astype(np.int64), self.reader.labels[index][:, None]]
        if mixed:
            ids.append(np.concatenate([d.mix.partner.T.numpy() for d in draws]).astype(np.int64))   # (B, V)
        passed = [np.concatenate(ids, 1)]                                  # the pass-through outputs, in order
        passed += [np.ascontiguousarray(np.concatenate([d.mix_lam.T.numpy() for d in draws]))] if mixed else []
        passed += [np.concatenate([d.tail for d in draws])] if tail else []   # the torch tail's parameters
        passed += [np.concatenate([d.tail_mix for d in draws])] if tail and mixed else []   # and its mixes' draws
        return fed + passed


def _rows(parts: list) -> np.ndarray | list[np.ndarray]:
    """One input of several training batches, as one: their rows concatenated (a list where the rows
    are arrays of different shapes: `dali_graph.blur_kernels`)."""
    if len(parts) == 1:
        return parts[0]
    return [r for p in parts for r in p] if isinstance(parts[0], list) else np.concatenate(parts)


def _host(tl) -> np.ndarray | list[np.ndarray]:
    """A debug output on the host: one array, or a list of the samples where their shapes differ."""
    tl = tl.as_cpu() if isinstance(tl, TensorListGPU) else tl
    return tl.as_array() if tl.is_dense_tensor() else [np.array(t) for t in tl]


def _tensor(tl, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A dense DALI batch (a pass-through output) as a tensor on `dev` (on the current stream on a GPU)."""
    t = tl.as_tensor()
    on_gpu = isinstance(tl, TensorListGPU)
    out = torch.empty(t.shape(), dtype=dtype, device=dev if on_gpu else "cpu")
    feed_ndarray(t, out, cuda_stream=torch.cuda.current_stream(dev) if on_gpu else None)
    return out.to(dev, non_blocking=True)


def _feed(tls: list, dev: torch.device, buffers: ReusedBuffers, channels_last: bool,
          stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> torch.Tensor | None:
    """Copy V view outputs (DALI batches of (3, S, S), or (S, S, 3) channels-last, float32 samples) into
    one (V, B, 3, S, S) tensor on `dev`, one `feed_ndarray` per view: GPU outputs device to device on
    the current stream, CPU outputs into a reused host buffer. Channels-last: a permuted view of a
    (V, B, S, S, 3) tensor, so that each view is a channels-last (B, 3, S, S) tensor without a copy.
    With `stats` (mean, std) the outputs are uint8 views (`graph_dtype="uint8"`), normalised here on
    `dev` by `batch.normalize` (on the current stream; its result keeps the layout)."""
    if not tls:
        return None
    out = _land(tls, dev, None if stats is not None else buffers)
    out = out.permute(0, 1, 4, 2, 3) if channels_last else out
    return normalize(out, *stats) if stats is not None else out


def _land(tls: list, dev: torch.device, buffers: ReusedBuffers | None = None) -> torch.Tensor:
    """V dense DALI batches of one shape as one (V, B, ...) tensor on `dev`, one `feed_ndarray` each (device
    to device on the current stream on a GPU): float32 into `buffers`' reused host memory on the CPU, or,
    without `buffers`, uint8 into a new tensor."""
    dense = [tl.as_tensor() for tl in tls]                                 # (B, ...) each
    shape = (len(dense), *dense[0].shape())
    on_gpu = isinstance(tls[0], TensorListGPU)
    if buffers is None:
        out = torch.empty(shape, dtype=torch.uint8, device=dev if on_gpu else "cpu")
    else:
        out = torch.empty(shape, dtype=torch.float32, device=dev) if on_gpu else buffers.take(shape)
    stream = torch.cuda.current_stream(dev) if on_gpu else None
    for v, t in enumerate(dense):
        feed_ndarray(t, out[v], cuda_stream=stream)
    return out.to(dev, non_blocking=True)


class _Ahead(NamedTuple):
    """The run of the graph the taker thread makes while the last batches are used (`DaliLoader._ahead`)."""

    position: tuple[int, int]        # (epoch, batch number) of its first training batch
    stream: object                   # the CUDA stream of its copies, or None
    batch: Future                    # [(Batch, debug outputs)], a training batch each (`LoaderSpec.graph_batches`)
    checkpoint: Future | None        # a graph that draws itself: DALI's checkpoint taken before it ran


def _done(future: Future | None):
    """`future`'s result where it has one, else None (not run yet, or failed)."""
    if future is None or not future.done() or future.exception() is not None:
        return None
    return future.result()


WORKER_POLL_S = 1.0     # how often a loader that waits for a batch looks whether its DALI workers live


class Taker:
    """The thread that takes the pipeline's batches (`DaliLoader._take`): runs what it is given, one at
    a time, in order, and hands back futures. A daemon thread rather than a ThreadPoolExecutor's, whose
    threads the interpreter waits for at exit: a taker stuck in DALI's task queue behind a dead worker
    (`DaliLoader._wait`) must not keep the process from ending with its error. The thread holds its
    queue alone, so a loader dropped without `close` is collected, and its taker's thread ends."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_take_from, args=(self._todo,), name="viewmill-dali-taker",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._todo.put, None)

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        self._todo.put((done, fn, args))
        return done

    def shutdown(self) -> None:
        """End the thread once what it was given is done."""
        self._todo.put(None)
        self._thread.join()


def _take_from(todo: queue.SimpleQueue) -> None:
    """The taker thread: each (future, function, arguments) of `todo` run, until None."""
    while (task := todo.get()) is not None:
        done, fn, args = task
        task = None                                 # holds no loader between batches
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn(*args))
            except BaseException as e:              # noqa: BLE001  (handed to the waiting thread)
                done.set_exception(e)
        done = fn = args = None


class DaliLoader(EpochLoader):
    """The DALI `Loader` of one rank (see `pipelines.spec.Loader`)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo, *, debug: bool = False, gpu_branches: bool = False) -> None:
        self.spec, self.info, self.debug, self.gpu_branches = spec, info, debug, gpu_branches
        self.gpu = spec.device.startswith("cuda") or gpu_branches     # the GPU graph's branches and inputs
        self.reader = ShardReader.open(info.dir / spec.split, info.count)
        self.masks = info.reads_masks(spec.recipe)
        self.order = EpochOrder(spec, info.count)
        self.draws_in_graph = draws_in_graph(spec, self.gpu)
        if self.draws_in_graph and spec.graph_batches > 1:
            raise LoaderError(f"graph_batches={spec.graph_batches} with a mix that draws in the graph (DACL's binary "
                              "or Gaussian noise): its draws resume only at a run's start; use graph_batches=1")
        if spec.gpu_tail == "torch" and spec.graph_dtype != "float32":
            raise LoaderError(f"gpu_tail='torch' normalises the views itself, graph_dtype={spec.graph_dtype!r} has "
                              "nothing to do; use graph_dtype=float32")
        self.tail = torch_tail(spec, self.gpu)
        self._tail_stream = None                     # a GPU's torch tail: its own stream (`_run`)
        self._buffers = ReusedBuffers()              # CPU device: the views land in reused host memory
        self._pipe, self._pipe_at, self._out = None, None, Outputs()
        self._source: BatchSource | None = None
        self._iteration = 0                          # DALI's iteration number of the pipeline's next batch
        self._dali_state: tuple[bytes, int] | None = None   # DALI checkpoint (and its iteration) to build from
        self._last: tuple[int, int] | None = None    # (epoch, batch number) of the last batch handed out
        self.last_debug: dict[str, np.ndarray] = {}  # debug: the graph's own draws of that batch
        self._ahead: _Ahead | None = None            # the graph's next run, made by the taker thread
        self._made: list[tuple[Batch, dict]] = []    # the last run's training batches not handed out, the first
        self._made_at: tuple[int, int] | None = None  # at this position
        self._taker: Taker | None = None
        self._workers: list[tuple[int, str]] = []    # (pid, start time) of the pipeline's worker processes
        self._died = False                           # a worker of the pipeline died (`_wait`)

    @property
    def last_draws(self) -> Draws | None:
        """The draws of the last batch handed out, made again here on demand (tests, debugging): the
        source is a pure function of the batch's place, and the training loop never asks for them."""
        if self._last is None:
            return None
        return self._source.batch(*self._last)[2]

    def state_dict(self) -> dict:
        """The loader's position (`EpochLoader`), and where the graph draws itself DALI's checkpoint of it.

        Raises:
            LoaderError: the graph draws itself, a worker of its pipeline died, and DALI's checkpoint taken before
                the run it died in was not there (the loader keeps that one: `_wait`).
        """
        if self.draws_in_graph and self._died:
            raise LoaderError("the DALI graph's own draws were lost with its worker; resume from the last checkpoint")
        dali = self._dali_state
        if self.draws_in_graph and self._ahead is not None and self._ahead.position == self._position():
            dali = self._ahead.checkpoint.result()   # taken before the batch made ahead was run
        elif self.draws_in_graph and self._pipe is not None and self._pipe_at == self._position():
            dali = self._checkpoint()
        return {**super().state_dict(), "dali": dali}

    def _checkpoint(self) -> tuple[bytes, int]:
        """DALI's checkpoint of the pipeline's in-graph draws after the batches it has handed out, and
        its iteration number."""
        return self._pipe.checkpoint(), self._iteration

    def load_state_dict(self, state: dict) -> None:
        self._drop_ahead()
        super().load_state_dict(state)
        self._end_pipe()
        self._dali_state = state.get("dali")

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
        self._iteration = ckpt[1] if ckpt else 0
        self._end_pipe()                      # the old pipeline's workers end before new ones start
        self._died = False
        self._source = BatchSource(s, self.reader, self.masks,
                                   self.gpu, self._position(), self._iteration)
        method = worker_start_method()
        self._pipe, self._out = define_pipeline(s, self.masks, self.info.mean, self.info.std, device_id, self._source,
                                                debug=self.debug, checkpoint=ckpt[0] if ckpt else None,
                                                gpu_branches=self.gpu_branches, start_method=method)
        with forking_workers() if method == "fork" else contextlib.nullcontext():
            self._pipe.build()               # forks the workers: they follow pipelines.processes' rules
        self._workers = [(pid, proc_stat(pid)[1]) for pid in self._pipe._py_pool.pids()]   # DALI's pool
        self._pipe_at = self._position()
        return self._pipe

    def __iter__(self) -> Iterator[Batch]:
        o, s = self.order, self.spec
        dev = torch.device(s.device)
        epoch = o.epoch
        while o.epoch == epoch and len(o):
            stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None   # the consumer's, now
            batch, self.last_debug = self._take(stream)
            self._last = self._position()
            o.advance()
            if self._ahead is None:
                # The graph's next run, made while this batch (and the last run's others) are used;
                # first, where the graph draws itself, the checkpoint that names its position (one
                # thread: it is taken before that run).
                self._pipe_at = self.order.after(self._position(), len(self._made))
                self._taker = self._taker or Taker()
                ckpt = self._taker.submit(self._checkpoint) if self.draws_in_graph else None
                run_on = self._run_stream(stream)
                self._ahead = _Ahead(self._pipe_at, run_on, self._taker.submit(self._run, run_on), ckpt)
            yield batch

    def _take(self, stream) -> tuple[Batch, dict]:
        """The batch at the loader's position: one the last run of the graph made, the first of the run
        the taker thread made ahead, else the first of one it makes now (the first batch, or after the
        position jumped: the pipeline is rebuilt).

        Raises:
            WorkerDiedError: a worker process of the pipeline ended while the loader waited (`_wait`).
        """
        if self._made and self._made_at == self._position():
            self._made_at = self.order.after(self._made_at, 1)
            return self._used_on(self._made.pop(0), stream)
        if self._ahead is not None and self._ahead.position == self._position():
            ahead, self._ahead = self._ahead, None
            made, run_on = self._wait(ahead.batch, ahead.checkpoint), ahead.stream
        else:
            if self._drop_ahead():
                self._pipe_at = None                 # the pipeline made a batch past the position: rebuild
            self._pipeline()
            self._taker = self._taker or Taker()
            run_on = self._run_stream(stream)
            ckpt = self._taker.submit(self._checkpoint) if self.draws_in_graph else None
            made = self._wait(self._taker.submit(self._run, run_on), ckpt)
        if run_on is not None and run_on != stream:
            stream.wait_stream(run_on)     # made on another stream (the torch tail's, or a consumer that changed)
        self._made, self._made_at = made[1:], self.order.after(self._position(), 1)
        return self._used_on(made[0], stream)

    def _run_stream(self, stream):
        """The stream a run of the graph copies (and finishes) its batches on: the consumer's `stream`, or on
        a GPU with the torch tail the tail's own stream, of the default priority (below a training stream
        of the highest, `run.train_stream`), so that the tail's kernels overlap the training step's."""
        if stream is None or not self.tail:
            return stream
        if self._tail_stream is None:
            self._tail_stream = torch.cuda.Stream(stream.device)
        return self._tail_stream

    def _used_on(self, made: tuple[Batch, dict], stream) -> tuple[Batch, dict]:
        """`made` handed to the consumer's `stream`: a batch made on the tail's stream has its memory kept
        from that stream's next allocations until the consumer's work on it is done (`record_stream`)."""
        if stream is not None and self.tail:
            for f in dataclass_fields(made[0]):
                if (x := getattr(made[0], f.name)) is not None:
                    x.record_stream(stream)
        return made

    def _wait(self, made: Future, checkpoint: Future | None) -> list[tuple[Batch, dict]]:
        """`made`'s batches; while they are not there, every `WORKER_POLL_S`, a look whether the pipeline's
        worker processes live. Workaround, DALI 2.4.0 (upstream bug): a worker killed while it waited for a task
        (the OOM killer) leaves DALI's task queue waiting for good for it to wake (its condition's
        `notify`), so the loader would wait for the batch for good instead of failing. Where the graph draws
        itself, `checkpoint` is DALI's checkpoint taken before that run (at the loader's position): after a
        death it is the loader's state (`state_dict`), so that a checkpoint saved then continues the same draws.

        Raises:
            WorkerDiedError: one of them ended; the taker thread, stuck in DALI's queue, is left behind
                (a daemon thread: the process still ends).
        """
        while True:
            try:
                return made.result(timeout=WORKER_POLL_S)
            except (TimeoutError, RuntimeError) as e:       # RuntimeError: DALI saw the death itself
                gone = [pid for pid, since in self._workers if not running(pid, since)]   # or its pid reused
                if not gone:
                    if isinstance(e, TimeoutError):
                        continue
                    raise
                self._taker = self._ahead = None
                self._pipe, self._dali_state = None, _done(checkpoint)   # nothing asks the broken pipeline again
                self._died = self.draws_in_graph and self._dali_state is None
                raise worker_died(f"DALI worker process {gone[0]} of this loader ended") from None

    def close(self) -> None:
        """End the pipeline, its worker processes and shared memory, and the taker thread; the next
        iteration builds them again at the loader's position (from the in-graph draws' state there)."""
        if self.draws_in_graph and not self._died:   # after a death: the state `_wait` kept, or none
            self._dali_state = self.state_dict()["dali"]
        self._drop_ahead()
        self._end_pipe()
        self._pipe_at = None
        if self._taker is not None:
            self._taker.shutdown()
            self._taker = None

    def _end_pipe(self) -> None:
        """Drop the pipeline, its worker processes ended now, as DALI's finalizer ends them when the pipeline
        is collected: an exception that passed through a run keeps the pipeline, through its traceback,
        until the garbage collector finds that cycle (seconds to minutes later). No run may be in flight
        (`_drop_ahead` first)."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None and pipe._py_pool is not None:     # DALI's pool, as `_pipeline` reads its pids
            pipe._py_pool.close()

    def _drop_ahead(self) -> bool:
        """Wait for the taker thread's run and drop it, and the last run's batches not handed out; whether
        there was either."""
        ahead, self._ahead = self._ahead, None
        made, self._made = self._made, []
        if ahead is not None:
            wait([ahead.batch])
        return ahead is not None or bool(made)

    def _run(self, stream) -> list[tuple[Batch, dict]]:
        """One iteration of the pipeline as its training batches (one, or `graph_batches`), each a `Batch`
        on the spec's device (and its debug outputs), the copies on `stream` (the consumer's). Runs on
        the taker thread (`_take`)."""
        s, out = self.spec, self._out
        dev = torch.device(s.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # The stream is run()'s positional-only argument: DALI takes a keyword for a pipeline input
            # (and refuses it with prefetching). One call on both devices, so the CPU tests run it too.
            outs = self._pipe.run(stream)
            self._iteration += 1
            views: dict[str, list] = {}
            for name, tl in zip(out.fields, outs):
                views.setdefault(name, []).append(tl)
            passed = dict(zip(out.passed, outs[len(out.fields):]))
            debug = ({n: _host(tl) for n, tl in zip(out.debug, outs[len(out.fields) + len(out.passed):])}
                     if self.debug else {})
            ids = _tensor(passed["ids"], torch.int64, dev)                   # (B, 2 + V) index, label, partners
            mixed = "lam" in passed
            lam = _tensor(passed["lam"], torch.float32, dev).T.contiguous() if mixed else None      # (V, B)
            partner = ids[:, 2:].T.contiguous() if mixed else None                                 # (V, B)
            if out.tail:          # each crop group's views stacked, finished by batched torch ops (`dali_tail`)
                crops: dict[str, list] = {}
                for tag, tls in views.items():
                    crops.setdefault(tag.rpartition("/")[0], []).extend(tls)
                mixes = (passed["tail_mix"].as_array(), partner, lam, s.batch_size) if mixed else None
                fields = finish({g: _land(tls, dev) for g, tls in crops.items()}, passed["tail"].as_array(),
                                s.recipe, self.info.mean, self.info.std, s.channels_last, s.mix, mixes)
            else:
                stats = (self.info.mean, self.info.std) if s.graph_dtype == "uint8" else None
                fields = {f: _feed(views.get(f, []), dev, self._buffers, s.channels_last, stats)
                          for f in (*FIELDS, "mixed")}
            batch = Batch(**fields, index=ids[:, 0].contiguous(), label=ids[:, 1].contiguous(), mix_lam=lam,
                          mix_partner=partner)
            if s.graph_batches == 1:
                return [(batch, debug)]
            bs = s.batch_size
            return [(_rows_of(batch, j * bs, (j + 1) * bs, s.channels_last),
                     {n: v[j * bs:(j + 1) * bs] for n, v in debug.items()}) for j in range(s.graph_batches)]


def _rows_of(batch: Batch, start: int, stop: int, channels_last: bool) -> Batch:
    """The samples [start, stop) of a graph run's `Batch` as a training batch of its own: every tensor
    copied out contiguous (once, on the batch's device and stream), each view in its memory layout, so
    that a training step gets what a run of one training batch gives it."""
    def part(name: str, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        if name in ("index", "label"):
            return x[start:stop].contiguous()
        if x.ndim == 2:                                                   # mix_lam, mix_partner: (V, B)
            return x[:, start:stop].contiguous()
        return channels_last_views(x[:, start:stop]) if channels_last else x[:, start:stop].contiguous()

    return Batch(**{f.name: part(f.name, getattr(batch, f.name)) for f in dataclass_fields(batch)})


def _unpack(nodes: dict, kinds: list) -> dict:
    """The graph's inputs from the source's outputs (`source_outputs`, `kinds`): the encoded files cut
    back to their bytes, every grouped input taken out of its group. Host routing, on the CPU."""
    inputs = {name: fn.slice(nodes[name], start=[0], shape=nodes[f"{name}_bytes"], axes=[0])
              for name in ("image", "mask") if name in nodes}
    for name, _, _, members in kinds:
        if len(members) == 1:
            inputs[members[0]] = nodes[name]
        for j, member in enumerate(members if len(members) > 1 else []):
            inputs[member] = nodes[name][j]
    return inputs


def define_pipeline(spec: LoaderSpec, masks: bool, mean, std, device_id: int | None, source=None, *,
                    debug: bool = False, checkpoint: bytes | None = None, gpu_branches: bool = False,
                    start_method: str = "fork") -> tuple[Pipeline, Outputs]:
    """The (unbuilt) DALI pipeline of `spec`: one external source (`source_outputs`: the encoded images
    and masks, the `dali_graph.input_specs` inputs, the pass-through outputs), then `dali_graph.graph`,
    then the pass-through outputs (on the graph's device).

    With `device_id=None` a graph of a "cuda" spec is defined (and can be serialised, its operators
    looked up) on a machine without a GPU; only building it needs the device.

    Args:
        masks: the graph reads masks (`DatasetInfo.reads_masks`).
        mean, std: the dataset's statistics. device_id: the GPU, or None.
        source: the external source's callback, run in `host_workers(spec)` DALI worker processes
            (`BatchSource`; None: a graph that is only defined).
        checkpoint: a DALI checkpoint to start from (the in-graph draws' state).
        gpu_branches: a CPU graph takes the GPU graph's branches (`dali_graph.colour_ops`).
        start_method: how DALI starts the workers, "fork" or "spawn" (`worker_start_method()`).

    Returns:
        (pipeline, the graph's `Outputs`).
    """
    gpu = spec.device.startswith("cuda") or gpu_branches
    kinds = source_outputs(spec, masks, gpu)
    seed = derive_seed(spec.seed, spec.rank, Stream.DALI_GRAPH) % (2**31 - 1)
    in_graph = draws_in_graph(spec, gpu)
    workers = host_workers(spec)
    built: dict = {}

    @pipeline_def(batch_size=spec.batch_size * spec.graph_batches, num_threads=max(1, spec.num_workers),
                  device_id=device_id, seed=seed, prefetch_queue_depth=PIPELINE_PREFETCH, enable_conditionals=True,
                  enable_checkpointing=in_graph, checkpoint=checkpoint, py_num_workers=workers,
                  py_start_method=start_method)
    def pipe():
        if source is None:         # defined only: one named input per output of the callback
            nodes = [fn.external_source(name=name, dtype=dali_type(t), ndim=n) for name, t, n, _ in kinds]
        else:
            # batch mode: each batch one task, made by any worker; `workers` batches ahead
            nodes = fn.external_source(source=source, num_outputs=len(kinds), batch=True, batch_info=True,
                                       parallel=True, prefetch_queue_depth=max(2, workers),
                                       dtype=[dali_type(t) for _, t, _, _ in kinds], ndim=[n for _, _, n, _ in kinds])
        nodes = dict(zip([name for name, _, _, _ in kinds], nodes))
        out = built["out"] = graph(spec, _unpack(nodes, kinds), masks, mean, std,
                                   channels_last=spec.channels_last, debug=debug, seed=seed, gpu_branches=gpu_branches)
        passed = [name for name in ("ids", "lam", "tail", "tail_mix") if name in nodes]
        out.passed = passed
        # the tail's draws stay on the host: the loader picks the views that blur there
        on_device = [nodes[n].gpu() if spec.device.startswith("cuda") and not n.startswith("tail") else nodes[n]
                     for n in passed]
        n = len(out.fields)
        return tuple(out.nodes[:n] + on_device + out.nodes[n:])

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
