"""The reference recipe (pipelines/augment.py): parameter laws, op semantics, staged and saliency views."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

from pipelines import augment
from pipelines.views import Recipe, ViewGroup


def test_crop_area_and_ratio_follow_the_recipe_law():
    g = ViewGroup(name="a", area=(0.05, 0.3), ratio=(0.5, 2.0))
    n = 3000
    hw = torch.tensor([[1000, 1000]] * n)
    boxes = augment.sample_crop_boxes(hw, g, torch.Generator().manual_seed(0)).double()
    area = boxes[:, 2] * boxes[:, 3] / 1e6
    ratio = boxes[:, 3] / boxes[:, 2]
    assert stats.kstest(area.numpy(), stats.uniform(0.05, 0.25).cdf).pvalue > 1e-3
    lr = np.log(ratio.numpy())
    assert stats.kstest(lr, stats.uniform(math.log(0.5), math.log(4.0)).cdf).pvalue > 1e-3
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= 1000).all()
    assert (boxes[:, 1] >= 0).all() and (boxes[:, 1] + boxes[:, 3] <= 1000).all()
    # Horizontal position uniform over the free range: mean of the box centre ~ image centre.
    cx = (boxes[:, 1] + boxes[:, 3] / 2) / 1000
    assert abs(cx.mean().item() - 0.5) < 0.02


def test_the_centre_crop_is_the_central_square_of_its_share_of_the_shorter_side():
    """Evaluation's Resize(256) + CenterCrop(224) as one window: the central square of 224/256 of the
    shorter side, whatever the draws (the uniforms are still drawn, so the streams stay aligned)."""
    g = ViewGroup(name="c", size_px=224, centre_crop=224 / 256, flip_p=0.0)
    hw = torch.tensor([[375, 500], [500, 333], [256, 256], [1, 9]])
    for seed in range(3):
        boxes = augment.sample_crop_boxes(hw, g, torch.Generator().manual_seed(seed))
        assert boxes.tolist() == [[23, 86, 328, 328], [104, 21, 291, 291], [16, 16, 224, 224], [0, 4, 1, 1]]


def test_crop_fallback_and_crop_p():
    # A 10 x 1000 strip cannot hold a 3/4..4/3 crop of >= 50 % area: central crop, ratio clamped.
    g = ViewGroup(name="a", area=(0.5, 1.0))
    boxes = augment.sample_crop_boxes(torch.tensor([[10, 1000]] * 5), g, torch.Generator().manual_seed(0))
    assert boxes.tolist() == [[0, 493, 10, 13]] * 5
    whole = augment.sample_crop_boxes(torch.tensor([[30, 40]] * 2000), ViewGroup(name="b", crop_p=0.3),
                                 torch.Generator().manual_seed(1))
    rate = (whole == torch.tensor([0, 0, 30, 40])).all(1).float().mean().item()
    assert abs(rate - 0.7) < 4 * math.sqrt(0.21 / 2000)


@pytest.mark.parametrize("field, p", [("flip", 0.5), ("gray", 0.2), ("blur", 0.1), ("solarize", 0.2), ("jitter", 0.8)])
def test_flag_rates_within_binomial_tolerance(field, p):
    g = ViewGroup(name="a", flip_p=0.5, gray_p=0.2, blur_p=0.1, solarize_p=0.2, jitter_p=0.8, brightness=0.4)
    n = 4000
    params = augment.sample_color_params(n, g, torch.Generator().manual_seed(2))
    rate = getattr(params, field).float().mean().item()
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(torch.sort(params.order, 1).values, torch.arange(4).expand(n, 4))


def test_rendered_ops_match_their_flags():
    # Solid colour image halves: flip, gray and solarize are visible in the rendered view.
    img = torch.zeros(3, 16, 16, dtype=torch.uint8)
    img[0, :, :8] = 200
    img[2, :, 8:] = 60
    g = ViewGroup(name="v", count=1, size_px=16, crop_p=0.0, flip_p=0.5, gray_p=0.3, solarize_p=0.4)
    b = 600
    out = augment.render_views([img] * b, None, torch.full((b,), -1.0), Recipe("t", (g,)), torch.Generator().manual_seed(5))
    x = out["v"][0]
    gray = (x[:, 0] == x[:, 1]).all(-1).all(-1) & (x[:, 1] == x[:, 2]).all(-1).all(-1)
    assert abs(gray.float().mean().item() - 0.3) < 4 * math.sqrt(0.21 / b)
    left_red = (x[:, 0, :, :4].mean((1, 2)) > x[:, 0, :, -4:].mean((1, 2))) | gray
    # Red on the left unless flipped; solarize maps 200/255 → 55/255 and 0 → 0 for red: stays left.
    flipped = ~left_red
    assert abs(flipped.float().mean().item() - 0.5 * 0.7) < 4 * math.sqrt(0.23 / b)


def test_color_jitter_and_blur_match_torchvision_semantics():
    import torchvision.transforms.functional as tvf

    x = torch.rand(1, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    for op, fn, f in ((0, tvf.adjust_brightness, 1.3), (1, tvf.adjust_contrast, 0.7),
                      (2, tvf.adjust_saturation, 1.4), (3, tvf.adjust_hue, -0.1)):
        assert torch.allclose(augment._jitter_op(x, op, torch.tensor([f])), fn(x, f), atol=1e-5), op
    blurred = augment.gaussian_blur(x, torch.tensor([1.1]), 5)
    assert torch.allclose(blurred, tvf.gaussian_blur(x, [5, 5], [1.1, 1.1]), atol=1e-5)


def test_views_of_one_sample_are_independent():
    g = ViewGroup(name="v", count=2, size_px=8, area=(0.1, 1.0), flip_p=0.5)
    b = 1500
    img = torch.randint(0, 255, (3, 20, 20), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(9)
    boxes = augment.sample_crop_boxes(torch.tensor([[20, 20]] * (2 * b)), g, gen).view(2, b, 4).double()
    area = boxes[..., 2] * boxes[..., 3]
    assert abs(stats.pearsonr(area[0].numpy(), area[1].numpy())[0]) < 4 / math.sqrt(b)
    p = augment.sample_color_params(2 * b, g, gen).flip.view(2, b).float()
    assert abs(stats.pearsonr(p[0].numpy(), p[1].numpy())[0]) < 4 / math.sqrt(b)
    out = augment.render_views([img] * 8, None, torch.full((8,), -1.0), Recipe("t", (g,)), gen)["v"]
    assert not torch.equal(out[0], out[1])


def test_staged_view_equals_weak_view_when_its_ops_are_off():
    weak = ViewGroup(name="weak", count=2, size_px=16, area=(0.2, 1.0))
    staged = ViewGroup(name="agg", count=2, size_px=16, parent="weak")
    imgs = [torch.randint(0, 255, (3, 24, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            for i in range(6)]
    out = augment.render_views(imgs, None, torch.full((6,), -1.0), Recipe("t", (weak, staged)), torch.Generator().manual_seed(0))
    assert torch.equal(out["agg"], out["weak"])
    on = dataclasses.replace(staged, gray_p=1.0)
    out = augment.render_views(imgs, None, torch.full((6,), -1.0), Recipe("t", (weak, on)), torch.Generator().manual_seed(0))
    expect = augment._gray(out["weak"].flatten(0, 1)).expand(-1, 3, -1, -1)
    assert torch.allclose(out["agg"].flatten(0, 1), expect)


def test_saliency_composite_never_grays_foreground():
    b = 64
    gen = torch.Generator().manual_seed(4)
    imgs = [torch.randint(0, 255, (3, 32, 32), dtype=torch.uint8, generator=gen) for _ in range(b)]
    masks = []
    for i in range(b):
        m = torch.zeros(1, 32, 32, dtype=torch.uint8)
        m[:, 4 + i % 8:20 + i % 8, 6:26] = 255
        masks.append(m)
    cov = torch.tensor([m.float().mean().item() / 255 for m in masks])
    cov[:8] = 0.01  # unreliable masks: never applied
    on = ViewGroup(name="v", count=2, size_px=16, area=(0.3, 1.0), saliency_p=1.0)
    off = dataclasses.replace(on, saliency_p=0.0)
    a = augment.render_views(imgs, masks, cov, Recipe("t", (on,)), torch.Generator().manual_seed(1))["v"]
    o = augment.render_views(imgs, masks, cov, Recipe("t", (off,)), torch.Generator().manual_seed(1))["v"]
    # Replay the engine's draws (boxes, then view parameters) to get each view's window and flip.
    gen = torch.Generator().manual_seed(1)
    boxes = augment.sample_crop_boxes(torch.tensor([[32, 32]] * (2 * b)), on, gen)
    params = augment.sample_color_params(2 * b, on, gen)
    mc = augment.render_crops(masks * 2, boxes, 16, "bilinear")                      # (2B, 1, 16, 16)
    mc = torch.where(params.flip.view(-1, 1, 1, 1), mc.flip(-1), mc).view(2, b, 1, 16, 16)
    fg = (mc >= 0.5).expand_as(a)
    diff = a != o
    assert not (diff & fg).any()                       # foreground never changed
    assert not diff[:, :8].any()                       # low coverage: background kept
    assert diff[:, 8:].any()                           # background replaced elsewhere
    level = params.gray_level.view(2, b)
    for v in range(2):
        for i in range(8, b):
            bg = a[v, i][~fg[v, i]]
            assert torch.allclose(bg, torch.full_like(bg, float(level[v, i])))


def test_saliency_background_goes_before_the_colour_ops():
    """RELICv2 Listing 1 removes the background before the view is augmented: with solarize always
    on, the background is the solarized gray level, not the level itself."""
    b = 32
    gen = torch.Generator().manual_seed(3)
    imgs = [torch.randint(0, 255, (3, 16, 16), dtype=torch.uint8, generator=gen) for _ in range(b)]
    mask = torch.zeros(1, 16, 16, dtype=torch.uint8)
    mask[:, 4:12, 4:12] = 255
    g = ViewGroup(name="v", count=1, size_px=16, crop_p=0.0, flip_p=0.0, saliency_p=1.0, solarize_p=1.0)
    out = augment.render_views(imgs, [mask] * b, torch.full((b,), 0.25), Recipe("t", (g,)),
                               torch.Generator().manual_seed(1))["v"][0]          # (B, 3, 16, 16)
    gen = torch.Generator().manual_seed(1)                                        # replay: boxes, then params
    augment.sample_crop_boxes(torch.tensor([[16, 16]] * b), g, gen)
    level = augment.sample_color_params(b, g, gen).gray_level                     # (B,)
    want = torch.where(level >= 0.5, 1.0 - level, level)
    corner = out[:, :, 0, 0]                                                      # background pixel
    assert torch.allclose(corner, want.view(-1, 1).expand(-1, 3))
    assert not torch.allclose(corner, level.view(-1, 1).expand(-1, 3))


@pytest.mark.parametrize("preset", ["byol", "relicv2", "rsa", "multicrop8", "mocov3"])
def test_every_recipe_blurs_with_sigma_in_px_of_the_view_and_not_the_identity_at_32_px(preset: str):
    """One blur reading for every recipe family: sigma in [0.1, 2] px of the view itself at every size (the
    codes behind the papers' CIFAR tables: MoCo v2's blur in RSA's, MoCo v3's in SDMP's, SwAV's PIL radius).
    Scaled from 224 px, BYOL's and RELICv2's 32-px views got sigma <= 0.29 px, next to the identity, while
    RSA's and SwAV's got up to 2 px. At 224 px this is BYOL's and RELICv2's 23-px window."""
    from pipelines.views import load_recipe

    for g in load_recipe(preset, 32, 16).groups:
        if g.blur_p > 0:
            assert augment.blur_sigma_px(g) == (0.1, 2.0) and augment.blur_kernel_px(g) >= 13, g.name
            x = (torch.arange(g.size_px).view(1, -1) + torch.arange(g.size_px).view(-1, 1)) % 2 * torch.ones(1, 3, 1, 1)
            y = augment.gaussian_blur(x, torch.tensor([1.0]), augment.blur_kernel_px(g))     # a checkerboard
            assert float((y - x).abs().mean()) > 0.3, g.name
    for g in load_recipe(preset, 224, 96).groups:
        if g.blur_p > 0 and g.size_px == 224 and preset in ("byol", "relicv2", "mocov3"):
            assert augment.blur_kernel_px(g) == 23, g.name


def test_relicv2_blur_is_a_23_px_window_with_sigma_0_1_to_2_on_every_view():
    """RELICv2 App. A.1 step 5: "a 23 x 23 Gaussian kernel with standard deviation sampled uniformly
    in [0.1, 2.0]", for the 224-px large and the 96-px small crops alike (the small ones were given
    sigma in [0.04, 0.86], scaled from 224); sigma in px of the view at other sizes, the window 23 px
    or the view's side."""
    from pipelines.views import load_recipe

    recipe = load_recipe("relicv2", 224, 96)
    assert len(recipe.groups) == 6
    for g in recipe.groups:
        assert augment.blur_kernel_px(g) == 23 and augment.blur_sigma_px(g) == pytest.approx((0.1, 2.0)), g.name
    small = load_recipe("relicv2", 224, 48).groups[-1]
    assert augment.blur_sigma_px(small) == pytest.approx((0.1, 2.0)) and augment.blur_kernel_px(small) == 23
    assert augment.blur_kernel_px(load_recipe("relicv2", 32, 16).groups[-1]) == 17
