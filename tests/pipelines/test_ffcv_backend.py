"""FFCV backend: both paths (compiled CPU ops, torch ops) on the CPU, reused output buffers, mixes, the
compiled crop, draws and per-view ops against `augment`'s laws and ops (the view laws on every engine
are test_view_laws.py's; the Batch contract, rank shards, seeds and resume test_contract.py's).

Datasets are written with the real FFCV writer into tmp_path. Images are raw (bit-exact) and encode
their coordinates (R = 2x, G = 2y), so crop windows can be recovered from pixels; the colour tests use
raw images of smooth random colour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from scipy import stats

pytest.importorskip("ffcv")

from pipelines import augment, ffcv_ops, mixing  # noqa: E402
from pipelines.ffcv_backend import FFCVLoader  # noqa: E402
from pipelines.ffcv_decode import view_params  # noqa: E402
from pipelines.loader import build_loader  # noqa: E402
from pipelines.mixing import MixSpec, with_mix_source  # noqa: E402
from pipelines.spec import DatasetInfo, LoaderSpec  # noqa: E402
from pipelines.views import Recipe, ViewGroup, load_recipe  # noqa: E402
from preprocess.records import Record  # noqa: E402
from preprocess.write_ffcv import write_ffcv  # noqa: E402
from tests.pipelines import mix_laws  # noqa: E402

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@dataclass
class CoordSplit:
    """Raw images whose R/G channels are 2x / 2y; B and the mask mark a centred square foreground."""

    n: int
    side: int
    mode: str = "raw"
    jpeg_quality: int = 90
    has_masks: bool = True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Record:
        s = self.side
        yy, xx = np.mgrid[0:s, 0:s]
        fg = (abs(yy - s / 2 + 0.5) < s / 4 + i % 3) & (abs(xx - s / 2 + 0.5) < s / 4)
        img = np.stack([2 * xx, 2 * yy, np.where(fg, 255, 40)], -1).astype(np.uint8)
        return Record(img, i % 7, i, fg.astype(np.uint8) * 255)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, CoordSplit]:
    split = CoordSplit(n=40, side=32)
    path = tmp_path_factory.mktemp("ffcv") / "train.beton"
    write_ffcv(split, path)
    return path, split


def loader(path: Path, recipe: Recipe, compiled_ops: bool | None = None, has_masks: bool = True, **kw) -> FFCVLoader:
    """An FFCV loader on a `.beton` written without a manifest (built directly, not by `build_loader`)."""
    from ffcv.reader import Reader

    spec = LoaderSpec(root="", dataset="", split=path.stem, recipe=recipe, num_workers=1, **{"batch_size": 8, **kw})
    info = DatasetInfo(dir=path.parent, split=path.stem, count=int(Reader(str(path)).num_samples), mean=MEAN,
                       std=STD, has_masks=has_masks)
    return FFCVLoader(replace(spec, recipe=with_mix_source(recipe, spec.mix)), info, ops=compiled_ops)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Undo `normalize` (MEAN/STD above) back to uint8-valued floats."""
    return ((x * 0.25 + 0.5) * 255).round()


RELIC = Recipe("relicv2", (
    ViewGroup("large", count=4, size_px=16, area=(0.14, 1.0), jitter_p=0.8, brightness=0.4, contrast=0.4,
              saturation=0.2, hue=0.1, gray_p=0.2, blur_p=0.5, solarize_p=0.2, saliency_p=0.5),
    ViewGroup("small", count=2, size_px=8, area=(0.05, 0.14), jitter_p=0.8, brightness=0.4, gray_p=0.2),
))
RSA = Recipe("rsa", (
    ViewGroup("weak", count=2, size_px=16, area=(0.2, 1.0)),
    ViewGroup("aggressive", count=2, size_px=16, parent="weak", jitter_p=0.8, brightness=0.4, contrast=0.4,
              saturation=0.4, hue=0.1, gray_p=0.2, blur_p=0.5),
))


def check_range(x: torch.Tensor) -> None:
    lo, hi = (0 - 0.5) / 0.25, (1 - 0.5) / 0.25
    assert x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    assert float(x.min()) >= lo - 1e-5 and float(x.max()) <= hi + 1e-5


# Both paths on the CPU: compiled per-view ops (the CPU default) and torch ops (the GPU default).
PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])


@PATHS
def test_batch_contract_relicv2_and_rsa(small, compiled: bool) -> None:
    path, split = small
    batches = list(loader(path, RELIC, compiled))
    assert len(batches) == 5
    for b in batches:
        assert b.global_views.shape == (4, 8, 3, 16, 16) and b.local_views.shape == (2, 8, 3, 8, 8)
        assert b.weak_views is None and b.mixed is None
        check_range(b.global_views)
        check_range(b.local_views)
        assert b.index.dtype == torch.int64 and torch.equal(b.label, b.index % 7)
    seen = torch.cat([b.index for b in batches])
    assert sorted(seen.tolist()) == list(range(40))
    (b,) = list(loader(path, RSA, compiled, batch_size=40))
    assert b.global_views.shape == b.weak_views.shape == (2, 40, 3, 16, 16) and b.local_views is None
    check_range(b.weak_views)
    assert not torch.equal(b.global_views, b.weak_views)         # aggressive ops were applied


def test_each_batch_comes_with_the_windows_its_views_were_cropped_from(small) -> None:
    """The windows the decoder wrote into the rows, read back with the batch (`FFCVLoader.decoded`), are the
    crops' own: on images whose R/G channels are 2x/2y, a view's first pixel is the mean over the first
    output cell of its window (INTER_AREA). Both paths read the rows alike (`CropLayout.read`)."""
    path, split = small
    group = ViewGroup("g", count=2, size_px=8, area=(0.2, 1.0), flip_p=0.0)
    seen = 0
    for decoded in loader(path, Recipe("plain", (group,)), has_masks=False).decoded():
        windows = decoded.windows["g"]                                         # (2, B, 4) int64
        assert windows.dtype == torch.int64 and windows.shape == (2, 8, 4)
        y0, x0, h, w = windows.unbind(-1)
        assert bool(((y0 >= 0) & (x0 >= 0) & (h > 0) & (w > 0)).all())
        assert bool(((y0 + h <= split.side) & (x0 + w <= split.side)).all())
        first = to_uint8(decoded.batch.global_views)[:, :, :, 0, 0]            # (2, B, 3): R, G, B
        assert torch.allclose(first[..., 0] / 2, x0 + (w / 8 - 1) / 2, atol=1.0)
        assert torch.allclose(first[..., 1] / 2, y0 + (h / 8 - 1) / 2, atol=1.0)
        seen += 1
    assert seen == 5


def test_output_buffers_are_reused_only_when_no_tensor_holds_them(small) -> None:
    """The compiled path writes each batch into a buffer no live tensor shares: batches (or slices of
    them) that the caller keeps never change, and buffers of dropped batches are written again."""
    path, _ = small
    kept, copies = [], []
    for b in loader(path, RELIC, seed=2):                        # keep all: every buffer is new
        kept.append(b)
        copies.append((b.global_views.clone(), b.local_views.clone()))
    assert len({b.global_views.data_ptr() for b in kept}) == len(kept) == 5
    for b, (g, s) in zip(kept, copies):
        assert torch.equal(b.global_views, g) and torch.equal(b.local_views, s)
    ld, ptrs, first_slice = loader(path, RELIC, seed=2), [], None
    for k, b in enumerate(ld):                                   # keep only a slice of batch 0
        ptrs.append(b.global_views.data_ptr())
        if k == 0:
            first_slice = b.global_views[1, 2:4]
    assert torch.equal(first_slice, copies[0][0][1, 2:4])        # same seed: batch 0 again, intact
    assert ptrs[0] not in ptrs[1:]                               # its buffer was never written again
    # 5 batches x 2 fields, while the loop variable holds the previous batch: two buffers alternate
    # per field, plus batch 0's global buffer pinned by the slice (10 without reuse).
    assert ld._buffers.made == 2 + 2 + 1


OPS_LAWS = ViewGroup("ops", count=64, size_px=4, area=(0.25, 0.5), flip_p=0.3, jitter_p=0.3, brightness=0.4,
                     contrast=0.4, saturation=0.2, hue=0.1, gray_p=0.2, blur_p=0.6, blur_sigma=(0.5, 1.5),
                     solarize_p=0.1, saliency_p=0.4, interpolation="bilinear")


def binomial_ok(hits: int, n: int, p: float) -> bool:
    """hits ~ Binomial(n, p) within 4 sigma."""
    return abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_compiled_draws_follow_the_laws(tmp_path: Path) -> None:
    """The parameters the compiled kernels draw (`ffcv_ops.draw_params`) follow `augment.sample_color_params`'
    laws: rates, factor and sigma ranges, uniformly random op orders, independent draws. (What the
    views look like, on every engine, is test_view_laws.py's.)"""
    split = CoordSplit(n=16, side=128)
    path = tmp_path / "train.beton"
    write_ffcv(split, path)
    ld = loader(path, Recipe("law", (OPS_LAWS,)), batch_size=16)
    drawn = []
    for epoch in range(2):
        ld.set_epoch(epoch)
        for decoded in ld.decoded():
            drawn.append(decoded.params["ops"])
    cat = {f: torch.cat([getattr(p, f) for p in drawn]) for f in ("flip", "jitter", "factors", "order", "gray",
                                                                 "blur", "sigma", "solarize", "saliency", "gray_level")}
    m = len(cat["flip"])
    assert m == 2048
    g = OPS_LAWS
    for f, prob in (("flip", g.flip_p), ("jitter", g.jitter_p), ("gray", g.gray_p), ("blur", g.blur_p),
                    ("solarize", g.solarize_p), ("saliency", g.saliency_p)):
        assert binomial_ok(int(cat[f].sum()), m, prob), f
    on = cat["jitter"]
    for k, amp in enumerate((g.brightness, g.contrast, g.saturation)):
        assert stats.kstest(cat["factors"][on, k].numpy(), stats.uniform(1 - amp, 2 * amp).cdf).pvalue > 1e-3
    assert stats.kstest(cat["factors"][on, 3].numpy(), stats.uniform(-g.hue, 2 * g.hue).cdf).pvalue > 1e-3
    assert torch.equal(cat["factors"][~on], torch.tensor([1.0, 1.0, 1.0, 0.0]).expand(int((~on).sum()), 4))
    assert torch.equal(cat["order"].sort(1).values, torch.arange(4).expand(m, 4))     # permutations
    first = torch.bincount(cat["order"][:, 0], minlength=4)
    assert all(binomial_ok(int(c), m, 0.25) for c in first)
    scale = g.size_px / 224
    assert stats.kstest(cat["sigma"].numpy(), stats.uniform(0.5 * scale, 1.0 * scale).cdf).pvalue > 1e-3
    assert stats.kstest(cat["gray_level"].numpy(), stats.uniform(0, 1).cdf).pvalue > 1e-3
    # Independent draws: flip and gray coincide at the product rate.
    assert binomial_ok(int((cat["flip"] & cat["gray"]).sum()), m, g.flip_p * g.gray_p)


@dataclass
class ColourSplit(CoordSplit):
    """Raw images of smooth random colour plus fine noise (every colour op changes them), no masks."""

    has_masks: bool = False

    def __getitem__(self, i: int) -> Record:
        return Record(colour_image(np.random.default_rng(i), self.side), i % 7, i, None)


def colour_image(rng: np.random.Generator, side: int) -> np.ndarray:
    """(side, side, 3) uint8: bicubic-upsampled random colours, noise, a few saturated pixels."""
    coarse = rng.uniform(0, 255, (side // 4 + 2, side // 4 + 2, 3)).astype(np.float32)
    img = cv2.resize(coarse, (side, side), interpolation=cv2.INTER_CUBIC) + rng.normal(0, 12, (side, side, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def torch_reference(crop: np.ndarray, p: augment.ViewParams, group: ViewGroup) -> torch.Tensor:
    """torch_backend's flip + apply_color_ops of N uint8 crops (N, S, S, 3) → (N, 3, S, S) float."""
    x = torch.from_numpy(crop).permute(0, 3, 1, 2).float().div(255.0)
    x = torch.where(p.flip.view(-1, 1, 1, 1), x.flip(-1), x)
    return augment.apply_color_ops(x, p, group)


def run_finish_view(crop: np.ndarray, u: np.ndarray, group: ViewGroup, keep: bool = False):
    """The decoder's C entry point on one (S, S, 3) uint8 crop: (uint8 result, parameters, float view)."""
    ops = ffcv_ops.compiled()
    s = crop.shape[0]
    out = np.ascontiguousarray(crop).copy()
    laws = ffcv_ops.group_table((group,))
    p = np.zeros(ffcv_ops.N_PARAMS, np.float32)
    buf, tmp = np.zeros(3 * s * s, np.float32), np.zeros(3 * s * s, np.float32)
    pad = np.zeros(3 * (3 * s + 2), np.float32)
    u = np.ascontiguousarray(u, np.float64)
    ops.finish_view(out.ctypes.data, s, u.ctypes.data, laws.ctypes.data, p.ctypes.data, buf.ctypes.data,
                    tmp.ctypes.data, pad.ctypes.data, int(keep))
    return out, p, buf


def params_of(p: np.ndarray) -> augment.ViewParams:
    return view_params(torch.from_numpy(p).reshape(1, -1))


@pytest.mark.parametrize("size", [224, 96, 17])
def test_compiled_ops_equal_torch_ops_within_one_level(size: int) -> None:
    """The decoder's compiled view (flip, jitter in drawn order, gray, blur, solarize) equals torch_backend's
    ops on the same crop within one uint8 level, over random draws with every op hit often; at 224 px
    the blur window is truncated at 4 sigma (23-px kernel, radius <= 8)."""
    group = ViewGroup("g", size_px=size, jitter_p=0.8, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.5,
                      gray_p=0.25, blur_p=0.6, solarize_p=0.4)
    rng = np.random.default_rng(size)
    seen = np.zeros(5, int)                                                   # flip, jitter, gray, blur, solarize
    for t in range({224: 12, 96: 24, 17: 60}[size]):
        crop = colour_image(rng, size)
        out, p, _ = run_finish_view(crop, rng.random(ffcv_ops.N_PARAMS), group)
        vp = params_of(p)
        ref = torch_reference(crop[None], vp, group)[0].permute(1, 2, 0).mul(255).numpy()   # (S, S, 3)
        err = np.abs(out.astype(np.float64) - ref)
        assert err.max() < 1.5, (t, p)                # one level of rounding, plus float32 noise
        P = ffcv_ops.Param
        seen += [p[P.FLIP] > 0.5, p[P.JITTER] > 0.5, p[P.GRAY] > 0.5, p[P.BLUR] > 0.5, p[P.SOLARIZE] > 0.5]
    assert (seen > 0).all()                                                # every op was exercised


def test_compiled_identity_and_extreme_factors() -> None:
    """No op drawn: the crop comes back bit-exact (flipped or not); extreme factors (brightness 0,
    saturation 0, hue +-0.5) still agree with the torch ops."""
    rng = np.random.default_rng(3)
    crop = colour_image(rng, 24)
    idle = ViewGroup("idle", size_px=24, flip_p=1.0)
    out, p, _ = run_finish_view(crop, np.full(ffcv_ops.N_PARAMS, 0.5), idle)
    assert p[ffcv_ops.Param.FLIP] == 1 and np.array_equal(out, crop[:, ::-1])
    strong = ViewGroup("s", size_px=24, flip_p=0.0, jitter_p=1.0, brightness=1.0, contrast=1.0, saturation=1.0,
                       hue=0.5)
    for edge in (0.0, 1.0 - 1e-12):
        u = np.full(ffcv_ops.N_PARAMS, 0.9)
        P = ffcv_ops.Param
        u[P.FACTORS:P.FACTORS + 4] = edge                                      # factors 0 or 2, hue -+0.5
        u[P.ORDER:P.ORDER + 4] = rng.random(4)
        out, p, _ = run_finish_view(crop, u, strong)
        ref = torch_reference(crop[None], params_of(p), strong)[0].permute(1, 2, 0).mul(255).numpy()
        assert np.abs(out - ref).max() < 1.5


@pytest.mark.parametrize("group", [
    ViewGroup("global", size_px=224, area=(0.08, 1.0)),
    ViewGroup("local", size_px=96, area=(0.05, 0.14), ratio=(0.5, 2.0), crop_p=0.7),
    ViewGroup("narrow", size_px=32, area=(0.9, 1.0), ratio=(3.0, 4.0)),          # mostly the fallback
    ViewGroup("centre", size_px=32, centre_crop=0.875, flip_p=0.0),              # evaluation's centre crop
], ids=lambda g: g.name)
def test_compiled_crop_law_equals_the_reference_law(group: ViewGroup) -> None:
    """`ffcv_ops.crop_window` (the decoder's compiled crop) gives the box of `augment.crop_boxes` on the
    same uniforms, for images from 1 px wide to panoramas; the fallback and the whole image are hit."""
    rng = np.random.default_rng(7)
    n = 3000
    hw = torch.from_numpy(np.stack([rng.integers(1, 900, n), rng.integers(1, 900, n)], 1))
    hw[:50, 1] = 1                                                               # one pixel wide
    hw[50:100, 1] = hw[50:100, 0] * 6                                            # panoramas
    u = torch.from_numpy(rng.random((n, augment.CROP_DRAWS)))
    ref = augment.crop_boxes(hw, group, u).numpy()
    log_ratio = np.log(np.array(group.ratio, np.float64))
    area = np.array(group.area, np.float64)
    got = np.empty((n, 4), np.int64)
    for i in range(n):
        ffcv_ops.crop_window(u[i].numpy(), int(hw[i, 0]), int(hw[i, 1]), group.crop_p, area, log_ratio, got[i],
                             group.centre_crop)
    assert np.array_equal(got, ref), np.flatnonzero((got != ref).any(1))[:5]
    if group.name == "centre":
        return
    whole = (ref == np.concatenate([np.zeros((n, 2), np.int64), hw.numpy()], 1)).all(1)
    assert (~whole).any() and (whole.any() or group.crop_p == 1)
    if group.name == "narrow":
        centred = (ref[:, 0] == (hw[:, 0].numpy() - ref[:, 2]) // 2) & (ref[:, 1] == (hw[:, 1].numpy() - ref[:, 3]) // 2)
        assert (centred & ~whole).sum() > n // 10                               # the fallback, often


def staged_recipe(ops_on: bool) -> Recipe:
    strong = dict(jitter_p=0.6, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.2, gray_p=0.3, blur_p=0.5,
                  solarize_p=0.3) if ops_on else {}
    mild = dict(jitter_p=0.5, brightness=0.3, hue=0.1, solarize_p=0.3) if ops_on else {}
    return Recipe("colour", (
        ViewGroup("a", count=3, size_px=16, area=(0.2, 1.0), flip_p=0.5 if ops_on else 0.0, **strong),
        ViewGroup("w", count=2, size_px=16, area=(0.3, 1.0), flip_p=0.5 if ops_on else 0.0, **mild),
        ViewGroup("s", count=2, size_px=16, parent="w", **strong),
    ))


def test_loader_views_equal_torch_ops_on_the_same_crops(tmp_path: Path) -> None:
    """Through FFCV: the parameters read back from the rows, fed to torch_backend's ops on the very same
    crops (a loader with every op off draws the same windows), give the loader's views within one
    level; staged views are the staged ops on the weak view's unrounded pixels."""
    path = tmp_path / "train.beton"
    write_ffcv(ColourSplit(n=24, side=40), path)
    on, off = loader(path, staged_recipe(True), has_masks=False), loader(path, staged_recipe(False), has_masks=False)
    groups = {g.name: g for g in staged_recipe(True).groups}
    hits = 0
    for decoded, c in zip(on.decoded(), off):
        b, drawn = decoded.batch, decoded.params
        # global_views = the staged group's 2 views, then group a's 3 (views.Recipe.fields).
        crops = {"a": c.global_views[2:], "w": c.weak_views}                  # (V, B, 3, 16, 16) normalised
        got = {"a": b.global_views[2:], "w": b.weak_views, "s": b.global_views[:2]}
        finished = {}
        for name in ("a", "w"):
            crop = to_uint8(crops[name]).flatten(0, 1).permute(0, 2, 3, 1).to(torch.uint8).numpy()
            finished[name] = torch_reference(crop, drawn[name], groups[name])   # (V*B, 3, S, S)
        finished["s"] = augment.apply_color_ops(finished["w"], drawn["s"], groups["s"])
        for name, ref in finished.items():
            err = (unnormalize(got[name]).flatten(0, 1) - ref).abs().mul(255)
            assert float(err.max()) < 1.5, name
            hits += int(drawn[name].jitter.sum() + drawn[name].blur.sum())
        assert not bool(drawn["s"].flip.any())                                # staged views have no crop
    assert hits > 20


MIX_RECIPE = Recipe("mix", (ViewGroup("g", count=2, size_px=16, area=(0.2, 1.0), jitter_p=0.5, brightness=0.4),))


def unnormalize(x: torch.Tensor) -> torch.Tensor:
    return x * 0.25 + 0.5


@pytest.mark.parametrize("mixer", ["mixup", "cutmix"])
def test_sdmp_mix_batch_contract_and_torch_reference(small, mixer: str) -> None:
    path, _ = small
    for b in loader(path, MIX_RECIPE, mix=MixSpec("sdmp", alpha=1.0, sdmp_mixers=(mixer,)), seed=2):
        x = b.global_views                                                    # (2, 8, 3, 16, 16)
        assert b.mixed.shape == x.shape and b.mix_lam.shape == b.mix_partner.shape == (2, 8)
        check_range(b.mixed)
        assert b.mix_lam.dtype == torch.float32 and b.mix_partner.dtype == torch.int64
        assert bool(((b.mix_lam >= 0) & (b.mix_lam <= 1)).all())
        assert torch.equal(b.mix_partner, torch.arange(7, -1, -1).expand(2, 8))   # flip partner n-1-i
        assert torch.equal(b.mix_lam[0], b.mix_lam[1])                     # same lam for both views
        part = b.mix_partner[0]
        for v in range(2):
            if mixer == "mixup":
                ref = mixing.mixup(unnormalize(x[v]), b.mix_lam[v], part)
                assert torch.allclose(unnormalize(b.mixed[v]), ref, atol=1e-5)
                continue
            # CutMix pastes partner pixels bit-exactly: the changed pixels lie in the box, whose
            # bounding box reproduces the output; lam is the kept fraction of the (larger) true box.
            changed = (b.mixed[v] != x[v]).any(1)                             # (B, 16, 16)
            for i in range(8):
                ys, xs = torch.nonzero(changed[i], as_tuple=True)
                box = (torch.tensor([[ys.min(), xs.min(), ys.max() + 1, xs.max() + 1]]) if len(ys)
                       else torch.zeros(1, 4, dtype=torch.long))
                out, kept = mixing.cutmix(x[v], box.expand(8, 4), part)
                assert torch.equal(out[i], b.mixed[v, i])
                assert float(b.mix_lam[v, i]) <= float(kept[i]) + 1e-6


def test_dacl_mix_batch_contract_and_torch_reference(small) -> None:
    """DACL+ through the loader: each positive follows one of Eqs. (3), (5), (6) with its own partner
    and lam, and both positives of a sample use the same noise (tests/pipelines/mix_laws.py)."""
    path, _ = small
    lams, kinds, partners, lam_vb = [], [], [], []
    for b in loader(path, MIX_RECIPE, mix=MixSpec("dacl", alpha=0.6, dacl_noises=mixing.DACL_NOISES), seed=4):
        x = unnormalize(b.global_views)                                       # (2, 8, 3, 16, 16)
        assert b.mixed.shape == x.shape and b.mix_lam.shape == b.mix_partner.shape == (2, 8)
        check_range(b.mixed)
        assert b.mix_partner.dtype == torch.int64 and bool((b.mix_partner < 8).all())
        kinds.append(mix_laws.noise_kinds(unnormalize(b.mixed) * 255, x * 255, b.mix_partner, b.mix_lam, tol=1e-3))
        partners.append(b.mix_partner)
        lam_vb.append(b.mix_lam)
        lams.append(b.mix_lam.flatten())
    mix_laws.check_dacl_laws(torch.cat(partners, 1), torch.cat(lam_vb, 1), torch.cat(kinds, 1), 0.6,
                             own=torch.arange(8).repeat(len(kinds)), noises={0, 1, 2})
    lams = torch.cat(lams).numpy()
    assert stats.kstest(lams, stats.uniform(0.6, 0.4).cdf).pvalue > 1e-3


def test_build_loader_on_prepared_dataset_with_resizemix_and_dacl_image_source(tiny_data_root) -> None:
    """The registry path (`build_loader`, manifest, real preprocessor output) with both mix kinds."""
    groups = (ViewGroup("g", count=2, size_px=16, area=(0.2, 1.0)),          # the whole image, as the mix source is
              ViewGroup("image", count=1, size_px=16, crop_p=0.0, flip_p=0.0, interpolation="bilinear"))
    recipe = Recipe("mix-image", groups)
    base = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", split="train", recipe=recipe,
                      batch_size=16, num_workers=1, seed=1)
    b = next(iter(build_loader("ffcv", replace(base, mix=MixSpec("sdmp", sdmp_mixers=("resizemix",))))))
    x = b.global_views                                                        # (3, 16, 3, 16, 16)
    assert b.mixed.shape == x.shape and b.mix_lam.shape == (3, 16)            # every global view mixed
    assert torch.equal(b.mix_partner, torch.arange(15, -1, -1).expand(3, 16))
    assert torch.equal(b.mix_lam[0], b.mix_lam[1]) and bool(((b.mix_lam >= 0) & (b.mix_lam <= 1)).all())
    # ResizeMix keeps image i's own pixels outside the box: a fraction lam of them is unchanged.
    same = (unnormalize(b.mixed) - unnormalize(x)).abs().amax(2).flatten(2).lt(1e-6).float().mean(2)
    assert bool((same >= b.mix_lam - 1e-5).all())
    ld = build_loader("ffcv", replace(base, mix=MixSpec("dacl", alpha=0.5, dacl_noises=("linear",), source="image")))
    b = next(iter(ld))
    image = unnormalize(b.global_views[2])                                    # = the source: the whole image
    assert b.mixed.shape == (2, 16, 3, 16, 16) and bool((b.mix_partner != torch.arange(16)).all())
    for v in range(2):
        ref = mixing.dacl_linear(image, b.mix_partner[v], b.mix_lam[v])
        assert torch.allclose(unnormalize(b.mixed[v]), ref, atol=1e-5)


@PATHS
def test_saliency_background_goes_before_the_colour_ops(small, compiled: bool) -> None:
    """RELICv2 Listing 1 (augment.finish_views' order), on both paths: with solarize always on, the
    gray background is solarized like the rest of the view."""
    path, _ = small
    group = ViewGroup("large", count=2, size_px=16, crop_p=0.0, flip_p=0.0, saliency_p=1.0, solarize_p=1.0)
    ld = loader(path, Recipe("sal", (group,)), compiled)
    checked = 0
    for decoded in ld.decoded():
        px = unnormalize(decoded.batch.global_views).flatten(0, 1)              # (V*B, 3, 16, 16)
        level = decoded.params["large"].gray_level                               # (V*B,)
        want = torch.where(level >= 0.5, 1.0 - level, level)
        corner = px[:, :, 0, 0]                                       # the whole image: a background pixel
        tol = 0.6 / 255 if compiled else 1e-5
        assert torch.allclose(corner, want.view(-1, 1).expand(-1, 3), atol=tol)
        checked += int((level > 0.55).sum())                                   # where the two orders differ
    assert checked > 5


def test_the_lean_os_cache_reads_ffcv_s_allocations_without_per_record_maps(small) -> None:
    """`LeanOSCacheManager`: the sorted allocation addresses and sizes the OS cache reads are FFCV's own
    manager's, without the per-record Python maps (a set per record, a dict per allocation: a loop over
    every record at start) that only FFCV's quasi-random order and process cache read; the loader built
    on it reads every record of the epoch."""
    from ffcv.memory_managers.os_cache import OSCacheManager
    from ffcv.reader import Reader

    from pipelines.ffcv_backend import LeanOSCacheManager

    path, split = small
    reader = Reader(str(path))
    lean, full = LeanOSCacheManager(reader), OSCacheManager(reader)
    assert np.array_equal(lean.ptrs, full.ptrs) and np.array_equal(lean.sizes, full.sizes)
    assert len(full.sample_to_pages) == len(split) and not hasattr(lean, "sample_to_pages")
    ld = loader(path, load_recipe("plain", 16, 8), batch_size=4)
    assert isinstance(ld.loader.memory_manager, LeanOSCacheManager)
    seen = torch.cat([b.index for b in ld])
    assert sorted(seen.tolist()) == list(range(len(split) // 4 * 4))
