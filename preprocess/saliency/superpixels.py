"""SLIC superpixels, the segmentation every handcrafted saliency map starts from (`handcrafted.py`,
`dsr.py`): the labels, relabelled 0..n-1 with their count checked; each superpixel's mean of a
per-pixel quantity; the image sides each touches; and the min-max normalisation of the maps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SIDES = ("top", "bottom", "left", "right")


class SaliencyError(ValueError):
    """Bad saliency input or parameters, with the fix."""


@dataclass(frozen=True)
class SlicParams:
    """SLIC settings: `segments` is the target count (the graph methods': `handcrafted.segments_for`;
    DSR's: its scales); a result under `min_fraction` of it is an error. Without smoothing (`sigma`)
    SLIC merges a noisy image into a handful of segments."""

    segments: int = 80
    compactness: float = 20.0
    sigma: float = 1.0
    min_fraction: float = 0.5


def segment(image: np.ndarray, slic: SlicParams) -> np.ndarray:
    """(H, W) SLIC superpixel labels 0..n-1 of an (H, W, 3) uint8 RGB image.

    Raises:
        SaliencyError: not an RGB image, or SLIC made fewer than `slic.min_fraction` of `slic.segments`.
    """
    from skimage.segmentation import slic as skimage_slic

    if image.ndim != 3 or image.shape[2] != 3:
        raise SaliencyError(f"saliency needs (H, W, 3) RGB images, got shape {image.shape}")
    h, w = image.shape[:2]
    raw = skimage_slic(image, n_segments=slic.segments, compactness=slic.compactness, sigma=slic.sigma,
                       start_label=0, channel_axis=-1)
    _, labels = np.unique(raw, return_inverse=True)
    labels = labels.reshape(h, w)
    n = int(labels.max()) + 1
    if n < slic.min_fraction * slic.segments:
        raise SaliencyError(f"SLIC made {n} superpixels for a target of {slic.segments} on a {w}x{h} image; "
                            "raise the working size or lower the superpixel count")
    return labels


def region_means(labels: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(n, C) mean over each superpixel of (H, W, C) per-pixel `values`."""
    flat = labels.ravel()
    n = int(flat.max()) + 1
    count = np.bincount(flat, minlength=n).astype(np.float64)
    return np.stack([np.bincount(flat, weights=values[..., c].ravel(), minlength=n) / count
                     for c in range(values.shape[-1])], axis=1)


def touching(labels: np.ndarray) -> dict[str, np.ndarray]:
    """Side name -> (n,) bool: the superpixels with a pixel on that side of the image."""
    n = int(labels.max()) + 1
    sides = {s: np.zeros(n, dtype=bool) for s in SIDES}
    for s, edge in (("top", labels[0]), ("bottom", labels[-1]), ("left", labels[:, 0]), ("right", labels[:, -1])):
        sides[s][np.unique(edge)] = True
    return sides


def minmax(x: np.ndarray) -> np.ndarray:
    """`x` scaled to [0, 1]; all zeros where it is constant."""
    lo, hi = float(x.min()), float(x.max())
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x, dtype=np.float64)
