"""The reference recipe: the laws every engine draws from, and plain tensor ops that apply them.

Every engine (the torch and torchvision loaders, the FFCV decoder and its compiled ops, the DALI
graph) imports its law constants from here, and the tests compare each engine with these ops; the
torch reference and the DALI backend draw every parameter of a batch with the same calls
(`draw_crop_boxes`, `draw_color_params`).

Laws (DESIGN §4; torchvision's transforms where the papers name them):
- crop: RandomResizedCrop — area ~ U(area) * H * W, log(w / h) ~ U(log ratio), the first of
  `CROP_TRIES` tries that fits, else the central crop with the ratio clamped into range; with
  probability 1 - crop_p the whole image; with centre_crop > 0 (evaluation) no draw: the central
  square of that share of the shorter side. Crops are resized with antialiasing.
- flip: horizontal, with p flip_p.
- colour jitter (p jitter_p): brightness, contrast, saturation factors ~ U(max(0, 1 - a), 1 + a) and a
  hue shift ~ U(-a, a) turns, applied in a random order per view, each clamped to [0, 1]
  (torchvision's ColorJitter; contrast blends with the mean gray of the current image, hue rotates
  in HSV); then grayscale (p gray_p, `GRAY_WEIGHTS`); Gaussian blur (p blur_p, sigma ~ U(blur_sigma)
  px of a view of `blur_reference_px` (default `BLUR_REFERENCE_PX`) scaled to the view size, or px
  of the view itself with `blur_sigma_at: view`; window `blur_kernel_px`, reflect padding);
  solarize (p solarize_p, pixels >= 0.5 inverted).
- saliency background removal (RELICv2 App. A.2, global crops): with p saliency_p, and only when
  the sample's mask covers at least `SALIENCY_MIN_COVERAGE` of the image, pixels whose mask (cropped
  with the view's window and flipped with it) is below 0.5 take one gray level ~ U(0, 1), before the
  colour ops (Listing 1 removes the background before the view is augmented).
- staged views take the parent view after its ops and apply their own colour/blur/solarize ops.

Every parameter is drawn per sample and per view from an explicit `torch.Generator`; rendering runs
on any device, vectorised over the batch (crops loop per sample: one `F.interpolate` per box).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pipelines.views import Recipe, ViewGroup

CROP_TRIES = 10                            # torchvision RandomResizedCrop attempts before the fallback
CROP_DRAWS = 1 + 4 * CROP_TRIES            # uniforms of one view's crop (`crop_boxes`'s layout)
GRAY_WEIGHTS = (0.2989, 0.5870, 0.1140)    # torchvision rgb_to_grayscale (ITU-R 601-2 luma)
SALIENCY_MIN_COVERAGE = 0.05               # RELICv2 App. A.2: a mask below 5 % of the image is not used
BLUR_REFERENCE_PX = 224                    # ViewGroup.blur_sigma is given in px at this view size
BLUR_KERNEL_FRACTION = 0.1                 # blur window side: 10 % of the view side (23 px at 224)
JITTER_OPS = ("brightness", "contrast", "saturation", "hue")


def blur_scale(group: ViewGroup) -> float:
    """View px per px of the size the group's blur is given at (`blur_sigma_at`, `blur_reference_px`)."""
    if group.blur_sigma_at == "view":
        return 1.0
    return group.size_px / (group.blur_reference_px or BLUR_REFERENCE_PX)


def blur_kernel_px(group: ViewGroup) -> int:
    """Odd Gaussian window side of the group's views, at most the side (+1 to stay odd): the recipe's
    `blur_kernel_px` scaled like sigma when set (RELICv2's 23 at 224 and at 96); else 10 % of the side
    (23 px at 224, BYOL / SimCLR's rule) when sigma scales with the view; with `blur_sigma_at: view` at
    least 2·ceil(3·sigma_max)+1 (MoCo v2's sigma of up to 2 px on a 32-px view needs 13 px, not 10 % of 32)."""
    if group.blur_kernel_px:
        k = min(int(round(group.blur_kernel_px * blur_scale(group))), group.size_px)
    else:
        k = int(round(BLUR_KERNEL_FRACTION * group.size_px))
        if group.blur_sigma_at == "view":
            k = min(max(k, 2 * math.ceil(3 * group.blur_sigma[1]) + 1), group.size_px)
    return k if k % 2 == 1 else k + 1


def blur_sigma_px(group: ViewGroup) -> tuple[float, float]:
    """The group's blur sigma range in px of its own views: `blur_sigma` scaled from the size it is
    given at (`blur_scale`)."""
    scale = blur_scale(group)
    return group.blur_sigma[0] * scale, group.blur_sigma[1] * scale


# ------------------------------------------------------------------------------------------------
# Crops
# ------------------------------------------------------------------------------------------------


def sample_crop_boxes(hw: Tensor, group: ViewGroup, gen: torch.Generator) -> Tensor:
    """RandomResizedCrop boxes, torchvision's rules (`crop_boxes`), vectorised over samples.

    Args:
        hw: (N, 2) long image heights and widths.
        group: the view group (area, ratio, crop_p).
        gen: CPU generator; the uniforms are drawn per kind (areas, ratios, y, x of every try, then
            the whole-image draw) and laid out in `crop_boxes`'s order.

    Returns:
        (N, 4) long boxes (y0, x0, h, w).
    """
    n = hw.shape[0]
    area, log_ratio, ry, rx = (torch.rand(n, CROP_TRIES, generator=gen, dtype=torch.float64) for _ in range(4))
    crop = torch.rand(n, generator=gen).double()
    tries = torch.stack([area, log_ratio, ry, rx], 2).reshape(n, 4 * CROP_TRIES)     # try t: 4t .. 4t + 3
    return crop_boxes(hw, group, torch.cat([crop[:, None], tries], 1))


def crop_boxes(hw: Tensor, group: ViewGroup, u: Tensor) -> Tensor:
    """The crop law on given uniforms: RandomResizedCrop with probability crop_p, else the whole image;
    with `centre_crop` > 0 the central square of that share of the shorter side, whatever the uniforms.

    Area ~ U(area) * H * W, log(w / h) ~ U(log ratio); up to `CROP_TRIES` tries, the first that fits
    wins; else the central crop with the ratio clamped to the range. The compiled FFCV decoder runs
    the same law on the same layout (`ffcv_ops.crop_window`; tests/pipelines/test_ffcv_backend.py).

    Args:
        hw: (N, 2) long image heights and widths.
        group: the view group (area, ratio, crop_p).
        u: (N, CROP_DRAWS) float64 uniforms: column 0 decides the crop (u < crop_p), columns
            1 + 4t .. 4 + 4t are try t's area, log-ratio, y and x.

    Returns:
        (N, 4) long boxes (y0, x0, h, w).
    """
    n = hw.shape[0]
    h, w = hw[:, 0].double(), hw[:, 1].double()
    tries = u[:, 1:].reshape(n, CROP_TRIES, 4)
    target = (h * w)[:, None] * (group.area[0] + (group.area[1] - group.area[0]) * tries[..., 0])    # (N, tries)
    lr = (math.log(group.ratio[0]), math.log(group.ratio[1]))
    ar = torch.exp(lr[0] + (lr[1] - lr[0]) * tries[..., 1])
    cw = torch.round(torch.sqrt(target * ar))
    ch = torch.round(torch.sqrt(target / ar))
    ok = (cw > 0) & (ch > 0) & (cw <= w[:, None]) & (ch <= h[:, None])                  # (N, tries)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1, dtype=torch.long))
    idx = first.clamp_min(0)[:, None]
    bh, bw = ch.gather(1, idx)[:, 0], cw.gather(1, idx)[:, 0]
    y0 = torch.floor(tries[..., 2].gather(1, idx)[:, 0] * (h - bh + 1))
    x0 = torch.floor(tries[..., 3].gather(1, idx)[:, 0] * (w - bw + 1))
    # Fallback: central crop, ratio clamped into range.
    in_ratio = w / h
    fw = torch.where(in_ratio < group.ratio[0], w, torch.where(in_ratio > group.ratio[1], torch.round(h * group.ratio[1]), w))
    fh = torch.where(in_ratio < group.ratio[0], torch.round(w / group.ratio[0]), h)
    fh = torch.where(in_ratio > group.ratio[1], h, fh)
    fb = first < 0
    bh, bw = torch.where(fb, fh, bh), torch.where(fb, fw, bw)
    y0 = torch.where(fb, torch.floor((h - bh) / 2), y0)
    x0 = torch.where(fb, torch.floor((w - bw) / 2), x0)
    whole = u[:, 0] >= group.crop_p
    boxes = torch.stack([y0, x0, bh, bw], 1).long()                                    # (N, 4)
    full = torch.stack([torch.zeros_like(h), torch.zeros_like(w), h, w], 1).long()
    if group.centre_crop > 0:
        side = torch.clamp(torch.round(torch.minimum(h, w) * group.centre_crop), min=1)
        return torch.stack([torch.floor((h - side) / 2), torch.floor((w - side) / 2), side, side], 1).long()
    return torch.where(whole[:, None], full, boxes)


def render_crops(images: list[Tensor], boxes: Tensor, size: int, interpolation: str) -> Tensor:
    """Crop and resize (antialiased) each image; images are (C, H, W) uint8 or float.

    Returns:
        (N, C, size, size) float in [0, 1].
    """
    out = []
    for img, (y0, x0, bh, bw) in zip(images, boxes.tolist()):
        c = img[:, y0:y0 + bh, x0:x0 + bw].unsqueeze(0).float()                         # (1, C, h, w)
        if img.dtype == torch.uint8:
            c = c / 255.0
        if c.shape[-2:] != (size, size):
            c = F.interpolate(c, size=(size, size), mode=interpolation, align_corners=False, antialias=True)
        out.append(c)
    return torch.cat(out).clamp_(0, 1)


# ------------------------------------------------------------------------------------------------
# Colour / blur / solarize / saliency parameters and ops
# ------------------------------------------------------------------------------------------------


@dataclass
class ViewParams:
    """Per-view random parameters of one group, N = count * B views (view-major)."""

    flip: Tensor        # (N,) bool
    jitter: Tensor      # (N,) bool, colour jitter applied
    factors: Tensor     # (N, 4) brightness, contrast, saturation factors and hue shift (identity when off)
    order: Tensor       # (N, 4) long, a permutation of JITTER_OPS per view
    gray: Tensor        # (N,) bool
    blur: Tensor        # (N,) bool
    sigma: Tensor       # (N,) float, blur sigma in px at the output size
    solarize: Tensor    # (N,) bool
    saliency: Tensor    # (N,) bool, background removal drawn (applied only with a good mask)
    gray_level: Tensor  # (N,) float in [0, 1], background level of the saliency composite


def sample_color_params(n: int, group: ViewGroup, gen: torch.Generator) -> ViewParams:
    """Draw the per-view parameters of `group` for n views (CPU generator, CPU tensors).

    Blur sigma is drawn in U(blur_sigma_px(group)).
    """
    def coin(p: float) -> Tensor:
        return torch.rand(n, generator=gen) < p

    flip, jit = coin(group.flip_p), coin(group.jitter_p)
    u = torch.rand(n, 4, generator=gen) * 2 - 1                                         # (N, 4) in [-1, 1]
    amp = torch.tensor([group.brightness, group.contrast, group.saturation, group.hue])
    f = u * amp
    f[:, :3] += 1
    f[:, :3].clamp_(min=0)
    ident = torch.tensor([1.0, 1.0, 1.0, 0.0])
    factors = torch.where(jit[:, None], f, ident)
    order = torch.argsort(torch.rand(n, 4, generator=gen), 1)
    gray, blur = coin(group.gray_p), coin(group.blur_p)
    s0, s1 = blur_sigma_px(group)
    sigma = s0 + (s1 - s0) * torch.rand(n, generator=gen)
    sol, sal = coin(group.solarize_p), coin(group.saliency_p)
    level = torch.rand(n, generator=gen)
    return ViewParams(flip, jit, factors, order, gray, blur, sigma, sol, sal, level)


def _gray(x: Tensor) -> Tensor:
    """(N, 1, H, W) luma of (N, 3, H, W)."""
    return (GRAY_WEIGHTS[0] * x[:, 0:1] + GRAY_WEIGHTS[1] * x[:, 1:2] + GRAY_WEIGHTS[2] * x[:, 2:3])


def _rgb2hsv(x: Tensor) -> Tensor:
    r, g, b = x.unbind(1)
    maxc = torch.maximum(torch.maximum(r, g), b)          # elementwise: faster than x.max(1) on CPU
    minc = torch.minimum(torch.minimum(r, g), b)
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    crd = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack((h, s, maxc), 1)


def _hsv2rgb(x: Tensor) -> Tensor:
    """HSV → RGB by the closed form f(n) = v - v s clamp(min(k, 4 - k), 0, 1), k = (n + 6h) mod 6,
    (R, G, B) = (f(5), f(3), f(1)); equal to torchvision's sector table and much cheaper on CPU."""
    h, s, v = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    n = torch.tensor([5.0, 3.0, 1.0], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = torch.remainder(n + 6.0 * h, 6.0)                                              # (N, 3, H, W)
    return v - v * s * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0)


def _blend(a: Tensor, b: Tensor, f: Tensor) -> Tensor:
    """torchvision `_blend`: f a + (1 - f) b, clamped to [0, 1]; f (N,)."""
    f = f.view(-1, 1, 1, 1)
    return (f * a + (1 - f) * b).clamp(0, 1)


def _jitter_op(x: Tensor, op: int, f: Tensor) -> Tensor:
    if op == 0:                                                      # brightness: multiply
        return _blend(x, torch.zeros_like(x), f)
    if op == 1:                                                      # contrast: blend with mean gray
        mean = _gray(x).mean((1, 2, 3), keepdim=True)
        return _blend(x, mean.expand_as(x), f)
    if op == 2:                                                      # saturation: blend with grayscale
        return _blend(x, _gray(x).expand_as(x), f)
    hsv = _rgb2hsv(x)                                                # hue: rotate in HSV
    h = torch.remainder(hsv[:, 0] + f.view(-1, 1, 1), 1.0)
    return _hsv2rgb(torch.stack((h, hsv[:, 1], hsv[:, 2]), 1))


def gaussian_blur(x: Tensor, sigma: Tensor, kernel_px: int) -> Tensor:
    """Separable Gaussian blur with per-sample sigma, reflect padding (torchvision's).

    Args:
        x: (N, C, H, W) float. sigma: (N,) px. kernel_px: odd kernel side.
    """
    n, c, h, w = x.shape
    k = kernel_px
    half = (k - 1) * 0.5
    t = torch.linspace(-half, half, k, device=x.device, dtype=x.dtype)
    ker = torch.exp(-0.5 * (t[None] / sigma.to(x).view(-1, 1)) ** 2)                    # (N, k)
    ker = ker / ker.sum(1, keepdim=True)
    pad = k // 2
    y = x.reshape(1, n * c, h, w)                                                       # (1, N*C, H, W)
    mode = "replicate" if pad >= min(h, w) else "reflect"
    y = F.pad(y, (pad, pad, pad, pad), mode=mode)
    ker = ker.repeat_interleave(c, 0)                                                   # (N*C, k)
    # One depthwise conv per axis: cheaper on CPU than k shifted multiply-adds.
    y = F.conv2d(y, ker.view(n * c, 1, 1, k), groups=n * c)
    y = F.conv2d(y, ker.view(n * c, 1, k, 1), groups=n * c)
    return y.view(n, c, h, w)                                                           # (N, C, H, W)


def apply_color_ops(x: Tensor, params: ViewParams, group: ViewGroup) -> Tensor:
    """Colour jitter (random order per view), grayscale, blur, solarize, vectorised over views.

    Args:
        x: (N, 3, H, W) float in [0, 1] (already cropped, resized and flipped).
        params: from `sample_color_params(N, group, gen)`.
        group: the group (blur kernel size).

    Returns:
        (N, 3, H, W) float in [0, 1].
    """
    dev = x.device
    fac = params.factors.to(dev)
    order = params.order.to(dev)
    if bool(params.jitter.any()):
        amps = (group.brightness, group.contrast, group.saturation, group.hue)
        jit = params.jitter.to(dev)
        x = x.clone()
        for pos in range(4):
            for op in range(4):
                if amps[op] == 0:
                    continue
                # Only the views that run `op` at position `pos` (each view runs each op once).
                sel = torch.nonzero((order[:, pos] == op) & jit).squeeze(1)
                if sel.numel():
                    x[sel] = _jitter_op(x[sel], op, fac[sel, op])
    sel = torch.nonzero(params.gray.to(dev)).squeeze(1)
    if sel.numel():
        x = x.clone()
        x[sel] = _gray(x[sel]).expand(-1, 3, -1, -1)
    sel = torch.nonzero(params.blur.to(dev)).squeeze(1)
    if sel.numel():
        x = x.clone()
        x[sel] = gaussian_blur(x[sel], params.sigma.to(dev)[sel], blur_kernel_px(group))
    if bool(params.solarize.any()):
        sol = params.solarize.to(dev).view(-1, 1, 1, 1) & (x >= 0.5)
        x = torch.where(sol, 1.0 - x, x)
    return x


def saliency_usable(coverage: Tensor) -> Tensor:
    """(B,) bool: whether each sample's mask may be used (it exists and covers >= 5 % of the image).

    Args:
        coverage: (B,) fraction of mask pixels >= 128, or `schema.NO_MASK_COVERAGE` (< 0) without a mask.
    """
    return torch.as_tensor(coverage, dtype=torch.float64) >= SALIENCY_MIN_COVERAGE


def apply_saliency(x: Tensor, mask: Tensor, use: Tensor, level: Tensor) -> Tensor:
    """Background removal: foreground pixels kept, background set to a homogeneous gray level.

    Args:
        x: (N, 3, H, W) float views. mask: (N, 1, H, W) float in [0, 1], the saliency mask cropped
            with the same window (and flipped). use: (N,) bool (drawn and coverage >= 0.05).
        level: (N,) gray level, or (N, 3) per channel (the gray already normalised, for views that
            are normalised before the composite).
    """
    bg = mask < 0.5
    keep = ~(use.to(x.device).view(-1, 1, 1, 1) & bg)
    return torch.where(keep, x, level.to(x).view(len(level), -1, 1, 1).expand_as(x))


# ------------------------------------------------------------------------------------------------
# Whole recipe
# ------------------------------------------------------------------------------------------------


def render_views(images: list[Tensor], masks: list[Tensor | None] | None, coverage: Tensor, recipe: Recipe,
                 gen: torch.Generator, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Render every group of `recipe` on a batch of decoded images (the reference recipe): crop and
    resize every view of every crop group, then `finish_views`.

    Args:
        images: B tensors (3, H_i, W_i) uint8 (CPU). masks: B tensors (1, H_i, W_i) uint8 or None, or
            None without masks.
        coverage: (B,) float mask coverage (negative: no mask).
        gen: CPU generator (all parameters are drawn on the CPU, rendering on `device`).

    Returns:
        {group name: (count, B, 3, S, S) float in [0, 1]} on `device`.
    """
    b = len(images)
    hw = torch.tensor([[im.shape[-2], im.shape[-1]] for im in images], dtype=torch.long)   # (B, 2)
    dev_imgs = [im.to(device) for im in images]
    boxes = draw_crop_boxes(hw, recipe, gen)                                             # (N, 4) view-major
    crops = {g.name: render_crops(dev_imgs * g.count, boxes[g.name], g.size_px, g.interpolation)
             .view(g.count, b, 3, g.size_px, g.size_px) for g in recipe.crop_groups}

    def crop_masks(g: ViewGroup, use: Tensor) -> Tensor:
        ms = [m.to(device) if m is not None else torch.zeros(1, *im.shape[-2:], dtype=torch.uint8, device=device)
              for m, im in zip(masks, images)]
        return render_crops(ms * g.count, boxes[g.name], g.size_px, "bilinear").view(g.count, b, 1, g.size_px, g.size_px)

    return finish_views(crops, saliency_usable(coverage), recipe, draw_color_params(recipe, b, gen),
                        crop_masks if masks is not None else None)


def draw_crop_boxes(hw: Tensor, recipe: Recipe, gen: torch.Generator) -> dict[str, Tensor]:
    """The crop boxes of every crop group of a batch, in recipe order (the reference's draw order).

    Args:
        hw: (B, 2) long image heights and widths.

    Returns:
        {crop group name: (count * B, 4) long (y0, x0, h, w), view-major}.
    """
    return {g.name: sample_crop_boxes(hw.repeat(g.count, 1), g, gen) for g in recipe.crop_groups}


def draw_color_params(recipe: Recipe, b: int, gen: torch.Generator) -> dict[str, ViewParams]:
    """The per-view parameters of every group of a batch of `b` samples: the crop groups in recipe
    order, then the staged groups (the order `finish_views` applies them in).

    Returns:
        {group name: its ViewParams of count * b views, view-major}.
    """
    return {g.name: sample_color_params(g.count * b, g, gen) for g in recipe.crop_groups + recipe.by_role("staged")}


def finish_views(crops: dict[str, Tensor], usable: Tensor, recipe: Recipe, drawn: dict[str, ViewParams],
                 crop_masks: Callable[[ViewGroup, Tensor], Tensor] | None = None) -> dict[str, Tensor]:
    """Everything after the crops, in the reference order: per crop view flip, saliency composite
    (RELICv2 Listing 1: the background goes before the view is augmented), colour jitter, grayscale,
    blur, solarize; then each staged group's own ops on its parent's finished views.

    Args:
        crops: {crop group name: (count, B, 3, S, S) float in [0, 1]}, crops resized, not flipped.
        usable: (B,) bool, `saliency_usable` of the samples' coverage.
        drawn: `draw_color_params` of the batch.
        crop_masks: (group, use (count * B,) bool) -> (count, B, 1, S, S) float masks in [0, 1], cropped
            with the views' windows, not flipped (only the `use` views matter); None without masks.

    Returns:
        {group name: (count, B, 3, S, S) float in [0, 1]}.
    """
    out: dict[str, Tensor] = {}
    for g in recipe.crop_groups:
        c, b, _, s, _ = crops[g.name].shape
        x = crops[g.name].reshape(c * b, 3, s, s)                                       # (N, 3, S, S)
        p = drawn[g.name]
        flip = p.flip.to(x.device).view(-1, 1, 1, 1)
        x = torch.where(flip, x.flip(-1), x)
        if g.saliency_p > 0 and crop_masks is not None:
            use = p.saliency & usable.to(p.saliency.device).repeat(c)
            if bool(use.any()):
                m = crop_masks(g, use).reshape(c * b, 1, s, s).to(x)
                x = apply_saliency(x, torch.where(flip, m.flip(-1), m), use, p.gray_level)
        out[g.name] = apply_color_ops(x, p, g).view(c, b, 3, s, s)
    for g in recipe.by_role("staged"):
        x = out[g.parent]
        c, b, _, s, _ = x.shape
        out[g.name] = apply_color_ops(x.reshape(c * b, 3, s, s), drawn[g.name], g).view(c, b, 3, s, s)
    return out
