"""Saliency quality against a ground-truth mask: MAE, F-β (β² = 0.3, the salient-object convention
DeepUSPS reports) at a threshold and its maximum over thresholds, and IoU."""

from __future__ import annotations

import numpy as np

BETA2 = 0.3
THRESHOLDS = np.linspace(0.05, 0.95, 19)


def _as_bool(gt: np.ndarray) -> np.ndarray:
    return gt > (127 if gt.dtype == np.uint8 else 0.5)


def mae(pred: np.ndarray, gt: np.ndarray) -> float:
    """Mean absolute error between a [0, 1] map and the binary ground truth."""
    return float(np.abs(pred.astype(np.float64) - _as_bool(gt)).mean())


def f_beta(pred: np.ndarray, gt: np.ndarray, threshold: float = 0.5, beta2: float = BETA2) -> float:
    """F-β of the map thresholded at `threshold`: (1 + β²)·P·R / (β²·P + R); precision is 1 when
    nothing is predicted (as DeepUSPS scores it)."""
    p, g = pred >= threshold, _as_bool(gt)
    tp = float(np.logical_and(p, g).sum())
    precision = tp / p.sum() if p.any() else 1.0
    recall = tp / g.sum() if g.any() else 1.0
    denom = beta2 * precision + recall
    return (1 + beta2) * precision * recall / denom if denom > 0 else 0.0


def max_f(pred: np.ndarray, gt: np.ndarray, beta2: float = BETA2) -> float:
    """The best F-β over 19 thresholds 0.05 … 0.95."""
    return max(f_beta(pred, gt, t, beta2) for t in THRESHOLDS)


def iou(pred: np.ndarray, gt: np.ndarray, threshold: float = 0.5) -> float:
    """Intersection over union of the thresholded map and the ground truth (1 when both are empty)."""
    p, g = pred >= threshold, _as_bool(gt)
    union = np.logical_or(p, g).sum()
    return float(np.logical_and(p, g).sum() / union) if union else 1.0
