"""make bench-preprocess: the generated folders hold what the report says, and the pass-through share it
reports is the one the files imply."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from bench import preprocess as bench


@pytest.mark.slow
def test_the_folders_and_the_reported_pass_through_share(tmp_path: Path) -> None:
    res = bench.run(100, 40, tmp_path, cores=2, repeats=1, with_ray=False)
    assert {"machine", "versions", "git"} <= set(res) and res["workers"] == 2
    for name in ("jpeg", "mixed"):
        files = sorted(p for p in (tmp_path / name).rglob("*") if p.is_file() and not p.name.startswith("."))
        assert len(files) == 100
        images = [Image.open(p) for p in files]
        plain = sum(im.format == "JPEG" and im.mode == "RGB" and max(im.size) <= 512 for im in images)
        row = res["folders"][name]
        for run in (row["local_1"], row["local_2"]):
            assert run["images"] == 100 and run["skipped"] == 0
            assert sum(v["as_is"] for v in run["stored"].values()) == plain
        assert row["ceiling_img_per_s_one_core"] > 0
        if name == "jpeg":
            assert plain == 100
        else:                          # 30 % large, 5 % PNG, 5 % grayscale, 3 % CMYK, drawn per image
            assert 15 <= sum(max(im.size) > 512 for im in images) <= 45
            assert {im.mode for im in images} >= {"RGB", "L", "CMYK"} and "PNG" in {im.format for im in images}
    assert "| jpeg | 100 % |" in bench.table(res)
