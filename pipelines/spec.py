"""What a backend is given and what every backend shares, once (`pipelines.loader` picks and builds one):
- `LoaderSpec`, checked once by `check_spec` (one `LoaderError` type for bad input);
- `DatasetInfo`: the manifest, read and verified once, as the typed facts a loader needs;
- `Loader`: what every backend returns;
- `EpochOrder`: which records a rank reads in an epoch, in which batches (per-epoch shuffle, rank
  sharding, skip for a mid-epoch resume) and the loader state-dict schema ({"epoch", "batches_done"}:
  the next batch to read); every loader iterates it (DALI's reads ahead along `EpochOrder.schedule`)
  and inherits `EpochLoader`, which answers len, set_epoch and the state dict from it;
- `derive_seed`: how every per-(rank, epoch, batch) seed is mixed from the spec's seed, and `Stream`,
  the one list of the independent random streams it separates.

Backends import this module, never `pipelines.loader` (which imports them).
"""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Protocol

import numpy as np

from pipelines import schema
from pipelines.batch import Batch
from pipelines.mixing import MixSpec, check_mix
from pipelines.views import Recipe


class LoaderError(ValueError):
    """A loader spec or dataset that cannot be loaded; the message is one line naming the fix."""


@dataclass(frozen=True)
class DecoderHints:
    """Settings of the GPU JPEG decode (DALI's nvJPEG `mixed` decoder); ignored by CPU decoders."""

    # Share of the JPEGs sent to the hardware JPEG decoder (A100, H100, H200); the rest take nvJPEG's
    # hybrid path (Huffman decoding on the CPU's threads, the rest on CUDA cores). All of them: on an
    # H200 with 16 cores, relicv2's 6 views ran at 9,136 img/s with 1.0 against 8,194 with 0.85 and
    # 6,765 with DALI's default 0.65, one view at 18,535 / 18,947 / 14,567 (docs/benchmarks.md, 27
    # Nov 2026): the hybrid path's CPU work competed with the graph's own host work.
    hw_load: float = 1.0
    size_hint_px: int = 0              # image side the decoder preallocates its buffers for (the dataset's max); 0: none


GpuBlur = Literal["gaussian", "filter", "conditional"]   # the DALI GPU graph's blur (`dali_graph.colour_ops`)
GraphDtype = Literal["float32", "uint8"]          # the DALI graph's view outputs (`dali_graph.graph`)
GpuContrast = Literal["device", "host"]           # where the DALI GPU graph makes the contrast offset (`colour_ops`)
GpuTail = Literal["graph", "torch"]               # what finishes the DALI GPU graph's crops (`dali_tail`)


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a backend needs to produce batches for one rank."""

    root: str                          # dataset root folder (`<root>/<dataset>/manifest.json`)
    dataset: str                       # dataset name, e.g. "synthetic"
    split: str                         # "train" | "val"
    recipe: Recipe                     # resolved view recipe (sizes in px, roles)
    batch_size: int                    # per rank, even
    mix: MixSpec = field(default_factory=MixSpec)
    rank: int = 0                      # this process's rank; pipelines never call torch.distributed
    world_size: int = 1
    seed: int = 0                      # base seed; each rank, epoch and batch derives its own
    device: str = "cpu"                # training device the Batch lands on
    num_workers: int = 2               # CPU threads/processes for decoding and augmentation
    shuffle: bool = True               # False: records in index order (evaluation)
    drop_last: bool = True             # False: the last partial batch is kept (evaluation)
    limit: int = 0                     # > 0: only that many records of the split, evenly spread (`EpochOrder`)
    subset: tuple[int, ...] | None = None  # only these records of the split (sorted dataset indices), e.g. labelled ones
    channels_last: bool = False        # views in a channels-last network's memory layout (DALI; others: NCHW)
    gpu_blur: GpuBlur = "gaussian"     # the DALI GPU graph's blur: "gaussian" (DALI's, every sample) | "filter" (`dali_graph`)
                                       # | "conditional" (DALI's, only the samples that drew it, as the CPU graph)
    graph_dtype: GraphDtype = "float32"  # the DALI graph's views: "float32" (normalised in the graph) | "uint8"
                                       # (normalised on the device by `batch.normalize`: a quarter of the bytes)
    gpu_contrast: GpuContrast = "device"  # the DALI GPU graph's contrast offset: made on the device and added after a
                                       # float pass | "host": each view's mean copied back, one uint8 pass
    graph_batches: int = 1             # DALI: training batches one run of the graph makes (its batch: this x the batch)
    gpu_tail: GpuTail = "graph"        # the DALI GPU graph's colour tail, blur, solarize and normalisation: in the
                                       # graph | "torch": its crops out as uint8, finished by batched torch ops
    decoder: DecoderHints = field(default_factory=DecoderHints)


@dataclass(frozen=True)
class DatasetInfo:
    """The facts of one split that loaders need, from the verified manifest."""

    dir: Path                          # `<root>/<dataset>`
    split: str
    count: int                         # records in the split
    mean: tuple[float, float, float]   # per channel, [0, 1] units (train split)
    std: tuple[float, float, float]
    has_masks: bool                    # every record carries a saliency mask

    @classmethod
    def read(cls, root: str | Path, dataset: str, split: str) -> "DatasetInfo":
        """Read and verify the manifest (`schema.read_manifest`) and pick the split.

        Raises:
            schema.DatasetError: a missing, incomplete or damaged dataset.
            LoaderError: the split does not exist.
        """
        d = Path(root) / dataset
        m = schema.read_manifest(d)
        if split not in m.counts:
            raise LoaderError(f"dataset {d} has no split {split!r}; choose one of {', '.join(sorted(m.counts))}")
        return cls(dir=d, split=split, count=int(m.counts[split]), mean=tuple(m.mean), std=tuple(m.std),
                   has_masks=bool(m.has_masks))

    def labels(self) -> np.ndarray:
        """(count,) int64 class labels of the split's records in index order (`schema.NO_LABEL` where a
        record has none), from its record table."""
        from pipelines.shards import ShardReader

        return np.array(ShardReader.open(self.dir / self.split, self.count).labels)

    def names(self) -> list[str]:
        """Each record's source file in index order (`schema.NAMES_NAME`: image folders' datasets).

        Raises:
            schema.DatasetError: a split written without names (a generated dataset, CIFAR, or an image
                folder written before names were recorded), or names that do not match its records.
        """
        path = self.dir / self.split / schema.NAMES_NAME
        try:
            names = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise schema.DatasetError(
                f"dataset {self.dir.name} records no file names for its {self.split} records ({path} is missing: "
                "only image folders written by make preprocess since names were recorded have them); write it "
                "again with make preprocess ... ARGS=--force") from None
        if len(names) != self.count:
            raise schema.DatasetError(f"{path} lists {len(names)} names for {self.count} records; write the dataset "
                                      "again with make preprocess ... ARGS=--force")
        return names

    def reads_masks(self, recipe: Recipe) -> bool:
        """Whether a loader reads the masks: the recipe removes backgrounds and the dataset has masks."""
        return self.has_masks and removes_backgrounds(recipe)


def removes_backgrounds(recipe: Recipe) -> bool:
    return any(g.saliency_p > 0 for g in recipe.groups)


class Loader(Protocol):
    """What every backend returns."""

    def __iter__(self) -> Iterator[Batch]: ...       # the rest of the current epoch
    def __len__(self) -> int: ...                    # batches per epoch on this rank
    def set_epoch(self, epoch: int) -> None: ...     # reshuffle and reseed for `epoch`
    def state_dict(self) -> dict: ...                # {"epoch", "batches_done", ...}: mid-epoch position
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...                     # end its workers and free their memory; iterating builds them again


@enum.unique
class Stream(enum.IntEnum):
    """The loaders' independent random streams: the last part of `derive_seed`, so that a draw added
    to one stream never shifts another."""
    BATCH = 0              # a batch's views and mixes: the reference's draws, DALI's host-drawn parameters
    FFCV_KEY_LO = 1        # the two words of the ffcv kernels' counter-based key, per (seed, rank, epoch)
    FFCV_KEY_HI = 2
    DALI_GRAPH = 3         # the DALI pipeline's own seed (the Binary Mixup masks made in the graph)
    FFCV_MIXES = 4         # the batch mixes the ffcv loader makes after its kernels
    TORCHVISION_MIXES = 5  # the same for the torchvision baseline
    TORCHVISION_VIEWS = 6  # the torchvision baseline's per-sample view draws (with the record index)
    SHUFFLE = 7            # the per-epoch permutation (seed and epoch only: the same on every rank)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integer parts (seed, rank, epoch, batch, `Stream`, ...); distinct
    parts give unrelated seeds (FNV-style multiply, then xor-shift, per part)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 % (1 << 64)
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def rank_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the contiguous block of n items that `rank` takes: n·r/w to n·(r+1)/w."""
    return n * rank // world_size, n * (rank + 1) // world_size


class EpochOrder:
    """The records one rank reads per epoch, in batches, and the loader position.

    Records: the whole split, or `spec.subset` of it, and with `spec.limit` that many of those spread
    evenly (records floor(j · n / limit), j < limit: every part of a split written in class order is
    represented).
    Order: a permutation of them seeded by (seed, epoch), the same on every rank (`shuffle`), or
    index order. Sharding: contiguous blocks of that order, with drop_last an equal number of whole
    batches per rank (n // (world · batch) batches), otherwise `rank_range` of it, the last batch
    possibly short. Resume: `load_state_dict` then iteration skips the batches already done.
    """

    def __init__(self, spec: LoaderSpec, count: int) -> None:
        self.spec = spec
        self.split_count = len(spec.subset) if spec.subset is not None else count   # records to choose from
        self.count = spec.limit if 0 < spec.limit < self.split_count else self.split_count     # records read
        self.epoch = 0
        self.batches_done = 0          # batches of `epoch` already handed out

    @property
    def records(self) -> np.ndarray:
        """(count,) int64 dataset indices read, in index order (made when asked: an order sent to a
        worker process is a few numbers whatever the split's size)."""
        chosen = np.arange(self.count) * self.split_count // self.count
        return chosen if self.spec.subset is None else np.asarray(self.spec.subset, np.int64)[chosen]

    def __len__(self) -> int:
        s = self.spec
        if s.drop_last:
            return self.count // (s.world_size * s.batch_size)
        lo, hi = rank_range(self.count, s.rank, s.world_size)
        return -(-(hi - lo) // s.batch_size)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """(n_rank,) int64 dataset indices this rank reads in `epoch` (default: the current one), in
        reading order."""
        s, n = self.spec, self.count
        epoch = self.epoch if epoch is None else epoch
        order = self.records
        if s.shuffle:
            order = order[np.random.default_rng(derive_seed(s.seed, epoch, Stream.SHUFFLE)).permutation(n)]
        if s.drop_last:
            per_rank = len(self) * s.batch_size
            return order[s.rank * per_rank:(s.rank + 1) * per_rank]
        lo, hi = rank_range(n, s.rank, s.world_size)
        return order[lo:hi]

    def remaining(self) -> list[tuple[int, np.ndarray]]:
        """[(batch number, (≤B,) int64 indices)] of this epoch from `batches_done` on."""
        idx, bs = self.indices(), self.spec.batch_size
        return [(k, idx[k * bs:(k + 1) * bs]) for k in range(self.batches_done, len(self))]

    def batch_seed(self, k: int, stream: Stream = Stream.BATCH, epoch: int | None = None) -> int:
        """The seed of `stream` for batch k of this rank and `epoch` (default: the current one)."""
        s = self.spec
        return derive_seed(s.seed, s.rank, self.epoch if epoch is None else epoch, k, stream)

    def schedule(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, batch number, (≤B,) int64 indices) of every batch from the current position on,
        epoch after epoch, without moving the position: what a loader that reads ahead (DALI's
        prefetch queue) reads next."""
        epoch, first = self.epoch, self.batches_done
        bs = self.spec.batch_size
        while len(self):
            idx = self.indices(epoch)
            for k in range(first, len(self)):
                yield epoch, k, idx[k * bs:(k + 1) * bs]
            epoch, first = epoch + 1, 0

    def after(self, position: tuple[int, int], n: int) -> tuple[int, int]:
        """The position (epoch, batch number) n batches after `position`, across epochs (`schedule`)."""
        done = position[1] + n
        return position[0] + done // len(self), done % len(self)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.batches_done = 0
        self.epoch = int(epoch)

    def advance(self) -> None:
        """Count one batch handed out; after an epoch's last batch the position is the next epoch's
        start, so a state dict taken between any two batches names the next batch to read."""
        self.batches_done += 1
        if self.batches_done >= len(self):
            self.epoch, self.batches_done = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])


class EpochLoader:
    """What every backend's loader shares, once: its `EpochOrder` (`self.order`, set by the backend)
    answers `len`, `set_epoch` and the position (`state_dict`); a backend adds `__iter__` and, where it
    has more state (DALI's pipeline checkpoint), extends the two state methods."""

    order: EpochOrder

    def __len__(self) -> int:
        return len(self.order)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)

    def close(self) -> None:
        """End what the loader started (worker processes, threads, a pipeline) and free its memory; a
        loader with nothing of the kind has nothing to do."""


def check_spec(spec: LoaderSpec, info: DatasetInfo) -> None:
    """The checks every backend needs, done once before a backend is built.

    Raises:
        LoaderError: odd or non-positive batch size, a rank outside the world, a split too small for
            one batch per rank, mixes without full batches, or a bad mix spec.
    """
    if spec.batch_size < 2 or spec.batch_size % 2:
        raise LoaderError(f"batch_size must be a positive even number per rank, got {spec.batch_size}; "
                          "use an even batch size")
    if not 0 <= spec.rank < spec.world_size:
        raise LoaderError(f"rank {spec.rank} is outside [0, world_size={spec.world_size}); pass a valid rank")
    if spec.subset is not None and (len(spec.subset) == 0 or min(spec.subset) < 0 or max(spec.subset) >= info.count
                                    or list(spec.subset) != sorted(set(spec.subset))):
        raise LoaderError(f"subset of split {spec.split!r} must be distinct, sorted record indices in [0, "
                          f"{info.count}); pass them sorted")
    records = len(spec.subset) if spec.subset is not None else info.count
    if spec.drop_last and records < spec.world_size * spec.batch_size:
        raise LoaderError(f"split {spec.split!r} has {records} records{' in its subset' if spec.subset else ''}, too "
                          f"small for one batch of {spec.batch_size} per rank on {spec.world_size} rank(s); lower the "
                          "batch size")
    if spec.mix.kind != "none" and not spec.drop_last:
        raise LoaderError("intra-batch mixes need full batches; use drop_last=True")
    for key, value, t in (("gpu_blur", spec.gpu_blur, GpuBlur), ("graph_dtype", spec.graph_dtype, GraphDtype),
                          ("gpu_contrast", spec.gpu_contrast, GpuContrast), ("gpu_tail", spec.gpu_tail, GpuTail)):
        if value not in typing.get_args(t):
            raise LoaderError(f"{key}={value!r} is not one of {', '.join(typing.get_args(t))}; pick one")
    if isinstance(spec.graph_batches, bool) or not isinstance(spec.graph_batches, int) or spec.graph_batches < 1:
        raise LoaderError(f"graph_batches={spec.graph_batches!r} must be a whole number of training batches, 1 or "
                          "more; use 1 for one batch a run of the graph")
    try:
        check_mix(spec.mix)
    except ValueError as e:
        raise LoaderError(str(e)) from None
