"""Intra-batch mixes (SDMP, DACL): pure device-side torch functions and their parameter samplers.

Papers:
- SDMP: Ren et al., "A Simple Data Mixing Prior for Improving Self-Supervised Learning" (CVPR 2022):
  the partner of sample i is sample n-1-i of the batch (flip pairing); one mixer per batch drawn from
  {Mixup, CutMix, ResizeMix}; lam ~ Beta(alpha, alpha); both views of a sample use the same lam and box.
- DACL: Verma et al., "Towards Domain-Agnostic Contrastive Learning" (ICML 2021), Sec. 3.1:
  Linear Mixup Eq. (3) x+ = lam x + (1-lam) x~, lam ~ U(alpha, 1); Geometric Mixup Eq. (5)
  x+ = x^lam * x~^(1-lam); Binary Mixup Eq. (6) x+ = x * m + x~ * (1-m), m ~ Bernoulli(rho). The paper
  searches rho separately; here rho = lam (one coefficient per positive, see `sample_dacl`). DACL+
  draws one noise function per sample.

All images are (B, C, H, W) float in [0, 1] before normalisation; `partner` is (B,) long, `lam` (B,)
float, `boxes` (B, 4) integer (y0, x0, y1, x1) with exclusive ends.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

SDMP_MIXERS = ("mixup", "cutmix", "resizemix")
DACL_NOISES = ("linear", "geometric", "binary")
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
    dacl_noises: tuple[str, ...] = DACL_NOISES    # DACL+: one drawn per sample
    source: MixSource = "global"       # "global": mix every global view; "image": the whole image,
                                       # resized to the global size without ops, mixed twice


def partner_index(b: int, device: torch.device | str | None = None) -> Tensor:
    """SDMP flip pairing: the partner of sample i is n-1-i (the only place that encodes it).

    For odd b the middle sample would be its own partner; callers use even batch sizes.
    """
    return torch.arange(b - 1, -1, -1, device=device)


def mixup(x: Tensor, lam: Tensor, partner: Tensor) -> Tensor:
    """Mixup: lam_i x_i + (1 - lam_i) x_partner(i).  x (B,C,H,W), lam (B,), partner (B,) long."""
    w = lam.to(x.dtype).view(-1, 1, 1, 1)                         # (B, 1, 1, 1)
    return w * x + (1 - w) * x[partner]


def _box_mask(boxes: Tensor, h: int, w: int) -> Tensor:
    """(B, 1, H, W) bool, True inside each clipped box."""
    b = boxes.long()
    ys = torch.arange(h, device=boxes.device).view(1, h, 1)
    xs = torch.arange(w, device=boxes.device).view(1, 1, w)
    y0, x0, y1, x1 = (b[:, k].clamp(0, h if k % 2 == 0 else w).view(-1, 1, 1) for k in range(4))
    m = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)           # (B, H, W)
    return m.unsqueeze(1)


def _kept_fraction(mask: Tensor) -> Tensor:
    """(B,) fraction of pixels outside the box (the image's own pixels kept)."""
    return 1.0 - mask.flatten(1).float().mean(1)


def cutmix(x: Tensor, boxes: Tensor, partner: Tensor) -> tuple[Tensor, Tensor]:
    """CutMix: paste the partner's pixels inside box i into image i.

    Returns:
        (x_mixed (B,C,H,W), lam (B,)) where lam is the fraction of image i's own pixels kept after
        clipping the box to the image.
    """
    h, w = x.shape[-2:]
    m = _box_mask(boxes, h, w)                                    # (B, 1, H, W)
    return torch.where(m, x[partner], x), _kept_fraction(m).to(x.dtype)


def resizemix(x: Tensor, boxes: Tensor, partner: Tensor) -> tuple[Tensor, Tensor]:
    """ResizeMix: the whole partner image, resized (bilinear, antialiased) into box i of image i.

    Returns:
        (x_mixed (B,C,H,W), lam (B,)): lam is the fraction of image i's own pixels kept.
    """
    h, w = x.shape[-2:]
    bx = boxes.long().clone()
    bx[:, 0::2] = bx[:, 0::2].clamp(0, h)
    bx[:, 1::2] = bx[:, 1::2].clamp(0, w)
    out = x.clone()
    src = x[partner]
    # One interpolate per distinct box (boxes differ in size per sample).
    for i in range(x.shape[0]):
        y0, x0, y1, x1 = (int(v) for v in bx[i])
        if y1 > y0 and x1 > x0:
            out[i, :, y0:y1, x0:x1] = F.interpolate(src[i:i + 1], size=(y1 - y0, x1 - x0), mode="bilinear",
                                                    align_corners=False, antialias=True)[0]
    m = _box_mask(bx, h, w)
    return out, _kept_fraction(m).to(x.dtype)


def dacl_linear(x: Tensor, partner: Tensor, lam: Tensor) -> Tensor:
    """DACL Linear Mixup, Eq. (3): lam x + (1 - lam) x_partner."""
    return mixup(x, lam, partner)


def dacl_geometric(x: Tensor, partner: Tensor, lam: Tensor) -> Tensor:
    """DACL Geometric Mixup, Eq. (5): x^lam * x_partner^(1-lam), on non-negative pixels (pre-normalisation)."""
    w = lam.to(x.dtype).view(-1, 1, 1, 1)                         # (B, 1, 1, 1)
    a = x.clamp_min(0)
    return a.pow(w) * a[partner].pow(1 - w)


def dacl_binary(x: Tensor, partner: Tensor, mask: Tensor) -> Tensor:
    """DACL Binary Mixup, Eq. (6): x * m + x_partner * (1 - m); mask same shape as x (bool or {0,1})."""
    return torch.where(mask.bool(), x, x[partner])


# ------------------------------------------------------------------------------------------------
# Samplers (explicit generator: reproducible for a seed).
# ------------------------------------------------------------------------------------------------


def _beta(alpha: float, n: int, gen: torch.Generator, device) -> Tensor:
    """Beta(alpha, alpha) draws from a generator, via two Gamma draws built from uniforms.

    torch's `_standard_gamma` takes no generator; Beta(a, a) = G1 / (G1 + G2) with Gi ~ Gamma(a)
    is computed with the Marsaglia-Tsang method on generator-drawn normals/uniforms (vectorised,
    a fixed number of rounds; boost for a < 1 by U^(1/a)).
    """
    def gamma(a: float) -> Tensor:
        boost = a < 1
        aa = a + 1 if boost else a
        d = aa - 1 / 3
        c = 1 / (9 * d) ** 0.5
        out = torch.full((n,), float("nan"), device=device)
        for _ in range(64):
            z = torch.randn(n, generator=gen, device=device)
            u = torch.rand(n, generator=gen, device=device)
            v = (1 + c * z) ** 3
            ok = (v > 0) & (torch.log(u.clamp_min(1e-30)) < 0.5 * z * z + d - d * v + d * torch.log(v.clamp_min(1e-30)))
            out = torch.where(torch.isnan(out) & ok, d * v, out)
            if not torch.isnan(out).any():
                break
        out = torch.nan_to_num(out, nan=d)
        if boost:
            u = torch.rand(n, generator=gen, device=device).clamp_min(1e-30)
            out = out * u.pow(1 / a)
        return out

    g1, g2 = gamma(alpha), gamma(alpha)
    return (g1 / (g1 + g2).clamp_min(1e-30)).clamp(0, 1)


@dataclass(frozen=True)
class SDMPParams:
    """One batch of SDMP mixing parameters, shared by all views of a sample."""

    mixer: str          # one of SDMP_MIXERS, for the whole batch
    lam: Tensor         # (B,) Beta(alpha, alpha) draw
    boxes: Tensor       # (B, 4) long (y0, x0, y1, x1), area ~ (1 - lam) H W, clipped
    partner: Tensor     # (B,) long, n-1-i


def sample_sdmp(b: int, h: int, w: int, alpha: float, mixers: tuple[str, ...], gen: torch.Generator,
                device="cpu") -> SDMPParams:
    """SDMP parameters for a batch: one mixer uniformly, per-sample lam ~ Beta(alpha, alpha), and a
    box of side sqrt(1 - lam) * (H, W) centred uniformly (CutMix rule; clipped at the border)."""
    bad = [m for m in mixers if m not in SDMP_MIXERS]
    if bad or not mixers:
        raise ValueError(f"unknown SDMP mixer(s) {bad}; use some of {', '.join(SDMP_MIXERS)}")
    mixer = mixers[int(torch.randint(len(mixers), (1,), generator=gen, device=device))]
    lam = _beta(alpha, b, gen, device)
    cut = torch.sqrt(1 - lam)
    ch, cw = (cut * h).long(), (cut * w).long()
    cy = torch.randint(h, (b,), generator=gen, device=device)
    cx = torch.randint(w, (b,), generator=gen, device=device)
    boxes = torch.stack([(cy - ch // 2).clamp(0, h), (cx - cw // 2).clamp(0, w),
                         (cy + ch - ch // 2).clamp(0, h), (cx + cw - cw // 2).clamp(0, w)], 1)   # (B, 4)
    return SDMPParams(mixer, lam, boxes, partner_index(b, device))


def apply_sdmp(x: Tensor, p: SDMPParams) -> tuple[Tensor, Tensor]:
    """Mix one view (B,C,H,W) with `p`; returns (mixed, lam actually used (B,))."""
    if p.mixer == "mixup":
        return mixup(x, p.lam, p.partner), p.lam.to(x.dtype)
    return (cutmix if p.mixer == "cutmix" else resizemix)(x, p.boxes, p.partner)


@dataclass(frozen=True)
class DACLParams:
    """DACL(+) parameters of one positive view of a batch."""

    partner: Tensor     # (B,) long, uniformly random, partner[i] != i
    lam: Tensor         # (B,) ~ U(alpha, 1)
    noise: Tensor       # (B,) long index into the noise tuple (DACL+: one per sample)


def sample_dacl(b: int, alpha: float, n_noises: int, gen: torch.Generator, device="cpu") -> DACLParams:
    """DACL parameters: partner ≠ i uniformly, lam ~ U(alpha, 1) (Sec. 3.1), noise type per sample."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"DACL alpha {alpha} outside [0, 1]: lam is drawn from U(alpha, 1)")
    shift = torch.randint(1, max(b, 2), (b,), generator=gen, device=device)
    partner = (torch.arange(b, device=device) + shift) % b
    lam = alpha + (1 - alpha) * torch.rand(b, generator=gen, device=device)
    noise = torch.randint(n_noises, (b,), generator=gen, device=device)
    return DACLParams(partner, lam, noise)


def apply_dacl(x: Tensor, p: DACLParams, noises: tuple[str, ...], gen: torch.Generator) -> Tensor:
    """Apply DACL+ noise per sample; binary masks m ~ Bernoulli(rho = lam_i) per pixel, Eq. (6)."""
    bad = [n for n in noises if n not in DACL_NOISES]
    if bad or not noises:
        raise ValueError(f"unknown DACL noise(s) {bad}; use some of {', '.join(DACL_NOISES)}")
    out = x
    for j, name in enumerate(noises):
        if name == "binary":
            keep = torch.rand(x.shape, generator=gen, device=x.device) < p.lam.view(-1, 1, 1, 1)
            y = dacl_binary(x, p.partner, keep)
        else:
            y = (dacl_linear if name == "linear" else dacl_geometric)(x, p.partner, p.lam)
        out = y if j == 0 else torch.where((p.noise == j).view(-1, 1, 1, 1), y, out)
    return out
