"""`python -m bench.data --quick`: a real run on tiny generated data writes a complete report."""

from __future__ import annotations

import json

import pytest

from bench import data as bench
from bench.datasets import prepare


@pytest.mark.slow
def test_quick_bench_writes_report(tmp_path) -> None:
    out = tmp_path / "bench" / "pipelines.json"
    bench.main(["--quick", "--recipes", "rsa", "--datasets", "imagenet-like",
                "--backends", "torchvision", "--cores", "1", "--repeats", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"machine", "versions", "git", "settings", "results", "ceilings", "ratios"} <= set(report)
    assert report["machine"]["cores"] >= 1 and report["versions"]["torch"]
    (row,) = report["results"]
    assert row["status"] == "ok", row.get("error")
    assert row["img_per_s"] > 0 and row["views_per_s"] == row["img_per_s"] * 4   # rsa: 2 weak + 2 staged
    assert {c["kind"] for c in report["ceilings"]} == {"decode", "decode+crops"}
    assert all(c["img_per_s"] > 0 for c in report["ceilings"])
    (crops,) = [c for c in report["ceilings"] if c["kind"] == "decode+crops"]
    repeats = report["settings"]["repeats"]       # one run of the ceiling and of each backend per round
    assert len(crops["runs"]) == len(row["runs"]) == len(row["crops_only_runs"]) == repeats >= 2
    assert report["ratios"][0]["best_backend"] == "torchvision"
    # The datasets are cached: preparing again runs no new preprocessing.
    log = out.parent / "bench-data" / "preprocess.log"
    runs = log.read_text().count("$ ")
    assert prepare("imagenet-like", out.parent / "bench-data", 48, True, 1) == (out.parent / "bench-data" / "data",
                                                                               "imagenet-like")
    assert log.read_text().count("$ ") == runs == 1
    assert log.read_text().startswith("$ python -m preprocess --dataset imagefolder ")
