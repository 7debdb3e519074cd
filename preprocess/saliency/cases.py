"""Labelled images for the saliency report: one object (or two) with an exact mask on a smooth random
background, over three clutter levels and four hard cases for the handcrafted cues (object
on the border, two objects, low contrast, thin shapes). Every image is a pure function of
(case, seed, index)."""

from __future__ import annotations

import numpy as np

# case -> (background amplitude, grain, what is special)
CASES = {
    "clutter-low": (0.05, 4.0, None),
    "clutter-medium": (0.15, 8.0, None),
    "clutter-high": (0.30, 14.0, None),
    "border": (0.15, 8.0, "border"),
    "two-objects": (0.15, 8.0, "two"),
    "low-contrast": (0.15, 8.0, "low"),
    "thin": (0.15, 8.0, "thin"),
}


def _smooth(rng: np.random.Generator, px: int, grid: int) -> np.ndarray:
    """(px, px, 3) smooth random field in [0, 1], bilinear from a grid x grid lattice."""
    import cv2

    return cv2.resize(rng.random((grid, grid, 3)).astype(np.float32), (px, px), interpolation=cv2.INTER_CUBIC).clip(0, 1)


def _ellipse(px: int, cy: float, cx: float, ry: float, rx: float, th: float) -> np.ndarray:
    yy, xx = np.mgrid[0:px, 0:px] + 0.5
    dy, dx = yy - cy, xx - cx
    u = np.cos(th) * dx + np.sin(th) * dy
    v = -np.sin(th) * dx + np.cos(th) * dy
    return (u / rx) ** 2 + (v / ry) ** 2 <= 1.0


def make(case: str, i: int, px: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Image i of `case`: ((px, px, 3) uint8, (px, px) uint8 {0, 255} mask)."""
    amp, grain, special = CASES[case]
    rng = np.random.default_rng([seed, list(CASES).index(case), i])
    base = rng.uniform(0.25, 0.75, 3)
    bg = base + amp * (2 * _smooth(rng, px, int(rng.integers(3, 7))) - 1)
    colour = (base + rng.choice([-1, 1], 3) * rng.uniform(0.25, 0.45, 3)).clip(0.05, 0.95)
    if special == "low":
        colour = (base + rng.choice([-1, 1], 3) * 0.10).clip(0, 1)
    r = rng.uniform(0.18, 0.28) * px
    cy, cx = px / 2 + rng.uniform(-0.12, 0.12) * px, px / 2 + rng.uniform(-0.12, 0.12) * px
    th = rng.uniform(0, np.pi)
    if special == "border":           # the object runs off one side of the image
        side = int(rng.integers(4))
        cy, cx = [(r * 0.4, cx), (px - r * 0.4, cx), (cy, r * 0.4), (cy, px - r * 0.4)][side]
        mask = _ellipse(px, cy, cx, r, r * 1.2, th)
    elif special == "two":
        mask = (_ellipse(px, px * 0.32, px * 0.30, r * 0.7, r * 0.8, th)
                | _ellipse(px, px * 0.68, px * 0.70, r * 0.7, r * 0.8, -th))
    elif special == "thin":           # a bar about 4 px wide
        mask = _ellipse(px, cy, cx, max(2.0, px / 32), r * 1.5, th)
    else:
        mask = _ellipse(px, cy, cx, r, r * rng.uniform(0.6, 1.0), th)
    img = np.where(mask[..., None], colour, bg) + rng.normal(0, grain / 255, (px, px, 3))
    return (img.clip(0, 1) * 255).round().astype(np.uint8), mask.astype(np.uint8) * 255
