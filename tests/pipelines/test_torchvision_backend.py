"""The torchvision baseline backend: batches independent of the workers, staged views, mixes, and the
laws of its drawn parameters read back from pixels (crop area and ratio, flip, grayscale, blur,
solarize rates, independent views), and the saliency composite aligned with the crop (the Batch
contract, rank shards, seeds and resume are in test_contract.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from pipelines.spec import LoaderSpec

from pipelines.loader import build_loader
from pipelines.views import Recipe, load_recipe

GLOBAL_PX, LOCAL_PX = 32, 16
N_TRAIN = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    from preprocess.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("tv_data")
    prepare_dataset("synthetic", out, workers=1, train_size=N_TRAIN, val_size=8, image_px=32,
                    gt_masks_as_mask=True)
    return str(out)


def _spec(root: str, recipe: Recipe, **kw) -> LoaderSpec:
    base = dict(root=root, dataset="synthetic", split="train", recipe=recipe, batch_size=4,
                num_workers=0, seed=7)
    return LoaderSpec(**{**base, **kw})


def test_same_seed_same_batches_across_workers(root: str) -> None:
    recipe = load_recipe("relicv2", GLOBAL_PX, LOCAL_PX)
    a = list(build_loader("torchvision", _spec(root, recipe, num_workers=0)))
    b = list(build_loader("torchvision", _spec(root, recipe, num_workers=2)))
    assert len(a) == len(b) == N_TRAIN // 4
    for x, y in zip(a, b):
        assert torch.equal(x.index, y.index)
        assert torch.equal(x.global_views, y.global_views) and torch.equal(x.local_views, y.local_views)


def test_staged_view_equals_weak_view_when_staged_ops_off(root: str) -> None:
    recipe = load_recipe("rsa", GLOBAL_PX, LOCAL_PX)
    off = dict(jitter_p=0.0, gray_p=0.0, blur_p=0.0, solarize_p=0.0)
    groups = tuple(dataclasses.replace(g, **off) if g.parent is not None else g for g in recipe.groups)
    b = next(iter(build_loader("torchvision", _spec(root, Recipe("rsa-off", groups)))))
    assert torch.equal(b.global_views, b.weak_views)
    # With the staged ops on, the aggressive views differ from their weak parents.
    b_on = next(iter(build_loader("torchvision", _spec(root, recipe))))
    assert torch.equal(b_on.weak_views, b.weak_views)
    assert not torch.equal(b_on.global_views, b_on.weak_views)


def test_sdmp_mix_pairs_flip_partners(root: str) -> None:
    from pipelines.mixing import MixSpec

    recipe = load_recipe("rsa", GLOBAL_PX, LOCAL_PX)
    b = next(iter(build_loader("torchvision", _spec(root, recipe, mix=MixSpec(kind="sdmp", sdmp_mixers=("mixup",))))))
    lam = b.mix_lam[:, :, None, None, None]                                  # (V, B, 1, 1, 1)
    # Mixup of normalised views equals the normalised mixup (normalisation is affine per channel).
    expect = lam * b.global_views + (1 - lam) * b.global_views.flip(1)
    assert b.mixed.shape == b.global_views.shape
    assert torch.equal(b.mix_partner[0], torch.arange(3, -1, -1))
    assert torch.allclose(b.mixed, expect, atol=1e-4)


# ---------------------------------------------------------------- laws of the drawn parameters

SIDE = 128


@dataclasses.dataclass
class _CoordSplit:
    """SIDE-px images with R = 2x and G = 2y (crop windows and flips read back from pixels) and a B
    checkerboard of 160 / 200 (solarize and blur read back from pixels); no masks."""

    n: int = 16
    mode: str = "raw"
    jpeg_quality: int = 90
    has_masks: bool = False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        from preprocess.records import Record

        yy, xx = np.mgrid[0:SIDE, 0:SIDE]
        img = np.stack([2 * xx, 2 * yy, np.where((xx + yy) % 2 == 0, 160, 200)], -1).astype(np.uint8)
        return Record(img, 0, i, None)


@pytest.fixture(scope="module")
def coord_entries(tmp_path_factory):
    from pipelines.shards import scan_shards
    from preprocess.write_dali import write_dali

    out = tmp_path_factory.mktemp("tv_coords") / "train"
    write_dali(_CoordSplit(), out, shard_size=8)
    return scan_shards(out)


def _dataset(entries, recipe: Recipe, masks: bool = False):
    """The baseline's per-sample renderer on indexed shards."""
    from pipelines.shards import ShardReader
    from pipelines.torchvision_backend import ShardDataset

    return ShardDataset(ShardReader(entries), recipe, masks)


def _window(view: np.ndarray) -> tuple[float, float, bool]:
    """(width, height, flipped) of the crop window behind a (3, S, S) view of a coordinate image:
    a straight-line fit of R along x and of G along y over the inner pixels (the borders of a
    resampled ramp bend), slope = 2 x window side / S."""
    s = view.shape[-1]
    inner = np.arange(2, s - 2)
    r = view[0].astype(np.float64).mean(0)[inner]            # R per column
    g = view[1].astype(np.float64).mean(1)[inner]            # G per row
    slope_x, slope_y = np.polyfit(inner, r, 1)[0], np.polyfit(inner, g, 1)[0]
    return abs(slope_x) * s / 2, slope_y * s / 2, slope_x < 0


def test_crop_laws_flip_rate_and_independent_views(coord_entries) -> None:
    from pipelines.views import ViewGroup

    g = ViewGroup("v", count=8, size_px=32, area=(0.08, 0.5), interpolation="bilinear", flip_p=0.5)
    ds = _dataset(coord_entries, Recipe("laws", (g,)))
    windows = np.array([[_window(v) for v in ds.render(k % len(ds), seed=k)["v"].numpy()]
                        for k in range(300)])                 # (samples, views, (w, h, flipped))
    w, h, flipped = windows[..., 0], windows[..., 1], windows[..., 2] > 0.5
    n = w.size                                                 # 2,400 views
    # Sides are whole pixels of a 128-px image and read back to ~0.2 px: allow that granularity.
    d_area = stats.kstest((w * h / SIDE**2).ravel(), stats.uniform(0.08, 0.42).cdf).statistic
    lr = math.log(4 / 3)
    d_ratio = stats.kstest(np.log(w / h).ravel(), stats.uniform(-lr, 2 * lr).cdf).statistic
    assert d_area < 1.36 / math.sqrt(n) + 0.02 and d_ratio < 1.36 / math.sqrt(n) + 0.02
    assert abs(flipped.mean() - 0.5) < 4 * math.sqrt(0.25 / n)
    # Views of one sample draw independently: no area correlation, flips coincide at p^2.
    m = w.shape[0]
    assert abs(stats.pearsonr(w[:, 0] * h[:, 0], w[:, 1] * h[:, 1])[0]) < 4 / math.sqrt(m)
    both = (flipped[:, 0::2] & flipped[:, 1::2]).mean()
    assert abs(both - 0.25) < 4 * math.sqrt(0.25 * 0.75 / (n // 2))


def test_grayscale_blur_solarize_rates(coord_entries) -> None:
    from pipelines.views import ViewGroup

    # The whole image at its own size: pixels change only by the drawn ops.
    g = ViewGroup("v", count=4, size_px=SIDE, crop_p=0.0, flip_p=0.0, gray_p=0.3, blur_p=0.4,
                  blur_sigma=(1.0, 2.0), solarize_p=0.2)
    ds = _dataset(coord_entries, Recipe("rates", (g,)))
    views = np.concatenate([ds.render(k % len(ds), seed=k)["v"].numpy() for k in range(500)])
    gray = np.array([np.array_equal(v[0], v[1]) and np.array_equal(v[1], v[2]) for v in views])
    colour = views[~gray]                                      # B is still the checkerboard's
    solarized = colour[:, 2].max(axis=(1, 2)) < 128                      # B in [160, 200] inverted
    blurred = np.array([not set(np.unique(v[2]).tolist()) <= {160, 200, 95, 55} for v in colour])
    for hits, n, p in ((gray.sum(), len(views), 0.3), (solarized.sum(), len(colour), 0.2),
                       (blurred.sum(), len(colour), 0.4)):
        assert abs(hits / n - p) < 4 * math.sqrt(p * (1 - p) / n), (hits, n, p)


@dataclasses.dataclass
class _MaskedSplit(_CoordSplit):
    """64-px images with R = 4x, G = 4y, B = 255 on a centred square foreground [16, 48)^2 and 0
    around it, and that square as the mask: the resized B channel is the resized mask."""

    has_masks: bool = True

    def __getitem__(self, i: int):
        from preprocess.records import Record

        yy, xx = np.mgrid[0:64, 0:64]
        fg = (yy >= 16) & (yy < 48) & (xx >= 16) & (xx < 48)
        img = np.stack([4 * xx, 4 * yy, np.where(fg, 255, 0)], -1).astype(np.uint8)
        return Record(img, 0, i, fg.astype(np.uint8) * 255)


def _inside(u: np.ndarray) -> np.ndarray:
    """Source coordinates deep inside the foreground [16, 48): 1.5 px from its edge pixels."""
    return (u > 16 + 1.5) & (u < 47 - 1.5)


def test_saliency_composite_is_aligned_with_the_crop(tmp_path) -> None:
    """Every view loses its background (p = 1): the pixels kept are exactly the foreground of the
    crop window, which is read back from the R/G ramps of the kept pixels."""
    from pipelines.shards import scan_shards
    from pipelines.views import ViewGroup
    from preprocess.write_dali import write_dali

    write_dali(_MaskedSplit(n=8), tmp_path / "train", shard_size=8)
    g = ViewGroup("v", count=4, size_px=32, area=(0.3, 1.0), interpolation="bilinear", flip_p=0.5,
                  saliency_p=1.0)
    ds = _dataset(scan_shards(tmp_path / "train"), Recipe("sal", (g,)), masks=True)
    checked = 0
    for k in range(60):
        for v in ds.render(k % 8, seed=k)["v"].numpy().astype(np.float64):   # (3, 32, 32)
            gray = (v[0] == v[1]) & (v[1] == v[2])
            kept = ~gray
            assert not (kept & (v[2] < 128)).any()             # no background pixel survives
            cols, rows = np.nonzero(kept.any(0))[0], np.nonzero(kept.any(1))[0]
            if len(cols) < 4 or len(rows) < 4:
                continue
            # Source coordinate of each view column / row from the kept pixels' ramps (x = R / 4).
            jj, ii = np.nonzero(kept)[1], np.nonzero(kept)[0]
            fx = np.polyfit(jj, v[0][kept] / 4, 1)
            fy = np.polyfit(ii, v[1][kept] / 4, 1)
            x, y = np.polyval(fx, np.arange(32)), np.polyval(fy, np.arange(32))
            deep_fg = _inside(y)[:, None] & _inside(x)[None, :]
            assert not (deep_fg & gray).any()                  # foreground never grayed
            checked += 1
    assert checked > 100
