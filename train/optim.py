"""Optimiser pieces of the loop: timm's LARS / SGD / AdamW with per-group weight-decay scaling, the
per-step learning rate and weight decay from `train.schedules`, optional clipping, then the step."""

from __future__ import annotations

import torch
from torch import nn

from train.config import Config


def build_optimizer(cfg: Config, modules: list[nn.Module]) -> torch.optim.Optimizer:
    """LARS / SGD (Nesterov) / plain momentum SGD / AdamW from timm; biases and norm weights get no
    weight decay (nor LARS adaptation) unless `optim.decay_all`."""
    from timm.optim import create_optimizer_v2

    holder = nn.ModuleList(modules)
    kwargs = {"betas": (cfg.optim.momentum, 0.999)} if cfg.optim.name == "adamw" else {"momentum": cfg.optim.momentum}
    optimizer = create_optimizer_v2(holder, opt=cfg.optim.name, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                    filter_bias_and_bn=not cfg.optim.decay_all, **kwargs)
    for group in optimizer.param_groups:
        group["wd_scale"] = 1.0 if group["weight_decay"] > 0 else 0.0
    return optimizer


def apply_lr_wd(optimizer: torch.optim.Optimizer, s) -> None:
    for group in optimizer.param_groups:
        group["lr"] = s.lr
        group["weight_decay"] = s.weight_decay * group["wd_scale"]


def clip_and_step(optimizer: torch.optim.Optimizer, scaler, clip: float) -> None:
    """Optional global-norm clipping, then the optimiser step."""
    if clip > 0:
        scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, clip)
    scaler.step(optimizer)
    scaler.update()
