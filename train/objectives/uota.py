"""UOTA: Mahalanobis outlier weights on the per-view losses of a multi-crop base objective.

Paper: "Improving Self-supervised Learning with Automated Unsupervised Outlier Arbitration",
Wang et al., NeurIPS 2021, arXiv:2112.08132 (the version is not printed in the supplement text
the project follows; equation numbers below are those of that text, "M" = main paper).
Implemented: the supplement's Sec. 2 pseudo-code W(multi_z, tau) — mu_i = mean over the M views
(Eq. M.10), Sigma = sum Delta Delta^T / N (Eq. M.10), w = exp(-Delta^T Sigma^-1 Delta / tau)
(Eq. M.9), normalised to mean 1 (Eq. M.11), no gradient — and the weighted losses Eq. (M.12) as
expanded for MoCo-v2* (Eq. S.5) and BYOL (Eq. S.6); the base objective alone for the first
`warmup_epochs` (N_warm, Sec. S.5).
Reference code: https://github.com/ssl-codelab/uota (commit unknown).

Setups (Sec. S.5: "exactly the same augmentation policy as what the baseline model X published"):
- BYOL+UOTA (the default, `uota.yaml`): BYOL's own two views (`views.recipe: byol`), its predictor and
  cosine EMA target; M = 2 trainable features per sample.
- MoCo-v2*+UOTA (`objective.base=mocov2star views.recipe=multicrop8 model.pred_hidden=0`): SwAV's
  multi-crop, 2 + 6 views with SwAV's colour law (`multicrop8`), M = 8; the queries are the projector
  outputs (MoCo v2 has no predictor: `emb.z`, whatever `model.pred_hidden` says) and the key encoder
  follows MoCo v2's fixed momentum `objective.key_momentum` (0.999), not BYOL's cosine schedule.

Deviations:
- Sigma^-1 is computed as a pseudo-inverse, equal to the inverse when Sigma is invertible, so
  that a rank-deficient Sigma (D > (M-1) N: small batches) still gives finite weights.
- The weights are computed over the batch gathered from all ranks (one Sigma and one
  normalisation for the global batch), so DDP equals the single-process run.
- Per-view sub-losses of a multi-crop view are averaged over the global target views other than
  itself, so that each trainable feature z_ij carries exactly one weight w_ij.
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
from train.objectives.terms import gather_nograd_local_first, regression_loss

UOTABase = Literal["byol", "mocov2star"]
BASES: tuple[str, ...] = typing.get_args(UOTABase)


@torch.no_grad()
def uota_weights(z: Tensor, tau: float) -> Tensor:
    """UOTA outlier weights of every trainable feature (supplement Sec. 2, W()).

    Args:
        z: (M, N, D) trainable features: M views (sub-losses) of N samples, raw.
        tau: UOTA temperature, > 0 (200-350 in Table S.1).

    Returns:
        (M, N) non-negative weights averaging 1, without gradient, in the dtype of `z`.
    """
    m, n, d = z.shape
    x = z.detach().to(torch.float64 if z.dtype == torch.float64 else torch.float32)
    # A float32 island: under the training step's bf16 autocast the matmuls below would run in bf16
    # and `pinv` rejects bf16 (and a covariance needs the precision), so autocast is off here.
    with torch.autocast(z.device.type, enabled=False):
        mu = x.mean(dim=0, keepdim=True)                               # (1, N, D) Eq. (M.10)
        delta = (x - mu).reshape(m * n, d)                             # (M*N, D)
        sigma = delta.T @ delta / n                                    # (D, D)   Eq. (M.10)
        sigma_inv = torch.linalg.pinv(sigma, hermitian=True)
        dist2 = ((delta @ sigma_inv) * delta).sum(dim=1) / tau         # (M*N,) Mahalanobis / tau
    # exp(-(d - min d)) differs from exp(-d) by one constant factor, which the normalisation
    # removes; the shift keeps the largest weight at 1 so that no batch underflows to 0/0.
    w = torch.exp(-(dist2 - dist2.min()))                              # Eq. (M.9)
    w = w / w.sum() * (m * n)                                          # Eq. (M.11), mean 1
    return w.reshape(m, n).to(z.dtype)                                 # (M, N)


@dataclass(frozen=True)
class UOTAConfig:
    base: UOTABase = "byol"     # base objective: "byol" (Eq. S.6) | "mocov2star" (Eq. S.5)
    tau: float = 200.0          # UOTA temperature (Table S.1: 200 BYOL, 250 MoCo-v2*)
    warmup_epochs: float = 20.0 # N_warm: epochs of the base objective alone before UOTA
    moco_tau: float = 0.2       # MoCo-v2* softmax temperature t
    queue_size: int = 65536     # MoCo-v2* negatives kept in the queue
    dim: int = 128              # projector output size; must equal model.proj_out (queue width)
    seed: int = 0               # seed of the random initial queue
    key_momentum: float = 0.999 # MoCo-v2* key encoder: MoCo v2's fixed EMA momentum

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"objective.base={self.base!r} is unknown; choose one of {', '.join(BASES)}")
        check_positive(self, "tau", "moco_tau")
        if self.queue_size < 1 or self.dim < 1:
            raise ValueError("objective.queue_size and objective.dim must be >= 1")
        if not 0.0 <= self.key_momentum <= 1.0:
            raise ValueError(f"objective.key_momentum must be in [0, 1], got {self.key_momentum}; "
                             "set objective.key_momentum=0.999")


class UOTA(Objective):
    """UOTA over a multi-crop base: online `p` of every view (global and local) is a trainable
    feature; targets are the target projections of the global views.

    BYOL base: per-view loss 2 - 2 cos(p_v, sg z_g), averaged over global views g != v.
    MoCo-v2* base: per-view InfoNCE of q_v against k_g+ and the queue, averaged over g != v; the
    queue (a registered buffer, so it is checkpointed) is updated only in `after_step` with the
    gathered keys of the first global view.
    """

    Config = UOTAConfig
    needs = ViewNeeds(global_views=2, target=True)

    def __init__(self, cfg: UOTAConfig) -> None:
        super().__init__(cfg)
        if cfg.base == "mocov2star":      # MoCo-v2*: SwAV's multi-crop, 2 global + 6 local views
            self.needs = ViewNeeds(global_views=2, local=6, target=True)
        k = cfg.queue_size if cfg.base == "mocov2star" else 0
        gen = torch.Generator().manual_seed(cfg.seed)
        self.register_buffer("queue", F.normalize(torch.randn(k, cfg.dim, generator=gen), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.int64))

    def _per_view_losses(self, p: Tensor, z_global: Tensor) -> tuple[Tensor, Tensor | None]:
        """(V, B) base losses of each online view, and the keys to enqueue (MoCo-v2*)."""
        vg = z_global.shape[0]
        rows = []
        for v in range(p.shape[0]):
            others = [g for g in range(vg) if g != v]
            if self.cfg.base == "byol":
                l_v = torch.stack([regression_loss(p[v], z_global[g]) for g in others]).mean(0)
            else:
                l_v = torch.stack([self._moco_term(p[v], z_global[g]) for g in others]).mean(0)
            rows.append(l_v)
        per_view = torch.stack(rows)                                       # (V, B)
        keys = None
        if self.cfg.base == "mocov2star":
            keys = gather_nograd_local_first(F.normalize(z_global[0], dim=1))  # (M, D)
        return per_view, keys

    def _moco_term(self, q: Tensor, k: Tensor) -> Tensor:
        """Per-sample MoCo-v2 InfoNCE (Eq. S.5): positive k_i, negatives the queue. (B,)."""
        if q.shape[1] != self.queue.shape[1]:
            raise ValueError(f"uota queue width objective.dim={self.queue.shape[1]} differs from "
                             f"the projector output {q.shape[1]}; set objective.dim={q.shape[1]}")
        q = F.normalize(q, dim=1)
        k = F.normalize(k.detach(), dim=1)
        pos = (q * k).sum(dim=1, keepdim=True)                             # (B, 1)
        neg = q @ self.queue.to(q.dtype).T                                 # (B, K)
        logits = torch.cat([pos, neg], dim=1) / self.cfg.moco_tau          # (B, 1 + K)
        return -logits.log_softmax(dim=1)[:, 0]

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        groups = [batch.global_views] if batch.local_views is None else [batch.global_views,
                                                                         batch.local_views]
        embs = online(groups)
        # BYOL's trainable features are the predictor outputs; MoCo v2's queries the projector outputs.
        p = torch.cat([e.p if self.cfg.base == "byol" else e.z for e in embs], dim=0)   # (V, B, D)
        with torch.no_grad():
            (tgt,) = target([batch.global_views])
        per_view, keys = self._per_view_losses(p, tgt.z)                   # (V, B)
        base = per_view.mean()
        state = {} if keys is None else {"keys": keys}
        logs = {"loss/base": base.detach()}
        if s.epoch < self.cfg.warmup_epochs:
            return LossOut(loss=base, logs=logs, state=state)
        b = p.shape[1]
        p_all = gather_nograd_local_first(p.transpose(0, 1))               # (M, V, D)
        w = uota_weights(p_all.transpose(0, 1), self.cfg.tau)[:, :b]       # (V, B) this rank
        loss = (w * per_view).mean()                                       # Eq. (M.12)
        logs["loss/uota"] = loss.detach()
        logs["uota/w_min"] = w.min()
        return LossOut(loss=loss, logs=logs, state=state)

    def target_momentum(self, s: StepValues) -> float:
        """BYOL base: the cosine schedule; MoCo-v2*: MoCo v2's fixed key-encoder momentum."""
        return s.ema if self.cfg.base == "byol" else self.cfg.key_momentum

    @torch.no_grad()
    def after_step(self, out: LossOut) -> None:
        """Enqueue the step's gathered keys (MoCo-v2* base), overwriting the oldest entries."""
        keys = out.state.get("keys")
        if keys is None or self.queue.shape[0] == 0:
            return
        k = self.queue.shape[0]
        keys = keys[-k:].to(self.queue.dtype)                              # (min(M, K), D)
        idx = (self.queue_ptr + torch.arange(keys.shape[0], device=keys.device)) % k
        self.queue.index_copy_(0, idx.to(self.queue.device), keys.to(self.queue.device))
        self.queue_ptr.copy_((self.queue_ptr + keys.shape[0]) % k)
