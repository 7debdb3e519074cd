"""BYOL baseline: online predictor regresses the target projection of the other view.

Paper: "Bootstrap Your Own Latent: A New Approach to Self-Supervised Learning", Grill et al.,
arXiv:2006.07733v3. Implemented: Eq. (2) normalised regression loss 2 - 2 cos and its
symmetrisation (Sec. 3.1). Reference code: https://github.com/deepmind/deepmind-research/tree/master/byol
(commit unknown). The EMA target update (Eq. 1) is the loop's `target.update_from`. ImageNet
(`data/imagenet.yaml`): Sec. 3.3's LARS, lr 0.2 x batch/256, weight decay 1.5e-6, 1000 epochs with 10
of warm-up, tau_base 0.996 -> 1.

Deviations: none.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, online_and_target
from train.objectives.terms import byol_loss


@dataclass(frozen=True)
class BYOLConfig:
    """BYOL has no loss hyper-parameters; the EMA momentum comes from the schedules."""


class BYOL(Objective):
    """Symmetrised BYOL loss over the first two global views."""

    Config = BYOLConfig
    needs = ViewNeeds(global_views=2, target=True)

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        emb, tgt = online_and_target(online, target, batch.global_views[:2], batch.global_views[:2])
        loss = byol_loss(emb.p[0], emb.p[1], tgt.z[0], tgt.z[1])
        return LossOut(loss=loss, logs={"loss/byol": loss.detach()})
