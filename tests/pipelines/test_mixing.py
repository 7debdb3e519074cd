"""Intra-batch mixes: algebraic properties (hypothesis) and the laws of lam."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from scipy import stats

from pipelines import mixing

SET = settings(max_examples=25, deadline=None)


def _batch(seed: int, b: int, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


@SET
@given(st.integers(1, 32).map(lambda k: 2 * k))
def test_partner_is_fixed_point_free_involution(b):
    p = mixing.partner_index(b)
    assert torch.equal(p[p], torch.arange(b))
    assert not (p == torch.arange(b)).any()


@SET
@given(st.integers(0, 10_000), st.integers(1, 8).map(lambda k: 2 * k))
def test_lam_one_leaves_batch_unchanged(seed, b):
    x = _batch(seed, b)
    p = mixing.partner_index(b)
    one = torch.ones(b)
    assert torch.allclose(mixing.mixup(x, one, p), x)
    assert torch.allclose(mixing.dacl_linear(x, p, one), x)
    assert torch.allclose(mixing.dacl_geometric(x, p, one), x, atol=1e-6)
    assert torch.equal(mixing.dacl_binary(x, p, torch.ones_like(x, dtype=torch.bool)), x)
    empty = torch.zeros(b, 4, dtype=torch.long)
    for f in (mixing.cutmix, mixing.resizemix):
        y, lam = f(x, empty, p)
        assert torch.equal(y, x) and torch.equal(lam, torch.ones(b))


@SET
@given(st.integers(0, 10_000), st.lists(st.integers(-6, 14), min_size=4, max_size=4))
def test_cutmix_and_resizemix_lam_is_real_pixel_fraction(seed, box):
    b, h, w = 4, 8, 10
    x = _batch(seed, b, h, w)
    p = mixing.partner_index(b)
    x[p] += 5.0  # partners distinguishable: values > 1 mark pasted pixels
    y0, x0, y1, x1 = box
    boxes = torch.tensor([[y0, x0, y1, x1]] * b)
    for f in (mixing.cutmix, mixing.resizemix):
        y, lam = f(x.clone(), boxes, p)
        own = (y == x).all(1).flatten(1).float().mean(1)
        assert torch.allclose(lam, own), (f.__name__, lam, own)
        cy = max(0, min(y1, h) - max(y0, 0)); cx = max(0, min(x1, w) - max(x0, 0))
        assert torch.allclose(lam, torch.full((b,), 1 - cy * cx / (h * w)))


@SET
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_permutation_commutes_with_mixing(seed, l):
    b = 6
    g = torch.Generator().manual_seed(seed)
    x = _batch(seed, b)
    partner = (torch.arange(b) + torch.randint(1, b, (b,), generator=g)) % b
    lam = torch.full((b,), l)
    perm = torch.randperm(b, generator=g)
    inv = torch.argsort(perm)
    pp = inv[partner[perm]]  # partners expressed in the permuted batch
    boxes = torch.tensor([[1, 2, 6, 7]] * b)
    mask = torch.rand(x.shape, generator=g) < 0.5
    assert torch.allclose(mixing.mixup(x, lam, partner)[perm], mixing.mixup(x[perm], lam, pp))
    assert torch.allclose(mixing.dacl_geometric(x, partner, lam)[perm], mixing.dacl_geometric(x[perm], pp, lam))
    assert torch.equal(mixing.dacl_binary(x, partner, mask)[perm], mixing.dacl_binary(x[perm], pp, mask[perm]))
    for f in (mixing.cutmix, mixing.resizemix):
        a, la = f(x, boxes, partner)
        c, lc = f(x[perm], boxes[perm], pp)
        assert torch.allclose(a[perm], c) and torch.allclose(la[perm], lc)


@SET
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_geometric_mixing_with_itself_is_identity(seed, l):
    x = _batch(seed, 4)
    same = torch.arange(4)
    assert torch.allclose(mixing.dacl_geometric(x, same, torch.full((4,), l)), x, atol=1e-5)


def test_sdmp_lam_is_beta_and_boxes_match_area():
    g = torch.Generator().manual_seed(0)
    for alpha in (0.5, 1.0, 2.0):
        p = mixing.sample_sdmp(4000, 32, 32, alpha, mixing.SDMP_MIXERS, g)
        assert stats.kstest(p.lam.numpy(), stats.beta(alpha, alpha).cdf).pvalue > 1e-3
    area = ((p.boxes[:, 2] - p.boxes[:, 0]) * (p.boxes[:, 3] - p.boxes[:, 1])).float() / 1024
    inside = p.lam < 0.5  # clipping only shrinks the box
    assert (area <= 1 - p.lam + 0.07).all() and area[inside].mean() > 0.3
    mixers = {mixing.sample_sdmp(2, 8, 8, 1.0, mixing.SDMP_MIXERS, g).mixer for _ in range(60)}
    assert mixers == set(mixing.SDMP_MIXERS)


def test_dacl_partner_never_self_lam_uniform_and_binary_rate():
    g = torch.Generator().manual_seed(1)
    p = mixing.sample_dacl(4000, 0.6, 3, g)
    assert not (p.partner == torch.arange(4000)).any()
    assert stats.kstest(p.lam.numpy(), stats.uniform(0.6, 0.4).cdf).pvalue > 1e-3
    assert set(p.noise.tolist()) == {0, 1, 2}
    x = torch.zeros(8, 3, 16, 16)
    x[::2] = 1.0  # partners of the even samples are odd with prob ~1/2; use a fixed partner instead
    q = mixing.DACLParams(torch.arange(8).roll(1), torch.full((8,), 0.7), torch.full((8,), 2))
    y = mixing.apply_dacl(x, q, mixing.DACL_NOISES, g)
    kept = (y[::2] == 1.0).float().mean().item()  # even samples keep their own 1s with rate rho = lam
    assert abs(kept - 0.7) < 0.03
