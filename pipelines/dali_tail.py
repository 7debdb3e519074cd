"""The DALI loader's views finished by batched torch operations on the training device
(`LoaderSpec.gpu_tail="torch"`).

On a GPU the DALI graph's cost beyond its crops is the per-view colour tail: each view's colour pass,
blur, solarize and normalisation are DALI operators of their own, and each pays its host set-up, one
operator at a time (docs/benchmarks.md, the H200 profile of 27 Nov). With this tail the graph stops at
the crops: each crop view leaves as uint8 HWC, resized, flipped and with its saliency composite, and
the loader finishes them here, the views of a group (one size) stacked, so that a group's tail is a
few batched kernels whatever its view count:

- jitter + grayscale: the graph's fused colour pass (`dali_graph.colour_matrices`, the same law and
  the same drawn matrices) as one batched product y = M·x + C·μ (μ: the view's mean RGB), clamped to
  [0, 255] once (the graph's deviation from the reference's per-op clamps, and its YIQ hue);
- blur: the reference's `augment.gaussian_blur` (its window `augment.blur_kernel_px`) on the views
  that drew it only, picked on the host (no device sync);
- solarize: levels >= half range inverted, on the views that drew it;
- staged groups: their own tail on their parent's finished views;
- the mixes: the reference's own (`mixing.MIXES[kind].apply`) on the finished source views in [0, 1],
  each training batch of the run with its draws; DACL's per-pixel draws (Binary Mixup's masks, the
  Gaussian noise) made on the device from the seeds the batch drew (`mixing.dacl_pixel_draws`; the
  graph draws them itself);
- then `batch.normalize`.

Unlike the graph, the views stay float between the operations (no rounding to uint8). Every parameter
was drawn by the batch's source with the reference's calls and comes with the crops as host arrays:
`TAIL_WIDTH` values a view (`dali_graph.tail_params`) and, with a mix, `tail_mix_draws`' per sample
beside the batch's partners and lams.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pipelines.augment import blur_kernel_px, gaussian_blur
from pipelines.batch import channels_last_views, normalize
from pipelines.mixing import MIXES, MixDraw, MixSpec, dacl_pixel_draws, mix_sources
from pipelines.views import Recipe, ViewGroup

# One view's tail parameters, in a (B, V, TAIL_WIDTH) float32 array of the batch's V views (`tail_views`).
TAIL_M = slice(0, 9)          # the colour matrix M (3 x 3, row-major)
TAIL_C = slice(9, 18)         # the contrast matrix C (3 x 3): the offset C·μ
TAIL_SIGMA = 18               # blur sigma, px of the view
TAIL_BLUR = 19                # 1: the view blurs
TAIL_SOLARIZE = 20            # 1: the view solarizes
TAIL_WIDTH = 21


# A sample's mix draws, in a (B, MIX_BOXES + 4·V) int64 array of V mixed views (`tail_mix_draws`).
MIX_MIXER, MIX_NOISE, MIX_MASK_SEED, MIX_NORMAL_SEED, MIX_BOXES = 0, 1, 2, 3, 4


def tail_mix_draws(mix: MixSpec, d: MixDraw) -> np.ndarray:
    """The draws of a batch's mixes that the tail needs beside each view's partner and lam (the batch's
    pass-through ids and lam), per sample: the batch's SDMP mixer (its index in `sdmp_mixers`), its DACL
    noise, the batch's seeds of the per-pixel draws and each mixed view's box.

    Returns:
        (B, MIX_BOXES + 4·V) int64.
    """
    v, b = d.partner.shape
    out = np.zeros((b, MIX_BOXES + 4 * v), np.int64)
    out[:, MIX_MIXER] = mix.sdmp_mixers.index(d.mixer) if mix.kind == "sdmp" else 0
    out[:, MIX_NOISE] = d.noise.numpy() if d.noise is not None else 0
    out[:, MIX_MASK_SEED], out[:, MIX_NORMAL_SEED] = d.mask_seed, d.normal_seed
    if d.boxes is not None:
        out[:, MIX_BOXES:] = d.boxes.numpy().transpose(1, 0, 2).reshape(b, 4 * v)
    return out


def _mix_draw(mix: MixSpec, draws: np.ndarray, partner: Tensor, lam: Tensor, size: int) -> MixDraw:
    """One training batch's `MixDraw` on the device, read back from `tail_mix_draws`' rows, its partners
    (V, B) and lams (V, B): the lam the graph passes through is the drawn one wherever the mix reads
    it (mixup and DACL's noises; a box mixer reads its boxes)."""
    dev, (v, b) = partner.device, partner.shape
    boxes = (torch.from_numpy(np.ascontiguousarray(draws[:, MIX_BOXES:].reshape(b, v, 4).transpose(1, 0, 2)))
             .to(dev, non_blocking=True) if mix.kind == "sdmp" else None)
    d = MixDraw(partner=partner, lam=lam, mixer=mix.sdmp_mixers[int(draws[0, MIX_MIXER])] if mix.kind == "sdmp" else "",
                boxes=boxes, noise=torch.from_numpy(draws[:, MIX_NOISE].copy()).to(dev, non_blocking=True),
                mask_seed=int(draws[0, MIX_MASK_SEED]), normal_seed=int(draws[0, MIX_NORMAL_SEED]))
    return dacl_pixel_draws(d, mix, size, size, dev) if mix.kind == "dacl" else d


def tail_views(recipe: Recipe) -> list[ViewGroup]:
    """The groups whose views the tail finishes, in the order of their views in the parameters: the
    crop groups in recipe order, then the staged groups (`augment.draw_color_params`'s order)."""
    return list(recipe.crop_groups + recipe.by_role("staged"))


def uses_colour(g: ViewGroup) -> bool:
    """Whether the group's views take a colour pass (jitter with a non-zero amplitude, or grayscale)."""
    return g.jitter_p > 0 and bool(g.brightness or g.contrast or g.saturation or g.hue) or g.gray_p > 0


def uses_contrast(g: ViewGroup) -> bool:
    """Whether the group's colour pass adds a contrast offset C·μ (made from the view's mean)."""
    return g.jitter_p > 0 and g.contrast > 0


def _view_range(recipe: Recipe, name: str) -> slice:
    """The group's views' columns in the (B, V, TAIL_WIDTH) parameters."""
    start = 0
    for g in tail_views(recipe):
        if g.name == name:
            return slice(start, start + g.count)
        start += g.count
    raise KeyError(name)


def _finish_group(x: Tensor, p: Tensor, host: np.ndarray, g: ViewGroup) -> Tensor:
    """One group's colour pass, blur and solarize.

    Args:
        x: (N, 3, S, S) float levels in [0, 255], N = count·B views, view-major.
        p: (N, TAIL_WIDTH) the views' parameters on x's device. host: the same on the host.

    Returns:
        (N, 3, S, S) float levels in [0, 255].
    """
    n, _, s, _ = x.shape
    m, c = p[:, TAIL_M].view(n, 3, 3), p[:, TAIL_C].view(n, 3, 3)
    if uses_colour(g):
        flat = x.reshape(n, 3, s * s)
        offset = torch.bmm(c, flat.mean(2, keepdim=True)) if uses_contrast(g) else None
        # y = M·x + C·μ, each view its own matrices (one batched product), clamped once
        y = torch.baddbmm(offset, m, flat) if offset is not None else torch.bmm(m, flat)
        x = y.clamp_(0.0, 255.0).view(n, 3, s, s)
    blur = np.flatnonzero(host[:, TAIL_BLUR] > 0.5)
    if blur.size:
        rows = torch.from_numpy(blur).to(x.device, non_blocking=True)
        x = x.index_copy(0, rows, gaussian_blur(x.index_select(0, rows), p[rows, TAIL_SIGMA], blur_kernel_px(g)))
    if g.solarize_p > 0:
        solarize = (p[:, TAIL_SOLARIZE] > 0.5).view(n, 1, 1, 1)
        x = torch.where(solarize & (x >= 127.5), 255.0 - x, x)        # augment: pixels >= 0.5 inverted
    return x


def finish(crops: dict[str, Tensor], params: np.ndarray, recipe: Recipe, mean, std, channels_last: bool = False,
           mix: MixSpec | None = None, mixes: tuple[np.ndarray, Tensor, Tensor, int] | None = None
           ) -> dict[str, Tensor | None]:
    """The batch's views, and its mixes, from its crops and parameters (module docstring).

    Args:
        crops: {crop group name: (count, B, S, S, 3) uint8 HWC crops} on the training device.
        params: (B, V, TAIL_WIDTH) float32 on the host, the views in `tail_views` order.
        mean, std: the dataset's statistics, [0, 1] units.
        channels_last: each (B, 3, S, S) view channels-last in memory (a permuted (V, B, S, S, 3)).
        mix: the mixes' spec (the recipe is `mixing.with_mix_source`'s); None or kind "none": no mixes.
        mixes: with a mix, (`tail_mix_draws` (B, ...) on the host, partners (V, B) and lams (V, B) on the
            device, the training batch size): a run of the graph may hold several training batches,
            each mixed within itself.

    Returns:
        {`Batch` field and "mixed": (V, B, 3, S, S) normalised float32, or None where there is none}.
    """
    dev = next(iter(crops.values())).device
    b = params.shape[0]
    on_dev = torch.from_numpy(params).to(dev, non_blocking=True)
    done: dict[str, Tensor] = {}                                            # group → (N, 3, S, S) levels
    for g in tail_views(recipe):
        cols = _view_range(recipe, g.name)
        # (B, count, W) → (count·B, W): view-major, as the crops
        p = on_dev[:, cols].transpose(0, 1).reshape(g.count * b, TAIL_WIDTH)
        host = params[:, cols].transpose(1, 0, 2).reshape(g.count * b, TAIL_WIDTH)
        if g.crops:
            c = crops[g.name]
            s = c.shape[2]
            # HWC uint8 to CHW float levels: one copy that casts and transposes
            x = torch.empty((g.count * b, 3, s, s), dtype=torch.float32, device=dev)
            x.copy_(c.reshape(g.count * b, s, s, 3).permute(0, 3, 1, 2))
        else:
            x = done[g.parent]
        done[g.name] = _finish_group(x, p, host, g)

    def handed_out(x: Tensor) -> Tensor:          # (V, B, 3, S, S) in [0, 1] → normalised, in the network's layout
        x = normalize(x, mean, std)
        return channels_last_views(x) if channels_last else x

    views = {g.name: done[g.name].view(g.count, b, 3, g.size_px, g.size_px) for g in tail_views(recipe)}
    out: dict[str, Tensor | None] = {}
    for field, groups in recipe.fields.items():
        out[field] = handed_out(torch.cat([views[g.name] for g in groups]).div_(255.0)) if groups else None  # a copy
    out["mixed"] = None
    if mix is not None and mix.kind != "none":
        draws, partner, lam, batch_size = mixes
        src = mix_sources(views, recipe, mix).div_(255.0)                                 # (V, B, 3, S, S), a copy
        made = []
        for rows in (slice(j, j + batch_size) for j in range(0, b, batch_size)):     # each training batch
            d = _mix_draw(mix, draws[rows], partner[:, rows], lam[:, rows], src.shape[-1])
            made.append(MIXES[mix.kind].apply(src[:, rows], d, mix)[0])
        out["mixed"] = handed_out(torch.cat(made, 1))
    return out
