"""The streamed writer of image folders: every image read and decoded once, straight into its DALI
shard, on all cores, resumable, on a local process pool or on Ray Data.

A split's sorted file listing is cut into work units of `shard_size` files; unit n becomes shard n.
`run_unit`, in one process, reads and decodes each file once (`imagefolder.try_read`), adds its
pixel sums to the split's statistics (train), keeps its JPEG bytes when they need no work or
encodes it once, and appends it to the unit's part shard; an unreadable file is a skip with its
reason. The part's `.tar` and `.idx` are renamed into place, then the unit's record `.json` is
written last: a unit with a record is finished, anything else is redone. Memory is one image per
process plus the listing.

    OUT/.<name>.staging/
        .plan.json                                  what this folder is built from (the resume key)
        .parts/<split>/shard-NNNNNN.tar|.idx|.json  finished units (records numbered as if no file
                                                    were skipped)
        <split>/shard-NNNNNN.tar|.idx               the dataset's shards: the parts under their final
                                                    indices (hard links; copies renumbered after a skip)
        <split>/records.npy                         the split's record table, for the loaders
        <split>/names.txt                           each record's source file, relative to `names_root`
        <split>.beton                               written from those shards, nothing decoded

Resuming: a run with the same plan (source, size policy, shard size, file listing) keeps every unit
whose record exists, whose files are intact and whose source files still have their recorded size
and mtime; the rest is redone. Another plan, or --force, starts over. An engine only decides where
`run_unit` runs (`LocalEngine` here, `RayEngine` in preprocess/ray_engine.py); the driver
(`write_folder`) merges the units' records and the caller writes the manifest last.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import cv2
import numpy as np

from pipelines import schema
from pipelines.shards import TABLE_COLUMNS, ShardReader, coverage_ppm, save_record_table
from pipelines.processes import fork_context
from preprocess import imagefolder
from preprocess.progress import bar as progress_bar
from preprocess.records import Record, mean_std, pixel_sums
from preprocess.write_dali import ShardWriter, encode_image, record_members, renumber_shard

PLAN_NAME = ".plan.json"
PARTS = ".parts"
_PLAN_VERSION = 1              # bump when a unit's output for the same input changes


@dataclass(frozen=True)
class Policy:
    """What every unit of one run shares."""

    parts: str                 # the staging folder's `.parts`
    max_side: int
    side: str
    jpeg_quality: int = schema.JPEG_QUALITY


@dataclass(frozen=True)
class Unit:
    """`shard_size` consecutive files of a split's listing, written as shard `number`."""

    split: str
    number: int
    start: int                                 # position of the first file in the split's listing
    files: tuple[tuple[str, int], ...]         # (path, label)
    stats: bool                                # add pixel sums (the train split)

    @property
    def record_path(self) -> str:
        return f"{self.split}/{schema.SHARD_PATTERN.format(self.number).replace('.tar', '.json')}"


def _stat(path: str) -> list[int]:
    """`schema.file_stat_key` ([bytes, mtime_ns]), [-1, -1] for a file that is gone."""
    try:
        return schema.file_stat_key(path)
    except OSError:
        return [-1, -1]


def run_unit(unit: Unit, policy: Policy) -> dict:
    """Read, decode, check and store the unit's files as its part shard; returns its record (also
    written as `<part>.json`, last).

    Raises:
        OSError: writing failed (e.g. a full disk); the part's temporary files are removed.
    """
    out_dir = Path(policy.parts) / unit.split
    out_dir.mkdir(parents=True, exist_ok=True)
    records, skipped, sources = [], [], []
    sums, as_is = np.zeros((3, 3)), 0
    secs = dict.fromkeys(("read_decode", "stats", "encode", "write", "checksum"), 0.0)
    with ShardWriter(out_dir, unit.number) as shard:
        for path, label in unit.files:
            sources.append(_stat(path))
            t0 = time.perf_counter()
            image, raw, reason = imagefolder.try_read(path, policy.max_side, policy.side)
            t1 = time.perf_counter()
            secs["read_decode"] += t1 - t0
            if reason is not None:
                skipped.append({"path": path, "reason": reason})
                continue
            if unit.stats:
                sums += pixel_sums(image)
            t2 = time.perf_counter()
            if raw is None:
                raw = encode_image(image, "jpg", policy.jpeg_quality)[1]
            else:
                as_is += 1
            t3 = time.perf_counter()
            index = unit.start + len(records)              # final unless an earlier file was skipped
            rec = Record(image=None, label=label, index=index, encoded=raw, size=image.shape[:2])
            shard.add(schema.record_key(index), record_members(rec, "jpg", policy.jpeg_quality))
            records.append([image.shape[0], image.shape[1], label])
            secs["stats"] += t2 - t1
            secs["encode"] += t3 - t2
            secs["write"] += time.perf_counter() - t3
    t = time.perf_counter()
    files = (shard.tar_path, shard.idx_path)
    digests = [schema.sha256_file(f) for f in files]          # here, in parallel, not in the driver
    secs["checksum"] = time.perf_counter() - t
    result = {"split": unit.split, "number": unit.number, "start": unit.start, "sources": sources,
              "records": records, "skipped": skipped, "as_is": as_is,
              "sums": sums.tolist() if unit.stats else None, "seconds": secs,
              "bytes": [f.stat().st_size for f in files], "sha256": digests}
    _write_json(out_dir / Path(unit.record_path).name, result)
    return result


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def finished(unit: Unit, policy: Policy) -> dict | None:
    """The record of a unit an earlier run finished, or None when it must be (re)done: no record,
    its files missing or resized, or a source file whose size or mtime changed since."""
    parts = Path(policy.parts)
    try:
        result = json.loads((parts / unit.record_path).read_text())
        tar = parts / unit.split / schema.SHARD_PATTERN.format(unit.number)
        idx = parts / unit.split / schema.INDEX_PATTERN.format(unit.number)
        if [tar.stat().st_size, idx.stat().st_size] != result["bytes"]:
            return None
    except (OSError, ValueError, KeyError):
        return None
    if result["sources"] != [_stat(p) for p, _ in unit.files]:
        return None
    return result


# ------------------------------------------------------------------------------------------------
# Engines: where units run.
# ------------------------------------------------------------------------------------------------

class WorkerDied(OSError):
    """A worker process died mid-unit (out of memory, a signal); finished units are kept."""


class LocalEngine:
    """Units on a pool of forked processes on this machine, in the given order, each as soon as a
    process is free (`workers` 1: in this process). A worker that dies stops the run with
    `WorkerDied` instead of waiting forever; the next run resumes."""

    name = "local"

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def map(self, fn: Callable[[Unit, Policy], dict], units: list[Unit], policy: Policy) -> Iterator[dict]:
        """Yield `fn(unit, policy)` for every unit, in the order they finish."""
        with one_opencv_thread():
            if self.workers <= 1 or len(units) <= 1:
                for u in units:
                    yield fn(u, policy)
                return
            pool = ProcessPoolExecutor(min(self.workers, len(units)), mp_context=fork_context())
            try:
                futures = [pool.submit(fn, u, policy) for u in units]
                for f in as_completed(futures):
                    yield f.result()
            except BrokenProcessPool:
                raise WorkerDied(errno.EIO, "a worker process died (out of memory?)") from None
            finally:
                pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def one_opencv_thread() -> Iterator[None]:
    """OpenCV on one thread in this process and the processes it forks meanwhile: units are the
    parallelism, and OpenCV's own threads oversubscribe the cores (2 workers on 2 cores: 1,085-1,311
    -> 1,435 images/s). Set before forking: a forked child that changes OpenCV's thread count while
    the parent's thread pool exists deadlocks."""
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(threads)


# ------------------------------------------------------------------------------------------------
# The driver.
# ------------------------------------------------------------------------------------------------

@dataclass
class ShardSplit:
    """A `PreparedSplit` over written JPEG shards: `split[i]` is record i's bytes and size, one
    positioned read (`pipelines.shards.ShardReader`), what the FFCV writer copies without decoding."""

    reader: ShardReader                # records in index order
    sizes: np.ndarray                  # (N, 2) int64: H, W
    mode: str = "jpg"
    jpeg_quality: int = schema.JPEG_QUALITY
    has_masks: bool = False

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> Record:
        i = int(i)
        h, w = (int(v) for v in self.sizes[i])
        return Record(image=None, label=int(self.reader.labels[i]), index=i, encoded=self.reader.image(i),
                      size=(h, w))


@dataclass
class FolderResult:
    """What the streamed pass learnt: the splits the FFCV writer reads and the manifest's facts."""

    splits: dict[str, ShardSplit]
    skipped: list[dict]                # {"path" (absolute), "reason"}
    image_px: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    stored: dict[str, dict]            # split -> {"as_is", "re_encoded"}
    seconds: dict[str, float]          # wall: "units", "assemble"
    cpu_seconds: dict[str, float]      # summed over processes: read_decode, stats, encode, write, checksum
    reused: int                        # units finished by an earlier run
    checksums: dict[str, dict]         # relpath -> {sha256, bytes} of shards the units already hashed


def plan_units(files: dict[str, list[tuple[str, int]]], shard_size: int) -> list[Unit]:
    """The work units of every split, in split and shard order."""
    return [Unit(split, n, a, tuple(listing[a:a + shard_size]), stats=split == "train")
            for split, listing in files.items() for n, a in enumerate(range(0, len(listing), shard_size))]


def plan_of(files: dict[str, list[tuple[str, int]]], params: dict, shard_size: int) -> dict:
    """The resume key: same plan, same output."""
    listing = hashlib.sha256("\n".join(f"{s}\t{p}\t{lab}" for s, fl in files.items() for p, lab in fl).encode())
    return {"version": _PLAN_VERSION, "params": params, "shard_size": shard_size,
            "listing_sha256": listing.hexdigest()}


def reusable(staging: Path, plan: dict) -> bool:
    """Whether `staging` holds units of this very plan (a resume), rather than another run's."""
    try:
        return json.loads((staging / PLAN_NAME).read_text()) == json.loads(json.dumps(plan))
    except (OSError, ValueError):
        return False


def _remove_temporaries(parts: Path) -> None:
    """Temporary files of units a killed process left (never a finished part)."""
    for tmp in parts.rglob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def write_folder(files: dict[str, list[tuple[str, int]]], staging: Path, plan: dict, policy_args: dict, *,
                 shard_size: int, engine, progress: bool, names_root: Path,
                 on_split: Callable[[str, ShardSplit], None] | None = None) -> FolderResult:
    """Write every split's shards into `staging` (created by the caller, possibly holding a finished
    part of this plan), resuming finished units; each split's final shards are assembled as soon as
    its last unit is in.

    Args:
        files: split -> [(path, label)], sorted (`imagefolder.list_image_folder`).
        staging: the dataset's staging folder.
        plan: `plan_of(...)`, recorded as `.plan.json`.
        policy_args: `Policy` fields but `parts` (max_side, side).
        shard_size: files per unit and shard.
        engine: `LocalEngine` or `RayEngine`.
        progress: a bar with images/s and ETA on a terminal, a line a minute in a log
            (`preprocess.progress`); a summary line per split in any case.
        names_root: the folder the records' names (`schema.NAMES_NAME`) are relative to.
        on_split: called with each assembled split while the other splits' units still run (the
            caller starts its FFCV copy there); splits go in `files` order, largest units first.

    Raises:
        OSError: a unit or the assembly failed to write; finished units stay for the next run.
    """
    _write_json(staging / PLAN_NAME, plan)
    parts = staging / PARTS
    parts.mkdir(exist_ok=True)
    _remove_temporaries(parts)
    policy = Policy(parts=str(parts), **policy_args)
    units = plan_units(files, shard_size)
    count = {s: sum(u.split == s for u in units) for s in files}
    results: dict[tuple[str, int], dict] = {}
    for u in units:
        if (r := finished(u, policy)) is not None:
            results[(u.split, u.number)] = r
    order = {s: k for k, s in enumerate(files)}
    todo = sorted((u for u in units if (u.split, u.number) not in results),
                  key=lambda u: (order[u.split], -len(u.files)))
    if results:
        print(f"resuming: {len(results)} of {len(units)} shards were written by an earlier run; "
              f"writing the other {len(todo)}", file=sys.stderr)
    t0 = time.perf_counter()
    left = {s: sum(1 for u in todo if u.split == s) for s in files}
    splits: dict[str, ShardSplit] = {}
    known: dict[str, dict] = {}
    seconds = {"assemble": 0.0}

    def split_done(s: str) -> None:
        done = [results[(s, n)] for n in range(count[s])]
        _split_line(s, done, time.perf_counter() - t0 if any(u.split == s for u in todo) else 0.0, bar)
        t = time.perf_counter()
        gone = {x["path"] for r in done for x in r["skipped"]}
        names = relative([f for u in units if u.split == s for f, _ in u.files if f not in gone], names_root)
        splits[s] = _assemble(s, done, staging, parts, known, names)
        seconds["assemble"] += time.perf_counter() - t
        if on_split is not None:
            on_split(s, splits[s])

    bar = progress_bar(sum(len(u.files) for u in todo), f"read/decode/write ({engine.name})", progress,
                       smoothing=0.1)
    try:
        for s in files:
            if left[s] == 0:
                split_done(s)
        for r in engine.map(run_unit, todo, policy):
            results[(r["split"], r["number"])] = r
            bar.update(len(r["sources"]))
            left[r["split"]] -= 1
            if left[r["split"]] == 0:
                split_done(r["split"])
    finally:
        bar.close()
        _remove_temporaries(parts)
    seconds["units"] = time.perf_counter() - t0 - seconds["assemble"]
    return _facts(files, results, {s: splits[s] for s in files}, seconds, reused=len(units) - len(todo),
                  known=known)


def relative(paths: list[str], root: Path) -> list[str]:
    """`paths` relative to `root`: the prefix cut off where a path starts with it (a listing of `root`:
    0.2 µs a path), `os.path.relpath` elsewhere (3.5 µs: 4.7 s over ImageNet's 1.33 M files)."""
    prefix = os.path.join(str(root), "")
    return [p[len(prefix):] if p.startswith(prefix) else os.path.relpath(p, root) for p in paths]


def _split_line(split: str, done: list[dict], secs: float, bar) -> None:
    """One line when a split's last unit is in: its images and what became of them."""
    n = sum(len(r["sources"]) for r in done)
    stored = sum(len(r["records"]) for r in done)
    as_is = sum(r["as_is"] for r in done)
    when = f"done {secs:.1f} s into the pass" if secs > 0 else "all written by an earlier run"
    bar.write(f"{split}: {n} images, {stored} stored ({as_is} as they are, {stored - as_is} re-encoded), "
              f"{n - stored} skipped; {when}", file=sys.stderr)


def _assemble(split: str, results: list[dict], staging: Path, parts: Path, known: dict[str, dict],
              names: list[str]) -> ShardSplit:
    """The split's final shards from its parts (records 0..N-1 in listing order), their source files'
    `names` as `schema.NAMES_NAME`, and its `ShardSplit`; adds the checksums the units computed of the
    shards used as they are to `known`."""
    out = staging / split
    if out.exists():
        shutil.rmtree(out)                 # an earlier attempt's assembly: redone from the parts
    out.mkdir()
    tables, sizes, number, first = [], [], 0, 0        # per unit: its rows of the record table, (H, W)
    for r in results:
        if not r["records"]:
            continue                       # every file of this unit was skipped: no shard
        src_tar = parts / split / schema.SHARD_PATTERN.format(r["number"])
        src_idx = parts / split / schema.INDEX_PATTERN.format(r["number"])
        tar = out / schema.SHARD_PATTERN.format(number)
        if first == r["start"]:                    # no skip before: the part's indices are final
            for a, b, digest, size in zip((src_tar, src_idx), (tar, out / schema.INDEX_PATTERN.format(number)),
                                          r["sha256"], r["bytes"]):
                _link_or_copy(a, b)
                known[b.relative_to(staging).as_posix()] = {"sha256": digest, "bytes": size}
        else:
            renumber_shard(src_tar, src_idx, out, number, first)
        index = schema.read_index(out / schema.INDEX_PATTERN.format(number))
        image = np.array([m["jpg"] for m in index], np.int64).reshape(-1, 2)    # offset, size in the shard
        hwl = np.array(r["records"], np.int64).reshape(-1, 3)                 # H, W, label of each record
        k = len(hwl)
        tables.append(np.column_stack([np.full(k, number), image, np.full(k, -1), np.zeros(k),      # no mask
                                       hwl[:, 2], np.arange(first, first + k),
                                       np.full(k, coverage_ppm(schema.NO_MASK_COVERAGE))]).astype(np.int64))
        sizes.append(hwl[:, :2])
        number += 1
        first += k
    save_record_table(out, np.concatenate(tables) if tables else np.zeros((0, len(TABLE_COLUMNS)), np.int64))
    if len(names) != first:
        raise AssertionError(f"{split}: {len(names)} names for {first} records")
    (out / schema.NAMES_NAME).write_text("".join(f"{n}\n" for n in names), encoding="utf-8")
    return ShardSplit(ShardReader.open(out, first), np.concatenate(sizes) if sizes else np.zeros((0, 2), np.int64))


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)          # a filesystem without hard links


def _facts(files: dict, results: dict, splits: dict[str, ShardSplit], seconds: dict, reused: int,
           known: dict[str, dict]) -> FolderResult:
    skipped = [s for key in sorted(results) for s in results[key]["skipped"]]
    sums = np.zeros((3, 3))
    for r in results.values():
        if r["sums"] is not None:
            sums += np.array(r["sums"])
    cpu: dict[str, float] = {}
    for r in results.values():
        for k, v in r["seconds"].items():
            cpu[k] = cpu.get(k, 0.0) + v
    stored = {}
    for s in files:
        n = len(splits[s])
        as_is = sum(r["as_is"] for (k, _), r in results.items() if k == s)
        stored[s] = {"as_is": as_is, "re_encoded": n - as_is}
    px = max((int(sp.sizes.max()) for sp in splits.values() if len(sp)), default=0)
    mean, std = mean_std(sums) if sums[2, 0] > 0 else ((0.0,) * 3, (0.0,) * 3)   # no image: the caller refuses
    return FolderResult(splits=splits, skipped=skipped, image_px=px, mean=mean, std=std, stored=stored,
                        seconds=seconds, cpu_seconds=cpu, reused=reused, checksums=known)
