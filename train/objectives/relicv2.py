"""RELICv2: contrastive likelihood plus KL invariance over sampled negatives, multi-crop.

Paper: "Pushing the limits of self-supervised ResNets: Can we outperform supervised learning
without labels on ImageNet?", Tomasev et al., arXiv:2201.05119 (the version is not printed in the
paper text the project follows; equation numbers below are those of that text).
Implemented: Eq. (1) likelihood with |N(x_i)| = n_e negatives sampled uniformly from the batch
(Sec. 2, App. D.3), Eq. (2) KL invariance with the stop-gradient on the entropy term, Eq. (3)
combination with alpha, beta, and the multi-crop pairing of Listing 1 (every online crop, large
and small, against every large target crop, divided by (n_large + n_small) * n_large).
Reference code: none published with the paper (unknown).

Online and target networks have the same form (encoder + comparison network, Listing 1): the method
preset sets no predictor (`model.pred_hidden: 0`); a predictor, if one is configured, is a
deviation and is used on the online side.

Loss weights: alpha = 0.3 and beta = 2.0, App. C.1's "contrast scale" and "invariance scale" of the
JFT-300M runs (1000 and 5000 epochs; 1.0 at 3000), the only values the paper states; it gives none
for ImageNet. tau = 0.2 from the same appendix; the ImageNet schedule is Sec. 3's (LARS, cosine, 1000
epochs, 10 of warm-up).

Target EMA: one momentum gamma for the whole run, xi_t = gamma xi_{t-1} + (1 - gamma) theta_t (App. D,
"Target EMA"; Listing 1 takes `gamma` as a fixed input, line 45), not BYOL's cosine schedule to 1: Table 17
sweeps fixed values only (0.9 to 0.996 alike; "for values of gamma of 0.999 and higher, the performance
quickly degrades"), and App. C.1 sets it to 0.996: `objective.gamma`, 0.996 by default (the `synthetic`
preset's short CPU runs hold 0.96, its EMA start); `optim.ema_start` and `optim.ema_end` do not apply.

Deviations:
- Embeddings are L2-normalised before the inner product of phi_tau (the paper leaves it implicit;
  RELIC and BYOL normalise).
- Negatives are drawn once per step and shared by all crop pairs (Listing 1 calls the loss with
  n_e per pair and does not say whether the draw is shared).
- The swapped likelihood p(x+; x) of Eq. (2) uses the same candidate set with the roles of online
  and target exchanged: softmax over c of <online_c, target_i>/tau (DESIGN §5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch
from train import dist
from train.objectives.base import LossOut, Objective, StepValues, ViewNeeds, check_positive
from train.objectives.terms import gather_local_first, gather_nograd_local_first


def relic_loss(online: Tensor, target: Tensor, neg_idx: Tensor, tau: float, alpha: float,
               beta: float) -> Tensor:
    """RELICv2 loss of one (online crop, target crop) pair, Eqs. (1)-(3), mean over anchors.

    For anchor i the candidates are c in {i} + neg_idx[i] (the positive first).
    row_i(c)  = softmax_c <online_i, target_c> / tau     -> p(x_i; x_i^+)   (Eq. 1)
    col_i(c)  = softmax_c <online_c, target_i> / tau     -> p(x_i^+; x_i)
    loss_i    = -alpha log row_i(i) + beta (sg[sum_c row log row] - sum_c row log col)  (Eqs. 2-3)
    The target network gets no gradient (target is detached here).

    Args:
        online: (M, D) online outputs, raw, gathered local-first (rows 0..B-1 are the anchors).
        target: (M, D) target outputs of the paired crop, raw, gathered local-first.
        neg_idx: (B, n_e) int64 rows of the negatives of each anchor, in [0, M), never the anchor.
        tau: temperature, > 0.
        alpha: weight of the contrastive term.
        beta: weight of the KL invariance term.

    Returns:
        Scalar loss.
    """
    b = neg_idx.shape[0]
    o = F.normalize(online, dim=1)
    t = F.normalize(target.detach(), dim=1)
    anchors = torch.arange(b, device=o.device)
    cand = torch.cat([anchors[:, None], neg_idx], dim=1)                 # (B, 1 + n_e)
    # Full (B, M) similarity products, then a gather of the candidates: measured 104 ms -> 29 ms
    # (forward + backward, 24 crop pairs, B = M = 256, D = 128, 2 CPU threads) against indexing
    # (B, 1 + n_e, D) embedding blocks, whose backward is a slow scatter-add.
    row = (o[:b] @ t.T / tau).gather(1, cand)                          # (B, 1 + n_e)
    col = (t[:b] @ o.T / tau).gather(1, cand)                          # (B, 1 + n_e)
    log_row = row.log_softmax(dim=1)
    log_col = col.log_softmax(dim=1)
    p_row = log_row.exp()
    contrastive = -log_row[:, 0]
    kl = (p_row * log_row).sum(dim=1).detach() - (p_row * log_col).sum(dim=1)   # Eq. (2)
    return (alpha * contrastive + beta * kl).mean()


def relicv2_multicrop_loss(online_large: list[Tensor], online_small: list[Tensor],
                           target_large: list[Tensor], neg_idx: Tensor, tau: float, alpha: float,
                           beta: float) -> Tensor:
    """Listing 1 pairing: every online crop against every large target crop, scaled.

    Args:
        online_large: n_large tensors (M, D) of online outputs of the large crops, local-first.
        online_small: n_small tensors (M, D) of online outputs of the small crops, local-first.
        target_large: n_large tensors (M, D) of target outputs of the large crops, local-first.
        neg_idx: (B, n_e) negatives of each anchor (see `relic_loss`).
        tau, alpha, beta: as in `relic_loss`.

    Returns:
        Scalar loss: sum over pairs of `relic_loss` / ((n_large + n_small) * n_large).
    """
    if not target_large:
        raise ValueError("relicv2_multicrop_loss needs at least one large target crop")
    loss = online_large[0].new_zeros(())
    for o in [*online_large, *online_small]:
        for t in target_large:
            loss = loss + relic_loss(o, t, neg_idx, tau, alpha, beta)
    return loss / ((len(online_large) + len(online_small)) * len(target_large))


def sample_negatives(m: int, n_e: int, generator: torch.Generator) -> Tensor:
    """Draw n_e distinct negatives per anchor uniformly among the other m-1 samples.

    Robert Floyd's algorithm, vectorised over anchors: exact uniform sampling without replacement
    in n_e steps of O(m) work (a full (m, m) shuffle would cost O(m^2 log m) per step).

    Args:
        m: samples in the (gathered) batch, > n_e.
        n_e: negatives per anchor, >= 1.
        generator: CPU generator; the same seed gives the same table on every rank.

    Returns:
        (m, n_e) int64 on CPU; row i holds distinct indices in [0, m) without i.
    """
    if m - 1 < n_e:
        raise ValueError(f"relicv2 needs more than num_negatives={n_e} samples in the global batch, "
                         f"got {m}; lower objective.num_negatives or raise data.batch_size")
    pop = m - 1                                                          # offsets 1..m-1
    chosen = torch.empty(m, n_e, dtype=torch.int64)
    for k, j in enumerate(range(pop - n_e, pop)):
        t = torch.randint(0, j + 1, (m,), generator=generator)
        dup = (chosen[:, :k] == t[:, None]).any(dim=1)
        chosen[:, k] = torch.where(dup, torch.full_like(t, j), t)
    return (torch.arange(m)[:, None] + 1 + chosen) % m                   # (m, n_e)


@dataclass(frozen=True)
class ReLICv2Config:
    tau: float = 0.2            # temperature of phi_tau (JFT setting, App. C.1)
    alpha: float = 0.3          # weight of the contrastive term, Eq. (3): App. C.1's "contrast scale"
    beta: float = 2.0           # weight of the KL invariance term, Eq. (3): App. C.1's "invariance scale"
    num_negatives: int = 10     # n_e, negatives sampled per anchor (Sec. 2)
    seed: int = 0               # base seed of the negative draws (seed + step)
    gamma: float = 0.996        # target EMA momentum, one for the whole run (App. D; 0.996: App. C.1)

    def __post_init__(self) -> None:
        check_positive(self, "tau")
        if self.num_negatives < 1:
            raise ValueError(f"objective.num_negatives must be >= 1, got {self.num_negatives}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"objective.gamma must be in [0, 1], got {self.gamma}; App. C.1 sets 0.996")


class ReLICv2(Objective):
    """RELICv2: 4 large crops (`global_views`, saliency-masked by the pipeline) and 2 small crops.

    Online: all crops; target: the large crops only. Negatives are drawn from the gathered batch
    with a generator seeded by `seed + s.step`, so the draw is reproducible and the same on all
    ranks.
    """

    Config = ReLICv2Config
    needs = ViewNeeds(global_views=4, local=2, target=True)

    def target_momentum(self, s: StepValues) -> float:
        """App. D's one gamma at every step (not the cosine schedule `s.ema` of BYOL)."""
        return self.cfg.gamma

    def describe(self, total_steps: int, steps_per_epoch: int) -> str:
        """The start line: the one momentum this run's target moves with."""
        return (f"relicv2: target EMA momentum {self.cfg.gamma} at every step (App. D's one gamma: objective.gamma; "
                "optim.ema_start and optim.ema_end do not apply)")

    def forward(self, online: nn.Module, target: nn.Module, batch: Batch, s: StepValues) -> LossOut:
        """Loss of one step from the views in `batch`; reads no state, changes none."""
        groups = [batch.global_views] if batch.local_views is None else [batch.global_views,
                                                                         batch.local_views]
        embs = online(groups)
        with torch.no_grad():
            (tgt,) = target([batch.global_views])
        b = batch.global_views.shape[1]
        online_large = [gather_local_first(p) for p in embs[0].p]          # Vg x (M, D)
        online_small = [gather_local_first(p) for p in embs[1].p] if len(embs) > 1 else []
        target_large = [gather_nograd_local_first(z) for z in tgt.z]       # Vg x (M, D)
        m = online_large[0].shape[0]
        gen = torch.Generator().manual_seed(self.cfg.seed + s.step)
        neg_all = sample_negatives(m, self.cfg.num_negatives, gen)         # (M, n_e) global rows
        r = dist.rank()
        neg_idx = (neg_all[r * b:(r + 1) * b] - r * b) % m                 # (B, n_e) local-first rows
        neg_idx = neg_idx.to(online_large[0].device, non_blocking=True)
        loss = relicv2_multicrop_loss(online_large, online_small, target_large, neg_idx,
                                      self.cfg.tau, self.cfg.alpha, self.cfg.beta)
        return LossOut(loss=loss, logs={"loss/relicv2": loss.detach()})
