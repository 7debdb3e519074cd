"""Schedules as pure functions of the optimiser step: linear warmup, then cosine, then the floor.

`at(cfg, step, steps_per_epoch, global_batch)` gives every value of one step as a `StepValues`;
nothing here keeps state, so a resumed run gets exactly the values of an uninterrupted one.
"""

from __future__ import annotations

import math

from train.objectives.base import StepValues


def cosine(step: int, total_steps: int, start: float, end: float) -> float:
    """Half-cosine from `start` (step 0) to `end` (step `total_steps`), constant after.

    Args:
        step: optimiser step, >= 0.
        total_steps: length of the cosine, > 0.
        start: value at step 0.
        end: value at and after `total_steps`.

    Returns:
        end + (start - end) * (1 + cos(pi * t)) / 2 with t = min(step / total_steps, 1).
    """
    t = min(max(step, 0) / max(total_steps, 1), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * t))


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, peak: float, floor: float) -> float:
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine from `peak` to `floor`.

    Args:
        step: optimiser step, >= 0.
        total_steps: steps of the whole run.
        warmup_steps: warmup length, >= 0 (0: no warmup).
        peak: value at the end of warmup.
        floor: value at the last step and after.

    Returns:
        The value at `step`.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return cosine(step - warmup_steps, max(total_steps - warmup_steps, 1), peak, floor)


def scaled_lr(lr: float, global_batch: int) -> float:
    """Linear scaling rule: `lr` is given at batch 256 (Goyal et al. 2017)."""
    return lr * global_batch / 256


def at(optim, step: int, steps_per_epoch: int, global_batch: int) -> StepValues:
    """All schedule values at `step` for an `OptimConfig`.

    Args:
        optim: the `optim` section of the config (lr, weight decay, warmup, steps, EMA endpoints).
        step: optimiser step, 0-based.
        steps_per_epoch: loader batches per epoch (for the `epoch` field only).
        global_batch: images per step over all ranks.

    Returns:
        StepValues: lr (warmup + cosine to `min_lr_ratio` of the scaled peak), weight decay (cosine
        from `weight_decay` to `final_weight_decay`) and EMA momentum (BYOL cosine,
        1 - (1 - ema_start)(cos(pi k/K) + 1)/2, from `ema_start` to `ema_end`).
    """
    peak = scaled_lr(optim.lr, global_batch)
    return StepValues(
        step=step,
        total_steps=optim.steps,
        epoch=step / max(steps_per_epoch, 1),
        lr=warmup_cosine(step, optim.steps, optim.warmup_steps, peak, peak * optim.min_lr_ratio),
        weight_decay=cosine(step, optim.steps, optim.weight_decay, optim.final_weight_decay),
        ema=cosine(step, optim.steps, optim.ema_start, optim.ema_end),
    )
