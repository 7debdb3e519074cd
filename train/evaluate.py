"""Frozen-feature evaluation: weighted kNN and a linear probe on the val split.

kNN follows Wu et al. 2018 ("Unsupervised Feature Learning via Non-Parametric Instance
Discrimination", arXiv:1805.01978v1, Sec. 3.4) as used by DINO: cosine similarity, the k = 20
nearest train features vote for their class with weight exp(sim / T), T = 0.07.
The linear probe is multinomial logistic regression on standardised features, trained to
convergence with full-batch L-BFGS (deterministic, no augmentation).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch


@torch.no_grad()
def extract_features(backbone: nn.Module, batches: Iterable[Batch],
                     device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """Backbone features of the first global view of every batch, in eval mode.

    Returns:
        (feats (N, F) float32 on CPU, labels (N,) long, index (N,) long).
    """
    was_training = backbone.training
    backbone.eval()
    feats, labels, index = [], [], []
    for batch in batches:
        if batch.label is None:
            raise ValueError("evaluation needs labels: build its loader from a dataset with labels")
        x = batch.global_views[0].to(device, non_blocking=True)          # (B, 3, H, W)
        feats.append(backbone(x).float().cpu())                          # (B, F)
        labels.append(batch.label.cpu().long())
        index.append(batch.index.cpu().long())
    backbone.train(was_training)
    return torch.cat(feats), torch.cat(labels), torch.cat(index)


@torch.no_grad()
def knn_top1(train_feats: Tensor, train_labels: Tensor, val_feats: Tensor, val_labels: Tensor,
             num_classes: int, k: int = 20, temperature: float = 0.07, chunk: int = 1024) -> float:
    """Top-1 accuracy of the temperature-weighted kNN vote (cosine similarity).

    Args:
        train_feats: (N, F); train_labels: (N,) in [0, num_classes).
        val_feats: (M, F); val_labels: (M,).
        k: neighbours (capped at N); temperature: T in exp(sim / T).

    Returns:
        Accuracy in [0, 1].
    """
    train = F.normalize(train_feats.float(), dim=1)
    k = min(k, train.shape[0])
    correct = 0
    for start in range(0, val_feats.shape[0], chunk):
        q = F.normalize(val_feats[start:start + chunk].float(), dim=1)   # (m, F)
        sim, idx = (q @ train.T).topk(k, dim=1)                          # (m, k)
        votes = torch.zeros(q.shape[0], num_classes)
        votes.scatter_add_(1, train_labels[idx], (sim / temperature).exp())  # (m, C)
        correct += int((votes.argmax(1) == val_labels[start:start + chunk]).sum())
    return correct / max(1, val_feats.shape[0])


def linear_probe_top1(train_feats: Tensor, train_labels: Tensor, val_feats: Tensor,
                      val_labels: Tensor, num_classes: int, weight_decay: float = 1e-4,
                      max_iter: int = 300) -> float:
    """Top-1 accuracy of a linear classifier on standardised frozen features.

    Full-batch L-BFGS on the cross-entropy plus an L2 penalty, from zero weights: deterministic and
    run until the gradient is below tolerance or `max_iter` iterations.

    Returns:
        Accuracy in [0, 1] on the val features.
    """
    x = train_feats.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    x = (x - mean) / std                                                 # (N, F)
    xv = (val_feats.double() - mean) / std                               # (M, F)
    w = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, tolerance_grad=1e-7,
                            tolerance_change=1e-10, history_size=20, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(x @ w + b, train_labels) + weight_decay * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        pred = (xv @ w + b).argmax(1)
    return float((pred == val_labels).double().mean())


def evaluate(backbone: nn.Module, train_batches: Iterable[Batch], val_batches: Iterable[Batch],
             num_classes: int, device: torch.device | str) -> dict[str, float]:
    """kNN and linear-probe top-1 of `backbone` on the val split, fitted on the train split."""
    tr_f, tr_y, _ = extract_features(backbone, train_batches, device)
    va_f, va_y, _ = extract_features(backbone, val_batches, device)
    return {"knn_top1": knn_top1(tr_f, tr_y, va_f, va_y, num_classes),
            "linear_top1": linear_probe_top1(tr_f, tr_y, va_f, va_y, num_classes)}
