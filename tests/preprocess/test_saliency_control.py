"""The control masks of the downstream check: centred rectangles with each saliency mask's coverage,
written into a copy of the dataset in both formats; the original is left as it was."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.shards import ShardReader, scan_shards
from preprocess.prepare import PreprocessError, prepare_dataset
from preprocess.saliency.control import centred_rectangle, write_control
from tests.readers import COVERAGE_ATOL, read_masks


@pytest.mark.parametrize("h,w,coverage", [(64, 64, 0.3), (48, 80, 0.05), (37, 53, 0.9), (20, 20, 0.0), (20, 30, 1.0)])
def test_the_rectangle_is_centred_with_the_coverage_and_aspect(h: int, w: int, coverage: float) -> None:
    m = centred_rectangle(h, w, coverage)
    rows, cols = np.nonzero(m.any(1))[0], np.nonzero(m.any(0))[0]
    assert m.shape == (h, w) and set(np.unique(m)) <= {0, 255}
    assert abs((m > 0).sum() - coverage * h * w) <= h + w                  # within a row and a column
    if coverage > 0:
        assert abs(rows[0] - (h - 1 - rows[-1])) <= 1 and abs(cols[0] - (w - 1 - cols[-1])) <= 1   # centred
        assert abs(len(rows) / h - len(cols) / w) <= 1.5 / min(h, w)                              # aspect


def test_the_copy_holds_centred_masks_of_the_same_coverage_in_both_formats(tmp_path: Path) -> None:
    src = prepare_dataset("synthetic", tmp_path, workers=1, train_size=24, val_size=8, image_px=32,
                          gt_masks_as_mask=True)
    before = (src / schema.MANIFEST_NAME).read_bytes()
    out = write_control(src)
    assert out.name == "synthetic-centre" and (src / schema.MANIFEST_NAME).read_bytes() == before
    m = schema.read_manifest(out, verify="full")
    assert m.saliency["control"] and m.counts == {"train": 24, "val": 8}
    for split in ("train", "val"):
        original, _ = read_masks(src / f"{split}.beton")
        control, coverage = read_masks(out / f"{split}.beton")
        shards = ShardReader(scan_shards(out / split, m.counts[split]))
        for i, (a, b, c) in enumerate(zip(original, control, coverage)):
            assert abs((b >= 128).mean() - (a >= 128).mean()) <= 2 * 32 / 32 ** 2
            assert np.array_equal(b, centred_rectangle(32, 32, float((a >= 128).mean())))
            assert c == pytest.approx((b >= 128).mean(), abs=COVERAGE_ATOL)
            dali = np.asarray(Image.open(io.BytesIO(shards.mask(i))))
            assert np.array_equal(dali, b) and shards.coverage[i] == c               # the same in both


def test_a_dataset_without_masks_is_refused_in_one_line(tmp_path: Path) -> None:
    src = prepare_dataset("synthetic", tmp_path, workers=1, train_size=8, val_size=4, image_px=16)
    with pytest.raises(PreprocessError, match="make saliency") as e:
        write_control(src)
    assert "\n" not in str(e.value) and not (tmp_path / "synthetic-centre").exists()
