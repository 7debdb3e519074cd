"""The optimiser step as the loop runs it: weight decay and LARS adaptation skip biases and norm
layers, and the EMA target follows the optimiser step."""

from __future__ import annotations

import pytest
import torch

from train import schedules
from train.optim import apply_lr_wd, build_optimizer
from train.resolve import load_config


def test_lars_skips_weight_decay_and_adaptation_for_biases_and_norm_layers(tiny_args, tmp_path) -> None:
    from models.multicrop import build_model

    cfg = load_config(tiny_args("byol", tmp_path, "optim.name=lars", "optim.weight_decay=0.1",
                                "optim.final_weight_decay=0.1"))
    torch.manual_seed(0)
    model = build_model("test_resnet", 16, 32, 16, 32)
    opt = build_optimizer(cfg, [model])
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        g = group_of[id(p)]
        if p.ndim <= 1:                                            # biases, BatchNorm weights
            assert g["weight_decay"] == 0 and g["wd_scale"] == 0, name
        else:
            assert g["weight_decay"] > 0 and g["wd_scale"] == 1, name
    # One step: a bias moves by -lr * grad (no trust ratio, no decay); a conv weight does not.
    s = schedules.at(cfg.optim, 1, 4, cfg.data.batch_size)
    apply_lr_wd(opt, s)
    bias, weight = model.projector[3].bias, model.backbone.conv1.weight
    before = {n: t.detach().clone() for n, t in (("bias", bias), ("weight", weight))}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(bias.detach(), before["bias"] - s.lr)
    assert not torch.allclose(weight.detach(), before["weight"] - s.lr)


# The target's momentum at the run's last step (tiny_args: 3 steps on the synthetic preset, whose EMA
# schedule runs from 0.96 to 1): BYOL's cosine schedule (`s.ema`, 0.99 there), and RELICv2's one gamma for
# the whole run (its App. D; the preset's 0.96).
@pytest.mark.parametrize("method, momentum", [("byol", lambda s: s.ema), ("relicv2", lambda s: 0.96)],
                         ids=["byol", "relicv2"])
def test_ema_target_update_follows_the_optimiser_step(tiny_args, tmp_path, method, momentum) -> None:
    """target <- m * target + (1 - m) * online, with the online weights *after* this step's update
    (RELICv2 App. D: xi_t = gamma xi_{t-1} + (1 - gamma) theta_t)."""
    from train.loop import train_step
    from train.setup import build_parts

    cfg = load_config(tiny_args(method, tmp_path, "objective.num_negatives=3") if method == "relicv2"
                      else tiny_args(method, tmp_path))
    parts = build_parts(cfg, torch.device("cpu"), "torch")
    batch = next(iter(parts.loader))
    s = schedules.at(cfg.optim, cfg.optim.steps - 1, len(parts.loader), cfg.data.batch_size)
    assert s.ema > 0.985                            # the schedule near its end: 0.03 above RELICv2's gamma
    m = momentum(s)
    torch.manual_seed(0)
    with torch.no_grad():                           # a target that has drifted from the online network, as
        for t in parts.target.parameters():         # after the first steps (a copy would hide the momentum)
            t.add_(torch.randn_like(t))
    target0 = {k: v.detach().clone() for k, v in parts.target.named_parameters()}
    online0 = {k: v.detach().clone() for k, v in parts.online.named_parameters()}
    train_step(parts, batch, s)
    online1 = dict(parts.online.named_parameters())
    moved = 0
    for k, t in parts.target.named_parameters():
        torch.testing.assert_close(t.detach(), m * target0[k] + (1 - m) * online1[k].detach())
        moved += not torch.equal(online1[k].detach(), online0[k])
    assert moved > 0
