"""The optimiser step as the loop runs it: weight decay and LARS adaptation skip biases and norm
layers, and the EMA target follows the optimiser step."""

from __future__ import annotations

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


def test_ema_target_update_follows_the_optimiser_step(tiny_args, tmp_path) -> None:
    """target <- m * target + (1 - m) * online, with the online weights *after* this step's update."""
    from train.loop import train_step
    from train.setup import build_parts

    cfg = load_config(tiny_args("byol", tmp_path))
    parts = build_parts(cfg, torch.device("cpu"), "torch")
    batch = next(iter(parts.loader))
    s = schedules.at(cfg.optim, 1, len(parts.loader), cfg.data.batch_size)
    target0 = {k: v.detach().clone() for k, v in parts.target.named_parameters()}
    online0 = {k: v.detach().clone() for k, v in parts.online.named_parameters()}
    train_step(parts, batch, s)
    online1 = dict(parts.online.named_parameters())
    moved = 0
    for k, t in parts.target.named_parameters():
        torch.testing.assert_close(t.detach(), s.ema * target0[k] + (1 - s.ema) * online1[k].detach())
        moved += not torch.equal(online1[k].detach(), online0[k])
    assert moved > 0
