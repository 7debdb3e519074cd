"""RELICv2 (Eqs. 1-3, Listing 1) against literal float64 transcriptions; negative sampling."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from train.objectives.relicv2 import relic_loss, relicv2_multicrop_loss, sample_negatives

from literal_check import assert_same_values_and_grads, rn


def _phi(a, b, tau):
    return sum(a[d] * b[d] for d in range(a.shape[0])) / (a.norm() * b.norm()) / tau


def literal_relic(online, target, neg, tau, alpha, beta):
    """Eq. (3) per anchor with P = {its target crop}, N = the sampled negatives; Eq. (1), Eq. (2)."""
    target = target.detach()                                   # EMA target network
    b = len(neg)
    total = 0.0
    for i in range(b):
        cand = [i] + list(neg[i])
        den_row = sum(torch.exp(_phi(online[i], target[c], tau)) for c in cand)
        den_col = sum(torch.exp(_phi(online[c], target[i], tau)) for c in cand)
        p_row = {c: torch.exp(_phi(online[i], target[c], tau)) / den_row for c in cand}  # p(x_i; .)
        p_col = {c: torch.exp(_phi(online[c], target[i], tau)) / den_col for c in cand}  # p(. ; x_i)
        log_lik = torch.log(p_row[i])                                                   # Eq. (1)
        kl = (sum(p_row[c] * torch.log(p_row[c]) for c in cand).detach()                # Eq. (2)
              - sum(p_row[c] * torch.log(p_col[c]) for c in cand))
        total = total + (-alpha * log_lik + beta * kl)
    return total / b


def test_relic_loss_matches_literal_eqs_1_to_3():
    torch.manual_seed(0)
    m, b, d, n_e = 9, 6, 5, 3                  # M > B: candidates from other ranks too
    online, target = rn(m, d), rn(m, d)
    neg = sample_negatives(m, n_e, torch.Generator().manual_seed(1))[:b]
    neg_list = neg.tolist()
    grads = assert_same_values_and_grads(lambda o, t: relic_loss(o, t, neg, 0.2, 0.7, 1.3),
                        lambda o, t: literal_relic(o, t, neg_list, 0.2, 0.7, 1.3),
                        [online, target])
    assert grads[0].abs().sum() > 0 and grads[1].abs().sum() == 0


def test_relic_kl_term_is_nonnegative_and_zero_when_online_equals_target():
    torch.manual_seed(2)
    x = rn(8, 4)
    neg = sample_negatives(8, 4, torch.Generator().manual_seed(0))
    kl_only = relic_loss(x, x, neg, 0.5, 0.0, 1.0)
    torch.testing.assert_close(kl_only, torch.zeros((), dtype=torch.float64), atol=1e-12, rtol=0)
    assert relic_loss(x, rn(8, 4), neg, 0.5, 0.0, 1.0) > 0


def test_multicrop_loss_matches_listing1_pairing():
    torch.manual_seed(3)
    b, d = 5, 4
    ol = [rn(b, d) for _ in range(3)]
    osm = [rn(b, d) for _ in range(2)]
    tl = [rn(b, d) for _ in range(3)]
    neg = sample_negatives(b, 2, torch.Generator().manual_seed(4))
    neg_list = neg.tolist()

    def literal(*xs):
        ol_, os_, tl_ = xs[:3], xs[3:5], xs[5:]
        loss = 0.0
        for i in range(3):                                 # all pairs of large crops
            for j in range(3):
                loss = loss + literal_relic(ol_[i], tl_[j], neg_list, 0.1, 1.0, 1.0)
        for i in range(2):                                 # small crops against large crops
            for j in range(3):
                loss = loss + literal_relic(os_[i], tl_[j], neg_list, 0.1, 1.0, 1.0)
        return loss / ((3 + 2) * 3)

    def fast(*xs):
        return relicv2_multicrop_loss(list(xs[:3]), list(xs[3:5]), list(xs[5:]), neg, 0.1, 1.0, 1.0)

    assert_same_values_and_grads(fast, literal, [*ol, *osm, *tl])


def test_negatives_are_distinct_exclude_the_anchor_and_are_reproducible():
    neg = sample_negatives(12, 10, torch.Generator().manual_seed(7))
    assert neg.shape == (12, 10)
    for i, row in enumerate(neg.tolist()):
        assert len(set(row)) == 10 and i not in row and all(0 <= c < 12 for c in row)
    assert torch.equal(neg, sample_negatives(12, 10, torch.Generator().manual_seed(7)))
    assert not torch.equal(neg, sample_negatives(12, 10, torch.Generator().manual_seed(8)))


def test_negatives_are_uniform_subsets():
    gen = torch.Generator().manual_seed(0)
    counts = Counter()
    draws = 600
    for _ in range(draws):
        counts[tuple(sorted(sample_negatives(5, 2, gen)[0].tolist()))] += 1
    subsets = list(itertools.combinations([1, 2, 3, 4], 2))
    assert set(counts) == set(subsets)
    for s in subsets:                                       # expected 100 each; 5 sigma ~ 46
        assert abs(counts[s] - draws / 6) < 46


def test_too_few_samples_for_the_negatives_is_a_clear_error():
    with pytest.raises(ValueError, match="num_negatives"):
        sample_negatives(10, 10, torch.Generator())


def test_relic_loss_decreases_over_20_sgd_steps():
    torch.manual_seed(5)
    online = rn(8, 6).requires_grad_(True)
    target = rn(8, 6)
    neg = sample_negatives(8, 4, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD([online], lr=1.0)
    losses = []
    for _ in range(20):
        loss = relic_loss(online, target, neg, 0.2, 1.0, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
