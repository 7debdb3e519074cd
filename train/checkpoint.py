"""Checkpoints that resume exactly: written atomically, read with `torch.load(weights_only=True)`.

A checkpoint holds only tensors and primitive containers: `online`, `target` and `objective` state
dicts, `optimizer`, `scaler`, `step`, the loader position, the RNG states, the resolved config (as
plain dicts), the random-init evaluation, whether the evaluation of its step is still to run
(`evaluate_first`: a signal stopped it), the git commit and the library versions (`library_versions`,
also the run folder's `versions.json`).

In a run folder the newest checkpoint is always `checkpoint.pt`; with `run.keep_last=N` the N - 1
before it stay as `checkpoint-<step>.pt` (`save_latest`). A write reaches the disk (fsync) before the
rename that publishes it, so neither a killed process nor a lost machine leaves a half-written
checkpoint under a checkpoint's name. `latest` lists a folder's checkpoints newest first, for
`run.resume=auto`. `Cadence` says when a training loop saves: both loops, pretraining's and the
protocols', keep to it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import random
import re
import shutil
import subprocess
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from train import dist


LATEST = "checkpoint.pt"                         # the newest checkpoint of a run folder
HISTORY = re.compile(r"checkpoint-(\d+)\.pt")    # an older one, named by its step (`run.keep_last` > 1)


class CheckpointError(FileNotFoundError):
    """A checkpoint that is missing or unreadable."""


def git_commit() -> str:
    """The commit of the source tree this process runs from ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Version key -> the distributions that provide it, the first one installed wins (DALI ships one per CUDA major).
LIBRARIES = {"viewmill": ("viewmill",), "torch": ("torch",), "torchvision": ("torchvision",), "timm": ("timm",),
             "numpy": ("numpy",), "pillow": ("pillow",), "opencv": ("opencv-python", "opencv-python-headless"),
             "ffcv": ("ffcv",), "dali": ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110"),
             "ray": ("ray",)}


def library_versions() -> dict[str, str | None]:
    """Python, the version of each of `LIBRARIES` (None where it is not installed), and the CUDA and cuDNN
    versions torch uses; read from package metadata (torch's from torch, with its build tag), so nothing
    is imported to find out."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dists in LIBRARIES.items():
        out[key] = None
        for d in dists:
            try:
                out[key] = importlib.metadata.version(d)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    out["torch"] = str(torch.__version__)       # with its build's tag (e.g. +cu130), which the metadata lacks
    out["cuda"] = torch.version.cuda
    out["cudnn"] = str(torch.backends.cudnn.version()) if torch.cuda.is_available() else None
    return out


def rng_state() -> dict:
    """Python, NumPy and torch RNG states as tensors and primitives (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rank_states(loader, alone: bool = False) -> dict:
    """The ranks' part of a checkpoint: every rank's loader position and RNG state, one collective that
    every rank makes (rank 0 then saves); with `alone`, this rank's own and who saved it, for a rank that
    saves by itself (`Cadence.next_batch`; `resume_rank` reads both)."""
    if alone:
        return {"loader": [loader.state_dict()], "rng": [rng_state()], "processes": dist.world_size(),
                "alone": dist.rank()}
    return {"loader": dist.gather_objects(loader.state_dict()), "rng": dist.gather_objects(rng_state())}


def save(path: Path, state: dict) -> Path:
    """Write `state` to `path` atomically and durably: a temp file in the same folder, flushed to the
    disk, then `os.replace`. A kill at any point leaves the old file or the new one, never a mix.

    Args:
        path: destination file; its folder is created.
        state: tensors and primitive containers only.

    Returns:
        `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_durably(path.with_name(f".{path.name}.tmp{os.getpid()}"), state)
    os.replace(tmp, path)                   # atomic: a kill leaves the old file or the new one
    _sync_folder(path.parent)
    return path


class _Writes:
    """A file as `torch.save` writes it, keeping the OSError of a failed write, which torch's zip writer
    replaces with an error of its own ("unexpected pos ..."): a full disk would not say so."""

    def __init__(self, f) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str):           # the rest of a file (flush, truncate, ...) is the file's
        return getattr(self.f, name)


def _write_durably(tmp: Path, state: dict) -> Path:
    """`torch.save` into `tmp` and flush it to the disk (deleted again if the write fails).

    Raises:
        OSError: a write failed (no space left, a quota, an I/O error), with its errno and `tmp`'s folder.
    """
    out = None
    try:
        with open(tmp, "wb") as f:
            out = _Writes(f)
            torch.save(state, out)
            f.flush()
            os.fsync(f.fileno())            # on the disk before a rename publishes it (a lost machine)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        cause = out.error if out is not None and out.error is not None else e
        if isinstance(cause, OSError) and cause.errno is not None:
            raise OSError(cause.errno, cause.strerror, str(tmp.parent)) from e
        raise
    return tmp


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename) to the disk; a no-op where a folder cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def history(run_dir: str | os.PathLike) -> dict[int, Path]:
    """The older checkpoints `save_latest` kept in `run_dir`: {step: `checkpoint-<step>.pt`}."""
    found = {}
    for p in Path(run_dir).glob("checkpoint-*.pt"):
        if m := HISTORY.fullmatch(p.name):
            found[int(m.group(1))] = p
    return found


def latest(run_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints of a run folder, newest first: `checkpoint.pt`, then `checkpoint-<step>.pt` by
    falling step (empty when the folder or its checkpoints do not exist)."""
    run_dir = Path(run_dir)
    older = [p for _, p in sorted(history(run_dir).items(), reverse=True)]
    return ([run_dir / LATEST] if (run_dir / LATEST).is_file() else []) + older


def state_bytes(state) -> int:
    """The bytes of the tensors in `state` (nested dicts, lists and tuples): a checkpoint of it takes
    about as much on disk (the rest is a few KiB)."""
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    return sum(state_bytes(v) for v in state) if isinstance(state, (list, tuple)) else 0


def space_short(folder: Path, size: int, keep_last: int) -> str:
    """A warning when the disk of the run `folder` cannot hold the checkpoints to come ("" when it can):
    `keep_last` of `size` bytes and the next one's temp file beside them, less those already there. Said
    after a start's first step (`size`: `state_bytes`, the optimiser's state made by then), before the
    first checkpoint, and at every checkpoint while it holds, so that a run is told before its disk runs
    out rather than at the save that fails (then one line, the last checkpoint whole)."""
    need = size * (1 + max(0, keep_last - len(latest(folder))))
    free = shutil.disk_usage(folder).free
    if free >= need:
        return ""
    return (f"warning: {free / 2**20:,.0f} MiB free on the disk of {folder}, and the checkpoints to come need "
            f"{need / 2**20:,.0f} MiB more ({size / 2**20:,.0f} MiB each: run.keep_last={keep_last} of them and "
            "the next one written beside them): free space there or give run.out_dir on another disk before it "
            "runs out")


def resume_rank(state: dict, rank: int, world: int, seed: int, batch: int, saved_batch: int,
                steps_per_epoch: int) -> tuple[dict, str]:
    """This rank's loader position in a checkpoint (`state`'s "loader" and "rng" hold one per process
    that saved it), its RNG state restored, and a note to print ("" when there is nothing to say).

    Saved by the `world` processes that trained it, with this global `batch`: the rank's own position
    and RNG state: the run continues exactly. Otherwise (a run resumed on more or fewer GPUs, with another
    global batch, e.g. `data.batch_size=<n>/gpu` on another number of GPUs, or saved by one rank alone
    when its loader worker died: `alone`), every rank takes the position that rank 0 saved (the ranks
    step together), without a loader's own state (DALI's draws in the graph), the records of the epoch
    read so far (`batches_done` batches of `saved_batch`) kept as the batches of `batch` that hold as many
    (rounded down: up to one batch of them read again), and its RNG seeded from (`seed`, rank, step).
    The run then continues at its step; where the ranks' shares of the epoch change (another world, or
    another batch over several ranks: each rank reads its slice of the epoch's order), the rest of the
    epoch is not read as the run never stopped would (some records twice, others not).

    Args:
        batch, saved_batch: the global batch of this run and of the run that saved `state`.
        steps_per_epoch: batches of `batch` in an epoch on this rank.
    """
    saved_by, trained_by = len(state["loader"]), int(state.get("processes", len(state["loader"])))
    if saved_by == trained_by == world and batch == saved_batch:
        set_rng_state(state["rng"][rank])
        return state["loader"][rank], ""
    from pipelines.spec import derive_seed

    epoch, records = int(state["loader"][0]["epoch"]), int(state["loader"][0]["batches_done"]) * saved_batch
    position = {"epoch": epoch, "batches_done": records // batch}
    if position["batches_done"] >= steps_per_epoch:         # the epoch's last batches were read already
        position = {"epoch": epoch + 1, "batches_done": 0}
    step = int(state["step"])
    mixed = derive_seed(seed, rank, step)
    random.seed(mixed)
    np.random.seed(mixed % 2**32)
    torch.manual_seed(mixed)
    said = [f"saved by rank {state['alone']} alone, its loader worker dead"] if "alone" in state else []
    if trained_by != world:
        said.append(f"trained by {trained_by} process(es), now {world}")
    if batch != saved_batch:
        said.append(f"global batch {saved_batch}, now {batch}: epoch {epoch} goes on after its first {records:,} "
                    f"records, at batch {position['batches_done']} of {steps_per_epoch}")
    else:
        said.append(f"the same global batch {batch}")
    same_shares = trained_by == world and (batch == saved_batch or world == 1)
    shares = ("each rank goes on in its share of the epoch" if same_shares
              else f"the rest of epoch {epoch} is read in the shares of {world} process(es) (some of its records "
                   "twice, others not)")
    return position, f"resuming step {step} ({'; '.join(said)}): {shares}, and the random streams start afresh"


def check_ranks_agree(folder: Path, step: int | None) -> None:
    """That every rank starts from the same checkpoint of `folder` (`step`; None: none). A run folder on
    each node's own disk, or a network filesystem that shows a node an older listing, would start the
    ranks at different steps, with different target networks, optimiser states and loader positions
    (DDP syncs only the online weights), and leave them waiting for each other at the end. One
    collective (`dist.gather_objects`), which every rank makes; nothing in a single process.

    Raises:
        CheckpointError: the ranks saw different checkpoints; the message names which, on how many ranks.
    """
    seen = dist.gather_objects(step)
    if len(set(seen)) == 1:
        return
    ranks: dict[int | None, list[int]] = {}
    for rank, s in enumerate(seen):
        ranks.setdefault(s, []).append(rank)
    said = "; ".join(f"{'none' if s is None else f'step {s}'} on {len(r)} rank(s) from rank {r[0]}"
                     for s, r in ranks.items())
    raise CheckpointError(f"the ranks see different checkpoints in {folder} ({said}): the run folder (run.out_dir) "
                          "must be on storage that every node shares and sees up to date; then the same command "
                          "continues")


def saved_step(path: Path) -> int | None:
    """The `step` of a checkpoint file, read without loading its tensors (mmap); None if unreadable."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:  # torch raises several types for a corrupt or foreign file
        return None


def save_latest(run_dir: str | os.PathLike, state: dict, keep_last: int) -> Path:
    """Write `state` as `<run_dir>/checkpoint.pt`, keeping the newest `keep_last` checkpoints.

    With `keep_last` > 1 the previous `checkpoint.pt` becomes `checkpoint-<its step>.pt` (an unreadable
    one is replaced). Then `checkpoint-<step>.pt` files beyond the newest `keep_last` - 1, those of a
    step at or after this one (the abandoned future of a run resumed from an earlier checkpoint) and
    the temp files of killed writes are deleted. The new data is on the disk before anything moves: a
    kill at any point leaves the newest complete checkpoint readable in the folder (`latest`).

    Args:
        run_dir: the run folder (created).
        state: tensors and primitive containers, with the int `step` after which it was taken.
        keep_last: checkpoints to keep, >= 1 (1: `checkpoint.pt` alone).

    Returns:
        The path of the new `checkpoint.pt`.
    """
    run_dir, step = Path(run_dir), int(state["step"])
    run_dir.mkdir(parents=True, exist_ok=True)
    newest = run_dir / LATEST
    tmp = _write_durably(run_dir / f".{LATEST}.tmp{os.getpid()}", state)
    if keep_last > 1 and newest.is_file():
        previous = saved_step(newest)
        if previous is not None and previous < step:
            os.replace(newest, run_dir / f"checkpoint-{previous}.pt")
    os.replace(tmp, newest)
    _sync_folder(run_dir)
    older = sorted((s for s in history(run_dir) if s < step), reverse=True)
    for s in [s for s in history(run_dir) if s >= step] + older[keep_last - 1:]:
        (run_dir / f"checkpoint-{s}.pt").unlink(missing_ok=True)
    for stale in run_dir.glob(f".{LATEST}.tmp*"):                   # what killed writes left behind
        stale.unlink(missing_ok=True)
    return newest


def load(path: str | os.PathLike, word: str = "run.resume") -> dict:
    """Read a checkpoint written by `save` onto the CPU (weights_only: no code is unpickled).

    Args:
        path: the file.
        word: the argument that named it (`run.resume`, `ckpt`), for the fix an error names.

    Raises:
        CheckpointError: the file is missing, a folder, or not a checkpoint.
    """
    path = Path(path)
    fix = f"pass {word}=<run dir>/{LATEST}"
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint; pass {word}={path / LATEST}"
                              if (path / LATEST).is_file() else f"{path} is a folder that holds no {LATEST}; {fix}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found; {fix}")
    if not zipfile.is_zipfile(path):    # what torch.save writes; torch's own error would advise weights_only=False
        raise CheckpointError(f"cannot read checkpoint {path}: not a file torch.save wrote (a truncated or other "
                              f"file); {fix}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}; {fix}") from e


def load_training(path: str | os.PathLike, word: str = "run.resume") -> dict:
    """`load`, and refuse a file that is not a training checkpoint (e.g. an exported backbone).

    Raises:
        CheckpointError: missing, unreadable, or without the saved config.
    """
    state = load(path, word)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{path} is not a training checkpoint (no saved config); pass {word}=<run dir>/{LATEST}")
    return state


class Cadence:
    """When a training loop saves its checkpoint: after every `every` steps and after its last; at the
    first log step `every_min` minutes (0: never) after its last save, by any rank's clock; and at the
    first log step after any rank caught the held signal (`dist.HeldSignal`, `run.checkpoint_on_signal`),
    where the loop then stops. The loop calls `at_log_step` at each log step (every rank, one collective),
    asks `due(done, last)` after each step and calls `saved()` after it saved.
    """

    def __init__(self, every: int, every_min: float, held: dist.HeldSignal | None = None) -> None:
        self.every, self.every_min = every, every_min
        self.held = held or dist.HeldSignal("")
        self.signalled = False               # some rank caught the held signal: save, then stop
        self._clock = False                  # some rank's clock says a save is due
        self._saved_at = time.monotonic()    # the loop's last save, or its start
        self.saved_step: int | None = None   # the step of the loop's last save

    def at_log_step(self, device: torch.device) -> None:
        """Agree over the ranks whether the signal was caught and whether the clock calls for a save."""
        clock = 0 < 60 * self.every_min <= time.monotonic() - self._saved_at
        # sync: which signals some rank caught, and whether some rank's clock says a checkpoint is due
        *caught, self._clock = dist.any_rank(device, *self.held.caught, clock)
        self.signalled = self.held.agree(caught)

    def due(self, done: int, last: int) -> bool:
        """Whether the loop saves after step `done` (1-based) of a loop that ends after step `last`."""
        return done % self.every == 0 or done == last or self.signalled or self._clock

    def saved(self, step: int | None = None) -> None:
        """The loop saved (the checkpoint of `step`): the clock starts again."""
        self._saved_at, self._clock = time.monotonic(), False
        self.saved_step = step

    def next_batch(self, batches: Iterator, step: int, first: int, save: Callable[[bool], None]):
        """The batch of the loop's (0-based) `step` from `batches`. When the loader's worker died (the OOM
        killer) and the loop trained steps since its `first` and its last save, `save(alone)` saves the
        checkpoint of the steps reached (`step`) before the error goes on: with several processes `alone`,
        this rank by itself (the others wait in the step's collective, where they can save nothing, until
        the launcher stops them; DDP keeps the weights and the optimiser equal on every rank, the ranks
        stand at the same position, and `resume_rank` seeds their random streams afresh). A loader whose
        state died with its worker (DALI's own draws in the graph, where its checkpoint before the run the
        worker died in was not taken) saves nothing.
        """
        from pipelines.processes import worker_death
        from pipelines.spec import LoaderError

        try:
            return next(batches)
        except RuntimeError as e:
            if worker_death(e) is None or step in (first, self.saved_step):
                raise
            world = dist.world_size()
            try:
                save(world > 1)
                print(f"a loader worker died: {f'rank {dist.rank()} ' if world > 1 else ''}saved the checkpoint of "
                      f"step {step}", flush=True)
            except LoaderError:              # the loader's state died with its worker
                pass
            raise
