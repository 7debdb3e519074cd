"""Reading the webdataset shards of a split by record: every loader (and the benches' ceilings).

`scan_shards` indexes a split once from the shards' index files, which give every member's offset
and size (no tar parsing), plus each record's small `.rec` member (label, index, mask coverage);
`ShardReader` then reads a record's members with one positioned read each. `image_size` reads an
encoded image's height and width from its header, so a crop can be drawn before anything is decoded.
The layout is the one of `pipelines/schema.py`.

At scale the scan is the slow part: one read of a `.rec` member per record (24 µs a record on 2 cores
with the files in the page cache: 4.8 s for 200,000 records, about 30 s for ImageNet's 1.28 M, on
every rank, for every loader; more from a cold disk). So the writers also save the split's record
table (`write_record_table`, `schema.RECORDS_NAME`: 8 int64 columns a record), and `ShardReader.open`
maps it instead (11 ms at 200,000 records), and a reader sent to a worker process (a fork server's, a
spawned one) is sent its path, not its columns (95 bytes instead of 12.8 MB). A dataset written
before the table existed is scanned as before, until `make preprocess` adds its tables
(`preprocess.prepare.add_record_tables`).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from pipelines import schema


@dataclass(frozen=True)
class ShardRecord:
    """Where the members of one record live inside its shard."""

    shard: str
    image_offset: int
    image_size: int
    mask_offset: int      # -1 without a mask
    mask_size: int
    label: int
    index: int
    coverage: float       # fraction of mask pixels >= 128, or schema.NO_MASK_COVERAGE


def scan_shards(split_dir: Path, count: int | None = None) -> list[ShardRecord]:
    """Index every record of a split from its shards' index files (and the small `.rec` members).

    Raises:
        schema.DatasetError: no shards, a shard without its index, a record without image or `.rec`,
            or indices that are not exactly 0..N-1 (`count`: N, when given, must match).
    """
    shards = sorted(Path(split_dir).glob("shard-*.tar"))
    if not shards:
        raise schema.DatasetError(f"no shard-*.tar files in {split_dir}; run `python -m preprocess` for this dataset")
    image_exts = schema.DALI_IMAGE_EXT.split(";")
    entries: list[ShardRecord] = []
    for shard in shards:
        idx = shard.with_suffix(".idx")
        if not idx.is_file():
            raise schema.DatasetError(f"missing shard index {idx}; re-run `python -m preprocess` with --force")
        fd = os.open(shard, os.O_RDONLY)
        try:
            for members in schema.read_index(idx):
                image = next((members[e] for e in image_exts if e in members), None)
                rec = members.get(schema.DALI_RECORD_EXT)
                if image is None or rec is None:
                    raise schema.DatasetError(
                        f"a record in {shard.name} lacks its image or .{schema.DALI_RECORD_EXT} member; "
                        "re-run `python -m preprocess` to rewrite the dataset")
                label, index, cov_ppm = (int(v) for v in np.frombuffer(os.pread(fd, rec[1], rec[0]), dtype="<i8")[:3])
                mask = members.get(schema.DALI_MASK_EXT, (-1, 0))
                entries.append(ShardRecord(
                    shard=str(shard), image_offset=image[0], image_size=image[1], mask_offset=mask[0],
                    mask_size=mask[1], label=label, index=index,
                    coverage=cov_ppm / 1e6 if cov_ppm >= 0 else schema.NO_MASK_COVERAGE))
        finally:
            os.close(fd)
    entries.sort(key=lambda e: e.index)
    if count is not None and len(entries) != count:
        raise schema.DatasetError(
            f"{split_dir} holds {len(entries)} records, the manifest says {count}; re-run `python -m preprocess` "
            "with --force")
    if [e.index for e in entries] != list(range(len(entries))):
        raise schema.DatasetError(
            f"record indices in {split_dir} are not 0..{len(entries) - 1}; re-run `python -m preprocess`")
    return entries


# The record table's columns (`schema.RECORDS_NAME`), all int64; coverage in parts per million, -1 without a
# mask (as the `.rec` member stores it).
TABLE_COLUMNS = ("shard", "image_offset", "image_size", "mask_offset", "mask_size", "label", "index",
                 "coverage_ppm")
SCAN_NOTE_RECORDS = 100_000        # an old dataset's split this large gets a note on what the scan costs
_NOTED: set[str] = set()


def coverage_ppm(coverage: float) -> int:
    """A mask coverage fraction in parts per million as the `.rec` member and the record table store
    it: -1 for `schema.NO_MASK_COVERAGE`."""
    return -1 if coverage == schema.NO_MASK_COVERAGE else int(round(coverage * 1_000_000))


def write_record_table(split_dir: Path, records: list[ShardRecord]) -> Path:
    """Save the record table of a split whose shards are written (`records`: its `scan_shards`, or what
    the writer knows of them, every shard inside `split_dir`), atomically; returns its path."""
    reader = ShardReader(records)
    table = np.array(reader.cols)
    # the reader numbers the shards it saw; the table names each by the number in its file name
    table[:, 0] = np.array([int(Path(s).stem.split("-")[1]) for s in reader.shards], np.int64)[table[:, 0]]
    return save_record_table(split_dir, table)


def save_record_table(split_dir: Path, table: np.ndarray) -> Path:
    """Save `table` ((N, 8) int64, `TABLE_COLUMNS`, the shard column numbering `shard-NNNNNN.tar` of
    `split_dir`) as the split's record table, atomically; returns its path."""
    split_dir = Path(split_dir)
    table = np.asarray(table, np.int64).reshape(-1, len(TABLE_COLUMNS))
    path = split_dir / schema.RECORDS_NAME
    tmp = split_dir / f".{schema.RECORDS_NAME}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, table)
    os.replace(tmp, path)
    return path


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}   # frame headers


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) of an encoded JPEG or PNG, read from its header (nothing is decoded).

    The stored images are upright (preprocessing applies EXIF orientation), so the header's size is
    the decoded size.

    Raises:
        schema.DatasetError: bytes that are neither a JPEG with a frame header nor a PNG.
    """
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        w, h = struct.unpack(">II", data[16:24])              # IHDR is the first chunk
        return h, w
    if data[:2] == b"\xff\xd8":
        pos, n = 2, len(data)
        while pos + 4 <= n:
            if data[pos] != 0xFF:
                break
            marker = data[pos + 1]
            if marker == 0xFF:                                 # fill byte before a marker
                pos += 1
                continue
            if marker in _JPEG_SOF:
                if pos + 9 > n:
                    break
                h, w = struct.unpack(">HH", data[pos + 5:pos + 9])
                return h, w
            if marker == 0xD8 or 0xD0 <= marker <= 0xD7 or marker == 0x01:   # markers without a length
                pos += 2
                continue
            pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    raise schema.DatasetError("an image in the shards is neither a PNG nor a JPEG with a frame header; "
                              "re-run `python -m preprocess` with --force")


# Descriptors one reader keeps open at most, the least recently used closed first (`ShardReader._read`):
# whatever the shard count (ImageNet: 1,282 train shards), a process holds a fixed number, under the
# 1,024 open files that Ubuntu and many clusters allow a process. A shuffled epoch reads each record
# from a random shard, so at ImageNet's shard count an LRU this small misses on nearly every read:
# what it saves is the sequential readers' reopening (evaluation, saliency, the writers' read-back).
# The cost of a miss (open + close beside the read) is in docs/benchmarks.md.
MAX_OPEN_SHARDS = 16


class ShardReader:
    """Positioned reads of records' members with `os.pread` (no seek, so threads may share a
    descriptor), holding at most `MAX_OPEN_SHARDS` descriptors whatever the shard count. The records
    are numpy columns: the split's record table mapped from its file (`open`), or made from scanned
    records. A reader pickled for a worker process carries the table's path when it has one (a few
    hundred bytes whatever the split's size), else its columns (64 bytes a record); each worker opens
    its own descriptors. `close` (or the reader's end) closes them."""

    def __init__(self, records: list[ShardRecord]) -> None:
        self.shards = sorted({r.shard for r in records})
        sid = {s: i for i, s in enumerate(self.shards)}
        self.cols = np.array([(sid[r.shard], r.image_offset, r.image_size, r.mask_offset, r.mask_size, r.label,
                               r.index, coverage_ppm(r.coverage)) for r in records],
                             np.int64).reshape(-1, len(TABLE_COLUMNS))                  # (N, 8)
        self.table_path: str | None = None
        self._fds: OrderedDict[str, int] = OrderedDict()     # shard -> descriptor, least recently used first
        self._lock = threading.Lock()

    @classmethod
    def open(cls, split_dir: Path, count: int | None = None) -> "ShardReader":
        """The reader of a written split: its record table mapped when the writer saved one, else its
        shards scanned (`scan_shards`, a dataset written before the table existed).

        Raises:
            schema.DatasetError: a table that does not match the split (`count` records, indices
                0..N-1, shards that exist), or what `scan_shards` raises.
        """
        split_dir = Path(split_dir)
        path = split_dir / schema.RECORDS_NAME
        if not path.is_file():
            if count is not None and count >= SCAN_NOTE_RECORDS and str(split_dir) not in _NOTED:
                _NOTED.add(str(split_dir))
                print(f"{split_dir} has no {schema.RECORDS_NAME} (written before it existed): reading its "
                      f"{count:,} records from the shards instead, for every loader; `make preprocess` for this "
                      "dataset adds it (one scan, nothing else rewritten)", file=sys.stderr)
            return cls(scan_shards(split_dir, count))
        reader = cls.__new__(cls)
        reader._map(str(path))
        n, cols = len(reader.cols), reader.cols
        fix = "re-run `python -m preprocess` with --force"
        if cols.ndim != 2 or cols.shape[1] != len(TABLE_COLUMNS) or cols.dtype != np.int64:
            raise schema.DatasetError(f"{path} is not a table of {len(TABLE_COLUMNS)} int64 columns ({cols.dtype}, "
                                      f"shape {cols.shape}); {fix}")
        if count is not None and n != count:
            raise schema.DatasetError(f"{path} holds {n} records, the manifest says {count}; {fix}")
        if not np.array_equal(reader.indices, np.arange(n)):
            raise schema.DatasetError(f"record indices in {path} are not 0..{n - 1}; {fix}")
        missing = [reader.shards[s] for s in np.unique(cols[:, 0]) if not os.path.isfile(reader.shards[s])]
        if missing:
            raise schema.DatasetError(f"{path} names shard {missing[0]}, which does not exist; {fix}")
        return reader

    def _map(self, path: str) -> None:
        self.table_path, self._fds, self._lock = path, OrderedDict(), threading.Lock()
        self.cols = np.load(path, mmap_mode="r")
        last = int(self.cols[:, 0].max()) if self.cols.ndim == 2 and len(self.cols) else -1
        split_dir = os.path.dirname(path)
        self.shards = [os.path.join(split_dir, schema.SHARD_PATTERN.format(s)) for s in range(last + 1)]

    def __getstate__(self) -> dict:
        if self.table_path is not None:
            return {"table_path": self.table_path}
        return {k: v for k, v in self.__dict__.items() if k not in ("_fds", "_lock", "coverage")}

    def __setstate__(self, state: dict) -> None:
        if "cols" not in state:
            self._map(state["table_path"])
            return
        self.__dict__.update(state)
        self._fds, self._lock = OrderedDict(), threading.Lock()

    def __len__(self) -> int:
        return len(self.cols)

    @property
    def labels(self) -> np.ndarray:
        """(N,) int64 class labels (`schema.NO_LABEL` in an unlabelled dataset)."""
        return self.cols[:, 5]

    @property
    def indices(self) -> np.ndarray:
        """(N,) int64 dataset indices."""
        return self.cols[:, 6]

    @cached_property
    def coverage(self) -> np.ndarray:
        """(N,) float64 mask coverage in [0, 1], or `schema.NO_MASK_COVERAGE` without a mask."""
        ppm = np.asarray(self.cols[:, 7])
        return np.where(ppm >= 0, ppm / 1e6, schema.NO_MASK_COVERAGE)

    def _read(self, shard: str, offset: int, size: int) -> bytes:
        # A descriptor in use is out of the LRU, so an eviction never closes one another thread reads
        # from; two threads reading one shard at once each open their own (at most one per thread more).
        with self._lock:
            fd = self._fds.pop(shard, None)
        if fd is None:
            fd = os.open(shard, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, size, offset)
        finally:
            with self._lock:
                if shard in self._fds:
                    os.close(fd)
                else:
                    self._fds[shard] = fd
                    while len(self._fds) > MAX_OPEN_SHARDS:
                        os.close(self._fds.popitem(last=False)[1])

    @property
    def open_descriptors(self) -> int:
        """How many shard descriptors this reader holds now (at most `MAX_OPEN_SHARDS`)."""
        return len(self._fds)

    def close(self) -> None:
        """Close every descriptor this reader holds; a later read opens what it needs again."""
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])

    def __del__(self) -> None:
        fds = getattr(self, "_fds", None)
        while fds:
            try:
                os.close(fds.popitem()[1])
            except OSError:
                pass

    def image(self, i: int) -> bytes:
        """The encoded image of record i (JPEG or PNG bytes)."""
        s, offset, size = self.cols[i, :3].tolist()
        return self._read(self.shards[s], offset, size)

    def mask(self, i: int) -> bytes | None:
        """The encoded mask of record i (PNG bytes), or None without one."""
        s, _, _, offset, size = self.cols[i, :5].tolist()
        return self._read(self.shards[s], offset, size) if offset >= 0 else None
