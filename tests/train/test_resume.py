"""Stop at a checkpoint and resume: the next losses equal those of an uninterrupted run; a killed job
re-run with the same command (`run.resume=auto`) continues from its run folder's newest readable
checkpoint, and `run.keep_last` keeps that many."""

from __future__ import annotations

import json
import os
import random
import signal
import uuid

import numpy as np
import pytest
import torch

from tests.processes import pids_under, workers_of
from tests.train.two_ranks import logged_steps
from train import checkpoint
from train.resolve import load_config


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


@pytest.mark.slow
@pytest.mark.parametrize("method", ["byol", "mocov3"])   # EMA target; mocov3 also has objective state
def test_stop_and_resume_repeats_the_uninterrupted_run(method, tiny_args, tmp_path) -> None:
    # 10 steps over 64 images at batch 8: the stop (step 5) is mid-epoch, the run crosses an epoch.
    from train.launch import train

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


@pytest.fixture(scope="module")
def uninterrupted(tiny_args, tmp_path_factory) -> dict[int, float]:
    """Losses of a 10-step byol run with a checkpoint every 2 steps, never stopped."""
    from train.launch import train

    out = tmp_path_factory.mktemp("uninterrupted")
    return losses(train(load_config([*tiny_args("byol", out), "optim.steps=10", "run.ckpt_every=2"])))


@pytest.mark.ddp
@pytest.mark.slow
def test_a_run_saved_by_one_process_continues_on_two_at_its_step_and_epoch_position(tiny_args, tmp_path) -> None:
    """A run resumed on more GPUs than saved it (a checkpoint of one process, then two ranks, started as
    torchrun or `gpus=2` starts them): rank 1 failed with an IndexError traceback; now both ranks
    continue at the saved step and epoch position and say how the rest of the epoch is shared out. 64
    records at batch 16 are 4 steps an epoch: saved at step 3, step 4 ends epoch 0 and step 5 is the
    first of epoch 1 (from a fresh position it would be the third of epoch 0 again)."""
    from tests.processes import free_port, none_left_on_failure, start
    from train.launch import train

    words = [*tiny_args("byol", tmp_path), "run.ckpt_every=3", "run.resume=auto", "run.eval=none"]   # optim.steps=3
    run = train(load_config(words))
    env = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mark = uuid.uuid4().hex
    ranks = [start(["-m", "train", *words, "optim.steps=5"], mark, RANK=str(r), LOCAL_RANK=str(r), **env)
             for r in (0, 1)]
    with none_left_on_failure(mark):      # a rank waiting for a failed one in a collective
        outs = [(r.wait(timeout=300), r.stdout.read(), r.stderr.read()) for r in ranks]
    assert [status for status, _, _ in outs] == [0, 0], outs[0][2] + outs[1][2]
    assert ("resuming step 3 (trained by 1 process(es), now 2; the same global batch 16): the rest of epoch 0 is "
            "read in the shares of 2 process(es)") in outs[0][1]
    state = checkpoint.load(run / checkpoint.LATEST)
    assert state["step"] == 5 and logged_steps(run) == [1, 2, 3, 4, 5]
    assert [(p["epoch"], p["batches_done"]) for p in state["loader"]] == [(1, 1), (1, 1)]


@pytest.mark.parametrize("saved_batch, batch", [(16, 8), (16, 48), (24, 16), (32, 96)])
def test_a_resume_with_another_global_batch_goes_on_after_the_records_of_the_epoch_already_read(saved_batch, batch):
    """A run saved after k batches of `saved_batch` and resumed with another global batch (e.g.
    `data.batch_size=<n>/gpu` on another number of GPUs; one process here, 96 records): the batches it
    reads next start at most one batch before the first record of the epoch's order not yet read, none
    is skipped, and when fewer than a batch of them are left the next epoch begins. Before, the position
    was kept in batches: at batch 16 -> 48, after 2 batches (32 records read) the next epoch began, 64 of
    its records never read."""
    from pipelines.spec import EpochOrder, LoaderSpec
    from pipelines.views import load_recipe

    n, epoch = 96, 2

    def order(b: int) -> EpochOrder:
        return EpochOrder(LoaderSpec(root="", dataset="", split="train", recipe=load_recipe("byol", 32, 16),
                                     batch_size=b, seed=5), n)

    read = order(saved_batch).indices(epoch)
    for k in range(len(order(saved_batch))):
        state = {"step": 40 + k, "loader": [{"epoch": epoch, "batches_done": k}], "rng": [checkpoint.rng_state()]}
        position, note = checkpoint.resume_rank(state, 0, 1, 0, batch, saved_batch, len(order(batch)))
        assert f"global batch {saved_batch}, now {batch}" in note and "each rank goes on in its share" in note
        resumed = order(batch)
        resumed.load_state_dict(position)
        if position["epoch"] == epoch:
            nxt = np.concatenate([idx for _, idx in resumed.remaining()])
            first = list(read).index(nxt[0])
            assert k * saved_batch - batch < first <= k * saved_batch          # at most a batch again, none skipped
            assert nxt.tolist() == read[first:first + len(nxt)].tolist() and first + len(nxt) == n
        else:
            assert position == {"epoch": epoch + 1, "batches_done": 0} and n - k * saved_batch < batch


@pytest.mark.slow
def test_a_run_resumed_with_another_global_batch_reads_its_epochs_in_order(tiny_args, tmp_path, capsys) -> None:
    """Saved after step 5 at batch 16 (64 records, 4 steps an epoch: 16 records of epoch 1 read) and
    resumed at batch 32 (2 steps an epoch): epoch 1 goes on from its first batch of 32 (16 records
    again), steps 6 and 7 read it, step 8 is the first batch of epoch 2: the loader stands at (2, 1). The
    loop counted epochs from the step before (8 // 2: epoch 3 at step 8, epoch 2 never read)."""
    from train.launch import train

    words = [*tiny_args("byol", tmp_path), "run.ckpt_every=5", "run.resume=auto", "run.eval=none"]
    run = train(load_config([*words, "optim.steps=5"]))
    train(load_config([*words, "optim.steps=8", "data.batch_size=32"]))
    assert "resuming step 5 (global batch 16, now 32: epoch 1 goes on after its first 16 records, at batch 0 of 2)" \
        in capsys.readouterr().out
    state = checkpoint.load(run / checkpoint.LATEST)
    assert state["step"] == 8 and [(p["epoch"], p["batches_done"]) for p in state["loader"]] == [(2, 1)]


class Preempted(Exception):
    """The job killed by the cluster, right after a checkpoint."""


@pytest.mark.slow
def test_auto_resume_with_the_same_command_repeats_the_uninterrupted_run(uninterrupted, tiny_args, tmp_path,
                                                                         monkeypatch, capsys) -> None:
    """The first start (no run folder yet) trains from step 0; killed after step 4's checkpoint, the same
    command continues at step 5 (not from 0 again) and every later loss equals the uninterrupted run's;
    once finished, the same command changes nothing (no second evaluation)."""
    from train.launch import train

    words = [*tiny_args("byol", tmp_path), "optim.steps=10", "run.ckpt_every=2", "run.resume=auto"]
    save_latest = checkpoint.save_latest

    def save_then_kill(run_dir, state, keep_last):
        save_latest(run_dir, state, keep_last)
        if state["step"] == 4:
            raise Preempted

    monkeypatch.setattr(checkpoint, "save_latest", save_then_kill)
    with pytest.raises(Preempted):
        train(load_config(words))
    monkeypatch.undo()
    run = tmp_path / "run"
    assert logged_steps(run) == [1, 2, 3, 4] and losses(run)[1] == pytest.approx(uninterrupted[1], rel=1e-5)

    train(load_config(words))
    assert logged_steps(run) == list(range(1, 11))
    for step in range(5, 11):
        assert losses(run)[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-6), step
    assert (run / "backbone.safetensors").is_file()
    # Finished: the same command again (a job requeued after its end) leaves the run as it is.
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    train(load_config(words))
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.slow
def test_auto_skips_a_damaged_newest_checkpoint_and_keep_last_2_keeps_two(uninterrupted, tiny_args, tmp_path,
                                                                          capsys) -> None:
    """keep_last=2 with checkpoints at steps 2, 4, 6 leaves checkpoint.pt (6) and checkpoint-4.pt; with
    checkpoint.pt cut short (a disk that lost its end), auto resumes from step 4 and repeats the
    uninterrupted run."""
    from train.launch import train

    words = [*tiny_args("byol", tmp_path), "optim.steps=10", "run.ckpt_every=2", "run.resume=auto",
             "run.keep_last=2"]
    run = train(load_config([*words, "run.stop_after_steps=6"]))
    assert sorted(p.name for p in run.glob("checkpoint*.pt")) == ["checkpoint-4.pt", "checkpoint.pt"]
    newest = run / "checkpoint.pt"
    assert checkpoint.load(newest)["step"] == 6
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    capsys.readouterr()

    train(load_config(words))
    out = capsys.readouterr().out
    assert "skipped cannot read checkpoint" in out and f"resuming from {run / 'checkpoint-4.pt'} (step 4)" in out
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]
    for step in range(5, 11):
        assert losses(run)[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-6), step
    assert sorted(p.name for p in run.glob("checkpoint*.pt")) == ["checkpoint-8.pt", "checkpoint.pt"]
    assert checkpoint.load(newest)["step"] == 10


@pytest.mark.slow
def test_a_held_signal_stops_at_the_next_log_step_s_checkpoint_and_the_same_command_continues(uninterrupted, tiny_args,
                                                                                            tmp_path, monkeypatch,
                                                                                            capsys) -> None:
    """`run.checkpoint_on_signal=USR2` (what launcher=slurm sets): SLURM's warning caught during step 4
    waits for the next log step (6), where the run saves step 6 and stops; only then does the signal's
    former handler (submitit's, here a recorder) run, once; the same command continues at step 7 and
    ends as the uninterrupted run. Caught outside the steps (here in the final evaluation), the signal
    acts at once, as without the option."""
    from train import loop
    from train.launch import train

    words = [*tiny_args("byol", tmp_path), "optim.steps=10", "run.ckpt_every=100", "run.log_every=3",
             "run.resume=auto", "run.checkpoint_on_signal=USR2"]
    run = tmp_path / "run"
    calls: list[tuple[int, list[int]]] = []          # (checkpoint step then, steps logged then)

    def former(signum, frame) -> None:               # submitit's handler: requeues the job, then exits
        ckpt = run / "checkpoint.pt"
        calls.append((checkpoint.load(ckpt)["step"] if ckpt.exists() else 0, logged_steps(run)))

    def signalled_at(step: int):
        real = loop.train_step

        def step_then_signal(parts, batch, s):
            if s.step == step - 1:                   # during step `step` (s.step is 0-based)
                os.kill(os.getpid(), signal.SIGUSR2)
            return real(parts, batch, s)
        return step_then_signal

    previous = signal.signal(signal.SIGUSR2, former)
    try:
        monkeypatch.setattr(loop, "train_step", signalled_at(4))
        train(load_config(words))
        assert calls == [(6, [3, 6])]                # after the save of step 6, not before, and once
        assert signal.getsignal(signal.SIGUSR2) is former        # the former handler is back
        assert "caught SIGUSR2: saved the checkpoint of step 6 and stopped" in capsys.readouterr().out
        monkeypatch.undo()

        real_eval = loop.evaluate_backbone

        def evaluate_then_signal(*args):
            os.kill(os.getpid(), signal.SIGUSR2)      # outside the steps: acts at once
            return real_eval(*args)

        monkeypatch.setattr(loop, "evaluate_backbone", evaluate_then_signal)
        train(load_config(words))                    # the same command: steps 7-10, the final evaluation
        assert calls[1:] == [(10, [3, 6, 9, 10])]    # at once, in the evaluation after the last save
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert logged_steps(run) == [3, 6, 9, 10]
    for step in (9, 10):
        assert losses(run)[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_a_signal_in_a_periodic_evaluation_requeues_from_its_step_and_the_next_start_evaluates_first(
        tiny_args, tmp_path, monkeypatch, capsys) -> None:
    """With a held signal (`run.checkpoint_on_signal=USR2`), an evaluation every epoch (4 steps) and
    checkpoints otherwise every 100 steps: SLURM's warning during the evaluation of step 4 acts at once
    (an evaluation may outlast the warning), and the job is requeued from a checkpoint of step 4, saved
    just before that evaluation, not from step 0. The next start evaluates step 4 first, then trains on
    as the run that was never stopped, evaluations included."""
    from train import loop
    from train.launch import train

    def words(out) -> list[str]:
        return [*tiny_args("byol", out), "optim.steps=10", "run.ckpt_every=100", "run.eval_every_epochs=1",
                "run.resume=auto", "run.checkpoint_on_signal=USR2"]

    def evals(run_dir) -> list[tuple[int, float]]:
        records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["alignment"]) for r in records if r["kind"] == "eval"]

    whole = train(load_config(words(tmp_path / "whole")))
    run = tmp_path / "run"

    def requeue(signum, frame) -> None:             # submitit's handler: requeues the job, then exits
        raise Preempted(checkpoint.load(run / "checkpoint.pt")["step"])

    real, calls = loop.evaluate_backbone, []

    def evaluate_then_signal(*args):
        calls.append(1)
        if len(calls) == 2:                         # the random-init evaluation, then step 4's
            os.kill(os.getpid(), signal.SIGUSR2)
        return real(*args)

    previous = signal.signal(signal.SIGUSR2, requeue)
    try:
        monkeypatch.setattr(loop, "evaluate_backbone", evaluate_then_signal)
        before = pids_under(os.getpid())
        with pytest.raises(Preempted) as stopped:
            train(load_config(words(tmp_path)))
        assert stopped.value.args == (4,) and logged_steps(run) == [1, 2, 3, 4] and evals(run) == []
        assert workers_of(os.getpid(), before) == []     # ended with the run, not by a garbage collection later
        monkeypatch.undo()
        capsys.readouterr()
        train(load_config(words(tmp_path)))
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert "a signal stopped the evaluation of step 4: it runs again first" in capsys.readouterr().out
    assert losses(run) == pytest.approx(losses(whole), rel=1e-5, abs=1e-6)
    assert [s for s, _ in evals(run)] == [s for s, _ in evals(whole)] == [4, 8, 10]
    assert [a for _, a in evals(run)] == pytest.approx([a for _, a in evals(whole)], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_a_checkpoint_is_due_by_the_clock_at_the_first_log_step_after_ckpt_every_min(uninterrupted, tiny_args, tmp_path,
                                                                                 monkeypatch) -> None:
    """`run.ckpt_every_min=5` with steps of a minute (the cadence's clock advanced by each step) and a line
    every 2 steps: a checkpoint at step 6, the first log step 5 minutes after the start, then none until
    the last step (10, 4 minutes after step 6), however far `run.ckpt_every`; the saves change nothing
    of the training."""
    from types import SimpleNamespace

    from train import loop
    from train.launch import train

    now = [0.0]
    real = loop.train_step

    def a_minute_a_step(parts, batch, s):
        now[0] += 60.0
        return real(parts, batch, s)

    monkeypatch.setattr(checkpoint, "time", SimpleNamespace(monotonic=lambda: now[0]))   # the cadence's clock
    monkeypatch.setattr(loop, "train_step", a_minute_a_step)
    run = train(load_config([*tiny_args("byol", tmp_path), "optim.steps=10", "run.ckpt_every=1000",
                             "run.log_every=2", "run.ckpt_every_min=5", "run.keep_last=5"]))
    kept = {p.name: checkpoint.load(p)["step"] for p in run.glob("checkpoint*.pt")}
    assert kept == {"checkpoint-6.pt": 6, "checkpoint.pt": 10}
    for step in (2, 4, 6, 8, 10):
        assert losses(run)[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-6), step
