"""The record contract both writers share: one check, one coverage, the same refusals."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pipelines import schema
from preprocess.records import Record, check_record, mask_coverage
from preprocess.write_dali import write_dali
from preprocess.write_ffcv import write_ffcv

_IMAGE = np.zeros((6, 8, 3), np.uint8)
_MASK = np.zeros((6, 8), np.uint8)


@dataclass
class _One:
    """A one-record split whose record is `rec`."""

    rec: Record
    has_masks: bool = True
    mode: str = "raw"
    jpeg_quality: int = schema.JPEG_QUALITY

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> Record:
        return self.rec


BAD = [
    (Record(_IMAGE, 0, 1, _MASK), "record 0 carries index 1"),
    (Record(_IMAGE.astype(np.float32), 0, 0, _MASK), "image must be uint8 (H, W, 3)"),
    (Record(_IMAGE[..., :1], 0, 0, _MASK), "image must be uint8 (H, W, 3)"),
    (Record(_IMAGE, 0, 0, None), "has no mask but the split declares has_masks=True"),
    (Record(_IMAGE, 0, 0, _MASK[:5]), "mask shape (5, 8) differs from image (6, 8)"),
]


@pytest.mark.parametrize("rec,expect", BAD)
def test_check_record_refuses_with_one_line(rec: Record, expect: str) -> None:
    with pytest.raises(ValueError) as e:
        check_record(_One(rec), 0)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_check_record_drops_an_undeclared_mask_and_keeps_a_declared_one() -> None:
    rec = Record(_IMAGE, 3, 0, _MASK)
    assert check_record(_One(rec, has_masks=False), 0).mask is None
    assert check_record(_One(rec), 0) is rec


def test_mask_coverage_is_the_fraction_at_or_above_128() -> None:
    mask = np.array([[0, 127, 128, 255]], np.uint8)
    assert mask_coverage(mask) == 0.5
    assert mask_coverage(None) == schema.NO_MASK_COVERAGE
    # In parts per million, the shards' unit, so that the FFCV file holds what the shards hold.
    assert mask_coverage(np.array([[255, 0, 0]], np.uint8)) == 0.333333


@pytest.mark.parametrize("rec,expect", [BAD[0], BAD[3]])
def test_both_writers_refuse_a_bad_record_alike(tmp_path: Path, rec: Record, expect: str) -> None:
    with pytest.raises(ValueError, match=expect):
        write_ffcv(_One(rec), tmp_path / "train.beton")
    with pytest.raises(ValueError, match=expect):
        write_dali(_One(rec), tmp_path / "train")
    assert not (tmp_path / "train.beton").exists() and not list((tmp_path / "train").glob("*.tar"))
