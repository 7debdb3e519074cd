"""Every registered objective on a tiny SSLModel and a hand-built Batch: finite loss, gradients
reach the online network only, the target is untouched, state changes only in `after_step`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.ema import make_target
from models.multicrop import build_model
from pipelines.batch import Batch
from train.objectives import OBJECTIVES
from train.objectives.base import LossOut, StepValues, ViewNeeds
from train.objectives.relicv2 import ReLICv2
from train.objectives.rsa import RSA, rsa_loss
from train.objectives.terms import byol_loss, regression_loss
from train.objectives.uota import UOTA, uota_weights

GLOBAL_PX, LOCAL_PX, DIM = 16, 8, 16

# Small configs so that the tests stay fast (few negatives, a short queue).
SMALL = {"relicv2": {"num_negatives": 3}, "uota": {"queue_size": 24, "dim": DIM, "warmup_epochs": 0.0}}


def tiny_model():
    torch.manual_seed(0)
    online = build_model("test_resnet", GLOBAL_PX, proj_hidden=32, proj_out=DIM, pred_hidden=32)
    return online, make_target(online)


def make_batch(needs: ViewNeeds, b: int = 6, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def views(v, px):
        return torch.randn(v, b, 3, px, px, generator=g)

    mixed = lam = partner = None
    if needs.mix != "none":
        mixed = views(2, GLOBAL_PX)
        lam = torch.rand(2, b, generator=g)
        partner = torch.arange(b - 1, -1, -1).expand(2, b).clone()
    return Batch(global_views=views(max(needs.global_views, 2), GLOBAL_PX),
                 local_views=views(needs.local, LOCAL_PX) if needs.local else None,
                 weak_views=views(2, GLOBAL_PX) if needs.weak else None,
                 mixed=mixed, mix_lam=lam, mix_partner=partner, index=torch.arange(b))


def step_values(step: int = 0, total: int = 10, epoch: float = 0.0) -> StepValues:
    return StepValues(step=step, total_steps=total, epoch=epoch, lr=0.1, weight_decay=0.0, ema=0.99)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_forward_backward_on_tiny_model(name: str) -> None:
    cls = OBJECTIVES[name]
    objective = cls(cls.Config(**SMALL.get(name, {})))
    online, target = tiny_model()
    target_before = {k: v.clone() for k, v in target.named_parameters()}
    batch = make_batch(objective.needs)
    out = objective(online, target if objective.needs.target else None, batch, step_values())
    assert isinstance(out, LossOut)
    assert out.loss.ndim == 0 and math.isfinite(out.loss.item())
    assert all(not v.requires_grad and v.ndim == 0 for v in out.logs.values())
    out.loss.backward()
    grads = {k: p.grad for k, p in online.named_parameters()}
    backbone = [g for k, g in grads.items() if k.startswith("backbone.") and g is not None]
    assert backbone and all(torch.isfinite(g).all() for g in backbone)
    assert sum(g.abs().sum() for g in backbone) > 0
    assert any(g is not None and g.abs().sum() > 0 for k, g in grads.items()
               if k.startswith("projector."))
    for k, p in target.named_parameters():
        assert p.grad is None
        assert torch.equal(p, target_before[k])


def test_byol_family_objectives_use_the_predictor():
    for name in ("byol", "rsa", "mocov3", "sdmp", "relicv2", "uota"):
        cls = OBJECTIVES[name]
        objective = cls(cls.Config(**SMALL.get(name, {})))
        online, target = tiny_model()
        out = objective(online, target, make_batch(objective.needs), step_values())
        out.loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0
                   for p in online.predictor.parameters()), name


def test_rsa_module_is_eq5_with_the_scheduled_beta_and_byol_at_the_last_step():
    online, target = tiny_model()
    batch = make_batch(RSA.needs)
    rsa = RSA(RSA.Config(beta_base=0.4))
    (agg,) = online([batch.global_views])
    with torch.no_grad():
        (weak,) = target([batch.weak_views])
    at_start = rsa(online, target, batch, step_values(step=0, total=10)).loss
    torch.testing.assert_close(at_start, rsa_loss(agg.p[0], agg.p[1], weak.z[0], weak.z[1], 0.4))
    at_end = rsa(online, target, batch, step_values(step=10, total=10)).loss
    torch.testing.assert_close(at_end, byol_loss(agg.p[0], agg.p[1], weak.z[0], weak.z[1]))


def test_relicv2_negatives_are_reproducible_per_step():
    online, target = tiny_model()
    objective = ReLICv2(ReLICv2.Config(num_negatives=3))
    batch = make_batch(objective.needs)
    a = objective(online, target, batch, step_values(step=5)).loss
    b = objective(online, target, batch, step_values(step=5)).loss
    c = objective(online, target, batch, step_values(step=6)).loss
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)


def test_uota_byol_base_before_and_after_warmup():
    online, target = tiny_model()
    objective = UOTA(UOTA.Config(base="byol", tau=5.0, warmup_epochs=2.0, dim=DIM))
    batch = make_batch(ViewNeeds(global_views=2, local=2))
    before = objective(online, target, batch, step_values(epoch=1.5))
    torch.testing.assert_close(before.loss, before.logs["loss/base"])
    after = objective(online, target, batch, step_values(epoch=2.0))
    # Recompute Eq. (M.12) by hand: per-view BYOL losses against the other global views.
    embs = online([batch.global_views, batch.local_views])
    p = torch.cat([e.p for e in embs])                                   # (4, B, D)
    with torch.no_grad():
        (tgt,) = target([batch.global_views])
    per_view = torch.stack([
        regression_loss(p[0], tgt.z[1]),
        regression_loss(p[1], tgt.z[0]),
        (regression_loss(p[2], tgt.z[0]) + regression_loss(p[2], tgt.z[1])) / 2,
        (regression_loss(p[3], tgt.z[0]) + regression_loss(p[3], tgt.z[1])) / 2,
    ])
    expected = (uota_weights(F.normalize(p, dim=-1), 5.0).w * per_view).mean()
    torch.testing.assert_close(after.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(before.logs["loss/base"], per_view.mean(), rtol=1e-5, atol=1e-6)


def test_uota_moco_queue_changes_only_in_after_step():
    online, target = tiny_model()
    objective = UOTA(UOTA.Config(base="mocov2star", queue_size=10, dim=DIM, warmup_epochs=0.0))
    assert set(objective.state_dict()) == {"queue", "queue_ptr"}
    batch = make_batch(ViewNeeds(global_views=2, local=2), b=6)
    queue0 = objective.queue.clone()
    out = objective(online, target, batch, step_values(epoch=1.0))
    assert torch.equal(objective.queue, queue0)                          # forward: no side effect
    keys = out.state["keys"]
    assert keys.shape == (6, DIM) and not keys.requires_grad
    objective.after_step(out)
    torch.testing.assert_close(objective.queue[:6], keys)
    assert torch.equal(objective.queue[6:], queue0[6:])
    assert int(objective.queue_ptr) == 6
    objective.after_step(out)                                            # wraps around
    torch.testing.assert_close(objective.queue[6:10], keys[:4])
    torch.testing.assert_close(objective.queue[:2], keys[4:])
    assert int(objective.queue_ptr) == 2


def test_uota_queue_width_mismatch_is_a_clear_error():
    online, target = tiny_model()
    objective = UOTA(UOTA.Config(base="mocov2star", queue_size=8, dim=DIM + 1))
    with pytest.raises(ValueError, match="objective.dim"):
        objective(online, target, make_batch(ViewNeeds(global_views=2)), step_values())


def test_missing_views_are_clear_errors():
    online, target = tiny_model()
    plain = make_batch(ViewNeeds(global_views=2))
    with pytest.raises(ValueError, match="weak_views"):
        RSA(RSA.Config())(online, target, plain, step_values())
    for name in ("sdmp", "dacl"):
        cls = OBJECTIVES[name]
        with pytest.raises(ValueError, match="mix"):
            cls(cls.Config())(online, target, plain, step_values())


def test_bad_config_values_are_rejected():
    with pytest.raises(ValueError, match="tau"):
        OBJECTIVES["sdmp"].Config(tau=0.0)
    with pytest.raises(ValueError, match="base"):
        OBJECTIVES["uota"].Config(base="swav")
    with pytest.raises(ValueError, match="beta_base"):
        OBJECTIVES["rsa"].Config(beta_base=1.5)


def test_uota_mocov2star_is_moco_v2_without_predictor_and_with_a_fixed_key_momentum():
    """Supplement Sec. S.5: MoCo-v2* queries are projector outputs (MoCo v2 has no predictor), its key
    encoder moves with MoCo v2's fixed momentum, and it reads SwAV's 2 + 6 multi-crop views; the BYOL
    base keeps the predictor and BYOL's scheduled momentum."""
    online, target = tiny_model()
    moco = UOTA(UOTA.Config(base="mocov2star", queue_size=24, dim=DIM, warmup_epochs=0.0))
    assert moco.needs.local == 6 and UOTA(UOTA.Config()).needs.local == 0
    out = moco(online, target, make_batch(moco.needs), step_values(epoch=1.0))
    out.loss.backward()
    assert all(p.grad is None for p in online.predictor.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in online.projector.parameters())
    s = step_values()
    assert moco.target_momentum(s) == 0.999 and UOTA(UOTA.Config()).target_momentum(s) == s.ema


def test_uota_preset_is_byol_with_its_own_two_views():
    from train.resolve import load_config

    cfg = load_config(["method=uota", "data=synthetic"])
    assert cfg.objective.base == "byol" and cfg.views.recipe == "byol" and cfg.model.pred_hidden > 0
