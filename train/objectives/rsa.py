"""RSA: BYOL with staged weak/aggressive views and a cosine-decayed aggressive weight.

Paper: "RSA: Reducing Semantic Shift from Aggressive Augmentations for Self-supervised Learning",
Bai et al., NeurIPS 2022, arXiv:2206.01999 (v1 is titled "MSR: Making Self-supervised learning
Robust to Aggressive Augmentations"; the version matching the paper text the project follows is
not printed in it; equation numbers below are those of that text).
Implemented: Eq. (2) L_mse = 2 - 2 cos, Eq. (4) aggressive views on the online network and weak
views on the target, Eq. (5) loss with the aggressive-aggressive target taken from the other
view's online output under stop-gradient, Eq. (6) beta = beta_base * (cos(pi k / K) + 1) / 2
over optimiser steps; Algorithm 1.
Reference code: https://github.com/tmllab/RSA (commit unknown).

Settings (Sec. 4.1, "Network structure and optimization"): CIFAR-10/100 the small-dataset setting
(`data/cifar*.yaml`, per_method: SGD lr 0.1, wd 5e-4, batch 256, beta_base 0.3, 1024/128 heads);
ImageNet-1K (`data/imagenet.yaml`, per_method): LARS, one cosine cycle, lr 0.6 x batch/256 for 200
epochs (0.9 for 100), momentum 0.9, wd 1e-6, batch 2048 (8 GPUs x 256), beta_base 0.4.

Deviations:
- ImageNet's warm-up (10 epochs) and target momentum (0.996 -> 1) are BYOL's: the paper says "we
  follow [15]" (BYOL) for ImageNet-1K and names neither; its 0.99 -> 1 is said of its small and medium
  datasets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, online_and_target
from train.objectives.terms import regression_loss


def rsa_beta(step: int, total_steps: int, beta_base: float) -> float:
    """Weight of the aggressive-aggressive pairs at optimiser step k, Eq. (6).

    Args:
        step: k, current optimiser step, 0 <= step <= total_steps.
        total_steps: K, steps of the whole run, > 0.
        beta_base: beta at step 0, in [0, 1].

    Returns:
        beta_base * (cos(pi * k / K) + 1) / 2: beta_base at k = 0, 0 at k = K, non-increasing.
    """
    if total_steps <= 0:
        raise ValueError(f"rsa_beta needs total_steps > 0, got {total_steps}")
    k = min(max(step, 0), total_steps)
    return beta_base * (math.cos(math.pi * k / total_steps) + 1.0) / 2.0


def rsa_terms(p1_a: Tensor, p2_a: Tensor, z1_w: Tensor, z2_w: Tensor) -> tuple[Tensor, Tensor]:
    """The two halves of Eq. (5), batch means: (weak-target term, aggressive-target term).

    weak       = L(p1_a, sg z2_w) + L(p2_a, sg z1_w)
    aggressive = L(p1_a, sg p2_a) + L(p2_a, sg p1_a)

    Args: see `rsa_loss`.

    Returns:
        Two scalars.
    """
    weak = (regression_loss(p1_a, z2_w) + regression_loss(p2_a, z1_w)).mean()
    aggressive = (regression_loss(p1_a, p2_a) + regression_loss(p2_a, p1_a)).mean()
    return weak, aggressive


def rsa_loss(p1_a: Tensor, p2_a: Tensor, z1_w: Tensor, z2_w: Tensor, beta: float) -> Tensor:
    """RSA loss, Eq. (5), mean over the batch.

    L = (1-b) L(z_a, z'_w) + b L(z_a, z'_a) + (1-b) L(z'_a, z_w) + b L(z'_a, z_a), where the
    second argument of every L is under stop-gradient (target network or detached online output).

    Args:
        p1_a, p2_a: (B, D) online predictor outputs of the aggressive views v_a, v'_a, raw.
        z1_w, z2_w: (B, D) target projections of the weak views v_w, v'_w, raw.
        beta: weight of the aggressive-aggressive pairs, from `rsa_beta`, in [0, 1].

    Returns:
        Scalar loss.
    """
    weak, aggressive = rsa_terms(p1_a, p2_a, z1_w, z2_w)
    return (1.0 - beta) * weak + beta * aggressive


@dataclass(frozen=True)
class RSAConfig:
    beta_base: float = 0.4      # beta at step 0 (0.3 CIFAR, 0.4 STL/Tiny/ImageNet-100, Sec. 4.1)

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta_base <= 1.0:
            raise ValueError(f"objective.beta_base must be in [0, 1], got {self.beta_base}")


class RSA(Objective):
    """RSA on BYOL: `batch.global_views` are the aggressive views, `batch.weak_views` their parents."""

    Config = RSAConfig
    needs = ViewNeeds(global_views=2, weak=True, target=True)

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        if batch.weak_views is None:
            raise ValueError("rsa needs batch.weak_views; use the staged view recipe views=rsa")
        agg, weak = online_and_target(online, target, batch.global_views[:2], batch.weak_views[:2])
        beta = rsa_beta(s.step, s.total_steps, self.cfg.beta_base)
        weak_term, aggressive_term = rsa_terms(agg.p[0], agg.p[1], weak.z[0], weak.z[1])
        loss = (1.0 - beta) * weak_term + beta * aggressive_term
        return LossOut(loss=loss, logs={"loss/weak": weak_term.detach(),
                                        "loss/aggressive": aggressive_term.detach()})
