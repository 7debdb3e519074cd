"""Many machines: 2 "nodes" x 1 process over torchrun's c10d rendezvous on 127.0.0.1 equal one node of 2
processes; `nodes=` without a rendezvous address is one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train.test_train_cli import fails_in_one_line
from train.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
SIX_STEPS = ("optim.steps=6", "run.ckpt_every=2", "data.num_workers=0")


def env_here(**extra: str) -> dict[str, str]:
    """The environment of a `python -m train` started by a test: this checkout's code, one thread per
    process (the same in every run compared, so the float sums are the same)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def free_port(low: int = 1024, high: int = 65536) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if low <= port < high:
            return port


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss per step of metrics.jsonl (a resumed run's later records win)."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def assert_same_training(run: Path, reference: Path) -> None:
    """The same losses at every step, and bit-identical online and target networks at the end."""
    assert losses(run) == losses(reference)
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (run, reference))
    assert a["step"] == b["step"] == 6
    for part in ("online", "target"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), (part, name)


@pytest.fixture(scope="module")
def two_processes(tiny_args, tmp_path_factory) -> Path:
    """The run folder of 6 byol steps in 2 processes on this machine (`gpus=2`)."""
    out = tmp_path_factory.mktemp("one-node")
    done = subprocess.run([sys.executable, "-m", "train", "gpus=2", *tiny_args("byol", out, *SIX_STEPS)], cwd=ROOT,
                          env=env_here(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out / "run"


@pytest.mark.ddp
@pytest.mark.slow
def test_two_nodes_over_a_c10d_rendezvous_equal_one_node_of_two_processes(two_processes, tiny_args, tmp_path) -> None:
    """The same command on two "nodes" (two launchers, 1 process each, on 127.0.0.1) meets at the
    rendezvous and trains exactly as `gpus=2` does: ranks, shards and gathers map the same way, so
    losses and weights are bit-identical (gloo sums 2 ranks in the same order)."""
    out = tmp_path / "runs"
    command = [sys.executable, "-m", "train", "gpus=1", "nodes=2", f"rdzv=127.0.0.1:{free_port()}",
               *tiny_args("byol", out, *SIX_STEPS)]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=env_here(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sum("training byol on synthetic (torch backend, 2 rank(s), cpu)" in o for o in outputs) == 1, outputs
    assert_same_training(out / "run", two_processes)


def test_nodes_without_a_rendezvous_address_is_one_line_and_writes_nothing(tiny_args, capsys, tmp_path,
                                                                          monkeypatch) -> None:
    out = tmp_path / "runs"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    fails_in_one_line(capsys, ["nodes=2", *tiny_args("byol", out)], "NODES=2 needs the rendezvous address",
                      "RDZV=<first node's host>:29500", "the same on every node")
    fails_in_one_line(capsys, ["nodes=0", *tiny_args("byol", out)], "nodes=0", "NODES=1")
    fails_in_one_line(capsys, ["nodes=two", *tiny_args("byol", out)], "'nodes'", "int")
    assert not out.exists()
