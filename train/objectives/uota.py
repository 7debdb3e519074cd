"""UOTA: Mahalanobis outlier weights on the per-view losses of a multi-crop base objective.

Paper: "Improving Self-supervised Learning with Automated Unsupervised Outlier Arbitration",
Wang et al., NeurIPS 2021, arXiv:2112.08132 (the version is not printed in the supplement text
the project follows; equation numbers below are those of that text, "M" = main paper).
Implemented: the supplement's Sec. 2 pseudo-code W(multi_z, tau) — mu_i = mean over the M views
(Eq. M.10), Sigma from the deviations (Eq. M.10), w = exp(-Delta^T Sigma^-1 Delta / tau) (Eq. M.9),
normalised to mean 1 (Eq. M.11), no gradient — and the weighted losses Eq. (M.12) as expanded for
MoCo-v2* (Eq. S.5) and BYOL (Eq. S.6); the base objective alone for the first N_warm of the run
(Sec. S.5: 20 of 200 epochs).
Reference code: https://github.com/ssl-codelab/uota (commit unknown).

Setups (Sec. S.5: "exactly the same augmentation policy as what the baseline model X published"):
- BYOL+UOTA (the default, `uota.yaml`): BYOL's own two views (`views.recipe: byol`), its predictor and
  cosine EMA target; M = 2 trainable features per sample.
- MoCo-v2*+UOTA (`objective.base=mocov2star views.recipe=multicrop8 model.pred_hidden=0
  model.proj_out=128`): SwAV's multi-crop, 2 + 6 views with SwAV's colour law (`multicrop8`), M = 8,
  MoCo v2's 128-d embedding; the queries are the projector outputs (MoCo v2 has no predictor: `emb.z`,
  whatever `model.pred_hidden` says), the queue is as wide as the projector, and the key encoder
  follows MoCo v2's fixed momentum `objective.key_momentum` (0.999), not BYOL's cosine schedule.

Deviations:
- Sigma is shrunk toward (tr Sigma / D) I by Ledoit and Wolf's estimate of the optimal intensity
  ("A well-conditioned estimator for large-dimensional covariance matrices", J. Multivariate Anal.
  2004, Sec. 3.3; `objective.shrinkage=ledoit_wolf`). The paper's sample covariance is singular
  whenever M N <= D, and BYOL's M = 2 makes it worse: Delta_i1 = -Delta_i2, so Sigma has rank <= N,
  and with N <= D (the global batch against the predictor's width: the synthetic, CIFAR and ImageNet
  presets, and the supplement's own BYOL setting) every Delta sits at the same Mahalanobis distance
  N/2 under the pseudo-inverse, so every weight is exactly 1 and UOTA silently is its base objective
  with the loss unchanged. Shrinkage keeps the distance a Mahalanobis distance where the data
  determines Sigma and makes it Euclidean where it does not; the intensity is estimated from the
  batch, no new hyperparameter. `objective.shrinkage=none` is the pseudo-code's exact inverse (a
  pseudo-inverse when singular) and refuses, in one line, a setup where it is degenerate.
- Sigma is divided by M N, the public code's scale, not by N as the pseudo-code writes: Table S.1's
  tau (200 BYOL, 250 MoCo-v2*) and Table S.3's sensitivity (UOTA helps for tau in 50-400 and turns
  one-hot below about 50) fit only that scale (under Sigma / N the same tau is M times flatter: with
  M = 8 and D = 128 the mean squared distance is at most 16, so tau = 200 leaves every weight within
  a few percent of 1).
- N_warm is a share of the run (`objective.warmup`, default 0.1: the paper's 20 of 200 epochs), so
  that a short run reweights too; `objective.warmup_epochs >= 0` gives it in epochs instead.
- The weights are computed over the batch gathered from all ranks (one Sigma and one
  normalisation for the global batch), so DDP equals the single-process run.
- Per-view sub-losses of a multi-crop view are averaged over the global target views other than
  itself, so that each trainable feature z_ij carries exactly one weight w_ij.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch
from pipelines.views import load_recipe
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_nograd_local_first, regression_loss

UOTABase = Literal["byol", "mocov2star"]
BASES: tuple[str, ...] = typing.get_args(UOTABase)
Shrinkage = Literal["ledoit_wolf", "none"]


def ledoit_wolf(delta: Tensor) -> tuple[Tensor, float]:
    """The Ledoit-Wolf shrinkage of the covariance of the rows of `delta` (already centred):
    S = delta^T delta / K shrunk toward mu I, mu = tr S / D, with intensity
    alpha = min(beta2, delta2) / delta2, delta2 = ||S - mu I||^2, beta2 = sum_k ||d_k d_k^T - S||^2 / K^2
    (Ledoit & Wolf 2004, Lemma 3.1 and Sec. 3.3, norms ||A||^2 = tr(A A^T) / D).

    Args:
        delta: (K, D) centred rows (float32 or float64).

    Returns:
        ((D, D) (1 - alpha) S + alpha mu I, alpha in [0, 1]).
    """
    k, d = delta.shape
    s = delta.T @ delta / k                                             # (D, D)
    mu = torch.trace(s) / d
    eye = torch.eye(d, dtype=s.dtype, device=s.device)
    d2 = ((s - mu * eye) ** 2).sum() / d
    sq = (delta * delta).sum(1)                                          # (K,) ||d_k||^2
    # ||d d^T - S||^2 = ||d||^4 - 2 d^T S d + ||S||^2, summed over the rows
    b2 = ((sq ** 2).sum() - 2 * ((delta @ s) * delta).sum() + k * (s ** 2).sum()) / (d * k * k)
    alpha = 1.0 if float(d2) <= 0 else float(torch.clamp(b2, min=0).clamp(max=d2) / d2)
    return (1 - alpha) * s + alpha * mu * eye, alpha


@torch.no_grad()
def uota_weights(z: Tensor, tau: float, shrinkage: str = "ledoit_wolf", sigma_scale: str = "mn") -> Tensor:
    """UOTA outlier weights of every trainable feature (supplement Sec. 2, W(); module docstring,
    Deviations).

    Args:
        z: (M, N, D) trainable features: M views (sub-losses) of N samples, raw.
        tau: UOTA temperature, > 0 (200-350 in Table S.1, on the `sigma_scale="mn"` scale).
        shrinkage: "ledoit_wolf" (`ledoit_wolf`) or "none" (the exact inverse, a pseudo-inverse
            when Sigma is singular).
        sigma_scale: "mn": Sigma = sum Delta Delta^T / (M N) (the public code's); "n": / N (the
            pseudo-code's).

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
        if shrinkage == "ledoit_wolf":
            sigma, _ = ledoit_wolf(delta)                              # (D, D) over M*N rows
            sigma_inv = torch.linalg.inv(sigma)                        # positive definite
        else:
            sigma = delta.T @ delta / (m * n)                          # (D, D)   Eq. (M.10)
            sigma_inv = torch.linalg.pinv(sigma, hermitian=True)
        if sigma_scale == "n":                                         # Sigma / N = M x (Sigma / MN)
            sigma_inv = sigma_inv / m
        dist2 = ((delta @ sigma_inv) * delta).sum(dim=1) / tau         # (M*N,) Mahalanobis / tau
    # exp(-(d - min d)) differs from exp(-d) by one constant factor, which the normalisation
    # removes; the shift keeps the largest weight at 1 so that no batch underflows to 0/0.
    w = torch.exp(-(dist2 - dist2.min()))                              # Eq. (M.9)
    w = w / w.sum() * (m * n)                                          # Eq. (M.11), mean 1
    return w.reshape(m, n).to(z.dtype)                                 # (M, N)


def degenerate(views: int, batch: int, width: int) -> bool:
    """Whether the pseudo-code's Sigma (no shrinkage) makes every weight 1: its pseudo-inverse puts all
    M N deviations at one distance when their span is the whole of it, i.e. when the global `batch`
    N times (M - 1) (the rank of M deviations per sample summing to 0) is at most the `width` D."""
    return batch * (views - 1) <= width


@dataclass(frozen=True)
class UOTAConfig:
    base: UOTABase = "byol"     # base objective: "byol" (Eq. S.6) | "mocov2star" (Eq. S.5)
    tau: float = 200.0          # UOTA temperature on the code's Sigma / (M N) (Table S.1: 200 BYOL, 250 MoCo-v2*)
    shrinkage: Shrinkage = "ledoit_wolf"  # Sigma shrunk toward a scaled identity; "none": the pseudo-code's
    warmup: float = 0.1         # N_warm as a share of the run: the base objective alone until then (20 of 200 epochs)
    warmup_epochs: float = -1.0 # >= 0: N_warm in epochs instead (Table S.1: 20)
    moco_tau: float = 0.2       # MoCo-v2* softmax temperature t
    queue_size: int = 65536     # MoCo-v2* negatives kept in the queue
    dim: int = 0                # queue width; 0: the projector's output (model.proj_out)
    seed: int = 0               # seed of the random initial queue
    key_momentum: float = 0.999 # MoCo-v2* key encoder: MoCo v2's fixed EMA momentum

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"objective.base={self.base!r} is unknown; choose one of {', '.join(BASES)}")
        check_positive(self, "tau", "moco_tau")
        if self.queue_size < 1 or self.dim < 0:
            raise ValueError("objective.queue_size must be >= 1 and objective.dim >= 0 (0: model.proj_out)")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"objective.warmup is a share of the run in [0, 1), got {self.warmup}; set objective.warmup=0.1")
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
        if not self.reweights(s):
            return LossOut(loss=base, logs=logs, state=state)
        b = p.shape[1]
        p_all = gather_nograd_local_first(p.transpose(0, 1))               # (M, V, D)
        w_all = uota_weights(p_all.transpose(0, 1), self.cfg.tau, self.cfg.shrinkage)   # (V, M)
        w = w_all[:, :b]                                                   # (V, B) this rank
        loss = (w * per_view).mean()                                       # Eq. (M.12)
        logs["loss/uota"] = loss.detach()
        logs.update({"uota/w_std": w_all.std(), "uota/w_max": w_all.max(), "uota/w_min": w_all.min()})
        return LossOut(loss=loss, logs=logs, state=state)

    def reweights(self, s: StepValues) -> bool:
        """Whether step `s` is past N_warm (`warmup`, a share of the run, or `warmup_epochs`)."""
        if self.cfg.warmup_epochs >= 0:
            return s.epoch >= self.cfg.warmup_epochs
        return s.step >= self.cfg.warmup * s.total_steps

    def describe(self, total_steps: int, steps_per_epoch: int) -> str:
        """When the reweighting starts, said once at the start of a run."""
        first = (math.ceil(self.cfg.warmup_epochs * steps_per_epoch) if self.cfg.warmup_epochs >= 0
                 else math.ceil(self.cfg.warmup * total_steps))
        return (f"uota: the base objective ({self.cfg.base}) alone until step {first} of {total_steps}, "
                f"outlier weights from there on (uota/w_std, uota/w_max in the log)")

    @classmethod
    def resolve(cls, cfg) -> UOTAConfig:
        """The objective config for the run `cfg`: the queue as wide as the projector; a setup where
        the pseudo-code's Sigma (no shrinkage) gives every weight 1 is refused.

        Raises:
            ValueError: `objective.shrinkage=none` in a degenerate setup (`degenerate`).
        """
        o = cfg.objective
        if o.dim == 0:
            o = dataclasses.replace(o, dim=cfg.model.proj_out)
        recipe = load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px)
        views = sum(g.count for g in recipe.by_role("global", "local")) if o.base == "mocov2star" else 2
        width = cfg.model.proj_out
        if o.shrinkage == "none" and degenerate(views, cfg.data.batch_size, width):
            raise ValueError(f"objective.shrinkage=none with a global batch of {cfg.data.batch_size} and {views} views "
                             f"of width {width}: every UOTA weight would be exactly 1; use objective.shrinkage=ledoit_wolf "
                             f"or a batch above {width // (views - 1)}")
        return o

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
