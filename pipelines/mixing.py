"""Intra-batch mixes (SDMP, DACL): their laws, a registry of samplers and applies, and the pure
torch functions every engine is compared with.

A mix has two halves, registered in `MIXES`: `sample` draws every random parameter of one batch (for
all its mixed views) from a generator, and `apply` mixes the views with those draws. The torch,
torchvision and FFCV loaders call `mix_views`; the DALI backend draws with the same `sample` and
applies the draws in its graph, and tests compare its outputs with these.

Laws (one home; DESIGN §4):
- SDMP, Ren et al., "A Simple Data Mixing Prior for Improving Self-Supervised Learning" (CVPR 2022,
  arXiv:2206.07692), Sec. 3.2: the partner of sample i is sample n-1-i (`partner_index`); one mixer
  per batch, uniformly from `MixSpec.sdmp_mixers`; lam ~ Beta(alpha, alpha) per sample, the same for
  every view of the sample (Eq. 1), and so is the box of the regional mixers: its side is
  floor(sqrt(1 - lam) * (H, W)). The regional mixers draw lam = 0.1 + 0.8 Beta(alpha, alpha) (boxes of
  10-90 % of the image, `SDMP_BOX_LAM`): the paper is silent, its code (`mixup.py` of OliverRensu/SDMP)
  scales the draw so, and so does this one.
  CutMix: the box centre is uniform over the image and the box is clipped at the border (CutMix's
  rule); lam becomes the fraction of the image's own pixels kept.
  ResizeMix, Eq. (2): the whole partner, resized (bilinear, antialiased) to the box, is pasted at a
  uniformly random position where the box lies fully inside the image; lam = 1 - box area / image area.
- DACL, Verma et al., "Towards Domain-Agnostic Contrastive Learning" (ICML 2021, arXiv:2011.04419),
  Sec. 3.1: each positive (mixed view) draws its own partner, uniformly among the other samples,
  and its own lam ~ U(alpha, 1); Linear Mixup Eq. (3) x+ = lam x + (1 - lam) x~; Geometric Mixup Eq. (5)
  x+ = x^lam * x~^(1 - lam) on [0, 1] pixels; Binary Mixup Eq. (6) x+ = x * m + x~ * (1 - m),
  m ~ Bernoulli(rho) per pixel and channel. Sec. 3.1 asks for "a high rho" and Sec. 5 searches
  {0.1, 0.3, 0.5}; both hold when the searched value is the probability that an element is swapped
  (`MixSpec.binary_swap`), so Eq. (6)'s rho, the probability of keeping x's own element, is
  1 - binary_swap in {0.9, 0.7, 0.5}: the anchor stays the larger part, as lam ~ U(alpha, 1) keeps
  it for the other noises. The default 0.3 is the middle of the grid (the paper reports no choice).
  Plain DACL (Algorithm 1) is Linear Mixup alone, the default `dacl_noises`. DACL+ (Sec. 3.1) lists
  several and draws one noise function per sample, used for both of the sample's positives ("apply
  this function to create both of the positive samples").
  The baseline DACL compares with (Tables 1-3, "Gaussian-noise"), Sec. 4: x+ = x + alpha delta, delta ~
  N(0, sigma^2 I) drawn for each positive, with alpha searched in {0.05, 0.1, 0.3, 0.5} and sigma 1.0
  (Sec. 5: "the mean of Gaussian-noise ... and the standard deviation is set to 1.0"); here on [0, 1]
  pixels, clipped to them (`dacl_gaussian`; `dacl_noises: [gaussian]`, alpha `MixSpec.gauss_scale`,
  0.1 by default: the paper reports no choice). It has no partner: its lam, the weight of the sample
  itself, is 1.

Sources (`MixSpec.source`): "global" mixes every global view of the batch (view v of the mix is
global view v mixed); "image" mixes the whole image resized to the global size with no other op,
twice (two positives), as DACL's domain-agnostic setting asks; `with_mix_source` adds that image as
a recipe group of role "image", so that every engine renders it like any other crop group.

Images are float in [0, 1] before normalisation; `partner` is long, `lam` float, `boxes` integer
(y0, x0, y1, x1) with exclusive ends.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from pipelines.views import Recipe, ViewGroup

SDMP_MIXERS = ("mixup", "cutmix", "resizemix")
SDMP_BOX_LAM = (0.1, 0.8)          # CutMix / ResizeMix: lam = 0.1 + 0.8 Beta(alpha, alpha), SDMP's code
DACL_NOISES = ("linear", "geometric", "binary")     # DACL(+)'s Mixup-noises
DACL_BASELINE_NOISES = ("gaussian",)                 # the noise DACL is compared with (Tables 1-3)
MixKind = Literal["none", "sdmp", "dacl"]
MixSource = Literal["global", "image"]
MIX_KINDS: tuple[str, ...] = typing.get_args(MixKind)
MIX_SOURCES: tuple[str, ...] = typing.get_args(MixSource)


@dataclass(frozen=True)
class MixSpec:
    """Intra-batch mixes added to each batch as `Batch.mixed`."""

    kind: MixKind = "none"             # "none" | "sdmp" | "dacl"
    alpha: float = 1.0                 # SDMP: lam ~ Beta(alpha, alpha); DACL: lam ~ U(alpha, 1)
    sdmp_mixers: tuple[str, ...] = SDMP_MIXERS    # one drawn uniformly per batch
    dacl_noises: tuple[str, ...] = ("linear",)    # plain DACL (Algorithm 1); several: DACL+, one drawn per sample
    binary_swap: float = 0.3           # Binary Mixup: P(an element comes from the partner) = 1 - rho
    gauss_scale: float = 0.1           # DACL's Gaussian-noise baseline: x + gauss_scale N(0, 1) on [0, 1] pixels
    source: MixSource = "global"       # "global": mix every global view; "image": the whole image,
                                       # resized to the global size without ops, mixed twice


def partner_index(b: int, device: torch.device | str | None = None) -> Tensor:
    """SDMP flip pairing: the partner of sample i is n-1-i (the only place that encodes it).

    For odd b the middle sample would be its own partner; callers use even batch sizes.
    """
    return torch.arange(b - 1, -1, -1, device=device)


def mixup(x: Tensor, lam: Tensor, partner: Tensor, out: Tensor | None = None) -> Tensor:
    """Mixup: lam_i x_i + (1 - lam_i) x_partner(i).  x (B,C,H,W), lam (B,), partner (B,) long.

    `out` (B,C,H,W), written and returned when given (a reused buffer). On the CPU each sample is one
    `lerp` pass into its output, with no temporary: 0.10 ms per 224-px image against 0.70 for the
    batched form's four new tensors (2 cores, batch 32); on a GPU the batched form, one kernel each.
    """
    if x.device.type == "cpu":
        out = torch.empty_like(x) if out is None else out
        for i, (p, w) in enumerate(zip(partner.tolist(), lam.tolist())):
            torch.lerp(x[p], x[i], w, out=out[i])                 # x_p + w (x_i - x_p)
        return out
    w = lam.to(x.dtype).view(-1, 1, 1, 1)                         # (B, 1, 1, 1)
    mixed = w * x + (1 - w) * x[partner]
    return mixed if out is None else out.copy_(mixed)


def _box_mask(boxes: Tensor, h: int, w: int) -> Tensor:
    """(B, 1, H, W) bool, True inside each clipped box."""
    b = boxes.long()
    ys = torch.arange(h, device=boxes.device).view(1, h, 1)
    xs = torch.arange(w, device=boxes.device).view(1, 1, w)
    y0, x0, y1, x1 = (b[:, k].clamp(0, h if k % 2 == 0 else w).view(-1, 1, 1) for k in range(4))
    m = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)           # (B, H, W)
    return m.unsqueeze(1)


def kept_fraction(boxes: Tensor, h: int, w: int) -> Tensor:
    """(...,) float32: the fraction of an h x w image's own pixels outside each box (y0, x0, y1, x1),
    clipped to the image: the lam of CutMix and ResizeMix."""
    b = boxes.long()
    bh = b[..., 2].clamp(0, h) - b[..., 0].clamp(0, h)
    bw = b[..., 3].clamp(0, w) - b[..., 1].clamp(0, w)
    return (1.0 - (bh.clamp_min(0) * bw.clamp_min(0)).double() / (h * w)).float()


def cutmix(x: Tensor, boxes: Tensor, partner: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """CutMix: paste the partner's pixels inside box i into image i (`out`: as `mixup`'s; on the CPU
    each sample is copied and its box pasted, with no temporary).

    Returns:
        (x_mixed (B,C,H,W), lam (B,)) where lam is the fraction of image i's own pixels kept after
        clipping the box to the image.
    """
    h, w = x.shape[-2:]
    lam = kept_fraction(boxes, h, w).to(x.dtype)
    if x.device.type == "cpu":
        out = torch.empty_like(x) if out is None else out
        for i, (p, (y0, x0, y1, x1)) in enumerate(zip(partner.tolist(), _clipped(boxes, h, w).tolist())):
            out[i].copy_(x[i])
            out[i, :, y0:y1, x0:x1] = x[p, :, y0:y1, x0:x1]
        return out, lam
    m = _box_mask(boxes, h, w)                                    # (B, 1, H, W)
    mixed = torch.where(m, x[partner], x)
    return (mixed if out is None else out.copy_(mixed)), lam


def _clipped(boxes: Tensor, h: int, w: int) -> Tensor:
    """(B, 4) long boxes (y0, x0, y1, x1) clipped to an h x w image."""
    b = boxes.long().clone()
    b[:, 0::2] = b[:, 0::2].clamp(0, h)
    b[:, 1::2] = b[:, 1::2].clamp(0, w)
    return b


def resizemix(x: Tensor, boxes: Tensor, partner: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """ResizeMix: the whole partner image, resized (bilinear, antialiased) into box i of image i
    (`out`: as `mixup`'s).

    Returns:
        (x_mixed (B,C,H,W), lam (B,)): lam is the fraction of image i's own pixels kept.
    """
    h, w = x.shape[-2:]
    bx = _clipped(boxes, h, w)
    out = x.clone() if out is None else out.copy_(x)
    # One interpolate per distinct box (boxes differ in size per sample).
    for i, (p, (y0, x0, y1, x1)) in enumerate(zip(partner.tolist(), bx.tolist())):
        if y1 > y0 and x1 > x0:
            out[i, :, y0:y1, x0:x1] = F.interpolate(x[p:p + 1], size=(y1 - y0, x1 - x0), mode="bilinear",
                                                    align_corners=False, antialias=True)[0]
    return out, kept_fraction(bx, h, w).to(x.dtype)


def dacl_linear(x: Tensor, partner: Tensor, lam: Tensor, out: Tensor | None = None) -> Tensor:
    """DACL Linear Mixup, Eq. (3): lam x + (1 - lam) x_partner."""
    return mixup(x, lam, partner, out)


def dacl_geometric(x: Tensor, partner: Tensor, lam: Tensor, out: Tensor | None = None) -> Tensor:
    """DACL Geometric Mixup, Eq. (5): x^lam * x_partner^(1-lam), on non-negative pixels (pre-normalisation)."""
    w = lam.to(x.dtype).view(-1, 1, 1, 1)                         # (B, 1, 1, 1)
    a = x.clamp_min(0)
    return torch.mul(a.pow(w), a[partner].pow(1 - w), out=out)


def dacl_binary(x: Tensor, partner: Tensor, mask: Tensor, out: Tensor | None = None) -> Tensor:
    """DACL Binary Mixup, Eq. (6): x * m + x_partner * (1 - m); mask same shape as x (bool or {0,1})."""
    return torch.where(mask.bool(), x, x[partner], out=out)


def dacl_gaussian(x: Tensor, normal: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    """DACL's Gaussian-noise positive, Sec. 4: x + alpha delta with delta = `normal` ~ N(0, I) (same shape as
    x) and alpha = `scale`, on [0, 1] pixels, clipped to them."""
    return torch.clamp(x + scale * normal, 0.0, 1.0, out=out)


def affine_in_pixels(mix: MixSpec) -> bool:
    """Whether every mixer `mix` can draw commutes with an affine map of the pixel values (a per-channel
    normalisation): mixup, CutMix, ResizeMix (interpolation weights sum to 1) and DACL's linear and
    binary noises do, DACL's geometric one and the Gaussian-noise baseline (clipped to the pixels' range)
    do not. Such mixes can be made from normalised views."""
    return mix.kind == "sdmp" or (mix.kind == "dacl" and not {"geometric", "gaussian"} & set(mix.dacl_noises))




# ------------------------------------------------------------------------------------------------
# Spec checks and sources.
# ------------------------------------------------------------------------------------------------


IMAGE_GROUP = "mix_image"           # name of the recipe group that `source: image` adds


def check_mix(mix: MixSpec) -> None:
    """Raise a one-line ValueError for an unknown kind, source, mixer or noise, or a bad alpha."""
    if mix.kind not in MIX_KINDS:
        raise ValueError(f"unknown mix kind {mix.kind!r}; use one of {', '.join(MIX_KINDS)}")
    if mix.source not in MIX_SOURCES:
        raise ValueError(f"unknown mix source {mix.source!r}; use one of {', '.join(MIX_SOURCES)}")
    if mix.kind == "sdmp":
        bad = [m for m in mix.sdmp_mixers if m not in SDMP_MIXERS]
        if bad or not mix.sdmp_mixers:
            raise ValueError(f"unknown SDMP mixer(s) {bad}; use some of {', '.join(SDMP_MIXERS)}")
        if not mix.alpha > 0:
            raise ValueError(f"SDMP draws lam ~ Beta(alpha, alpha): mix.alpha must be > 0, got {mix.alpha}")
    if mix.kind == "dacl":
        bad = [n for n in mix.dacl_noises if n not in DACL_NOISES + DACL_BASELINE_NOISES]
        if bad or not mix.dacl_noises:
            raise ValueError(f"unknown DACL noise(s) {bad}; use some of {', '.join(DACL_NOISES + DACL_BASELINE_NOISES)}")
        if not 0.0 <= mix.alpha < 1.0:
            raise ValueError(f"DACL draws lam ~ U(alpha, 1): mix.alpha must be in [0, 1), got {mix.alpha}")
        if not 0.0 < mix.binary_swap < 1.0:
            raise ValueError(f"mix.binary_swap is a probability in (0, 1), got {mix.binary_swap}; the paper searches 0.1, 0.3, 0.5")
        if not mix.gauss_scale > 0:
            raise ValueError(f"mix.gauss_scale must be > 0, got {mix.gauss_scale}; the paper searches 0.05, 0.1, 0.3, 0.5")


def with_mix_source(recipe: Recipe, mix: MixSpec) -> Recipe:
    """`recipe` plus, for `source: image` mixes, the group `IMAGE_GROUP` (role "image": the whole image
    resized to the global size, bilinear, no flip and no other op) that the engines render."""
    if mix.kind == "none" or mix.source != "image" or any(g.role == "image" for g in recipe.groups):
        return recipe
    image = ViewGroup(IMAGE_GROUP, count=1, size_px=recipe.global_px, crop_p=0.0, flip_p=0.0,
                      interpolation="bilinear", role="image")
    return replace(recipe, groups=recipe.groups + (image,))


def mix_source_views(recipe: Recipe, mix: MixSpec) -> list[tuple[str, int]]:
    """The views a batch's mixes start from, as (group name, view number) (module docstring, sources):
    every global view in `Recipe.fields` order ("global"), or the whole image twice ("image")."""
    if mix.source == "image":
        image = next(g.name for g in recipe.groups if g.role == "image")
        return [(image, 0), (image, 0)]
    return [(g.name, v) for g in recipe.fields["global_views"] for v in range(g.count)]


def mix_sources(views: dict[str, Tensor], recipe: Recipe, mix: MixSpec) -> Tensor:
    """The source views of `mix_source_views`, stacked.

    Args:
        views: {group name: (count, B, 3, S, S)} rendered views in [0, 1] (the recipe of
            `with_mix_source`).

    Returns:
        (V, B, 3, S, S).
    """
    return torch.stack([views[name][v] for name, v in mix_source_views(recipe, mix)])


# ------------------------------------------------------------------------------------------------
# Samplers and applies, one per kind (explicit generator: reproducible for a seed).
# ------------------------------------------------------------------------------------------------


def beta(alpha: float, n: int, gen: torch.Generator) -> Tensor:
    """n draws of Beta(alpha, alpha) from a CPU generator.

    torch's `_standard_gamma` takes no generator; Beta(a, a) = G1 / (G1 + G2) with Gi ~ Gamma(a)
    is computed with the Marsaglia-Tsang method on generator-drawn normals/uniforms (vectorised,
    a fixed number of rounds; boost for a < 1 by U^(1/a)).
    """
    def gamma(a: float) -> Tensor:
        boost = a < 1
        aa = a + 1 if boost else a
        d = aa - 1 / 3
        c = 1 / (9 * d) ** 0.5
        out = torch.full((n,), float("nan"))
        for _ in range(64):
            z = torch.randn(n, generator=gen)
            u = torch.rand(n, generator=gen)
            v = (1 + c * z) ** 3
            ok = (v > 0) & (torch.log(u.clamp_min(1e-30)) < 0.5 * z * z + d - d * v + d * torch.log(v.clamp_min(1e-30)))
            out = torch.where(torch.isnan(out) & ok, d * v, out)
            if not torch.isnan(out).any():
                break
        out = torch.nan_to_num(out, nan=d)
        if boost:
            out = out * torch.rand(n, generator=gen).clamp_min(1e-30).pow(1 / a)
        return out

    g1, g2 = gamma(alpha), gamma(alpha)
    return (g1 / (g1 + g2).clamp_min(1e-30)).clamp(0, 1)


def sdmp_box_sides(lam: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
    """(box heights, box widths), long: floor(sqrt(1 - lam) * (H, W)), the side law of both regional mixers."""
    cut = torch.sqrt(1 - lam.double())
    return torch.floor(cut * h).long(), torch.floor(cut * w).long()


@dataclass(frozen=True)
class MixDraw:
    """Every random draw of one batch's mixes, per mixed view (V views of B samples)."""

    partner: Tensor              # (V, B) long, the sample mixed into sample i
    lam: Tensor                  # (V, B) float, the drawn weight of sample i itself
    mixer: str = ""              # SDMP: the batch's mixer (one of SDMP_MIXERS)
    boxes: Tensor | None = None  # SDMP: (V, B, 4) long (y0, x0, y1, x1), exclusive ends, clipped
    noise: Tensor | None = None  # DACL: (B,) long, index into MixSpec.dacl_noises, shared by the positives
    keep: Tensor | None = None   # DACL binary mixup: (V, B, C, H, W) bool, m of Eq. (6)
    normal: Tensor | None = None # DACL Gaussian-noise: (V, B, C, H, W) float32 delta ~ N(0, I), per positive
    mask_seed: int = 0           # DACL: the seeds `keep` and `normal` are drawn from (`dacl_pixel_draws`)
    normal_seed: int = 0


def sample_sdmp(v: int, b: int, h: int, w: int, mix: MixSpec, gen: torch.Generator, device) -> MixDraw:
    """SDMP draws (module docstring): one mixer, lam per sample and its box, shared by the V views."""
    mixer = mix.sdmp_mixers[int(torch.randint(len(mix.sdmp_mixers), (1,), generator=gen))]
    lam = beta(mix.alpha, b, gen)                                                      # (B,)
    if mixer in ("cutmix", "resizemix"):
        lam = SDMP_BOX_LAM[0] + SDMP_BOX_LAM[1] * lam
    bh, bw = sdmp_box_sides(lam, h, w)
    if mixer == "resizemix":                                  # fully inside: top-left uniform
        y0 = torch.floor(torch.rand(b, generator=gen, dtype=torch.float64) * (h - bh + 1)).long()
        x0 = torch.floor(torch.rand(b, generator=gen, dtype=torch.float64) * (w - bw + 1)).long()
        boxes = torch.stack([y0, x0, y0 + bh, x0 + bw], 1)
    else:                                                     # centre uniform, clipped (CutMix)
        cy = torch.randint(h, (b,), generator=gen)
        cx = torch.randint(w, (b,), generator=gen)
        boxes = torch.stack([(cy - bh // 2).clamp(0, h), (cx - bw // 2).clamp(0, w),
                             (cy + bh - bh // 2).clamp(0, h), (cx + bw - bw // 2).clamp(0, w)], 1)  # (B, 4)
    return MixDraw(partner=partner_index(b).expand(v, b).to(device), lam=lam.float().expand(v, b).to(device),
                   mixer=mixer, boxes=boxes.expand(v, b, 4).to(device))


def mix_lam(d: MixDraw, h: int, w: int) -> Tensor:
    """(V, B) float32: the lam of each mixed view of h x w pixels, the weight of sample i itself: for
    SDMP's box mixers the fraction of its pixels kept (`kept_fraction`), else the drawn lam."""
    if d.mixer in ("cutmix", "resizemix"):
        return kept_fraction(d.boxes, h, w)
    return d.lam.float()


def apply_sdmp(x: Tensor, d: MixDraw, mix: MixSpec, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mix views x (V, B, C, H, W) with SDMP draws (into `out`, same shape, when given); returns
    (mixed, lam actually used (V, B))."""
    out = torch.empty_like(x) if out is None else out
    for k in range(x.shape[0]):
        if d.mixer == "mixup":
            mixup(x[k], d.lam[k], d.partner[k], out[k])
        else:
            (cutmix if d.mixer == "cutmix" else resizemix)(x[k], d.boxes[k], d.partner[k], out[k])
    return out, mix_lam(d, *x.shape[-2:]).to(x.dtype)


def binary_rho(mix: MixSpec, lam: Tensor) -> Tensor:
    """(V, B) rho of Binary Mixup, Eq. (6), like `lam`: the probability of keeping x's own element,
    1 - `mix.binary_swap` (module docstring)."""
    return torch.full_like(lam, 1.0 - mix.binary_swap)


def sample_dacl(v: int, b: int, h: int, w: int, mix: MixSpec, gen: torch.Generator, device, *,
                pixel_masks: bool = True) -> MixDraw:
    """DACL(+) draws (module docstring): per positive a partner != i and lam (1 for the Gaussian-noise
    baseline's samples: no partner); one noise per sample; the Binary Mixup masks and the Gaussian noise
    unless `pixel_masks` is False (an engine that draws them where the pixels are: the DALI graph; the
    other draws are the same either way)."""
    shift = torch.randint(1, max(b, 2), (v, b), generator=gen)
    partner = (torch.arange(b) + shift) % b                                          # (V, B)
    lam = mix.alpha + (1 - mix.alpha) * torch.rand(v, b, generator=gen)               # (V, B)
    noise = torch.randint(len(mix.dacl_noises), (b,), generator=gen)                  # (B,)
    # The masks and the noise are the only large draws: drawn where they are used, from generators seeded here.
    mask_seed = int(torch.randint(2**62, (1,), generator=gen)) if "binary" in mix.dacl_noises else 0
    normal_seed = int(torch.randint(2**62, (1,), generator=gen)) if "gaussian" in mix.dacl_noises else 0
    if "gaussian" in mix.dacl_noises:
        lam = torch.where(noise == mix.dacl_noises.index("gaussian"), 1.0, lam)        # its own sample only
    d = MixDraw(partner=partner.to(device), lam=lam.to(device), noise=noise.to(device), mask_seed=mask_seed,
                normal_seed=normal_seed)
    return dacl_pixel_draws(d, mix, h, w, device) if pixel_masks else d


def dacl_pixel_draws(d: MixDraw, mix: MixSpec, h: int, w: int, device) -> MixDraw:
    """`d` with its per-pixel draws made on `device` from its seeds: the Binary Mixup masks (Eq. 6, m ~
    Bernoulli(rho) per pixel and channel) and the Gaussian-noise baseline's delta ~ N(0, I), (V, B, 3, H,
    W) each, for the noises of `mix` that need them."""
    v, b = d.lam.shape
    keep = normal = None
    if "binary" in mix.dacl_noises:
        u = torch.rand((v, b, 3, h, w), generator=torch.Generator(device=device).manual_seed(d.mask_seed),
                       device=device)
        keep = u < binary_rho(mix, d.lam).to(device).view(v, b, 1, 1, 1)               # (V, B, 3, H, W)
    if "gaussian" in mix.dacl_noises:
        normal = torch.randn((v, b, 3, h, w), generator=torch.Generator(device=device).manual_seed(d.normal_seed),
                             device=device)                                            # (V, B, 3, H, W)
    return replace(d, keep=keep, normal=normal)


def apply_dacl(x: Tensor, d: MixDraw, mix: MixSpec, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mix views x (V, B, C, H, W) with DACL draws, each sample with its noise (`d.noise` indexes
    `mix.dacl_noises`), into `out` (same shape) when given; returns (mixed, lam). The first noise is
    written straight into the output, each further one over the samples that drew it."""
    out = torch.empty_like(x) if out is None else out
    for k in range(x.shape[0]):
        for j, name in enumerate(mix.dacl_noises):
            dst = out[k] if j == 0 else None
            if name == "binary":
                m = dacl_binary(x[k], d.partner[k], d.keep[k], dst)
            elif name == "gaussian":
                m = dacl_gaussian(x[k], d.normal[k], mix.gauss_scale, dst)
            else:
                m = (dacl_linear if name == "linear" else dacl_geometric)(x[k], d.partner[k], d.lam[k], dst)
            if j:
                torch.where((d.noise == j).view(-1, 1, 1, 1), m, out[k], out=out[k])
    return out, mix_lam(d, *x.shape[-2:]).to(x.dtype)


@dataclass(frozen=True)
class Mix:
    """One kind of intra-batch mix: how to draw a batch's parameters, and how to apply them."""

    sample: Callable[..., MixDraw]                      # (v, b, h, w, mix, gen, device) -> MixDraw
    apply: Callable[..., tuple[Tensor, Tensor]]         # (x, draw, mix, out=None) -> (mixed, lam)


MIXES: dict[str, Mix] = {
    "sdmp": Mix(sample_sdmp, apply_sdmp),
    "dacl": Mix(sample_dacl, apply_dacl),
}


@dataclass(frozen=True)
class MixOut:
    """The mixes of one batch, unnormalised."""

    mixed: Tensor                # (V, B, 3, H, W) in [0, 1]
    lam: Tensor                  # (V, B) float32, weight of sample i itself after area correction
    partner: Tensor              # (V, B) long
    draw: MixDraw                # the draws (tests and debugging)


def mix_views(x: Tensor, mix: MixSpec, gen: torch.Generator, out: Tensor | None = None) -> MixOut:
    """The intra-batch mixes of `mix` on the source views x (V, B, 3, H, W) in [0, 1] (`mix_sources`),
    or normalised where `affine_in_pixels(mix)` (the mixes are then the normalised mixes).

    Args:
        x: source views on the training device.
        mix: the spec (kind "sdmp" or "dacl").
        gen: CPU generator of the batch; every draw comes from it.
        out: (V, B, 3, H, W) float written with the mixes (a reused buffer), else a new tensor.
    """
    v, b, _, h, w = x.shape
    kind = MIXES[mix.kind]
    draw = kind.sample(v, b, h, w, mix, gen, x.device)
    mixed, lam = kind.apply(x, draw, mix, out)
    return MixOut(mixed=mixed, lam=lam.float(), partner=draw.partner.long(), draw=draw)
