"""MoCo v3 baseline: symmetric InfoNCE of online predictions against gathered target keys.

Paper: "An Empirical Study of Training Self-Supervised Vision Transformers", Chen, Xie, He,
arXiv:2104.02057v4. Implemented: Algorithm 1, ctr(q1, k2) + ctr(q2, k1) with
ctr(q, k) = 2 tau * CE(q k^T / tau), keys from all devices. Reference code:
https://github.com/facebookresearch/moco-v3 (commit unknown; `moco/builder.py`, CONFIG.md).

Setting (`mocov3.yaml`, the ResNet one, as the code builds `MoCo_ResNet`): tau = 1.0; a 2-layer
projector ending in an affine-free BatchNorm (`model.proj_last_bn`) and a 2-layer predictor without one
(`_build_mlp(2, dim, mlp_dim, dim, False)`: only the ViT predictor keeps it; `model.pred_last_bn` false),
hidden width 4096 on ImageNet; the 3-layer projector is the ViT head. Views:
BYOL's with crops of 20-100 % (`--crop-min=.2` in every ResNet-50 config; the `mocov3` recipe). On
ImageNet (`data/imagenet.yaml`, per_method) the 1,000-epoch ResNet-50 config: LARS, lr 0.3 x batch/256,
weight decay 1.5e-6, momentum 0.996 -> 1 (cosine, `--moco-m-cos`), 10 warm-up epochs.

Deviations:
- Weight decay follows the project's cosine from `optim.weight_decay` to `optim.final_weight_decay`;
  the presets set both equal, which is MoCo v3's constant decay.
- On CIFAR and the synthetic data the optimiser is the data preset's (the paper trains ResNets on
  ImageNet only).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive, online_and_target
from train.objectives.terms import gather_nograd_local_first, moco_ctr


@dataclass(frozen=True)
class MoCoV3Config:
    tau: float = 0.2            # softmax temperature (0.2 for ViT, 1.0 for ResNet-50 in the paper)

    def __post_init__(self) -> None:
        check_positive(self, "tau")


class MoCoV3(Objective):
    """MoCo v3 over the first two global views; queries are online `p`, keys target `z`."""

    Config = MoCoV3Config
    needs = ViewNeeds(global_views=2, target=True)

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        emb, tgt = online_and_target(online, target, batch.global_views[:2], batch.global_views[:2])
        k1 = gather_nograd_local_first(tgt.z[0])                          # (M, D)
        k2 = gather_nograd_local_first(tgt.z[1])                          # (M, D)
        loss = moco_ctr(emb.p[0], k2, self.cfg.tau) + moco_ctr(emb.p[1], k1, self.cfg.tau)
        return LossOut(loss=loss, logs={"loss/mocov3": loss.detach()})
