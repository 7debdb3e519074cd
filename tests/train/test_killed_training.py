"""Killed mid-run, nothing stays behind (training): `python -m train gpus=2`, each rank with a loader
worker, is killed with SIGKILL on its launcher (the python process of `make train GPUS=2`), then,
restarted with the same command (`run.resume=auto`), on one of its ranks. Each time, within a few seconds
no launcher, rank or loader worker is left; the third start of the same command ends exactly as an
uninterrupted run: the same loss at every step, and the same online and target weights, bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pipelines.processes import proc_stat
from train import checkpoint
from tests.processes import kill_and_reap, left_after, live, none_left_on_failure, start, tree, wait_for, workers_of
from tests.train.two_ranks import STEPS, WORDS, assert_same_training, kill_workers_of_rank, logged_steps

GONE_S = 3.0                     # "within a few seconds": a child polls its parent every 0.2 s


def rank_of(launcher_pid: int, mark: str) -> int:
    """The pid of one rank: a process of the run whose parent is the launcher."""
    for pid in live(mark):
        if proc_stat(pid)[2] == launcher_pid:
            return pid
    raise AssertionError("no rank found")


@pytest.mark.ddp
@pytest.mark.slow
def test_a_killed_launcher_or_rank_leaves_no_process_and_the_same_command_resumes_exactly(two_processes, tiny_args,
                                                                                        tmp_path) -> None:
    def command(out: Path) -> list[str]:
        return ["-m", "train", "gpus=2", *tiny_args("byol", out, *WORDS, "run.resume=auto")]

    run_dir = tmp_path / "runs" / "run"

    # 1. kill -9 of the launcher once the checkpoint of step 2 is written (step 3 is logged after it).
    run = start(command(tmp_path / "runs"))
    wait_for(lambda: 3 in logged_steps(run_dir) and len(live(run.mark)) >= 5, 180,
             "step 3 with 2 ranks and their loader workers", run)
    noted = kill_and_reap(run)
    assert left_after(run.mark, GONE_S, noted) == []
    assert max(logged_steps(run_dir)) < STEPS

    # 2. The same command resumes; one rank is killed once the checkpoint of step 6 is written.
    first = len(logged_steps(run_dir))
    run = start(command(tmp_path / "runs"))
    wait_for(lambda: 7 in logged_steps(run_dir)[first:], 180, "step 7 of the resumed run", run)
    noted = tree(run.pid)
    os.kill(rank_of(run.pid, run.mark), signal.SIGKILL)
    assert run.wait(timeout=60) != 0
    err = run.stderr.read()
    assert "was killed by signal 9" in err and "run.resume=auto continues from the last checkpoint" in err
    assert left_after(run.mark, GONE_S, noted) == []
    assert max(logged_steps(run_dir)) < STEPS

    # 3. The same command again ends as the uninterrupted run.
    run = start(command(tmp_path / "runs"))
    assert run.wait(timeout=300) == 0, run.stderr.read()
    assert left_after(run.mark, GONE_S) == []
    assert_same_training(run_dir, two_processes)


@pytest.mark.ddp
@pytest.mark.slow
def test_sigterm_to_every_process_of_a_run_holding_it_saves_the_step_reached_and_ends_in_one_line(tiny_args,
                                                                                                   tmp_path) -> None:
    """`python -m train gpus=2 run.checkpoint_on_signal=TERM`, and SIGTERM to every process of the run at
    once, as a scheduler's preemption sends it (the launcher, the ranks and their loader workers): the
    ranks hold it, their workers leave it to them (they ended at once before), and both ranks save the
    step they reached (no other checkpoint was due). torch's launcher stops with them, and the command
    ends with status 143 and one line naming the signal and the command that continues (it was torch's
    traceback), leaving no process behind."""
    run_dir = tmp_path / "runs" / "run"
    run = start(["-m", "train", "gpus=2", *tiny_args("byol", tmp_path / "runs", "optim.steps=400", "run.resume=auto",
                                                      "run.ckpt_every=1000", "run.checkpoint_on_signal=TERM")])
    wait_for(lambda: 2 in logged_steps(run_dir) and len(live(run.mark)) >= 5, 180, "step 2 with 2 ranks", run)
    noted = tree(run.pid)
    for pid, _ in noted:
        os.kill(pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 128 + signal.SIGTERM
    err, out = run.stderr.read(), run.stdout.read()
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: stopped by signal 15") and "run.resume=auto continues" in last
    assert "Traceback" not in err
    assert left_after(run.mark, GONE_S, noted) == []
    saved = checkpoint.load(run_dir / checkpoint.LATEST)["step"]
    assert saved == max(logged_steps(run_dir)) >= 2
    assert f"caught SIGTERM: saved the checkpoint of step {saved}" in out


@pytest.mark.slow
@pytest.mark.parametrize("backend, says", [("dali", "DALI worker process "), ("torch", "DataLoader worker (pid"),
                                           ("torchvision", "DataLoader worker (pid")],
                         ids=["dali", "torch", "torchvision"])
def test_a_loader_worker_killed_mid_run_ends_the_run_in_one_line(backend, says, tiny_args, tmp_path) -> None:
    """The OOM killer takes the loader's workers in the middle of a run: the run ends within seconds
    with status 1 and one line naming the worker and the command that continues (no traceback, no wait
    for good), and leaves no process behind. The death shows at the next batch, DataLoader's too (torch's
    SIGCHLD handler told it in the middle of a training step before, and nothing was saved), and the
    run of one process first saves the checkpoint of the steps it reached (none was due:
    `run.ckpt_every=1000`), which the same command continues from."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    run_dir = tmp_path / "runs" / "run"
    run = start(["-m", "train", *tiny_args("byol", tmp_path / "runs", f"data.backend={backend}", "optim.steps=400",
                                           "run.ckpt_every=1000", "run.resume=auto")])
    wait_for(lambda: 2 in logged_steps(run_dir), 180, "step 2", run)
    workers = workers_of(run.pid)
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=60) == 1
    err, out = run.stderr.read(), run.stdout.read()
    assert max(logged_steps(run_dir)) < 400
    assert err.startswith(f"error: {says}") and "run.resume=auto continues" in err
    assert len(err.strip().splitlines()) == 1, err
    assert left_after(run.mark, GONE_S) == []
    saved = checkpoint.load(run_dir / checkpoint.LATEST)["step"]
    assert saved == max(logged_steps(run_dir)) >= 2
    assert f"a loader worker died: saved the checkpoint of step {saved}\n" in out



@pytest.mark.ddp
@pytest.mark.slow
def test_a_loader_worker_killed_on_one_rank_of_two_saves_the_steps_reached_and_the_same_command_continues(
        tiny_args, tmp_path) -> None:
    """The OOM killer takes rank 1's loader worker (`gpus=2`, no checkpoint due: `run.ckpt_every=1000`):
    rank 1 saves the checkpoint of the steps reached by itself (rank 0 waits in the step's collective),
    the run ends within seconds and leaves no process; the same command continues at that step on both
    ranks, each in its share of the epoch. Before, nothing was saved: the run went back to its last
    periodic checkpoint (up to `run.ckpt_every_min`, 30 minutes, of every GPU's work)."""
    run_dir = tmp_path / "runs" / "run"
    words = ["-m", "train", "gpus=2", *tiny_args("byol", tmp_path / "runs", "optim.steps=400", "run.ckpt_every=1000",
                                                 "run.resume=auto", "run.eval=none")]
    run = start(words)
    with none_left_on_failure(run.mark):             # a rank waiting for good would outlive a failure
        kill_workers_of_rank(run, 1, run_dir)
        assert run.wait(timeout=60) == 1
    err, out = run.stderr.read(), run.stdout.read()
    assert err.startswith("error: DataLoader worker (pid") and "run.resume=auto continues" in err, err
    assert left_after(run.mark, GONE_S) == []
    state = checkpoint.load(run_dir / checkpoint.LATEST)
    saved, logged = state["step"], max(logged_steps(run_dir))
    assert state["alone"] == 1 and 2 <= logged <= saved <= logged + 1    # rank 0 logs a step just after it ends
    assert f"a loader worker died: rank 1 saved the checkpoint of step {saved}\n" in out

    run = start([*words, f"run.stop_after_steps={saved + 2}"])
    assert run.wait(timeout=300) == 0, run.stderr.read()
    assert (f"resuming step {saved} (saved by rank 1 alone, its loader worker dead; the same global batch 16): "
            "each rank goes on in its share of the epoch") in run.stdout.read()
    state = checkpoint.load(run_dir / checkpoint.LATEST)
    assert state["step"] == saved + 2 and logged_steps(run_dir)[-2:] == [saved + 1, saved + 2]
    assert state["loader"][0] == state["loader"][1] == {"epoch": (saved + 2) // 4, "batches_done": (saved + 2) % 4}


# `python -m train WORDS` with Ctrl-C's default action, as a shell starts a foreground command: a process
# started in the background by a script (make test under a CI script) inherits SIGINT ignored.
AS_FROM_A_SHELL = ["-c", "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "sys.argv[0] = 'train'; runpy.run_module('train', run_name='__main__', alter_sys=True)"]


@pytest.mark.slow
def test_ctrl_c_ends_a_run_in_one_line_naming_its_checkpoint_and_the_word_that_continues_it(tiny_args,
                                                                                              tmp_path) -> None:
    """Ctrl-C (SIGINT to the foreground group: the run and its loader worker) ended in a 50-line
    KeyboardInterrupt traceback that said nothing of where to go on from. Now one line names the step of
    the run folder's newest checkpoint and the word that continues from it, with exit status 130 and no
    process left; that word continues the run at that step."""
    words = tiny_args("rsa", tmp_path / "runs", "optim.steps=40", "run.ckpt_every=5")
    run_dir = tmp_path / "runs" / "run"
    run = start([*AS_FROM_A_SHELL, *words])
    with none_left_on_failure(run.mark):
        wait_for(lambda: 7 in logged_steps(run_dir), 120, "step 7 (after the checkpoint of step 5)", run)
        noted = tree(run.pid)
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=60) == 128 + signal.SIGINT
        assert left_after(run.mark, GONE_S, noted) == []
    err = run.stderr.read().strip()
    saved = checkpoint.load(run_dir / "checkpoint.pt")["step"]
    word = f"run.resume={run_dir / 'checkpoint.pt'}"
    assert err == f"error: interrupted; {run_dir} holds the checkpoint of step {saved}: the same command with {word} " \
                  "continues from it", err
    again = start(["-m", "train", *words, word])
    with none_left_on_failure(again.mark):
        assert again.wait(timeout=180) == 0, again.stderr.read()[-2000:]
    assert f"resuming from {run_dir / 'checkpoint.pt'} (step {saved})" in again.stdout.read()
    assert logged_steps(run_dir)[-1] == 40
