"""The webdataset shards read without DALI (torch and torchvision loaders, the bench's ceilings).

`scan_shards` indexes a split once from the tar headers, which give every member's offset;
`ShardReader` then reads a record's members with one positioned read each (no tar parsing in the
workers). The layout is the one of `pipelines/schema.py`.
"""

from __future__ import annotations

import os
import tarfile
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
    """Index every record of a split by reading the tar headers (and the small `.rec` members).

    Raises:
        schema.DatasetError: no shards, a record without image or `.rec`, or indices that are
            not exactly 0..N-1 (`count`: N, when given, must match).
    """
    shards = sorted(split_dir.glob("shard-*.tar"))
    if not shards:
        raise schema.DatasetError(f"no shard-*.tar files in {split_dir}; run `python -m preprocess` for this dataset")
    image_exts = schema.DALI_IMAGE_EXT.split(";")
    entries: list[ShardRecord] = []
    for shard in shards:
        members: dict[str, dict[str, tarfile.TarInfo]] = {}
        recs: dict[str, bytes] = {}
        with tarfile.open(shard, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                key, _, ext = info.name.partition(".")
                members.setdefault(key, {})[ext] = info
                if ext == schema.DALI_RECORD_EXT:
                    recs[key] = tar.extractfile(info).read()
        for key in sorted(members):
            parts = members[key]
            image = next((parts[e] for e in image_exts if e in parts), None)
            if image is None or key not in recs:
                raise schema.DatasetError(
                    f"record {key} in {shard.name} lacks its image or .{schema.DALI_RECORD_EXT} member; "
                    "re-run `python -m preprocess` to rewrite the dataset")
            label, index, cov_ppm = (int(v) for v in np.frombuffer(recs[key], dtype="<i8")[:3])
            mask = parts.get(schema.DALI_MASK_EXT)
            entries.append(ShardRecord(
                shard=str(shard), image_offset=image.offset_data, image_size=image.size,
                mask_offset=mask.offset_data if mask is not None else -1,
                mask_size=mask.size if mask is not None else 0, label=label, index=index,
                coverage=cov_ppm / 1e6 if cov_ppm >= 0 else schema.NO_MASK_COVERAGE))
    entries.sort(key=lambda e: e.index)
    if count is not None and len(entries) != count:
        raise schema.DatasetError(
            f"{split_dir} holds {len(entries)} records, the manifest says {count}; re-run `python -m preprocess` "
            "with --force")
    if [e.index for e in entries] != list(range(len(entries))):
        raise schema.DatasetError(
            f"record indices in {split_dir} are not 0..{len(entries) - 1}; re-run `python -m preprocess`")
    return entries


class ShardReader:
    """Positioned reads of records' members: one descriptor per shard and process, `os.pread` (no
    seek, so threads may share it); picklable into DataLoader workers, which open their own."""

    def __init__(self, records: list[ShardRecord]) -> None:
        self.records = records
        self._fds: dict[str, int] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}}

    def _read(self, shard: str, offset: int, size: int) -> bytes:
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(shard, os.O_RDONLY)
        return os.pread(fd, size, offset)

    def image(self, i: int) -> bytes:
        """The encoded image of record i (JPEG or PNG bytes)."""
        r = self.records[i]
        return self._read(r.shard, r.image_offset, r.image_size)

    def mask(self, i: int) -> bytes | None:
        """The encoded mask of record i (PNG bytes), or None without one."""
        r = self.records[i]
        return self._read(r.shard, r.mask_offset, r.mask_size) if r.mask_offset >= 0 else None
