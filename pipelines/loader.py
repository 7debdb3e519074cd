"""The one entry point the trainer uses: `build_loader(backend, spec)` → an iterable of `Batch`.

What a backend is given and shares with the others (`LoaderSpec`, `DatasetInfo`, `EpochOrder`,
seeds) is `pipelines.spec`; this module picks a backend (`auto_backend`) and builds it.

Backends: `torch_backend.py` (plain tensor ops, the reference recipe of `augment.py`),
`torchvision_backend.py` (PIL + torchvision, the measured baseline), `ffcv_backend.py` and
`dali_backend.py`. This module is the only one that imports a backend, lazily, so that a missing
optional package (FFCV, DALI: the project's extras) only matters to the backend that needs it, which
then says so in one line (`not_installed`); a backend imports FFCV or DALI at its top.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import typing
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pipelines import schema
from pipelines.jit import cache_typed_dict_helpers
from pipelines.mixing import with_mix_source
from pipelines.spec import DatasetInfo, Loader, LoaderError, LoaderSpec, check_spec, removes_backgrounds

Backend = Literal["torch", "torchvision", "ffcv", "dali"]
BACKENDS: tuple[str, ...] = typing.get_args(Backend)


# The package each accelerated backend imports, and the extra of the project that installs it
# (`pip install 'viewmill[ffcv]'`): without it that backend alone is unavailable, said in one line.
ACCELERATORS: dict[str, tuple[str, str]] = {"ffcv": ("ffcv", "ffcv"), "dali": ("nvidia.dali", "dali")}


def installed(backend: str) -> bool:
    """Whether the package `backend` needs (`ACCELERATORS`; none for torch and torchvision) can be
    found, without importing it."""
    if backend not in ACCELERATORS:
        return True
    try:
        return importlib.util.find_spec(ACCELERATORS[backend][0]) is not None
    except (ImportError, ValueError):           # an absent parent package, or an import blocked on purpose
        return False


def not_installed(backend: str) -> str:
    """The one line that says `backend`'s package is missing and how to install it."""
    package, extra = ACCELERATORS[backend]
    others = ", ".join(b for b in BACKENDS if b != backend and installed(b))
    return (f"the {backend} backend needs {package}, which is not installed; install it with "
            f"pip install 'viewmill[{extra}]' (a checkout: make install), or read with another backend: {others}")


# `data.backend=auto` on a CPU: the first of these the dataset was written for and this machine
# can import. Order measured by `make bench-data` (docs/measured.md): ffcv ~6x the torchvision baseline on the
# relicv2 and rsa recipes, the torch reference ~0.9x. On a GPU, auto is the GPU-resident DALI graph
# where DALI is installed, else the same order.
CPU_PREFERENCE: tuple[tuple[str, str], ...] = (("ffcv", "ffcv"), ("torch", "dali"))  # (backend, files it reads)
_NOTED: set[Path | str] = set()    # what this process has mentioned: datasets without masks, "dali" missing


def auto_backend(device_type: str, root: str | Path, dataset: str) -> str:
    """The backend `data.backend=auto` means for a training device of `device_type` ("cpu"/"cuda").

    Args:
        device_type: torch device type of the training process.
        root: data root; the dataset's manifest tells which file formats exist.
        dataset: dataset folder name.

    Raises:
        schema.DatasetError: a missing, incomplete or damaged dataset.
    """
    if device_type == "cuda":
        if installed("dali"):
            return "dali"
        if "dali" not in _NOTED:        # once per process
            _NOTED.add("dali")
            print(f"note: {not_installed('dali').split(';')[0]}, so the GPU pipeline is not used; "
                  "pip install 'viewmill[dali]' installs it", file=sys.stderr, flush=True)
    formats = schema.read_manifest(Path(root) / dataset, verify="size").formats
    for backend, files in CPU_PREFERENCE:
        if files in formats and installed(backend):
            return backend
    return "torch"


# The reader workers a loader gets by default (`default_workers`): the cores this process gets (a node's
# cores shared by its processes, one per GPU), and where a backend was measured to do best with fewer,
# that many. DALI on a GPU: 4 (an H100 with 16 cores, relicv2 at batch 256, the process pinned to C
# cores with C workers: 16 cores 8,856-8,968 img/s, 8: 8,888-9,827, 4: 9,848-10,666, 2: 5,523-6,929;
# docs/benchmarks.md). The others decode on the CPU, so their rate grows with the cores they get.
BEST_WORKERS: dict[tuple[str, str], int] = {("dali", "cuda"): 4}


def cores_per_process(local_processes: int = 1) -> int:
    """The CPU cores one of `local_processes` processes on this machine gets: SLURM's
    `--cpus-per-task` where SLURM set it, else this process's CPU affinity shared equally."""
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_processes))


def default_workers(backend: str, device_type: str, local_processes: int = 1) -> int:
    """The reader workers of a loader of `backend` training on `device_type` in one of `local_processes`
    processes on this machine: `cores_per_process`, at most `BEST_WORKERS`' count where one was measured."""
    cores = cores_per_process(local_processes)
    return max(1, min(cores, BEST_WORKERS.get((backend, device_type), cores)))


def build_loader(backend: str, spec: LoaderSpec) -> Loader:
    """Build the loader of `backend` for `spec`: reads the manifest, checks the spec, adds the mix
    source group to the recipe (`mixing.with_mix_source`), then builds the backend.

    Raises:
        LoaderError: unknown backend, a backend whose package is not installed (`not_installed`), or
            bad spec (see `check_spec`).
        schema.DatasetError: a missing, incomplete or damaged dataset.
    """
    if backend not in BACKENDS:
        raise LoaderError(f"unknown pipeline backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not installed(backend):
        raise LoaderError(not_installed(backend))
    info = DatasetInfo.read(spec.root, spec.dataset, spec.split)
    check_spec(spec, info)
    if removes_backgrounds(spec.recipe) and not info.has_masks and spec.rank == 0 and info.dir not in _NOTED:
        # Not an error (the op needs masks, and runs without them as p = 0), but never silent; once
        # per dataset and process (benches build many loaders).
        _NOTED.add(info.dir)
        print(f"note: recipe {spec.recipe.name} removes backgrounds (saliency_p > 0) but dataset "
              f"{spec.dataset} has no saliency masks, so no view is masked; `make saliency "
              f"DATASET={spec.dataset}` computes them", file=sys.stderr, flush=True)
    spec = replace(spec, recipe=with_mix_source(spec.recipe, spec.mix))
    if backend == "ffcv":
        cache_typed_dict_helpers()           # before FFCV's import compiles them (pipelines/jit.py)
    module = importlib.import_module(f"pipelines.{backend}_backend")
    return module.build(spec, info)


def shared_memory_bytes(backend: str, spec: LoaderSpec) -> int:
    """The /dev/shm one loader of `backend` for `spec` fills at most: what its worker processes hand
    their batches through (the backend's `shared_memory_bytes`; 0 for a backend whose workers are
    threads, FFCV's, or that reads in the training process).

    Raises:
        LoaderError, schema.DatasetError: as `build_loader`.
    """
    if backend not in BACKENDS or not installed(backend):
        raise LoaderError(f"unknown pipeline backend {backend!r}; choose one of {', '.join(BACKENDS)}"
                          if backend not in BACKENDS else not_installed(backend))
    info = DatasetInfo.read(spec.root, spec.dataset, spec.split)
    module = importlib.import_module(f"pipelines.{backend}_backend")
    need = getattr(module, "shared_memory_bytes", None)
    return 0 if need is None or spec.num_workers == 0 else need(replace(spec, recipe=with_mix_source(spec.recipe, spec.mix)), info)
