"""DALI writer → DALI reader round trip on 16 synthetic images."""

from __future__ import annotations

import tarfile
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")

from pipelines import schema  # noqa: E402
from preprocess.records import Record  # noqa: E402
from preprocess.write_dali import tar_header, write_dali  # noqa: E402
from tests.readers import assert_table_is_the_scan, read_shards  # noqa: E402


@dataclass
class _Split:
    mode: str = "raw"
    jpeg_quality: int = schema.JPEG_QUALITY
    has_masks: bool = True
    n: int = 16

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Record:
        r = np.random.default_rng(i)
        h = 20 + i
        yy, xx = np.mgrid[0:h, 0:24]
        img = np.stack([yy * 6 + i, xx * 7, (xx + yy) * 4 + r.integers(0, 4, (h, 24))], -1).astype(np.uint8)
        mask = ((xx < 6 + i % 10) * 255).astype(np.uint8)
        return Record(img, i % 3, i, mask if self.has_masks else None)


def _read(folder, **kw):
    return list(read_shards(folder, **kw))


@pytest.mark.parametrize("mode", ["raw", "jpg"])
def test_round_trip(tmp_path, mode: str) -> None:
    split = _Split(mode=mode)
    out = tmp_path / "train"
    paths = write_dali(split, out, shard_size=5, num_workers=2)
    assert [p.name for p in paths] == [schema.SHARD_PATTERN.format(s) for s in range(4)]
    assert not list(out.glob(".*"))                              # no temporary file left
    assert_table_is_the_scan(out, 16)                            # with masks: their offsets and coverage
    seen = {}
    for imgs, labels, idx in _read(out, rank=0, world_size=1, batch_size=4, shuffle=False, seed=0):
        for im, lab, i in zip(imgs, labels, idx):
            seen[int(i)] = (im, int(lab))
    assert sorted(seen) == list(range(16))
    for i, (im, lab) in seen.items():
        ref = split[i]
        assert lab == ref.label
        if mode == "raw":
            assert np.array_equal(im, ref.image)
        else:  # JPEG q90 (4:2:0 chroma) on smooth 24-px gradients: mean |err| < 3, max < 48
            err = np.abs(im.astype(int) - ref.image.astype(int))
            assert im.shape == ref.image.shape and err.mean() < 3.0 and err.max() < 48


def test_index_file_offsets_and_rec(tmp_path) -> None:
    split = _Split()
    out = tmp_path / "train"
    write_dali(split, out, shard_size=16)
    data = (out / "shard-000000.tar").read_bytes()
    lines = (out / "shard-000000.idx").read_text().splitlines()
    assert lines[0] == "v1.2 16"
    for i, line in enumerate(lines[1:]):
        f = line.split()
        comps = {f[k]: (int(f[k + 1]), int(f[k + 2]), f[k + 3]) for k in range(0, len(f), 4)}
        assert set(comps) == {"png", "cls", "rec", "mask.png"}
        off, size, name = comps["rec"]
        assert name == f"{schema.record_key(i)}.rec"
        rec = np.frombuffer(data[off:off + size], dtype="<i8")
        ppm = round(float(np.mean(split[i].mask >= 128)) * 1_000_000)
        assert rec.tolist() == [i % 3, i, ppm] and ppm > 0
        off, size, _ = comps["cls"]
        assert data[off:off + size] == str(i % 3).encode()


def test_masks_are_the_same_bytes_in_both_formats(tmp_path) -> None:
    pytest.importorskip("ffcv")
    from preprocess.write_ffcv import write_ffcv
    from tests.readers import read_mask_bytes

    split = _Split(n=6)
    write_dali(split, tmp_path / "train", shard_size=6)
    write_ffcv(split, tmp_path / "train.beton", num_workers=1)
    data = (tmp_path / "train" / "shard-000000.tar").read_bytes()
    lines = (tmp_path / "train" / "shard-000000.idx").read_text().splitlines()[1:]
    in_tar = []
    for line in lines:
        f = line.split()
        comps = {f[k]: (int(f[k + 1]), int(f[k + 2])) for k in range(0, len(f), 4)}
        off, size = comps["mask.png"]
        in_tar.append(data[off:off + size])
    assert read_mask_bytes(tmp_path / "train.beton") == in_tar
    assert all(b[:8] == b"\x89PNG\r\n\x1a\n" for b in in_tar)


def test_every_index_once_across_two_ranks(tmp_path) -> None:
    out = tmp_path / "train"
    write_dali(_Split(n=15, has_masks=False), out, shard_size=4)
    got = []
    for rank in range(2):
        for _, _, idx in _read(out, rank=rank, world_size=2, batch_size=4, shuffle=True, seed=rank):
            got += idx.tolist()
    assert sorted(got) == list(range(15))


def test_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match="empty split"):
        write_dali(_Split(n=0), tmp_path / "a")

    class NoMask(_Split):
        def __getitem__(self, i):
            r = super().__getitem__(i)
            return Record(r.image, r.label, r.index, None)

    with pytest.raises(ValueError, match="no mask"):
        write_dali(NoMask(), tmp_path / "b")


def _tarfile_header(name: str, size: int) -> bytes | str:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    try:
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    except ValueError as e:
        return f"ValueError: {e}"


def test_each_member_header_is_the_one_tarfile_writes() -> None:
    """Names of 1 to 120 bytes (a prefix field past 100, refused past what it holds), non-ASCII, and
    sizes up to USTAR's 11 octal digits and past them (refused as tarfile refuses)."""
    rng = np.random.default_rng(0)
    names = ["000000123.jpg", "000000001.mask.png", "a", "x" * 100, "x" * 101, "é.png"]
    names += ["".join(rng.choice(list("abc0123456789._-/"), int(rng.integers(1, 121)))) for _ in range(200)]
    sizes = [0, 1, 511, 512, 978, 8 ** 11 - 1, 8 ** 11, 2 ** 40] + [int(v) for v in rng.integers(0, 2 ** 34, 30)]
    for name in names:
        for size in sizes:
            try:
                ours: bytes | str = tar_header(name, size)
            except ValueError as e:
                ours = f"ValueError: {e}"
            assert ours == _tarfile_header(name, size), (name, size)
