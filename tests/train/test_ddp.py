"""2-process gloo DDP equals one process on the concatenated batch: loss, gradients, EMA targets.

Equivalence is exact only when no layer mixes samples within a rank's batch. SyncBatchNorm needs CUDA
(torch raises on CPU tensors), so BatchNorm layers run in eval mode here (running statistics): then
every per-sample computation is independent of how the batch is split, and what remains to test is
the objectives' cross-rank gather and DDP's gradient averaging.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from models.ema import make_target
from models.multicrop import build_model
from pipelines.batch import Batch
from tests.once import made_once
from tests.processes import free_port
from tests.train.test_objectives_modules import DIM, SMALL, step_values
from train.dist import any_rank
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


class LinearSSL(torch.nn.Module):
    """A batch-norm-free embedding network with SSLModel's interface, so that a rank's outputs do
    not depend on the other samples of its batch and DDP can be compared with one process."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(),
                                            torch.nn.Linear(12, 10))
        self.projector = torch.nn.Linear(10, DIM)
        self.predictor = torch.nn.Linear(DIM, DIM)

    def forward(self, groups):
        out = []
        for g in groups:
            v, b = g.shape[:2]
            h = self.backbone(g.reshape(v * b, *g.shape[2:]))                   # (V*B, F)
            z = self.projector(h)
            p = self.predictor(z)
            out.append(SimpleNamespace(h=h.reshape(v, b, -1), z=z.reshape(v, b, -1),
                                       p=p.reshape(v, b, -1)))              # (V, B, ...)
        return out


OBJECTIVE_CASES = [(n, {}) for n in sorted(OBJECTIVES) if n != "sdmp"] + [
    ("dacl", {"with_simclr": True}), ("uota", {"base": "mocov2star", "tau": 3.0})]


def objective_batch(b: int) -> dict:
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(global_views=r(4, b, 3, 4, 4), local_views=r(2, b, 3, 2, 2),
                weak_views=r(2, b, 3, 4, 4), mixed=r(2, b, 3, 4, 4),
                mix_lam=torch.rand(2, b, generator=g, dtype=torch.float64),
                mix_partner=torch.zeros(2, b, dtype=torch.int64), index=torch.arange(b))


def objective_case(name: str, variant: dict, parts: dict):
    cls = OBJECTIVES[name]
    objective = cls(cls.Config(**{**SMALL.get(name, {}), **variant})).double()
    online = LinearSSL().double()
    target = copy.deepcopy(online).requires_grad_(False)
    out = objective(online, target, Batch(**parts), step_values(step=3, epoch=1.0))
    out.loss.backward()
    objective.after_step(out)
    grads = [p.grad for p in online.parameters() if p.grad is not None]
    return out.loss.detach(), grads, objective.state_dict()


EVAL_WORDS = ("run.max_eval_samples=27",)


def rank_worker(rank: int, world: int, port: int, eval_words: list[str], out_dir: str) -> None:
    """One rank of the pair that serves every test below: a step of each method, each objective on a
    linear network, then the evaluation."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for method in METHODS:
            torch.save(one_step(method, rank, world), os.path.join(out_dir, f"{method}-rank{rank}.pt"))
        full, b = objective_batch(8), 8 // world
        for name, variant in OBJECTIVE_CASES:
            parts = {k: (v[rank * b:(rank + 1) * b] if k == "index" else v[:, rank * b:(rank + 1) * b])
                     for k, v in full.items()}
            loss, grads, state = objective_case(name, variant, parts)
            tdist.all_reduce(loss)                               # what DDP does to gradients
            for g in grads:
                tdist.all_reduce(g)
            if rank == 0:
                torch.save((loss / world, [g / world for g in grads], state),
                           os.path.join(out_dir, f"{name}-{len(variant)}.pt"))
        torch.save(eval_result(eval_words), os.path.join(out_dir, f"eval-rank{rank}.pt"))
        torch.save(protocol_steps(rank, world), os.path.join(out_dir, f"protocol-rank{rank}.pt"))
        flags = any_rank(torch.device("cpu"), rank == 0, rank == 1, False)
        torch.save(flags, os.path.join(out_dir, f"any-rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_args, tmp_path_factory) -> tuple[Path, list[str]]:
    """The folder of what each of 2 gloo processes computed (a step of every method in METHODS, every
    objective case on `LinearSSL`, and the evaluation of `eval_words`), and `eval_words`. One spawned pair serves every test, once per session
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


@pytest.mark.ddp
def test_every_objective_on_two_ranks_equals_one_process_on_the_concatenated_batch(two_ranks) -> None:
    """Each objective's own cross-rank gathers (negatives, keys, UOTA's statistics, queues): loss,
    gradients and objective state of 2 gloo ranks equal one process, in float64 on a network with
    no batch norm."""
    for name, variant in OBJECTIVE_CASES:
        loss, grads, state = objective_case(name, variant, objective_batch(8))
        loss2, grads2, state2 = torch.load(two_ranks[0] / f"{name}-{len(variant)}.pt")
        torch.testing.assert_close(loss2, loss, rtol=1e-10, atol=1e-12, msg=name)
        for g1, g2 in zip(grads, grads2, strict=True):
            torch.testing.assert_close(g2, g1, rtol=1e-9, atol=1e-12, msg=name)
        for k in state:
            torch.testing.assert_close(state2[k], state[k], msg=name)


def protocol_steps(rank: int, world: int) -> dict:
    """The linear protocol's head after 3 steps (`train.protocol.train_step`) on this rank's slice of fixed
    batches of 8, the head DDP-wrapped on several ranks, the frozen backbone in eval mode."""
    from models.backbone import build_backbone
    from train.protocol import Classifier, ProtocolConfig, build_optimizer, train_step

    torch.manual_seed(0)
    backbone, width = build_backbone("test_resnet", PX)
    model = Classifier(backbone, width, 5, bn=False, frozen=True)
    trained = DistributedDataParallel(model.head) if world > 1 else model.head
    optimizer = build_optimizer(ProtocolConfig(lr=0.5, nesterov=True, weight_decay=1e-4), model)
    g = torch.Generator().manual_seed(2)
    part = slice(rank * B // world, (rank + 1) * B // world)
    for _ in range(3):
        views, labels = torch.randn(B, 3, PX, PX, generator=g), torch.randint(0, 5, (B,), generator=g)
        train_step(model, trained, optimizer, views[part], labels[part])
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.ddp
def test_the_linear_protocol_on_two_ranks_takes_the_one_process_steps(two_ranks) -> None:
    """Two ranks on halves of each batch end with the head of one process on the whole batches, and the
    frozen backbone (its BatchNorm statistics too) untouched on both."""
    torch.set_num_threads(1)
    single = protocol_steps(0, 1)
    ranks = [torch.load(two_ranks[0] / f"protocol-rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        for k, v in single.items():
            assert torch.allclose(r[k].float(), v.float(), rtol=1e-5, atol=1e-6), k
    torch.manual_seed(0)
    from models.backbone import build_backbone

    fresh = build_backbone("test_resnet", PX)[0].state_dict()
    assert all(torch.equal(single[f"backbone.{k}"], v) for k, v in fresh.items())
    assert not torch.equal(single["head.1.weight"], torch.zeros_like(single["head.1.weight"]))


def eval_result(words: list[str]) -> dict:
    """kNN + probe of a fixed random-init backbone, evaluated by this process (and its peers, if any),
    and the number of feature rows this process extracted itself, per split."""
    from train import evaluate
    from train.resolve import load_config
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


@pytest.mark.ddp
def test_a_flag_of_one_rank_is_every_rank_s(two_ranks) -> None:
    """`any_rank` at a log step: a flag that one rank raised (a caught signal on rank 0, a checkpoint due
    by rank 1's clock) comes back raised on both, so that both save together; one none raised, on none."""
    out, _ = two_ranks
    assert [torch.load(out / f"any-rank{r}.pt") for r in range(2)] == [(True, True, False)] * 2


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
