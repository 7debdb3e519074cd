"""Self-supervised on unlabelled images: a folder without classes goes through `python -m preprocess`
and `python -m train` with no file written by hand, and the run reports the label-free health metrics
next to the random-init backbone's; a labelled evaluation of it is a one-line error."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from preprocess.__main__ import main as preprocess_main
from train.__main__ import main as train_main


@pytest.mark.slow
def test_an_unlabelled_folder_trains_and_reports_health_against_random_init(tmp_path, capsys) -> None:
    rng = np.random.default_rng(0)
    for i in range(80):                                    # a nested camera dump: no classes anywhere
        d = tmp_path / "photos" / f"trip{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(d / f"{i}.jpg", quality=90)
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(tmp_path / "photos"), "--out", str(tmp_path / "data"),
                            "--name", "photos", "--workers", "1"]) == 0
    capsys.readouterr()
    words = ["method=simclr", "data=photos", f"data.root={tmp_path / 'data'}", "data.backend=torch", "data.num_workers=1",
             "data.batch_size=8", "model.backbone=test_resnet", "optim.steps=4", "run.log_every=2",
             f"run.out_dir={tmp_path / 'runs'}", "run.name=run"]
    assert train_main(words + ["run.eval=knn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "run.eval=knn needs labels" in err and "run.eval=auto" in err
    assert not (tmp_path / "runs").exists()
    assert train_main(words) == 0
    out = capsys.readouterr().out
    assert "rankme" in out and "random init" in out and "kNN" not in out
    evals = [r for r in map(json.loads, (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    last = evals[-1]
    for key in ("rankme", "feature_std", "alignment"):
        assert math.isfinite(last[key]) and math.isfinite(last[f"random_init/{key}"]), key
    assert 1.0 <= last["rankme"] and 0 < last["feature_std"] < 1 and 0 <= last["alignment"] <= 4
    assert "knn_top1" not in last and last["eval_val_samples"] == 8          # held out: max(1 %, 80 // 10)
