"""kNN and linear-probe evaluation against literal implementations and known answers."""

from __future__ import annotations

import math

import torch

from train.evaluate import knn_top1, linear_probe_top1


def _clusters(n: int, d: int, classes: int, spread: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=g) * 4
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + spread * torch.randn(n, d, generator=g), y


def test_knn_matches_a_literal_weighted_vote() -> None:
    xt, yt = _clusters(60, 8, 3, spread=4.0, seed=1)
    xv, yv = _clusters(25, 8, 3, spread=4.0, seed=2)
    k, T = 5, 0.07
    correct = 0
    for i in range(xv.shape[0]):
        sims = [float(torch.dot(xv[i], xt[j]) / (xv[i].norm() * xt[j].norm())) for j in range(xt.shape[0])]
        nearest = sorted(range(len(sims)), key=lambda j: -sims[j])[:k]
        votes = [0.0] * 3
        for j in nearest:
            votes[int(yt[j])] += math.exp(sims[j] / T)
        correct += int(max(range(3), key=lambda c: votes[c]) == int(yv[i]))
    assert knn_top1(xt, yt, xv, yv, num_classes=3, k=k, temperature=T) == correct / xv.shape[0]


def test_knn_separates_clusters_and_is_at_chance_on_random_labels() -> None:
    xt, yt = _clusters(500, 16, 5, spread=0.5, seed=3)
    assert knn_top1(xt, yt, xt[:200], yt[:200], 5) == 1.0
    g = torch.Generator().manual_seed(4)
    noise_t, noise_v = torch.randn(2000, 16, generator=g), torch.randn(1000, 16, generator=g)
    acc = knn_top1(noise_t, torch.randint(0, 5, (2000,), generator=g), noise_v,
                   torch.randint(0, 5, (1000,), generator=g), 5)
    assert abs(acc - 0.2) < 0.06


def test_linear_probe_solves_separable_data_deterministically_and_not_noise() -> None:
    xt, yt = _clusters(400, 10, 4, spread=1.0, seed=5)
    xv, yv = _clusters(200, 10, 4, spread=1.0, seed=5)
    a = linear_probe_top1(xt, yt, xv, yv, 4)
    assert a > 0.97 and a == linear_probe_top1(xt, yt, xv, yv, 4)
    g = torch.Generator().manual_seed(6)
    acc = linear_probe_top1(torch.randn(400, 10, generator=g), torch.randint(0, 4, (400,), generator=g),
                            torch.randn(400, 10, generator=g), torch.randint(0, 4, (400,), generator=g), 4)
    assert acc < 0.4
