"""Recipe presets and validation errors."""

from __future__ import annotations

import pytest

from pipelines.views import PRESETS, RecipeError, load_recipe, recipe_for_dataset


def test_presets_resolve_sizes_and_parameters():
    byol = load_recipe("byol", 64, 32)
    assert [(g.blur_p, g.solarize_p, g.size_px) for g in byol.groups] == [(1.0, 0.0, 64), (0.1, 0.2, 64)]
    rel = load_recipe("relicv2", 224, 96)
    large = [g for g in rel.groups if g.size_px == 224]
    small = [g for g in rel.groups if g.size_px == 96]
    assert [g.blur_p for g in large] == [0.1, 1.0, 0.1, 1.0] and [g.blur_p for g in small] == [0.1, 1.0]
    assert all(g.area == (0.14, 1.0) and g.saliency_p == 0.1 for g in large)
    assert all(g.area == (0.05, 0.14) and g.saliency_p == 0 for g in small)
    rsa = load_recipe("rsa", 32, 16)
    weak, agg = rsa.groups
    assert agg.parent == "weak" and agg.count == weak.count == 2 and agg.size_px == 32
    assert (agg.brightness, agg.contrast, agg.saturation, agg.hue, agg.jitter_p) == (0.4, 0.4, 0.4, 0.1, 0.8)
    mc = load_recipe("multicrop8", 32, 16)
    assert [(g.count, g.size_px) for g in mc.groups] == [(2, 32), (6, 16)]
    plain = load_recipe("plain", 32, 16).groups[0]
    assert (plain.crop_p, plain.flip_p, plain.jitter_p, plain.blur_p) == (0.0, 0.0, 0.0, 0.0)
    assert set(PRESETS) == {"byol", "relicv2", "rsa", "multicrop8", "plain"}
    assert recipe_for_dataset("byol", 500).groups[0].size_px == 224
    assert [g.size_px for g in recipe_for_dataset("multicrop8", 32).groups] == [32, 16]


@pytest.mark.parametrize("body, needle", [
    ("groups:\n  - {name: a, blurr_p: 0.5}", "unknown key(s) ['blurr_p']; valid: name, count"),
    ("groups:\n  - {name: a, gray_p: 1.5}", "gray_p 1.5 outside [0, 1]"),
    ("groups:\n  - {name: a, area: [0.5, 0.2]}", "area [0.5, 0.2]"),
    ("groups:\n  - {name: a}\n  - {name: b, parent: c}", "unknown parent 'c'"),
    ("groups:\n  - {name: a, count: 2}\n  - {name: b, parent: a, area: [0.2, 1.0]}", "no crop of its own"),
    ("groups:\n  - {name: a, count: 2}\n  - {name: b, parent: a}", "count 1 differs from parent"),
    ("groups:\n  - {name: a}\n  - {name: b, size_px: local, saliency_p: 0.1}", "saliency_p on a local group"),
    ("groups:\n  - {name: a, size_px: huge}", "size_px 'huge'"),
    ("groups:\n  - {name: a}\n  - {name: a}", "duplicate group name"),
    ("groups:\n  - {name: a, interpolation: nearest}", "interpolation 'nearest'"),
    ("groups: []", "no view groups"),
    ("views: []\ngroups:\n  - {name: a}", "unknown key(s) ['views']"),
])
def test_validation_errors_are_one_line(tmp_path, body, needle):
    f = tmp_path / "r.yaml"
    f.write_text(body)
    with pytest.raises(RecipeError) as e:
        load_recipe(str(f), 32, 16)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_unknown_recipe_name():
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_recipe("bogus", 32, 16)
