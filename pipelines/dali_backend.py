"""DALI backend: webdataset shards → decode once → every view of the recipe → `Batch`.

One DALI graph per rank and epoch: `fn.readers.webdataset` (sharded by rank, shard order permuted
per epoch with a seed shared by all ranks, shuffled within the rank's shard with a per-rank seed)
→ one decode → per view group: crop window drawn per sample and view (torchvision's
RandomResizedCrop law: area ~ U(area), log-ratio ~ U(log ratio), 10 tries, then the whole image
with the ratio clamped), resize (the flip folded into its ROI), saliency background removal on
the same window, colour jitter + grayscale, Gaussian blur, solarize; staged groups take their
parent's output and add their own colour/blur/solarize ops (one crop, two outputs).

Colour jitter + grayscale are one `fn.coord_transform` per view: without the clamps the four
torchvision ops compose to the same affine map in every order (see `_colour_ops`), so the random order
only changes where an intermediate value clips at 0/255; this pass clamps once at the end. Hue is
DALI's YIQ rotation by 2π·h (the `fn.hsv` model), an approximation of torchvision's HSV hue shift.
The pipeline is built with `enable_conditionals=True`: blur, solarize and saliency run only on the
samples whose coin came up. Every random op has its own seed derived from the epoch seed and the op's
name, so switching one op off leaves the other draws unchanged. Views leave the graph normalised
(`crop_mirror_normalize`, CHW float32, the formula of `pipelines.batch.normalize`).

Mixes stay in the graph (`_mix_views`): partners come from `fn.permute_batch` (SDMP: the flip
partner n-1-i of `pipelines.mixing.partner_index`; DACL: `fn.batch_permutation` without fixed
points), boxes are pasted through a coordinate-grid mask, ResizeMix's partner is resized into its box
and placed with a padded `fn.slice`. They match the torch reference functions of `pipelines/mixing.py`
(tested). The mixer of an SDMP batch is sample 0's draw broadcast with `permute_batch`.

Speed (2 shared CPU cores, noisy; 2000 JPEGs 500x375 q90, batch 32, relicv2 224/96, same-run
medians of 3 after warm-up): the full recipe went from 17.4 to 36.6 img/s (2.1x) with the fused
colour pass, conditionals, the flip folded into the resize and normalisation in the graph
(crops + resizes only: 53.7 -> 71.2 img/s); `python -m pipelines.bench` then measured dali 74 img/s
against the PIL/torchvision baseline's 65 (1.13x). What is left is mostly the antialiased resizes of
large random windows (decode + 6 such resizes: ~185-220 img/s) and the sigma-derived blur.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pipelines import schema
from pipelines.batch import Batch, ReusedBuffers
from pipelines.loader import LoaderSpec
from pipelines.views import Recipe, ViewGroup

_TRIES = 10                                   # torchvision RandomResizedCrop attempts
_GRAY_W = (0.2989, 0.5870, 0.1140)            # torchvision rgb_to_grayscale weights
_SALIENCY_MIN_PPM = 50_000                    # coverage gate: 5 % of the image
# RGB <-> YIQ, for the hue rotation M(θ) = C0 + cos θ·C1 + sin θ·C2 (constants, so θ stays per sample).
_RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ2RGB = np.linalg.inv(_RGB2YIQ)
_HUE_C0 = (_YIQ2RGB @ np.diag([1.0, 0.0, 0.0]) @ _RGB2YIQ).astype(np.float32)
_HUE_C1 = (_YIQ2RGB @ np.diag([0.0, 1.0, 1.0]) @ _RGB2YIQ).astype(np.float32)
_HUE_C2 = (_YIQ2RGB @ np.array([[0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]]) @ _RGB2YIQ).astype(np.float32)
_GRAY_M = np.tile(np.array(_GRAY_W, dtype=np.float32), (3, 1))                  # G = 1wᵀ, rows = w
_GH_C0, _GH_C1, _GH_C2 = (_GRAY_M @ c for c in (_HUE_C0, _HUE_C1, _HUE_C2))     # G·H = Σ coef · G·C_k


class DaliBackendError(ValueError):
    """Bad dataset folder or spec for the DALI backend."""


def _shards(dataset_dir: Path, split: str) -> tuple[list[str], list[str], bool]:
    """(tar paths, index paths, has_masks) of one split."""
    folder = Path(dataset_dir) / split
    tars = sorted(str(p) for p in folder.glob("shard-*.tar"))
    if not tars:
        raise DaliBackendError(f"no DALI shards in {folder}; run `python -m preprocess` for this dataset")
    idxs = [t[: -len(".tar")] + ".idx" for t in tars]
    for i in idxs:
        if not Path(i).is_file():
            raise DaliBackendError(f"missing DALI index file {i}; re-run preprocessing with --force")
    with open(idxs[0], encoding="ascii") as f:
        f.readline()
        has_masks = f" {schema.DALI_MASK_EXT} " in f" {f.readline()} "
    return tars, idxs, has_masks


def _count(idxs: list[str]) -> int:
    n = 0
    for i in idxs:
        with open(i, encoding="ascii") as f:
            n += int(f.readline().split()[1])
    return n


def _manifest(dataset_dir: Path) -> dict:
    return schema.read_manifest(dataset_dir)           # refuses incomplete or damaged datasets


def _stats(manifest) -> tuple[tuple[float, ...], tuple[float, ...]]:
    get = manifest.get if isinstance(manifest, dict) else (lambda k: getattr(manifest, k, None))
    mean, std = get("mean"), get("std")
    if mean is None or std is None:
        raise DaliBackendError("manifest has no mean/std; re-run preprocessing with --force")
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _rank_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """The sample range DALI's sharded readers give `rank` (shard i: [n·i/k, n·(i+1)/k))."""
    return n * rank // world, n * (rank + 1) // world


# ----------------------------------------------------------------------------------------------
# Round-trip reader (issue 2)


def _read_shards(tars, idxs, *, rank, world_size, batch_size, shuffle, seed):
    from nvidia.dali import fn, pipeline_def, types

    n = _count(idxs)
    lo, hi = _rank_range(n, rank, world_size)

    @pipeline_def(batch_size=batch_size, num_threads=1, device_id=None, seed=seed)
    def pipe():
        img, rec = fn.readers.webdataset(
            paths=tars, index_paths=idxs, ext=[schema.DALI_IMAGE_EXT, schema.DALI_RECORD_EXT],
            dtypes=[types.UINT8, types.INT64], shard_id=rank, num_shards=world_size,
            random_shuffle=shuffle, pad_last_batch=True, name="reader")
        return fn.decoders.image(img, device="cpu", output_type=types.RGB), rec

    p = pipe()
    p.build()
    left = hi - lo
    while left > 0:
        imgs, recs = p.run()
        k = min(batch_size, left)
        r = np.stack([np.asarray(recs[j]) for j in range(k)])   # (k, 3) [label, index, coverage]
        yield [np.asarray(imgs[j]) for j in range(k)], r[:, 0].copy(), r[:, 1].copy()
        left -= k


def read_records(dataset_dir, split: str, *, rank: int = 0, world_size: int = 1, batch_size: int = 32,
                 shuffle: bool = False, seed: int = 0) -> Iterator[tuple[list[np.ndarray], np.ndarray, np.ndarray]]:
    """Decoded images, labels and indices of one split, read by DALI on the CPU (round-trip tests).

    Args:
        dataset_dir: `<root>/<dataset>` with a valid manifest.
        split: "train" or "val".
        rank, world_size: this reader's shard of the records (DALI's contiguous sharding).
        batch_size: records per yielded batch (the last one may be shorter).
        shuffle, seed: DALI's buffered shuffle.

    Yields:
        (images HWC uint8 RGB, labels (k,) int64, indices (k,) int64) covering the rank's records once.
    """
    _manifest(Path(dataset_dir))
    tars, idxs, _ = _shards(Path(dataset_dir), split)
    yield from _read_shards(tars, idxs, rank=rank, world_size=world_size, batch_size=batch_size,
                            shuffle=shuffle, seed=seed)


# ----------------------------------------------------------------------------------------------
# View graph (issue 3)


def _roles(recipe: Recipe) -> tuple[list[ViewGroup], list[ViewGroup], list[ViewGroup]]:
    """(global groups, local groups, weak groups) in recipe order.

    Staged groups and plain groups of the largest size are global; parents of staged groups are weak;
    the other plain groups are local.
    """
    parents = {g.parent for g in recipe.groups if g.parent}
    names = {g.name for g in recipe.groups}
    for p in parents:
        if p not in names:
            raise DaliBackendError(f"recipe {recipe.name!r}: parent {p!r} is not a group name; fix the recipe")
    largest = max(g.size_px for g in recipe.groups)
    glob = [g for g in recipe.groups if g.parent or (g.name not in parents and g.size_px == largest)]
    local = [g for g in recipe.groups if not g.parent and g.name not in parents and g.size_px != largest]
    weak = [g for g in recipe.groups if g.name in parents]
    return glob, local, weak


def _crop_window(fn, types, shape, g: ViewGroup, sd, tag: str):
    """Per-sample crop window (y0, x0, h, w) in pixels, torchvision's RandomResizedCrop law."""
    from nvidia.dali import math as dmath

    H, W = shape[0], shape[1]
    area = fn.random.uniform(range=list(g.area), shape=[_TRIES], seed=sd(f"{tag}/area")) * (H * W)
    logr = fn.random.uniform(range=[math.log(g.ratio[0]), math.log(g.ratio[1])], shape=[_TRIES],
                              seed=sd(f"{tag}/ratio"))
    r = dmath.exp(logr)
    w = dmath.floor(dmath.sqrt(area * r) + 0.5)                       # (TRIES,) candidates
    h = dmath.floor(dmath.sqrt(area / r) + 0.5)
    ok = fn.cast((w > 0.0) & (w <= W) & (h > 0.0) & (h <= H), dtype=types.FLOAT)
    ks = types.Constant(np.arange(_TRIES, dtype=np.float32))
    first = fn.reductions.min(ks + _TRIES * (1.0 - ok))                    # first valid try, or >= TRIES
    pick = fn.cast(ks == first, dtype=types.FLOAT)                         # one-hot (or zeros: none valid)
    hit = fn.reductions.sum(pick)                                          # 1 if a try was valid
    w_t, h_t = fn.reductions.sum(pick * w), fn.reductions.sum(pick * h)
    # fallback: the whole image, its ratio clamped to the range (torchvision's central crop)
    in_r = W / H
    lo_r, hi_r = g.ratio
    too_narrow = fn.cast(in_r < lo_r, dtype=types.FLOAT)
    too_wide = fn.cast(in_r > hi_r, dtype=types.FLOAT)
    mid = 1.0 - too_narrow - too_wide
    w_f = too_narrow * W + too_wide * dmath.floor(H * hi_r + 0.5) + mid * W
    h_f = too_narrow * dmath.floor(W / lo_r + 0.5) + too_wide * H + mid * H
    if g.crop_p < 1.0:
        do = fn.cast(fn.random.coin_flip(probability=g.crop_p, seed=sd(f"{tag}/crop")), dtype=types.FLOAT)
        hit = hit * do
    w_c = hit * w_t + (1.0 - hit) * w_f
    h_c = hit * h_t + (1.0 - hit) * h_f
    uy = fn.random.uniform(range=[0.0, 1.0], seed=sd(f"{tag}/y"))
    ux = fn.random.uniform(range=[0.0, 1.0], seed=sd(f"{tag}/x"))
    y_r = dmath.min(dmath.floor(uy * (H - h_c + 1.0)), H - h_c)       # randint(0, H - h)
    x_r = dmath.min(dmath.floor(ux * (W - w_c + 1.0)), W - w_c)
    y0 = hit * y_r + (1.0 - hit) * dmath.floor((H - h_c) * 0.5)
    x0 = hit * x_r + (1.0 - hit) * dmath.floor((W - w_c) * 0.5)
    return y0, x0, h_c, w_c


def _colour_ops(fn, types, x, g: ViewGroup, size_px: int, debug: dict, tag: str, sd):
    """Jitter + grayscale (one fused affine pass), blur, solarize of `g` on uint8 HWC views `x`.

    Called inside a pipeline built with `enable_conditionals=True`: the `if` on a per-sample DataNode
    splits the batch so that blur and solarize run only on the samples whose coin came up.
    """
    from nvidia.dali import math as dmath

    jitter = g.jitter_p > 0 and bool(g.brightness or g.contrast or g.saturation or g.hue)
    if jitter or g.gray_p > 0:
        # One `coord_transform` for the four jitter ops and grayscale instead of five, and two
        # reductions instead of eight (with the conditionals and the flip fold below, the full
        # relicv2 224/96 recipe on 500x375 JPEGs, 2 shared cores: 1.6-2.0x, same-run medians;
        # colour ops alone had cost more than half of the time). Brightness b·I,
        # contrast c·I + (1-c)·mean_gray·1, saturation S = s·I + (1-s)·G (G = 1wᵀ), hue H and
        # grayscale G compose, without the clamps, to the same affine map in any order: the
        # matrices αI + βG commute (G² = G as Σw = 1), H fixes the gray axis (H·1 = 1) and wᵀH = wᵀ up
        # to the YIQ-vs-torchvision luma weights (|Δw| ≤ 1e-4), and brightness scales the mean that a
        # later contrast takes. So  y = b·c·[(1-gr)·s·H + (1-(1-gr)·s)·GH]·x + b·(1-c)·μ_gray·1,  with
        # μ_gray the view's mean gray. What the random order still changes in torchvision is only
        # where an intermediate value clips at 0/255 (and uint8 rounding between ops): this pass
        # clamps once at the end, so the drawn order is not needed and not drawn.
        one = 1.0
        b = c = s = one
        theta = None
        if jitter:
            on = fn.cast(fn.random.coin_flip(probability=g.jitter_p, seed=sd(f"{tag}/jitter")), dtype=types.FLOAT)
            debug[f"{tag}/jitter"] = on

            def factor(a, key):  # torchvision: U(max(0, 1-a), 1+a), neutral (1) when jitter is off
                if a <= 0:
                    return one
                u = fn.random.uniform(range=[max(0.0, 1.0 - a), 1.0 + a], seed=sd(f"{tag}/{key}"))
                return 1.0 + on * (u - 1.0)

            b, c = factor(g.brightness, "brightness"), factor(g.contrast, "contrast")
            s = factor(g.saturation, "saturation")
            if g.hue > 0:
                theta = on * fn.random.uniform(range=[-g.hue, g.hue], seed=sd(f"{tag}/hue")) * (2.0 * math.pi)
            drawn = [b, c, s, 0.0] if theta is None else [b, c, s, theta]
            debug[f"{tag}/jitter_factors"] = fn.stack(*[on * 0.0 + v for v in drawn])   # b, c, s, θ
        gr = 0.0
        if g.gray_p > 0:
            gr = fn.cast(fn.random.coin_flip(probability=g.gray_p, seed=sd(f"{tag}/gray")), dtype=types.FLOAT)
            debug[f"{tag}/gray"] = gr
        if theta is None:
            h_m, gh_m = types.Constant(np.eye(3, dtype=np.float32)), types.Constant(_GRAY_M)
        else:
            cos_t, sin_t = dmath.cos(theta), dmath.sin(theta)
            h_m = (types.Constant(_HUE_C0) + cos_t * types.Constant(_HUE_C1)
                   + sin_t * types.Constant(_HUE_C2))                      # (3, 3) hue rotation H
            gh_m = (types.Constant(_GH_C0) + cos_t * types.Constant(_GH_C1)
                    + sin_t * types.Constant(_GH_C2))                      # (3, 3) G·H
        keep = (1.0 - gr) * s
        m = b * c * (keep * h_m + (1.0 - keep) * gh_m)
        if jitter and g.contrast > 0:
            mu = fn.reductions.mean(x, axes=[0, 1])                        # (3,) mean RGB of the view
            mean_gray = fn.reductions.sum(mu * types.Constant(np.array(_GRAY_W, dtype=np.float32)))
            t = (b * (1.0 - c) * mean_gray) * types.Constant(np.ones(3, dtype=np.float32))
            x = fn.coord_transform(x, M=m, T=t, dtype=types.UINT8)
        else:
            x = fn.coord_transform(x, M=m, dtype=types.UINT8)
    if g.blur_p > 0:
        scale = size_px / 224.0
        sig = fn.random.uniform(range=[g.blur_sigma[0] * scale, g.blur_sigma[1] * scale],
                                seed=sd(f"{tag}/sigma"))
        if g.blur_p < 1.0:
            bl = fn.random.coin_flip(probability=g.blur_p, dtype=types.BOOL, seed=sd(f"{tag}/blur"))
            debug[f"{tag}/blur"] = fn.cast(bl, dtype=types.FLOAT)
            # Conditional: blur only the samples that drew it (p 0.1 for relicv2's odd views).
            if bl:
                x = _blur(fn, x, sig)
        else:
            debug[f"{tag}/blur"] = sig * 0.0 + 1.0
            x = _blur(fn, x, sig)
    if g.solarize_p > 0:
        so = fn.random.coin_flip(probability=g.solarize_p, dtype=types.BOOL, seed=sd(f"{tag}/solarize"))
        debug[f"{tag}/solarize"] = fn.cast(so, dtype=types.UINT8)
        if so:                                         # conditional: only the drawn samples
            x = _solarize(types, x)
    return x


def _blur(fn, x, sig):
    # The window is DALI's 2·ceil(3σ)+1 from sigma rather than the fixed 10 % kernel (23 px at 224):
    # the weights beyond 3σ are < 0.3 % of the mass, and on 2 cores, 224-px uint8, σ ~ U(0.1, 2) the
    # derived window measured 8.0 ms/img against 28.7 ms/img for the fixed 23 px (3.6x).
    return fn.gaussian_blur(x, sigma=sig)


def _solarize(types, x):
    # 255 - v == v XOR 255 on uint8: one uint8 arithmetic op instead of five casts and products.
    return x ^ ((x >= 128) * types.Constant(255, dtype=types.UINT8))


def _saliency(fn, types, x, mask, start, end, size_px: int, level):
    """Background (mask < 0.5 on the same, possibly mirrored, window) replaced by gray `level`."""
    m = fn.resize(mask, size=[size_px, size_px], roi_start=start, roi_end=end,
                  interp_type=types.INTERP_LINEAR, antialias=True)
    keep = fn.cast(m >= 128, dtype=types.UINT8)                           # (S, S, 1)
    return fn.cast(keep * x + (1 - keep) * level, dtype=types.UINT8)


def _check_spec(spec: LoaderSpec) -> None:
    """The recipe and mix checks of the graph, in plain Python before it is traced.

    (Inside the traced graph DALI's conditionals would wrap the error in a StagingError.)
    """
    _roles(spec.recipe)
    by_name = {g.name: g for g in spec.recipe.groups}
    for g in spec.recipe.groups:
        if not g.parent and g.interpolation not in ("bilinear", "bicubic"):
            raise DaliBackendError(f"group {g.name!r}: interpolation {g.interpolation!r}; use bilinear or bicubic")
        if g.parent and g.count != by_name[g.parent].count:
            raise DaliBackendError(f"staged group {g.name!r} has count {g.count}, parent "
                                   f"{by_name[g.parent].count}; make them equal")
    mix = spec.mix
    if mix.kind not in ("none", "sdmp", "dacl"):
        raise DaliBackendError(f"unknown mix kind {mix.kind!r}; use none, sdmp or dacl")
    if mix.kind == "sdmp":
        known = ("mixup", "cutmix", "resizemix")
        for m in mix.sdmp_mixers:
            if m not in known:
                raise DaliBackendError(f"unknown SDMP mixer {m!r}; use some of {known}")
    if mix.kind == "dacl":
        if not 0.0 <= mix.alpha < 1.0:
            raise DaliBackendError(f"DACL draws lam ~ U(alpha, 1): mix.alpha must be in [0, 1), got {mix.alpha}")
        known = ("linear", "geometric", "binary")
        for m in mix.dacl_noises:
            if m not in known:
                raise DaliBackendError(f"unknown DACL noise {m!r}; use some of {known}")


def _graph(spec: LoaderSpec, tars, idxs, has_masks: bool, debug: bool, seed: int, mean, std):
    """The pipeline function's body; returns (outputs, output names)."""

    def sd(key: str) -> int:
        # Each random op's seed from the pipeline seed and the op's name, not from its creation
        # order: a recipe with an op switched off (or a conditional) draws the same other values.
        return _epoch_seed(seed, zlib.crc32(key.encode()), 0)

    from nvidia.dali import fn, types

    glob, local, weak = _roles(spec.recipe)
    saliency = has_masks and any(g.saliency_p > 0 and g in glob and not g.parent for g in spec.recipe.groups)
    exts = [schema.DALI_IMAGE_EXT, schema.DALI_RECORD_EXT] + ([schema.DALI_MASK_EXT] if saliency else [])
    dtypes = [types.UINT8, types.INT64] + ([types.UINT8] if saliency else [])
    outs = fn.readers.webdataset(
        paths=tars, index_paths=idxs, ext=exts, dtypes=dtypes, shard_id=spec.rank,
        num_shards=spec.world_size, random_shuffle=spec.shuffle, initial_fill=256,
        pad_last_batch=True, name="reader")
    gpu = spec.device.startswith("cuda")
    img = fn.decoders.image(outs[0], device="mixed" if gpu else "cpu", output_type=types.RGB)
    rec = outs[1]
    mask = None
    if saliency:
        mask = fn.decoders.image(outs[2], device="mixed" if gpu else "cpu", output_type=types.GRAY)
    shape = fn.cast(img.shape(), dtype=types.FLOAT)                     # (3,) [H, W, C]
    interp = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}
    dbg: dict = {}
    views: dict[str, list] = {}
    by_name = {g.name: g for g in spec.recipe.groups}
    for g in spec.recipe.groups:
        if g.parent:
            continue
        outs_g = []
        for v in range(g.count):
            tag = f"{g.name}/{v}"
            y0, x0, h, w = _crop_window(fn, types, shape, g, sd, tag)
            if g.flip_p > 0:
                # The flip is folded into the resize: an x-ROI given right to left comes out
                # mirrored (bit-identical to fn.flip of the resized view), one pass less per view.
                fl = fn.random.coin_flip(probability=g.flip_p, seed=sd(f"{tag}/flip"))
                dbg[f"{tag}/flip"] = fl
                flf = fn.cast(fl, dtype=types.FLOAT)
                start, end = fn.stack(y0, x0 + flf * w), fn.stack(y0 + h, x0 + w - flf * w)
            else:
                start, end = fn.stack(y0, x0), fn.stack(y0 + h, x0 + w)
            x = fn.resize(img, size=[g.size_px, g.size_px], roi_start=start, roi_end=end,
                          interp_type=interp[g.interpolation], antialias=True, dtype=types.UINT8)
            dbg[f"{tag}/window"] = fn.stack(y0, x0, h, w, shape[0], shape[1])
            if saliency and g.saliency_p > 0 and g in glob:
                gate = fn.cast(rec[2] >= _SALIENCY_MIN_PPM, dtype=types.UINT8)
                do = fn.cast(fn.random.coin_flip(probability=g.saliency_p, seed=sd(f"{tag}/saliency")),
                             dtype=types.UINT8) * gate
                level = fn.cast(fn.random.uniform(range=[0.0, 256.0], seed=sd(f"{tag}/level")),
                                dtype=types.UINT8)                               # gray per image
                dbg[f"{tag}/saliency"] = do
                if fn.cast(do, dtype=types.BOOL):          # conditional: mask resize only where drawn
                    x = _saliency(fn, types, x, mask, start, end, g.size_px, level)
            x = _colour_ops(fn, types, x, g, g.size_px, dbg, tag, sd)
            outs_g.append(x)
        views[g.name] = outs_g
    for g in spec.recipe.groups:
        if g.parent:
            parent = by_name[g.parent]
            views[g.name] = [_colour_ops(fn, types, x, g, parent.size_px, dbg, f"{g.name}/{v}", sd)
                             for v, x in enumerate(views[g.parent])]
    def out(x):
        # `pipelines.batch.normalize` ((x/255 - mean)/std, CHW float32) inside the graph, in DALI's
        # threads and overlapped with the host through the prefetch queue; on the host the uint8
        # stack + permute + normalize of relicv2's views took ~8 ms/img. Measured: crops-only
        # 57 -> 71 img/s (1.25x), full recipe 1.3-1.5x. Same formula up to float rounding.
        return fn.crop_mirror_normalize(x, dtype=types.FLOAT, output_layout="CHW",
                                        mean=[255.0 * m for m in mean], std=[255.0 * v for v in std])

    names, nodes = [], []
    if spec.mix.kind != "none":
        mixed, lam, partner = _mix_views(fn, types, spec, [x for g in glob for x in views[g.name]], img, dbg,
                                             sd)
        for v, x in enumerate(mixed):
            names += [f"mixed:{v}", f"mix_lam:{v}"]
            nodes += [out(x), lam[v]]
            if partner[v] is not None:
                names.append(f"mix_partner:{v}")
                nodes.append(partner[v])
    for role, groups in (("global", glob), ("local", local), ("weak", weak)):
        for g in groups:
            for v, x in enumerate(views[g.name]):
                names.append(f"{role}:{g.name}/{v}")
                nodes.append(out(x))
    names.append("rec")
    nodes.append(rec)
    if debug:
        for k, node in dbg.items():
            names.append(f"debug:{k}")
            nodes.append(node)
    return nodes, names


def _box_mask(fn, types, size: int, y0, x0, y1, x1):
    """(S, S, 1) uint8, 1 inside [y0, y1) x [x0, x1)."""
    yy = types.Constant(np.arange(size, dtype=np.float32).reshape(size, 1, 1))
    xx = types.Constant(np.arange(size, dtype=np.float32).reshape(1, size, 1))
    return fn.cast((yy >= y0) & (yy < y1) & (xx >= x0) & (xx < x1), dtype=types.UINT8)


def _mix_views(fn, types, spec: LoaderSpec, sources: list, img, dbg: dict, sd):
    """Intra-batch mixes of `spec.mix` (DESIGN.md §4) on uint8 views; returns (views, lams, partners)."""
    from nvidia.dali import math as dmath

    mix, b = spec.mix, spec.batch_size
    if mix.kind == "dacl" and mix.source == "image":
        size = max(g.size_px for g in spec.recipe.groups)
        whole = fn.resize(img, size=[size, size], interp_type=types.INTERP_LINEAR, antialias=True)
        sources = [whole, whole]                       # two positives of the whole resized image
    size = spec.recipe.groups[0].size_px
    for g in spec.recipe.groups:
        size = max(size, g.size_px)
    out, lams, partners = [], [], []
    if mix.kind == "sdmp":
        flip = list(range(b - 1, -1, -1))              # pipelines.mixing.partner_index(b): n-1-i
        lam = fn.random.beta(alpha=mix.alpha, beta=mix.alpha, seed=sd("mix/lam"))  # per sample, all views
        choice = fn.random.choice(len(mix.sdmp_mixers), seed=sd("mix/choice"))
        choice = fn.permute_batch(choice, indices=[0] * b)             # one mixer per batch
        dbg["mix/choice"] = choice
        side = dmath.floor(size * dmath.sqrt(1.0 - lam))               # box side from lam, same per view
        side = dmath.min(side, float(size))
        for v, x in enumerate(sources):
            xp = fn.permute_batch(x, indices=flip)
            xf, xpf = fn.cast(x, dtype=types.FLOAT), fn.cast(xp, dtype=types.FLOAT)
            parts, plams = [], []
            for m in mix.sdmp_mixers:
                if m == "mixup":
                    parts.append(lam * xf + (1.0 - lam) * xpf)
                    plams.append(lam)
                elif m == "cutmix":                                    # centre anywhere, box clipped
                    cy = dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd(f"mix/{v}/cy")) * size)
                    cx = dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd(f"mix/{v}/cx")) * size)
                    half = dmath.floor(side * 0.5)
                    y0, x0 = dmath.max(cy - half, 0.0), dmath.max(cx - half, 0.0)
                    y1, x1 = dmath.min(cy + half, float(size)), dmath.min(cx + half, float(size))
                    box = fn.cast(_box_mask(fn, types, size, y0, x0, y1, x1), dtype=types.FLOAT)
                    parts.append(xf * (1.0 - box) + xpf * box)
                    plams.append(1.0 - (y1 - y0) * (x1 - x0) / float(size * size))  # pixels kept
                    dbg[f"mix/{v}/cutmix_box"] = fn.stack(y0, x0, y1, x1)
                else:                                                  # resizemix: box inside the image
                    y0 = dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd(f"mix/{v}/ry")) * (size - side + 1.0))
                    x0 = dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd(f"mix/{v}/rx")) * (size - side + 1.0))
                    y0, x0 = dmath.min(y0, size - side), dmath.min(x0, size - side)
                    s1 = dmath.max(side, 1.0)
                    patch = fn.resize(xp, size=fn.stack(s1, s1), interp_type=types.INTERP_LINEAR,
                                      antialias=False, dtype=types.FLOAT)
                    canvas = fn.slice(patch, start=fn.cast(fn.stack(-y0, -x0), dtype=types.INT32), shape=[size, size], axes=[0, 1],
                                      out_of_bounds_policy="pad", fill_values=0)
                    box = fn.cast(_box_mask(fn, types, size, y0, x0, y0 + side, x0 + side), dtype=types.FLOAT)
                    parts.append(xf * (1.0 - box) + canvas * box)
                    plams.append(1.0 - side * side / float(size * size))
                    dbg[f"mix/{v}/resizemix_box"] = fn.stack(y0, x0, y0 + side, x0 + side)
            sel = [fn.cast(choice == k, dtype=types.FLOAT) for k in range(len(parts))]
            y = sel[0] * parts[0]
            lv = sel[0] * plams[0]
            for k in range(1, len(parts)):
                y, lv = y + sel[k] * parts[k], lv + sel[k] * plams[k]
            out.append(fn.cast(dmath.floor(y + 0.5), dtype=types.UINT8))
            lams.append(lv)
            partners.append(None)                                      # n-1-i, filled on the host
    elif mix.kind == "dacl":
        for v, x in enumerate(sources):
            perm = fn.batch_permutation(no_fixed_points=True, seed=sd(f"mix/{v}/perm"))         # partner != itself
            xp = fn.permute_batch(x, indices=perm)
            lam = fn.random.uniform(range=[mix.alpha, 1.0], seed=sd(f"mix/{v}/lam"))
            xf, xpf = fn.cast(x, dtype=types.FLOAT), fn.cast(xp, dtype=types.FLOAT)
            parts = []
            for m in mix.dacl_noises:
                if m == "linear":
                    parts.append(lam * xf + (1.0 - lam) * xpf)
                elif m == "geometric":                                 # on [0, 1] pixels
                    parts.append(dmath.pow(xf / 255.0, lam) * dmath.pow(xpf / 255.0, 1.0 - lam) * 255.0)
                else:
                    keep = fn.cast(fn.random.uniform(range=[0.0, 1.0], shape=fn.cast(x.shape(), dtype=types.INT32),
                                                     seed=sd(f"mix/{v}/binary")) < lam, dtype=types.FLOAT)
                    dbg[f"mix/{v}/binary_mask"] = keep
                    parts.append(keep * xf + (1.0 - keep) * xpf)
            noise = fn.random.choice(len(parts), seed=sd(f"mix/{v}/noise"))    # DACL+: one noise per sample
            dbg[f"mix/{v}/noise"] = noise
            y = fn.cast(noise == 0, dtype=types.FLOAT) * parts[0]
            for k in range(1, len(parts)):
                y = y + fn.cast(noise == k, dtype=types.FLOAT) * parts[k]
            out.append(fn.cast(dmath.floor(y + 0.5), dtype=types.UINT8))
            lams.append(lam)
            partners.append(fn.cast(perm, dtype=types.INT64))
    return out, lams, partners


def _epoch_seed(seed: int, rank: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, rank, epoch]).generate_state(1)[0] % (2**31 - 1))


def _make_pipeline(spec: LoaderSpec, tars, idxs, has_masks: bool, epoch: int, mean, std, *, debug: bool = False,
                   checkpoint: str | None = None):
    from nvidia.dali import pipeline_def

    if spec.shuffle:  # shard order per epoch, same for every rank, so ranks see new records each epoch
        order = np.random.default_rng([spec.seed, epoch]).permutation(len(tars))
        tars, idxs = [tars[i] for i in order], [idxs[i] for i in order]
    gpu = spec.device.startswith("cuda")
    device_id = (torch.device(spec.device).index or 0) if gpu else None
    names: list[str] = []
    pipe_seed = _epoch_seed(spec.seed, spec.rank, epoch)

    # enable_conditionals: `if` on per-sample coins inside the graph (blur, solarize, saliency)
    # splits the batch, so those ops run only on the samples that drew them.
    @pipeline_def(batch_size=spec.batch_size, num_threads=max(1, spec.num_workers), device_id=device_id,
                  seed=pipe_seed, prefetch_queue_depth=2,
                  enable_checkpointing=True, checkpoint=checkpoint, enable_conditionals=True)
    def graph():
        nodes, out_names = _graph(spec, tars, idxs, has_masks, debug, pipe_seed, mean, std)
        names.extend(out_names)
        return tuple(nodes)

    pipe = graph()
    pipe.build()
    return pipe, names


def _to_torch(tl) -> torch.Tensor:
    if hasattr(tl, "as_cpu"):
        tl = tl.as_cpu()
    return torch.from_numpy(tl.as_array())


def _feed(tls: list, dev: torch.device, buffers: ReusedBuffers, k: int) -> torch.Tensor | None:
    """Copy V view outputs (DALI batches of (3, S, S) float32 samples) into one (V, k, 3, S, S)
    tensor on `dev`, one copy per view with DALI's `feed_ndarray`: GPU outputs device to device (no
    round trip through the host), CPU outputs into a reused host buffer (`ReusedBuffers`)."""
    if not tls:
        return None
    from nvidia.dali.backend import TensorListGPU
    from nvidia.dali.plugin.pytorch import feed_ndarray

    dense = [tl.as_tensor() for tl in tls]                                 # (B, 3, S, S) each
    shape = (len(dense), *dense[0].shape())
    on_gpu = isinstance(tls[0], TensorListGPU)
    out = torch.empty(shape, dtype=torch.float32, device=dev) if on_gpu else buffers.take(shape)
    stream = torch.cuda.current_stream(dev) if on_gpu else None
    for v, t in enumerate(dense):
        feed_ndarray(t, out[v], cuda_stream=stream)
    return out[:, :k].to(dev, non_blocking=True)


class DaliLoader:
    """The DALI `Loader` of one rank (see `pipelines.loader.Loader`)."""

    def __init__(self, spec: LoaderSpec, tars, idxs, has_masks: bool, mean, std, *, debug: bool = False):
        if spec.batch_size < 2 or spec.batch_size % 2:
            raise DaliBackendError(f"batch_size must be even and >= 2, got {spec.batch_size}")
        if spec.mix.kind not in ("none", "sdmp", "dacl"):
            raise DaliBackendError(f"unknown mix kind {spec.mix.kind!r}; use none, sdmp or dacl")
        if spec.mix.kind != "none" and not spec.drop_last:
            raise DaliBackendError("intra-batch mixes need full batches; set drop_last=True")
        if not 0 <= spec.rank < spec.world_size:
            raise DaliBackendError(f"rank {spec.rank} outside world_size {spec.world_size}")
        _check_spec(spec)
        self.spec, self.tars, self.idxs, self.has_masks = spec, tars, idxs, has_masks
        self.mean, self.std, self.debug = mean, std, debug
        self._buffers = ReusedBuffers()               # CPU device: the views land in reused host memory
        self.n = _count(idxs)
        lo, hi = _rank_range(self.n, spec.rank, spec.world_size)
        self.rank_count = hi - lo
        if spec.drop_last:
            self.length = (self.n // spec.world_size) // spec.batch_size   # equal on every rank
        else:
            self.length = -(-self.rank_count // spec.batch_size)
        if self.length == 0:
            raise DaliBackendError(f"{self.n} records give no full batch of {spec.batch_size} per rank; lower batch_size")
        self.epoch, self.done = 0, 0
        self._pipe, self._pipe_epoch, self._names, self._resume = None, None, None, None
        self.last_debug: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.done, self._pipe = epoch, 0, None

    def state_dict(self) -> dict:
        ckpt = self._pipe.checkpoint() if self._pipe is not None else None
        return {"epoch": self.epoch, "done": self.done, "dali": ckpt}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.done = int(state["epoch"]), int(state["done"])
        self._pipe, self._resume = None, state.get("dali")

    def _ensure_pipe(self) -> None:
        if self._pipe is None or self._pipe_epoch != self.epoch:
            ckpt, self._resume = self._resume, None
            self._pipe, self._names = _make_pipeline(self.spec, self.tars, self.idxs, self.has_masks,
                                                     self.epoch, self.mean, self.std, debug=self.debug,
                                                     checkpoint=ckpt)
            self._pipe_epoch = self.epoch

    def __iter__(self) -> Iterator[Batch]:
        self._ensure_pipe()
        dev = torch.device(self.spec.device)
        while self.done < self.length:
            outs = self._pipe.run()
            k = self.spec.batch_size
            if not self.spec.drop_last and self.done == self.length - 1:
                k = self.rank_count - self.done * self.spec.batch_size
            groups: dict[str, list] = {"global": [], "local": [], "weak": [], "mixed": [],  # DALI outputs,
                                       "mix_lam": [], "mix_partner": []}                 # or tensors
            rec = None
            self.last_debug = {}
            for name, tl in zip(self._names, outs):
                if name == "rec":
                    rec = _to_torch(tl)[:k]                                   # (B, 3)
                elif name.startswith("debug:"):
                    self.last_debug[name[6:]] = _to_torch(tl)[:k].numpy()
                elif name.startswith(("mix_lam", "mix_partner")):
                    groups[name.split(":")[0]].append(_to_torch(tl)[:k])     # (B,)
                else:
                    groups[name.split(":")[0]].append(tl)                     # B x (3, S, S) float32
            self.done += 1

            def stack(tls):
                return _feed(tls, dev, self._buffers, k)                         # (V, k, 3, S, S)

            lam = partner = None
            if groups["mixed"]:
                lam = torch.stack(groups["mix_lam"]).float().to(dev)          # (Vm, B)
                if self.spec.mix.kind == "sdmp":                              # partner_index: n-1-i
                    partner = torch.arange(k - 1, -1, -1).expand(len(groups["mixed"]), k)
                else:
                    partner = torch.stack(groups["mix_partner"])              # (Vm, B)
                partner = partner.to(dev)
            yield Batch(global_views=stack(groups["global"]), local_views=stack(groups["local"]),
                        weak_views=stack(groups["weak"]), mixed=stack(groups["mixed"]), mix_lam=lam,
                        mix_partner=partner,
                        index=rec[:, 1].to(dev), label=rec[:, 0].to(dev))
        self.epoch, self.done, self._pipe = self.epoch + 1, 0, None


def build(spec: LoaderSpec, *, debug: bool = False) -> DaliLoader:
    """The DALI loader of `spec` (verifies the manifest first).

    Args:
        spec: the loader spec; `spec.device` "cuda[:i]" runs decode on nvJPEG and the ops on the GPU.
        debug: also record the drawn parameters of the last batch in `loader.last_debug`.
    """
    dataset_dir = Path(spec.root) / spec.dataset
    mean, std = _stats(_manifest(dataset_dir))
    tars, idxs, has_masks = _shards(dataset_dir, spec.split)
    return DaliLoader(spec, tars, idxs, has_masks, mean, std, debug=debug)
