"""The DALI graph of one rank: webdataset shards → decode once → every view of the recipe → mixes.

`graph` is the body of the pipeline function (`dali_backend` builds and runs it): the webdataset
reader (sharded by rank, shuffled within the rank's shard) → one decode (nvJPEG `mixed` on a GPU,
CPU otherwise) → per crop group and view: the crop window of `augment`'s law (`crop_window`),
resize with the flip folded into its ROI, saliency composite on the same window (`saliency`), the
colour ops (`colour_ops`); staged groups take their parent's output and add their own colour, blur
and solarize ops (one crop, two outputs); then the mixes of `pipelines.mixing`'s laws (`mixes`); every
output leaves normalised (`crop_mirror_normalize`: CHW float32, the formula of `batch.normalize`).

Colour jitter + grayscale are one `fn.coord_transform` per view: without the clamps the four
torchvision ops compose to the same affine map in every order (see `colour_ops`), so the random order
only changes where an intermediate value clips at 0/255; this pass clamps once at the end. Hue is
DALI's YIQ rotation by 2π·h (the `fn.hsv` model), an approximation of torchvision's HSV hue shift.
The pipeline is built with `enable_conditionals=True`: blur, solarize and saliency run only on the
samples whose coin came up. Every random op has its own seed derived from the pipeline seed and the
op's name (`Seeds`), so switching one op off leaves the other draws unchanged.

Deviations from the reference recipe: the jitter ops are fused as above (order-independent up to
clamping, YIQ hue); the Gaussian window is 2·ceil(3σ)+1 rather than `augment.blur_kernel_px`
(weights beyond 3σ are < 0.3 % of the mass); the mixes are rounded to uint8 before normalisation.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath

from pipelines import schema
from pipelines.augment import CROP_TRIES, GRAY_WEIGHTS, SALIENCY_MIN_COVERAGE, blur_sigma_px
from pipelines.loader import LoaderSpec, derive_seed
from pipelines.mixing import MixSpec
from pipelines.views import ViewGroup

_SALIENCY_MIN_PPM = round(SALIENCY_MIN_COVERAGE * 1_000_000)   # the .rec coverage is in parts per million
_INTERP = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}
# RGB <-> YIQ, for the hue rotation M(θ) = C0 + cos θ·C1 + sin θ·C2 (constants, so θ stays per sample).
_RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ2RGB = np.linalg.inv(_RGB2YIQ)
_HUE_C0 = (_YIQ2RGB @ np.diag([1.0, 0.0, 0.0]) @ _RGB2YIQ).astype(np.float32)
_HUE_C1 = (_YIQ2RGB @ np.diag([0.0, 1.0, 1.0]) @ _RGB2YIQ).astype(np.float32)
_HUE_C2 = (_YIQ2RGB @ np.array([[0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]]) @ _RGB2YIQ).astype(np.float32)
_GRAY_W = np.array(GRAY_WEIGHTS, dtype=np.float32)
_GRAY_M = np.tile(_GRAY_W, (3, 1))                                               # G = 1wᵀ, rows = w
_GH_C0, _GH_C1, _GH_C2 = (_GRAY_M @ c for c in (_HUE_C0, _HUE_C1, _HUE_C2))     # G·H = Σ coef · G·C_k


class Seeds:
    """Each random op's seed from the pipeline seed and the op's name, not from its creation order:
    a recipe with an op switched off (or a conditional) draws the same other values."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, name: str) -> int:
        return derive_seed(self.seed, zlib.crc32(name.encode())) % (2**31 - 1)


def crop_window(shape, g: ViewGroup, sd: Seeds, tag: str):
    """Per-sample crop window (y0, x0, h, w) in pixels, `augment.sample_crop_boxes`'s law."""
    H, W = shape[0], shape[1]
    area = fn.random.uniform(range=list(g.area), shape=[CROP_TRIES], seed=sd(f"{tag}/area")) * (H * W)
    logr = fn.random.uniform(range=[math.log(g.ratio[0]), math.log(g.ratio[1])], shape=[CROP_TRIES],
                             seed=sd(f"{tag}/ratio"))
    r = dmath.exp(logr)
    w = dmath.floor(dmath.sqrt(area * r) + 0.5)                       # (TRIES,) candidates
    h = dmath.floor(dmath.sqrt(area / r) + 0.5)
    ok = fn.cast((w > 0.0) & (w <= W) & (h > 0.0) & (h <= H), dtype=types.FLOAT)
    ks = types.Constant(np.arange(CROP_TRIES, dtype=np.float32))
    first = fn.reductions.min(ks + CROP_TRIES * (1.0 - ok))               # first valid try, or >= TRIES
    pick = fn.cast(ks == first, dtype=types.FLOAT)                        # one-hot (or zeros: none valid)
    hit = fn.reductions.sum(pick)                                         # 1 if a try was valid
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


def colour_ops(x, g: ViewGroup, debug: dict, tag: str, sd: Seeds):
    """Jitter + grayscale (one fused affine pass), blur, solarize of `g` on uint8 HWC views `x`.

    Called inside a pipeline built with `enable_conditionals=True`: the `if` on a per-sample DataNode
    splits the batch so that blur and solarize run only on the samples whose coin came up.
    """
    jitter = g.jitter_p > 0 and bool(g.brightness or g.contrast or g.saturation or g.hue)
    if jitter or g.gray_p > 0:
        # One `coord_transform` for the four jitter ops and grayscale instead of five, and two
        # reductions instead of eight (colour ops alone had cost more than half of the time of the
        # relicv2 recipe). Brightness b·I, contrast c·I + (1-c)·mean_gray·1, saturation
        # S = s·I + (1-s)·G (G = 1wᵀ), hue H and grayscale G compose, without the clamps, to the
        # same affine map in any order: the matrices αI + βG commute (G² = G as Σw = 1), H fixes the
        # gray axis (H·1 = 1) and wᵀH = wᵀ up to the YIQ-vs-torchvision luma weights (|Δw| ≤ 1e-4),
        # and brightness scales the mean that a later contrast takes. So
        # y = b·c·[(1-gr)·s·H + (1-(1-gr)·s)·GH]·x + b·(1-c)·μ_gray·1, with μ_gray the view's mean
        # gray. What the random order still changes in torchvision is only where an intermediate
        # value clips at 0/255 (and uint8 rounding between ops): this pass clamps once at the end,
        # so the drawn order is not needed and not drawn.
        b = c = s = 1.0
        theta = None
        if jitter:
            on = fn.cast(fn.random.coin_flip(probability=g.jitter_p, seed=sd(f"{tag}/jitter")), dtype=types.FLOAT)
            debug[f"{tag}/jitter"] = on

            def factor(a, key):  # torchvision: U(max(0, 1-a), 1+a), neutral (1) when jitter is off
                if a <= 0:
                    return 1.0
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
            h_m = types.Constant(_HUE_C0) + cos_t * types.Constant(_HUE_C1) + sin_t * types.Constant(_HUE_C2)  # H
            gh_m = types.Constant(_GH_C0) + cos_t * types.Constant(_GH_C1) + sin_t * types.Constant(_GH_C2)    # G·H
        keep = (1.0 - gr) * s
        m = b * c * (keep * h_m + (1.0 - keep) * gh_m)
        if jitter and g.contrast > 0:
            mu = fn.reductions.mean(x, axes=[0, 1])                        # (3,) mean RGB of the view
            mean_gray = fn.reductions.sum(mu * types.Constant(_GRAY_W))
            t = (b * (1.0 - c) * mean_gray) * types.Constant(np.ones(3, dtype=np.float32))
            if x.device == "gpu":      # T computed on the GPU cannot be an argument input (CPU only)
                x = fn.cast(fn.coord_transform(x, M=m, dtype=types.FLOAT) + t, dtype=types.UINT8)  # rounds, saturates
            else:
                x = fn.coord_transform(x, M=m, T=t, dtype=types.UINT8)
        else:
            x = fn.coord_transform(x, M=m, dtype=types.UINT8)
    if g.blur_p > 0:
        sig = fn.random.uniform(range=list(blur_sigma_px(g)), seed=sd(f"{tag}/sigma"))
        if g.blur_p < 1.0:
            bl = fn.random.coin_flip(probability=g.blur_p, dtype=types.BOOL, seed=sd(f"{tag}/blur"))
            debug[f"{tag}/blur"] = fn.cast(bl, dtype=types.FLOAT)
            if bl:                                     # conditional: only the samples that drew it
                x = blur(x, sig)
        else:
            debug[f"{tag}/blur"] = sig * 0.0 + 1.0
            x = blur(x, sig)
    if g.solarize_p > 0:
        so = fn.random.coin_flip(probability=g.solarize_p, dtype=types.BOOL, seed=sd(f"{tag}/solarize"))
        debug[f"{tag}/solarize"] = fn.cast(so, dtype=types.UINT8)
        if so:                                         # conditional: only the drawn samples
            x = solarize(x)
    return x


def blur(x, sig):
    # The window is DALI's 2·ceil(3σ)+1 from sigma rather than the fixed 10 % kernel (23 px at 224):
    # a few times cheaper for the small σ most draws give (docs/benchmarks.md, kernel notes).
    return fn.gaussian_blur(x, sigma=sig)


def solarize(x):
    # 255 - v == v XOR 255 on uint8: one uint8 arithmetic op instead of five casts and products.
    return x ^ ((x >= 128) * types.Constant(255, dtype=types.UINT8))


def saliency(x, mask, start, end, size_px: int, level):
    """Background (mask < 0.5 on the same, possibly mirrored, window) replaced by gray `level`."""
    m = fn.resize(mask, size=[size_px, size_px], roi_start=start, roi_end=end,
                  interp_type=types.INTERP_LINEAR, antialias=True)
    keep = fn.cast(m >= 128, dtype=types.UINT8)                           # (S, S, 1)
    return fn.cast(keep * x + (1 - keep) * level, dtype=types.UINT8)


def box_mask(size: int, y0, x0, y1, x1):
    """(S, S, 1) float, 1 inside [y0, y1) x [x0, x1)."""
    yy = types.Constant(np.arange(size, dtype=np.float32).reshape(size, 1, 1))
    xx = types.Constant(np.arange(size, dtype=np.float32).reshape(1, size, 1))
    return fn.cast((yy >= y0) & (yy < y1) & (xx >= x0) & (xx < x1), dtype=types.FLOAT)


def _select(choice, parts: list):
    """Per sample, parts[choice]: the one-hot sum of the parts."""
    out = None
    for k, p in enumerate(parts):
        term = fn.cast(choice == k, dtype=types.FLOAT) * p
        out = term if out is None else out + term
    return out


def mixes(sources: list, mix: MixSpec, batch_size: int, size: int, debug: dict, sd: Seeds):
    """The intra-batch mixes of `mixing`'s laws on uint8 HWC views of side `size`.

    Returns:
        (mixed uint8 views, lam per view (area-corrected), partner per view or None for SDMP's n-1-i).
    """
    out, lams, partners = [], [], []
    if mix.kind == "sdmp":
        flip = list(range(batch_size - 1, -1, -1))                    # mixing.partner_index: n-1-i
        choice = fn.random.choice(len(mix.sdmp_mixers), seed=sd("mix/choice"))
        choice = fn.permute_batch(choice, indices=[0] * batch_size)   # one mixer per batch
        lam = fn.random.beta(alpha=mix.alpha, beta=mix.alpha, seed=sd("mix/lam"))  # per sample, all views
        side = dmath.floor(dmath.sqrt(1.0 - lam) * size)               # mixing.sdmp_box_sides
        half = dmath.floor(side * 0.5)
        # One box per sample for every view (same lam after clipping): CutMix centre anywhere,
        # clipped; ResizeMix top-left so that the box lies inside.
        cy = dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd("mix/cy")) * size)
        cx = dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd("mix/cx")) * size)
        cut = (dmath.max(cy - half, 0.0), dmath.max(cx - half, 0.0),
               dmath.min(cy + side - half, float(size)), dmath.min(cx + side - half, float(size)))
        ry = dmath.min(dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd("mix/ry")) * (size - side + 1.0)), size - side)
        rx = dmath.min(dmath.floor(fn.random.uniform(range=[0.0, 1.0], seed=sd("mix/rx")) * (size - side + 1.0)), size - side)
        debug.update({"mix/choice": choice, "mix/lam_drawn": lam, "mix/cutmix_box": fn.stack(*cut),
                      "mix/resizemix_box": fn.stack(ry, rx, ry + side, rx + side)})
        cut_lam = 1.0 - (cut[2] - cut[0]) * (cut[3] - cut[1]) / float(size * size)    # pixels kept
        resize_lam = 1.0 - side * side / float(size * size)
        s1 = dmath.max(side, 1.0)
        for x in sources:
            xp = fn.permute_batch(x, indices=flip)
            xf, xpf = fn.cast(x, dtype=types.FLOAT), fn.cast(xp, dtype=types.FLOAT)
            parts, plams = [], []
            for m in mix.sdmp_mixers:
                if m == "mixup":
                    parts.append(lam * xf + (1.0 - lam) * xpf)
                    plams.append(lam)
                elif m == "cutmix":
                    box = box_mask(size, *cut)
                    parts.append(xf * (1.0 - box) + xpf * box)
                    plams.append(cut_lam)
                else:
                    patch = fn.resize(xp, size=fn.stack(s1, s1), interp_type=types.INTERP_LINEAR, antialias=True,
                                      dtype=types.FLOAT)
                    canvas = fn.slice(patch, start=fn.cast(fn.stack(-ry, -rx), dtype=types.INT32), shape=[size, size],
                                      axes=[0, 1], out_of_bounds_policy="pad", fill_values=0)
                    box = box_mask(size, ry, rx, ry + side, rx + side)
                    parts.append(xf * (1.0 - box) + canvas * box)
                    plams.append(resize_lam)
            out.append(fn.cast(dmath.floor(_select(choice, parts) + 0.5), dtype=types.UINT8))
            lams.append(_select(choice, plams))
            partners.append(None)
    elif mix.kind == "dacl":
        noise = fn.random.choice(len(mix.dacl_noises), seed=sd("mix/noise"))   # DACL+: one per sample, all positives
        debug["mix/noise"] = noise
        for v, x in enumerate(sources):
            perm = fn.batch_permutation(no_fixed_points=True, seed=sd(f"mix/{v}/perm"))   # partner != itself
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
                    u = fn.random.uniform(range=[0.0, 1.0], shape=fn.cast(x.shape(), dtype=types.INT32),
                                          seed=sd(f"mix/{v}/binary"))
                    keep = fn.cast(u < (lam if mix.binary_rho == 0 else mix.binary_rho), dtype=types.FLOAT)
                    debug[f"mix/{v}/binary_mask"] = keep
                    parts.append(keep * xf + (1.0 - keep) * xpf)
            out.append(fn.cast(dmath.floor(_select(noise, parts) + 0.5), dtype=types.UINT8))
            lams.append(lam)
            partners.append(fn.cast(perm, dtype=types.INT64))
    return out, lams, partners


@dataclass
class Outputs:
    """The graph's outputs in order, and what each is: (Batch field or "rec" / "mix_lam" / "mix_partner"
    / "debug:<name>")."""

    nodes: list = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def add(self, name: str, node) -> None:
        self.names.append(name)
        self.nodes.append(node)


def graph(spec: LoaderSpec, tars: list[str], idxs: list[str], masks: bool, seed: int, mean, std,
          debug: bool) -> Outputs:
    """The pipeline function's body (see the module docstring).

    Args:
        tars, idxs: the split's shards and their index files, in this epoch's shard order.
        masks: read and use the masks (the dataset has them and some group draws saliency).
        seed: the pipeline's seed; every op's seed derives from it (`Seeds`).
        mean, std: the dataset's statistics for the normalisation.
        debug: also output the drawn parameters (`debug:<name>`), for tests.
    """
    sd = Seeds(seed)
    recipe = spec.recipe
    exts = [schema.DALI_IMAGE_EXT, schema.DALI_RECORD_EXT] + ([schema.DALI_MASK_EXT] if masks else [])
    dtypes = [types.UINT8, types.INT64] + ([types.UINT8] if masks else [])
    outs = fn.readers.webdataset(
        paths=tars, index_paths=idxs, ext=exts, dtypes=dtypes, shard_id=spec.rank,
        num_shards=spec.world_size, random_shuffle=spec.shuffle, initial_fill=256,
        pad_last_batch=True, name="reader")
    device = "mixed" if spec.device.startswith("cuda") else "cpu"
    img = fn.decoders.image(outs[0], device=device, output_type=types.RGB)
    rec = outs[1]
    mask = fn.decoders.image(outs[2], device=device, output_type=types.GRAY) if masks else None
    shape = fn.cast(img.shape(), dtype=types.FLOAT)                     # (3,) [H, W, C]
    dbg: dict = {}
    views: dict[str, list] = {}
    for g in recipe.crop_groups:
        views[g.name] = []
        for v in range(g.count):
            tag = f"{g.name}/{v}"
            y0, x0, h, w = crop_window(shape, g, sd, tag)
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
                          interp_type=_INTERP[g.interpolation], antialias=True, dtype=types.UINT8)
            dbg[f"{tag}/window"] = fn.stack(y0, x0, h, w, shape[0], shape[1])
            if masks and g.saliency_p > 0:
                gate = fn.cast(rec[2] >= _SALIENCY_MIN_PPM, dtype=types.UINT8)
                do = fn.cast(fn.random.coin_flip(probability=g.saliency_p, seed=sd(f"{tag}/saliency")),
                             dtype=types.UINT8) * gate
                level = fn.cast(fn.random.uniform(range=[0.0, 256.0], seed=sd(f"{tag}/level")), dtype=types.UINT8)
                dbg[f"{tag}/saliency"] = do
                if fn.cast(do, dtype=types.BOOL):          # conditional: mask resize only where drawn
                    x = saliency(x, mask, start, end, g.size_px, level)
            views[g.name].append(colour_ops(x, g, dbg, tag, sd))
    for g in recipe.by_role("staged"):
        views[g.name] = [colour_ops(x, g, dbg, f"{g.name}/{v}", sd) for v, x in enumerate(views[g.parent])]

    def normalized(x):
        # `batch.normalize` ((x/255 - mean)/std, CHW float32) inside the graph, in DALI's threads
        # and overlapped with the host through the prefetch queue, instead of a uint8 stack +
        # permute + normalize on the host.
        return fn.crop_mirror_normalize(x, dtype=types.FLOAT, output_layout="CHW",
                                        mean=[255.0 * m for m in mean], std=[255.0 * v for v in std])

    out = Outputs()
    for name, groups in recipe.fields.items():
        for g in groups:
            for x in views[g.name]:
                out.add(name, normalized(x))
    if spec.mix.kind != "none":
        if spec.mix.source == "image":
            image = views[next(g.name for g in recipe.groups if g.role == "image")][0]
            sources = [image, image]
        else:
            sources = [x for g in recipe.fields["global_views"] for x in views[g.name]]
        mixed, lams, partners = mixes(sources, spec.mix, spec.batch_size, recipe.global_px, dbg, sd)
        for x, lam, partner in zip(mixed, lams, partners):
            out.add("mixed", normalized(x))
            out.add("mix_lam", lam)
            if partner is not None:
                out.add("mix_partner", partner)
    out.add("rec", rec)
    if debug:
        for k, node in dbg.items():
            out.add(f"debug:{k}", node)
    return out
