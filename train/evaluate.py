"""Frozen-feature evaluation on every rank: weighted kNN and a linear probe where the data has labels,
and label-free representation health everywhere.

kNN follows Wu et al. 2018 ("Unsupervised Feature Learning via Non-Parametric Instance
Discrimination", arXiv:1805.01978v1, its weighted k-nearest-neighbour classifier) as DINO uses it
(arXiv:2104.14294v2 and its eval_knn.py): cosine similarity s_i between the val feature and train feature i,
the k = 20 nearest train features vote for their class with weight exp(s_i / T), T = 0.07, and the
class with the largest summed weight wins.
The linear probe is multinomial logistic regression on features standardised with the train
mean/std: cross-entropy + l2 * ||W||^2 from zero weights. Up to `PROBE_LBFGS_MAX` (train rows x
feature width x classes) it is minimised full-batch with L-BFGS until the gradient vanishes (exact,
deterministic, seconds on a CPU); above, by mini-batch SGD on the training device
(`PROBE_SGD_EPOCHS` epochs of `PROBE_SGD_BATCH`, momentum 0.9, cosine learning rate, a seeded order:
deterministic too), whose cost grows linearly with the rows instead of L-BFGS's ~1,000 full passes.

Health (computed on the held-out val images, with or without labels):
- `rankme`: the effective rank of the features, exp of the entropy of their normalised singular
  values (Garrido et al., "RankMe", arXiv:2210.02885v3, Eq. 1: p_k = sigma_k / ||sigma||_1 + eps);
- `feature_std`: the per-dimension std over samples of the l2-normalised features, averaged over
  dimensions (Chen & He, SimSiam, arXiv:2011.10566v1, Sec. 4.1: about 1/sqrt(D) for features spread
  over the sphere, 0 for collapsed ones);
- `alignment`: E ||f(x1)/|f(x1)| - f(x2)/|f(x2)| ||^2 over two BYOL-augmented views of the same image
  (Wang & Isola, arXiv:2005.10242v10, Eq. 4 with alpha = 2): 0 for views the network cannot tell
  apart, 4 at most. The views are the `byol` recipe's for every method, so the figure compares. It is
  the mean over at most `ALIGNMENT_CAP` val images, evenly spread (two forward passes an image: on
  the demo's 2,000 val images the whole split made alignment half of an evaluation's passes; the same
  images and the same draws at every evaluation of a run, so its evaluations compare pair for pair).

Scale: every rank extracts the features of its shard of each split (`plain` views, index order). The
train features are gathered to every rank; each rank then scores kNN and the probe on its own val
shard and the health sums of its shard, and the counts and sums are added across ranks, so every rank
gets the same result, that of one process, and no rank waits for work of another beyond the gathers.
kNN runs on the training device in blocks of `KNN_ROWS` val rows x `KNN_COLUMNS` train rows (memory
bounded whatever the split sizes). A split larger than `EVAL_CAP` is evaluated on that many records,
evenly spread over it (`run.max_eval_samples` sets both caps instead).

Deviations: none for kNN. The linear probe is the l2-regularised logistic regression of SimCLR's
transfer evaluation (arXiv:2002.05709v3, transfer-learning appendix; no augmentation) rather than
DINO's SGD-trained linear layer on augmented crops.

`evaluate_backbone` runs everything on the data of a run's config; the loop calls it, and
`evaluate_checkpoint` (`python -m train eval ckpt=...`) for a checkpoint's backbone and a random-init one.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipelines.batch import Batch
from pipelines.loader import build_loader
from pipelines.processes import ensure_open_files
from pipelines.schema import NO_LABEL
from pipelines.spec import DatasetInfo, LoaderSpec
from pipelines.views import load_recipe
from train import checkpoint, dist
from train.config import Config, ConfigError
from train.log import eval_line
from train.resolve import config_from_dict
from train.run import check_same_network
from train.setup import (build_online, channels_last, check_dataset, decoder_hints, loader_workers, open_files_needed,
                         resolve_backend, select_device)

EVAL_CAP = {"train": 100_000, "val": 50_000}   # records per split evaluated by default (ImageNet's val whole)
ALIGNMENT_CAP = 512                            # val images of the alignment figure at most
KNN_ROWS, KNN_COLUMNS = 1024, 65_536           # kNN similarity block: 256 MiB of float32
PROBE_LBFGS_MAX = 2e9                          # rows x width x classes up to which the probe is L-BFGS
PROBE_SGD_EPOCHS, PROBE_SGD_BATCH, PROBE_SGD_LR = 30, 4096, 0.1
RANKME_EPS = 1e-7                              # Garrido et al. Eq. 1's epsilon
_NOTED: set[tuple] = set()                     # the caps this process has printed


def eval_kinds(cfg: Config) -> tuple[str, ...]:
    """The labelled evaluations `run.eval` asks for: kNN and the probe ("auto" on labelled data, and
    "linear", which adds `train.protocol`'s linear evaluation after the last step), one of them, or none;
    the label-free health metrics run in every case.

    Raises:
        ConfigError: kNN or the probe asked for on a dataset without labels.
    """
    labelled = cfg.data.num_classes > 0
    if cfg.run.eval in ("knn", "probe", "linear") and not labelled:
        raise ConfigError(f"run.eval={cfg.run.eval} needs labels, and dataset {cfg.data.name!r} has none; use "
                          "run.eval=auto (label-free health metrics) or train on a labelled dataset")
    return {"auto": ("knn", "probe") if labelled else (), "knn": ("knn",), "probe": ("probe",),
            "linear": ("knn", "probe"), "none": ()}[cfg.run.eval]


def _check_split(feats: Tensor, labels: Tensor, num_classes: int, split: str) -> None:
    if feats.dim() != 2 or labels.dim() != 1 or feats.shape[0] != labels.shape[0]:
        raise ValueError(f"{split} features must be (N, F) with labels (N,), got "
                         f"{tuple(feats.shape)} and {tuple(labels.shape)}")
    if feats.shape[0] == 0 and split == "train":
        raise ValueError(f"the {split} split has no samples; evaluation needs a non-empty split")
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{split} labels must lie in [0, {num_classes}), got "
                         f"[{int(labels.min())}, {int(labels.max())}]; check data.num_classes")


@torch.no_grad()
def extract_features(backbone: nn.Module, batches: Iterable[Batch], device: torch.device | str,
                     view_px: int | None = None, view: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Backbone features of global view `view` of every batch, in eval mode, without grad, on `device`.

    The backbone's train/eval mode is restored afterwards.

    Args:
        backbone: (B, 3, H, W) -> (B, F) module, already on `device`.
        batches: Batch objects (labels, or `schema.NO_LABEL` for unlabelled data; no shuffling).
        device: where the backbone runs and the features stay.
        view_px: the views' side; given, no batches at all (a rank whose shard is empty) give empty
            features of the backbone's width instead of an error.
        view: which global view of each batch.

    Returns:
        (feats (N, F) float32, labels (N,) int64, index (N,) int64), on `device`.

    Raises:
        ValueError: no batches at all (without `view_px`).
    """
    was_training = backbone.training
    backbone.eval()
    feats, labels, index = [], [], []
    try:
        for batch in batches:
            x = batch.global_views[view].to(device, non_blocking=True)           # (B, 3, H, W)
            feats.append(backbone(x).float())                                   # (B, F)
            labels.append(batch.label.to(device).long() if batch.label is not None
                          else torch.full((x.shape[0],), NO_LABEL, dtype=torch.long, device=device))
            index.append(batch.index.to(device).long())
        if not feats and view_px is not None:        # an empty shard: no rows, the backbone's width
            width = backbone(torch.zeros(1, 3, view_px, view_px, device=device)).shape[1]
            empty = torch.zeros(0, dtype=torch.long, device=device)
            feats, labels, index = [torch.zeros(0, width, device=device)], [empty], [empty]
    finally:
        backbone.train(was_training)
    if not feats:
        raise ValueError("evaluation got no batches; check that the split is not empty")
    return torch.cat(feats), torch.cat(labels), torch.cat(index)


@torch.no_grad()
def knn_correct(train_feats: Tensor, train_labels: Tensor, val_feats: Tensor, val_labels: Tensor,
                num_classes: int, k: int = 20, temperature: float = 0.07, rows: int = KNN_ROWS,
                columns: int = KNN_COLUMNS) -> int:
    """How many val rows the temperature-weighted kNN vote on cosine similarity gets right.

    score_c(x) = sum_{i in top-k(x)} [y_i = c] exp(s_i / T), prediction argmax_c score_c
    (Wu et al. 2018, weighted kNN). Computed on the features' device in blocks of `rows` val rows x
    `columns` train rows, the top k of each block merged into the running top k, so that memory is
    bounded by rows x (columns + k) whatever N and M; a row's result does not depend on the others.

    Args:
        train_feats: (N, F) float features of the train split.
        train_labels: (N,) int labels in [0, num_classes).
        val_feats: (M, F) float features of val rows (M may be 0).
        val_labels: (M,) int labels in [0, num_classes).
        num_classes: C.
        k: neighbours, >= 1 (capped at N).
        temperature: T > 0.

    Returns:
        The number of correct val rows.

    Raises:
        ValueError: inconsistent shapes, labels out of range, k < 1 or T <= 0.
    """
    _check_split(train_feats, train_labels, num_classes, "train")
    _check_split(val_feats, val_labels, num_classes, "val")
    if k < 1 or temperature <= 0:
        raise ValueError(f"kNN needs k >= 1 and temperature > 0, got k={k}, T={temperature}")
    train = F.normalize(train_feats.float(), dim=1)                                # (N, F)
    train_labels = train_labels.long().to(train.device)
    n, k = train.shape[0], min(k, train.shape[0])
    correct = 0
    for start in range(0, val_feats.shape[0], rows):
        q = F.normalize(val_feats[start:start + rows].float(), dim=1).to(train.device)  # (m, F)
        best_sim = torch.full((q.shape[0], 0), -2.0, device=q.device)
        best_idx = torch.zeros((q.shape[0], 0), dtype=torch.long, device=q.device)
        for col in range(0, n, columns):
            sim, idx = (q @ train[col:col + columns].T).topk(min(k, min(columns, n - col)), dim=1)  # (m, k')
            best_sim, pick = torch.cat([best_sim, sim], 1).topk(min(k, best_sim.shape[1] + sim.shape[1]), dim=1)
            best_idx = torch.cat([best_idx, idx + col], 1).gather(1, pick)                    # (m, k)
        votes = torch.zeros(q.shape[0], num_classes, device=q.device)                         # (m, C)
        votes.scatter_add_(1, train_labels[best_idx], (best_sim / temperature).exp())
        correct += int((votes.argmax(1) == val_labels[start:start + rows].long().to(q.device)).sum())  # sync
    return correct


def knn_top1(train_feats: Tensor, train_labels: Tensor, val_feats: Tensor, val_labels: Tensor,
             num_classes: int, k: int = 20, temperature: float = 0.07, chunk: int = KNN_ROWS) -> float:
    """Top-1 accuracy in [0, 1] of `knn_correct` over all val rows (`chunk`: val rows per block)."""
    if val_feats.shape[0] == 0:
        raise ValueError("the val split has no samples; evaluation needs a non-empty split")
    return knn_correct(train_feats, train_labels, val_feats, val_labels, num_classes, k, temperature,
                       rows=chunk) / val_feats.shape[0]


@dataclass(frozen=True)
class Probe:
    """A fitted linear probe: standardisation, then logits x @ w + b."""

    mean: Tensor          # (F,)
    std: Tensor           # (F,)
    w: Tensor             # (F, C)
    b: Tensor             # (C,)
    method: str           # "lbfgs" | "sgd"

    @torch.no_grad()
    def correct(self, feats: Tensor, labels: Tensor) -> int:
        """How many rows of (feats (M, F), labels (M,)) the probe classifies right."""
        if feats.shape[0] == 0:
            return 0
        x = (feats.float().to(self.w.device) - self.mean) / self.std
        return int(((x @ self.w + self.b).argmax(1) == labels.long().to(self.w.device)).sum())   # sync


def fit_probe(train_feats: Tensor, train_labels: Tensor, num_classes: int, l2: float = 1e-4,
              max_iter: int = 1000, seed: int = 0, rank: int = 0, world: int = 1,
              reduce: Callable[[list[Tensor]], list[Tensor]] | None = None) -> Probe:
    """Multinomial logistic regression on standardised features: mean cross-entropy + l2 * ||W||^2
    (bias not penalised) from zero weights, on the features' device.

    Up to `PROBE_LBFGS_MAX` (N x F x C) full-batch L-BFGS (strong Wolfe) in float32 until the largest
    gradient entry is below 1e-5, the loss stops changing, or `max_iter` iterations; above, mini-batch
    SGD (module docstring) in an order seeded by `seed`. Both are deterministic. The SGD is shared out
    over `world` ranks that all hold the same features: each takes every world-th row of a mini-batch
    and `reduce` sums their gradients (ImageNet's 100,000 x 2,048 x 1,000 probe, 30 epochs, is 3.7e13
    FLOP, once in all instead of on every rank); the step is the one-process step.

    Args:
        train_feats: (N, F) float features. train_labels: (N,) int labels in [0, num_classes).
        num_classes: C. l2: weight of the squared-norm penalty, >= 0.
        rank, world: this rank and the ranks fitting together (each with the same features).
        reduce: sums a list of tensors over the ranks (`train.dist.all_reduce_sum`); None with world 1.
    """
    _check_split(train_feats, train_labels, num_classes, "train")
    # float32, not float64: 1.9-5.6 s instead of 12-22 s on 10,000 x 512 features (2 busy CPU
    # cores), final loss within 0.2% of float64 and the same val accuracy in 3 measured cases.
    x = train_feats.float()
    mean, std = x.mean(0), x.std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))           # constant features stay 0
    x = (x - mean) / std                                               # (N, F)
    y = train_labels.long().to(x.device)
    w = torch.zeros(x.shape[1], num_classes, device=x.device, requires_grad=True)
    b = torch.zeros(num_classes, device=x.device, requires_grad=True)
    lbfgs = x.shape[0] * x.shape[1] * num_classes <= PROBE_LBFGS_MAX

    def loss_of(xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(xb @ w + b, yb) + l2 * (w * w).sum()

    with torch.enable_grad():
        if lbfgs:
            opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter,
                                    tolerance_grad=1e-5, tolerance_change=1e-9, history_size=20,
                                    line_search_fn="strong_wolfe")

            def closure() -> Tensor:
                opt.zero_grad()
                loss = loss_of(x, y)
                loss.backward()
                return loss

            opt.step(closure)
        else:
            opt = torch.optim.SGD([w, b], lr=PROBE_SGD_LR, momentum=0.9)
            gen = torch.Generator().manual_seed(seed)
            steps_per_epoch = math.ceil(x.shape[0] / PROBE_SGD_BATCH)
            total = PROBE_SGD_EPOCHS * steps_per_epoch
            for epoch in range(PROBE_SGD_EPOCHS):
                order = torch.randperm(x.shape[0], generator=gen).to(x.device)
                for k in range(steps_per_epoch):
                    step = epoch * steps_per_epoch + k
                    for g in opt.param_groups:
                        g["lr"] = PROBE_SGD_LR * 0.5 * (1 + math.cos(math.pi * step / total))
                    rows = order[k * PROBE_SGD_BATCH:(k + 1) * PROBE_SGD_BATCH]
                    mine = rows[rank::world]
                    opt.zero_grad()
                    # this rank's share of the mini-batch's mean cross-entropy; the penalty counted once
                    loss = F.cross_entropy(x[mine] @ w + b, y[mine], reduction="sum") / len(rows)
                    (loss + l2 * (w * w).sum() if rank == 0 else loss).backward()
                    if world > 1:
                        w.grad, b.grad = reduce([w.grad, b.grad])
                    opt.step()
    return Probe(mean, std, w.detach(), b.detach(), "lbfgs" if lbfgs else "sgd")


def linear_probe_top1(train_feats: Tensor, train_labels: Tensor, val_feats: Tensor,
                      val_labels: Tensor, num_classes: int, l2: float = 1e-4,
                      max_iter: int = 1000) -> float:
    """Top-1 accuracy in [0, 1] on the val features of `fit_probe` fitted on the train features."""
    _check_split(val_feats, val_labels, num_classes, "val")
    if val_feats.shape[0] == 0:
        raise ValueError("the val split has no samples; evaluation needs a non-empty split")
    probe = fit_probe(train_feats, train_labels, num_classes, l2, max_iter)
    return probe.correct(val_feats, val_labels) / val_feats.shape[0]


# ------------------------------------------------------------------------------------------------
# Health: label-free, from sums that add up across ranks
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def health_sums(feats: Tensor) -> dict[str, Tensor]:
    """The sums the health metrics need from (N, D) features: their Gram matrix (for the singular
    values, float64), and the count, sum and sum of squares of the l2-normalised features."""
    f = feats.double()
    z = F.normalize(f, dim=1)
    return {"gram": f.T @ f, "n": torch.tensor(float(f.shape[0]), dtype=torch.float64, device=f.device),
            "z_sum": z.sum(0), "z_sq": (z * z).sum(0)}


@torch.no_grad()
def alignment_sums(backbone: nn.Module, batches: Iterable[Batch], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """(sum over images of ||f(x1)/|f(x1)| - f(x2)/|f(x2)| ||^2, number of images) for the first two
    global views of every batch, the backbone in eval mode (restored afterwards); float64 on `device`."""
    was_training = backbone.training
    backbone.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    n = 0
    try:
        for batch in batches:
            f1, f2 = (F.normalize(backbone(batch.global_views[v].to(device, non_blocking=True)).float(), dim=1)
                      for v in (0, 1))                                              # (B, F) each
            total += ((f1 - f2) ** 2).sum().double()
            n += f1.shape[0]
    finally:
        backbone.train(was_training)
    return total, torch.tensor(float(n), dtype=torch.float64, device=device)


def rankme(gram: Tensor) -> float:
    """RankMe (Garrido et al. Eq. 1) of features whose Gram matrix X^T X is `gram` (D, D): the
    singular values of X are the square roots of its eigenvalues."""
    sigma = torch.linalg.eigvalsh(gram.double()).clamp_min(0).sqrt()       # (D,)
    p = sigma / sigma.sum() + RANKME_EPS
    return float(torch.exp(-(p * p.log()).sum()))


def health(sums: dict[str, Tensor], align_sum: Tensor, align_n: Tensor) -> dict[str, float]:
    """`rankme`, `feature_std` and `alignment` (module docstring) from `health_sums` and the summed
    squared distances of `align_n` view pairs."""
    n = float(sums["n"])
    var = (sums["z_sq"] - sums["z_sum"] ** 2 / n) / max(n - 1, 1)           # (D,) unbiased, as torch.std
    return {"rankme": rankme(sums["gram"]), "feature_std": float(var.clamp_min(0).sqrt().mean()),
            "alignment": float(align_sum / align_n.clamp_min(1))}


# ------------------------------------------------------------------------------------------------
# The evaluation of a run
# ------------------------------------------------------------------------------------------------


def eval_limit(count: int, split: str, max_samples: int) -> int:
    """Records of a split of `count` records that evaluation reads: `run.max_eval_samples` when set,
    else `EVAL_CAP[split]` when the split is larger, else all (0)."""
    if max_samples > 0:
        return max_samples
    return EVAL_CAP[split] if count > EVAL_CAP[split] else 0


def evaluate_backbone(cfg: Config, backbone: nn.Module, backend: str, device: torch.device) -> dict[str, float]:
    """Evaluate `backbone` on the data of `cfg` on every rank (module docstring, Scale).

    Each split's loader is built when it is read and closed after it (its workers, a DALI pipeline and
    its shared memory freed), so that between evaluations a run holds only its training loader's
    processes and memory, and every evaluation reads the same records with the same draws.

    Args:
        cfg: the run's config (data, views, run.eval, run.seed, run.max_eval_samples).
        backbone: (B, 3, H, W) -> (B, F) module on `device`; its train/eval mode is restored.
        backend: a resolved loader backend (not "auto").
        device: where the backbone runs, the batches land and kNN and the probe run.

    Returns:
        {"rankme", "feature_std", "alignment"} and, per `run.eval` on labelled data, {"knn_top1",
        "linear_top1"} in [0, 1], and the records read per split ("eval_train_samples",
        "eval_val_samples") and for the alignment ("eval_alignment_samples"); the same on every rank.
    """
    world, rank = dist.world_size(), dist.rank()
    kinds = eval_kinds(cfg)
    plain = load_recipe("plain", cfg.views.global_px, cfg.views.local_px)
    counts = {s: DatasetInfo.read(cfg.data.root, cfg.data.name, s).count for s in ("train", "val")}
    limits = {s: eval_limit(counts[s], s, cfg.run.max_eval_samples) for s in counts}
    note = (cfg.data.name, tuple(limits.items()))
    if rank == 0 and any(limits[s] and limits[s] < counts[s] for s in counts) and note not in _NOTED:
        _NOTED.add(note)
        print("evaluation reads " + ", ".join(f"{min(limits[s] or counts[s], counts[s]):,} of the {counts[s]:,} {s} "
                                              f"records" for s in counts)
              + " (evenly spread; run.max_eval_samples sets how many)", flush=True)

    def loader(split: str, recipe, limit: int) -> contextlib.closing:
        return contextlib.closing(build_loader(backend, LoaderSpec(
            root=cfg.data.root, dataset=cfg.data.name, split=split, recipe=recipe,
            batch_size=cfg.data.batch_size // world, rank=rank, world_size=world, seed=cfg.run.seed,
            device=str(device), num_workers=loader_workers(cfg, backend, device), shuffle=False, drop_last=False,
            limit=limit, channels_last=channels_last(cfg, device), decoder=decoder_hints(cfg))))

    with loader("val", plain, limits["val"]) as batches:
        va_f, va_y, _ = extract_features(backbone, batches, device, plain.global_px)
    byol = load_recipe("byol", cfg.views.global_px, cfg.views.local_px)
    with loader("val", byol, min(limits["val"] or counts["val"], ALIGNMENT_CAP)) as batches:
        align = alignment_sums(backbone, batches, device)
    train = None
    if kinds:
        with loader("train", plain, limits["train"]) as batches:
            train = extract_features(backbone, batches, device, plain.global_px)
    return score_features(train, va_f, va_y, align, kinds, cfg.data.num_classes, cfg.run.seed)


def score_features(train: tuple[Tensor, Tensor, Tensor] | None, val_feats: Tensor, val_labels: Tensor,
                   align: tuple[Tensor, Tensor], kinds: tuple[str, ...], num_classes: int, seed: int = 0
                   ) -> dict[str, float]:
    """The figures of an evaluation from this rank's features (module docstring, Scale): the train
    shard is gathered to every rank, the val shard stays, counts and sums are added across ranks.

    Args:
        train: this rank's (features (N_r, F), labels (N_r,), dataset indices (N_r,)), or None when
            `kinds` is empty.
        val_feats, val_labels: this rank's val shard (M_r, F), (M_r,).
        align: this rank's `alignment_sums`.
        kinds: the labelled evaluations (`eval_kinds`). num_classes: C. seed: the probe's order.

    Returns:
        See `evaluate_backbone`.
    """
    sums = health_sums(val_feats)
    totals = dist.all_reduce_sum([*sums.values(), *align])
    result = health(dict(zip(sums, totals[:len(sums)])), totals[-2], totals[-1])
    result["eval_val_samples"] = float(totals[list(sums).index("n")])
    result["eval_alignment_samples"] = float(totals[-1])
    if kinds:
        tr_f, tr_y, tr_i = (dist.gather_rows(t) for t in train)          # every rank: the whole split
        order = tr_i.argsort()
        tr_f, tr_y = tr_f[order], tr_y[order]
        right = []
        if "knn" in kinds:
            right.append(knn_correct(tr_f, tr_y, val_feats, val_labels, num_classes))
        if "probe" in kinds:
            probe = fit_probe(tr_f, tr_y, num_classes, seed=seed, rank=dist.rank(), world=dist.world_size(),
                              reduce=dist.all_reduce_sum)
            right.append(probe.correct(val_feats, val_labels))
        got = dist.all_reduce_sum([torch.tensor(float(r), dtype=torch.float64, device=val_feats.device) for r in right])
        for kind, r in zip([k for k in ("knn", "probe") if k in kinds], got):
            result["knn_top1" if kind == "knn" else "linear_top1"] = float(r) / result["eval_val_samples"]
        result["eval_train_samples"] = float(tr_f.shape[0])
    return result


def evaluate_checkpoint(args: list[str]) -> dict[str, dict[str, float]]:
    """kNN + linear probe of the checkpoint's backbone and of a random-init backbone of the same
    architecture; `args` are `ckpt=PATH` and optional `key=value` overrides of the saved config
    (e.g. `data.root=...`, `run.max_eval_samples=...`); prints both and returns them.

    Raises:
        ConfigError, CheckpointError, DatasetError: no `ckpt=`, an unreadable or foreign checkpoint, an
            override that builds another network, a missing dataset.
    """
    ckpt = [a.split("=", 1)[1] for a in args if a.startswith("ckpt=")]
    if not ckpt:
        raise ConfigError("eval needs the checkpoint: make eval CKPT=<run dir>/checkpoint.pt")
    state = checkpoint.load_training(ckpt[-1], "ckpt")
    cfg = config_from_dict(state["config"], overrides=[a for a in args if not a.startswith("ckpt=")])
    check_same_network(cfg, state["config"], ckpt[-1], "eval rebuilds that network: drop the override")
    check_dataset(cfg)
    ensure_open_files(open_files_needed(cfg, dist.local_world_size(), int(os.environ.get("WORLD_SIZE", "1"))),
                      "this evaluation")
    device = select_device(cfg.run.device, cfg.run.dist_timeout_min)
    backend = resolve_backend(cfg, device)
    trained = build_online(cfg, device)
    trained.load_state_dict(state["online"])
    torch.manual_seed(cfg.run.seed + 1)
    results = {"checkpoint": evaluate_backbone(cfg, trained.backbone, backend, device),
               "random_init": evaluate_backbone(cfg, build_online(cfg, device).backbone, backend, device)}
    print(f"step {state['step']} {cfg.method} {cfg.model.backbone} on {cfg.data.name}")
    for name, r in results.items():
        print(f"{name:>12}: {eval_line(r)}")
    return results
