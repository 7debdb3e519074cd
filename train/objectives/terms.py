"""Loss terms shared by several objectives: BYOL regression, InfoNCE forms and gathering helpers.

Conventions of every function here:
- inputs are raw (un-normalised) embeddings; each function L2-normalises what the paper compares
  by cosine similarity;
- targets produced by an EMA target network are detached inside the function (the target network
  never receives gradient);
- a "gathered" tensor is (M, D) with M = world_size * B, rotated by `local_first` so that this
  rank's B rows come first. In a single process M = B and nothing moves, so the index of a
  sample's positive is simply its own row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from train import dist


def local_first(x: Tensor, b: int) -> Tensor:
    """Rotate a gathered tensor so that this rank's rows come first.

    Softmax denominators over all M rows do not depend on the order of the rows, so the losses
    can index positives as rows 0..B-1 whatever the rank.

    Args:
        x: (M, ...) tensor gathered in rank order, M = world_size * b.
        b: rows per rank.

    Returns:
        (M, ...) tensor with rows rank*b .. rank*b+b-1 first, then the others in cyclic order.
    """
    r = dist.rank()
    if r == 0:
        return x
    return torch.roll(x, shifts=-r * b, dims=0)                # (M, ...)


def gather_local_first(x: Tensor) -> Tensor:
    """`dist.gather` (keeps the graph) followed by `local_first`. (B, ...) -> (M, ...)."""
    return local_first(dist.gather(x), x.shape[0])


def gather_nograd_local_first(x: Tensor) -> Tensor:
    """`dist.gather_nograd` followed by `local_first`; the result is detached. (B, ...) -> (M, ...)."""
    return local_first(dist.gather_nograd(x.detach()), x.shape[0])


def regression_loss(p: Tensor, z: Tensor) -> Tensor:
    """BYOL's normalised regression loss 2 - 2 cos(p, sg[z]) per sample.

    (Grill et al., arXiv:2006.07733v3, Eq. 2; RSA Eq. 2.)

    Args:
        p: (..., D) online predictions, raw.
        z: (..., D) targets, raw; detached here.

    Returns:
        (...) tensor of per-sample losses in [0, 4].
    """
    return 2.0 - 2.0 * F.cosine_similarity(p, z.detach(), dim=-1)


def byol_loss(p1: Tensor, p2: Tensor, z1: Tensor, z2: Tensor) -> Tensor:
    """Symmetrised BYOL loss: mean over the batch of L(p1, sg z2) + L(p2, sg z1).

    Args:
        p1, p2: (B, D) online predictor outputs of views 1 and 2.
        z1, z2: (B, D) target projections of views 1 and 2.

    Returns:
        Scalar loss in [0, 8].
    """
    return (regression_loss(p1, z2) + regression_loss(p2, z1)).mean()


def soft_info_nce(q: Tensor, k: Tensor, w: Tensor, tau: float) -> Tensor:
    """InfoNCE with soft positive weights (cross-entropy against a soft label).

    l_i = -sum_j w_ij * log softmax_j(q_i . k_j / tau), averaged over i.
    With w = one-hot this is standard InfoNCE.

    Args:
        q: (B, D) L2-normalised queries.
        k: (M, D) L2-normalised keys, M >= B.
        w: (B, M) non-negative weights whose rows sum to 1.
        tau: temperature, > 0.

    Returns:
        Scalar loss.
    """
    logits = q @ k.T / tau                                   # (B, M)
    return -(w * logits.log_softmax(dim=1)).sum(dim=1).mean()


def moco_ctr(q: Tensor, k: Tensor, tau: float) -> Tensor:
    """MoCo v3 contrastive term ctr(q, k) = 2 tau * CE(q k^T / tau, positives on the diagonal).

    (Chen, Xie, He, arXiv:2104.02057v4, Algorithm 1.)

    Args:
        q: (B, D) online predictor outputs, raw.
        k: (M, D) target projections, raw, gathered local-first (positive of q_i is k_i); detached.
        tau: temperature, > 0.

    Returns:
        Scalar loss.
    """
    q = F.normalize(q, dim=1)
    k = F.normalize(k.detach(), dim=1)
    logits = q @ k.T / tau                                   # (B, M)
    labels = torch.arange(q.shape[0], device=q.device)
    return 2.0 * tau * F.cross_entropy(logits, labels)


def nt_xent_local(a1: Tensor, a2: Tensor, c1: Tensor, c2: Tensor, tau: float) -> Tensor:
    """NT-Xent of this rank's 2B anchors against the 2M gathered candidates.

    For anchor a1_i the positive is c2_i and the denominator runs over all 2M candidates except
    the anchor itself (c1_i); symmetrically for a2_i. Averaged over the 2B anchors. With
    a = c (one process) this is exactly `nt_xent`.

    Args:
        a1, a2: (B, D) this rank's embeddings of the two positives, raw.
        c1, c2: (M, D) the same embeddings gathered local-first (rows 0..B-1 are a1, a2), raw.
        tau: temperature, > 0.

    Returns:
        Scalar loss.
    """
    b, m = a1.shape[0], c1.shape[0]
    a = F.normalize(torch.cat([a1, a2]), dim=1)              # (2B, D)
    c = F.normalize(torch.cat([c1, c2]), dim=1)              # (2M, D)
    logits = a @ c.T / tau                                   # (2B, 2M)
    rows = torch.arange(2 * b, device=a.device)
    own = torch.cat([rows[:b], rows[:b] + m])                # column of each anchor itself
    pos = torch.cat([rows[:b] + m, rows[:b]])                # column of its positive
    # The anchor is not its own candidate: -inf on its column (out of place, autograd-safe).
    logits = logits.index_put((rows, own), logits.new_tensor(float("-inf")))
    return F.cross_entropy(logits, pos)


def nt_xent(z1: Tensor, z2: Tensor, tau: float) -> Tensor:
    """SimCLR's normalised temperature-scaled cross-entropy over 2N samples.

    L = 1/(2N) sum_k [l(2k-1, 2k) + l(2k, 2k-1)],
    l(i, j) = -log exp(s_ij / tau) / sum_{k != i} exp(s_ik / tau), s = cosine similarity
    (DACL arXiv:2011.04419, Algorithm 1 lines 17-21; SimCLR arXiv:2002.05709v3, Eq. 1).

    Args:
        z1, z2: (N, D) raw embeddings of the two positives of each sample.
        tau: temperature, > 0.

    Returns:
        Scalar loss.
    """
    return nt_xent_local(z1, z2, z1, z2, tau)
