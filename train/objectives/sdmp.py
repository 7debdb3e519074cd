"""SDMP on MoCo v3: mixed images as extra soft positives.

Paper: "A Simple Data Mixing Prior for Improving Self-Supervised Learning", Ren et al., CVPR 2022,
arXiv:2206.07692 (the version is not printed in the paper text the project follows; equation
numbers below are those of that text).
Implemented: Algorithm 1 (Fig. 2) with the source loss Eq. (3), the mixing coefficient
lambda^c and mixing loss Eq. (4), summed as in the replace version Eq. (5); intra-batch partner
n-1-i (Sec. 3.1).
Reference code: https://github.com/OliverRensu/SDMP (commit unknown).

Deviations:
- Algorithm 1 writes one direction (mixed view a as query, view b as key). Like MoCo v3 we
  symmetrise: the mixes of both global views serve as queries, each against the clean and the
  mixed keys of the other view, and the two directions are summed.
- No 2*tau factor on the loss (Algorithm 1 has none; MoCo v3's own ctr() has it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_nograd_local_first, soft_info_nce


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


@dataclass(frozen=True)
class SDMPConfig:
    tau: float = 0.2            # softmax temperature of Eqs. (3)-(4)

    def __post_init__(self) -> None:
        check_positive(self, "tau")


class SDMP(Objective):
    """SDMP in MoCo v3 form: online queries on mixed views, target keys of clean and mixed views.

    Reads `batch.global_views` (2, B, ...), `batch.mixed` (2, B, ...) where mixed[v] mixes
    global view v with partner B-1-i and `batch.mix_lam` (2, B). Keys are gathered across ranks.
    """

    Config = SDMPConfig
    needs = ViewNeeds(global_views=2, mix="sdmp", target=True)

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        if batch.mixed is None or batch.mix_lam is None:
            raise ValueError("sdmp needs batch.mixed and batch.mix_lam; set data.mix.kind=sdmp")
        (emb_mix,) = online([batch.mixed[:2]])
        q = emb_mix.p                                                      # (2, B, D)
        with torch.no_grad():
            tgt_clean, tgt_mix = target([batch.global_views[:2], batch.mixed[:2]])
        k_src = [gather_nograd_local_first(tgt_clean.z[v]) for v in range(2)]  # 2 x (M, D)
        k_mix = [gather_nograd_local_first(tgt_mix.z[v]) for v in range(2)]    # 2 x (M, D)
        lam = batch.mix_lam
        d0 = sdmp_loss(q[0], k_src[1], k_mix[1], lam[0], self.cfg.tau)
        d1 = sdmp_loss(q[1], k_src[0], k_mix[0], lam[1], self.cfg.tau)
        loss = d0 + d1
        return LossOut(loss=loss, logs={"loss/sdmp": loss.detach()})
