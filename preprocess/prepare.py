"""Turn a source (synthetic, CIFAR, image folder) into a complete dataset folder, atomically.

    OUT/.<name>.staging/            everything is written here first
        <split>.beton               FFCV file          (copied from the split's shards,
                                                        preprocess/ffcv_copy.py)
        <split>/shard-*.tar|.idx    DALI shards        (preprocess/write_dali.py)
        gt_masks/<split>.npy        synthetic only: exact foreground masks
        .verified.json              checksum stamp (see pipelines/schema.py, verification policy)
        manifest.json               written last (temporary name + os.replace)
    OUT/<name>/                     the staging folder renamed into place

A source held in memory (synthetic, CIFAR) is made or read and checked first (`preprocess/sources.py`,
before anything is written under OUT), then written into its DALI shards and its `.beton` copied from
them, split by split. An image folder is listed, then written in one streamed, resumable pass
(`preprocess/stream.py`: each image decoded once, straight into its DALI shard, on all cores or on
Ray) and its `.beton` copied from the shards (by several processes, its JPEGs as they are). Where
FFCV is not installed (a GPU machine that reads with DALI only) the `.beton` files are left out, said
on stderr and in the manifest's `formats`; the ffcv backend then refuses the dataset with that fix.
Nothing under OUT/<name> changes until the new dataset is complete: with --force the old folder is
moved aside (its manifest removed first, so a reader never accepts a half-swapped folder), the staging
folder renamed in, and the old one deleted. A folder at OUT/<name> that no viewmill write made (no
manifest, no stamp: a user's files, the source itself) is never replaced: the run refuses it first.
An interrupted run leaves only the staging folder: the next run resumes an image folder's finished
shards from it (same arguments, no --force), or deletes it.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from pipelines import schema
from pipelines.schema import DatasetError, Manifest
from pipelines.processes import FolderLock, descriptors_needed, ensure_open_files, fork_context
from pipelines.shards import ShardReader, scan_shards, write_record_table
from preprocess import stream
from preprocess.ffcv_copy import copy_to_ffcv
from preprocess.sources import SOURCES, ListedSource, PreparedSource, PreprocessError, Source
from preprocess.write_dali import write_dali
from preprocess.write_ffcv import warm_up as warm_up_ffcv

SHARD_SIZE = 1000               # records per DALI shard (--shard-size)
ENGINES = ("local", "ray")      # where an image folder's units run (--engine)
BACKGROUND = "_background"      # a timing key ending so ran beside the stages (not part of their sum)


def default_workers() -> int:
    """CPU cores available to this process."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ------------------------------------------------------------------------------------------------
# Orchestration.
# ------------------------------------------------------------------------------------------------

def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _bookkeeping(rel: str) -> bool:
    """Top-level names starting with "." (the resume plan and parts, stamps) are not dataset files."""
    return rel.startswith(".") or rel == schema.MANIFEST_NAME


def hash_files(root: Path, workers: int = 1, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """{relpath: {sha256, bytes}} of the dataset files under `root`, hashed on `workers` threads;
    `known` entries (hashed by whoever wrote the file) are taken as they are when the size matches."""
    known = known or {}
    files = {f.relative_to(root).as_posix(): f for f in sorted(root.rglob("*")) if f.is_file()}
    files = {rel: f for rel, f in files.items() if not _bookkeeping(rel)}
    todo = [rel for rel, f in files.items() if known.get(rel, {}).get("bytes") != f.stat().st_size]
    with ThreadPoolExecutor(max(1, workers)) as pool:         # hashlib releases the GIL
        digests = dict(zip(todo, pool.map(schema.sha256_file, [files[rel] for rel in todo])))
    return {rel: {"sha256": digests[rel], "bytes": f.stat().st_size} if rel in digests else dict(known[rel])
            for rel, f in files.items()}


def write_manifest(staging: Path, manifest: Manifest, stamp: dict[str, list[int]] | None = None) -> None:
    """Write the verification stamp (`stamp`; default: every file of a staging folder just hashed),
    then manifest.json (temporary name + os.replace), last."""
    raw = manifest.to_json()
    if stamp is None:
        stamp = {rel: schema.file_stat_key(staging / rel) for rel in manifest.files}
    schema.write_verified_stamp(staging, hashlib.sha256(raw).hexdigest(), stamp)
    tmp = staging / f".{schema.MANIFEST_NAME}.tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / schema.MANIFEST_NAME)


class DatasetLock:
    """An exclusive lock on writing `<out_root>/<name>` (`processes.FolderLock` on `.<name>.lock` beside
    it): two runs on the same dataset would delete each other's staging folder. A run that ended without
    releasing it (killed) left its pid in the file; the next run says so in one line and goes on."""

    def __init__(self, out_root: Path, name: str) -> None:
        self.lock = FolderLock(Path(out_root) / f".{name}.lock")
        self.path, self.name = self.lock.path, name

    def acquire(self) -> None:
        """Take the lock (no-op when held).

        Raises:
            PreprocessError: another live run holds it (the message names its pid, command and how to stop it),
                or the lock file cannot be made (a read-only data root; the message names the folder).
        """
        try:
            holder = self.lock.acquire()
        except OSError as e:         # a read-only or foreign data root: the lock file cannot be made
            raise PreprocessError(f"data root {self.path.parent} cannot be written ({e.strerror or e}), and "
                                  f"writing {self.name} takes its lock file {self.path.name} there: make the "
                                  "folder writable or use a writable copy of it") from None
        if holder is not None:
            stop = "" if holder.command == "this process" else f" or stop it with `{holder.stop()}`"
            raise PreprocessError(f"another run ({holder}) is writing {self.name} into {self.path.parent}; wait for "
                                  f"it to finish{stop}, then re-run")
        if self.lock.stale:
            print(f"the lock of {self.name} is stale: its run (pid {self.lock.stale}) ended without finishing; "
                  "going on", file=sys.stderr)
            self.lock.stale = ""

    def release(self) -> None:
        """Drop the lock, leaving the file empty: an empty lock file is one that no run left behind."""
        self.lock.release()


def ffcv_installed() -> bool:
    """Whether FFCV (the extra `viewmill[ffcv]`) can be found, without importing it."""
    try:
        return importlib.util.find_spec("ffcv") is not None
    except (ImportError, ValueError):           # an import blocked on purpose counts as absent
        return False


def replaceable(final: Path) -> bool:
    """Whether a dataset may be swapped in for `final`: it does not exist, is an empty folder, or is a
    folder a viewmill write made. Such a folder holds the verification stamp (`schema.VERIFIED_NAME`,
    written before its manifest and kept by a swap that died after removing the manifest), or a
    manifest with a schema version; anything else (a user's files, a source folder) is never replaced."""
    if not (final.exists() or final.is_symlink()):
        return True
    try:
        if not final.is_dir():
            return False
        if (final / schema.VERIFIED_NAME).is_file() or not any(final.iterdir()):
            return True
        return "schema_version" in json.loads((final / schema.MANIFEST_NAME).read_bytes())
    except (OSError, ValueError, TypeError):       # unreadable, no manifest, or not one of ours
        return False


def swap_in(staging: Path, final: Path) -> None:
    """Rename the complete staging folder to `final`, moving a previous dataset aside first.

    Raises:
        PreprocessError: `final` is not `replaceable` (checked before anything is written, again here).
    """
    if not replaceable(final):
        raise PreprocessError(f"{final} is not a viewmill dataset folder and is left as it is: move it away or "
                              "choose another --name, then re-run")
    old = final.with_name(f".{final.name}.old")
    _remove(old)
    if final.exists():
        # Remove the manifest first: if we die between the renames, no reader accepts a mixed folder.
        (final / schema.MANIFEST_NAME).unlink(missing_ok=True)
        os.replace(final, old)
    os.replace(staging, final)
    _remove(old)


def _is_complete(final: Path) -> Manifest | None:
    try:
        return schema.read_manifest(final, verify="size")
    except DatasetError:
        return None


# Parameters whose recorded value is a path of the machine that wrote the dataset (a source read again from
# another mount is the same dataset): not compared with those asked.
PATH_PARAMS = ("src", "class_list")


def _changed_params(job: "Job", done: Manifest) -> list[tuple[str, str]]:
    """The source parameters asked (defaults filled in) that act otherwise on the source than those a
    complete dataset was written with (`Source.acting`), as (written, asked) option words; a parameter
    the manifest does not record is not compared.

    Raises:
        PreprocessError: an option the source does not take, or a bad value (`Source.resolve`).
    """
    asked = job.source.resolve(job.params)
    src = Path(job.src) if job.source.needs_src and job.src is not None else None
    acts, acted = job.source.acting(asked, src), job.source.acting(done.params, src)
    return [(f"--{k.replace('_', '-')} {done.params[k]}", f"--{k.replace('_', '-')} {v}") for k, v in asked.items()
            if k not in PATH_PARAMS and k in done.params and acted[k] != acts[k]]


def add_record_tables(final: Path, manifest: Manifest, lock: DatasetLock) -> list[str]:
    """Give a complete dataset written before the record tables existed the table of each split
    (`pipelines.shards.write_record_table`, one scan of the split's shards), listed in a new manifest,
    under the dataset's lock; the files the old manifest's stamp verified stay verified (no re-hash of
    the shards). Returns the splits that got one."""
    todo = [s for s in manifest.counts if f"{s}/{schema.RECORDS_NAME}" not in manifest.files
            and any(rel.startswith(f"{s}/") for rel in manifest.files)]
    if not todo:
        return []
    lock.acquire()
    stamp = schema.read_stamp(final, hashlib.sha256((final / schema.MANIFEST_NAME).read_bytes()).hexdigest())
    files = dict(manifest.files)
    for split in todo:
        table = write_record_table(final / split, scan_shards(final / split, manifest.counts[split]))
        rel = table.relative_to(final).as_posix()
        files[rel] = {"sha256": schema.sha256_file(table), "bytes": table.stat().st_size}
        stamp[rel] = schema.file_stat_key(table)
    write_manifest(final, replace(manifest, files=files), stamp)
    return todo


def prepare_dataset(dataset: str, out_root: Path, *, src: Path | None = None, force: bool = False,
                    workers: int | None = None, progress: bool = False, name: str | None = None,
                    shard_size: int = SHARD_SIZE, engine: str | object = "local", **source_params) -> Path:
    """Write `dataset` as FFCV + DALI files with a manifest into `out_root/<name>` (atomically).

    Args:
        dataset: a key of `preprocess.sources.SOURCES`.
        out_root: the data root; the dataset lands in `out_root/<name>`.
        src: source folder (CIFAR batches or the image folder); used only by sources that need one.
        force: rewrite a complete dataset, and start an interrupted image folder over instead of
            resuming it.
        workers: parallel processes (default: all available cores).
        progress: show progress (`preprocess.progress`: a bar on a terminal, a line a minute in a log).
        name: dataset folder name (default: `dataset`): a plain name, no '/', no leading '.' (`check_name`).
        shard_size: records per DALI shard (for image folders also files per work unit).
        engine: where an image folder's units run: "local" (processes on this machine), "ray"
            (Ray Data; `RAY_ADDRESS` picks a cluster), or an engine object (`preprocess.stream`).
        **source_params: the source's parameters (`SOURCES[dataset].params`; missing ones take
            their defaults): synthetic: train_size, val_size, image_px, seed, gt_masks_as_mask;
            imagefolder: max_side (px, 0 keeps the size), side ("longer" | "shorter"), class_list.

    Returns:
        The dataset folder `out_root/<name>`.

    Raises:
        PreprocessError, CifarError, ImageFolderError (all ValueError): bad input or a failed write,
            with a one-line message; a previous complete dataset is then left intact. Before anything is
            read or written: a bad name, an `out_root/<name>` that is not a viewmill dataset folder
            (`replaceable`), a source that is the destination or inside it (or, for an image folder,
            holds it).
    """
    source = SOURCES.get(dataset)
    if source is None:
        raise PreprocessError(f"unknown dataset {dataset!r}; choose one of {', '.join(SOURCES)}")
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if shard_size < 1:
        raise PreprocessError(f"--shard-size must be >= 1, got {shard_size}")
    if isinstance(engine, str) and engine not in ENGINES:
        raise PreprocessError(f"unknown --engine {engine!r}; use one of {', '.join(ENGINES)}")
    if name is not None:
        check_name(name)
    ensure_open_files(descriptors_needed(workers=workers), "preprocessing")
    job = Job(source, dataset, src, dict(source_params), Path(out_root), name or dataset, force, workers, progress,
              shard_size, engine)
    _check_destination(job)
    lock = DatasetLock(job.out_root, job.name)
    try:
        return _prepare(job, lock)
    finally:
        lock.release()


@dataclass(frozen=True)
class Job:
    """What `prepare_dataset` was asked, its arguments checked."""

    source: Source                  # SOURCES[dataset]
    dataset: str                    # its key, recorded as the manifest's source
    src: Path | None                # source folder, for sources that need one
    params: dict                    # the source's parameters as given (defaults filled in by the source)
    out_root: Path                  # the data root
    name: str                       # the dataset folder's name under it
    force: bool                     # rewrite a complete dataset; start an interrupted image folder over
    workers: int                    # parallel processes
    progress: bool                  # tqdm bars on a terminal
    shard_size: int                 # records per DALI shard (an image folder's files per work unit)
    engine: str | object            # where an image folder's units run: "local", "ray" or an engine object

    @property
    def final(self) -> Path:
        return self.out_root / self.name

    @property
    def staging(self) -> Path:
        return self.out_root / f".{self.name}.staging"


@dataclass(frozen=True)
class Written:
    """What the writers put into the staging folder, for the manifest."""

    source: PreparedSource          # the facts of the records written
    seconds: dict[str, float]       # durations of the write stages; a key ending in BACKGROUND ran beside them
    build: dict = field(default_factory=dict)          # how: an image folder's engine, resumed units, CPU seconds
    known: dict[str, dict] = field(default_factory=dict)  # checksums the writers computed: {relpath: {sha256, bytes}}


@dataclass
class Known:
    """What a `write_staged` fill that records nothing else returns: the checksums its writers computed,
    {relpath: {sha256, bytes}}."""

    known: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class Hashed:
    """The dataset files of a staging folder with their checksums (`hash_files`)."""

    files: dict[str, dict]          # relpath -> {sha256, bytes}
    seconds: float                  # the hashing's duration


def check_name(name: str) -> None:
    """A dataset name is one plain folder name: `.` would make OUT itself the dataset folder, `..` its
    parent, a separator a folder elsewhere, and a leading dot collides with the hidden bookkeeping beside
    it (`.<name>.staging`, `.<name>.old`, `.<name>.lock`).

    Raises:
        PreprocessError: naming the name and the fix.
    """
    if not name or name.startswith(".") or "/" in name or (os.altsep and os.altsep in name) or os.sep in name:
        raise PreprocessError(f"--name {name!r} is not a plain folder name: give a name without '/' that does "
                              "not start with '.' (e.g. --name mydata)")


def _check_destination(job: Job) -> None:
    """Refuse, before anything is read or written, a destination OUT/<name> that a swap would lose: one
    that is not `replaceable` (a user's folder, a file), or one that is the source or holds it; and one
    inside the source of a source that reads all of its folder (`Source.lists_src`: an image folder).

    Raises:
        PreprocessError: naming the folder in the way and the fix.
    """
    final = job.final.resolve()
    if job.source.needs_src and job.src is not None:
        src = Path(job.src).resolve()
        if src == final or final in src.parents:
            raise PreprocessError(f"--src {job.src} is the destination {job.final} or inside it, which a write "
                                  "replaces: choose another --out or --name")
        if job.source.lists_src and src in final.parents:     # its folders would be read as the source's
            raise PreprocessError(f"the destination {job.final} is inside --src {job.src}, which is read as a "
                                  "whole: choose an --out outside the source")
    if not replaceable(job.final):
        what = (f"a folder that is not a viewmill dataset (no viewmill {schema.MANIFEST_NAME})" if job.final.is_dir()
                else "not a folder")
        raise PreprocessError(f"{job.final} already exists and is {what}; nothing was touched: move it away or "
                              "choose another --name (or --out)")


def _prepare(job: Job, lock: DatasetLock) -> Path:
    """`prepare_dataset` after its argument checks: nothing when the dataset is complete; else the source
    is read (or an image folder listed) before anything is written under OUT, OUT is made ready (`lock`
    taken before the read when OUT exists, so that a second run stops at once, else as soon as OUT is
    created), the records are written into the staging folder, and the manifest, written last, makes
    the dataset that is swapped in (`write_staged`)."""
    if not job.force and (done := _is_complete(job.final)) is not None:
        if changed := _changed_params(job, done):
            raise PreprocessError(f"{job.final} was written with {', '.join(w for w, _ in changed)}, not "
                                  f"{', '.join(a for _, a in changed)} as asked: pass --force to rewrite it, "
                                  "or give --name another name to write a second dataset")
        counts = ", ".join(f"{k} {v}" for k, v in done.counts.items())
        if added := add_record_tables(job.final, done, lock):
            print(f"{job.final} is complete ({counts}); added the record table of {', '.join(added)}, which the "
                  "loaders read instead of every record of the shards (pass --force to rewrite everything)")
        else:
            print(f"{job.final} is complete ({counts}); nothing to do (pass --force to rewrite)")
        return job.final
    started = time.perf_counter()
    _check_writable(job.out_root)
    if job.out_root.is_dir():
        lock.acquire()
    t = time.perf_counter()
    read = job.source.prepare(job.src, dict(job.params), workers=job.workers, progress=job.progress)
    read_seconds = {"list" if isinstance(read, ListedSource) else "read_decode": time.perf_counter() - t}
    if not isinstance(read, ListedSource) and job.engine != "local":
        raise PreprocessError(f"--engine {getattr(job.engine, 'name', job.engine)} writes image folders; "
                              f"{job.dataset} is made in memory on this machine: drop --engine (ENGINE=)")
    plan = stream.plan_of(read.files, read.params, job.shard_size) if isinstance(read, ListedSource) else None
    _make_room(job, lock, plan)
    with_ffcv = ffcv_installed()
    if not with_ffcv:
        print("ffcv is not installed: writing the DALI shards only, which every backend but ffcv reads "
              "(pip install 'viewmill[ffcv]', then --force, adds the .beton files)", file=sys.stderr)

    def manifest_of(written: Written, hashed: Hashed) -> Manifest:
        seconds = {**read_seconds, **written.seconds, "checksum": hashed.seconds}
        total = time.perf_counter() - started
        # Whatever no stage timed (checks, the lock, the staging folder, pool start-up), named so
        # that the stages add up to the total.
        other = max(0.0, total - sum(v for k, v in seconds.items() if not k.endswith(BACKGROUND)))
        return _manifest(job, written, hashed.files, {**seconds, "total": total, "other": other})

    if isinstance(read, ListedSource):
        write_staged(job.staging, job.final, lambda staging: _write_folder(read, staging, plan, job, with_ffcv),
                     manifest_of, f"writing {job.name} into {job.out_root} failed ({{what}}); nothing was replaced "
                     "and the finished shards are kept: free space, then re-run the same command to resume",
                     resumable=True, workers=job.workers)
    else:
        write_staged(job.staging, job.final, lambda staging: _write_in_memory(read, staging, job, with_ffcv),
                     manifest_of, f"writing {job.name} into {job.out_root} failed ({{what}}); nothing was replaced: "
                     "free space or choose another --out, then re-run", workers=job.workers)
    return job.final


def _check_writable(out_root: Path) -> None:
    """OUT exists as a writable folder, or can be created under one.

    Raises:
        PreprocessError: naming the folder in the way.
    """
    existing = next(p for p in (out_root.resolve(), *out_root.resolve().parents) if p.exists())
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise PreprocessError(f"output folder {out_root} cannot be created or written ({existing} is not a "
                              "writable folder): choose a writable --out")


def _make_room(job: Job, lock: DatasetLock, plan: dict | None) -> None:
    """Create OUT, take `lock`, and remove a staging folder an interrupted run left, unless this image
    folder's run resumes it (`plan`: the same listing and parameters, no --force).

    Raises:
        PreprocessError: OUT cannot be created or written.
    """
    try:
        job.out_root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        if job.staging.exists() and not (plan is not None and not job.force and stream.reusable(job.staging, plan)):
            print(f"removing {job.staging} left by an interrupted run", file=sys.stderr)
            _remove(job.staging)
    except OSError as e:
        raise PreprocessError(f"cannot prepare output folder {job.out_root}: {e.strerror or e}; choose a "
                              "writable --out") from None


def _write_in_memory(prepared: PreparedSource, staging: Path, job: Job, with_ffcv: bool) -> Written:
    """A source held in memory: its DALI shards, its `.beton` files (`with_ffcv`: copied from the
    shards, the same bytes in every run, `preprocess.ffcv_copy`) and its ground-truth masks, split by
    split."""
    seconds = {"dali_write": 0.0, "ffcv_write": 0.0}
    known = {}                                   # the .beton files, hashed as they were copied
    for split_name, split in prepared.splits.items():
        t = time.perf_counter()
        write_dali(split, staging / split_name, shard_size=job.shard_size, num_workers=job.workers,
                   progress=job.progress)
        seconds["dali_write"] += time.perf_counter() - t
    t = time.perf_counter()
    if with_ffcv:
        for split_name, split in prepared.splits.items():
            known[f"{split_name}.beton"] = copy_to_ffcv(
                ShardReader.open(staging / split_name, len(split)), staging / f"{split_name}.beton",
                has_masks=split.has_masks, mode=split.mode, jpeg_quality=split.jpeg_quality,
                num_workers=job.workers, progress=job.progress)
    seconds["ffcv_write"] = time.perf_counter() - t
    for split_name, masks in prepared.gt_masks.items():
        (staging / "gt_masks").mkdir(exist_ok=True)
        np.save(staging / "gt_masks" / f"{split_name}.npy", masks)
    return Written(prepared, seconds, known=known)


def _timed(fn: Callable[[], None]) -> float:
    """Seconds `fn()` took (run in the FFCV copy process)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _copy_to_ffcv(split: stream.ShardSplit, path: Path, workers: int) -> tuple[float, dict]:
    """Copy an image folder's split from its shards into its FFCV file (`preprocess.ffcv_copy`, on
    `workers` processes); returns the seconds it took and the file's {sha256, bytes}, hashed as it was
    written."""
    t = time.perf_counter()
    checksum = copy_to_ffcv(split.reader, path, sizes=split.sizes, jpeg_quality=split.jpeg_quality,
                            num_workers=workers)
    return time.perf_counter() - t, checksum


def _write_folder(listing: ListedSource, staging: Path, plan: dict, job: Job, with_ffcv: bool) -> Written:
    """An image folder's shards (`stream.write_folder`) and, as each split is assembled, its `.beton`
    copied in a background process (`with_ffcv`); the facts the manifest records, with the checksums the
    units and the copies computed."""
    copies: dict = {}                # relpath -> the copy's future
    base = listing.src if listing.src.is_dir() else listing.src.parent       # a list file: its folder

    def on_split(split_name: str, split: stream.ShardSplit) -> None:
        if len(split) == 0:
            raise PreprocessError(f"split {split_name} of {listing.src} has no decodable image "
                                  f"({len(listing.files[split_name])} skipped, see their reasons with a "
                                  "viewer): add valid images")
        if with_ffcv:                # in a process of its own while the other splits' units run
            copies[f"{split_name}.beton"] = ffcv_pool.submit(_copy_to_ffcv, split, staging / f"{split_name}.beton",
                                                             job.workers)

    engine = _engine(job.engine, job.workers)
    seconds: dict[str, float] = {}
    # Forked from this (main) thread: the copy forks again, which numba refuses from a thread.
    with ProcessPoolExecutor(1, mp_context=fork_context()) as ffcv_pool:
        # The copy process imports FFCV at once, while the units run (1.5-3 s that were in series).
        warm = ffcv_pool.submit(_timed, warm_up_ffcv) if with_ffcv else None
        try:
            res = stream.write_folder(listing.files, staging, plan, listing.policy, shard_size=job.shard_size,
                                      engine=engine, progress=job.progress, names_root=base, on_split=on_split)
            t = time.perf_counter()
            if warm is not None:
                seconds[f"ffcv_import{BACKGROUND}"] = warm.result()
            copied = {rel: c.result() for rel, c in copies.items()}
            seconds[f"ffcv_write{BACKGROUND}"] = sum(secs for secs, _ in copied.values())
            seconds["ffcv_wait"] = time.perf_counter() - t
        finally:
            for c in copies.values():
                c.cancel()
    written = PreparedSource(splits=res.splits, params=listing.params, class_names=listing.class_names,
                             image_px=res.image_px, mean=res.mean, std=res.std,
                             size_policy={"side": listing.policy["side"], "max_side_px": listing.policy["max_side"]},
                             skipped=tuple({**x, "path": os.path.relpath(x["path"], base)} for x in res.skipped),
                             stored=res.stored)
    build = {"engine": engine.name, "resumed_units": res.reused,
             "cpu_seconds": {k: round(v, 3) for k, v in res.cpu_seconds.items()}}
    known = {**res.checksums, **{rel: checksum for rel, (_, checksum) in copied.items()}}
    return Written(written, {**seconds, **res.seconds}, build, known)


def _engine(engine: str | object, workers: int):
    if not isinstance(engine, str):
        return engine
    if engine == "ray":
        from preprocess.ray_engine import RayEngine, RayUnavailable
        try:
            return RayEngine(workers)
        except RayUnavailable as e:
            raise PreprocessError(str(e)) from None
    return stream.LocalEngine(workers)


def _manifest(job: Job, written: Written, files: dict[str, dict], seconds: dict[str, float]) -> Manifest:
    """The manifest of a dataset whose files (relpath -> {sha256, bytes}) are all written."""
    prepared = written.source
    splits = prepared.splits
    first = splits["train"]
    return Manifest(
        schema_version=schema.SCHEMA_VERSION,
        dataset=job.name,
        source=job.dataset,
        counts={k: len(v) for k, v in splits.items()},
        class_names=tuple(prepared.class_names),
        image_mode=first.mode,
        image_px=int(prepared.image_px),
        has_masks=bool(first.has_masks),
        mean=prepared.mean,
        std=prepared.std,
        files=files,
        params=prepared.params,
        skipped=prepared.skipped,
        jpeg_quality=schema.JPEG_QUALITY if first.mode == "jpg" else None,
        size_policy=prepared.size_policy,
        mask_source=prepared.mask_source,
        gt_masks={k: f"gt_masks/{k}.npy" for k in prepared.gt_masks},
        formats={**({"ffcv": {k: f"{k}.beton" for k in splits}} if all(f"{k}.beton" in files for k in splits) else {}),
                 "dali": {k: sorted(f for f in files if f.startswith(f"{k}/") and f.endswith(".tar"))
                          for k in splits}},
        shard_size=job.shard_size,
        build={"workers": job.workers, "seconds": {k: round(v, 3) for k, v in seconds.items()},
               **({"images": prepared.stored} if prepared.stored else {}), **written.build},
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


M = TypeVar("M")                    # what a `write_staged` fill made, for its manifest


def write_staged(staging: Path, final: Path, fill: Callable[[Path], M],
                 manifest_of: Callable[[M, Hashed], Manifest], failure: str, *,
                 resumable: bool = False, workers: int = 1) -> Manifest:
    """The one way a dataset folder is written: `fill(staging)` writes every file into the staging
    folder; the files are hashed, `manifest_of(what fill returned, the hashed files)` is written last
    (`write_manifest`), the bookkeeping (top-level dot names but the stamp) is removed and the folder
    is swapped in for `final` (`swap_in`).

    Args:
        fill: writes the files; what it returns goes to `manifest_of` (a `Written` or a `Known` also
            brings the checksums its writers computed, which are not computed again).
        resumable: the staging folder may hold an interrupted run's work that `fill` resumes; it is
            kept when this run fails too. Otherwise it must not exist and is removed on failure.
        workers: threads that hash the files.

    Raises:
        PreprocessError: an OSError while writing: `failure` with `{what}` filled in (e.g. "disk is
            full"); `final` is left as it was. Any other error propagates, also leaving `final` as it was.
    """
    try:
        staging.mkdir(exist_ok=resumable)
        made = fill(staging)
        t = time.perf_counter()
        files = hash_files(staging, workers, made.known if isinstance(made, (Written, Known)) else None)
        manifest = manifest_of(made, Hashed(files, time.perf_counter() - t))
        write_manifest(staging, manifest)
        for p in staging.iterdir():
            if p.name.startswith(".") and p.name != schema.VERIFIED_NAME:
                _remove(p)
        swap_in(staging, final)
    except OSError as e:
        if not resumable:
            remove_quietly(staging)
        what = "disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise PreprocessError(failure.format(what=what)) from None
    except BaseException:
        if not resumable:
            remove_quietly(staging)
        raise
    return manifest


def remove_quietly(path: Path) -> None:
    try:
        _remove(path)
    except OSError:
        pass        # the next run removes a stale staging folder


def summary(dataset_dir: Path) -> str:
    """A short human summary of a complete dataset: counts, files, sizes, throughput."""
    m = schema.read_manifest(dataset_dir, verify="size")
    n = sum(m.counts.values())
    size = sum(f["bytes"] for f in m.files.values())
    secs = m.build.get("seconds", {})
    lines = [f"{m.dataset} ({m.source}): " + ", ".join(f"{k} {v}" for k, v in m.counts.items())
             + f" images, {f'{m.num_classes} classes' if m.labelled else 'no labels'}, {m.image_mode} {m.image_px} px, masks "
             + ("yes" if m.has_masks else "no")]
    by_kind: dict[str, list[int]] = {}
    for rel, f in m.files.items():
        kind = ("ffcv .beton" if rel.endswith(".beton") else "dali shards" if rel.endswith((".tar", ".idx"))
                else "ground-truth masks" if rel.startswith("gt_masks/") else "other")
        by_kind.setdefault(kind, [0, 0])
        by_kind[kind][0] += 1
        by_kind[kind][1] += f["bytes"]
    for kind, (count, b) in sorted(by_kind.items()):
        lines.append(f"  {kind:20s} {count:5d} files {b / 2**20:9.1f} MiB")
    lines.append(f"  total {len(m.files)} files, {size / 2**20:.1f} MiB in {dataset_dir}")
    if m.skipped:
        lines.append(f"  skipped {len(m.skipped)} unreadable files (listed in manifest.json)")
    if m.build.get("images"):
        lines.append("  JPEGs stored as they are / re-encoded: " + ", ".join(
            f"{k} {v['as_is']} / {v['re_encoded']}" for k, v in m.build["images"].items()))
    if secs.get("total"):
        stages = ", ".join(f"{k} {v:.1f}s" for k, v in secs.items() if k != "total" and not k.endswith(BACKGROUND))
        beside = ", ".join(f"{k.removesuffix(BACKGROUND)} {v:.1f}s" for k, v in secs.items() if k.endswith(BACKGROUND))
        lines.append(f"  {n / secs['total']:.0f} images/s on {m.build['workers']} workers "
                     f"({secs['total']:.1f}s: {stages}" + (f"; beside them {beside}" if beside else "") + ")")
    return "\n".join(lines)


def command_seconds(dataset_dir: Path, started_s: float, ended_s: float) -> str | None:
    """The line that accounts for a whole `python -m preprocess` that wrote `dataset_dir`: its
    process's age when `prepare_dataset` started (`started_s`: interpreter start-up and imports) and
    when it returned (`ended_s`), around the run's own stages (the summary's total); what is after
    them is the manifest written, the folder swapped in and the lock released. None when the dataset
    was already complete (nothing was written)."""
    m = schema.read_manifest(dataset_dir, verify="size")
    total = m.build.get("seconds", {}).get("total")
    if total is None or total > ended_s - started_s + 0.05:
        return None
    return (f"  {ended_s:.1f}s in this command: start-up and imports {started_s:.1f}s, the stages above "
            f"{total:.1f}s, manifest, swap and lock {max(0.0, ended_s - started_s - total):.1f}s")
