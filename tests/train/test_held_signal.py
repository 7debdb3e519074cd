"""`run.checkpoint_on_signal`'s signal (`train.dist.HeldSignal`) on its own: held, it waits for `release`
and then does what it did before, a Python handler or the default (the process ends by the signal);
unheld, it acts at once; "" installs nothing; two held signals act for those caught, in the order named.
The runs it stops: tests/train/test_resume.py (one process), tests/train/test_cluster.py (a SLURM job of
two ranks) and tests/train/test_killed_training.py (SIGTERM to every process of two ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from train.config import ConfigError
from train.dist import HeldSignal, any_rank
from train.resolve import load_config
from tests.train.two_ranks import ROOT, env_here


def test_held_the_signal_waits_for_release_and_then_runs_the_former_handler_once() -> None:
    calls: list[str] = []
    previous = signal.signal(signal.SIGUSR2, lambda *_: calls.append("former"))
    try:
        held = HeldSignal("USR2")
        os.kill(os.getpid(), signal.SIGUSR2)              # not held: at once
        assert calls == ["former"] and not any(held.caught)
        with held.holding():
            os.kill(os.getpid(), signal.SIGUSR2)
            with held.holding(False):                     # an evaluation inside the loop: at once
                os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)          # twice held: one action
            assert calls == ["former", "former"] and held.agree(any_rank(torch.device("cpu"), *held.caught))
        assert calls == ["former", "former"]
        former = signal.getsignal(signal.SIGUSR2)
        held.release()
        assert calls == ["former"] * 3 and signal.getsignal(signal.SIGUSR2) is not former   # put back
        os.kill(os.getpid(), signal.SIGUSR2)
        assert calls == ["former"] * 4
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_without_a_signal_nothing_is_installed_and_no_rank_stops() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    held = HeldSignal("")
    with held.holding():
        assert not held.agree(any_rank(torch.device("cpu"), *held.caught))
    held.release()
    assert signal.getsignal(signal.SIGUSR2) is before



@pytest.mark.parametrize("sent", [["TERM"], ["TERM", "USR2"]], ids=["term", "both"])
def test_two_held_signals_act_at_release_for_those_some_rank_caught_in_the_order_named(sent) -> None:
    """`USR2+TERM` (what launcher=slurm sets) under submitit's handlers: a preemption's SIGTERM alone is
    held and then ignored, as submitit does (the task ends; SLURM requeues the job or cancels it); with
    the warning too, the warning's handler (the requeue) comes first. The signals another rank caught
    count as this rank's (`agree`), and the line names them."""
    calls: list[str] = []
    before = {s: signal.signal(s, lambda signum, _: calls.append(signal.Signals(signum).name))
              for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        held = HeldSignal("USR2+TERM")
        with held.holding():
            os.kill(os.getpid(), getattr(signal, f"SIG{sent[0]}"))
            assert held.agree(any_rank(torch.device("cpu"), *held.caught)) and calls == []
            if len(sent) > 1:
                assert held.agree([True, False])          # another rank caught the warning
        assert held.what() == " and ".join(f"SIG{n}" for n in ("USR2", "TERM") if n in sent)
        held.release()
        assert calls == [f"SIG{n}" for n in ("USR2", "TERM") if n in sent]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

HELD_TERM = """
import os, signal, torch
from train.dist import HeldSignal, any_rank
held = HeldSignal("TERM")
with held.holding():
    os.kill(os.getpid(), signal.SIGTERM)
    print("held", held.agree(any_rank(torch.device("cpu"), *held.caught)), flush=True)
held.release()
print("not reached", flush=True)
"""


def test_a_held_signal_without_a_former_handler_ends_the_process_at_release() -> None:
    """TERM (a scheduler's, under torchrun) with its default action: the process ends by it, after what
    the held part did (there: the checkpoint)."""
    done = subprocess.run([sys.executable, "-c", HELD_TERM], cwd=ROOT, env=env_here(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM and done.stdout == "held True\n", done.stderr


def test_an_unknown_signal_is_one_line_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="run.checkpoint_on_signal.*USR2.*TERM"):
        load_config(["run.checkpoint_on_signal=USR1"])

