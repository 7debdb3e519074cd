"""DACL: NT-Xent over Mixup-noise positives, alone or added to SimCLR.

Paper: "Towards Domain-Agnostic Contrastive Learning", Verma et al., ICML 2021,
arXiv:2011.04419 (the version is not printed in the paper text the project follows; equation
numbers below are those of that text).
Implemented: Algorithm 1 (two Mixup-noise positives per sample, Eq. 3, lam ~ U(alpha, 1);
NT-Xent with the anchor excluded from its own denominator, lines 17-21); the positives arrive
already mixed in `batch.mixed` from the pipeline: Linear Mixup alone by default (Algorithm 1), the
DACL+ noises (Eqs. 5-6, one per sample for both positives) with `data.mix.dacl_noises`; SimCLR+DACL
as the sum of the SimCLR and DACL losses (Sec. 5.1).
Reference code: none published with the paper (unknown).

Projection head: Sec. 5.2's "3-layer MLP projection-head to project the representation to a
128-dimensional latent space" (`dacl.yaml`: `model.proj_layers: 3`, `model.proj_out: 128`; the hidden
width is the project's 2048, as SimCLR's).
Binary Mixup's rho (Eq. 6): Sec. 3.1's "high rho" and Sec. 5's grid {0.1, 0.3, 0.5} are read
together as the grid giving the probability of swapping an element (`data.mix.binary_swap`, default
0.3), so rho = P(keep) in {0.9, 0.7, 0.5} (`pipelines.mixing`).

ImageNet (Sec. 5.2, `data/imagenet.yaml`, per_method): LARS, lr 0.3 x batch/256, 100 epochs with 10 of
linear warm-up then cosine, weight decay 1e-6 (batch 4096: 16 GPUs x 256).
CIFAR-10/100 (`data/cifar*.yaml`): not the paper's setting (Sec. 5.2: a ResNet-50 (4x), LARS at lr 1.0 x
batch/256 for 1,000 epochs at batch 4096) but the data preset's own, ResNet-18 at batch 512 with LARS
lr 1.0, as every method without a per-method CIFAR setting; `optim.*` and `model.backbone` set the paper's.
tau 0.5: the middle of Sec. 5's grid {0.1, 0.5, 1.0}, which reports no choice per dataset.

Deviations:
- SimCLR+DACL's two views use the `byol` recipe (see `simclr.py`).
- Sec. 5.2's encoder is ResNet-50 (4x); timm has no 4x-wide ResNet-50, so the presets keep ResNet-50.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_local_first, nt_xent, nt_xent_local

__all__ = ["DACL", "DACLConfig", "nt_xent"]


@dataclass(frozen=True)
class DACLConfig:
    tau: float = 0.5            # NT-Xent temperature: a pick from Sec. 5's grid {0.1, 0.5, 1.0} (no choice reported)
    with_simclr: bool = False   # True: SimCLR loss on the two global views + DACL loss

    def __post_init__(self) -> None:
        check_positive(self, "tau")


class DACL(Objective):
    """NT-Xent of the projector outputs of the two Mixup-noise positives `batch.mixed[0:2]`.

    `needs` of an instance follows the config: one global view (unused) for DACL alone, two for
    SimCLR+DACL. No target network.
    """

    Config = DACLConfig
    needs = ViewNeeds(global_views=1, mix="dacl", target=False)

    def __init__(self, cfg: DACLConfig) -> None:
        super().__init__(cfg)
        if cfg.with_simclr:
            self.needs = replace(DACL.needs, global_views=2)

    def forward(self, online: nn.Module, target: nn.Module | None, batch: Batch,
                s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        if batch.mixed is None or batch.mixed.shape[0] < 2:
            raise ValueError("dacl needs two mixup-noise positives in batch.mixed; "
                             "set data.mix.kind=dacl")
        tau = self.cfg.tau
        if self.cfg.with_simclr:
            # Same resolution: one backbone call for the views and the mixes.
            emb_views, emb_mix = online([batch.global_views[:2], batch.mixed[:2]])
        else:
            (emb_mix,) = online([batch.mixed[:2]])
        m1, m2 = emb_mix.z[0], emb_mix.z[1]                               # (B, D) each
        dacl = nt_xent_local(m1, m2, gather_local_first(m1), gather_local_first(m2), tau)
        logs = {"loss/dacl": dacl.detach()}
        loss = dacl
        if self.cfg.with_simclr:
            v1, v2 = emb_views.z[0], emb_views.z[1]
            simclr = nt_xent_local(v1, v2, gather_local_first(v1), gather_local_first(v2), tau)
            loss = simclr + dacl
            logs["loss/simclr"] = simclr.detach()
        return LossOut(loss=loss, logs=logs)
