"""The view laws (pipelines/augment.py's docstring), written once and checked on every engine from what
it outputs: the torch reference, the torchvision baseline, FFCV with its compiled ops and with the torch
ops, the DALI CPU graph and, where there is a GPU, the DALI GPU graph.

One dataset serves every engine, written once in both formats: raw images whose R and G channels
are ramps of x and y (R = 2x + 1, G = 2y), so each view's crop window and flip are read back from its
pixels, and whose B channel and saliency mask are both a centred square foreground (B = 255 there,
0 around it). The laws: crop area and ratio, the flip rate, views of a sample drawn independently;
the grayscale, blur and solarize rates; a staged view with its ops off is its parent view; the
saliency composite greys the background of the crop's own window and never the foreground. The
mixes' laws are tests/pipelines/mix_laws.py's; the Batch contract is test_contract.py's.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from scipy import stats

from pipelines.mixing import with_mix_source
from pipelines.spec import DatasetInfo, LoaderSpec
from pipelines.views import Recipe, ViewGroup
from preprocess.records import Record
from tests.devices import OnHost

SIDE, N = 128, 16                        # image side and records
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
FG = (SIDE // 4, 3 * SIDE // 4)           # the foreground square [32, 96)^2: a quarter of the image

_NEEDS = {"ffcv": "ffcv", "dali": "nvidia.dali"}


def _engine(name: str, *marks):
    package = _NEEDS.get(name.split("-")[0].split("@")[0])
    missing = package is not None and importlib.util.find_spec(package) is None
    return pytest.param(name, marks=[*marks, pytest.mark.skipif(missing, reason=f"{package} not installed")])


# ffcv-torch: the FFCV loader with the torch ops (its GPU path) on the CPU; dali-gpu: the DALI graph with the
# branches written for the GPU (no conditionals, the blur as per-sample kernels: gpu_blur="filter") on the CPU;
# dali-tail: the DALI graph's crops finished by batched torch ops (gpu_tail="torch"), on the CPU and the GPU.
ENGINES = [_engine("torch"), _engine("torchvision"), _engine("ffcv"), _engine("ffcv-torch"), _engine("dali"),
           _engine("dali-gpu"), _engine("dali-tail"), _engine("dali@cuda", pytest.mark.gpu),
           _engine("dali-tail@cuda", pytest.mark.gpu)]


@dataclass
class CoordSplit:
    """The coordinate images of the module docstring, with the square as their saliency mask."""

    n: int = N
    mode: str = "raw"
    jpeg_quality: int = 90
    has_masks: bool = True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Record:
        yy, xx = np.mgrid[0:SIDE, 0:SIDE]
        fg = (yy >= FG[0]) & (yy < FG[1]) & (xx >= FG[0]) & (xx < FG[1])
        img = np.stack([2 * xx + 1, 2 * yy, np.where(fg, 255, 0)], -1).astype(np.uint8)
        return Record(img, i % 3, i, fg.astype(np.uint8) * 255)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> DatasetInfo:
    """The split, written by the real writers in both formats into one folder."""
    from preprocess.write_dali import write_dali

    d = tmp_path_factory.mktemp("laws")
    write_dali(CoordSplit(), d / "train", shard_size=8)
    if importlib.util.find_spec("ffcv") is not None:
        from preprocess.write_ffcv import write_ffcv

        write_ffcv(CoordSplit(), d / "train.beton")
    return DatasetInfo(dir=d, split="train", count=N, mean=MEAN, std=STD, has_masks=True)


def views_of(engine: str, info: DatasetInfo, recipe: Recipe, epochs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every view an engine makes of the split over `epochs` epochs: {group name: (count, samples, 3,
    S, S) float pixel levels in [0, 255]}."""
    backend, _, device = engine.partition("@")
    backend, _, variant = backend.partition("-")
    spec = LoaderSpec(root="", dataset="", split="train", recipe=recipe, batch_size=8, seed=seed,
                      device=device or "cpu", num_workers=0 if backend in ("torch", "torchvision") else 1)
    spec = replace(spec, recipe=with_mix_source(spec.recipe, spec.mix))
    module = importlib.import_module(f"pipelines.{backend}_backend")
    if variant == "torch":
        loader = module.FFCVLoader(spec, info, ops=False)
    elif variant == "gpu":
        loader = module.DaliLoader(replace(spec, gpu_blur="filter"), info, gpu_branches=True)
    elif variant == "tail":
        loader = module.DaliLoader(replace(spec, gpu_tail="torch"), info, gpu_branches=True)
    else:
        loader = module.build(spec, info)
    loader = OnHost(loader, device or "cpu")
    out: dict[str, list[torch.Tensor]] = {g.name: [] for g in recipe.groups}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for b in loader:
            for field, groups in recipe.fields.items():
                x, start = getattr(b, field), 0
                for g in groups:
                    out[g.name].append((x[start:start + g.count] * STD[0] + MEAN[0]) * 255)
                    start += g.count
    return {k: torch.cat(v, 1) for k, v in out.items()}


def window(view: np.ndarray) -> tuple[float, float, bool]:
    """(width, height, flipped) of the crop window behind a (3, S, S) coordinate view: straight-line
    fits of R along x and of G along y over the inner pixels (the borders of a resampled ramp
    bend); slope = 2 x window side / S."""
    s = view.shape[-1]
    inner = np.arange(2, s - 2)
    slope_x = np.polyfit(inner, view[0].mean(0)[inner], 1)[0]
    slope_y = np.polyfit(inner, view[1].mean(1)[inner], 1)[0]
    return abs(slope_x) * s / 2, slope_y * s / 2, slope_x < 0


def within(hits: float, n: int, p: float) -> bool:
    """hits ~ Binomial(n, p) within 4 sigma."""
    return abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_crop_flip_and_op_laws(dataset: DatasetInfo, engine: str) -> None:
    """Crops: area ~ U(0.08, 0.5) of the image and log(w / h) ~ U(log 3/4, log 4/3) (every first try
    fits at these ranges), flips at p = 0.5, the views of a sample drawn independently (uncorrelated
    areas, flips coinciding at p^2). Ops on the whole image at its own size (pixels change only by
    the drawn ops): grayscale at 0.3, blur at 0.4, solarize at 0.2."""
    crops = ViewGroup("crops", count=16, size_px=16, area=(0.08, 0.5), flip_p=0.5, interpolation="bilinear")
    ops = ViewGroup("ops", count=2, size_px=SIDE, crop_p=0.0, flip_p=0.0, gray_p=0.3, blur_p=0.4,
                    blur_sigma=(1.0, 2.0), blur_sigma_at="view", solarize_p=0.2)
    views = views_of(engine, dataset, Recipe("laws", (ops, crops)), epochs=8)
    v = views["crops"].numpy()                                                   # (16, 128, 3, 16, 16)
    windows = np.array([[window(x) for x in per_sample] for per_sample in v.transpose(1, 0, 2, 3, 4)])
    w, h, flipped = windows[..., 0], windows[..., 1], windows[..., 2] > 0.5      # (samples, views)
    n = w.size                                                                   # 2,048 views
    # Sides are whole pixels and read back to ~0.3 px: allow that granularity in D.
    d_area = stats.kstest((w * h / SIDE**2).ravel(), stats.uniform(0.08, 0.42).cdf).statistic
    lr = math.log(4 / 3)
    d_ratio = stats.kstest(np.log(w / h).ravel(), stats.uniform(-lr, 2 * lr).cdf).statistic
    assert d_area < 1.36 / math.sqrt(n) + 0.02 and d_ratio < 1.36 / math.sqrt(n) + 0.03, (d_area, d_ratio)
    assert within(flipped.sum(), n, 0.5)
    area = w * h
    assert abs(stats.pearsonr(area[:, 0::2].ravel(), area[:, 1::2].ravel())[0]) < 4 / math.sqrt(n // 2)
    assert within((flipped[:, 0::2] & flipped[:, 1::2]).sum(), n // 2, 0.25)

    o = views["ops"].flatten(0, 1).round().numpy()                              # (256, 3, 128, 128)
    gray = (o[:, 0] == o[:, 1]).all((1, 2)) & (o[:, 1] == o[:, 2]).all((1, 2))
    colour = o[~gray]
    solarized = colour[:, 2].max((1, 2)) < 128                                  # the square's B = 255 inverted
    blurred = np.array([not set(np.unique(x[2]).tolist()) <= {0.0, 255.0} for x in colour])
    for hits, m, p in ((gray.sum(), len(o), 0.3), (solarized.sum(), len(colour), 0.2),
                       (blurred.sum(), len(colour), 0.4)):
        assert within(hits, m, p), (hits, m, p)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_centre_crop_is_the_same_central_window_for_every_sample_and_epoch(dataset: DatasetInfo,
                                                                               engine: str) -> None:
    """Evaluation's centre crop (`centre_crop` 0.875: Resize(256) + CenterCrop(224) of the shorter side):
    every view is the central 112 x 112 px window of the 128-px image, never flipped."""
    views = views_of(engine, dataset, Recipe("centre", (ViewGroup("centre", size_px=32, centre_crop=0.875,
                                                                  flip_p=0.0),)), epochs=2)["centre"][0].numpy()
    for view in views:                                                           # (3, 32, 32) each
        w, h, flipped = window(view)
        assert abs(w - 112) < 1.5 and abs(h - 112) < 1.5 and not flipped, (w, h, flipped)
        # the ramps' means: the window's centre, x = y = 64 (R = 2x + 1, G = 2y)
        assert abs(view[0].mean() - 129) < 1.5 and abs(view[1].mean() - 128) < 1.5
    assert np.abs(views - views[0]).max() < 1.0


@pytest.mark.parametrize("engine", ENGINES)
def test_staged_view_with_its_ops_off_is_its_parent(dataset: DatasetInfo, engine: str) -> None:
    recipe = Recipe("staged", (ViewGroup("weak", count=2, size_px=16, area=(0.2, 1.0), flip_p=0.5),
                               ViewGroup("aggressive", count=2, size_px=16, parent="weak")))
    views = views_of(engine, dataset, recipe, epochs=1, seed=2)
    assert torch.equal(views["weak"], views["aggressive"])
    assert not torch.equal(views["weak"][0], views["weak"][1])                 # two crops, not one


def _inside(u: np.ndarray) -> np.ndarray:
    """Source coordinates deep inside the foreground: 1.5 px from its edge pixels."""
    return (u > FG[0] + 1.5) & (u < FG[1] - 1 - 1.5)


def _outside(u: np.ndarray) -> np.ndarray:
    return (u < FG[0] - 1 - 1.5) | (u > FG[1] + 1.5)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_saliency_greys_the_background_of_the_window_and_never_the_foreground(dataset: DatasetInfo,
                                                                               engine: str) -> None:
    """Every view loses its background (p = 1; the square covers a quarter of the image, above the
    5 % gate): with the crop window read back from the R/G ramps of the pixels kept, the deep
    foreground of the window is never grey, its deep background always is, in one grey level per view."""
    g = ViewGroup("v", count=4, size_px=32, area=(0.3, 1.0), interpolation="bilinear", flip_p=0.5, saliency_p=1.0)
    views = views_of(engine, dataset, Recipe("sal", (g,)), epochs=2, seed=5)["v"].flatten(0, 1).round().numpy()
    checked = 0
    for v in views.astype(np.float64):                                          # (3, 32, 32)
        grey = (v[0] == v[1]) & (v[1] == v[2])        # R = G = B: the grey level, or a resampled edge by chance
        if grey.any():
            levels, counts = np.unique(v[0][grey], return_counts=True)
            assert counts.max() >= 0.9 * grey.sum()                             # one level per view
            grey &= v[0] == levels[counts.argmax()]
        kept = ~grey
        jj, ii = np.nonzero(kept)[1], np.nonzero(kept)[0]
        if len(set(jj.tolist())) < 4 or len(set(ii.tolist())) < 4:
            continue
        # Source coordinate of each view column / row from the kept pixels' ramps (x = (R - 1) / 2).
        x = np.polyval(np.polyfit(jj, (v[0][kept] - 1) / 2, 1), np.arange(32))
        y = np.polyval(np.polyfit(ii, v[1][kept] / 2, 1), np.arange(32))
        deep_fg = _inside(y)[:, None] & _inside(x)[None, :]
        deep_bg = _outside(y)[:, None] | _outside(x)[None, :]
        assert not (deep_fg & grey).any()                                       # foreground never greyed
        assert grey[deep_bg].all()                                              # background always
        checked += int(deep_bg.any())
    assert checked > len(views) // 4
