"""Recipe presets and validation errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelines.views import PRESETS, VARIANTS, Recipe, RecipeError, ViewGroup, load_recipe, recipe_for_dataset


def test_presets_resolve_sizes_and_parameters():
    byol = load_recipe("byol", 64, 32)
    assert [(g.blur_p, g.solarize_p, g.size_px) for g in byol.groups] == [(1.0, 0.0, 64), (0.1, 0.2, 64)]
    rel = load_recipe("relicv2", 224, 96)
    large = [g for g in rel.groups if g.size_px == 224]
    small = [g for g in rel.groups if g.size_px == 96]
    assert [g.blur_p for g in large] == [0.1, 1.0, 0.1, 1.0] and [g.blur_p for g in small] == [0.1, 1.0]
    assert [g.area for g in large] == [(0.14, 1.0), (0.08, 1.0)] * 2       # Table 4: even column 8 %
    assert all(g.saliency_p == 0.1 for g in large)
    assert all(g.area == (0.05, 0.14) and g.saliency_p == 0 for g in small)
    rsa = load_recipe("rsa", 32, 16)
    weak, agg = rsa.groups
    assert agg.parent == "weak" and agg.count == weak.count == 2 and agg.size_px == 32
    assert (agg.brightness, agg.contrast, agg.saturation, agg.hue, agg.jitter_p) == (0.4, 0.4, 0.4, 0.1, 0.8)
    mc = load_recipe("multicrop8", 32, 16)
    assert [(g.count, g.size_px) for g in mc.groups] == [(2, 32), (6, 16)]
    assert all((g.brightness, g.contrast, g.saturation, g.hue, g.solarize_p, g.blur_sigma_at) ==
               (0.8, 0.8, 0.8, 0.2, 0.0, "view") for g in mc.groups)             # SwAV's colour law
    plain = load_recipe("plain", 32, 16).groups[0]
    assert (plain.crop_p, plain.flip_p, plain.jitter_p, plain.blur_p) == (0.0, 0.0, 0.0, 0.0)
    assert set(PRESETS) == {"byol", "relicv2", "rsa", "multicrop8", "plain"}
    # MoCo v3's ResNet views: BYOL's with crops of 20-100 % (its CONFIG.md's --crop-min=.2), nothing else.
    mocov3, byol = load_recipe("mocov3", 32, 16), load_recipe("byol", 32, 16)
    assert [replace(g, area=(0.08, 1.0)) for g in mocov3.groups] == list(byol.groups)
    assert all(g.area == (0.2, 1.0) for g in mocov3.groups) and VARIANTS["mocov3"] == "byol"
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


def test_roles_are_resolved_once_from_parents_and_size_words():
    def counts(r):
        return {name: [(g.name, g.count) for g in groups] for name, groups in r.fields.items()}

    assert counts(load_recipe("relicv2", 64, 32)) == {
        "global_views": [("large1_odd", 1), ("large2_even", 1), ("large3_odd", 1), ("large4_even", 1)],
        "local_views": [("small1_odd", 1), ("small2_even", 1)], "weak_views": []}
    assert counts(load_recipe("rsa", 32, 16)) == {"global_views": [("aggressive", 2)], "local_views": [],
                                                  "weak_views": [("weak", 2)]}
    assert counts(load_recipe("multicrop8", 32, 16))["local_views"] == [("local", 6)]
    # A dataset whose global and local sizes coincide (16-px images: 16/8 -> e.g. global_px=local_px):
    # the words decide, not the sizes.
    mc = load_recipe("multicrop8", 16, 16)
    assert [g.role for g in mc.groups] == ["global", "local"]


def test_staged_views_come_first_in_global_views(tmp_path):
    f = tmp_path / "odd.yaml"
    f.write_text("groups:\n  - {name: extra, size_px: global}\n  - {name: weak, count: 2}\n"
                 "  - {name: agg, count: 2, parent: weak, gray_p: 1.0}\n  - {name: small, size_px: local}\n")
    r = load_recipe(str(f), 32, 16)
    assert [g.name for g in r.fields["global_views"]] == ["agg", "extra"]
    assert [g.name for g in r.fields["weak_views"]] == ["weak"] and [g.name for g in r.fields["local_views"]] == ["small"]
    assert [g.role for g in r.groups] == ["global", "weak", "staged", "local"] and r.group("agg").size_px == 32


def test_code_made_recipes_get_roles_by_size():
    r = Recipe("r", (ViewGroup("a", 2, 24), ViewGroup("b", 3, 12), ViewGroup("c", 1, 24)))
    assert [g.role for g in r.groups] == ["global", "local", "global"]
    assert r.global_px == 24 and [g.name for g in r.fields["global_views"]] == ["a", "c"]


@pytest.mark.parametrize("groups, needle", [
    ((ViewGroup("a", 1, 32, role="global"), ViewGroup("b", 1, 16, role="global")), "sizes [16, 32] px"),
    ((ViewGroup("a", 1, 16, role="local"),), "no global view"),
    ((ViewGroup("a", 2, 32), ViewGroup("b", 2, 16, parent="a")), "no crop of its own"),
    ((ViewGroup("a", 1, 32, role="weak"),), "decided by `parent`"),
    ((ViewGroup("a", 1, 32, role="big"),), "role 'big'"),
    ((ViewGroup("a", 1, 32), ViewGroup("b", 1, 16, saliency_p=0.1)), "saliency applies to global crops only"),
])
def test_role_errors_are_one_line(groups, needle):
    with pytest.raises(RecipeError) as e:
        Recipe("r", groups)
    assert needle in str(e.value) and "\n" not in str(e.value)
