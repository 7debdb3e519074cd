"""SDMP loss (Eqs. 3-4, Algorithm 1) against a literal float64 transcription."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.objectives.sdmp import sdmp_clam, sdmp_loss
from train.objectives.terms import moco_ctr

from literal_check import rn, values_and_grads


def _cos(a, b):
    return sum(a[d] * b[d] for d in range(a.shape[0])) / (a.norm() * b.norm())


def literal_sdmp(q_mix, k_src, k_mix, lam, tau):
    """Eq. (3) + Eq. (4), one sample at a time; partner of i is n-1-i; keys are the target's."""
    n, m = q_mix.shape[0], k_src.shape[0]
    k_src, k_mix = k_src.detach(), k_mix.detach()
    total = 0.0
    for i in range(n):
        j = n - 1 - i
        den_s = sum(torch.exp(_cos(q_mix[i], k_src[c]) / tau) for c in range(m))
        l_s = (-lam[i] * torch.log(torch.exp(_cos(q_mix[i], k_src[i]) / tau) / den_s)
               - (1 - lam[i]) * torch.log(torch.exp(_cos(q_mix[i], k_src[j]) / tau) / den_s))
        clam = min(lam[i], 1 - lam[j]) + min(1 - lam[i], lam[j])
        den_m = sum(torch.exp(_cos(q_mix[i], k_mix[c]) / tau) for c in range(m))
        l_m = (-1 / (1 + clam) * torch.log(torch.exp(_cos(q_mix[i], k_mix[i]) / tau) / den_m)
               - clam / (1 + clam) * torch.log(torch.exp(_cos(q_mix[i], k_mix[j]) / tau) / den_m))
        total = total + l_s + l_m
    return total / n


def test_sdmp_loss_matches_literal_eqs_3_4_values_and_grads():
    torch.manual_seed(0)
    b, extra, d = 6, 4, 5                       # extra keys: other ranks' samples (denominators only)
    q, ks, km = rn(b, d), rn(b + extra, d), rn(b + extra, d)
    lam = torch.rand(b, dtype=torch.float64)
    lam_list = lam.tolist()
    v1, g1 = values_and_grads(lambda q, ks, km: sdmp_loss(q, ks, km, lam, 0.3), [q, ks, km])
    v2, g2 = values_and_grads(lambda q, ks, km: literal_sdmp(q, ks, km, lam_list, 0.3), [q, ks, km])
    torch.testing.assert_close(v1, v2, rtol=1e-9, atol=1e-10)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-8, atol=1e-10)
    assert g1[1].abs().sum() == 0 and g1[2].abs().sum() == 0      # keys: target, no gradient


def test_sdmp_with_lam_one_is_two_infonce_terms():
    q, k = rn(8, 4), rn(8, 4)
    lam = torch.ones(8, dtype=torch.float64)
    expected = 2 * moco_ctr(q, k, 0.2) / (2 * 0.2)
    torch.testing.assert_close(sdmp_loss(q, k, k, lam, 0.2), expected)


def _pair_preserving_permutation(b: int, gen: torch.Generator) -> torch.Tensor:
    """pi with pi(b-1-i) = b-1-pi(i): moves (sample, partner) pairs together."""
    half = b // 2
    sigma = torch.randperm(half, generator=gen)
    flip = torch.randint(0, 2, (half,), generator=gen)
    pi = torch.empty(b, dtype=torch.int64)
    for i in range(half):
        pi[i] = sigma[i] if flip[i] == 0 else b - 1 - sigma[i]
        pi[b - 1 - i] = b - 1 - pi[i]
    return pi


def test_sdmp_invariant_to_permuting_samples_with_their_partners():
    gen = torch.Generator().manual_seed(3)
    b = 10
    q, ks, km = rn(b, 6), rn(b, 6), rn(b, 6)
    lam = torch.rand(b, dtype=torch.float64)
    pi = _pair_preserving_permutation(b, gen)
    assert torch.equal(torch.sort(pi).values, torch.arange(b))

    def moved(x):
        out = torch.empty_like(x)
        out[pi] = x                                           # sample i lands at position pi(i)
        return out

    torch.testing.assert_close(sdmp_loss(moved(q), moved(ks), moved(km), moved(lam), 0.2),
                               sdmp_loss(q, ks, km, lam, 0.2))


@settings(max_examples=50, deadline=None)
@given(lams=st.integers(1, 8).flatmap(
    lambda h: st.lists(st.floats(0.0, 1.0), min_size=2 * h, max_size=2 * h)))
def test_clam_in_unit_interval_and_shared_by_partners(lams):
    lam = torch.tensor(lams, dtype=torch.float64)
    c = sdmp_clam(lam)
    assert torch.all((c >= 0) & (c <= 1 + 1e-12))
    torch.testing.assert_close(c, c.flip(0))                 # lam^c_i = lam^c_{n-1-i}
    for i in range(len(lams)):
        j = len(lams) - 1 - i
        assert abs(c[i].item() - (min(lams[i], 1 - lams[j]) + min(1 - lams[i], lams[j]))) < 1e-12


def test_sdmp_loss_decreases_over_20_sgd_steps():
    torch.manual_seed(1)
    q = rn(8, 6).requires_grad_(True)
    ks, km = rn(8, 6), rn(8, 6)
    lam = torch.rand(8, dtype=torch.float64)
    opt = torch.optim.SGD([q], lr=1.0)
    losses = []
    for _ in range(20):
        loss = sdmp_loss(q, ks, km, lam, 0.2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


# ---- the wiring of the module: what the online network sees, and the plain term -----------------


def _wiring(version: str):
    from models.ema import make_target
    from models.multicrop import build_model
    from pipelines.batch import Batch
    from train.objectives.base import StepValues
    from train.objectives.sdmp import SDMP, SDMPConfig

    torch.manual_seed(0)
    online = build_model("resnet18", 16, proj_hidden=32, proj_out=16, pred_hidden=32).eval()   # eval: BN per view
    target = make_target(online).eval()
    g = torch.Generator().manual_seed(0)
    batch = Batch(global_views=torch.randn(2, 4, 3, 16, 16, generator=g), local_views=None, weak_views=None,
                  mixed=torch.randn(2, 4, 3, 16, 16, generator=g), mix_lam=torch.rand(2, 4, generator=g),
                  mix_partner=torch.arange(3, -1, -1).expand(2, 4), index=torch.arange(4))
    seen = []
    real_forward = online.forward

    def spy(groups):
        seen.append([x for grp in groups for x in grp])           # every (B, 3, H, W) view the online net embeds
        return real_forward(groups)

    online.forward = spy
    objective = SDMP(SDMPConfig(version=version))

    def step(k: int):
        s = StepValues(step=k, total_steps=10, epoch=0.0, lr=0.1, weight_decay=0.0, ema=0.99)
        return objective(online, target, batch, s)
    return batch, online, target, seen, step, real_forward


def _which(x: torch.Tensor, batch) -> str:
    for name in ("global_views", "mixed"):
        for v in range(2):
            if torch.equal(x, getattr(batch, name)[v]):
                return f"{name}[{v}]"
    return "?"


def test_replace_version_online_sees_one_clean_and_one_mixed_view_every_step() -> None:
    """Sec. 4.1.1: one of the symmetric views is replaced by the mix, at random: the online network
    embeds a clean view and the mix of the other view in every step, and both views get replaced."""
    batch, _, _, seen, step, _ = _wiring("replace")
    clean = set()
    for k in range(12):
        step(k)
        views = sorted(_which(x, batch) for x in seen[-1])
        assert len(views) == 2 and views[0].startswith("global_views") and views[1].startswith("mixed"), views
        assert views[0][-2] != views[1][-2], views                # the mix replaces the *other* view
        clean.add(views[0])
    assert clean == {"global_views[0]", "global_views[1]"}


def test_replace_version_plain_term_is_moco_v3_on_the_clean_view() -> None:
    """The clean direction equals MoCo v3's ctr on the same views, divided by 2 tau (Eq. 5's first term)."""
    from train.objectives.sdmp import clean_view

    batch, online, target, _, step, forward = _wiring("replace")
    for k in range(4):
        out = step(k)
        v = clean_view(k)
        with torch.no_grad():
            (emb,) = forward([batch.global_views[v:v + 1]])
            (tgt,) = target([batch.global_views[1 - v:2 - v]])
        want = moco_ctr(emb.p[0], tgt.z[0], 0.2) / (2 * 0.2)
        torch.testing.assert_close(out.logs["loss/sdmp_plain"], want, rtol=1e-5, atol=1e-6)
        # SDMP's code: the source term plus half of each mixed term
        torch.testing.assert_close(out.loss, want + 0.5 * out.logs["loss/sdmp_mixed"], rtol=1e-5, atol=1e-6)


def test_extra_view_version_keeps_both_clean_directions() -> None:
    batch, _, _, seen, step, _ = _wiring("extra")
    step(0)
    assert sorted(_which(x, batch) for x in seen[-1]) == ["global_views[0]", "global_views[1]", "mixed[0]"]
