"""The 2-process reference run that the multi-node, SLURM and kill tests end equal to: byol on the tiny
dataset, `WORDS`, started as `python -m train gpus=2`; made once per test session (`tests.once`), the
comparison of a run with it, and the readers of a run's metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.once import made_once

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
WORDS = (f"optim.steps={STEPS}", "run.ckpt_every=2", "data.num_workers=1")    # checkpoints every 2 steps


def env_here(**extra: str) -> dict[str, str]:
    """The environment of a `python -m train` started by a test: this checkout's code, one thread per
    process (the same in every run compared, so the float sums are the same)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss per step of metrics.jsonl (a resumed run's later records win)."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def logged_steps(run_dir: Path) -> list[int]:
    """The train steps of metrics.jsonl in the order they were logged (a resumed run logs some again)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    records = [json.loads(ln) for ln in lines if ln.endswith("}")]        # the last line may be half written
    return [r["step"] for r in records if r["kind"] == "train"]


def kill_workers_of_rank(run: subprocess.Popen, rank: int, folder: Path) -> None:
    """Once `folder`'s metrics hold step 2 and the ranks of `run` (a `gpus=2` launcher, started by
    `tests.processes.start`) run with their loader workers, kill that rank's workers with SIGKILL (what
    the OOM killer does)."""
    from pipelines.processes import proc_stat
    from tests.processes import environ, live, wait_for, workers_of

    wait_for(lambda: 2 in logged_steps(folder) and len(live(run.mark)) >= 5, 180,
             "step 2 with 2 ranks and their loader workers", run)
    pid = next(p for p in live(run.mark) if proc_stat(p)[2] == run.pid and environ(p).get("RANK") == str(rank))
    for worker in workers_of(pid):
        os.kill(worker, signal.SIGKILL)


def assert_same_training(run: Path, reference: Path) -> None:
    """The same losses at every step, and bit-identical online and target networks at the end."""
    assert losses(run) == losses(reference)
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (run, reference))
    assert a["step"] == b["step"] == max(losses(reference))
    for part in ("online", "target"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), (part, name)


@pytest.fixture(scope="session")
def two_processes(tiny_args, tmp_path_factory) -> Path:
    """The run folder of byol, `WORDS`, in 2 processes on this machine (`gpus=2`)."""
    def make(out: Path) -> None:
        done = subprocess.run([sys.executable, "-m", "train", "gpus=2", *tiny_args("byol", out, *WORDS)],
                              cwd=ROOT, env=env_here(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr

    return made_once(tmp_path_factory, "two-processes", make) / "run"
