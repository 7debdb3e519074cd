"""The torch tail of the DALI loader (pipelines/dali_tail.py) on crops made here: the reference's ops where
the tail has no deviation to make (grayscale, blur, solarize, staged views), and each view's own drawn
colour pass where it fuses the jitter. The tail behind the DALI graph, against the graph's own tail and
the view laws, is test_dali_backend.py's and test_view_laws.py's ("dali-tail")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")

from pipelines import augment, dali_tail  # noqa: E402
from pipelines.batch import normalize  # noqa: E402
from pipelines.dali_graph import colour_matrices, tail_params  # noqa: E402
from pipelines.views import Recipe, ViewGroup  # noqa: E402

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
B = 6


def _crops(recipe: Recipe, seed: int) -> dict[str, torch.Tensor]:
    """Random uint8 HWC crops of every crop group: {name: (count, B, S, S, 3)}."""
    gen = torch.Generator().manual_seed(seed)
    return {g.name: torch.randint(0, 256, (g.count, B, g.size_px, g.size_px, 3), generator=gen, dtype=torch.uint8)
            for g in recipe.crop_groups}


def _chw(x: torch.Tensor) -> torch.Tensor:
    """(count, B, S, S, 3) uint8 → (count, B, 3, S, S) float in [0, 1]."""
    return x.permute(0, 1, 4, 2, 3).float() / 255


def test_the_tail_without_jitter_is_the_reference_with_staged_views() -> None:
    """Grayscale, blur (the reference's window, per-view sigma, only where drawn), solarize and a staged
    group on its parent's finished views: `augment.finish_views` on the same crops and draws, then
    `batch.normalize`, within float rounding, every field in the recipe's field order."""
    recipe = Recipe("t", (
        ViewGroup("weak", 2, 24, flip_p=0.0, gray_p=0.3, blur_p=0.6, blur_sigma=(0.5, 3.0)),
        ViewGroup("strong", 2, 24, parent="weak", gray_p=0.4, blur_p=0.5, solarize_p=0.5),
        ViewGroup("small", 3, 12, flip_p=0.0, blur_p=1.0, solarize_p=0.4)))
    crops = _crops(recipe, 1)
    drawn = augment.draw_color_params(recipe, B, torch.Generator().manual_seed(2))
    assert all(bool(p.blur.any()) and not bool(p.blur.all()) for n, p in drawn.items() if n != "small")
    want = augment.finish_views({n: _chw(c) for n, c in crops.items()}, torch.zeros(B, dtype=torch.bool), recipe,
                                drawn)
    got = dali_tail.finish(crops, tail_params(recipe, drawn, B), recipe, MEAN, STD)
    assert set(got) == {*recipe.fields, "mixed"} and got["mixed"] is None
    for field, groups in recipe.fields.items():
        ref = normalize(torch.cat([want[g.name] for g in groups]), MEAN, STD)
        assert got[field].shape == ref.shape and got[field].dtype == torch.float32
        assert torch.allclose(got[field], ref, atol=2e-5, rtol=0), field


def test_each_view_takes_its_own_drawn_colour_pass() -> None:
    """With jitter (brightness, contrast, saturation, hue) and grayscale, each view of each sample is
    clamp(M·x + C·μ) with its own drawn matrices (`dali_graph.colour_matrices`), x its crop's levels and
    μ its mean RGB, written here per view from the draws: the tail's batching puts every view's
    parameters on its own crop."""
    g = ViewGroup("v", 3, 16, flip_p=0.0, jitter_p=0.8, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1,
                  gray_p=0.2)
    recipe = Recipe("c", (g,))
    crops = _crops(recipe, 3)
    drawn = augment.draw_color_params(recipe, B, torch.Generator().manual_seed(4))
    m, c = colour_matrices(drawn["v"])                                          # (3·B, 3, 3) view-major
    got = dali_tail.finish(crops, tail_params(recipe, drawn, B), recipe, MEAN, STD)["global_views"]
    for v in range(3):
        for i in range(B):
            x = crops["v"][v, i].double().numpy().reshape(-1, 3)                  # (S·S, 3) levels
            k = v * B + i
            y = np.clip(x @ m[k].T.astype(np.float64) + c[k].astype(np.float64) @ x.mean(0), 0, 255)
            want = (y.reshape(16, 16, 3) / 255 - np.array(MEAN)) / np.array(STD)
            assert np.allclose(got[v, i].permute(1, 2, 0).numpy(), want, atol=1e-4), (v, i)


def test_channels_last_views_are_the_same_values_laid_out_for_the_network() -> None:
    recipe = Recipe("l", (ViewGroup("g", 2, 16, gray_p=0.5, blur_p=0.5), ViewGroup("s", 2, 8, solarize_p=0.5)))
    crops = _crops(recipe, 5)
    params = tail_params(recipe, augment.draw_color_params(recipe, B, torch.Generator().manual_seed(6)), B)
    chw = dali_tail.finish(crops, params, recipe, MEAN, STD)
    hwc = dali_tail.finish(crops, params, recipe, MEAN, STD, channels_last=True)
    for field in ("global_views", "local_views"):
        x = hwc[field]
        assert x.permute(0, 1, 3, 4, 2).is_contiguous()
        assert all(x[v].is_contiguous(memory_format=torch.channels_last) for v in range(x.shape[0]))
        assert torch.equal(x, chw[field])
