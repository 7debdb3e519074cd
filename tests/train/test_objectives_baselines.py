"""Baselines (BYOL, MoCo v3, SimCLR) and SDMP's reduction to MoCo v3 on a tiny model."""

from __future__ import annotations

import math

import torch

from models.ema import make_target
from models.multicrop import build_model
from pipelines.batch import Batch
from train.objectives.base import StepValues
from train.objectives.byol import BYOL
from train.objectives.mocov3 import MoCoV3
from train.objectives.sdmp import SDMP
from train.objectives.simclr import SimCLR
from train.objectives.terms import byol_loss, nt_xent

PX = 16
S = StepValues(step=0, total_steps=10, epoch=0.0, lr=0.1, weight_decay=0.0, ema=0.99)


def tiny():
    torch.manual_seed(0)
    online = build_model("test_resnet", PX, proj_hidden=32, proj_out=16, pred_hidden=32)
    return online, make_target(online)


def two_views(b=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    views = torch.randn(2, b, 3, PX, PX, generator=g)
    return Batch(global_views=views, local_views=None, weak_views=None, mixed=None, mix_lam=None,
                 mix_partner=None, index=torch.arange(b))


def _cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def test_byol_module_is_the_symmetrised_regression_loss():
    online, target = tiny()
    batch = two_views()
    out = BYOL(BYOL.Config())(online, target, batch, S)
    (emb,) = online([batch.global_views])
    with torch.no_grad():
        (tgt,) = target([batch.global_views])
    torch.testing.assert_close(out.loss, byol_loss(emb.p[0], emb.p[1], tgt.z[0], tgt.z[1]))


def test_mocov3_module_matches_literal_ctr_sum():
    online, target = tiny()
    batch = two_views()
    tau = 0.2
    out = MoCoV3(MoCoV3.Config(tau=tau))(online, target, batch, S)
    (emb,) = online([batch.global_views])
    with torch.no_grad():
        (tgt,) = target([batch.global_views])
    q = emb.p.detach().double()
    k = tgt.z.double()

    def ctr(qv, kv):                                  # 2 tau * mean_i -log softmax_i(q_i . k / tau)
        total = 0.0
        for i in range(q.shape[1]):
            den = sum(math.exp(_cos(q[qv, i], k[kv, j]) / tau) for j in range(q.shape[1]))
            total -= math.log(math.exp(_cos(q[qv, i], k[kv, i]) / tau) / den)
        return 2 * tau * total / q.shape[1]

    assert math.isclose(out.loss.item(), ctr(0, 1) + ctr(1, 0), rel_tol=1e-5)


def test_mocov3_is_symmetric_in_the_views():
    online, target = tiny()
    batch = two_views()
    swapped = Batch(global_views=batch.global_views.flip(0), local_views=None, weak_views=None,
                    mixed=None, mix_lam=None, mix_partner=None, index=batch.index)
    m = MoCoV3(MoCoV3.Config())
    torch.testing.assert_close(m(online, target, swapped, S).loss, m(online, target, batch, S).loss)


def test_simclr_module_is_nt_xent_of_projections():
    online, _ = tiny()
    batch = two_views()
    out = SimCLR(SimCLR.Config(tau=0.5))(online, None, batch, S)
    (emb,) = online([batch.global_views])
    torch.testing.assert_close(out.loss, nt_xent(emb.z[0], emb.z[1], 0.5))


def test_sdmp_without_mixing_is_mocov3_without_its_2tau_factor():
    """lam = 1 and mixes equal to the clean views: the replace version's plain direction is MoCo v3's
    ctr(q_v, k_o) / 2 tau, and its source and mixing terms are both ctr(q_o, k_v) / 2 tau, each at
    `mix_weight` (the code's 1/2 by default, so that SDMP without mixing is MoCo v3 without 2 tau)."""
    from train.objectives.sdmp import clean_view
    from train.objectives.terms import gather_nograd_local_first, moco_ctr

    online, target = tiny()
    batch = two_views()
    lam = torch.ones(2, 6)
    mixed = Batch(global_views=batch.global_views, local_views=None, weak_views=None,
                  mixed=batch.global_views.clone(), mix_lam=lam,
                  mix_partner=torch.arange(5, -1, -1).expand(2, 6), index=batch.index)
    tau = 0.2
    for step, w in ((0, 0.5), (1, 0.5), (2, 1.0), (3, 1.0)):
        s = StepValues(step=step, total_steps=10, epoch=0.0, lr=0.1, weight_decay=0.0, ema=0.99)
        cfg = SDMP.Config(tau=tau) if w == 0.5 else SDMP.Config(tau=tau, mix_weight=w)
        sdmp = SDMP(cfg)(online, target, mixed, s).loss
        v, o = clean_view(step), 1 - clean_view(step)
        (emb,) = online([batch.global_views[[v, o]]])                   # one BN batch, as SDMP's forward
        with torch.no_grad():
            (tgt,) = target([batch.global_views[:2]])
        k = [gather_nograd_local_first(tgt.z[i]) for i in range(2)]
        want = (moco_ctr(emb.p[0], k[o], tau) + 2 * w * moco_ctr(emb.p[1], k[v], tau)) / (2 * tau)
        torch.testing.assert_close(sdmp, want, rtol=1e-5, atol=1e-6)
