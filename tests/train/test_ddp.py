"""2-process gloo DDP equals one process on the concatenated batch: loss, gradients, EMA targets.

Equivalence is exact only when no layer mixes samples within a rank's batch. SyncBatchNorm needs CUDA
(torch raises on CPU tensors), so BatchNorm layers run in eval mode here (running statistics): then
every per-sample computation is independent of how the batch is split, and what remains to test is
the objectives' cross-rank gather and DDP's gradient averaging.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from models.ema import make_target
from models.multicrop import build_model
from pipelines.batch import Batch
from tests.once import made_once
from train.objectives import OBJECTIVES
from train.objectives.base import StepValues

B, PX = 8, 32
# Global views only (simclr / mocov3 gather negatives), and SDMP: its mixes pair samples within each
# rank's batch (partner B-1-i), its keys are gathered from every rank.
METHODS = ["byol", "mocov3", "simclr", "sdmp"]


def full_batch() -> Batch:
    """Two global views, and (read by SDMP only) two mixed views with their lam."""
    g = torch.Generator().manual_seed(1)
    return Batch(global_views=torch.randn(2, B, 3, PX, PX, generator=g), local_views=None, weak_views=None,
                 mixed=torch.randn(2, B, 3, PX, PX, generator=g), mix_lam=torch.rand(1, B, generator=g).expand(2, B),
                 mix_partner=None, index=torch.arange(B))


def rank_batch(rank: int, world: int) -> Batch:
    b, part = full_batch(), slice(rank * B // world, (rank + 1) * B // world)
    return Batch(global_views=b.global_views[:, part], local_views=None, weak_views=None, mixed=b.mixed[:, part],
                 mix_lam=b.mix_lam[:, part], mix_partner=None, index=b.index[part])


def two_ranks_in_one_process(objective, online, target, batch, s: StepValues, monkeypatch=None):
    """SDMP's loss as two ranks compute it, in one process: each half of the batch is a rank's, whose
    own keys come first and the other rank's after them (what the gather gives each rank); the loss
    is the mean of the two (DDP averages the gradients)."""
    from train.objectives import sdmp

    halves = [rank_batch(r, 2) for r in range(2)]
    with torch.no_grad():
        keys = [target([h.global_views[:2], h.mixed[:2]]) for h in halves]       # (clean, mixed) per rank
    loss = 0.0
    for r in range(2):
        other = [keys[1 - r][0].z[0], keys[1 - r][0].z[1], keys[1 - r][1].z[0], keys[1 - r][1].z[1]]
        monkeypatch.setattr(sdmp, "gather_nograd_local_first", lambda x: torch.cat([x.detach(), other.pop(0)]))
        loss = loss + objective(online, target, halves[r], s).loss / 2
        assert not other                                  # all four gathers of the objective were seen
    return loss


def one_step(method: str, rank: int, world: int, monkeypatch=None) -> dict:
    """Loss, gradients and EMA target after one SGD step on this rank's slice of `full_batch()` (SDMP
    on one process: `two_ranks_in_one_process`)."""
    cls = OBJECTIVES[method]
    objective = cls(cls.Config())
    torch.manual_seed(0)
    online = build_model("test_resnet", PX, 32, 16, 32 if cls.needs.target else 0).eval()
    target = make_target(online).eval() if cls.needs.target else None
    model = DistributedDataParallel(online) if world > 1 else online
    s = StepValues(step=0, total_steps=10, epoch=0.0, lr=0.1, weight_decay=0.0, ema=0.9)
    if method == "sdmp" and world == 1:
        total = two_ranks_in_one_process(objective, online, target, full_batch(), s, monkeypatch)
    else:
        total = objective(model, target, rank_batch(rank, world), s).loss
    total.backward()
    loss = total.detach().clone()
    if world > 1:
        tdist.all_reduce(loss)
        loss /= world
    grads = {n: p.grad.clone() for n, p in online.named_parameters() if p.grad is not None}
    torch.optim.SGD(online.parameters(), lr=s.lr).step()
    if target is not None:
        target.update_from(online, momentum=s.ema)
    return {"loss": loss, "grads": grads,
            "target": {k: v.clone() for k, v in target.state_dict().items()} if target is not None else {}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


EVAL_WORDS = ("run.max_eval_samples=27",)


def rank_worker(rank: int, world: int, port: int, eval_words: list[str], out_dir: str) -> None:
    """One rank of the pair that serves every test below: a step of each method, then the evaluation."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for method in METHODS:
            torch.save(one_step(method, rank, world), os.path.join(out_dir, f"{method}-rank{rank}.pt"))
        torch.save(eval_result(eval_words), os.path.join(out_dir, f"eval-rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_args, tmp_path_factory) -> tuple[Path, list[str]]:
    """The folder of what each of 2 gloo processes computed (a step of every method in METHODS, and the
    evaluation of `eval_words`), and `eval_words`. One spawned pair serves every test, once per session
    (`tests.once`): each spawned process imports torch and this code anew, seconds of CPU per process."""
    def make(out: Path) -> None:
        words = tiny_args("byol", out, *EVAL_WORDS)
        (out / "words.json").write_text(json.dumps(words))          # for the workers that did not make it
        mp.spawn(rank_worker, args=(2, free_port(), words, str(out)), nprocs=2, join=True)

    out = made_once(tmp_path_factory, "two-ranks", make)
    return out, json.loads((out / "words.json").read_text())


@pytest.mark.ddp
@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_equal_one_process_on_the_whole_batch(method: str, two_ranks, monkeypatch) -> None:
    torch.set_num_threads(1)
    single = one_step(method, 0, 1, monkeypatch)
    ranks = [torch.load(two_ranks[0] / f"{method}-rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert torch.allclose(r["loss"], single["loss"], rtol=1e-5, atol=1e-6)
        assert set(r["grads"]) == set(single["grads"])
        for name, grad in single["grads"].items():
            assert torch.allclose(r["grads"][name], grad, rtol=1e-4, atol=1e-6), name
        for name, value in single["target"].items():
            assert torch.allclose(r["target"][name].float(), value.float(), rtol=1e-5, atol=1e-6), name
    for name, value in ranks[0]["target"].items():
        assert torch.equal(value, ranks[1]["target"][name]), name    # targets identical across ranks


def eval_result(words: list[str]) -> dict:
    """kNN + probe of a fixed random-init backbone, evaluated by this process (and its peers, if any),
    and the number of feature rows this process extracted itself, per split."""
    from train import evaluate
    from train.config import load_config
    from train.setup import build_online

    cfg = load_config(words, world_size=tdist.get_world_size() if tdist.is_initialized() else 1)
    torch.manual_seed(5)
    backbone = build_online(cfg, torch.device("cpu")).backbone
    rows, extract = [], evaluate.extract_features

    def counted(*args, **kw):
        out = extract(*args, **kw)
        rows.append(out[0].shape[0])
        return out

    evaluate.extract_features = counted
    try:
        return {**evaluate.evaluate_backbone(cfg, backbone, "torch", torch.device("cpu")), "rows": rows}
    finally:
        evaluate.extract_features = extract


@pytest.mark.ddp
def test_evaluation_on_two_ranks_equals_one_process(two_ranks) -> None:
    """Each rank extracts its shard (27 records of each split, the cap of run.max_eval_samples: 13 and
    14 per rank), the train features are gathered, the val counts and health sums added up: every rank
    gets the kNN and probe accuracy of one process on the whole splits, and its health metrics (the
    alignment from other random views); no rank waits idle while another evaluates."""
    torch.set_num_threads(1)
    out, words = two_ranks
    single = eval_result(words)
    assert single.pop("rows") == [27, 27]
    ranks = [torch.load(out / f"eval-rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r.pop("rows") for r in ranks] == [[13, 13], [14, 14]]    # each rank its share, no rank idle
    for r in ranks:
        exact = {k: r.pop(k) for k in ("knn_top1", "linear_top1", "eval_train_samples", "eval_val_samples")}
        assert exact == {k: single[k] for k in exact}
        # The features of a batch of 13 or 14 differ from those of a batch of 27 in the last float bits.
        assert r["rankme"] == pytest.approx(single["rankme"], rel=1e-5)
        assert r["feature_std"] == pytest.approx(single["feature_std"], rel=1e-5)
        # Alignment is a mean over random views, drawn per batch: other batches, other views.
        assert 0 < r["alignment"] < 4 and r["alignment"] == ranks[0]["alignment"]


def test_the_gpu_is_set_before_the_process_group_that_names_it_with_the_run_s_timeout(monkeypatch) -> None:
    """NCCL binds its communicator to the device named at init; the timeout is `run.dist_timeout_min`,
    not NCCL's 10-minute default (a CPU machine records the calls instead of making them)."""
    from datetime import timedelta

    from train import dist

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(tdist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw)))
    monkeypatch.setattr(dist, "is_distributed", lambda: False)
    assert dist.init_from_env(use_cuda=True, timeout_min=45.0) == torch.device("cuda", 3)
    assert calls == [("set_device", torch.device("cuda", 3)),
                     ("init_process_group", {"backend": "nccl", "timeout": timedelta(minutes=45),
                                             "device_id": torch.device("cuda", 3)})]


def test_training_on_a_gpu_lets_cudnn_pick_its_algorithms(monkeypatch) -> None:
    from train import dist, setup

    monkeypatch.setattr(dist, "init_from_env", lambda use_cuda, timeout_min: torch.device("cuda", 0))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert setup.select_device("auto") == torch.device("cuda", 0) and torch.backends.cudnn.benchmark
