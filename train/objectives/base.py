"""Types shared by the trainer and every objective: what goes in (`StepValues`), what comes out
(`LossOut`) and what an objective needs from the data (`ViewNeeds`), plus the online/target forward
that the EMA-target objectives share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class StepValues:
    """Values of every schedule at one optimiser step (pure functions of `step`, train/schedules.py)."""

    step: int                 # optimiser step, 0-based
    total_steps: int          # steps of the whole run
    epoch: float              # step / steps_per_epoch
    lr: float                 # learning rate after warmup/cosine and batch scaling
    weight_decay: float       # weight decay at this step
    ema: float                # EMA momentum of the target network at this step


@dataclass(frozen=True)
class ViewNeeds:
    """What an objective reads from a `Batch`; checked against the data config at start-up."""

    global_views: int = 2     # minimum number of global views
    local: int = 0            # minimum number of local views (0: ignored if present)
    weak: bool = False        # needs staged weak parents (RSA)
    mix: str = "none"         # intra-batch mix kind it needs: "none" | "sdmp" | "dacl"
    target: bool = True       # uses an EMA target network


@dataclass
class LossOut:
    """The loss of one step and the detached terms to log."""

    loss: Tensor                                            # scalar, differentiable
    logs: dict[str, Tensor] = field(default_factory=dict)   # name -> detached scalar
    state: dict[str, Tensor] = field(default_factory=dict)  # detached tensors for `after_step`


def online_and_target(online: nn.Module, target: nn.Module, online_views: list[Tensor],
                      target_views: list[Tensor]):
    """One resolution of views through the online model and, without gradient, the EMA target.

    Returns:
        (online ViewEmbeddings, target ViewEmbeddings) of `models.multicrop.SSLModel`.
    """
    (emb,) = online([online_views])
    with torch.no_grad():
        (tgt,) = target([target_views])
    return emb, tgt
