"""The EMA target network: a frozen copy of the online network, updated only by an explicit call."""

from __future__ import annotations

import copy

import torch
from torch import nn

# Buffer policy: buffers (BatchNorm running statistics) are copied from the online network, not averaged.


def make_target(online: nn.Module) -> nn.Module:
    """A deep copy of `online` with gradients switched off (kept in train mode like online)."""
    target = copy.deepcopy(online)
    for p in target.parameters():
        p.requires_grad_(False)
    target.train(online.training)
    return target


@torch.no_grad()
def ema_update_(target: nn.Module, online: nn.Module, momentum: float) -> None:
    """In place: target ← momentum · target + (1 − momentum) · online, for every parameter.

    Args:
        target, online: modules with identical structure.
        momentum: in [0, 1]; 1 keeps the target, 0 copies online.
    """
    t_params = [p for p in target.parameters()]
    o_params = [p.detach() for p in online.parameters()]
    torch._foreach_lerp_(t_params, o_params, 1.0 - momentum)   # t + (1-m)(o - t) = m t + (1-m) o
    for tb, ob in zip(target.buffers(), online.buffers()):
        tb.copy_(ob)
