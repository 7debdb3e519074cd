"""`python -m train.bench` measures one objective end to end: timings, peak memory, accuracy after a
run of an equal time budget."""

from __future__ import annotations

import math

from train.bench import bench_one


def test_bench_one_objective_reports_rates_memory_and_accuracy(tiny_args, tmp_path) -> None:
    rest = [w for w in tiny_args("simclr", tmp_path) if not w.startswith(("method=", "data=", "run.name="))]
    row, config = bench_one("simclr", rest, steps=2, repeats=2, minutes=0.05)
    assert config["method"] == "simclr" and config["data"]["batch_size"] == 16
    # The time budget became the run length: the steps the measured rate fits into 3 seconds.
    assert row["train_steps"] == config["optim"]["steps"] == max(1, round(3 * row["steps_per_s"]))
    assert row["steps_per_s"] > 0 and row["cached_steps_per_s"] > 0
    assert math.isclose(row["img_per_s"], row["steps_per_s"] * 16)
    assert 0.0 <= row["data_stall_fraction"] < 1.0
    assert row["peak_mem_mb"] > 50                           # a process holding torch and a model
    for key in ("knn_top1", "linear_top1", "random_init/knn_top1", "random_init/linear_top1"):
        assert 0.0 <= row[key] <= 1.0
    assert (tmp_path / "bench-simclr" / "metrics.jsonl").exists()
