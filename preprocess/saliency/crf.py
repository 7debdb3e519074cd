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


def _crf_chunk(job: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    p, images = job
    return np.stack([dense_crf(a, im) for a, im in zip(p, images)])


class CrfPool:
    """`dense_crf` of many maps, in `workers` processes forked once for a whole run (the refinement's
    folds, then every map of every split) and sent the maps and images in chunks; in this process with
    one worker. A context manager: the processes end with it.

    Calling it: (N, H, W) maps and their (N, H, W, 3) uint8 images -> (N, H, W) float32.
    """

    CHUNKS_PER_WORKER = 4          # chunks a call hands each worker (an uneven share waits on the slowest)

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)
        self._pool = fork_context().Pool(self.workers) if self.workers > 1 else None

    def __call__(self, p: np.ndarray, images: np.ndarray) -> np.ndarray:
        if len(p) == 0:
            return p.astype(np.float32)
        if self._pool is None or len(p) < 2 * self.workers:
            return _crf_chunk((p, images))
        edges = np.linspace(0, len(p), min(len(p), self.workers * self.CHUNKS_PER_WORKER) + 1).astype(int)
        return np.concatenate(self._pool.map(_crf_chunk, [(p[a:b], images[a:b]) for a, b in zip(edges, edges[1:])]))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "CrfPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
