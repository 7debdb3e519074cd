"""Intra-batch mixes: algebraic properties (hypothesis) and the laws of lam."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats

from pipelines import mixing
from pipelines.mixing import MixSpec
from tests.pipelines import mix_laws

SET = settings(max_examples=25, deadline=None)


def _batch(seed: int, b: int, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


@SET
@given(st.integers(1, 32).map(lambda k: 2 * k))
def test_partner_is_fixed_point_free_involution(b):
    p = mixing.partner_index(b)
    assert torch.equal(p[p], torch.arange(b))
    assert not (p == torch.arange(b)).any()


@SET
@given(st.integers(0, 10_000), st.integers(1, 8).map(lambda k: 2 * k))
def test_lam_one_leaves_batch_unchanged(seed, b):
    x = _batch(seed, b)
    p = mixing.partner_index(b)
    one = torch.ones(b)
    assert torch.allclose(mixing.mixup(x, one, p), x)
    assert torch.allclose(mixing.dacl_linear(x, p, one), x)
    assert torch.allclose(mixing.dacl_geometric(x, p, one), x, atol=1e-6)
    assert torch.equal(mixing.dacl_binary(x, p, torch.ones_like(x, dtype=torch.bool)), x)
    empty = torch.zeros(b, 4, dtype=torch.long)
    for f in (mixing.cutmix, mixing.resizemix):
        y, lam = f(x, empty, p)
        assert torch.equal(y, x) and torch.equal(lam, torch.ones(b))


@SET
@given(st.integers(0, 10_000), st.lists(st.integers(-6, 14), min_size=4, max_size=4))
def test_cutmix_and_resizemix_lam_is_real_pixel_fraction(seed, box):
    b, h, w = 4, 8, 10
    x = _batch(seed, b, h, w)
    p = mixing.partner_index(b)
    x[p] += 5.0  # partners distinguishable: values > 1 mark pasted pixels
    y0, x0, y1, x1 = box
    boxes = torch.tensor([[y0, x0, y1, x1]] * b)
    for f in (mixing.cutmix, mixing.resizemix):
        y, lam = f(x.clone(), boxes, p)
        own = (y == x).all(1).flatten(1).float().mean(1)
        assert torch.allclose(lam, own), (f.__name__, lam, own)
        cy = max(0, min(y1, h) - max(y0, 0)); cx = max(0, min(x1, w) - max(x0, 0))
        assert torch.allclose(lam, torch.full((b,), 1 - cy * cx / (h * w)))


@SET
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_permutation_commutes_with_mixing(seed, l):
    b = 6
    g = torch.Generator().manual_seed(seed)
    x = _batch(seed, b)
    partner = (torch.arange(b) + torch.randint(1, b, (b,), generator=g)) % b
    lam = torch.full((b,), l)
    perm = torch.randperm(b, generator=g)
    inv = torch.argsort(perm)
    pp = inv[partner[perm]]  # partners expressed in the permuted batch
    boxes = torch.tensor([[1, 2, 6, 7]] * b)
    mask = torch.rand(x.shape, generator=g) < 0.5
    assert torch.allclose(mixing.mixup(x, lam, partner)[perm], mixing.mixup(x[perm], lam, pp))
    assert torch.allclose(mixing.dacl_geometric(x, partner, lam)[perm], mixing.dacl_geometric(x[perm], pp, lam))
    assert torch.equal(mixing.dacl_binary(x, partner, mask)[perm], mixing.dacl_binary(x[perm], pp, mask[perm]))
    for f in (mixing.cutmix, mixing.resizemix):
        a, la = f(x, boxes, partner)
        c, lc = f(x[perm], boxes[perm], pp)
        assert torch.allclose(a[perm], c) and torch.allclose(la[perm], lc)


@SET
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_geometric_mixing_with_itself_is_identity(seed, l):
    x = _batch(seed, 4)
    same = torch.arange(4)
    assert torch.allclose(mixing.dacl_geometric(x, same, torch.full((4,), l)), x, atol=1e-5)


def test_sdmp_lam_is_beta_and_one_mixer_per_batch():
    g = torch.Generator().manual_seed(0)
    for alpha in (0.5, 1.0, 2.0):
        d = mixing.sample_sdmp(2, 4000, 32, 32, mixing.MixSpec("sdmp", alpha=alpha, sdmp_mixers=("mixup",)), g, "cpu")
        assert stats.kstest(d.lam[0].numpy(), stats.beta(alpha, alpha).cdf).pvalue > 1e-3
        for box in ("cutmix", "resizemix"):     # SDMP's code: 0.1 + 0.8 Beta, boxes of 10-90 % of the image
            d = mixing.sample_sdmp(2, 4000, 32, 32, mixing.MixSpec("sdmp", alpha=alpha, sdmp_mixers=(box,)), g, "cpu")
            assert stats.kstest(d.lam[0].numpy(), stats.beta(alpha, alpha, loc=0.1, scale=0.8).cdf).pvalue > 1e-3
    mixers = {mixing.sample_sdmp(2, 2, 8, 8, mixing.MixSpec("sdmp"), g, "cpu").mixer for _ in range(60)}
    assert mixers == set(mixing.SDMP_MIXERS)


def _constant_colour_views(b: int, s: int, v: int = 2) -> torch.Tensor:
    """(V, B, 3, S, S) pixel levels: sample i is one colour, unique per sample, in every view."""
    colour = torch.stack([torch.full((b,), 200.0), 40.0 + 3 * torch.arange(b), torch.full((b,), 90.0)], 1)
    return colour.view(1, b, 3, 1, 1).expand(v, b, 3, s, s).clone()


@pytest.mark.parametrize("mixer", ["mixup", "cutmix", "resizemix"])
def test_sdmp_laws_of_the_reference(mixer):
    b, s = 32, 16
    x = _constant_colour_views(b, s)
    spec = mixing.MixSpec("sdmp", alpha=1.0, sdmp_mixers=(mixer,))
    out = mixing.mix_views(x / 255, spec, torch.Generator().manual_seed(4))
    boxes = mix_laws.pasted_boxes(out.mixed * 255, x, tol=1e-3)
    clipped = mix_laws.check_sdmp_laws(mixer, out.draw.lam[0], out.lam, boxes, out.partner, s)
    assert mixer != "cutmix" or clipped > 0
    if mixer != "mixup":                           # positions spread over the image, up to both borders
        d = mixing.sample_sdmp(2, 4000, s, s, spec, torch.Generator().manual_seed(5), "cpu")
        y0, y1 = d.boxes[0, :, 0], d.boxes[0, :, 2]
        assert int(y0.min()) == 0 and int(y1.max()) == s and y0.unique().numel() >= s // 2


def test_dacl_laws_of_the_reference():
    b, s = 32, 16
    x = _constant_colour_views(b, s)
    spec = mixing.MixSpec("dacl", alpha=0.5, dacl_noises=mixing.DACL_NOISES)
    out = mixing.mix_views(x / 255, spec, torch.Generator().manual_seed(6))
    kinds = mix_laws.noise_kinds(out.mixed * 255, x, out.partner, out.lam, tol=1e-3)
    mix_laws.check_dacl_laws(out.partner, out.lam, kinds, 0.5, own=torch.arange(b), noises={0, 1, 2},
                             drawn=out.draw.noise)
    g = torch.Generator().manual_seed(1)
    d = mixing.sample_dacl(2, 4000, 4, 4, mixing.MixSpec("dacl", alpha=0.6, dacl_noises=mixing.DACL_NOISES), g, "cpu")
    assert not (d.partner == torch.arange(4000)).any()
    assert stats.kstest(d.lam[0].numpy(), stats.uniform(0.6, 0.4).cdf).pvalue > 1e-3
    assert set(d.noise.tolist()) == {0, 1, 2}


def test_binary_mixup_keeps_its_own_pixels_where_the_mask_says():
    x = torch.zeros(1, 8, 3, 16, 16)
    x[:, ::2] = 1.0                                                 # even samples 1, partners (odd) 0
    d = mixing.MixDraw(partner=torch.arange(8).roll(1).view(1, 8), lam=torch.full((1, 8), 0.7),
                       noise=torch.zeros(8, dtype=torch.long),
                       keep=torch.rand(1, 8, 3, 16, 16, generator=torch.Generator().manual_seed(2)) < 0.7)
    y, _ = mixing.apply_dacl(x, d, mixing.MixSpec("dacl", dacl_noises=("binary",)))
    kept = (y[0, ::2] == 1.0).float().mean().item()                # even samples keep their own 1s at the mask's rate
    assert abs(kept - 0.7) < 0.03


def test_plain_dacl_is_linear_mixup_alone():
    """Algorithm 1 (plain DACL, the default noises): every positive is lam x + (1 - lam) x~, never a
    geometric or binary mix."""
    b, s = 16, 8
    x = _constant_colour_views(b, s)
    spec = mixing.MixSpec("dacl", alpha=0.5)
    assert spec.dacl_noises == ("linear",)
    out = mixing.mix_views(x / 255, spec, torch.Generator().manual_seed(7))
    lam = out.lam.view(2, b, 1, 1, 1)
    want = lam * x / 255 + (1 - lam) * torch.stack([x[v][out.partner[v]] for v in range(2)]) / 255
    torch.testing.assert_close(out.mixed, want, atol=1e-6, rtol=0)


def test_the_gaussian_noise_baseline_adds_scaled_standard_normal_noise_to_each_positive():
    """DACL Sec. 4's Gaussian-noise positives, x+ = x + alpha delta and x++ = x + alpha delta' with
    delta, delta' ~ N(0, sigma^2 I), sigma 1 (Sec. 5), transcribed on [0, 1] pixels and clipped to them:
    each positive its own delta, no partner (lam 1), the same draws from the same generator."""
    b, s, alpha = 32, 16, 0.3
    x = torch.rand(2, b, 3, s, s, generator=torch.Generator().manual_seed(1))
    spec = mixing.MixSpec("dacl", alpha=0.5, dacl_noises=("gaussian",), gauss_scale=alpha)
    out = mixing.mix_views(x, spec, torch.Generator().manual_seed(9))
    delta = out.draw.normal                                                         # (2, B, 3, S, S)
    assert delta.shape == x.shape and abs(delta.mean().item()) < 0.02 and abs(delta.std().item() - 1) < 0.02
    assert stats.kstest(delta.flatten().numpy(), stats.norm.cdf).pvalue > 1e-3
    assert torch.corrcoef(torch.stack([delta[0].flatten(), delta[1].flatten()]))[0, 1].abs() < 0.02
    want = torch.minimum(torch.maximum(x + alpha * delta, torch.zeros(())), torch.ones(()))
    torch.testing.assert_close(out.mixed, want, atol=0, rtol=0)
    assert torch.equal(out.lam, torch.ones(2, b))
    again = mixing.mix_views(x, spec, torch.Generator().manual_seed(9))
    assert torch.equal(again.mixed, out.mixed)
    # With Mixup-noises (DACL+ beside the baseline), a sample that drew another noise keeps its partner
    # and lam, and its draws are those the Mixup-noises alone would make.
    both = mixing.MixSpec("dacl", alpha=0.5, dacl_noises=("linear", "gaussian"))
    d = mixing.sample_dacl(2, b, s, s, both, torch.Generator().manual_seed(4), "cpu")
    plain = mixing.sample_dacl(2, b, s, s, mixing.MixSpec("dacl", alpha=0.5, dacl_noises=("linear", "binary")),
                               torch.Generator().manual_seed(4), "cpu")
    linear = d.noise == 0
    assert torch.equal(d.lam[:, linear], plain.lam[:, linear]) and torch.equal(d.lam[:, ~linear], torch.ones(2, int((~linear).sum())))
    with pytest.raises(ValueError, match="gauss_scale must be > 0"):
        mixing.check_mix(mixing.MixSpec("dacl", alpha=0.5, dacl_noises=("gaussian",), gauss_scale=0.0))
    assert not mixing.affine_in_pixels(spec)


@pytest.mark.parametrize("swap", [0.1, 0.5])
def test_binary_mixup_swaps_the_set_share_of_elements_whatever_lam(swap):
    """Eq. (6) with rho = 1 - binary_swap (the grid {0.1, 0.3, 0.5} read as the swapped share)."""
    spec = mixing.MixSpec("dacl", alpha=0.9, dacl_noises=("binary",), binary_swap=swap)
    d = mixing.sample_dacl(2, 64, 16, 16, spec, torch.Generator().manual_seed(8), "cpu")
    assert float(d.lam.min()) >= 0.9 and abs(d.keep.float().mean().item() - (1 - swap)) < 0.01
    with pytest.raises(ValueError, match="binary_swap is a probability"):
        mixing.check_mix(mixing.MixSpec("dacl", alpha=0.5, binary_swap=1.5))


@pytest.mark.parametrize("mix", [MixSpec(kind="sdmp", sdmp_mixers=(m,)) for m in mixing.SDMP_MIXERS]
                         + [MixSpec(kind="dacl", alpha=0.5, source="image"),
                            MixSpec(kind="dacl", alpha=0.5, source="image", dacl_noises=("linear", "binary"))],
                         ids=[*mixing.SDMP_MIXERS, "dacl", "dacl-linear-binary"])
def test_affine_mixes_of_normalised_views_are_the_normalised_mixes(mix) -> None:
    """What the compiled FFCV path relies on (`mixing.affine_in_pixels`): mixing the normalised views
    gives `mix_batch`'s normalised mixes of the [0, 1] views, the same draws from the same generator,
    into a reused buffer as into new memory; DACL's geometric noise is not affine and is not claimed."""
    from pipelines.batch import mix_batch, normalize
    from pipelines.views import load_recipe

    recipe = mixing.with_mix_source(load_recipe("byol", 24, 12), mix)
    g = torch.Generator().manual_seed(3)
    views = {grp.name: torch.randint(0, 256, (grp.count, 8, 3, 24, 24), dtype=torch.uint8, generator=g)
             for grp in recipe.groups}
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    expected, lam, partner = mix_batch(views, recipe, mix, torch.Generator().manual_seed(7), mean, std, "cpu")
    src = normalize(mixing.mix_sources(views, recipe, mix), mean, std)
    buffer = torch.full_like(expected, float("nan"))
    got = mixing.mix_views(src, mix, torch.Generator().manual_seed(7), out=buffer)
    assert mixing.affine_in_pixels(mix) and got.mixed is buffer
    assert torch.allclose(got.mixed, expected, atol=1e-5) and torch.equal(got.lam, lam) and torch.equal(got.partner, partner)
    assert not mixing.affine_in_pixels(MixSpec(kind="dacl", dacl_noises=("linear", "geometric")))
