"""The run: one training run's folder and what it holds, opened once per process (`Run.open`).

A run folder holds `config.yaml` and `versions.json` (written at every start: `Run.begin`),
`metrics.jsonl` and TensorBoard events (`train.log`), `checkpoint.pt` and the older checkpoints
`run.keep_last` keeps (`Run.save`, `train.checkpoint`), and at the end `backbone.pt` and
`backbone.safetensors` (`Run.export`); the last one marks the run finished.

The folder's name, and the checkpoint the run starts from, are agreed by every rank once, when the run
is opened: the collectives of the run's bookkeeping, which every rank makes. After that the folder is a
plain attribute, so asking for it never waits on another rank, whichever branch a rank is in. One
process at a time writes a run's folder (`lock_of`, `hold`): a second start of a run that runs is
refused in one line.
`folder_of` is the folder of a config whose name is already fixed (a SLURM job's, a bench's), for the
places that look at a run from outside.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch import nn

from models.backbone import export_backbone_state, save_backbone
from pipelines.processes import FolderLock
from train import checkpoint, dist
from train.config import Config, ConfigError, dump_yaml, to_dict
from train.log import Log

FINISHED = "backbone.safetensors"       # written last, by rank 0: the run reached optim.steps
LINEAR_EVAL = "linear_eval.json"        # `run.eval=linear`'s result (train.protocol), written after the export

# The parts of a saved config that fix the network's layout: a checkpoint only loads into a network
# built with the same values (views.global_px decides the small-image stem).
LAYOUT_KEYS = ("method", "model.backbone", "model.proj_hidden", "model.proj_out", "model.proj_layers",
               "model.proj_last_bn", "model.pred_hidden", "model.pred_last_bn", "views.global_px")


# What a start can do where another run writes its folder, and where its folder cannot be written.
RUN_FIXES = ("give this run another run.name", "give run.out_dir a folder this user can write")


def lock_of(folder: Path) -> FolderLock:
    """The lock on writing `folder` (a run's, a protocol's): `.<name>.lock` beside it, as a dataset's
    (`processes.FolderLock`). Two runs writing one folder (the same `run.name` started twice, a job
    submitted again while it runs) would train from the same checkpoint and overwrite each other's
    checkpoints and metrics."""
    return FolderLock(folder.parent / f".{folder.name}.lock")


def hold(lock: FolderLock, folder: Path, fixes: tuple[str, str]) -> None:
    """Take `lock`, `folder`'s (`lock_of`), on rank 0, before the first write there: the process that
    writes it holds it until the caller releases it, or until it ends. Every rank learns whether it could
    (one collective; none in a single process).

    Raises:
        ConfigError: another live process writes `folder` (named, with how to stop it, and `fixes[0]`), or
            the folder cannot be written there (a read-only disk, another user's folder: `fixes[1]`).
    """
    refused = None
    if dist.is_main():
        try:
            lock.path.parent.mkdir(parents=True, exist_ok=True)
            if (holder := lock.acquire()) is not None:
                refused = (f"another run ({holder}) is writing {folder}; wait for it to end or stop it "
                           f"({holder.stop()}){f', or {fixes[0]}' if fixes[0] else ''}")
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR):
                raise
            refused = f"{folder} cannot be written ({e.strerror}: {e.filename}); {fixes[1]}"
    if (refused := dist.broadcast_object(refused)) is not None:
        raise ConfigError(refused)


def check_free(folder: Path, fixes: tuple[str, str]) -> None:
    """`hold`'s check, without holding: for the process that launches a run's processes, which write.

    Raises:
        ConfigError: as `hold`.
    """
    lock = lock_of(folder)
    if lock.path.is_file():
        try:
            hold(lock, folder, fixes)
        finally:
            lock.release()


def check_same_network(cfg: Config, saved: dict, path: str, fix: str) -> None:
    """Refuse a checkpoint whose saved config builds another network than `cfg`.

    Args:
        cfg: the config the network is built from.
        saved: the checkpoint's `config` (plain dicts, as `to_dict` writes them).
        path: the checkpoint file (for the message).
        fix: how to proceed, the end of the message.

    Raises:
        ConfigError: naming each differing `LAYOUT_KEYS` value, saved and asked for.
    """
    def value(tree: dict, dotted: str, default=None):
        for part in dotted.split("."):
            if not isinstance(tree, dict) or part not in tree:
                return default
            tree = tree[part]
        return tree

    ours, defaults = to_dict(cfg), to_dict(Config())
    saved = {k: value(saved, k, value(defaults, k)) for k in LAYOUT_KEYS}   # a key added since: its default
    diffs = [f"{k}={saved[k]} (asked for {value(ours, k)})" for k in LAYOUT_KEYS if saved[k] != value(ours, k)]
    if diffs:
        raise ConfigError(f"checkpoint {path} was trained with {', '.join(diffs)}; {fix}")


def proposed_name(cfg: Config) -> str:
    """`run.name`, or a new `<method>-<data>-<time>` from this process's clock (`Run.open` makes every
    rank take rank 0's)."""
    return cfg.run.name or f"{cfg.method}-{cfg.data.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def folder_of(cfg: Config) -> Path:
    """The run folder of `cfg`: that of `run.resume`'s checkpoint file, else `<run.out_dir>/<run.name>`.
    A plain path, no collective: a run without a name is named when it is opened (`Run.open`).

    Raises:
        ValueError: no `run.resume` file and no `run.name` (a caller's mistake, not the user's).
    """
    if cfg.run.resume and cfg.run.resume != "auto":
        return Path(cfg.run.resume).parent
    if not cfg.run.name:
        raise ValueError("folder_of needs a named run; a run without run.name is named by Run.open")
    return Path(cfg.run.out_dir) / cfg.run.name


@dataclass(frozen=True)
class Resume:
    """Where a run starts: a checkpoint's state, or step 0."""

    state: dict | None = None           # the checkpoint (`checkpoint.load_training`); None: a fresh start
    path: Path | None = None            # the file it was read from
    skipped: list[str] = field(default_factory=list)   # newer files of the run folder that did not read

    @property
    def step(self) -> int:
        """The steps done before this start (0 for a fresh one)."""
        return int(self.state["step"]) if self.state is not None else 0


def resume_state(cfg: Config, folder: Path) -> Resume:
    """The checkpoint `run.resume` names, checked to build `cfg`'s network; nothing for a fresh run.

    `run.resume=auto` reads `folder`'s checkpoints newest first (`checkpoint.latest`), skips those that do
    not read (a truncated or damaged file) and starts fresh when none is left. A run folder whose newest
    readable checkpoint (or, without one, `config.yaml`) builds another network is an error, not a fresh
    start.

    A fresh start (no `run.resume`) in a folder that holds a run already is an error: it would train from
    step 0 over that run's checkpoints, config and metrics.

    Raises:
        CheckpointError: a named checkpoint that is missing, unreadable or not a training checkpoint.
        ConfigError: a checkpoint or run folder of another method or network (`check_same_network`); a fresh
            start in a run's folder.
    """
    if not cfg.run.resume:
        held = checkpoint.latest(folder)
        if held or (folder / "config.yaml").is_file():
            step = checkpoint.saved_step(held[0]) if held else None
            what = ("no checkpoint yet" if not held else
                    held[0].name + (f" at step {step}" if step is not None else ""))
            raise ConfigError(f"{folder} holds a run already ({what}); continue it with run.resume=auto, or give this "
                              "run another run.name (nothing there was changed)")
        return Resume()
    if cfg.run.resume != "auto":
        state = checkpoint.load_training(cfg.run.resume)
        check_same_network(cfg, state["config"], cfg.run.resume,
                           "resume it with the same method and model, or drop run.resume to start a fresh run")
        return Resume(state, Path(cfg.run.resume))
    fix = f"run.resume=auto continues the run in {folder}: give that run's method and model, or another run.name"
    skipped = []
    for path in checkpoint.latest(folder):
        try:
            state = checkpoint.load_training(path)
        except checkpoint.CheckpointError as e:
            skipped.append(str(e))
            continue
        check_same_network(cfg, state["config"], str(path), fix)
        return Resume(state, path, skipped)
    saved = folder / "config.yaml"          # a run killed before its first checkpoint is still that run
    try:
        tree = yaml.safe_load(saved.read_text()) if saved.is_file() else None
    except yaml.YAMLError:                  # damaged: nothing to compare with
        tree = None
    if isinstance(tree, dict):
        check_same_network(cfg, tree, str(saved), fix)
    return Resume(skipped=skipped)


class Interrupted(Exception):
    """A start ended by Ctrl-C (SIGINT): `str()` is the one line that says where to continue from."""


@dataclass(frozen=True)
class Run:
    """One run as this process sees it: its config, its folder and where it starts."""

    cfg: Config
    folder: Path
    resume: Resume

    @classmethod
    def open(cls, cfg: Config) -> Run:
        """The run of `cfg`, read before anything is written. Every rank calls it once, after joining the
        process group: the folder's name is rank 0's (`dist.broadcast_object`), and every rank must see
        the same checkpoint there (`checkpoint.check_ranks_agree`): the two collectives here; a single
        process makes none.

        Raises:
            CheckpointError, ConfigError: see `resume_state`; CheckpointError: the ranks saw different
                checkpoints (a run folder not on shared storage).
        """
        name = dist.broadcast_object(proposed_name(cfg))
        folder = folder_of(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name)))
        resume = resume_state(cfg, folder)
        checkpoint.check_ranks_agree(folder, None if resume.path is None else resume.step)
        return cls(cfg, folder, resume)

    @property
    def trained(self) -> bool:
        """Whether an earlier start reached `optim.steps` and exported the backbone."""
        return self.resume.step >= self.cfg.optim.steps and (self.folder / FINISHED).is_file()

    @property
    def finished(self) -> bool:
        """Whether an earlier start did all this run asks (a requeued job, the same command twice): trained
        and, with `run.eval=linear`, the linear evaluation's result written. Nothing is left to do."""
        return self.trained and (self.cfg.run.eval != "linear" or (self.folder / LINEAR_EVAL).is_file())

    def finished_line(self) -> str:
        """The one line a finished run prints when started again."""
        return (f"{self.folder} finished at step {self.resume.step} (its results are there); nothing to do: "
                "raise optim.steps to train on, or give another run.name")

    def begin(self, log: Log) -> None:
        """Write the start files on rank 0 (`config.yaml`, whole or not at all since `run.resume=auto`
        reads it; `versions.json`: the libraries of this start) and say where the run starts."""
        if dist.is_main():
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / ".config.yaml.tmp").write_text(dump_yaml(self.cfg))
            os.replace(self.folder / ".config.yaml.tmp", self.folder / "config.yaml")
            (self.folder / "versions.json").write_text(json.dumps(checkpoint.library_versions(), indent=1) + "\n")
        log.print(f"config ({self.folder / 'config.yaml'}):\n{dump_yaml(self.cfg)}")
        for note in self.resume.skipped:
            log.print(f"skipped {note}")
        if self.resume.path is not None:
            log.print(f"resuming from {self.resume.path} (step {self.resume.step})")
        elif self.cfg.model.init:
            log.print(f"backbone initialised from {self.cfg.model.init}")

    def save(self, state: dict) -> str:
        """Write a checkpoint of this run (rank 0 calls it, or a rank alone: `Cadence.next_batch`), keeping
        `run.keep_last` of them; returns a warning to print when the disk cannot hold the next ones
        (`checkpoint.space_short`), else ""."""
        checkpoint.save_latest(self.folder, state, self.cfg.run.keep_last)
        size = (self.folder / checkpoint.LATEST).stat().st_size
        return checkpoint.space_short(self.folder, size, self.cfg.run.keep_last)

    def interrupted_line(self) -> str:
        """What an interrupted start (Ctrl-C) says: the step its folder's newest checkpoint holds (each is
        written whole or not at all) and the word that continues from it."""
        held = checkpoint.latest(self.folder)
        step = checkpoint.saved_step(held[0]) if held else None
        if step is None:
            return (f"interrupted before the first checkpoint of {self.folder}; start again with run.resume=auto and "
                    f"run.name={self.folder.name}")
        return (f"interrupted; {self.folder} holds the checkpoint of step {step}: the same command with "
                f"{self.resume_hint()} continues from it")

    def resume_hint(self) -> str:
        """The word that continues this run after `run.stop_after_steps`."""
        return "run.resume=auto" if self.cfg.run.resume == "auto" else f"run.resume={self.folder / checkpoint.LATEST}"

    def export(self, backbone: nn.Module, log: Log) -> None:
        """Write the trained backbone on rank 0: `backbone.pt` (a timm state dict) and `backbone.safetensors`
        (with what rebuilds it; written last, so it marks the run finished)."""
        cfg = self.cfg
        if dist.is_main():
            torch.save(export_backbone_state(backbone), self.folder / "backbone.pt")
            save_backbone(backbone, self.folder / FINISHED, cfg.model.backbone, cfg.views.global_px,
                          {"method": cfg.method, "dataset": cfg.data.name, "git_commit": checkpoint.git_commit()})
        log.print(f"results in {self.folder}: metrics.jsonl, TensorBoard events (tensorboard --logdir "
                  f"{self.folder.parent}), config.yaml, versions.json, checkpoint.pt, backbone.pt and "
                  f"backbone.safetensors (timm {cfg.model.backbone}, num_classes=0; models.backbone.load_backbone "
                  "reads it)")
