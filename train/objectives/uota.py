"""UOTA: Mahalanobis outlier weights on the per-view losses of a multi-crop base objective.

Paper: "Improving Self-supervised Learning with Automated Unsupervised Outlier Arbitration",
Wang et al., NeurIPS 2021, arXiv:2112.08132 (the version is not printed in the supplement text
the project follows; equation numbers below are those of that text, "M" = main paper).
Implemented: the supplement's Sec. 2 pseudo-code W(multi_z, tau) — mu_i = mean over the M views
(Eq. M.10), Sigma from the deviations (Eq. M.10), w = exp(-Delta^T Sigma^-1 Delta / tau) (Eq. M.9),
normalised to mean 1 (Eq. M.11), no gradient — and the weighted losses Eq. (M.12) as expanded for
MoCo-v2* (Eq. S.5) and BYOL (Eq. S.6); the base objective alone for the first N_warm of the run
(Sec. S.5: 20 of 200 epochs).
Reference code: https://github.com/ssl-codelab/uota (commit c5b0597; SwAV+UOTA only, `src/uota.py`).

Setups (Sec. S.5: "exactly the same augmentation policy as what the baseline model X published"):
- BYOL+UOTA (the default, `uota.yaml`): BYOL's own two views (`views.recipe: byol`), its predictor and
  cosine EMA target; M = 2 trainable features per sample. With M = 2 the two deviations of a sample
  are opposite (Delta_i1 = -Delta_i2), so both views of a sample are at one distance and share one
  weight: UOTA reweights samples here, not views.
- MoCo-v2*+UOTA (`objective.base=mocov2star views.recipe=multicrop8 model.pred_hidden=0
  model.proj_out=128`): SwAV's multi-crop, 2 + 6 views with SwAV's colour law (`multicrop8`), M = 8,
  MoCo v2's 128-d embedding; the queries are the projector outputs (MoCo v2 has no predictor: `emb.z`,
  whatever `model.pred_hidden` says), the queue is as wide as the projector, and the key encoder
  follows MoCo v2's fixed momentum `objective.key_momentum` (0.999), not BYOL's cosine schedule.

tau (`objective.tau`; 0, the default, takes the base's `TAU`): Table S.1 prints its tau row as 200
(beside the row's name) and then 200, 250, 200, four values for its four models in order: MoCo-v2+UOTA
200, MoCo-v2*+UOTA 200, BYOL+UOTA 250, SwAV+UOTA 200. MoCo-v2*+UOTA with 8 views has 200 in Table S.3
(number of views) and Table S.4 (global Sigma and mu_i, the Table M.2 setup) too. The range in which
UOTA helps (tau 50-400, flat above about 350, one-hot weights below about 50) is Sec. S.3 / Fig. S.1,
not a table.

Sigma's estimate (`objective.shrinkage`, default "auto"):
- "auto": the paper's Sigma and its exact inverse wherever the batch determines Sigma, i.e. where the
  N (M - 1) independent deviations (M per sample summing to 0) outnumber the width D; Ledoit and
  Wolf's shrinkage (below) only where they do not (`degenerate`). There the pseudo-code's Sigma is
  singular, and under its pseudo-inverse the deviations span the whole of it and every one sits at
  the same distance N (M - 1), so every weight is exactly 1 and UOTA silently is its base objective.
  Which presets that is: BYOL+UOTA on `synthetic` (global batch 64 against the 128-d predictor) and
  on `imagenet` with one GPU (256 against 256); not CIFAR (512 > 256), not `imagenet` on 2 GPUs or
  more, not MoCo-v2* on any preset (64 x 7 > 128). The start of a run says which estimate it uses.
  The paper's own BYOL+UOTA setting (Sec. S.5: N = 128 against BYOL's D = 256, M = 2) is degenerate
  too: under its exact inverse every weight there is 1. So the Ledoit-Wolf branch is this project's
  extension, not the paper's; what the paper reports for BYOL+UOTA cannot come from its pseudo-code's
  Sigma at that batch.
- "none": the exact inverse everywhere (refused, in one line, where it is degenerate);
- "ledoit_wolf": the shrinkage everywhere.
The exact inverse is taken in float64 over the eigen-directions of Sigma above 1e-6 of its mean
eigenvalue (below that, float32 features carry no information: this is the public code's ridge of
1e-8 on unit features, in relative terms); it is the plain inverse wherever Sigma is well-posed.

Deviations:
- The trainable features are L2-normalised before mu and Sigma, as the public code does and as every
  base compares them (BYOL's loss and MoCo v2's query are on the unit sphere; Eqs. S.5-S.6 write
  z_ij for the feature the loss sees). The pseudo-code's raw features would let the norm of a
  prediction, which no base's loss reads, decide its weight.
- Sigma is divided by M N, the public code's scale, not by N as the pseudo-code writes. Under the
  exact inverse this makes the mean squared distance exactly rank(Sigma) (= D at full rank: 128 for
  MoCo-v2*), whatever mu and the normalisation, which is the scale on which Fig. S.1's tau range
  behaves as Sec. S.3 describes (under Sigma / N the mean is D / M = 16 for 8 views, and tau = 50
  could never make the weights one-hot).
- mu_i is the mean of all M views, as the pseudo-code and Eq. (M.10) define it; the public code takes
  it from the two global crops, which puts the six local crops farther from it and weights them as
  a group (on MoCo-v2* features about 0.9 on average against 1.0 here). So the shipped tau is the
  paper's number on the paper's mu, on the code's scale; the spread it gives is logged
  (`uota/w_std`).
- Ledoit-Wolf (where it is used): S shrunk toward (tr S / D) I with the optimal intensity of
  "A well-conditioned estimator for large-dimensional covariance matrices", J. Multivariate Anal.
  2004 (Lemma 3.1, Sec. 3.3), with the samples as the independent draws: the M rows of a sample are
  not independent (they sum to 0; with M = 2 they are one row and its negative), and counting them
  as M N draws would halve the intensity at M = 2. No new hyperparameter; `uota/shrink` logs it (0
  under the exact inverse), `uota/d2` the mean squared distance the weights come from.
- N_warm is a share of the run (`objective.warmup`, default 0.1: the paper's 20 of 200 epochs), so
  that a short run reweights too; `objective.warmup_epochs >= 0` gives it in epochs instead.
- ImageNet-1k (`data/imagenet.yaml`) runs the BYOL base's own recipe (1000 epochs, LARS lr 0.2, EMA
  0.996): Sec. S.5 trains "X+UOTA" with X's pipeline, and its BYOL+UOTA numbers are ImageNet-100 with
  ResNet-18 (200 epochs, lr 0.6 tuned there), a setting the ImageNet-1k preset does not claim.
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
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch
from pipelines.views import load_recipe
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_nograd_local_first, regression_loss

UOTABase = Literal["byol", "mocov2star"]
BASES: tuple[str, ...] = typing.get_args(UOTABase)
Shrinkage = Literal["auto", "ledoit_wolf", "none"]
EIGEN_FLOOR = 1e-6              # eigenvalues of Sigma below this share of the mean one count as 0


def ledoit_wolf(delta: Tensor) -> tuple[Tensor, Tensor]:
    """The Ledoit-Wolf shrinkage of the covariance of the deviations `delta`, one draw per sample:
    S = sum_ij d_ij d_ij^T / (M N) = mean_i S_i with S_i = sum_j d_ij d_ij^T / M, shrunk toward
    mu I, mu = tr S / D, with intensity alpha = min(beta2, delta2) / delta2, delta2 = ||S - mu I||^2,
    beta2 = sum_i ||S_i - S||^2 / N^2 (Ledoit & Wolf 2004, Lemma 3.1 and Sec. 3.3, norms
    ||A||^2 = tr(A A^T) / D, the N samples as the independent draws). With M = 1 this is the paper's
    estimator over N rows; with M = 2 (d_i2 = -d_i1) the one over the N rows d_i1.

    Args:
        delta: (M, N, D) deviations of the M views of each of N samples from their mean (float64).

    Returns:
        ((D, D) (1 - alpha) S + alpha mu I, alpha: a 0-dim tensor in [0, 1]).
    """
    m, n, d = delta.shape
    rows = delta.reshape(m * n, d)                                      # (M*N, D)
    s = rows.T @ rows / (m * n)                                         # (D, D)
    mu = torch.trace(s) / d
    eye = torch.eye(d, dtype=s.dtype, device=s.device)
    d2 = ((s - mu * eye) ** 2).sum() / d
    gram = torch.einsum("jnd,knd->njk", delta, delta)                   # (N, M, M) d_ij . d_ik
    # ||S_i - S||^2 = ||S_i||^2 - 2 <S_i, S> + ||S||^2, with ||S_i||^2 = sum_jk (d_ij . d_ik)^2 / M^2
    # and <S_i, S> = sum_j d_ij^T S d_ij / M
    own = (gram ** 2).sum(dim=(1, 2)) / m ** 2                          # (N,)
    cross = ((delta @ s) * delta).sum(dim=(0, 2)) / m                   # (N,)
    b2 = (own - 2 * cross + (s ** 2).sum()).sum() / (d * n * n)
    alpha = torch.where(d2 > 0, b2.clamp(min=0).minimum(d2) / d2.clamp(min=torch.finfo(d2.dtype).tiny),
                        torch.ones_like(d2))
    return (1 - alpha) * s + alpha * mu * eye, alpha


def degenerate(views: int, batch: int, width: int) -> bool:
    """Whether the pseudo-code's Sigma is singular for `views` M per sample, a global `batch` N and
    features of `width` D: its N (M - 1) independent deviations (M per sample summing to 0) do not
    outnumber D, so its pseudo-inverse puts every deviation at the same distance N (M - 1) and every
    weight is 1 (module docstring)."""
    return batch * (views - 1) <= width


class UOTAWeights(NamedTuple):
    """The weights of one batch and what they came from (no gradient)."""

    w: Tensor           # (M, N) non-negative, mean 1, in the dtype of the features
    shrink: Tensor      # 0-dim Ledoit-Wolf intensity; 0 under the exact inverse
    d2: Tensor          # 0-dim mean squared Mahalanobis distance (before / tau)


@torch.no_grad()
def uota_weights(z: Tensor, tau: float, shrinkage: str = "auto", sigma_scale: str = "mn") -> UOTAWeights:
    """UOTA outlier weights of every trainable feature (supplement Sec. 2, W(); module docstring).

    Args:
        z: (M, N, D) trainable features: M views (sub-losses) of N samples, as given (the objective
            L2-normalises them first).
        tau: UOTA temperature, > 0 (200 in Tables S.1, S.3 and S.4, on the `sigma_scale="mn"` scale).
        shrinkage: "auto" (the exact inverse unless `degenerate`, then "ledoit_wolf"), "none" (the
            exact inverse; a pseudo-inverse where Sigma is singular) or "ledoit_wolf" (`ledoit_wolf`).
        sigma_scale: "mn": Sigma = sum Delta Delta^T / (M N) (the public code's); "n": / N (the
            pseudo-code's).

    Returns:
        `UOTAWeights`: (M, N) weights averaging 1, in the dtype of `z`, the shrinkage intensity and
        the mean squared distance.
    """
    m, n, d = z.shape
    # A float64 island: under the training step's bf16 autocast the matmuls below would run in bf16,
    # and a covariance and its inverse need the precision (M N x D and D x D: cheap next to the step).
    with torch.autocast(z.device.type, enabled=False):
        x = z.detach().to(torch.float64)
        delta = x - x.mean(dim=0, keepdim=True)                         # (M, N, D)   Eq. (M.10)
        if shrinkage == "auto":
            shrinkage = "ledoit_wolf" if degenerate(m, n, d) else "none"
        if shrinkage == "ledoit_wolf":
            sigma, alpha = ledoit_wolf(delta)                           # (D, D)
        else:
            rows = delta.reshape(m * n, d)
            sigma, alpha = rows.T @ rows / (m * n), x.new_zeros(())     # (D, D)   Eq. (M.10)
        evals, evecs = torch.linalg.eigh(sigma)                         # Sigma = V diag(evals) V^T
        keep = evals > EIGEN_FLOOR * evals.mean().clamp(min=0)
        inv = torch.where(keep, 1 / evals.clamp(min=torch.finfo(evals.dtype).tiny), torch.zeros_like(evals))
        if sigma_scale == "n":                                          # Sigma / N = M x (Sigma / MN)
            inv = inv / m
        proj = delta.reshape(m * n, d) @ evecs                          # (M*N, D) in Sigma's eigenbasis
        dist2 = (proj ** 2 * inv).sum(dim=1)                            # (M*N,) Mahalanobis
        # exp(-(d - min d)) differs from exp(-d) by one constant factor, which the normalisation
        # removes; the shift keeps the largest weight at 1 so that no batch underflows to 0/0.
        w = torch.exp(-(dist2 - dist2.min()) / tau)                     # Eq. (M.9)
        w = w / w.sum() * (m * n)                                       # Eq. (M.11), mean 1
    return UOTAWeights(w.reshape(m, n).to(z.dtype), alpha.to(z.dtype), dist2.mean().to(z.dtype))


# Table S.1's tau of each base (supplement Sec. S.5): BYOL+UOTA 250, MoCo-v2*+UOTA 200 (module docstring).
TAU = {"byol": 250.0, "mocov2star": 200.0}


@dataclass(frozen=True)
class UOTAConfig:
    base: UOTABase = "byol"     # base objective: "byol" (Eq. S.6) | "mocov2star" (Eq. S.5)
    tau: float = 0.0            # UOTA temperature on the code's Sigma / (M N); 0: the base's in Table S.1 (`TAU`)
    shrinkage: Shrinkage = "auto"  # "auto": exact inverse unless degenerate, then Ledoit-Wolf | "none" | "ledoit_wolf"
    warmup: float = 0.1         # N_warm as a share of the run: the base objective alone until then (20 of 200 epochs;
                                # 1: never reweighted, the base itself: the baseline row of `make compare`)
    warmup_epochs: float = -1.0 # >= 0: N_warm in epochs instead (Table S.1: 20)
    moco_tau: float = 0.2       # MoCo-v2* softmax temperature t
    queue_size: int = 65536     # MoCo-v2* negatives kept in the queue
    dim: int = 0                # queue width; 0: the projector's output (model.proj_out)
    seed: int = 0               # seed of the random initial queue
    key_momentum: float = 0.999 # MoCo-v2* key encoder: MoCo v2's fixed EMA momentum

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"objective.base={self.base!r} is unknown; choose one of {', '.join(BASES)}")
        check_positive(self, "moco_tau")
        if self.tau < 0:
            raise ValueError(f"objective.tau must be > 0, or 0 for Table S.1's value of the base; got {self.tau}")
        if self.queue_size < 1 or self.dim < 0:
            raise ValueError("objective.queue_size must be >= 1 and objective.dim >= 0 (0: model.proj_out)")
        if not 0.0 <= self.warmup <= 1.0:
            raise ValueError(f"objective.warmup is a share of the run in [0, 1], got {self.warmup}; set objective.warmup=0.1")
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
        # The feature each base's loss compares is the unit vector (module docstring, Deviations).
        p_all = gather_nograd_local_first(F.normalize(p.detach(), dim=-1).transpose(0, 1))   # (M, V, D)
        weights = uota_weights(p_all.transpose(0, 1), self.cfg.tau or TAU[self.cfg.base], self.cfg.shrinkage)
        w_all = weights.w                                                  # (V, M)
        w = w_all[:, :b]                                                   # (V, B) this rank
        loss = (w * per_view).mean()                                       # Eq. (M.12)
        logs["loss/uota"] = loss.detach()
        logs.update({"uota/w_std": w_all.std(), "uota/w_max": w_all.max(), "uota/w_min": w_all.min(),
                     "uota/shrink": weights.shrink, "uota/d2": weights.d2})
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
        sigma = {"auto": "Sigma's exact inverse where the global batch N x (M - 1) views exceeds the width D, "
                         "else Ledoit-Wolf", "none": "Sigma's exact inverse",
                 "ledoit_wolf": "Sigma shrunk by Ledoit-Wolf"}[self.cfg.shrinkage]
        return (f"uota: the base objective ({self.cfg.base}) alone until step {first} of {total_steps}, "
                f"outlier weights from there on ({sigma}; uota/w_std, uota/w_max, uota/shrink (0: exact "
                f"inverse) and uota/d2 in the log)")

    @classmethod
    def resolve(cls, cfg) -> UOTAConfig:
        """The objective config for the run `cfg`: the queue as wide as the projector; a setup where
        the exact inverse (`objective.shrinkage=none`) gives every weight 1 is refused.

        Raises:
            ValueError: `objective.shrinkage=none` in a degenerate setup (`degenerate`).
        """
        o = cfg.objective
        if o.dim == 0:
            o = dataclasses.replace(o, dim=cfg.model.proj_out)
        if o.tau == 0:
            o = dataclasses.replace(o, tau=TAU[o.base])
        recipe = load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px)
        views = sum(g.count for g in recipe.by_role("global", "local")) if o.base == "mocov2star" else 2
        width = cfg.model.proj_out
        if o.shrinkage == "none" and degenerate(views, cfg.data.batch_size, width):
            raise ValueError(f"objective.shrinkage=none with a global batch of {cfg.data.batch_size} and {views} views "
                             f"of width {width}: every UOTA weight would be exactly 1; use objective.shrinkage=auto "
                             f"(Ledoit-Wolf here) or a global batch above {width // (views - 1)}")
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
