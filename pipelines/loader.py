"""The one entry point the trainer uses: `build_loader(backend, spec)` → an iterable of `Batch`.

Backends live in `torch_backend.py` (plain tensor ops, reference and CPU test backend),
`torchvision_backend.py` (PIL + torchvision, the measured baseline), `ffcv_backend.py` and
`dali_backend.py`. Each is imported lazily, so that a missing optional package only matters to the
backend that needs it.
"""

from __future__ import annotations

import importlib
import typing
from dataclasses import dataclass
from typing import Iterator, Literal, Protocol

from pipelines.batch import Batch
from pipelines.mixing import MIX_KINDS, MixSpec  # noqa: F401  (MIX_KINDS: re-exported)
from pipelines.views import Recipe

Backend = Literal["torch", "torchvision", "ffcv", "dali"]
BACKENDS: tuple[str, ...] = typing.get_args(Backend)


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a backend needs to produce batches for one rank."""

    root: str                          # dataset root folder (`<root>/<dataset>/manifest.json`)
    dataset: str                       # dataset name, e.g. "synthetic"
    split: str                         # "train" | "val"
    recipe: Recipe                     # resolved view recipe (sizes in px)
    batch_size: int                    # per rank, even
    mix: MixSpec = MixSpec()
    rank: int = 0                      # this process's rank; pipelines never call torch.distributed
    world_size: int = 1
    seed: int = 0                      # base seed; each rank and epoch derives its own
    device: str = "cpu"                # training device the Batch lands on
    num_workers: int = 2               # CPU threads/processes for decoding and augmentation
    shuffle: bool = True               # False: records in index order (evaluation)
    drop_last: bool = True             # False: the last partial batch is kept (evaluation); with
                                       # world_size > 1 ranks then cover disjoint index ranges


class Loader(Protocol):
    """What every backend returns."""

    def __iter__(self) -> Iterator[Batch]: ...       # one epoch, drop-last, equal length per rank
    def __len__(self) -> int: ...                    # batches per epoch on this rank
    def set_epoch(self, epoch: int) -> None: ...     # reshuffle and reseed for `epoch`
    def state_dict(self) -> dict: ...                # position for a mid-epoch resume
    def load_state_dict(self, state: dict) -> None: ...


def build_loader(backend: str, spec: LoaderSpec) -> Loader:
    """Build the loader of `backend` for `spec`.

    Raises:
        ValueError: unknown backend (the message lists the valid ones).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown pipeline backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    module = importlib.import_module(f"pipelines.{backend}_backend")
    return module.build(spec)
