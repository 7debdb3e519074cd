"""DACL (Algorithm 1): NT-Xent over Mixup-noise positives, alone and with SimCLR."""

from __future__ import annotations

import torch

from models.multicrop import build_model
from pipelines.batch import Batch
from train.objectives.base import StepValues
from train.objectives.dacl import DACL
from train.objectives.simclr import SimCLR

PX = 16
S = StepValues(step=0, total_steps=10, epoch=0.0, lr=0.1, weight_decay=0.0, ema=0.99)


def tiny_online():
    torch.manual_seed(0)
    return build_model("test_resnet", PX, proj_hidden=32, proj_out=16, pred_hidden=0)


def linear_mixup(sources, partner, lam):
    """Eq. (3): positive v of sample i is lam x_i + (1 - lam) x_partner, from sources[v]."""
    out = []
    for v in range(lam.shape[0]):
        w = lam[v].view(-1, 1, 1, 1)
        out.append(w * sources[v] + (1 - w) * sources[v][partner[v]])
    return torch.stack(out)                                             # (2, B, 3, H, W)


def algorithm_1_loss(z1, z2, tau):
    """Algorithm 1, lines 17-21, literally: z_{2k-1} = z1_k and z_{2k} = z2_k; s_ij the cosine
    similarity; l(i, j) = -log exp(s_ij / tau) / sum_{k != i} exp(s_ik / tau);
    L = 1/(2N) sum_k [l(2k-1, 2k) + l(2k, 2k-1)]."""
    n = z1.shape[0]
    z = [None] * (2 * n)
    for k in range(n):
        z[2 * k], z[2 * k + 1] = z1[k], z2[k]                          # 0-based 2k-1 -> 2k, 2k -> 2k+1

    def s(i, j):
        return torch.dot(z[i], z[j]) / (z[i].norm() * z[j].norm())

    def ell(i, j):
        den = sum(torch.exp(s(i, k) / tau) for k in range(2 * n) if k != i)
        return -torch.log(torch.exp(s(i, j) / tau) / den)

    return sum(ell(2 * k, 2 * k + 1) + ell(2 * k + 1, 2 * k) for k in range(n)) / (2 * n)


def batch_of(x, views, partner, lam):
    """DACL alone mixes the image itself (x) for both positives; `views` are the SimCLR views."""
    return Batch(global_views=x[None] if views is None else views, local_views=None,
                 weak_views=None, mixed=linear_mixup(torch.stack([x, x]), partner, lam), mix_lam=lam,
                 mix_partner=partner, index=torch.arange(x.shape[0]))


def random_partners(b, gen):
    """A partner != i for each of the two positives of each sample."""
    offsets = torch.randint(1, b, (2, b), generator=gen)
    return (torch.arange(b) + offsets) % b                              # (2, B)


def test_dacl_with_lambda_one_equals_simclr_nt_xent():
    gen = torch.Generator().manual_seed(0)
    b = 6
    views = torch.randn(2, b, 3, PX, PX, generator=gen)
    partner = random_partners(b, gen)
    lam = torch.ones(2, b)
    mixed = linear_mixup(views, partner, lam)                           # lam = 1: the views themselves
    assert torch.equal(mixed, views)
    batch = Batch(global_views=views, local_views=None, weak_views=None, mixed=mixed,
                  mix_lam=lam, mix_partner=partner, index=torch.arange(b))
    online = tiny_online()
    dacl = DACL(DACL.Config(tau=0.5))(online, None, batch, S).loss
    simclr = SimCLR(SimCLR.Config(tau=0.5))(online, None, batch, S).loss
    torch.testing.assert_close(dacl, simclr)


def test_dacl_module_is_algorithm_1_on_the_mixed_positives():
    gen = torch.Generator().manual_seed(1)
    b = 6
    x = torch.randn(b, 3, PX, PX, generator=gen)
    batch = batch_of(x, None, random_partners(b, gen),
                     0.7 + 0.3 * torch.rand(2, b, generator=gen))
    online = tiny_online()
    out = DACL(DACL.Config(tau=0.3))(online, None, batch, S)
    (emb,) = online([batch.mixed])
    torch.testing.assert_close(out.loss, algorithm_1_loss(emb.z[0], emb.z[1], 0.3), rtol=1e-5, atol=1e-6)


def test_simclr_plus_dacl_is_the_sum_and_needs_two_views():
    gen = torch.Generator().manual_seed(2)
    b = 6
    x = torch.randn(b, 3, PX, PX, generator=gen)
    views = torch.randn(2, b, 3, PX, PX, generator=gen)
    batch = batch_of(x, views, random_partners(b, gen), 0.6 + 0.4 * torch.rand(2, b, generator=gen))
    online = tiny_online()
    both = DACL(DACL.Config(tau=0.5, with_simclr=True))
    assert both.needs.global_views == 2 and DACL.needs.global_views == 1
    out = both(online, None, batch, S)
    torch.testing.assert_close(out.loss, out.logs["loss/simclr"] + out.logs["loss/dacl"])
    # Views and mixes share one backbone call (one resolution), hence one set of BN statistics.
    emb_views, emb_mix = online([batch.global_views, batch.mixed])
    expected = algorithm_1_loss(emb_views.z[0], emb_views.z[1], 0.5) + algorithm_1_loss(emb_mix.z[0], emb_mix.z[1], 0.5)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)


def test_dacl_invariant_to_permuting_samples_with_their_partners():
    gen = torch.Generator().manual_seed(3)
    b = 8
    x = torch.randn(b, 3, PX, PX, generator=gen)
    partner = random_partners(b, gen)
    lam = 0.5 + 0.5 * torch.rand(2, b, generator=gen)
    order = torch.randperm(b, generator=gen)                            # new position i <- old order[i]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(b)
    x2 = x[order]
    partner2 = inverse[partner[:, order]]                               # the same source images
    lam2 = lam[:, order]
    online = tiny_online()
    dacl = DACL(DACL.Config(tau=0.5))
    ref = dacl(online, None, batch_of(x, None, partner, lam), S).loss
    moved = dacl(online, None, batch_of(x2, None, partner2, lam2), S).loss
    torch.testing.assert_close(moved, ref, rtol=1e-5, atol=1e-5)
