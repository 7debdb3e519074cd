"""A finished run started again under DDP (the same command twice, or a SLURM job requeued after its
end) exits 0 on every rank, says once that the run is finished, and changes none of the run's files.
The requeued job's two tasks are two gloo ranks started as SLURM's srun starts them, the way torchrun's
ranks take too; `gpus=2` on a finished run starts no rank at all (its launcher says the line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import free_port
from tests.train.test_cluster import fake_slurm, start_task
from tests.train.two_ranks import ROOT, env_here
from train.__main__ import main

FINISHED = "finished at step 3"


def files_of(run: Path) -> dict[str, bytes]:
    """Every file of the run folder with its bytes, but the SLURM job's own folder (submitit's logs and
    result pickles)."""
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.relative_to(run).parts[0] != "slurm"}


@pytest.mark.ddp
@pytest.mark.slow
def test_a_finished_run_started_again_on_two_ranks_exits_cleanly_and_changes_nothing(tiny_args, tmp_path,
                                                                                    monkeypatch, capsys) -> None:
    """The run is submitted as a 2-task SLURM job and trained to its end here (one process stands in for the
    job's first life); then, at once, the same command with gpus=2 and the job's two tasks requeued past the
    end: every process exits 0, each start prints the finished line once, and no file of the run changes
    (on 13ee16a rank 0 waited on a broadcast that no other rank made: exit 1, "Connection closed by peer")."""
    job_id = free_port(20_000, 60_000) - 20_000     # its MASTER_PORT (20000 + id) is free now
    fake = fake_slurm(tmp_path / "bin", job_id)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "runs"
    words = tiny_args("byol", out, "run.resume=auto", "run.dist_timeout_min=1")
    assert main(["launcher=slurm", "nodes=2", "gpus=1", *words]) == 0
    assert main(words) == 0
    run = out / "run"
    before = files_of(run)
    assert "backbone.safetensors" in before and "checkpoint.pt" in before
    capsys.readouterr()

    log = tmp_path / "tasks.log"
    again = subprocess.Popen([sys.executable, "-m", "train", "gpus=2", *words], cwd=ROOT, env=env_here(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tasks = [start_task(run / "slurm", job_id, rank, log) for rank in range(2)]
    printed = again.communicate(timeout=120)[0]
    assert [t.wait(timeout=120) for t in tasks] == [0, 0], log.read_text()
    assert again.returncode == 0, printed
    for output in (printed, log.read_text()):
        assert [line for line in output.splitlines() if FINISHED in line] == [
            f"{run} finished at step 3 (its results are there); nothing to do: raise optim.steps to train on, "
            "or give another run.name"], output
        assert "Traceback" not in output, output
    assert files_of(run) == before
