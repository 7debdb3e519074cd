"""RSA (Eqs. 2, 5, 6) against literal float64 transcriptions."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.objectives.rsa import rsa_beta, rsa_loss
from train.objectives.terms import byol_loss

from literal_check import rn, values_and_grads


def _mse(z, z2):
    """Eq. (2): 2 - 2 <z, z'> / (||z|| ||z'||)."""
    return 2 - 2 * sum(z[d] * z2[d] for d in range(z.shape[0])) / (z.norm() * z2.norm())


def literal_rsa(za, za2, zw, zw2, beta):
    """Eq. (5) per sample; second arguments are target outputs or detached online outputs."""
    total = 0.0
    for i in range(za.shape[0]):
        total = total + ((1 - beta) * _mse(za[i], zw2[i].detach())
                         + beta * _mse(za[i], za2[i].detach())
                         + (1 - beta) * _mse(za2[i], zw[i].detach())
                         + beta * _mse(za2[i], za[i].detach()))
    return total / za.shape[0]


def test_rsa_loss_matches_literal_eq5_values_and_grads():
    torch.manual_seed(0)
    xs = [rn(5, 4) for _ in range(4)]
    v1, g1 = values_and_grads(lambda a, b, c, d: rsa_loss(a, b, c, d, 0.3), xs)
    v2, g2 = values_and_grads(lambda a, b, c, d: literal_rsa(a, b, c, d, 0.3), xs)
    torch.testing.assert_close(v1, v2, rtol=1e-9, atol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    assert g1[2].abs().sum() == 0 and g1[3].abs().sum() == 0          # weak targets: no gradient


def test_rsa_with_beta_zero_is_byol_on_aggressive_online_weak_target():
    p1, p2, z1, z2 = (rn(6, 5) for _ in range(4))
    torch.testing.assert_close(rsa_loss(p1, p2, z1, z2, 0.0), byol_loss(p1, p2, z1, z2))


def test_rsa_is_symmetric_in_the_two_views():
    p1, p2, z1, z2 = (rn(6, 5) for _ in range(4))
    torch.testing.assert_close(rsa_loss(p2, p1, z2, z1, 0.4), rsa_loss(p1, p2, z1, z2, 0.4))


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 10_000), base=st.floats(0.0, 1.0), a=st.floats(0, 1), b=st.floats(0, 1))
def test_rsa_beta_hits_endpoints_and_is_monotone(total, base, a, b):
    assert rsa_beta(0, total, base) == base
    assert abs(rsa_beta(total, total, base)) < 1e-12
    k1, k2 = sorted((int(a * total), int(b * total)))
    assert rsa_beta(k1, total, base) >= rsa_beta(k2, total, base) - 1e-15
    mid = rsa_beta(k1, total, base)
    assert math.isclose(mid, base * 0.5 * (math.cos(math.pi * k1 / total) + 1), abs_tol=1e-12)


def test_rsa_loss_decreases_over_20_sgd_steps():
    torch.manual_seed(2)
    p1, p2 = rn(8, 6).requires_grad_(True), rn(8, 6).requires_grad_(True)
    z1, z2 = rn(8, 6), rn(8, 6)
    opt = torch.optim.SGD([p1, p2], lr=0.5)
    losses = []
    for step in range(20):
        loss = rsa_loss(p1, p2, z1, z2, rsa_beta(step, 20, 0.4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
