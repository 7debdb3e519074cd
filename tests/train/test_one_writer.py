"""One process writes a run's folder at a time (`train.run.hold`): a second start of a run that is training
(the same `run.name` started twice, a job submitted again while it runs), or of an evaluation that is
running, is refused in one line naming the process that writes it, and writes nothing; a run that was
killed holds nothing (the kernel drops its lock), so the same command continues it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.processes import holding, kill_and_reap, start, wait_for
from tests.train.two_ranks import ROOT, env_here, logged_steps
from train import checkpoint
from train.config import ConfigError
from train.run import lock_of

@pytest.mark.parametrize("loop", ["pretraining", pytest.param("linear", marks=pytest.mark.slow)])
def test_a_folder_another_process_writes_is_refused_in_one_line_and_a_dead_writer_holds_nothing(
        loop, tiny_args, tmp_path) -> None:
    """Rank 0's `hold`, in both loops (a single process, a torchrun or SLURM rank): while another
    process holds the folder, the start fails with one line naming it and how to stop it, before
    anything is written there; once that process is killed, the same start runs."""
    from train.launch import train
    from train.protocol import Protocol, load_protocol
    from train.resolve import config_from_dict, load_config

    words = tiny_args("byol", tmp_path, "optim.steps=2", "run.ckpt_every=2", "run.eval=none")
    folder = tmp_path / "run"

    def start_it():
        if loop == "pretraining":
            return train(load_config(words))
        state = checkpoint.load(folder / checkpoint.LATEST)
        cfg = config_from_dict(state["config"])
        _, p = load_protocol("linear", "small", cfg.method, 64, [("epochs", "1"), ("batch_size", "16")])
        return Protocol("linear", "small", p, cfg, folder / "linear-small", state["online"]).run(
            "torch", torch.device("cpu"))

    if loop == "linear":
        train(load_config(words))
    guarded = folder if loop == "pretraining" else folder / "linear-small"
    holder = holding(lock_of(guarded).path)
    with pytest.raises(ConfigError) as refused:
        start_it()
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"another run (pid {holder.pid}: {sys.executable} -c ")
    assert f"is writing {guarded}; wait for it to end or stop it (kill {holder.pid})" in line
    assert not guarded.exists()                               # nothing written
    if loop == "linear":                                      # `gpus=2`: refused before its processes start
        words = ["gpus=2", "linear", f"ckpt={folder / 'checkpoint.pt'}", "preset=small", "epochs=1", "batch_size=16",
                 "run.device=cpu"]
        launched = subprocess.run([sys.executable, "-m", "train", *words], cwd=ROOT, env=env_here(),
                                  capture_output=True, text=True, timeout=120)
        assert launched.returncode == 2 and launched.stderr.count("\n") == 1, launched.stderr
        assert launched.stderr.startswith(f"error: {line}") and "linear evaluation" not in launched.stdout
    kill_and_reap(holder)
    start_it()
    assert checkpoint.load(guarded / checkpoint.LATEST)["step"] >= 2


@pytest.mark.slow
def test_a_second_start_of_a_training_run_is_refused_before_its_processes_start(tiny_args, tmp_path) -> None:
    """A run trains (one process); the same command with `gpus=2` (a job submitted again) ends at once
    with one line naming the run's process, starts no process and changes nothing; the first goes on."""
    words = ["-m", "train", *tiny_args("byol", tmp_path, "optim.steps=400", "run.ckpt_every=1000",
                                       "run.resume=auto", "run.eval=none")]
    first = start(words)
    try:
        wait_for(lambda: 2 in logged_steps(tmp_path / "run"), 180, "step 2", first)
        second = subprocess.run([sys.executable, *words, "gpus=2"], cwd=ROOT, env=env_here(), capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2 and "step " not in second.stdout
        assert second.stderr.startswith(f"error: another run (pid {first.pid}: {sys.executable} -m train ")
        assert "or give this run another run.name" in second.stderr and second.stderr.count("\n") == 1
        at = max(logged_steps(tmp_path / "run"))
        wait_for(lambda: max(logged_steps(tmp_path / "run")) > at + 1, 60, "the first run's next steps", first)
        assert logged_steps(tmp_path / "run") == list(range(1, max(logged_steps(tmp_path / "run")) + 1))
    finally:
        kill_and_reap(first)
