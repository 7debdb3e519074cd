"""Reading the webdataset shards of a split by record: every loader (and the benches' ceilings).

`scan_shards` indexes a split once from the shards' index files, which give every member's offset
and size (no tar parsing), plus each record's small `.rec` member (label, index, mask coverage);
`ShardReader` then reads a record's members with one positioned read each. `image_size` reads an
encoded image's height and width from its header, so a crop can be drawn before anything is decoded.
The layout is the one of `pipelines/schema.py`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
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


class ShardReader:
    """Positioned reads of records' members: one descriptor per shard and process, `os.pread` (no
    seek, so threads may share it). The records are kept as numpy columns, so that what a worker
    process is sent is small whatever starts it (64 bytes a record; a fork server's or a spawned
    worker gets the reader pickled); each worker opens its own descriptors."""

    def __init__(self, records: list[ShardRecord]) -> None:
        self.shards = sorted({r.shard for r in records})
        sid = {s: i for i, s in enumerate(self.shards)}
        self.cols = np.array([(sid[r.shard], r.image_offset, r.image_size, r.mask_offset, r.mask_size, r.label,
                               r.index) for r in records], np.int64).reshape(-1, 7)          # (N, 7)
        self.coverage = np.array([r.coverage for r in records], np.float64)              # (N,) or NO_MASK_COVERAGE
        self._fds: dict[str, int] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}}

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

    def _read(self, shard: str, offset: int, size: int) -> bytes:
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(shard, os.O_RDONLY)
        return os.pread(fd, size, offset)

    def image(self, i: int) -> bytes:
        """The encoded image of record i (JPEG or PNG bytes)."""
        s, offset, size = self.cols[i, :3].tolist()
        return self._read(self.shards[s], offset, size)

    def mask(self, i: int) -> bytes | None:
        """The encoded mask of record i (PNG bytes), or None without one."""
        s, _, _, offset, size = self.cols[i, :5].tolist()
        return self._read(self.shards[s], offset, size) if offset >= 0 else None
