"""The built-in `synthetic` source: ten classes of procedurally drawn objects on cluttered textures.

A class is a (shape, texture pattern) pair; colour, size, position, rotation, texture frequency and
phase are drawn per image, so colour histograms alone do not tell classes apart. The background is
low-frequency coloured noise with fine grain, cluttered with 2-4 smaller distractor objects drawn
from *other* classes; the object is drawn last, so the ground-truth mask (exactly the pixels that
carry the object's colour) is the object minus nothing. Every image is a pure function of
(seed, split, index): records can be made in any worker, in any order. Drawing is vectorised numpy
(no per-pixel Python).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from preprocess.records import Record

CLASS_NAMES = ("circle-stripes", "square-checker", "triangle-dots", "cross-rings", "annulus-halves",
               "hexagon-grid", "star-waves", "ellipse-pies", "crescent-blobs", "tee-plain")
NUM_CLASSES = len(CLASS_NAMES)
_SPLIT_IDS = {"train": 0, "val": 1}


def _shape(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside-test of class `cls`'s shape in its own frame (unit radius); (H, W) bool."""
    r = np.hypot(u, v)
    if cls == 0:
        return r < 1.0
    if cls == 1:
        return np.maximum(abs(u), abs(v)) < 0.78
    if cls in (2, 5):                                  # regular triangle / hexagon (half-planes)
        n = 3 if cls == 2 else 6
        a = 2 * np.pi * np.arange(n) / n
        d = u[..., None] * np.cos(a) + v[..., None] * np.sin(a)           # (H, W, n)
        return d.max(-1) < np.cos(np.pi / n) * 1.05
    if cls == 3:
        return ((abs(u) < 0.33) & (abs(v) < 0.95)) | ((abs(v) < 0.33) & (abs(u) < 0.95))
    if cls == 4:
        return (r < 1.0) & (r > 0.5)
    if cls == 6:
        return r < 0.62 + 0.38 * np.cos(5 * np.arctan2(v, u))
    if cls == 7:
        return u ** 2 + (v / 0.55) ** 2 < 1.0
    if cls == 8:
        return (r < 1.0) & ((u - 0.5) ** 2 + v ** 2 > 0.72 ** 2)
    return ((abs(u) < 0.95) & (v > -0.95) & (v < -0.45)) | ((abs(u) < 0.28) & (abs(v) < 0.95))


def _texture(cls: int, u: np.ndarray, v: np.ndarray, f: float, ph: float, blobs: np.ndarray) -> np.ndarray:
    """Two-colour pattern of class `cls` in the object frame; (H, W) bool (True: second colour)."""
    if cls == 0:
        return np.sin(f * u + ph) > 0                                     # stripes
    if cls == 1:
        return np.sin(f * u + ph) * np.sin(f * v) > 0                     # checker
    if cls == 2:
        return np.sin(f * u + ph) * np.sin(f * v + ph) > 0.45            # dots
    if cls == 3:
        return np.sin(f * np.hypot(u, v) + ph) > 0                        # concentric rings
    if cls == 4:
        return u > 0                                                      # two halves
    if cls == 5:
        return (abs(np.sin(f * u + ph)) < 0.35) | (abs(np.sin(f * v)) < 0.35)   # grid lines
    if cls == 6:
        return np.sin(f * v + 2.5 * np.sin(f * u) + ph) > 0              # wavy stripes
    if cls == 7:
        return np.sin(4 * np.arctan2(v, u) + ph) > 0                      # pie slices
    if cls == 8:
        return blobs                                                      # random blobs
    return np.zeros_like(u, dtype=bool)                                   # plain


def _hsv_rgb(h: float, s: float, v: float) -> np.ndarray:
    """One HSV colour (all in [0, 1]) as float RGB in [0, 255]."""
    k = (np.array([5.0, 3.0, 1.0]) + h * 6) % 6
    return 255 * (v - v * s * np.clip(np.minimum(k, 4 - k), 0, 1))


def _upsample(rng: np.random.Generator, grid: int, px: int, channels: int) -> np.ndarray:
    """Smooth noise: a (grid, grid, channels) uniform grid bilinearly upsampled to (px, px, channels)."""
    g = rng.random((grid, grid, channels))
    t = np.linspace(0, grid - 1, px)
    i0 = np.minimum(t.astype(int), grid - 2)
    w = (t - i0)[:, None]
    rows = g[i0] * (1 - w[..., None]) + g[i0 + 1] * w[..., None]         # (px, grid, C)
    return rows[:, i0] * (1 - w[None, :, :]) + rows[:, i0 + 1] * w[None, :, :]   # (px, px, C)


def _draw(rng: np.random.Generator, cls: int, px: int, radius: tuple[float, float],
          jitter: float) -> tuple[tuple[slice, slice], np.ndarray, np.ndarray]:
    """Draw one object of class `cls` inside its bounding box.

    Returns:
        (box, inside, layer): the (rows, cols) slices of the box in the image, the (h, w) bool
        mask and the (h, w, 3) float colour layer of the object within the box.
    """
    s = rng.uniform(*radius) * px
    cx, cy = px / 2 + rng.uniform(-jitter, jitter) * px, px / 2 + rng.uniform(-jitter, jitter) * px
    th = rng.uniform(0, 2 * np.pi)
    f, ph = rng.uniform(5.0, 9.0), rng.uniform(0, 2 * np.pi)
    c1 = _hsv_rgb(rng.random(), rng.uniform(0.5, 1.0), rng.uniform(0.6, 1.0))
    c2 = _hsv_rgb(rng.random(), rng.uniform(0.3, 1.0), rng.uniform(0.15, 0.55))
    blobs_grid = _upsample(rng, 5, 2 * int(s) + 2, 1)[..., 0] > 0.5 if cls == 8 else None
    # Only the bounding box is computed: ~3x cheaper than full-frame layers on a 64-px image with clutter.
    y0, y1 = max(int(cy - s) - 1, 0), min(int(cy + s) + 2, px)
    x0, x1 = max(int(cx - s) - 1, 0), min(int(cx + s) + 2, px)
    yy, xx = np.mgrid[y0:max(y1, y0), x0:max(x1, x0)] + 0.5                # pixel centres of the box
    dx, dy = (xx - cx) / s, (yy - cy) / s
    u, v = np.cos(th) * dx + np.sin(th) * dy, -np.sin(th) * dx + np.cos(th) * dy
    inside = _shape(cls, u, v)
    blobs = None
    if blobs_grid is not None:                 # blobs live in the object frame: sample the grid at (u, v)
        n = blobs_grid.shape[0]
        bi = np.clip(((v + 1) / 2 * (n - 1)).round().astype(int), 0, n - 1)
        bj = np.clip(((u + 1) / 2 * (n - 1)).round().astype(int), 0, n - 1)
        blobs = blobs_grid[bi, bj]
    pattern = _texture(cls, u, v, f, ph, blobs)
    shade = 1.0 - 0.15 * (u * np.cos(th) + v * np.sin(th))               # soft directional light
    layer = np.where(pattern[..., None], c2, c1) * shade[..., None]       # (h, w, 3)
    return (slice(y0, y1), slice(x0, x1)), inside, layer


@dataclass
class SyntheticSplit:
    """One split of the synthetic dataset; `split[i]` is the `Record` with index i (deterministic).

    Labels are a seeded permutation of `i % 10`, so classes are exactly balanced (±1).
    """

    n: int
    seed: int = 0
    split: str = "train"
    image_px: int = 64
    gt_masks_as_mask: bool = False     # store the ground-truth mask in the record's mask field
    mode: str = "raw"
    jpeg_quality: int = 90
    labels: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.split not in _SPLIT_IDS:
            raise ValueError(f"unknown split {self.split!r}; use one of {', '.join(_SPLIT_IDS)}")
        if self.n < 1 or self.image_px < 16:
            raise ValueError(f"synthetic {self.split}: need size >= 1 and image_px >= 16, got "
                             f"{self.n} and {self.image_px}")
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], 1 << 20])
        self.labels = rng.permutation(np.arange(self.n) % NUM_CLASSES).astype(np.int64)

    @property
    def has_masks(self) -> bool:
        return self.gt_masks_as_mask

    def __len__(self) -> int:
        return self.n

    def render(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Image i as layers: (background+clutter (H, W, 3) uint8, object (H, W, 3) uint8, mask (H, W) bool)."""
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for a split of {self.n}")
        px, cls = self.image_px, int(self.labels[i])
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], i])
        bg = (40 + 170 * _upsample(rng, rng.integers(3, 7), px, 3)).astype(np.float32)  # (H, W, 3) noise
        # float32 normals: ~2x cheaper than float64 `rng.normal` on a 64-px image
        bg += 12 * rng.standard_normal((px, px, 3), dtype=np.float32)    # fine grain
        others = [c for c in range(NUM_CLASSES) if c != cls]
        for c in rng.choice(others, size=rng.integers(2, 5), replace=False):
            box, m, layer = _draw(rng, int(c), px, (0.10, 0.18), 0.45)
            bg[box][m] = layer[m]
        obj = np.zeros((px, px, 3), np.float32)
        inside = np.zeros((px, px), dtype=bool)
        box, m, layer = _draw(rng, cls, px, (0.26, 0.40), 0.18)
        inside[box] = m
        obj[box] = layer + 6 * rng.standard_normal(layer.shape, dtype=np.float32)   # noise in the box only
        to8 = lambda a: np.clip(a, 0, 255).astype(np.uint8)   # noqa: E731
        return to8(bg), to8(obj), inside

    def __getitem__(self, i: int) -> Record:
        i = int(i)
        bg, obj, inside = self.render(i)
        image = np.where(inside[..., None], obj, bg)                      # (H, W, 3) uint8
        mask = inside.astype(np.uint8) * 255
        return Record(image=image, label=int(self.labels[i]), index=i,
                      mask=mask if self.gt_masks_as_mask else None)

    def gt_mask(self, i: int) -> np.ndarray:
        """The exact foreground mask of image i, (H, W) uint8 {0, 255}."""
        return self.render(int(i))[2].astype(np.uint8) * 255
