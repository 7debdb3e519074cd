"""Compiled per-view pixel ops of the FFCV backend on the CPU (numba; FFCV itself is not needed here).

On a CPU loader, `ffcv_decode.DecodeViews` calls these kernels (`finish_view`, `finish_staged`, as C
functions; see `compiled`) right after it resizes each crop into its row, inside its compiled kernel
(`ffcv_decode.decode_rows`, parallel over the samples of a batch):
horizontal flip, colour jitter (the four ops in a per-view random order), grayscale, Gaussian blur and
solarize, then staged views (RSA) on top of their parent's finished pixels. They reproduce
`pipelines.augment.apply_color_ops` op for op: float32 pixels in [0, 1], torchvision's per-op
clamping, contrast against the mean luma of the *current* image, hue rotated in the same HSV, and one
rounding to uint8 at the end of the view. Agreement with the torch ops is within one uint8 level
(tests/pipelines/test_ffcv_backend.py), which is the rounding of the final value. The hue op computes
the same HSV rotation with the hue kept in sixths (`hue_`), which only changes float rounding.
A view that draws saliency is left raw by `finish_view` and finished on the host by
`finish_salient` (composite, then the same ops), once its mask is known.
`normalize_views` then turns a batch's rows into the normalised `Batch` field in one pass.

Parameters are drawn by the caller's counter hash as uniforms `u` (draws `FIRST_DRAW + k` of the
view, after the crop draws) and turned into a view's parameters by `draw_params` with the laws of
`augment.sample_color_params`. A view's parameters are `N_PARAMS` float32 values, columns `Param`;
the decoder writes them into the row so that Python reads them back. The crop is drawn before, by
`crop_window` (`augment.crop_boxes` on the view's first `CROP_DRAWS` uniforms).

Deviation: the Gaussian window is truncated at radius min(kernel_px // 2, ceil(4 sigma)) and
renormalised. The weights beyond 4 sigma hold < 1e-4 of the mass (< 0.02 of a uint8 level); the
23-tap kernel of 224-px views shrinks to 17 taps at sigma = 2 and 5 at sigma = 0.5.
"""

from __future__ import annotations

import functools
from enum import IntEnum
from types import SimpleNamespace

import numba
import numpy as np

from pipelines.augment import CROP_DRAWS, CROP_TRIES, GRAY_WEIGHTS, blur_kernel_px, blur_sigma_px
from pipelines.views import ViewGroup

class Param(IntEnum):
    """The columns of a view's drawn parameters (float32 in the row), and the draw each comes from
    (uniform `FIRST_DRAW + column` of the view)."""

    FLIP = 0
    JITTER = 1
    FACTORS = 2        # 4 columns: brightness, contrast, saturation factors, hue shift (`augment.JITTER_OPS`)
    ORDER = 6          # 4 columns: the jitter ops' order, a permutation of 0..3
    GRAY = 10
    BLUR = 11
    SIGMA = 12
    SOLARIZE = 13
    SALIENCY = 14
    GRAY_LEVEL = 15


class Law(IntEnum):
    """The columns of a group's law row (`group_table`, float64)."""

    FLIP_P = 0
    JITTER_P = 1
    STRENGTH = 2       # 4 columns: brightness, contrast, saturation, hue strengths
    GRAY_P = 6
    BLUR_P = 7
    SIGMA_PX = 8       # 2 columns: the blur sigma range in px of the view
    SOLARIZE_P = 10
    SALIENCY_P = 11
    SIZE_PX = 12
    KERNEL_PX = 13
    STAGED = 14


N_PARAMS = Param.GRAY_LEVEL + 1   # float32 values per view in the row
PARAM_BYTES = 4 * N_PARAMS
N_LAWS = Law.STAGED + 1
FIRST_DRAW = CROP_DRAWS           # a view's crop draws come first (`augment.crop_boxes`)


def group_table(groups: tuple[ViewGroup, ...], saliency: bool = True) -> np.ndarray:
    """The laws of each group as one float64 row per group, columns `Law`.

    Args:
        groups: the groups, in the decoder's view-number order.
        saliency: False (a dataset without masks): no view draws saliency, so none waits for a mask.

    Returns:
        (G, N_LAWS) float64.
    """
    rows = [(g.flip_p, g.jitter_p, g.brightness, g.contrast, g.saturation, g.hue, g.gray_p, g.blur_p,
             *blur_sigma_px(g), g.solarize_p, g.saliency_p if saliency else 0.0, g.size_px,
             blur_kernel_px(g), float(g.role == "staged")) for g in groups]
    return np.array(rows, np.float64).reshape(len(groups), N_LAWS)


_F32 = np.float32
_ZERO, _ONE, _HALF, _C255 = _F32(0.0), _F32(1.0), _F32(0.5), _F32(255.0)
_TWO, _FOUR, _SIX = _F32(2.0), _F32(4.0), _F32(6.0)
_W_R, _W_G, _W_B = (_F32(w) for w in GRAY_WEIGHTS)
# cache=True: compiling the kernels takes about 10 s; numba's on-disk cache pays it once per machine.
jit = numba.njit(nogil=True, cache=True)


@jit
def draw_params(u, gp, p):
    """u: (N_PARAMS,) float64 uniforms of the view; gp: its group row (`Law`); p: (N_PARAMS,) float32
    out (`Param`)."""
    staged = gp[Law.STAGED] > 0.5
    # Staged views have no crop of their own: no flip, no saliency (as in torch_backend).
    p[Param.FLIP] = 1.0 if (u[Param.FLIP] < gp[Law.FLIP_P] and not staged) else 0.0
    on = u[Param.JITTER] < gp[Law.JITTER_P]
    p[Param.JITTER] = 1.0 if on else 0.0
    for k in range(4):
        f = (2.0 * u[Param.FACTORS + k] - 1.0) * gp[Law.STRENGTH + k]
        if k < 3:
            f = max(f + 1.0, 0.0)
        p[Param.FACTORS + k] = f if on else (1.0 if k < 3 else 0.0)
    # Order: argsort of four uniforms (a uniformly random permutation of the four ops).
    for pos in range(4):
        rank = 0
        for k in range(4):
            if u[Param.ORDER + k] < u[Param.ORDER + pos] or (u[Param.ORDER + k] == u[Param.ORDER + pos] and k < pos):
                rank += 1
        p[Param.ORDER + rank] = pos
    p[Param.GRAY] = 1.0 if u[Param.GRAY] < gp[Law.GRAY_P] else 0.0
    p[Param.BLUR] = 1.0 if u[Param.BLUR] < gp[Law.BLUR_P] else 0.0
    p[Param.SIGMA] = gp[Law.SIGMA_PX] + (gp[Law.SIGMA_PX + 1] - gp[Law.SIGMA_PX]) * u[Param.SIGMA]
    p[Param.SOLARIZE] = 1.0 if u[Param.SOLARIZE] < gp[Law.SOLARIZE_P] else 0.0
    p[Param.SALIENCY] = 1.0 if (u[Param.SALIENCY] < gp[Law.SALIENCY_P] and not staged) else 0.0
    p[Param.GRAY_LEVEL] = u[Param.GRAY_LEVEL]


@jit
def crop_window(u, height, width, crop_p, area, log_ratio, box, centre=0.0):
    """`augment.crop_boxes` for one view: u, its CROP_DRAWS float64 uniforms in that layout; area and
    log_ratio, the group's (2,) ranges; centre, its centre_crop; box, (4,) int64 out: y0, x0, h, w."""
    box[0], box[1], box[2], box[3] = 0, 0, height, width
    if centre > 0:
        side = max(1, int(np.round(min(height, width) * centre)))
        box[0], box[1], box[2], box[3] = (height - side) // 2, (width - side) // 2, side, side
        return
    if u[0] >= crop_p:
        return
    for t in range(CROP_TRIES):
        a = area[0] + (area[1] - area[0]) * u[1 + 4 * t]
        aspect = np.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[2 + 4 * t])
        target = a * height * width
        cw = int(np.round(np.sqrt(target * aspect)))
        ch = int(np.round(np.sqrt(target / aspect)))
        if 0 < cw <= width and 0 < ch <= height:
            box[0] = int(u[3 + 4 * t] * (height - ch + 1))
            box[1] = int(u[4 + 4 * t] * (width - cw + 1))
            box[2], box[3] = ch, cw
            return
    # Fallback: central crop, ratio clamped into range.
    h, w = height, width
    if width / height < np.exp(log_ratio[0]):
        h = int(np.round(width / np.exp(log_ratio[0])))
    elif width / height > np.exp(log_ratio[1]):
        w = int(np.round(height * np.exp(log_ratio[1])))
    box[0], box[1], box[2], box[3] = (height - h) // 2, (width - w) // 2, h, w



# The counter-based random draws (`ffcv_decode`: a parameter is a hash of key, sample, view and draw).
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)


@jit
def mix64(z):
    """splitmix64's finaliser: a bijective scramble of a 64-bit word."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@jit
def uniform(k0, k1, sample, view, draw):
    """U[0, 1) from the counter (key k0 k1, sample, view, draw); 53 random bits."""
    z = mix64(k0 + np.uint64(sample) * _GOLDEN)
    z = mix64(z ^ (k1 + np.uint64(view * 64 + draw) * _GOLDEN))
    return np.float64(z >> _S11) * (1.0 / 9007199254740992.0)


def draw_uniforms(k0, k1, sample, view, first, n, u):
    """C entry point: u, (n,) float64 by address <- draws first .. first + n - 1 of (sample, view)."""
    u_a = numba.carray(u, n, np.float64)
    for d in range(n):
        u_a[d] = uniform(k0, k1, sample, view, first + d)


def draw_crop(k0, k1, sample, view, height, width, law, uc, box):
    """C entry point: the crop of (sample, view) on a height x width image, from its first CROP_DRAWS
    draws (into uc, float64 by address) and its group's crop law (law: `CROP_LAW` float64 by address,
    `crop_law`'s), as `crop_window` writes it into box (4 int64 by address)."""
    uc_a = numba.carray(uc, CROP_DRAWS, np.float64)
    for d in range(CROP_DRAWS):
        uc_a[d] = uniform(k0, k1, sample, view, d)
    law_a = numba.carray(law, CROP_LAW, np.float64)
    crop_window(uc_a, height, width, law_a[0], law_a[1:3], law_a[3:5], numba.carray(box, 4, np.int64), law_a[5])


CROP_LAW = 6                     # float64 values of a crop group's law (`crop_law`)


def crop_law(group: ViewGroup) -> tuple[float, ...]:
    """A crop group's law as `draw_crop` reads it: crop_p, the area range, the log-ratio range, centre_crop."""
    return (group.crop_p, *group.area, *np.log(np.array(group.ratio, np.float64)), group.centre_crop)


@jit
def load(row, off, s, flip, buf):
    """(s, s, 3) uint8 crop at row[off:] → float32 buf[: 3 s s] in [0, 1], columns reversed if flip.

    Loops index zero-based slices, never `off + i`: numba cannot prove such an index non-negative,
    and its wraparound check keeps LLVM from vectorising (docs/benchmarks.md, kernel notes).
    """
    n, rs = 3 * s * s, 3 * s
    if not flip:
        src, dst = row[off:off + n], buf[:n]
        for i in range(n):
            dst[i] = _F32(src[i]) / _C255
        return
    for y in range(s):
        src, dst = row[off + y * rs:off + (y + 1) * rs], buf[y * rs:(y + 1) * rs]
        for x in range(s):
            sx = 3 * (s - 1 - x)
            dst[3 * x] = _F32(src[sx]) / _C255
            dst[3 * x + 1] = _F32(src[sx + 1]) / _C255
            dst[3 * x + 2] = _F32(src[sx + 2]) / _C255


@jit
def store(buf, row, off, s):
    """Round float32 buf (clamped to [0, 1]) to uint8 into row[off:] (the view's one rounding)."""
    n = 3 * s * s
    src, dst = buf[:n], row[off:off + n]
    for i in range(n):
        v = min(max(src[i], _ZERO), _ONE) * _C255 + _HALF
        dst[i] = np.uint8(np.int32(v))


@jit
def flip_u8(row, off, s):
    """Reverse the columns of the (s, s, 3) uint8 crop at row[off:] in place."""
    for y in range(s):
        base = off + y * s * 3
        for x in range(s // 2):
            a, b = base + x * 3, base + (s - 1 - x) * 3
            for c in range(3):
                row[a + c], row[b + c] = row[b + c], row[a + c]


@jit
def blend_(buf, n, f, other):
    """buf = clamp(f buf + (1 - f) other, 0, 1) with a scalar `other` (torchvision `_blend`)."""
    g = _ONE - f
    for i in range(n):
        buf[i] = min(max(f * buf[i] + g * other, _ZERO), _ONE)


@jit
def saturation_(buf, npx, f):
    g = _ONE - f
    for q in range(npx):
        r, gg, b = buf[3 * q], buf[3 * q + 1], buf[3 * q + 2]
        luma = _W_R * r + _W_G * gg + _W_B * b
        buf[3 * q] = min(max(f * r + g * luma, _ZERO), _ONE)
        buf[3 * q + 1] = min(max(f * gg + g * luma, _ZERO), _ONE)
        buf[3 * q + 2] = min(max(f * b + g * luma, _ZERO), _ONE)


@jit
def mean_luma(buf, npx):
    acc = 0.0
    for q in range(npx):
        acc += _W_R * buf[3 * q] + _W_G * buf[3 * q + 1] + _W_B * buf[3 * q + 2]
    return _F32(acc / npx)


@jit
def hue_channel(h6, maxc, cr, n):
    """One channel of torch_backend._hsv2rgb, f(n) = v - v s clamp(min(k, 4 - k), 0, 1) with
    k = (n + 6 h) mod 6, written with v s = max - min = cr and 6 h = h6 in [0, 6)."""
    k = n + h6
    k = k - _SIX if k >= _SIX else k
    return maxc - cr * min(max(min(k, _FOUR - k), _ZERO), _ONE)


@jit
def hue_(buf, npx, shift):
    """Rotate the hue by `shift` turns in torch_backend's HSV (torchvision's rgb→hsv sectors).

    Algebraically the same as rgb→hsv, h = (h + shift) mod 1, hsv→rgb, with hue kept in sixths
    (h6 = 6 h) and v s = cr, which saves four divisions and the mod-1 floors per pixel; only float
    rounding differs from the torch op. Gray pixels (cr = 0) come back unchanged (any hue gives
    v back). Every branch is a select on a zero-based slice, so LLVM vectorises the loop.
    """
    shift6 = _SIX * shift
    px = buf[:3 * npx]
    for q in range(npx):
        r, g, b = px[3 * q], px[3 * q + 1], px[3 * q + 2]
        maxc = max(max(r, g), b)
        cr = maxc - min(min(r, g), b)
        inv = _ONE / cr if cr > _ZERO else _ZERO
        # torchvision's sectors: (bc - gc), 2 + (rc - bc), 4 + (gc - rc), as sixths in [-1, 5]
        h6_gb = _TWO + (b - r) * inv if maxc == g else _FOUR + (r - g) * inv
        h6 = (g - b) * inv if maxc == r else h6_gb
        h6 += shift6                           # in [-4, 8): one wrap each way
        h6 = h6 + _SIX if h6 < _ZERO else (h6 - _SIX if h6 >= _SIX else h6)
        px[3 * q] = hue_channel(h6, maxc, cr, _F32(5.0))
        px[3 * q + 1] = hue_channel(h6, maxc, cr, _F32(3.0))
        px[3 * q + 2] = hue_channel(h6, maxc, cr, _ONE)


@jit
def gray_(buf, npx):
    for q in range(npx):
        luma = _W_R * buf[3 * q] + _W_G * buf[3 * q + 1] + _W_B * buf[3 * q + 2]
        buf[3 * q] = luma
        buf[3 * q + 1] = luma
        buf[3 * q + 2] = luma


@jit
def reflect(i, s, replicate):
    """Source index of padded index i in [-r, s + r) (r < s): reflect, or replicate."""
    if replicate:
        return min(max(i, 0), s - 1)
    return -i if i < 0 else (2 * (s - 1) - i if i >= s else i)


@jit
def taps_(dst, w, r, src, a0, row):
    """dst = sum_j w[j] src[a_j : a_j + row] for the 2r + 1 rows a_j = a0[j], symmetric weights
    (w[j] = w[2r - j]) folded: w[r] centre + sum_{j<r} w[j] (left_j + right_j). Loops over whole,
    zero-based rows so that LLVM vectorises them."""
    c = src[a0[r]:a0[r] + row]
    wc = w[r]
    for i in range(row):
        dst[i] = wc * c[i]
    for j in range(r):
        left, right = src[a0[j]:a0[j] + row], src[a0[2 * r - j]:a0[2 * r - j] + row]
        wj = w[j]
        for i in range(row):
            dst[i] += wj * (left[i] + right[i])


@jit
def blur_(buf, s, sigma, kernel_px, tmp, pad):
    """Separable Gaussian blur of the (s, s, 3) float32 image in buf, in place.

    Rows first, then columns, as torch_backend.gaussian_blur; reflect padding (replicate where the
    kernel's half-width reaches the image side, as there). The window is truncated at radius
    min(kernel_px // 2, ceil(4 sigma)) and renormalised (module docstring); its symmetric taps are
    summed in pairs and the padding is copied as a slice (the fastest of the loop shapes tried,
    docs/benchmarks.md); only float rounding differs from the torch op.
    tmp: >= 3 s s floats; pad: >= 3 (s + 2 r).
    """
    half_k = kernel_px // 2
    r = min(half_k, int(np.ceil(4.0 * sigma)))
    w = np.empty(2 * r + 1, np.float32)
    tot = 0.0
    for j in range(2 * r + 1):
        t = (j - r) / sigma
        w[j] = np.exp(-0.5 * t * t)
        tot += w[j]
    for j in range(2 * r + 1):
        w[j] = _F32(w[j] / tot)
    replicate = half_k >= s
    row = 3 * s
    starts = np.empty(2 * r + 1, np.int64)
    for j in range(2 * r + 1):             # horizontal pass: tap j reads the padded row at 3 j
        starts[j] = 3 * j
    for y in range(s):
        src = buf[y * row:(y + 1) * row]
        pad[3 * r:3 * r + row] = src
        for e in range(r):
            left, right = reflect(e - r, s, replicate), reflect(s + e, s, replicate)
            for c in range(3):
                pad[3 * e + c] = src[3 * left + c]
                pad[3 * (s + r + e) + c] = src[3 * right + c]
        taps_(tmp[y * row:(y + 1) * row], w, r, pad, starts, row)
    for y in range(s):                     # vertical pass: tap j reads row reflect(y + j - r)
        for j in range(2 * r + 1):
            starts[j] = row * reflect(y + j - r, s, replicate)
        taps_(buf[y * row:(y + 1) * row], w, r, tmp, starts, row)


@jit
def color_ops(buf, s, p, gp, tmp, pad):
    """torch_backend.apply_color_ops on _ONE view: jitter in p's order (ops with _ZERO strength are
    skipped, as there), grayscale, blur, solarize; buf (3 s s float32, HWC) in place."""
    npx = s * s
    n = 3 * npx
    if p[Param.JITTER] > 0.5:
        for pos in range(4):
            op = int(p[Param.ORDER + pos])
            if gp[Law.STRENGTH + op] == 0.0:
                continue
            f = p[Param.FACTORS + op]
            if op == 0:
                blend_(buf, n, f, _ZERO)
            elif op == 1:
                blend_(buf, n, f, mean_luma(buf, npx))
            elif op == 2:
                saturation_(buf, npx, f)
            else:
                hue_(buf, npx, f)
    if p[Param.GRAY] > 0.5:
        gray_(buf, npx)
    if p[Param.BLUR] > 0.5:
        blur_(buf, s, np.float64(p[Param.SIGMA]), int(gp[Law.KERNEL_PX]), tmp, pad)
    if p[Param.SOLARIZE] > 0.5:
        for i in range(n):
            if buf[i] >= _HALF:
                buf[i] = _ONE - buf[i]


@jit
def needs_pixels(p, gp):
    """Whether the view's drawn ops change any pixel beyond the flip."""
    if p[Param.JITTER] > 0.5:
        for k in range(4):
            if gp[Law.STRENGTH + k] != 0.0:
                return True
    return p[Param.GRAY] > 0.5 or p[Param.BLUR] > 0.5 or p[Param.SOLARIZE] > 0.5


def finish_view(crop, s, u, gp, p, buf, tmp, pad, keep):
    """One crop view, in place: draw its parameters, flip, apply its ops, round back to uint8. A view
    that draws saliency keeps its raw crop (`finish_salient` finishes it once its mask is known).

    C entry point (all arrays by address): crop, the (s, s, 3) uint8 crop in the row; u, its
    N_PARAMS float64 uniforms; gp, its group's law row; p, where its N_PARAMS float32 parameters go
    (in the row); buf, tmp, pad: float32 scratch (3 s s, 3 s s, 3 (3 s + 2)). keep != 0: leave the
    finished float view in buf for staged views.
    """
    n = 3 * s * s
    crop_a = numba.carray(crop, n, np.uint8)
    p_a = numba.carray(p, N_PARAMS, np.float32)
    gp_a = numba.carray(gp, N_LAWS, np.float64)
    draw_params(numba.carray(u, N_PARAMS, np.float64), gp_a, p_a)
    if p_a[Param.SALIENCY] > 0.5:
        return
    if keep != 0 or needs_pixels(p_a, gp_a):
        buf_a = numba.carray(buf, n, np.float32)
        load(crop_a, 0, s, p_a[Param.FLIP] > 0.5, buf_a)
        color_ops(buf_a, s, p_a, gp_a, numba.carray(tmp, n, np.float32), numba.carray(pad, 3 * (3 * s + 2), np.float32))
        store(buf_a, crop_a, 0, s)
    elif p_a[Param.FLIP] > 0.5:
        flip_u8(crop_a, 0, s)


def finish_salient(crop, s, p, gp, mask, use, buf, tmp, pad):
    """A view that drew saliency, finished by the loader once its mask is known: flip, composite the
    background onto the drawn gray level where `use` (the mask's coverage passed the gate), then the
    view's ops, in place.

    C entry point (all arrays by address), like `finish_view`: crop, the (s, s, 3) uint8 raw crop in
    the row; p, its N_PARAMS float32 drawn parameters; gp, its group's law row; mask, (s s,) float32
    in [0, 1], cropped with the view's window and flipped with it (read only when use != 0); buf, tmp,
    pad: float32 scratch (3 s s, 3 s s, 3 (3 s + 2)).
    """
    n = 3 * s * s
    crop_a = numba.carray(crop, n, np.uint8)
    p_a = numba.carray(p, N_PARAMS, np.float32)
    buf_a = numba.carray(buf, n, np.float32)
    load(crop_a, 0, s, p_a[Param.FLIP] > 0.5, buf_a)
    if use != 0:
        mask_a = numba.carray(mask, s * s, np.float32)
        level = p_a[Param.GRAY_LEVEL]
        for q in range(s * s):
            if mask_a[q] < _HALF:
                buf_a[3 * q] = level
                buf_a[3 * q + 1] = level
                buf_a[3 * q + 2] = level
    color_ops(buf_a, s, p_a, numba.carray(gp, N_LAWS, np.float64), numba.carray(tmp, n, np.float32),
              numba.carray(pad, 3 * (3 * s + 2), np.float32))
    store(buf_a, crop_a, 0, s)


def finish_staged(parent, s, u, gp, p, out, child, tmp, pad):
    """One staged view: draw its parameters, apply its ops to its parent's finished float view.

    C entry point (all arrays by address): parent, the parent's float32 view (`finish_view`'s buf
    with keep); out, the (s, s, 3) uint8 destination in the row; child, tmp, pad: float32 scratch.
    """
    n = 3 * s * s
    p_a = numba.carray(p, N_PARAMS, np.float32)
    gp_a = numba.carray(gp, N_LAWS, np.float64)
    draw_params(numba.carray(u, N_PARAMS, np.float64), gp_a, p_a)
    child_a = numba.carray(child, n, np.float32)
    child_a[:] = numba.carray(parent, n, np.float32)
    color_ops(child_a, s, p_a, gp_a, numba.carray(tmp, n, np.float32), numba.carray(pad, 3 * (3 * s + 2), np.float32))
    store(child_a, numba.carray(out, n, np.uint8), 0, s)


def normalize_views(rows, row_bytes, n, off, count, s, lut, out):
    """Finished uint8 views of a batch → normalised float32, channels first, in one pass.

    C entry point (arrays by address): rows, n rows of row_bytes bytes; a group's `count` views of
    (s, s, 3) uint8 start at byte `off` of each row; lut: (3, 256) float32, the normalised value of
    each level per channel (made by `pipelines.batch.normalize` itself, so the result is bit-equal to
    it); out: (count, n, 3, s, s) float32. Replaces a permuted copy, a cast, a concatenation and two
    normalisation passes in torch; with `pipelines.batch.ReusedBuffers` the output pages are
    already mapped.
    """
    npx = s * s
    src_all = numba.carray(rows, n * row_bytes, np.uint8)
    dst_all = numba.carray(out, count * n * 3 * npx, np.float32)
    table = numba.carray(lut, 3 * 256, np.float32)
    for v in range(count):
        for b in range(n):
            start = b * row_bytes + off + v * 3 * npx
            src = src_all[start:start + 3 * npx]
            base = (v * n + b) * 3 * npx
            d0 = dst_all[base:base + npx]
            d1 = dst_all[base + npx:base + 2 * npx]
            d2 = dst_all[base + 2 * npx:base + 3 * npx]
            for q in range(npx):
                d0[q] = table[src[3 * q]]
                d1[q] = table[256 + src[3 * q + 1]]
                d2[q] = table[512 + src[3 * q + 2]]


@functools.lru_cache(maxsize=None)
def compiled() -> SimpleNamespace:
    """The kernels, compiled (or loaded from numba's cache) once per process.

    The decoder's kernel (`ffcv_decode.decode_rows`) calls `draw_crop`, `draw_uniforms`, `finish_view`
    and `finish_staged` as C functions linked by name (as it calls libffcv), and the loader
    `finish_salient` and `normalize_views` through ctypes, with addresses for arrays; all six are
    compiled here, once, and nothing is compiled while batches flow. Linked as numba dispatchers
    instead, their code was re-optimised into the decoder's (~1.5 s more compile when FFCV compiled
    it per loader), and a dispatcher that gained a new overload after FFCV pipelines had been
    compiled in the process raised KeyError inside numba's overload list. The jitted kernels are
    returned too, for tests.
    """
    import ctypes

    ptr, i64 = numba.types.voidptr, numba.types.int64
    view_sig = numba.types.void(ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64)
    staged_sig = numba.types.void(ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr)
    norm_sig = numba.types.void(ptr, i64, i64, i64, i64, i64, ptr, ptr)
    salient_sig = numba.types.void(ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr)
    u64 = numba.types.uint64
    draws_sig = numba.types.void(u64, u64, i64, i64, i64, i64, ptr)
    crop_sig = numba.types.void(u64, u64, i64, i64, i64, i64, ptr, ptr, ptr)
    draws_c = numba.cfunc(draws_sig, nopython=True, cache=True)(draw_uniforms)
    crop_c = numba.cfunc(crop_sig, nopython=True, cache=True)(draw_crop)
    view_c = numba.cfunc(view_sig, nopython=True, cache=True)(finish_view)
    staged_c = numba.cfunc(staged_sig, nopython=True, cache=True)(finish_staged)
    norm_c = numba.cfunc(norm_sig, nopython=True, cache=True)(normalize_views)
    salient_c = numba.cfunc(salient_sig, nopython=True, cache=True)(finish_salient)
    addr, i64c, u64c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    draws_f = ctypes.CFUNCTYPE(None, u64c, u64c, i64c, i64c, i64c, i64c, addr)(draws_c.address)
    crop_f = ctypes.CFUNCTYPE(None, u64c, u64c, i64c, i64c, i64c, i64c, addr, addr, addr)(crop_c.address)
    view_f = ctypes.CFUNCTYPE(None, addr, i64c, addr, addr, addr, addr, addr, addr, i64c)(view_c.address)
    staged_f = ctypes.CFUNCTYPE(None, addr, i64c, addr, addr, addr, addr, addr, addr, addr)(staged_c.address)
    norm_f = ctypes.CFUNCTYPE(None, addr, i64c, i64c, i64c, i64c, i64c, addr, addr)(norm_c.address)
    salient_f = ctypes.CFUNCTYPE(None, addr, i64c, addr, addr, addr, i64c, addr, addr, addr)(salient_c.address)
    # Keep the compiled objects alive as long as the ctypes pointers into them.
    return SimpleNamespace(draw_uniforms=draws_f, draw_crop=crop_f, finish_view=view_f, finish_staged=staged_f,
                           normalize_views=norm_f, finish_salient=salient_f,
                           _cfuncs=(draws_c, crop_c, view_c, staged_c, norm_c, salient_c),
                           draw_params=draw_params, color_ops=color_ops, needs_pixels=needs_pixels,
                           load=load, store=store, flip_u8=flip_u8)
