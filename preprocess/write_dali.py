"""DALI writer: one split → webdataset tar shards plus the DALI index file of each shard.

Layout (names from `pipelines.schema`): `out_dir/shard-NNNNNN.tar` holding, per record and in index
order, `<key>.jpg` (mode "jpg", JPEG at `split.jpeg_quality`) or `<key>.png` (mode "raw", lossless),
`<key>.cls` (ASCII label), `<key>.rec` (little-endian int64 [label, index, coverage ppm or -1]) and,
when the split has masks, `<key>.mask.png`; and `out_dir/shard-NNNNNN.idx`, the `wds2idx` v1.2 index
that `fn.readers.webdataset(index_paths=...)` reads. The index is written from the offsets known while
writing the tar, so no second pass over the archive is needed. Last, the split's record table
(`out_dir/records.npy`, `pipelines.shards.write_record_table`), which the loaders map.

`ShardWriter` is the one writer of a shard (used by `write_dali` for in-memory splits and by the
streamed image-folder writer, `preprocess/stream.py`); `renumber_shard` copies a shard under new
record indices. Every file is written under a temporary name and renamed into place; the caller
(`preprocess/prepare.py`) stages the whole split folder and renames it.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines import schema
from pipelines.processes import fork_context
from pipelines.shards import coverage_ppm, scan_shards, write_record_table
from preprocess.progress import bar as progress_bar
from preprocess.records import PreparedSplit, Record, check_record, encode_mask_png, mask_coverage


def encode_image(image: np.ndarray, mode: str, quality: int) -> tuple[str, bytes]:
    """(extension, bytes) of a (H, W, 3) uint8 image: JPEG at `quality` (mode "jpg") or PNG ("raw")."""
    buf = io.BytesIO()
    pil = Image.fromarray(np.ascontiguousarray(image), mode="RGB")
    if mode == "jpg":
        pil.save(buf, format="JPEG", quality=quality)
        return "jpg", buf.getvalue()
    # compress_level 1: PNG is lossless at every level; level 1 encodes ~5x faster than the
    # default 6 on 64-px images for ~10 % larger files.
    pil.save(buf, format="PNG", compress_level=1)
    return "png", buf.getvalue()


def record_members(rec: Record, mode: str, jpeg_quality: int) -> list[tuple[str, bytes]]:
    """The tar members of a checked record: (name, data), in storage order; the image is encoded
    unless the record carries its JPEG bytes."""
    key = schema.record_key(rec.index)
    ext, data = ("jpg", rec.encoded) if rec.encoded is not None else encode_image(rec.image, mode, jpeg_quality)
    rec_bytes = np.array([rec.label, rec.index, coverage_ppm(mask_coverage(rec.mask))], dtype="<i8").tobytes()
    members = [
        (f"{key}.{schema.DALI_LABEL_EXT}", str(int(rec.label)).encode("ascii")),
        (f"{key}.{ext}", data),
    ]
    if rec.mask is not None:
        members.append((f"{key}.{schema.DALI_MASK_EXT}", encode_mask_png(rec.mask)))
    members.append((f"{key}.{schema.DALI_RECORD_EXT}", rec_bytes))
    return members


def _ustar_template() -> bytes:
    """tarfile's USTAR header of a regular file (mode 0644, mtime 0, no owner) with the name and size
    fields zeroed and the checksum field blank (8 spaces, as the checksum is computed)."""
    info = tarfile.TarInfo("x")
    info.mode, info.mtime = 0o644, 0
    header = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
    header[0:100], header[124:136], header[148:156] = bytes(100), bytes(12), b" " * 8
    return bytes(header)


_USTAR = _ustar_template()


def tar_header(name: str, size: int) -> bytes:
    """The header tarfile writes for member `name` of `size` bytes in `ShardWriter`'s archives (mode
    0644, mtime 0): the template with the name, the size and the checksum filled in, 3 µs where
    `TarInfo.tobuf` takes 16 (three members a record); tarfile's own where the name or the size needs
    more than USTAR's plain fields."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or size >= 8 ** 11:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    header = bytearray(_USTAR)
    header[0:len(raw)] = raw
    header[124:136] = b"%011o\0" % size
    header[148:155] = b"%06o\0" % sum(header)              # the checksum, over the blank checksum field
    return bytes(header)


class ShardWriter:
    """One shard being written: records' members appended to `.shard-N.tar.tmp` while the index
    lines are built from their offsets; `close()` writes the index and renames both into place
    (the tar first: a shard counts as written once its index exists). As a context manager, an
    exception removes the temporary files, so a failed shard (a full disk, a kill) leaves nothing
    that looks written."""

    def __init__(self, out_dir: Path, shard: int) -> None:
        self.tar_path = Path(out_dir) / schema.SHARD_PATTERN.format(shard)
        self.idx_path = Path(out_dir) / schema.INDEX_PATTERN.format(shard)
        self._tmp_tar = self.tar_path.with_name(f".{self.tar_path.name}.tmp")
        self._tmp_idx = self.idx_path.with_name(f".{self.idx_path.name}.tmp")
        self._file = open(self._tmp_tar, "wb")
        self._offset = 0
        self._lines: list[str] = []

    def add(self, key: str, members: list[tuple[str, bytes]]) -> None:
        """Append one record: `members` are (f"{key}.{ext}", data)."""
        parts = []
        for name, data in members:
            header = tar_header(name, len(data))     # mtime 0: same records, same bytes
            pad = -len(data) % tarfile.BLOCKSIZE
            self._file.write(header)
            self._file.write(data)
            self._file.write(b"\0" * pad)
            parts.append(f"{name[len(key) + 1:]} {self._offset + len(header)} {len(data)} {name}")
            self._offset += len(header) + len(data) + pad
        self._lines.append(" ".join(parts))

    def close(self) -> Path:
        """Finish the tar, write the index, rename both into place; returns the tar path."""
        end = self._offset + 2 * tarfile.BLOCKSIZE           # two zero blocks end the archive, which
        self._file.write(b"\0" * (end - self._offset + (-end % tarfile.RECORDSIZE)))   # fills whole records
        self._file.close()
        with open(self._tmp_idx, "w", encoding="ascii") as f:
            f.write(f"{schema.INDEX_VERSION} {len(self._lines)}\n")
            f.write("\n".join(self._lines) + "\n")
        os.replace(self._tmp_tar, self.tar_path)
        os.replace(self._tmp_idx, self.idx_path)
        return self.tar_path

    def abort(self) -> None:
        """Drop the shard: close and remove the temporary files."""
        try:
            self._file.close()
        finally:
            for tmp in (self._tmp_tar, self._tmp_idx):
                tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def renumber_shard(src_tar: Path, src_idx: Path, out_dir: Path, shard: int, first_index: int) -> Path:
    """Copy a shard's records into shard `shard` of `out_dir` as records first_index, first_index+1,
    ... (keys and the index in `.rec` rewritten; image bytes copied, never decoded)."""
    with open(src_tar, "rb") as f, ShardWriter(out_dir, shard) as out:
        for j, members in enumerate(schema.read_index(src_idx)):
            key = schema.record_key(first_index + j)
            parts = []
            for ext, (offset, size) in members.items():
                f.seek(offset)
                data = f.read(size)
                if ext == schema.DALI_RECORD_EXT:
                    rec = np.frombuffer(data, dtype="<i8").copy()
                    rec[1] = first_index + j
                    data = rec.tobytes()
                parts.append((f"{key}.{ext}", data))
            out.add(key, parts)
    return out.tar_path


def _write_shard(split: PreparedSplit, shard: int, start: int, stop: int, out_dir: Path) -> Path:
    """Write records [start, stop) as shard `shard` (tar + index), each via a temporary name."""
    with ShardWriter(out_dir, shard) as out:
        for i in range(start, stop):
            out.add(schema.record_key(i), record_members(check_record(split, i), split.mode, split.jpeg_quality))
    return out.tar_path


_WORKER_SPLIT = None


def _init_worker(split: PreparedSplit) -> None:
    global _WORKER_SPLIT
    _WORKER_SPLIT = split


def _worker_shard(args: tuple[int, int, int, str]) -> str:
    shard, start, stop, out_dir = args
    return str(_write_shard(_WORKER_SPLIT, shard, start, stop, Path(out_dir)))


def write_dali(split: PreparedSplit, out_dir: Path, *, shard_size: int = 1000, num_workers: int = 1,
               progress: bool = False) -> list[Path]:
    """Write `split` as DALI webdataset shards with index files.

    Args:
        split: a `preprocess.records.PreparedSplit` (mode "jpg" or "raw", has_masks).
        out_dir: folder of the split's shards (created if missing).
        shard_size: records per shard (the last shard may be shorter).
        num_workers: encoding processes; each builds whole shards.
        progress: show progress (`preprocess.progress`: a bar on a terminal, a line a minute in a log).

    Returns:
        The tar paths, in shard order.

    Raises:
        ValueError: empty split, bad shard size, unknown mode, or a malformed record.
    """
    n = len(split)
    if n == 0:
        raise ValueError("cannot write an empty split; check the source has images for this split")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if split.mode not in schema.IMAGE_MODES:
        raise ValueError(f"unknown image mode {split.mode!r}; use one of {schema.IMAGE_MODES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(s, a, min(a + shard_size, n), str(out_dir)) for s, a in enumerate(range(0, n, shard_size))]
    bar = progress_bar(n, f"dali {out_dir.name}", progress)
    paths: list[Path] = []
    try:
        if num_workers <= 1 or len(jobs) == 1:
            for s, a, b, d in jobs:
                paths.append(_write_shard(split, s, a, b, Path(d)))
                bar.update(b - a)
        else:
            with fork_context().Pool(min(num_workers, len(jobs)), _init_worker, (split,)) as pool:
                for (s, a, b, _), p in zip(jobs, pool.imap(_worker_shard, jobs)):
                    paths.append(Path(p))
                    bar.update(b - a)
    finally:
        bar.close()
    write_record_table(out_dir, scan_shards(out_dir, n))       # the readers' table of the split's records
    return paths
