"""`run.checkpoint_on_signal`'s signal (`train.dist.HeldSignal`) on its own: held, it waits for `release`
and then does what it did before, a Python handler or the default (the process ends by the signal);
unheld, it acts at once; "" installs nothing. The runs it stops: tests/train/test_resume.py (one process)
and tests/train/test_cluster.py (a SLURM job of two ranks)."""

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
        assert calls == ["former"] and not held.noted
        with held.holding():
            os.kill(os.getpid(), signal.SIGUSR2)
            with held.holding(False):                     # an evaluation inside the loop: at once
                os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)          # twice held: one action
            assert calls == ["former", "former"] and held.agree(*any_rank(torch.device("cpu"), held.noted))
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
        assert not held.agree(*any_rank(torch.device("cpu"), held.noted))
    held.release()
    assert signal.getsignal(signal.SIGUSR2) is before


HELD_TERM = """
import os, signal, torch
from train.dist import HeldSignal, any_rank
held = HeldSignal("TERM")
with held.holding():
    os.kill(os.getpid(), signal.SIGTERM)
    print("held", held.agree(*any_rank(torch.device("cpu"), held.noted)), flush=True)
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


def test_sigterm_is_held_in_a_run_of_one_process_only() -> None:
    """With several processes a launcher sends SIGTERM to each rank's whole process group (its loader
    workers end at once), so TERM cannot be held there: one line naming what to use instead."""
    assert load_config(["run.checkpoint_on_signal=TERM"], world_size=1).run.checkpoint_on_signal == "TERM"
    with pytest.raises(ConfigError, match="one process only.*launcher=slurm"):
        load_config(["run.checkpoint_on_signal=TERM"], world_size=2)
    assert load_config(["run.checkpoint_on_signal=USR2"], world_size=8).run.checkpoint_on_signal == "USR2"
