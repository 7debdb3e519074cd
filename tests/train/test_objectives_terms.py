"""Shared loss terms against literal float64 transcriptions of their equations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from train.objectives.terms import (byol_loss, local_first, moco_ctr, nt_xent, regression_loss,
                                    soft_info_nce)

from literal_check import assert_same_values_and_grads, rn, values_and_grads


def _cos(a, b):
    return sum(a[d] * b[d] for d in range(a.shape[0])) / (a.norm() * b.norm())


def literal_nt_xent(z1, z2, tau):
    """DACL Algorithm 1 lines 17-21, with z_{2k-1} = z1[k], z_{2k} = z2[k] (0-based here)."""
    n = z1.shape[0]
    z = [None] * (2 * n)
    for k in range(n):
        z[2 * k], z[2 * k + 1] = z1[k], z2[k]

    def ell(i, j):
        den = sum(torch.exp(_cos(z[i], z[k]) / tau) for k in range(2 * n) if k != i)
        return -torch.log(torch.exp(_cos(z[i], z[j]) / tau) / den)

    return sum(ell(2 * k, 2 * k + 1) + ell(2 * k + 1, 2 * k) for k in range(n)) / (2 * n)


def test_regression_loss_matches_eq2_and_stops_target_gradient():
    p, z = rn(5, 7), rn(5, 7)

    def literal(p, z):
        return sum(2 - 2 * _cos(p[i], z[i].detach()) for i in range(5))

    assert_same_values_and_grads(lambda p, z: regression_loss(p, z).sum(), literal, [p, z])
    _, (gp, gz) = values_and_grads(lambda p, z: regression_loss(p, z).sum(), [p, z])
    assert gp.abs().sum() > 0 and gz.abs().sum() == 0


def test_byol_loss_is_symmetric_in_the_views():
    p1, p2, z1, z2 = rn(4, 6, 9).unbind(0)
    torch.testing.assert_close(byol_loss(p1, p2, z1, z2), byol_loss(p2, p1, z2, z1))


def test_nt_xent_matches_dacl_algorithm1_values_and_grads():
    z1, z2 = rn(6, 5), rn(6, 5)
    assert_same_values_and_grads(lambda a, b: nt_xent(a, b, 0.3),
                                 lambda a, b: literal_nt_xent(a, b, 0.3), [z1, z2])


def test_nt_xent_invariant_to_view_swap_and_sample_permutation():
    z1, z2 = rn(8, 4), rn(8, 4)
    perm = torch.randperm(8)
    ref = nt_xent(z1, z2, 0.5)
    torch.testing.assert_close(nt_xent(z2, z1, 0.5), ref)
    torch.testing.assert_close(nt_xent(z1[perm], z2[perm], 0.5), ref)


def test_nt_xent_is_scale_invariant_raw_inputs():
    z1, z2 = rn(6, 4), rn(6, 4)
    torch.testing.assert_close(nt_xent(3.0 * z1, 0.5 * z2, 0.2), nt_xent(z1, z2, 0.2))


def test_soft_info_nce_with_one_hot_weights_is_cross_entropy():
    q = F.normalize(rn(5, 3), dim=1)
    k = F.normalize(rn(9, 3), dim=1)
    w = F.one_hot(torch.arange(5), 9).double()
    torch.testing.assert_close(soft_info_nce(q, k, w, 0.1),
                               F.cross_entropy(q @ k.T / 0.1, torch.arange(5)))


def test_moco_ctr_matches_literal_infonce_and_stops_key_gradient():
    q, k = rn(4, 6), rn(7, 6)
    tau = 0.2

    def literal(q, k):
        k = k.detach()
        total = 0.0
        for i in range(4):
            den = sum(torch.exp(_cos(q[i], k[j]) / tau) for j in range(7))
            total = total - torch.log(torch.exp(_cos(q[i], k[i]) / tau) / den)
        return 2 * tau * total / 4

    assert_same_values_and_grads(lambda q, k: moco_ctr(q, k, tau), literal, [q, k])


def test_local_first_is_identity_in_one_process():
    x = rn(6, 2)
    assert torch.equal(local_first(x, 6), x)


def test_nt_xent_decreases_over_20_sgd_steps():
    torch.manual_seed(0)
    z1 = rn(8, 6).requires_grad_(True)
    z2 = rn(8, 6).requires_grad_(True)
    opt = torch.optim.SGD([z1, z2], lr=0.5)
    losses = []
    for _ in range(20):
        loss = nt_xent(z1, z2, 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert math.isfinite(losses[-1])
