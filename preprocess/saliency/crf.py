"""DeepUSPS's dense CRF on saliency predictions (Nguyen et al., NeurIPS 2019: the predictions are
made to follow the image's colour edges before they enter the moving average, its "intra-image
fidelity"): a fully connected CRF of two labels (Krähenbühl and Koltun, NeurIPS 2011)
through `pydensecrf` (the `pydensecrf2` package, the `crf` extra).

Parameters of DeepUSPS's code on 432-px images: unary −log p of the two labels, a Gaussian kernel of
sxy 3 and compatibility 3, a bilateral kernel of sxy 80, srgb 13 and compatibility 10, 5 mean-field
iterations. The spatial widths are in pixels, so here they are scaled by side / 432 (the same share
of the image at the networks' 64-128 px; the Gaussian kernel's at least 1 px); colour widths stay.
"""

from __future__ import annotations

import numpy as np

from pipelines.processes import fork_context
from preprocess.sources import PreprocessError

DEEPUSPS_SIDE = 432          # the side DeepUSPS's parameters are given at
GAUSSIAN_SXY, GAUSSIAN_COMPAT = 3.0, 3.0
BILATERAL_SXY, BILATERAL_SRGB, BILATERAL_COMPAT = 80.0, 13.0, 10.0
ITERATIONS = 5
P_FLOOR = 1e-5               # probabilities clipped away from 0 and 1 before the log


def available() -> bool:
    """Whether pydensecrf imports."""
    try:
        import pydensecrf.densecrf  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raises `PreprocessError` in one line when pydensecrf is missing."""
    if not available():
        raise PreprocessError("the refinement's dense CRF needs pydensecrf: pip install 'viewmill[crf]' (it builds "
                              "from source with a C++ compiler; `make saliency` installs it), or pass --no-crf")


def dense_crf(p: np.ndarray, image: np.ndarray, iterations: int = ITERATIONS) -> np.ndarray:
    """The CRF's marginal of the salient label for one image.

    Args:
        p: (H, W) float saliency probabilities in [0, 1].
        image: (H, W, 3) uint8 RGB image of the same size.

    Returns:
        (H, W) float32 in [0, 1].
    """
    import pydensecrf.densecrf as dcrf

    h, w = p.shape
    if image.shape != (h, w, 3) or image.dtype != np.uint8:
        raise ValueError(f"dense_crf needs an (H, W, 3) uint8 image of the map's size {(h, w)}, got "
                         f"{image.shape} {image.dtype}")
    scale = max(h, w) / DEEPUSPS_SIDE
    model = dcrf.DenseCRF2D(w, h, 2)
    prob = np.clip(np.stack([1.0 - p, p]), P_FLOOR, 1.0 - P_FLOOR).astype(np.float32)       # (2, H, W)
    model.setUnaryEnergy(np.ascontiguousarray(-np.log(prob).reshape(2, -1)))
    model.addPairwiseGaussian(sxy=max(1.0, GAUSSIAN_SXY * scale), compat=GAUSSIAN_COMPAT)
    model.addPairwiseBilateral(sxy=BILATERAL_SXY * scale, srgb=BILATERAL_SRGB, rgbim=np.ascontiguousarray(image),
                             compat=BILATERAL_COMPAT)
    q = np.asarray(model.inference(iterations), dtype=np.float32).reshape(2, h, w)
    return q[1]


_BATCH: tuple[np.ndarray, np.ndarray] | None = None     # the maps and images forked workers read


def _crf_range(bounds: tuple[int, int]) -> np.ndarray:
    p, images = _BATCH
    return np.stack([dense_crf(p[i], images[i]) for i in range(*bounds)])


def dense_crf_all(p: np.ndarray, images: np.ndarray, workers: int = 1) -> np.ndarray:
    """`dense_crf` of each of (N, H, W) maps with its (N, H, W, 3) image: (N, H, W) float32, in
    `workers` forked processes (which read both arrays from the parent's memory) when there are
    more than a few maps a worker."""
    global _BATCH
    if len(p) == 0:
        return p.astype(np.float32)
    if workers <= 1 or len(p) < 8 * workers:
        return np.stack([dense_crf(a, im) for a, im in zip(p, images)])
    edges = np.linspace(0, len(p), workers + 1).astype(int)
    _BATCH = (p, images)
    try:
        with fork_context().Pool(workers) as pool:
            return np.concatenate(pool.map(_crf_range, list(zip(edges[:-1], edges[1:]))))
    finally:
        _BATCH = None
