"""Stop at a checkpoint and resume: the next losses equal those of an uninterrupted run; `run.keep_last`
keeps that many checkpoints, and a write killed midway keeps the last good one."""

from __future__ import annotations

import json

import random

import numpy as np
import pytest
import torch

from train import checkpoint
from train.config import load_config


def test_checkpoint_round_trips_rng_and_is_weights_only(tmp_path) -> None:
    state = {"rng": checkpoint.rng_state(), "step": 3, "config": {"optim": {"lr": 0.1}}}
    path = checkpoint.save(tmp_path / "run" / "checkpoint.pt", state)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    loaded = checkpoint.load(path)
    assert loaded["step"] == 3 and loaded["config"] == {"optim": {"lr": 0.1}}
    checkpoint.set_rng_state(loaded["rng"])
    assert (random.random(), float(np.random.rand())) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.pt"]     # no temp file left
    with pytest.raises(checkpoint.CheckpointError, match="not found"):
        checkpoint.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load(tmp_path / "junk.pt")


def losses(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("method", ["byol", "mocov3"])   # EMA target; mocov3 also has objective state
def test_stop_and_resume_repeats_the_uninterrupted_run(method, tiny_args, tmp_path) -> None:
    # 10 steps over 64 images at batch 8: the stop (step 5) is mid-epoch, the run crosses an epoch.
    from train.loop import train

    words = [*tiny_args(method, tmp_path / "a"), "optim.steps=10", "run.ckpt_every=5"]
    full = losses(train(load_config(words)))

    words_b = [*tiny_args(method, tmp_path / "b"), "optim.steps=10", "run.ckpt_every=5"]
    stopped = train(load_config([*words_b, "run.stop_after_steps=5"]))
    assert max(losses(stopped)) == 5 and not (stopped / "backbone.pt").exists()
    resumed = losses(train(load_config([*words_b, f"run.resume={stopped / 'checkpoint.pt'}"])))

    assert sorted(resumed) == list(range(1, 11))
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


def test_a_killed_write_leaves_the_last_good_checkpoint_and_keep_last_keeps_the_newest(tmp_path, monkeypatch) -> None:
    """`save_latest`: a write killed midway changes no checkpoint and leaves no temp file; the next write
    removes a killed process's temp file; keep_last=3 keeps checkpoint.pt and the two steps before it,
    and `latest` lists them newest first."""
    run = tmp_path / "run"
    checkpoint.save_latest(run, {"step": 1}, keep_last=1)
    real_save = torch.save

    def killed(obj, f) -> None:            # a partial file, then the job is killed
        real_save(obj, f)
        f.truncate(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_latest(run, {"step": 2}, keep_last=1)
    monkeypatch.undo()
    assert [p.name for p in run.iterdir()] == ["checkpoint.pt"] and checkpoint.load(run / "checkpoint.pt")["step"] == 1

    (run / ".checkpoint.pt.tmp999999").write_bytes(b"half a checkpoint")   # another process, killed
    for step in (2, 3, 4, 5):
        checkpoint.save_latest(run, {"step": step}, keep_last=3)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-3.pt", "checkpoint-4.pt", "checkpoint.pt"]
    assert [checkpoint.load(p)["step"] for p in checkpoint.latest(run)] == [5, 4, 3]
    checkpoint.save_latest(run, {"step": 6}, keep_last=1)              # fewer kept from now on
    assert [p.name for p in run.iterdir()] == ["checkpoint.pt"]

