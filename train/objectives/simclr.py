"""SimCLR baseline: NT-Xent over two augmented views, negatives from the gathered batch.

Paper: "A Simple Framework for Contrastive Learning of Visual Representations", Chen et al.,
arXiv:2002.05709v3. Implemented: Eq. (1) NT-Xent, Algorithm 1 (2N samples, anchor excluded from
its own denominator). Reference code: https://github.com/google-research/simclr (commit unknown).

Deviations:
- Views: the `byol` recipe (BYOL Table 6: asymmetric blur, solarize 0.2 on one view) rather than
  SimCLR's own augmentation (symmetric blur 0.5, no solarize), so that the three baselines BYOL,
  MoCo v3 and SimCLR differ only in their loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_local_first, nt_xent_local


@dataclass(frozen=True)
class SimCLRConfig:
    tau: float = 0.5            # NT-Xent temperature (0.5 on CIFAR, 0.1 on ImageNet in the paper)

    def __post_init__(self) -> None:
        check_positive(self, "tau")


class SimCLR(Objective):
    """NT-Xent of the projector outputs `z` of the first two global views; no target network."""

    Config = SimCLRConfig
    needs = ViewNeeds(global_views=2, target=False)

    def forward(self, online: nn.Module, target: nn.Module | None, batch: Batch,
                s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        (emb,) = online([batch.global_views[:2]])
        z1, z2 = emb.z[0], emb.z[1]                                       # (B, D) each
        loss = nt_xent_local(z1, z2, gather_local_first(z1), gather_local_first(z2), self.cfg.tau)
        return LossOut(loss=loss, logs={"loss/simclr": loss.detach()})
