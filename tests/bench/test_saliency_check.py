"""make saliency-check: three relicv2 arms that differ only in background removal, trained and scored."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import saliency_check
from bench.train import finished_eval
from pipelines.views import load_recipe
from preprocess.prepare import prepare_dataset
from preprocess.saliency.control import write_control
from train.config import to_dict
from train.resolve import load_config


@pytest.mark.slow
def test_the_three_arms_differ_only_in_background_removal_and_are_scored(tmp_path: Path, tiny_args) -> None:
    root = tmp_path / "data"
    prepare_dataset("synthetic", root, workers=1, train_size=72, val_size=16, image_px=32, gt_masks_as_mask=True)
    write_control(root / "synthetic")
    words = [w for w in tiny_args("relicv2", tmp_path / "runs")           # not the batch size: the arms
             if not w.startswith(("method=", "data=", "data.root=", "run.name=", "optim.", "data.batch_size"))]
    report = tmp_path / "report"
    assert saliency_check.main(["steps=2", "seeds=1", f"report={report}", f"data.root={root}", *words]) == 0
    out = json.loads((report / "check.json").read_text())
    assert list(out["results"]) == list(saliency_check.ARMS)
    cfgs = [load_config(r[0]["words"]) for r in out["results"].values()]
    recipes = [load_recipe(c.views.recipe, 32, 16) for c in cfgs]
    assert [[g.saliency_p for g in r.groups] for r in recipes] == [[0.0] * 4 + [0.0] * 2] + [[0.1] * 4 + [0.0] * 2] * 2
    strip = [[replace(g, saliency_p=0.0) for g in r.groups] for r in recipes]
    assert strip[0] == strip[1] == strip[2]                               # nothing else differs
    assert [c.data.name for c in cfgs] == ["synthetic", "synthetic", "synthetic-centre"]
    assert all(c.optim.steps == 2 and c.method == "relicv2" for c in cfgs)
    rest = [to_dict(replace(c, data=replace(c.data, name=""), views=replace(c.views, recipe=""),
                            run=replace(c.run, name=""), layers=()))
            for c in cfgs]                                                # layers: where values came from
    assert rest[0] == rest[1] == rest[2]                                  # the same run otherwise
    assert finished_eval(out["results"][saliency_check.ARMS[2]][0]["words"]) is not None   # resumable
    for r in out["results"].values():
        assert 0.0 <= r[0]["knn_top1"] <= 1.0 and 0.0 <= r[0]["linear_top1"] <= 1.0
    assert "| p_m = 0.1, centred control |" in (report / "check.md").read_text()
