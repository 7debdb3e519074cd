"""The DALI graph of one rank: encoded images and the batch's drawn parameters in; every view of the
recipe and the mixes out, normalised, on the graph's device.

Every random parameter is drawn on the host, per batch, by the laws of the torch reference and with
the same generator calls (`augment.draw_crop_boxes`, `augment.draw_color_params`, `mixing.MIXES`),
by `draw_inputs`, and enters the graph through one `fn.external_source` (`dali_backend`: one input
per operator argument, `input_specs`, packed by kind). So the graph holds pixel operators and the
routing of the host's inputs, nothing else: no per-sample arithmetic
on the CPU that would grow with the views (the former in-graph draws were ~1,000 tiny CPU operators
per iteration for `relicv2`), and nothing waits for a decoded image (the crop windows come from the
sizes in the encoded images' headers, `shards.image_size`). The one exception is DACL's Binary Mixup
mask (and the Gaussian-noise baseline's delta), a random value per pixel: drawn in the graph, on the
graph's device (with the torch tail, `dali_tail`, on the device from seeds the host drew).

Per batch the images, and the masks where a view composites saliency, are decoded once. Per crop view
(`graph`): resize of the crop window, with the flip folded into the ROI (an x-range given right to left
comes out mirrored, bit-identical to a flip of the resized view) → saliency composite on the same
window (`saliency`), for the samples that drew it only (a conditional) → the colour ops (`colour_ops`:
on the GPU every sample runs blur and solarize with no-op parameters where it drew none, on the CPU a
conditional skips them). Staged groups take their parent's output and add their own colour ops. Then
the mixes (`mixes`): SDMP's mixers as one branch per mixer (the batch's mixer runs, the others see an
empty batch), CutMix and ResizeMix as `fn.multi_paste` of the box on the device, DACL's noises per
sample. Three workarounds of DALI 2.4.0 GPU bugs are marked where they are (ResizeMix's patch padded to
the canvas, empty paste regions out of the canvas, masks decoded outside the conditionals). Every
output leaves normalised (`crop_mirror_normalize`: the formula of `batch.normalize`), CHW, or HWC when
a channels-last network takes it (then the loader hands out a permuted view, no copy); with
`LoaderSpec.graph_dtype="uint8"` the views leave as uint8 and the loader normalises them on the device
with `batch.normalize` (the data-stall option the GPU check measures). With `LoaderSpec.gpu_tail="torch"`
the GPU graph stops at the crops (resize, flip, saliency composite): they leave as uint8 HWC, and the
loader finishes them, and makes the mixes, with batched torch operations on the device
(`pipelines.dali_tail`), from the draws that the source passes through (`tail_params`,
`dali_tail.tail_mix_draws`).

Colour jitter + grayscale are one `fn.coord_transform` per view (`colour_matrices`): without the clamps
the four torchvision ops compose to the same affine map in every order, so the random order only
changes where an intermediate value clips at 0/255; this pass clamps once at the end. Hue is DALI's
YIQ rotation by 2π·h (the `fn.hsv` model), an approximation of torchvision's HSV hue shift.

Deviations from the reference recipe: the jitter ops are fused as above (order-independent up to
clamping, YIQ hue); the Gaussian window is 2·ceil(3σ)+1 rather than `augment.blur_kernel_px` (weights
beyond 3σ are < 0.3 % of the mass); views and mixes are rounded to uint8 between ops.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from nvidia.dali import fn, types
from nvidia.dali import math as dmath

from pipelines.augment import GRAY_WEIGHTS, ViewParams, draw_color_params, draw_crop_boxes
from pipelines.dali_tail import (TAIL_BLUR, TAIL_C, TAIL_M, TAIL_SIGMA, TAIL_SOLARIZE, TAIL_WIDTH, tail_mix_draws,
                                 tail_views, uses_colour, uses_contrast)
from pipelines.mixing import MIXES, MixDraw, MixSpec, binary_rho, mix_lam, mix_source_views
from pipelines.spec import LoaderSpec
from pipelines.views import Recipe

_INTERP = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}
_DALI_TYPES = {np.dtype(np.uint8): types.UINT8, np.dtype(np.int32): types.INT32, np.dtype(np.int64): types.INT64,
               np.dtype(np.float32): types.FLOAT, np.dtype(np.bool_): types.BOOL}
# RGB <-> YIQ, for the hue rotation H(θ) = C0 + cos θ·C1 + sin θ·C2.
_RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_YIQ2RGB = np.linalg.inv(_RGB2YIQ)
_HUE_C = np.stack([_YIQ2RGB @ np.diag([1.0, 0.0, 0.0]) @ _RGB2YIQ,
                   _YIQ2RGB @ np.diag([0.0, 1.0, 1.0]) @ _RGB2YIQ,
                   _YIQ2RGB @ np.array([[0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]]) @ _RGB2YIQ])      # (3, 3, 3)
_GRAY_M = np.tile(np.array(GRAY_WEIGHTS), (3, 1))                                               # G = 1wᵀ
_SOLARIZED = [v if v < 128 else 255 - v for v in range(256)]          # levels >= half range inverted


def _png_1px() -> bytes:
    """A 1 x 1 gray PNG (level 0)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b""))


NO_MASK_PNG = _png_1px()      # the mask a sample that composites in no view brings to the once-per-batch decode


# ------------------------------------------------------------------------------------------------
# Host side: the batch's draws as the graph's inputs
# ------------------------------------------------------------------------------------------------


def colour_matrices(p: ViewParams) -> tuple[np.ndarray, np.ndarray]:
    """The fused jitter + grayscale of each view as y = M·x + C·μ (μ: the view's mean RGB).

    Brightness b·I, contrast c·I + (1-c)·mean_gray·1, saturation s·I + (1-s)·G (G = 1wᵀ), hue H and
    grayscale G compose, without the clamps, to the same affine map in any order: the matrices αI + βG
    commute (G² = G as Σw = 1), H fixes the gray axis (H·1 = 1) and wᵀH = wᵀ up to the YIQ-vs-torchvision
    luma weights (|Δw| ≤ 1e-4), and brightness scales the mean that a later contrast takes. So
    M = b·c·[k·H + (1 - k)·G·H] with k = (1 - gray)·s, and C = b·(1 - c)·G.

    Args:
        p: the views' draws (`augment.sample_color_params`): factors (N, 4) b, c, s, hue in turns;
            gray (N,) bool. Views without jitter carry the identity factors.

    Returns:
        (M (N, 3, 3), C (N, 3, 3)) float32.
    """
    f = p.factors.double().numpy()
    b, c, s, theta = f[:, 0], f[:, 1], f[:, 2], 2 * math.pi * f[:, 3]
    coef = np.stack([np.ones_like(theta), np.cos(theta), np.sin(theta)], 1)                  # (N, 3)
    hue = np.einsum("nk,kij->nij", coef, _HUE_C)                                              # (N, 3, 3)
    k = ((1.0 - p.gray.double().numpy()) * s)[:, None, None]
    m = (b * c)[:, None, None] * (k * hue + (1.0 - k) * (_GRAY_M @ hue))
    t = (b * (1.0 - c))[:, None, None] * _GRAY_M
    return m.astype(np.float32), np.broadcast_to(t, m.shape).astype(np.float32)


def blur_kernels(sigma: np.ndarray, drawn: np.ndarray) -> list[np.ndarray]:
    """Each view's Gaussian blur as one 2-D kernel made on the host (`colour_ops`, the GPU graph's
    `gpu_blur="filter"`): the outer product of the 1-D Gaussian of its sigma over DALI's window
    2·ceil(3σ)+1, normalised; a 1 x 1 identity where the view drew no blur, so that a view pays for the
    window it drew and nothing where it drew none.

    Args:
        sigma: (N,) sigmas in px. drawn: (N,) bool, the views that blur.

    Returns:
        N float32 kernels of (k, k), k odd (1 where not drawn).
    """
    out = []
    for s, on in zip(sigma.tolist(), drawn.tolist()):
        if not on:
            out.append(np.ones((1, 1), np.float32))
            continue
        radius = int(math.ceil(3 * s))
        g = np.exp(-0.5 * (np.arange(-radius, radius + 1) / s) ** 2)
        g /= g.sum()
        out.append(np.outer(g, g).astype(np.float32))
    return out


@dataclass
class Draws:
    """Everything drawn on the host for one batch: the reference draws, and the graph's inputs."""

    hw: torch.Tensor                                     # (B, 2) long image sizes
    boxes: dict[str, torch.Tensor]                       # crop group → (count·B, 4) y0, x0, h, w
    params: dict[str, ViewParams]                        # group → its views' parameters
    mix: MixDraw | None                                  # the mixes' draws (no pixel masks)
    mix_lam: torch.Tensor | None                         # (V, B) lam of each mixed view (Batch.mix_lam)
    inputs: dict[str, np.ndarray] = field(default_factory=dict)   # graph input name → (B, ...) batch
    reads_mask: np.ndarray | None = None                 # (B,) bool: the sample composites saliency in some view
    tail: np.ndarray | None = None                       # (B, V, TAIL_WIDTH) the torch tail's inputs (`tail_params`)
    tail_mix: np.ndarray | None = None                   # (B, ...) int64 the torch tail's mix draws (`tail_mix_draws`)


def torch_tail(spec: LoaderSpec, gpu: bool) -> bool:
    """Whether the graph stops at the crops and `dali_tail` finishes them (`LoaderSpec.gpu_tail`): on the
    GPU graph, and on the CPU graph that takes the GPU graph's branches (`gpu`)."""
    return gpu and spec.gpu_tail == "torch"


def tail_params(recipe: Recipe, params: dict[str, ViewParams], b: int) -> np.ndarray:
    """Each view's parameters of the torch tail (`dali_tail`): its colour matrices (`colour_matrices`),
    blur sigma and switch, solarize switch.

    Returns:
        (B, V, TAIL_WIDTH) float32, the views in `dali_tail.tail_views` order.
    """
    cols = []
    for g in tail_views(recipe):
        p, n = params[g.name], g.count * b
        m, t = colour_matrices(p)
        a = np.zeros((n, TAIL_WIDTH), np.float32)
        a[:, TAIL_M], a[:, TAIL_C] = m.reshape(n, 9), t.reshape(n, 9)
        a[:, TAIL_SIGMA], a[:, TAIL_BLUR], a[:, TAIL_SOLARIZE] = p.sigma.numpy(), p.blur.numpy(), p.solarize.numpy()
        cols.append(a.reshape(g.count, b, TAIL_WIDTH))
    return np.ascontiguousarray(np.concatenate(cols).transpose(1, 0, 2))


def draw_inputs(spec: LoaderSpec, hw: torch.Tensor, usable: torch.Tensor, masks: bool,
                gen: torch.Generator, gpu: bool = False) -> Draws:
    """Draw a batch's parameters (the reference's calls, in its order) and turn them into the graph's
    inputs: per crop view its ROI, per view its colour matrices and op switches, per mix its partner,
    weights and boxes.

    Args:
        spec: the loader spec (recipe with its mix source group, mix, batch size).
        hw: (B, 2) long heights and widths of the batch's images.
        usable: (B,) bool, `augment.saliency_usable` of the records' mask coverage.
        masks: whether the graph reads masks (`DatasetInfo.reads_masks`).
        gen: the batch's CPU generator (`EpochOrder.batch_seed`).
        gpu: the inputs of the GPU graph's branches (`colour_ops`), not the CPU graph's; with the torch
            tail (`torch_tail`) no colour inputs, the views' `tail_params` instead.

    Returns:
        The draws, with `inputs` {name: (B, ...) numpy batch}; the names depend on the spec and `gpu`.
    """
    recipe, b = spec.recipe, hw.shape[0]
    boxes = draw_crop_boxes(hw, recipe, gen)
    params = draw_color_params(recipe, b, gen)
    inputs: dict[str, np.ndarray] = {}
    reads_mask = np.zeros(b, bool)
    for g in recipe.crop_groups:
        y0, x0, h, w = boxes[g.name].double().numpy().T                                    # (N,) each
        flip = params[g.name].flip.numpy()
        # x-range right to left where flipped: the resize comes out mirrored
        start = np.stack([y0, np.where(flip, x0 + w, x0)], 1).astype(np.float32).reshape(g.count, b, 2)
        end = np.stack([y0 + h, np.where(flip, x0, x0 + w)], 1).astype(np.float32).reshape(g.count, b, 2)
        sal = (params[g.name].saliency & usable.repeat(g.count)).numpy().reshape(g.count, b)
        level = np.floor(params[g.name].gray_level.numpy() * 255 + 0.5).astype(np.uint8).reshape(g.count, b)
        for v in range(g.count):
            tag = f"{g.name}/{v}"
            inputs[f"{tag}/roi_start"], inputs[f"{tag}/roi_end"] = start[v], end[v]
            if masks and g.saliency_p > 0:
                inputs[f"{tag}/saliency"], inputs[f"{tag}/level"] = sal[v], level[v]
                reads_mask |= sal[v]
    tail = tail_params(recipe, params, b) if torch_tail(spec, gpu) else None
    coloured = tail_views(recipe) if tail is None else ()     # with the torch tail, in `tail` instead
    for g in coloured:
        p = params[g.name]
        m, t = colour_matrices(p) if uses_colour(g) else (None, None)
        for v in range(g.count):
            tag, rows = f"{g.name}/{v}", slice(v * b, (v + 1) * b)
            if m is not None:
                inputs[f"{tag}/colour"] = m[rows]
                if uses_contrast(g):
                    inputs[f"{tag}/contrast"] = t[rows]
            if g.blur_p > 0 and gpu and spec.gpu_blur == "filter":
                inputs[f"{tag}/blur_kernel"] = blur_kernels(p.sigma[rows].numpy(), p.blur[rows].numpy())
            elif g.blur_p > 0:
                sigma = p.sigma[rows].numpy().astype(np.float32)
                inputs[f"{tag}/sigma"] = sigma
                if g.blur_p < 1 and gpu and spec.gpu_blur == "gaussian":   # a no-op window of 1 where not drawn
                    inputs[f"{tag}/blur_window"] = np.where(p.blur[rows].numpy(), 2 * np.ceil(3 * sigma) + 1,
                                                            1).astype(np.int32)
                elif g.blur_p < 1:             # the conditional's predicate (the CPU graph's, gpu_blur="conditional")
                    inputs[f"{tag}/blur"] = p.blur[rows].numpy()
            if g.solarize_p > 0 and gpu:       # min(x, x ^ mask): 255 inverts the upper levels, 0 nothing
                inputs[f"{tag}/solarize_mask"] = np.where(p.solarize[rows].numpy(), 255, 0).astype(np.uint8)
            elif g.solarize_p > 0:
                inputs[f"{tag}/solarize"] = p.solarize[rows].numpy()
    mix = lam = None
    if spec.mix.kind != "none":
        size, v = recipe.global_px, len(mix_sources(spec))
        if spec.mix.kind == "dacl":
            mix = MIXES["dacl"].sample(v, b, size, size, spec.mix, gen, "cpu", pixel_masks=False)
        else:
            mix = MIXES["sdmp"].sample(v, b, size, size, spec.mix, gen, "cpu")
        lam = mix_lam(mix, size, size)
        if tail is None:
            inputs.update(_mix_inputs(spec.mix, mix, lam, size))
    tail_mix = tail_mix_draws(spec.mix, mix) if tail is not None and mix is not None else None
    return Draws(hw=hw, boxes=boxes, params=params, mix=mix, mix_lam=lam, inputs=inputs, reads_mask=reads_mask,
                 tail=tail, tail_mix=tail_mix)


def is_partner(name: str) -> bool:
    """Whether graph input `name` is a mix's partner (`_mix_inputs`): indices into the graph's batch, for
    `fn.permute_batch`."""
    return name.startswith("mix/") and name.endswith("/partner")


def _mix_inputs(mix: MixSpec, d: MixDraw, lam: torch.Tensor, size: int) -> dict[str, np.ndarray]:
    """The mixes' graph inputs from their draws (SDMP: one set for every view; DACL: per positive)."""
    out: dict[str, np.ndarray] = {}
    b = d.partner.shape[1]
    if mix.kind == "sdmp":
        out["mix/partner"] = d.partner[0].numpy().astype(np.int32)
        for m in mix.sdmp_mixers[:-1]:          # the branch predicates (`_sdmp`: the last is the else)
            out[f"mix/{m}"] = np.full(b, d.mixer == m)
        if "mixup" in mix.sdmp_mixers:
            out["mix/lam"], out["mix/lam_other"] = lam[0].numpy(), (1 - lam[0]).numpy()
        box = d.boxes[0].numpy()                                                            # (B, 4) y0, x0, y1, x1
        side = box[:, 2:] - box[:, :2]                                                      # (B, 2) h, w
        # Workaround, DALI 2.4.0 (upstream bug): the GPU `multi_paste` opens a region of zero area (a
        # box of side 0, lam near 1) and never closes it, pasting from its anchor to the bottom-right
        # corner. An empty region is placed at the canvas's far corner, where it can never open.
        empty = (side == 0).any(1)
        at = np.where(empty[:, None], size, box[:, :2])
        side = np.where(empty[:, None], 0, side)
        anchor = np.stack([np.zeros((b, 2)), at], 1).astype(np.int32)                      # (B, 2 regions, 2)
        shape = np.stack([np.full((b, 2), size), side], 1).astype(np.int32)
        for m in ("cutmix", "resizemix"):
            if m in mix.sdmp_mixers:
                out[f"mix/{m}_anchor"], out[f"mix/{m}_shape"] = anchor, shape
        if "resizemix" in mix.sdmp_mixers:
            # the partner resized to the box (a side of 0 pastes nothing; the resize needs >= 1 px)
            out["mix/resizemix_size"] = np.maximum(shape[:, 1], 1).astype(np.float32)
    else:
        for v in range(d.partner.shape[0]):
            if set(mix.dacl_noises) != {"gaussian"}:    # the Gaussian-noise baseline mixes in no partner
                out[f"mix/{v}/partner"] = d.partner[v].numpy().astype(np.int32)
            if {"linear", "geometric"} & set(mix.dacl_noises):
                out[f"mix/{v}/lam"], out[f"mix/{v}/lam_other"] = d.lam[v].numpy(), (1 - d.lam[v]).numpy()
            if "binary" in mix.dacl_noises:
                out[f"mix/{v}/rho"] = binary_rho(mix, d.lam)[v].numpy().astype(np.float32)
        for j, n in enumerate(mix.dacl_noises[:-1]):   # the branch predicates (`_dacl`: the last is the else)
            out[f"mix/{n}"] = (d.noise == j).numpy()
    return out


def input_specs(spec: LoaderSpec, masks: bool, gpu: bool = False) -> list[tuple[str, np.dtype, tuple[int, ...] | int]]:
    """(name, dtype, sample shape) of every graph input besides the encoded images (and masks), in the
    order `draw_inputs` makes them (from a draw on stand-in image sizes: names and shapes do not depend
    on the data); an input whose samples differ in shape (a list: `blur_kernels`) has its sample ndim,
    an int, for a shape."""
    b = spec.batch_size
    hw = torch.full((b, 2), max(g.size_px for g in spec.recipe.groups), dtype=torch.long)
    d = draw_inputs(spec, hw, torch.ones(b, dtype=torch.bool), masks, torch.Generator().manual_seed(0), gpu)
    return [(name, a[0].dtype, a[0].ndim) if isinstance(a, list) else (name, a.dtype, a.shape[1:])
            for name, a in d.inputs.items()]


def dali_type(dtype: np.dtype):
    """The DALI type of a numpy dtype of the graph inputs."""
    return _DALI_TYPES[np.dtype(dtype)]


# ------------------------------------------------------------------------------------------------
# The graph
# ------------------------------------------------------------------------------------------------


def colour_ops(x, inputs: dict, tag: str, gpu_branches: bool = False, contrast_on: str = "device"):
    """Jitter + grayscale (one fused affine pass), blur, solarize on uint8 HWC views `x`, as view `tag`'s
    inputs say.

    The CPU graph takes the view's contrast offset as the colour pass's argument, and splits the batch
    with a conditional (`enable_conditionals=True`: an `if` on a per-sample input) so that blur and
    solarize run only on the samples whose coin came up. The GPU graph adds the offset, made on the
    device (so it cannot be an argument), after a float pass, and gives every sample the same
    operators with no-op parameters (a blur window of 1; solarize as min(x, x XOR mask) with a
    per-sample mask of 255 or 0: two uint8 operators, as each arithmetic node is one operator in DALI):
    no conditional, whose splits and merges of the views and their arguments cost more operators there
    than the work they skip (`gpu_blur="conditional"` keeps the CPU graph's conditional blur, to time the
    two on a GPU). With `contrast_on="host"` (`LoaderSpec.gpu_contrast`) the GPU graph copies
    each view's mean RGB (3 values a sample) to the host instead, where the offset is made as the CPU
    graph makes it, and the colour pass takes it as its argument and rounds to uint8 itself: one
    operator on the device where the float pass, the add and the cast were three, at the price of a
    copy back that the pass waits for (DALI's dynamic executor, its default, allows it).

    Args:
        inputs: the graph's inputs; blur and solarize take the GPU graph's form where `draw_inputs`
            made its inputs (`gpu=True`).
        gpu_branches: take the GPU graph's branch on the CPU too (tests compare the two there).
        contrast_on: where the GPU graph's branch makes the contrast offset, "device" or "host".
    """
    if f"{tag}/colour" in inputs:
        m = inputs[f"{tag}/colour"]
        if f"{tag}/contrast" in inputs:
            on_device = (x.device == "gpu" or gpu_branches) and contrast_on == "device"
            mean_rgb = fn.reductions.mean(x, axes=[0, 1], keep_dims=True)         # (1, 1, 3) float
            if contrast_on == "host":
                mean_rgb = mean_rgb.cpu()                    # copied back on a GPU, as it is on the CPU
            t = fn.coord_transform(mean_rgb, M=inputs[f"{tag}/contrast"])       # b·(1-c)·mean gray
            if on_device:
                # The offset broadcast over the view, then rounded. The cast stays: an argument must
                # come from the CPU, and CoordTransform's output is its input's type or float, so
                # neither the pass nor an add before it can round to uint8 itself.
                x = fn.cast(fn.coord_transform(x, M=m, dtype=types.FLOAT) + t, dtype=types.UINT8)
            else:                                           # the offset the pass's argument, made on the CPU
                x = fn.coord_transform(x, M=m, T=fn.reshape(t, shape=[3]), dtype=types.UINT8)
        else:
            x = fn.coord_transform(x, M=m, dtype=types.UINT8)
    if f"{tag}/blur_kernel" in inputs:                      # GPU, gpu_blur="filter": one pass, per-sample kernels
        x = fn.filter(x, inputs[f"{tag}/blur_kernel"], border="reflect_101")
    if f"{tag}/sigma" in inputs:
        # DALI's window 2·ceil(3σ)+1 rather than the fixed 10 % kernel (23 px at 224): a few times
        # cheaper for the small σ most draws give (docs/benchmarks.md, kernel notes).
        sigma = inputs[f"{tag}/sigma"]
        if f"{tag}/blur_window" in inputs:                  # GPU: every sample, no-op windows
            x = fn.gaussian_blur(x, sigma=sigma, window_size=inputs[f"{tag}/blur_window"])
        elif f"{tag}/blur" in inputs:                       # the CPU graph's, and gpu_blur="conditional"
            if inputs[f"{tag}/blur"]:                       # conditional: only the samples that drew it
                x = fn.gaussian_blur(x, sigma=sigma)
        else:
            x = fn.gaussian_blur(x, sigma=sigma)
    if f"{tag}/solarize_mask" in inputs:                    # GPU: every sample, no-op masks (0)
        x = dmath.min(x, x ^ inputs[f"{tag}/solarize_mask"])  # min(x, 255 - x): x below 128, 255 - x above
    elif f"{tag}/solarize" in inputs:
        if inputs[f"{tag}/solarize"]:                       # conditional: only the drawn samples
            x = fn.lookup_table(x, keys=list(range(256)), values=_SOLARIZED, dtype=types.UINT8)
    return x


def saliency(x, mask, start, end, size_px: int, level):
    """Background (mask < 0.5 on the same, possibly mirrored, window) replaced by gray `level`.

    As level + (x - level)·keep in uint8, whose wrap-around is arithmetic modulo 256: x where kept,
    level elsewhere, in four arithmetic operators (each is one in DALI) and no cast."""
    m = fn.resize(mask, size=[size_px, size_px], roi_start=start, roi_end=end,
                  interp_type=types.INTERP_LINEAR, antialias=True)
    return level + (x - level) * (m >= 128)                               # (S, S, 1) bool broadcast over RGB


def _blend(x, xp, lam, lam_other):
    """Per sample lam·x + lam_other·xp on uint8 views, rounded to uint8."""
    return fn.cast(x * lam + xp * lam_other, dtype=types.UINT8)


def _sdmp_mixer(m: str, x, xp, inputs: dict, size: int, pasted: dict | None = None):
    """One SDMP mixer on uint8 HWC views; `pasted` (debug, outside any conditional): gets the inputs of
    the mixer's `multi_paste` under "paste_in0", "paste_in1"."""
    if m == "mixup":
        return _blend(x, xp, inputs["mix/lam"], inputs["mix/lam_other"])
    if m == "cutmix":                  # the partner's box pasted over the image, on the device
        regions = dict(in_anchors=inputs["mix/cutmix_anchor"], out_anchors=inputs["mix/cutmix_anchor"],
                       shapes=inputs["mix/cutmix_shape"])
    else:
        patch = fn.resize(xp, size=inputs["mix/resizemix_size"], interp_type=types.INTERP_LINEAR, antialias=True,
                          dtype=types.UINT8)
        # Workaround, DALI 2.4.0 (upstream bug): the GPU `multi_paste` sets up every input with the
        # shape of input 0, so a box-sized patch is read with the canvas's row pitch (wrong pixels
        # inside the box, reads past the buffer). The patch is padded to the canvas, its region read
        # from the top-left corner, so that every input has the canvas's shape.
        xp = fn.pad(patch, axis_names="HW", shape=[size, size], fill_value=0)
        regions = dict(out_anchors=inputs["mix/resizemix_anchor"], shapes=inputs["mix/resizemix_shape"])
    if pasted is not None:
        pasted["paste_in0"], pasted["paste_in1"] = x, xp
    return fn.multi_paste(x, xp, output_size=[size, size], **regions)


def _sdmp(mixers: tuple[str, ...], x, xp, inputs: dict, size: int):
    """The batch's mixer: with several, one conditional branch per mixer (one runs, on every sample)."""
    if len(mixers) == 1:
        return _sdmp_mixer(mixers[0], x, xp, inputs, size)
    if inputs[f"mix/{mixers[0]}"]:
        y = _sdmp_mixer(mixers[0], x, xp, inputs, size)
    else:
        y = _sdmp(mixers[1:], x, xp, inputs, size)
    return y


def _dacl_noise(n: str, x, xp, v: int, inputs: dict, keep, shift):
    if n == "binary":                  # Eq. (6): m·x + (1 - m)·x', exact in uint8 (modulo 256, as `saliency`)
        return xp + (x - xp) * keep
    if n == "gaussian":                                                       # the baseline: x + alpha delta
        return fn.cast(dmath.clamp(x + shift, 0.0, 255.0), dtype=types.UINT8)
    lam, lam_other = inputs[f"mix/{v}/lam"], inputs[f"mix/{v}/lam_other"]
    if n == "linear":                                                         # Eq. (3)
        return _blend(x, xp, lam, lam_other)
    y = dmath.pow(x * (1 / 255.0), lam) * dmath.pow(xp * (1 / 255.0), lam_other) * 255.0   # Eq. (5), [0, 1] pixels
    return fn.cast(y, dtype=types.UINT8)


def _dacl(noises: tuple[str, ...], x, xp, v: int, inputs: dict, keep, shift):
    """The sample's noise: with several (DACL+), one conditional branch per noise."""
    if len(noises) == 1:
        return _dacl_noise(noises[0], x, xp, v, inputs, keep, shift)
    if inputs[f"mix/{noises[0]}"]:
        y = _dacl_noise(noises[0], x, xp, v, inputs, keep, shift)
    else:
        y = _dacl(noises[1:], x, xp, v, inputs, keep, shift)
    return y


def mix_sources(spec: LoaderSpec) -> list[str]:
    """The view tags the mixes start from (`mixing.mix_source_views`)."""
    return [f"{name}/{v}" for name, v in mix_source_views(spec.recipe, spec.mix)]


def mixes(spec: LoaderSpec, views: dict[str, object], inputs: dict, device: str, debug: dict, seed: int) -> list:
    """The intra-batch mixes of `mixing`'s laws on uint8 HWC views: (V,) mixed views, in source order."""
    mix, size = spec.mix, spec.recipe.global_px
    out = []
    for v, tag in enumerate(mix_sources(spec)):
        x = views[tag]
        if mix.kind == "sdmp":
            xp = fn.permute_batch(x, indices=inputs["mix/partner"])      # mixing.partner_index
            if len(mix.sdmp_mixers) == 1:                                # no conditional: debug sees the paste
                pasted: dict = {}
                out.append(_sdmp_mixer(mix.sdmp_mixers[0], x, xp, inputs, size, pasted))
                debug.update({f"mix/{v}/{k}": node for k, node in pasted.items()})
                continue
            out.append(_sdmp(tuple(mix.sdmp_mixers), x, xp, inputs, size))
        else:
            xp = fn.permute_batch(x, indices=inputs[f"mix/{v}/partner"]) if f"mix/{v}/partner" in inputs else None
            keep = None
            if "binary" in mix.dacl_noises:
                # Eq. (6)'s m ~ Bernoulli(rho) per pixel and channel: drawn here, on the graph's device
                # (before the noise branches, so that a debug run can output it)
                u = fn.random.uniform(range=[0.0, 1.0], shape=[size, size, 3], device=device, seed=seed + v)
                keep = debug[f"mix/{v}/binary_mask"] = fn.cast(u < inputs[f"mix/{v}/rho"], dtype=types.UINT8)
            shift = None
            if "gaussian" in mix.dacl_noises:
                # the baseline's delta ~ N(0, I) per pixel and channel, drawn here like the masks; in levels
                delta = debug[f"mix/{v}/gauss_normal"] = fn.random.normal(shape=[size, size, 3], device=device,
                                                                          seed=seed + 1000 + v)
                shift = delta * (mix.gauss_scale * 255.0)
            out.append(_dacl(tuple(mix.dacl_noises), x, xp, v, inputs, keep, shift))
    return out


@dataclass
class Outputs:
    """The graph's outputs in order: each view's `Batch` field, the pass-through outputs (added by the
    pipeline's definition), then the debug nodes by name."""

    fields: list[str] = field(default_factory=list)      # "global_views" | "local_views" | "weak_views" | "mixed";
                                                         # with the torch tail each crop view's tag ("group/v")
    passed: list[str] = field(default_factory=list)      # the source's pass-through outputs (index, label, ...)
    tail: bool = False                                   # the outputs are uint8 HWC crops for `dali_tail`
    debug: list[str] = field(default_factory=list)
    nodes: list = field(default_factory=list)

    def add(self, name: str, node) -> None:
        """A field output."""
        self.fields.append(name)
        self.nodes.append(node)


def graph(spec: LoaderSpec, inputs: dict, masks: bool, mean, std, *, channels_last: bool = False,
          debug: bool = False, seed: int = 0, gpu_branches: bool = False) -> Outputs:
    """The pipeline function's body (see the module docstring).

    Args:
        inputs: {name: DataNode}: "image" (encoded bytes), "mask" (encoded masks, when `masks`) and the
            `input_specs` names.
        masks: the recipe composites saliency and the dataset has masks.
        mean, std: the dataset's statistics for the normalisation.
        channels_last: HWC outputs (a channels-last network's memory layout) instead of CHW.
        debug: also output the in-graph draws (Binary Mixup masks).
        seed: the seed of the in-graph random operator.
        gpu_branches: a CPU graph takes the branches written for the GPU (`colour_ops`, `torch_tail`).
    """
    recipe = spec.recipe
    device = "gpu" if spec.device.startswith("cuda") else "cpu"
    decoder = {"device": "mixed", "hw_decoder_load": spec.decoder.hw_load,
               "preallocate_width_hint": spec.decoder.size_hint_px,
               "preallocate_height_hint": spec.decoder.size_hint_px} if device == "gpu" else {"device": "cpu"}
    img = fn.decoders.image(inputs["image"], output_type=types.RGB, **decoder)
    if any(k.endswith("/saliency") for k in inputs):
        # Workaround, DALI 2.4.0 (upstream bug): on the GPU, an operator inside a conditional that no
        # sample of the batch takes is skipped, and a decoder's output is then left without shape or
        # layout ("number of dimensions 0 does not match any of the allowed layouts" in the resize
        # after it). So the masks are decoded once per batch, outside any conditional (a sample that
        # composites in no view brings a 1-px stand-in, `NO_MASK_PNG`), and only pixel operators
        # run inside the per-view branches.
        mask = fn.decoders.image(inputs["mask"], output_type=types.GRAY, **decoder)
    tail = torch_tail(spec, device == "gpu" or gpu_branches)
    views: dict[str, object] = {}
    for g in recipe.crop_groups:
        for v in range(g.count):
            tag = f"{g.name}/{v}"
            start, end = inputs[f"{tag}/roi_start"], inputs[f"{tag}/roi_end"]
            x = fn.resize(img, size=[g.size_px, g.size_px], roi_start=start, roi_end=end,
                          interp_type=_INTERP[g.interpolation], antialias=True, dtype=types.UINT8)
            if f"{tag}/saliency" in inputs:
                if inputs[f"{tag}/saliency"]:                # conditional: only the samples that drew it
                    x = saliency(x, mask, start, end, g.size_px, inputs[f"{tag}/level"])
            views[tag] = x if tail else colour_ops(x, inputs, tag, gpu_branches, spec.gpu_contrast)
    if tail:              # the crops leave as they are; `dali_tail` finishes them and makes the staged views
        out = Outputs(tail=True)
        for tag, x in views.items():
            out.add(tag, x)
        return out
    for g in recipe.by_role("staged"):
        for v in range(g.count):
            views[f"{g.name}/{v}"] = colour_ops(views[f"{g.parent}/{v}"], inputs, f"{g.name}/{v}", gpu_branches,
                                                spec.gpu_contrast)

    def normalized(x):
        # `batch.normalize` ((x/255 - mean)/std, float32) inside the graph, in DALI's threads and
        # overlapped with training through the prefetch queue; with `graph_dtype="uint8"` the views leave
        # as they are (a quarter of the bytes, no operator a view) and the loader normalises them.
        if spec.graph_dtype == "uint8":
            return x if channels_last else fn.transpose(x, perm=[2, 0, 1])
        return fn.crop_mirror_normalize(x, dtype=types.FLOAT, output_layout="HWC" if channels_last else "CHW",
                                        mean=[255.0 * m for m in mean], std=[255.0 * s for s in std])

    out, dbg = Outputs(), {}
    for name, groups in recipe.fields.items():
        for g in groups:
            for v in range(g.count):
                out.add(name, normalized(views[f"{g.name}/{v}"]))
    if spec.mix.kind != "none":
        for x in mixes(spec, views, inputs, device, dbg, seed):
            out.add("mixed", normalized(x))
    if debug:
        for name, node in dbg.items():
            out.debug.append(name)
            out.nodes.append(node)
    return out
