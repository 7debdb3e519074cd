"""Readers of written datasets for round-trip tests: records back in index order, nothing else.

Training never uses these; the loaders in `pipelines/` do. FFCV files are read through FFCV's own
`Reader` (header, field metadata, allocation table) and decoded per record with the JPEG decoder
FFCV's image decoders call, so images of any size come back whole; DALI shards are read by DALI's
`fn.readers.webdataset` on the CPU, sharded across ranks as the DALI loader shards them.

    from tests.readers import read_beton, read_masks, read_shards
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import cv2
import numpy as np

from pipelines import schema

Chunk = tuple[list[np.ndarray], np.ndarray, np.ndarray]   # (images (H, W, 3) uint8, labels (k,), indices (k,))


# ---------------------------------------------------------------------------------------------
# FFCV .beton
# ---------------------------------------------------------------------------------------------

class _Beton:
    """One `.beton` file: per-sample field metadata and the bytes each field points to."""

    def __init__(self, path: str | Path) -> None:
        from ffcv.reader import Reader

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"FFCV file {path} not found; write it first")
        reader = Reader(str(path))
        self.meta = {name: reader.metadata[f"f{k}"] for k, name in enumerate(reader.field_names)}
        order = np.argsort(reader.alloc_table["ptr"])
        self.ptrs = reader.alloc_table["ptr"][order]
        self.sizes = reader.alloc_table["size"][order]
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self.num_samples = int(reader.num_samples)

    def bytes_at(self, ptr: int) -> np.ndarray:
        """The allocation starting at file offset `ptr` (what FFCV's memory manager returns)."""
        k = int(np.searchsorted(self.ptrs, ptr))
        if k == len(self.ptrs) or self.ptrs[k] != ptr:
            raise ValueError(f"no allocation starts at offset {ptr}; the .beton file is damaged")
        return np.asarray(self.data[int(ptr):int(ptr) + int(self.sizes[k])])

    def image(self, i: int) -> np.ndarray:
        """Sample i's image, (H, W, 3) uint8 RGB, at its stored size."""
        from ffcv.fields.rgb_image import IMAGE_MODES
        from ffcv.libffcv import imdecode

        m = self.meta[schema.IMAGE][i]
        h, w = int(m["height"]), int(m["width"])
        stored = self.bytes_at(m["data_ptr"])
        if m["mode"] == IMAGE_MODES["raw"]:
            return stored[:h * w * 3].reshape(h, w, 3).copy()
        out = np.empty((h, w, 3), np.uint8)
        imdecode(np.ascontiguousarray(stored), out, h, w, h, w, 0, 0, 1, 1, False, False)
        return out


def read_beton(path: str | Path, *, batch_size: int = 32) -> Iterator[Chunk]:
    """Images, labels and indices of a `.beton` file, in storage (index) order.

    Args:
        path: the `.beton` file.
        batch_size: records per yielded chunk (the last one may be shorter).

    Yields:
        (images, labels, indices): a list of (H, W, 3) uint8 RGB arrays (sizes may differ), and
        (k,) int64 labels and indices.
    """
    beton = _Beton(path)
    labels = beton.meta[schema.LABEL].astype(np.int64)
    indices = beton.meta[schema.INDEX].astype(np.int64)
    for a in range(0, beton.num_samples, batch_size):
        b = min(a + batch_size, beton.num_samples)
        yield [beton.image(i) for i in range(a, b)], labels[a:b].copy(), indices[a:b].copy()


# A stored coverage against the mask's own mean: coverage is stored in parts per million, so rounding
# moves it by up to half a ppm, and a tie lands a float's error beyond that.
COVERAGE_ATOL = 5.1e-7


def read_masks(path: str | Path) -> tuple[list[np.ndarray | None], np.ndarray]:
    """All masks and coverages of a `.beton` file in index order (None where no mask is stored).

    Returns:
        (masks, coverage): (H, W) uint8 arrays or None (told by coverage == NO_MASK_COVERAGE), and
        (N,) float64 coverages.
    """
    beton = _Beton(path)
    coverage = beton.meta[schema.COVERAGE].astype(np.float64)
    masks = [None if c == schema.NO_MASK_COVERAGE
             else cv2.imdecode(beton.bytes_at(m["ptr"]), cv2.IMREAD_GRAYSCALE)
             for m, c in zip(beton.meta[schema.MASK], coverage)]
    return masks, coverage


def read_mask_bytes(path: str | Path) -> list[bytes | None]:
    """The stored mask bytes of every record of a `.beton` file in index order (None without a mask)."""
    beton = _Beton(path)
    coverage = beton.meta[schema.COVERAGE]
    return [None if c == schema.NO_MASK_COVERAGE else beton.bytes_at(m["ptr"]).tobytes()
            for m, c in zip(beton.meta[schema.MASK], coverage)]


def read_ffcv_records(dataset_dir: str | Path, split: str, *, batch_size: int = 32) -> Iterator[Chunk]:
    """`read_beton` on `<dataset_dir>/<split>.beton` after `schema.read_manifest` accepts the folder."""
    dataset_dir = Path(dataset_dir)
    schema.read_manifest(dataset_dir)
    yield from read_beton(dataset_dir / f"{split}.beton", batch_size=batch_size)


# ---------------------------------------------------------------------------------------------
# DALI webdataset shards
# ---------------------------------------------------------------------------------------------

def _shards(split_dir: Path) -> tuple[list[str], list[str], int]:
    """(tar paths, index paths, record count) of one split folder."""
    tars = sorted(str(p) for p in Path(split_dir).glob("shard-*.tar"))
    if not tars:
        raise FileNotFoundError(f"no DALI shards in {split_dir}; write them first")
    idxs = [t[:-len(".tar")] + ".idx" for t in tars]
    n = 0
    for i in idxs:
        with open(i, encoding="ascii") as f:
            n += int(f.readline().split()[1])            # "v1.2 <samples>"
    return tars, idxs, n


def read_shards(split_dir: str | Path, *, rank: int = 0, world_size: int = 1, batch_size: int = 32,
                shuffle: bool = False, seed: int = 0) -> Iterator[Chunk]:
    """Decoded images, labels and indices of one split's shards, read by DALI on the CPU.

    Args:
        split_dir: the folder holding `shard-NNNNNN.tar` and `.idx` files.
        rank, world_size: this reader's shard of the records (DALI's contiguous sharding: rank r
            reads records [n·r/k, n·(r+1)/k)).
        batch_size: records per yielded chunk (the last one may be shorter).
        shuffle, seed: DALI's buffered shuffle.

    Yields:
        (images, labels, indices): (H, W, 3) uint8 RGB arrays and (k,) int64 labels and indices,
        covering the rank's records once.
    """
    from nvidia.dali import fn, pipeline_def, types

    tars, idxs, n = _shards(Path(split_dir))

    @pipeline_def(batch_size=batch_size, num_threads=1, device_id=None, seed=seed)
    def pipe():
        img, rec = fn.readers.webdataset(
            paths=tars, index_paths=idxs, ext=[schema.DALI_IMAGE_EXT, schema.DALI_RECORD_EXT],
            dtypes=[types.UINT8, types.INT64], shard_id=rank, num_shards=world_size,
            random_shuffle=shuffle, pad_last_batch=True, name="reader")
        return fn.decoders.image(img, device="cpu", output_type=types.RGB), rec

    p = pipe()
    p.build()
    left = n * (rank + 1) // world_size - n * rank // world_size
    while left > 0:
        imgs, recs = p.run()
        k = min(batch_size, left)                         # the padded tail of the last batch is dropped
        r = np.stack([np.asarray(recs[j]) for j in range(k)])   # (k, 3) [label, index, coverage ppm]
        yield [np.asarray(imgs[j]) for j in range(k)], r[:, 0].copy(), r[:, 1].copy()
        left -= k


def read_dali_records(dataset_dir: str | Path, split: str, *, rank: int = 0, world_size: int = 1,
                      batch_size: int = 32, shuffle: bool = False, seed: int = 0) -> Iterator[Chunk]:
    """`read_shards` on `<dataset_dir>/<split>/` after `schema.read_manifest` accepts the folder."""
    dataset_dir = Path(dataset_dir)
    schema.read_manifest(dataset_dir)
    yield from read_shards(dataset_dir / split, rank=rank, world_size=world_size, batch_size=batch_size,
                           shuffle=shuffle, seed=seed)


def assert_table_is_the_scan(split_dir: str | Path, count: int) -> None:
    """The record table a writer saved (`schema.RECORDS_NAME`) holds what a scan of the split's shards
    reads: every column, and the same bytes for each record's image and mask."""
    from pipelines.shards import ShardReader, scan_shards

    mapped, scanned = ShardReader.open(Path(split_dir), count), ShardReader(scan_shards(Path(split_dir), count))
    assert mapped.table_path == str(Path(split_dir) / schema.RECORDS_NAME)
    for column in ("labels", "indices", "coverage"):
        assert np.array_equal(getattr(mapped, column), getattr(scanned, column)), column
    for i in range(count):
        assert mapped.image(i) == scanned.image(i) and mapped.mask(i) == scanned.mask(i), i
