"""`python -m bench.train` measures each objective end to end: timings and peak memory first, then
accuracy after a run of an equal time budget."""

from __future__ import annotations

import json
import math

import pytest

from bench.train import main, steps_in
from train.resolve import load_config


@pytest.mark.slow
def test_bench_times_then_trains_one_objective_for_its_time_budget(tiny_args, tmp_path, capsys) -> None:
    """The command as a user runs it: timing in a fresh process, then a run of the steps the measured
    rate fits into the budget, then the table and `bench_train.json`."""
    rest = [w for w in tiny_args("simclr", tmp_path) if not w.startswith(("method=", "data=", "run.name="))]
    assert main(["methods=simclr", "steps=2", "repeats=2", "minutes=0.05", *rest]) == 0
    report = json.loads((tmp_path / "bench_train.json").read_text())
    assert set(report) >= {"machine", "versions", "git", "results", "configs"}
    timing, config = report["results"]["simclr"], report["configs"]["simclr"]
    assert timing["steps_per_s"] > 0 and timing["cached_steps_per_s"] > 0
    assert math.isclose(timing["img_per_s"], timing["steps_per_s"] * 16)
    assert 0.0 <= timing["data_stall_fraction"] < 1.0
    assert timing["peak_mem_mb"] > 50                        # a process holding torch and a model

    # The time budget becomes the run length: the steps the measured rate fits into 3 seconds.
    budget = steps_in(0.05, timing["steps_per_s"])
    assert budget == max(1, round(3 * timing["steps_per_s"]))
    assert config["method"] == "simclr" and config["data"]["batch_size"] == 16
    assert timing["train_steps"] == config["optim"]["steps"] == budget
    assert config["optim"]["warmup_steps"] == budget // 10
    for key in ("knn_top1", "linear_top1", "random_init/knn_top1", "random_init/linear_top1"):
        assert 0.0 <= timing[key] <= 1.0
    assert (tmp_path / "bench-simclr" / "metrics.jsonl").exists()
    assert "simclr" in capsys.readouterr().out.splitlines()[-2]          # its row of the table


def test_a_bad_word_is_one_line_before_any_process_starts(capsys) -> None:
    assert main(["methods=rsa,nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown method 'nosuch'") and "\n" not in err


@pytest.mark.slow
def test_a_measurement_in_the_bench_s_own_run_folder_is_started_over(tiny_args, tmp_path, capsys) -> None:
    """A bench's run folder (its own run.name) of an earlier measurement, of another setting or interrupted,
    is trained afresh: the second start is not refused as a fresh start in a run's folder, and its metrics
    are the new run's alone."""
    from bench.train import accuracy_after

    accuracy_after(load_config(tiny_args("byol", tmp_path / "runs", "optim.steps=2")))
    accuracy_after(load_config(tiny_args("byol", tmp_path / "runs")))                  # 3 steps
    assert f"starting {tmp_path / 'runs' / 'run'} over" in capsys.readouterr().out
    lines = (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"] == [1, 2, 3]
