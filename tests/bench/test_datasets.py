"""The benches' one image generator and their dataset preparation (`bench.datasets`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from bench.datasets import BenchError, _preprocess, prepare, write_images


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def test_the_images_depend_on_the_seed_alone_not_on_the_worker_count(tmp_path) -> None:
    one = _files(write_images(tmp_path / "one", 6, 2, size_px=(40, 30), mixed=True, seed=3, workers=1))
    two = _files(write_images(tmp_path / "two", 6, 2, size_px=(40, 30), mixed=True, seed=3, workers=2))
    other = _files(write_images(tmp_path / "other", 6, 2, size_px=(40, 30), mixed=True, seed=4, workers=1))
    assert len(one) == 8 and one == two
    assert sum(k.startswith("train/") for k in one) == 6 and {k.split("/")[1] for k in one} >= {"class000", "class005"}
    assert one != other
    for path in (tmp_path / "one").rglob("*.jpg"):
        w, h = Image.open(path).size
        assert 30 * 0.85 - 1 <= min(w, h) and (max(w, h) <= 40 * 1.15 or max(w, h) >= 700)   # or a large one


def test_a_complete_folder_is_reused_and_other_settings_rewrite_it(tmp_path) -> None:
    src = write_images(tmp_path / "src", 4, 2, size_px=(32, 24))
    first = {p: p.stat().st_mtime_ns for p in src.rglob("*.jpg")}
    write_images(src, 4, 2, size_px=(32, 24))
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*.jpg")} == first
    write_images(src, 4, 2, size_px=(32, 24), seed=1)
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*.jpg")} != first


def test_failed_preprocessing_is_one_line_pointing_at_its_log(tmp_path) -> None:
    log = tmp_path / "preprocess.log"
    with pytest.raises(BenchError, match=r"^preprocessing x failed \(.*\); see .*preprocess.log$"):
        _preprocess(log, "imagefolder", tmp_path / "data", src=tmp_path / "missing", name="x", workers=1)
    text = log.read_text()
    assert text.startswith(f"$ python -m preprocess --dataset imagefolder --out {tmp_path / 'data'} --src ")
    assert "\nerror: " in text
    with pytest.raises(BenchError, match="unknown bench dataset 'nosuch'"):
        prepare("nosuch", tmp_path, 8, True, 1)
