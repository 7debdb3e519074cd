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
- staged groups: their own tail on their parent's finished views; then `batch.normalize`.

Unlike the graph, the views stay float between the operations (no rounding to uint8). Every parameter
was drawn by the batch's source with the reference's calls and comes with the crops as one host array
per batch (`tail_params` layout: `TAIL_WIDTH` values a view). Mixes are not made here (the loader
refuses a mix with this tail).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pipelines.augment import blur_kernel_px, gaussian_blur
from pipelines.batch import normalize
from pipelines.views import Recipe, ViewGroup

# One view's tail parameters, in a (B, V, TAIL_WIDTH) float32 array of the batch's V views (`tail_views`).
TAIL_M = slice(0, 9)          # the colour matrix M (3 x 3, row-major)
TAIL_C = slice(9, 18)         # the contrast matrix C (3 x 3): the offset C·μ
TAIL_SIGMA = 18               # blur sigma, px of the view
TAIL_BLUR = 19                # 1: the view blurs
TAIL_SOLARIZE = 20            # 1: the view solarizes
TAIL_WIDTH = 21


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


def finish(crops: dict[str, Tensor], params: np.ndarray, recipe: Recipe, mean, std,
           channels_last: bool = False) -> dict[str, Tensor | None]:
    """The batch's views from its crops and parameters (module docstring).

    Args:
        crops: {crop group name: (count, B, S, S, 3) uint8 HWC crops} on the training device.
        params: (B, V, TAIL_WIDTH) float32 on the host, the views in `tail_views` order.
        mean, std: the dataset's statistics, [0, 1] units.
        channels_last: each (B, 3, S, S) view channels-last in memory (a permuted (V, B, S, S, 3)).

    Returns:
        {`Batch` field: (V, B, 3, S, S) normalised float32, or None where the recipe has none}.
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
    out: dict[str, Tensor | None] = {}
    for field, groups in recipe.fields.items():
        if not groups:
            out[field] = None
            continue
        x = torch.cat([done[g.name].view(g.count, b, 3, g.size_px, g.size_px) for g in groups])   # a copy
        x = normalize(x.div_(255.0), mean, std)
        out[field] = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3) if channels_last else x
    return out
