"""FFCV writer → reader round trip on 16 synthetic images (raw bit-exact, JPEG within tolerance)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pipelines import schema
from preprocess.records import Record
from preprocess.write_ffcv import write_ffcv
from tests.readers import COVERAGE_ATOL, read_beton, read_masks

# JPEG at quality 90 on smooth images: mean absolute error per image stays below this (uint8 units).
JPEG_MEAN_ABS_TOL = 3.0


@dataclass
class Split:
    """A deterministic PreparedSplit of smooth images of varying sizes with disc masks."""

    n: int = 16
    mode: str = "raw"
    jpeg_quality: int = 90
    has_masks: bool = True
    bad_index: int = -1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Record:
        rng = np.random.default_rng(i)
        h, w = 24 + 4 * (i % 3), 32 - 4 * (i % 2)
        yy, xx = np.mgrid[0:h, 0:w]
        base = rng.integers(0, 100, 3)
        img = np.stack([base[c] + yy * (c + 1) + xx for c in range(3)], -1).astype(np.uint8)
        mask = (((yy - h / 2) ** 2 + (xx - w / 2) ** 2) < (4 + i % 5) ** 2).astype(np.uint8) * 255
        return Record(img, i % 10, i if i != self.bad_index else i + 1, mask)


def test_raw_round_trip_is_bit_exact(tmp_path: Path) -> None:
    split = Split()
    path = tmp_path / "train.beton"
    write_ffcv(split, path, num_workers=2)
    images, labels, indices = map(list, zip(*read_beton(path, batch_size=5)))
    images = [im for chunk in images for im in chunk]
    assert np.concatenate(indices).tolist() == list(range(16))
    assert np.concatenate(labels).tolist() == [i % 10 for i in range(16)]
    for i, im in enumerate(images):
        assert np.array_equal(im, split[i].image)
    masks, coverage = read_masks(path)
    for i, m in enumerate(masks):
        assert np.array_equal(m, split[i].mask)
        assert coverage[i] == pytest.approx(float(np.mean(split[i].mask >= 128)), abs=COVERAGE_ATOL)
    assert not [p for p in tmp_path.iterdir() if p.name != "train.beton"]   # no temporary left


def test_jpeg_round_trip_within_tolerance_and_no_masks(tmp_path: Path) -> None:
    split = Split(mode="jpg", has_masks=False)
    path = tmp_path / "val.beton"
    write_ffcv(split, path)
    n = 0
    for images, labels, indices in read_beton(path, batch_size=16):
        for im, label, i in zip(images, labels, indices):
            ref = split[int(i)].image
            assert im.shape == ref.shape and label == int(i) % 10
            err = np.abs(im.astype(np.int16) - ref).mean()
            assert 0 < err < JPEG_MEAN_ABS_TOL          # lossy, but close
            n += 1
    assert n == 16
    masks, coverage = read_masks(path)
    assert masks == [None] * 16 and np.all(coverage == schema.NO_MASK_COVERAGE)


def test_bad_record_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    path = tmp_path / "train.beton"
    with pytest.raises(ValueError, match="record 3 carries index 4"):
        write_ffcv(Split(n=6, bad_index=3), path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_ffcv(Split(n=2), tmp_path / "missing" / "train.beton")
