"""`shards.image_size` reads the size a decoder will produce from the header alone (the DALI backend
draws its crop windows from it before anything is decoded). `ShardReader.open` maps a split's record
table: what a worker process is sent does not grow with the split, a split written before the table
existed is scanned instead, and a table that does not match its split is a one-line error."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.shards import ShardReader, image_size, scan_shards


def encoded(h: int, w: int, fmt: str, **save) -> bytes:
    rng = np.random.default_rng(h * 1000 + w)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize("h, w", [(375, 500), (500, 333), (17, 1), (1, 9)])
@pytest.mark.parametrize("fmt, save", [
    ("JPEG", {"quality": 90}),
    ("JPEG", {"progressive": True}),                           # SOF2 frame header
    ("JPEG", {"restart_marker_blocks": 1, "optimize": True}),  # DRI before the frame, Huffman tables
    ("JPEG", {"exif": b"Exif\x00\x00" + b"\x00" * 3000}),    # a long APP1 before the frame
    ("PNG", {}),
])
def test_header_size_is_the_decoded_size(h: int, w: int, fmt: str, save: dict) -> None:
    data = encoded(h, w, fmt, **save)
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (w, h) and np.asarray(im).shape[:2] == (h, w)
    assert image_size(data) == (h, w)


@pytest.mark.parametrize("data", [b"", b"GIF89a" + b"\x00" * 40, b"\xff\xd8\xff\xe0\x00\x10JFIF" + b"\x00" * 8,
                                  b"\xff\xd8\xff\xc0\x00\x11\x08\x01"])      # a frame header cut short
def test_bytes_without_a_frame_header_are_a_dataset_error(data: bytes) -> None:
    with pytest.raises(schema.DatasetError, match="re-run `python -m preprocess`"):
        image_size(data)


def test_a_reader_sent_to_a_worker_carries_its_table_s_path_not_its_records(tiny_data_root, tmp_path) -> None:
    ds = tiny_data_root / "synthetic"
    sent = {split: pickle.dumps(ShardReader.open(ds / split, n)) for split, n in (("train", 64), ("val", 32))}
    path = len(str(ds / "train" / schema.RECORDS_NAME))
    assert len(sent["train"]) < path + 100                            # 64 and 32 records: the path and a few bytes
    assert len(sent["train"]) - len(sent["val"]) == len("train") - len("val")   # but for the path's name
    received = pickle.loads(sent["train"])
    assert [received.image(i) for i in (0, 63)] == [ShardReader.open(ds / "train", 64).image(i) for i in (0, 63)]
    # A split written before the table existed: scanned, the same records, sent as columns.
    old = tmp_path / "train"
    shutil.copytree(ds / "train", old)
    (old / schema.RECORDS_NAME).unlink()
    scanned = ShardReader.open(old, 64)
    assert scanned.table_path is None and np.array_equal(scanned.labels, received.labels)
    assert np.array_equal(scanned.coverage, received.coverage) and scanned.image(5) == received.image(5)
    assert len(pickle.dumps(scanned)) > 64 * 64


def test_a_table_that_does_not_match_its_split_is_a_one_line_error(tiny_data_root, tmp_path) -> None:
    split = tmp_path / "train"
    shutil.copytree(tiny_data_root / "synthetic" / "train", split)
    with pytest.raises(schema.DatasetError, match=r"holds 64 records, the manifest says 65; re-run"):
        ShardReader.open(split, 65)
    table = np.load(split / schema.RECORDS_NAME)
    np.save(split / schema.RECORDS_NAME, table[::-1])
    with pytest.raises(schema.DatasetError, match=r"record indices in .* are not 0\.\.63; re-run"):
        ShardReader.open(split, 64)
    table[-1, 0] = 7
    np.save(split / schema.RECORDS_NAME, table)
    with pytest.raises(schema.DatasetError, match=r"names shard .*shard-000007.tar, which does not exist"):
        ShardReader.open(split, 64)
    assert len(scan_shards(split, 64)) == 64                          # the shards themselves are intact


def _shard_descriptors() -> int:
    """Descriptors this process holds on shard files."""
    fd_dir = "/proc/self/fd"
    n = 0
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            n += os.readlink(os.path.join(fd_dir, fd)).endswith(".tar")
    return n


def test_a_reader_over_more_shards_than_its_cap_holds_at_most_the_cap_and_reads_every_record(tmp_path, monkeypatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from pipelines import shards
    from preprocess.prepare import prepare_dataset

    root = tmp_path / "data"
    prepare_dataset("synthetic", root, workers=1, train_size=40, val_size=2, image_px=16, seed=0, shard_size=1)
    split = root / "synthetic" / "train"
    assert len(list(split.glob("shard-*.tar"))) == 40
    want = ShardReader.open(split, 40)
    expected = {i: (want.image(i), want.mask(i)) for i in range(40)}      # unbounded readers would hold 40
    want.close()
    monkeypatch.setattr(shards, "MAX_OPEN_SHARDS", 4)
    base = _shard_descriptors()
    reader = ShardReader.open(split, 40)
    order = np.random.default_rng(0).permutation(np.tile(np.arange(40), 3))
    peak = 0
    for i in order:                                                       # shuffled, three epochs
        assert (reader.image(int(i)), reader.mask(int(i))) == expected[int(i)]
        peak = max(peak, _shard_descriptors() - base)
    assert peak <= 4 and reader.open_descriptors == 4
    with ThreadPoolExecutor(4) as pool:                                   # threads sharing the reader
        got = list(pool.map(lambda i: reader.image(int(i)), order))
    assert got == [expected[int(i)][0] for i in order]
    assert reader.open_descriptors <= 4 and _shard_descriptors() - base <= 4
    reader.close()
    assert reader.open_descriptors == 0 and _shard_descriptors() == base
    again = ShardReader.open(split, 40)
    again.image(3)
    del again                                                             # a dropped reader closes its own
    assert _shard_descriptors() == base
