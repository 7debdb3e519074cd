"""The `.beton` copied from the shards by several processes is the file FFCV's own writer makes from
the same records with one process, byte for byte: pages, the records a full page pushes onto the next,
the image bytes FFCV's retry leaves behind, metadata, allocation table; for JPEGs stored as they are
and for pixels (a "raw" split, whose shards hold PNGs)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pytest

pytest.importorskip("ffcv")

from pipelines.shards import ShardReader  # noqa: E402
from preprocess.ffcv_copy import copy_to_ffcv, plan  # noqa: E402
from preprocess.records import Record  # noqa: E402
from preprocess.write_dali import write_dali  # noqa: E402
from preprocess.write_ffcv import write_ffcv  # noqa: E402
from tests.readers import read_beton  # noqa: E402

PAGE = 1 << 21               # FFCV's smallest page: the 200 records below fill several


@dataclass
class NoiseJpegs:
    """A `PreparedSplit` of JPEGs of noise (40-300 px a side, up to ~250 KB each) stored as they are,
    with noise masks (PNGs of up to ~20 KB) when `has_masks`: sizes that end pages at every kind of place.
    Mode "raw": the same images as pixels (up to 270 KB each), which the shards store as PNGs."""

    n: int = 200
    has_masks: bool = True
    mode: str = "jpg"
    jpeg_quality: int = 90
    big: int = -1            # this record is a JPEG larger than PAGE
    side: tuple[int, int] = (40, 300)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Record:
        rng = np.random.default_rng(i)
        h, w = (1600, 1600) if i == self.big else tuple(int(v) for v in rng.integers(*self.side, 2))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        jpeg = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
        mask = (rng.random((h, w)) < 0.5).astype(np.uint8) * 255 if self.has_masks else None
        if self.mode == "raw":
            return Record(pixels, i % 7, i, mask)
        return Record(None, i % 7, i, mask, encoded=jpeg, size=(h, w))


@pytest.fixture(scope="module", params=[("jpg", True), ("jpg", False), ("raw", True), ("raw", False)],
                ids=["jpg-masks", "jpg-no-masks", "raw-masks", "raw-no-masks"])
def written(request, tmp_path_factory) -> tuple[NoiseJpegs, ShardReader, bytes]:
    """The split's shards and the reference file FFCV's writer makes of it in one process."""
    split = NoiseJpegs(mode=request.param[0], has_masks=request.param[1])
    root = tmp_path_factory.mktemp("copy")
    write_dali(split, root / "train", shard_size=50)
    write_ffcv(split, root / "reference.beton", num_workers=1, page_size=PAGE)
    return split, ShardReader.open(root / "train", len(split)), (root / "reference.beton").read_bytes()


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("sizes_known", [True, False], ids=["sizes-given", "sizes-from-headers"])
def test_the_copy_is_byte_for_byte_the_file_ffcvs_writer_writes(written, workers, sizes_known, tmp_path) -> None:
    split, reader, reference = written
    sizes = np.array([split[i].shape for i in range(split.n)]) if sizes_known else None
    checksum = copy_to_ffcv(reader, tmp_path / "train.beton", sizes=sizes, has_masks=split.has_masks,
                            mode=split.mode, jpeg_quality=90, num_workers=workers, page_size=PAGE)
    assert (tmp_path / "train.beton").read_bytes() == reference
    # hashed run by run as the pages were written
    assert checksum == {"sha256": hashlib.sha256(reference).hexdigest(), "bytes": len(reference)}
    assert [p.name for p in tmp_path.iterdir()] == ["train.beton"]                   # no temporary left
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "train.beton").stat().st_mode & 0o777 == 0o666 & ~umask        # not the temporary's 0600
    # The case is what it should be: several pages, and (with masks) records FFCV retried on a new page.
    cols = np.asarray(reader.cols)
    image_sizes = [np.prod(split[i].shape) * 3 for i in range(split.n)] if split.mode == "raw" else cols[:, 2]
    layout = plan(image_sizes, cols[:, 4] if split.has_masks else np.ones(split.n, np.int64), 0, PAGE)
    strays = len(layout.piece_ptr) - 2 * split.n
    assert layout.pages >= 4 and (strays >= 1) == split.has_masks


def test_a_page_of_thousands_of_small_records_is_copied_whole(tmp_path) -> None:
    """3,000 JPEGs of 8-12 px, about 700 bytes with their masks: more pieces on a page than one
    positioned write takes (IOV_MAX, 1,024 on Linux)."""
    split = NoiseJpegs(n=3000, side=(8, 12))
    write_dali(split, tmp_path / "train")
    write_ffcv(split, tmp_path / "reference.beton", num_workers=1, page_size=PAGE)
    copy_to_ffcv(ShardReader.open(tmp_path / "train", split.n), tmp_path / "train.beton", has_masks=True,
                 num_workers=2, page_size=PAGE)
    assert (tmp_path / "train.beton").read_bytes() == (tmp_path / "reference.beton").read_bytes()


def test_ffcv_reads_each_record_back_from_the_copy(written, tmp_path) -> None:
    split, reader, _ = written
    copy_to_ffcv(reader, tmp_path / "train.beton", has_masks=split.has_masks, mode=split.mode, num_workers=2,
                 page_size=PAGE)
    images, labels, indices = read_beton(tmp_path / "train.beton", batch_size=split.n).__next__()
    assert indices.tolist() == list(range(split.n)) and labels.tolist() == [i % 7 for i in range(split.n)]
    for i in (0, 57, split.n - 1):
        if split.mode == "raw":
            assert np.array_equal(images[i], split[i].image)                 # the pixels, bit-exact
            continue
        expect = cv2.cvtColor(cv2.imdecode(np.frombuffer(split[i].encoded, np.uint8), cv2.IMREAD_COLOR),
                              cv2.COLOR_BGR2RGB)
        assert np.abs(images[i].astype(int) - expect).mean() < 2.0          # the same JPEG, decoded


def test_a_record_larger_than_a_page_is_refused_in_one_line_and_nothing_is_written(tmp_path) -> None:
    split = NoiseJpegs(n=3, has_masks=False, big=1)
    write_dali(split, tmp_path / "train")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=r"record 1 takes [\d,]+ bytes, more than FFCV's page of 2,097,152") as e:
        copy_to_ffcv(ShardReader.open(tmp_path / "train", 3), out / "train.beton", page_size=PAGE)
    assert "\n" not in str(e.value) and not list(out.iterdir())


def test_an_image_wider_than_ffcv_stores_is_refused_before_anything_is_written(written, tmp_path) -> None:
    split, reader, _ = written
    sizes = np.array([split[i].shape for i in range(split.n)])
    sizes[7] = (100, 70_000)
    with pytest.raises(ValueError, match="record 7: image side 70000 px exceeds FFCV's 65535 px"):
        copy_to_ffcv(reader, tmp_path / "train.beton", sizes=sizes, has_masks=split.has_masks, mode=split.mode,
                     page_size=PAGE)
    assert not list(tmp_path.iterdir())


def test_the_plan_places_every_allocation_where_ffcvs_allocator_does(tmp_path) -> None:
    """FFCV's own `MemoryAllocator` and record loop (`handle_sample`, which retries a record on a new
    page), run on sizes that hit each edge: an exact fit, an image that fits where its mask does not,
    an image that opens a page, a record of a whole page, then random sizes."""
    from ffcv.fields import BytesField
    from ffcv.memory_allocator import MemoryAllocator
    from ffcv.writer import handle_sample

    edges = [(PAGE - 10, 10),         # fills page 0 exactly
             (5, 1), (PAGE - 10, 4),  # page 1: a record that fills the rest exactly
             (3, 3), (PAGE - 8, 3),   # page 2: the image fits, the mask does not: retried on page 3
             (5, 1),                  # the image fills page 3 exactly, the mask does not fit: page 4
             (PAGE - 5, 1), (3, 1),   # the image does not fit: page 5, then an exact fit
             (PAGE - 1, 1), (100, 100)]
    rng = np.random.default_rng(0)
    sizes = edges + [tuple(int(v) for v in rng.integers(1, PAGE // 3, 2)) for _ in range(60)]
    fields = {"image": BytesField(), "mask": BytesField()}
    meta = np.zeros(len(sizes), np.dtype([("image", BytesField().metadata_type), ("mask", BytesField().metadata_type)]))
    fill = lambda i, k: (2 * i + k) % 255 + 1                                            # noqa: E731
    (tmp_path / "f").write_bytes(b"\0" * 100)
    allocator = MemoryAllocator(str(tmp_path / "f"), 100, PAGE)
    with allocator:
        for i, (a, b) in enumerate(sizes):
            sample = (np.full(a, fill(i, 0), np.uint8), np.full(b, fill(i, 1), np.uint8))
            handle_sample(sample, i, ["image", "mask"], meta, allocator, fields)
    image_sizes, mask_sizes = np.array(sizes).T
    layout = plan(image_sizes, mask_sizes, 100, PAGE)
    assert layout.table.tolist() == [tuple(x) for x in allocator.allocations]
    assert layout.pages == allocator.next_page_allocated.value
    # Every byte the plan puts in the file, the stray copies of retried images included, is FFCV's.
    expect = np.zeros(PAGE + layout.pages * PAGE, np.uint8)
    for rec, kind, ptr in zip(layout.piece_record, layout.piece_kind, layout.piece_ptr):
        expect[ptr:ptr + sizes[rec][kind]] = fill(rec, kind)
    assert np.array_equal(np.fromfile(tmp_path / "f", np.uint8), expect)


def test_a_damaged_shard_stops_the_copy_in_one_line_naming_it_and_nothing_is_left(tmp_path) -> None:
    split = NoiseJpegs(n=40, has_masks=False)
    write_dali(split, tmp_path / "train", shard_size=10)
    reader = ShardReader.open(tmp_path / "train", split.n)
    shard = tmp_path / "train" / "shard-000002.tar"
    os.truncate(shard, shard.stat().st_size // 2)                       # records 20-29, cut in half
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=r"record 2\d: shard-000002.tar holds \d+ of its \d+ bytes") as e:
        copy_to_ffcv(reader, out / "train.beton", num_workers=2, page_size=PAGE)
    assert "\n" not in str(e.value) and "--force" in str(e.value) and not list(out.iterdir())
