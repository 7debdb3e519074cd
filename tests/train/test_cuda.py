"""The trainer on a GPU (tests marked `gpu`): every objective trains a few steps on `cuda` from the DALI
GPU graph with bf16 autocast and a channels-last network, its losses are finite, and a run resumed from
its checkpoint of a mid-run step repeats the uninterrupted run's losses."""

from __future__ import annotations

import json
import math

import pytest
import torch

from train.objectives import OBJECTIVES
from train.resolve import load_config

pytest.importorskip("nvidia.dali")
pytestmark = [pytest.mark.gpu, pytest.mark.slow]        # slow: started first (tests/conftest.py)


@pytest.fixture
def deterministic():
    """cuDNN and torch kernels that give the same result on every run, so that a resumed run can be
    compared with an uninterrupted one (bf16 included)."""
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[:2]
    torch.use_deterministic_algorithms(before[2])


def _losses(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("method", sorted(OBJECTIVES))
def test_objective_trains_and_resumes_on_cuda(method: str, tiny_args, tmp_path, deterministic) -> None:
    # 6 steps over 64 images at batch 16: the checkpoint of step 3 is mid-epoch and the run crosses an
    # epoch. The run keeps that checkpoint (`run.keep_last=2`), and a second run resumed from it repeats
    # steps 4-6 (a run stopped there, `run.stop_after_steps`, writes the same checkpoint: test_resume).
    from train.launch import train
    from train.setup import build_online

    words = ["data.backend=dali", "run.device=cuda", "run.amp=true", "model.channels_last=true",
             "optim.steps=6", "run.ckpt_every=3", "run.keep_last=2"]
    cfg = load_config([*tiny_args(method, tmp_path / "a"), *words])
    online = build_online(cfg, torch.device("cuda"))
    assert next(online.parameters()).is_cuda
    assert online.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last)     # the small stem
    run = train(cfg)
    full = _losses(run)
    assert sorted(full) == list(range(1, 7)) and all(math.isfinite(v) for v in full.values())
    assert len(set(full.values())) == 6                       # new batches every step

    resumed = _losses(train(load_config([*tiny_args(method, tmp_path / "b"), *words,
                                         f"run.resume={run / 'checkpoint-3.pt'}"])))
    assert sorted(resumed) == list(range(1, 7))
    for step in range(4, 7):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), (method, step)


def test_training_on_a_high_priority_stream_trains_as_on_the_default_one(tiny_args, tmp_path, deterministic,
                                                                         monkeypatch) -> None:
    """`run.train_stream=high` (the default): the steps run on a stream of a higher priority than the default one, the
    DALI loader's batches reach it ready (the same losses as a run on the default stream, which they
    would not be if a step read a batch still being copied), and the default stream is current again
    afterwards; on a CPU the option does nothing."""
    from train import loop
    from train.launch import train, training_stream

    streams = []
    real = loop.train_step

    def noted(parts, batch, s):
        streams.append(torch.cuda.current_stream().priority)
        return real(parts, batch, s)

    words = ["data.backend=dali", "run.device=cuda", "run.amp=true", "optim.steps=6"]
    default = _losses(train(load_config([*tiny_args("byol", tmp_path / "a"), *words, "run.train_stream=default"])))
    monkeypatch.setattr(loop, "train_step", noted)
    high = _losses(train(load_config([*tiny_args("byol", tmp_path / "b"), *words, "run.train_stream=high"])))
    assert len(streams) == 6 and len(set(streams)) == 1 and streams[0] < torch.cuda.default_stream().priority
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert sorted(high) == sorted(default) == list(range(1, 7))
    for step in default:
        assert high[step] == pytest.approx(default[step], rel=1e-5, abs=1e-6), step
    with training_stream(torch.device("cpu"), "high") as stream:
        assert stream is None


def test_a_graph_run_of_two_training_batches_trains_as_runs_of_one(tiny_args, tmp_path, deterministic) -> None:
    """`data.graph_batches=2` (one run of the DALI GPU graph makes 2 training batches): the steps train
    on the batches of runs of one, so the losses are those of `data.graph_batches=1`, through an epoch
    boundary, channels-last and bf16 as in training."""
    from train.launch import train

    words = ["data.backend=dali", "run.device=cuda", "run.amp=true", "model.channels_last=true", "optim.steps=6"]
    one = _losses(train(load_config([*tiny_args("byol", tmp_path / "a"), *words, "data.graph_batches=1"])))
    two = _losses(train(load_config([*tiny_args("byol", tmp_path / "b"), *words, "data.graph_batches=2"])))
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5, abs=1e-6), step


def test_the_torch_tail_trains_as_the_graph_s_own_tail(tiny_args, tmp_path, deterministic) -> None:
    """`data.gpu_tail=torch` (the DALI graph's crops finished by batched torch ops on a stream of their own,
    the training on its stream of the highest priority): the steps train on views within one level of
    those of the graph's own tail, so the first step's loss is the graph's within 1 % and every loss is
    finite, channels-last and bf16 as in training."""
    from train.launch import train

    words = ["data.backend=dali", "run.device=cuda", "run.amp=true", "model.channels_last=true", "optim.steps=6",
             "run.train_stream=high"]
    graph = _losses(train(load_config([*tiny_args("byol", tmp_path / "a"), *words, "data.gpu_tail=graph"])))
    tail = _losses(train(load_config([*tiny_args("byol", tmp_path / "b"), *words, "data.gpu_tail=torch"])))
    assert sorted(graph) == sorted(tail) == list(range(1, 7))
    assert all(math.isfinite(x) for x in tail.values())
    assert tail[1] == pytest.approx(graph[1], rel=1e-2)
