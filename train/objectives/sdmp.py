"""SDMP on MoCo v3: mixed images as extra soft positives.

Paper: "A Simple Data Mixing Prior for Improving Self-Supervised Learning", Ren et al., CVPR 2022,
arXiv:2206.07692 (the version is not printed in the paper text the project follows; equation
numbers below are those of that text).
Implemented: Algorithm 1 (Fig. 2) with the source loss Eq. (3), the mixing coefficient
lambda^c and mixing loss Eq. (4), in the replace version of Eq. (5) (the default, Sec. 4.1.1: "we
randomly replace one of the symmetric views with the mixed data") or the extra-view version of
Sec. 4.3.3 / Table 9 (`objective.version=extra`); intra-batch partner n-1-i (Sec. 3.1).
Reference code: https://github.com/OliverRensu/SDMP (commit unknown).

Replace version, per step: one global view v is drawn (a fair coin seeded by the step, so a resumed
run draws the same); the online network embeds the clean view v and the mix of the other view.
Direction 1 is plain MoCo, clean query v against the clean key of the other view (the first term of
Eq. 5, L^s with lambda = 1); direction 2 is the replaced one, the mixed query against the clean key
of view v (Eq. 3) and the key of view v mixed with the same lambda and box (Eq. 4). So the online
network sees one clean and one mixed view every step, as many as MoCo v3 sees, and its BatchNorm
statistics are never those of mixed images alone. Extra-view version: both plain MoCo directions
plus the mixed query of view 0 against view 1's clean and mixed keys (three online views per step).

Setting: SDMP's ResNet code (`moco/builder.py`, `MoCo_ResNet`): a 2-layer projector with an affine-free
last BatchNorm and a 2-layer predictor without one, tau = 1.0 (`sdmp.yaml`); BYOL's views (Sec. 4).
CIFAR-10/100 (Sec. 4.2, Table 5): ResNet-50 (`model.backbone=resnet101` for the other rows) with the
small-image stem, 200 epochs (`optim.epochs=2000` for the long rows); ImageNet (Table 1, ResNet-50): 300
epochs (`data/*.yaml`, per_method).

Deviations:
- The paper states its optimiser for its main backbone, ViT-S (Sec. 4: AdamW, lr 0.0005 x batch/256 at
  batch 1024), and none for its ResNets: CIFAR takes its code's defaults (LARS, lr 0.6 x
  batch/256, weight decay 1e-6, 10 warm-up epochs, momentum 0.99 -> 1, heads 4096 wide) at the CIFAR
  preset's batch 512 (the code's default is 4096: 12 steps an epoch on CIFAR); ImageNet takes MoCo v3's
  300-epoch ResNet-50 config (lr 0.3, weight decay 1e-6, momentum 0.99 -> 1), whose 72.8 % is the
  baseline Table 1 improves to 73.5 %.
- The extra-view version (Sec. 4.3.3, Table 9) is trained there for 2/3 of the replace version's
  epochs, to spend the same compute on three views; the preset's length stays the run's budget
  whichever version runs (a length is the user's to choose), and the start of an extra-view run says
  what the equal-compute length is.
- The view replaced is drawn once per step for the whole batch (the text does not say per step or
  per sample; per step keeps each backbone call to one kind of image).
- No 2*tau factor on the loss (Algorithm 1 has none; MoCo v3's own ctr() has it): the plain term is
  MoCo v3's ctr / (2 tau), on the same scale as Eqs. (3)-(4).
- Where the paper is silent, its code: the replace version's loss is the source term plus half of each
  mixed term, L^s + (L^s_mix + L^m) / 2 (`objective.mix_weight=0.5`; 1.0 is the plain sum of Eq. 5's
  terms); CutMix and ResizeMix draw lam = 0.1 + 0.8 Beta(alpha, alpha) (`pipelines.mixing`); the key
  momentum is the code's constant 0.99 (`--moco-m-cos` off) on CIFAR, and MoCo v3's 300-epoch config's
  on ImageNet.
- The predictor's and projector's last Linear keep a bias where no BatchNorm follows them (SDMP's code
  builds every head Linear without one); the projector's affine-free last BatchNorm makes its bias moot,
  the predictor's is a free offset the code does not have.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_nograd_local_first, moco_ctr, soft_info_nce


def sdmp_clam(lam: Tensor) -> Tensor:
    """Shared-semantics coefficient lambda^c of two mixes with the same sources (Eq. 4).

    lambda^c_i = min(lam_i, 1 - lam_{n-1-i}) + min(1 - lam_i, lam_{n-1-i}).

    Args:
        lam: (B,) weight of sample i itself in its mix, in [0, 1]; partner of i is B-1-i.

    Returns:
        (B,) coefficients in [0, 1].
    """
    lam_p = lam.flip(0)                                      # (B,) lam of the partner n-1-i
    return torch.minimum(lam, 1 - lam_p) + torch.minimum(1 - lam, lam_p)


def sdmp_loss(q_mix: Tensor, k_src: Tensor, k_mix: Tensor, lam: Tensor, tau: float) -> Tensor:
    """SDMP loss of one direction: source term Eq. (3) + mixing term Eq. (4), batch mean.

    Source term: soft label lam_i on key i and (1 - lam_i) on key n-1-i of the clean other view.
    Mixing term: soft label 1/(1+lam^c_i) on mixed key i and lam^c_i/(1+lam^c_i) on mixed key
    n-1-i of the other view mixed with the same lam. Both softmaxes run over all M keys.
    Keys come from the EMA target and are detached here.

    Args:
        q_mix: (B, D) online outputs of the mixed view x^m, raw.
        k_src: (M, D) target outputs of the clean other view x', raw, gathered local-first
            (rows 0..B-1 are this rank's batch, in order).
        k_mix: (M, D) target outputs of the other view mixed with the same lam, x'^m, raw,
            gathered local-first.
        lam: (B,) weight of sample i itself in its mix, in [0, 1].
        tau: temperature, > 0.

    Returns:
        Scalar loss.
    """
    b, m = q_mix.shape[0], k_src.shape[0]
    q = F.normalize(q_mix, dim=1)
    k_src = F.normalize(k_src.detach(), dim=1)
    k_mix = F.normalize(k_mix.detach(), dim=1)
    lam = lam.to(q.dtype)
    own = F.one_hot(torch.arange(b, device=q.device), m).to(q.dtype)          # (B, M)
    partner = F.one_hot(torch.arange(b - 1, -1, -1, device=q.device), m).to(q.dtype)  # (B, M)
    w_src = lam[:, None] * own + (1 - lam[:, None]) * partner                 # Eq. (3) labels
    clam = sdmp_clam(lam)[:, None]                                           # (B, 1)
    w_mix = own / (1 + clam) + partner * clam / (1 + clam)                   # Eq. (4) labels
    return soft_info_nce(q, k_src, w_src, tau) + soft_info_nce(q, k_mix, w_mix, tau)


SDMPVersion = Literal["replace", "extra"]


@dataclass(frozen=True)
class SDMPConfig:
    tau: float = 0.2                    # softmax temperature of Eqs. (3)-(4)
    version: SDMPVersion = "replace"    # Eq. (5)'s replace version, or Table 9's extra view
    mix_weight: float = 0.5             # weight of each mixed term (Eqs. 3-4 on the mixed query): the code's 1/2

    def __post_init__(self) -> None:
        check_positive(self, "tau")
        check_positive(self, "mix_weight")
        if self.version not in typing.get_args(SDMPVersion):
            raise ValueError(f"objective.version must be one of {', '.join(typing.get_args(SDMPVersion))}, "
                             f"got {self.version!r}; set objective.version=replace")


def clean_view(step: int) -> int:
    """The global view (0 or 1) the online network sees clean at `step` in the replace version: a
    fair coin seeded by the step alone (the same in every rank and after a resume)."""
    return int(torch.randint(2, (), generator=torch.Generator().manual_seed(step)))


def plain_term(q: Tensor, k: Tensor, tau: float) -> Tensor:
    """The clean MoCo direction of Eq. (5), Eq. (3) with lambda = 1: MoCo v3's ctr(q, k) without its
    2 tau factor."""
    return moco_ctr(q, k, tau) / (2 * tau)


class SDMP(Objective):
    """SDMP in MoCo v3 form: online queries on a clean view and on a mixed view (replace version),
    target keys of clean and mixed views.

    Reads `batch.global_views` (2, B, ...), `batch.mixed` (2, B, ...) where mixed[v] mixes
    global view v with partner B-1-i and `batch.mix_lam` (2, B). Keys are gathered across ranks.
    """

    Config = SDMPConfig
    needs = ViewNeeds(global_views=2, mix="sdmp", target=True)

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        if batch.mixed is None or batch.mix_lam is None:
            raise ValueError("sdmp needs batch.mixed and batch.mix_lam; set data.mix.kind=sdmp")
        tau, lam = self.cfg.tau, batch.mix_lam
        with torch.no_grad():
            tgt_clean, tgt_mix = target([batch.global_views[:2], batch.mixed[:2]])
        k = [gather_nograd_local_first(tgt_clean.z[v]) for v in range(2)]      # 2 x (M, D) clean keys
        k_mix = [gather_nograd_local_first(tgt_mix.z[v]) for v in range(2)]   # 2 x (M, D) mixed keys
        if self.cfg.version == "replace":
            v = clean_view(s.step)
            o = 1 - v                                                          # the view replaced by its mix
            emb_clean, emb_mix = online([batch.global_views[v:v + 1], batch.mixed[o:o + 1]])
            plain = plain_term(emb_clean.p[0], k[o], tau)
            mixed = sdmp_loss(emb_mix.p[0], k[v], k_mix[v], lam[o], tau)
        else:
            emb_clean, emb_mix = online([batch.global_views[:2], batch.mixed[:1]])
            plain = plain_term(emb_clean.p[0], k[1], tau) + plain_term(emb_clean.p[1], k[0], tau)
            mixed = sdmp_loss(emb_mix.p[0], k[1], k_mix[1], lam[0], tau)
        loss = plain + self.cfg.mix_weight * mixed
        return LossOut(loss=loss, logs={"loss/sdmp_plain": plain.detach(), "loss/sdmp_mixed": mixed.detach()})

    def describe(self, total_steps: int, steps_per_epoch: int) -> str | None:
        """For the extra-view version, the length Table 9 compares it at, said once at the start."""
        if self.cfg.version != "extra":
            return None
        return (f"sdmp: extra-view version, three online views a step; Sec. 4.3.3 trains it for 2/3 of the replace "
                f"version's epochs for the same compute: optim.steps={round(2 * total_steps / 3)} here "
                f"(this run: {total_steps})")
