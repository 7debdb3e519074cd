"""kNN, the linear probe and the health metrics against literal transcriptions, known answers and real
batches; the blocks, probe paths and per-rank sums give what one pass over everything gives."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models.backbone import build_backbone
from pipelines.batch import Batch
import torch.nn.functional as F

from train import evaluate
from train.evaluate import (alignment_sums, extract_features, fit_probe, health, health_sums, knn_correct, knn_top1,
                            linear_probe_top1)


def _clusters(n: int, d: int, classes: int, spread: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=torch.Generator().manual_seed(0)) * 4
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + spread * torch.randn(n, d, generator=g), y


def _literal_knn(xt, yt, xv, yv, classes: int, k: int, t: float) -> float:
    """Wu et al. 2018 weighted vote, written out with Python loops in float64."""
    correct = 0
    for i in range(xv.shape[0]):
        q = xv[i].double()
        sims = [float(q @ xt[j].double() / (q.norm() * xt[j].double().norm())) for j in range(xt.shape[0])]
        nearest = sorted(range(len(sims)), key=lambda j: -sims[j])[:k]
        votes = [0.0] * classes
        for j in nearest:
            votes[int(yt[j])] += math.exp(sims[j] / t)
        correct += int(max(range(classes), key=lambda c: votes[c]) == int(yv[i]))
    return correct / xv.shape[0]


@pytest.mark.parametrize("k, t, rows, columns", [(20, 0.07, 1024, 65536), (5, 0.5, 7, 3), (200, 0.07, 16, 33),
                                                 (20, 0.07, 30, 20)])
def test_knn_matches_a_literal_weighted_vote(k: int, t: float, rows: int, columns: int) -> None:
    """Whatever the blocks of val rows and train columns (the running top k merged block by block)."""
    xt, yt = _clusters(80, 8, 4, spread=5.0, seed=1)      # overlapping clusters: votes matter
    xv, yv = _clusters(30, 8, 4, spread=5.0, seed=2)
    got = knn_correct(xt, yt, xv, yv, num_classes=4, k=k, temperature=t, rows=rows, columns=columns) / 30
    assert got == _literal_knn(xt, yt, xv, yv, 4, min(k, 80), t)
    assert 0.3 < got < 1.0                                 # neither trivial nor chance


def test_knn_weights_by_similarity_not_by_count() -> None:
    # Two near neighbours of class 1 outvote three far ones of class 0 only through exp(sim / T).
    xt = torch.tensor([[1.0, 0.02], [1.0, -0.02], [0.6, 0.8], [0.6, -0.8], [0.5, 0.85]])
    yt = torch.tensor([1, 1, 0, 0, 0])
    xv, yv = torch.tensor([[1.0, 0.0]]), torch.tensor([1])
    assert knn_top1(xt, yt, xv, yv, num_classes=2, k=5, temperature=0.07) == 1.0
    assert knn_top1(xt, yt, xv, yv, num_classes=2, k=5, temperature=100.0) == 0.0   # ~ majority


def test_knn_separates_clusters_and_is_at_chance_on_random_labels() -> None:
    xt, yt = _clusters(500, 16, 5, spread=0.5, seed=3)
    xv, yv = _clusters(200, 16, 5, spread=0.5, seed=4)
    assert knn_top1(xt, yt, xv, yv, 5) == 1.0
    g = torch.Generator().manual_seed(5)
    acc = knn_top1(torch.randn(2000, 16, generator=g), torch.randint(0, 5, (2000,), generator=g),
                   torch.randn(1000, 16, generator=g), torch.randint(0, 5, (1000,), generator=g), 5)
    assert abs(acc - 0.2) < 0.06                           # 4.7 standard errors


def test_linear_probe_solves_separable_data_deterministically_and_not_noise() -> None:
    xt, yt = _clusters(400, 10, 4, spread=1.0, seed=6)
    xv, yv = _clusters(200, 10, 4, spread=1.0, seed=7)
    a = linear_probe_top1(xt, yt, xv, yv, 4)
    assert a >= 0.99 and a == linear_probe_top1(xt, yt, xv, yv, 4)
    g = torch.Generator().manual_seed(8)
    acc = linear_probe_top1(torch.randn(400, 10, generator=g), torch.randint(0, 4, (400,), generator=g),
                            torch.randn(400, 10, generator=g), torch.randint(0, 4, (400,), generator=g), 4)
    assert acc < 0.4                                       # chance is 0.25


def test_linear_probe_standardises_features_and_ignores_constant_columns() -> None:
    # Label in one tiny-scale feature, noise in huge-scale ones, plus a constant column: without
    # standardisation the L2 penalty and conditioning would hide the signal; with it the probe is exact.
    g = torch.Generator().manual_seed(9)
    y = torch.randint(0, 2, (300,), generator=g)
    signal = (y.float() * 2 - 1 + 0.1 * torch.randn(300, generator=g)) * 1e-4
    noise = 1e4 * torch.randn(300, 5, generator=g)
    x = torch.cat([signal[:, None], noise, torch.full((300, 1), 7.0)], dim=1)   # (300, 7)
    acc = linear_probe_top1(x[:200], y[:200], x[200:], y[200:], num_classes=2)
    assert acc == 1.0


def test_bad_evaluation_inputs_are_value_errors() -> None:
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        knn_top1(x, y, x, y, num_classes=2)
    with pytest.raises(ValueError, match="features must be"):
        linear_probe_top1(x, y[:5], x, y, num_classes=3)
    with pytest.raises(ValueError, match="temperature > 0"):
        knn_top1(x, y, x, y, num_classes=3, temperature=0.0)


def _batches(n_batches: int, b: int, seed: int, px: int = 16) -> list[Batch]:
    """Images whose mean colour encodes the label: class c is bright in channel c."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        label = torch.randint(0, 3, (b,), generator=g)
        x = 0.3 * torch.randn(1, b, 3, px, px, generator=g)                     # (1, B, 3, H, W)
        x[0, torch.arange(b), label] += 2.0
        out.append(Batch(global_views=x, local_views=None, weak_views=None, mixed=None, mix_lam=None,
                         mix_partner=None, index=torch.arange(i * b, (i + 1) * b), label=label))
    return out


def test_extract_features_runs_the_backbone_in_eval_mode_on_the_first_global_view() -> None:
    torch.manual_seed(0)
    backbone, f = build_backbone("resnet18", 16)
    batches = _batches(2, 3, seed=10)
    feats, labels, index = extract_features(backbone, batches, "cpu")
    assert backbone.training                                # mode restored
    assert feats.shape == (6, f) and feats.dtype == torch.float32 and not feats.requires_grad
    assert torch.equal(labels, torch.cat([bt.label for bt in batches]))
    assert torch.equal(index, torch.arange(6))
    with torch.no_grad():
        expected = backbone.eval()(torch.cat([bt.global_views[0] for bt in batches]))   # (6, F)
    torch.testing.assert_close(feats, expected, rtol=1e-4, atol=1e-5)
    empty = extract_features(backbone, [], "cpu", view_px=16)                # a rank whose shard is empty
    assert empty[0].shape == (0, f) and empty[1].shape == empty[2].shape == (0,)


def test_the_probe_fits_by_sgd_above_the_size_threshold_deterministically(monkeypatch) -> None:
    xt, yt = _clusters(3000, 10, 4, spread=1.0, seed=6)
    xv, yv = _clusters(500, 10, 4, spread=1.0, seed=7)
    assert fit_probe(xt, yt, 4).method == "lbfgs"
    monkeypatch.setattr(evaluate, "PROBE_LBFGS_MAX", 0)
    a, b = fit_probe(xt, yt, 4, seed=3), fit_probe(xt, yt, 4, seed=3)
    assert a.method == "sgd" and torch.equal(a.w, b.w)
    assert a.correct(xv, yv) >= 0.99 * 500


def test_the_sgd_probe_shared_over_ranks_takes_the_one_process_steps(monkeypatch) -> None:
    """Ranks that fit the SGD probe together, each on every world-th row of a mini-batch with their
    gradients summed, end with the one-process probe (three ranks as threads, summing through a barrier)."""
    from concurrent.futures import ThreadPoolExecutor
    import threading

    monkeypatch.setattr(evaluate, "PROBE_LBFGS_MAX", 0)
    monkeypatch.setattr(evaluate, "PROBE_SGD_BATCH", 512)
    xt, yt = _clusters(3000, 10, 4, spread=3.0, seed=6)
    one = fit_probe(xt, yt, 4, seed=3)
    world, barrier, sent = 3, threading.Barrier(3), {}

    def reduce_of(rank: int):
        def reduce(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            sent[rank] = [t.clone() for t in tensors]
            barrier.wait()
            total = [sum(parts) for parts in zip(*(sent[r] for r in range(world)))]
            barrier.wait()
            return total
        return reduce

    with ThreadPoolExecutor(world) as pool:
        shared = list(pool.map(lambda r: fit_probe(xt, yt, 4, seed=3, rank=r, world=world, reduce=reduce_of(r)),
                               range(world)))
    assert all(torch.equal(p.w, shared[0].w) and torch.equal(p.b, shared[0].b) for p in shared)
    assert torch.allclose(shared[0].w, one.w, atol=1e-4) and torch.allclose(shared[0].b, one.b, atol=1e-4)
    assert not torch.allclose(one.w, torch.zeros_like(one.w), atol=1e-2)


def _literal_rankme(x: torch.Tensor) -> float:
    """Garrido et al. (arXiv:2210.02885v3) Eq. 1 on the singular values of the (N, D) matrix itself."""
    sigma = torch.linalg.svdvals(x.double())
    p = sigma / sigma.sum() + 1e-7
    return float(torch.exp(-(p * p.log()).sum()))


def test_health_metrics_match_their_definitions_and_add_up_over_shards() -> None:
    g = torch.Generator().manual_seed(20)
    spread = torch.randn(400, 32, generator=g)                               # isotropic: rank near 32
    point = torch.randn(1, 32, generator=g) + 1e-3 * torch.randn(400, 32, generator=g)   # collapsed: one point
    for x in (spread, point):
        h = health(health_sums(x), torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
        assert h["rankme"] == pytest.approx(_literal_rankme(x), rel=1e-6)
        assert h["feature_std"] == pytest.approx(float(F.normalize(x, dim=1).std(0).mean()), rel=1e-6)
        halves = [health_sums(x[:150]), health_sums(x[150:])]                # two ranks' shards, summed
        summed = {k: halves[0][k] + halves[1][k] for k in halves[0]}
        assert health(summed, torch.tensor(0.0), torch.tensor(1.0))["rankme"] == pytest.approx(h["rankme"], rel=1e-6)
    assert _literal_rankme(spread) > 28 and _literal_rankme(point) < 1.5    # collapse: one direction
    assert health(health_sums(point), torch.tensor(0.0), torch.tensor(1.0))["feature_std"] < 0.01 < \
        health(health_sums(spread), torch.tensor(0.0), torch.tensor(1.0))["feature_std"]    # ~1/sqrt(32)


def test_alignment_is_the_mean_squared_distance_of_the_normalised_views() -> None:
    mean_colour = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())      # (B, 3, H, W) -> (B, 3)
    batches = _batches(3, 4, seed=13)
    batches = [Batch(**{**vars(b), "global_views": torch.cat([b.global_views, b.global_views.flip(-1) + 0.5])})
               for b in batches]                                            # view 2: mirrored and brighter
    total, n = alignment_sums(mean_colour, batches, "cpu")
    pairs = [(mean_colour(b.global_views[0][i:i + 1])[0], mean_colour(b.global_views[1][i:i + 1])[0])
             for b in batches for i in range(4)]
    literal = sum(float(((u / u.norm() - v / v.norm()) ** 2).sum()) for u, v in pairs) / len(pairs)
    assert int(n) == 12 and float(total / n) == pytest.approx(literal, rel=1e-6)
    same = [Batch(**{**vars(b), "global_views": b.global_views[:1].expand(2, -1, -1, -1, -1)}) for b in batches]
    assert float(alignment_sums(mean_colour, same, "cpu")[0]) == 0.0


def test_alignment_reads_at_most_its_cap_of_val_images_and_nothing_else_changes(tiny_args, tmp_path,
                                                                                monkeypatch) -> None:
    from train.resolve import load_config

    cfg = load_config(tiny_args("byol", tmp_path))
    backbone = build_backbone(cfg.model.backbone, cfg.views.global_px)[0].eval()
    whole = evaluate.evaluate_backbone(cfg, backbone, "torch", torch.device("cpu"))
    assert whole["eval_alignment_samples"] == whole["eval_val_samples"] == 16      # under the cap: every one
    monkeypatch.setattr(evaluate, "ALIGNMENT_CAP", 5)
    capped = evaluate.evaluate_backbone(cfg, backbone, "torch", torch.device("cpu"))
    assert capped.pop("eval_alignment_samples") == 5 and whole.pop("eval_alignment_samples") == 16
    assert capped.pop("alignment") != whole.pop("alignment") and capped == whole


@pytest.mark.parametrize("backend", ["torch", "torchvision", pytest.param("ffcv", marks=pytest.mark.slow), "dali"])
def test_an_evaluation_frees_its_loaders_and_the_next_one_scores_the_same(backend, tiny_args, tmp_path,
                                                                          monkeypatch) -> None:
    """Each evaluation builds its loaders, reads each split once and closes them: no worker process, DALI
    pipeline or shared memory of theirs outlives it, and a run's later evaluation reads the same records
    with the same draws (the alignment views) as the first."""
    pytest.importorskip({"torch": "torch", "torchvision": "torchvision", "ffcv": "ffcv", "dali": "nvidia.dali"}[backend])
    import os

    from pipelines.processes import descendants
    from train.resolve import load_config

    cfg = load_config(tiny_args("byol", tmp_path, f"data.backend={backend}", "data.num_workers=2"))
    backbone = build_backbone(cfg.model.backbone, cfg.views.global_px)[0].eval()
    built, closed = [], []
    real_build = evaluate.build_loader

    def build(*a):
        loader = real_build(*a)
        built.append((a[1].split, loader))
        real_close = loader.close
        loader.close = lambda: closed.append(loader) or real_close()
        return loader

    monkeypatch.setattr(evaluate, "build_loader", build)
    before = descendants(os.getpid())
    first = evaluate.evaluate_backbone(cfg, backbone, backend, torch.device("cpu"))
    assert sorted(split for split, _ in built) == ["train", "val", "val"]      # plain train and val, byol val
    assert [loader for _, loader in built] == closed                         # each closed after its split
    assert descendants(os.getpid()) <= before                                # none of their workers is left
    again = evaluate.evaluate_backbone(cfg, backbone, backend, torch.device("cpu"))
    assert len(built) == 6 and again == first
    assert first["eval_val_samples"] == 16 and first["eval_train_samples"] == 16