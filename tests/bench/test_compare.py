"""`make compare`: the baseline row is the method row's resolved config with only what makes the baseline
changed, both rows train over the seeds, and the report gives both and their difference."""

from __future__ import annotations

import json

import pytest

from bench import compare
from train.config import ConfigError, to_dict
from train.resolve import load_config


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("method, changed, against", [
    ("sdmp", {"method", "data.mix.kind"}, ""),
    ("rsa", {"method", "views.recipe"}, ""),
    ("relicv2", {"method", "views.recipe"}, ""),            # the tiny runs give relicv2 a predictor already
    ("dacl", {"method", "data.mix.kind", "data.mix.alpha", "data.mix.source"}, ""),
    ("dacl", {"data.mix.dacl_noises"}, "gaussian"),        # DACL Tables 1-3's Gaussian-noise row
    ("uota", {"method"}, ""),
])
def test_the_baseline_row_differs_from_the_method_row_only_in_what_makes_the_baseline(method, changed, against,
                                                                                      tiny_args, tmp_path) -> None:
    words = tiny_args(method, tmp_path)
    plan = compare.rows(words, tmp_path, against)
    mine, base = (flat({k: v for k, v in to_dict(load_config(plan[row][1])).items()
                        if k not in ("objective", "layers")})          # layers: where the values came from
                  for row in ("method", "baseline"))
    assert {k for k in mine if mine[k] != base[k] and k != "run.name"} == changed     # run.name: set per run
    assert "beside" in plan["paper"]


def test_relicv2_s_baseline_is_byol_with_its_predictor_as_wide_as_the_projector(tmp_path) -> None:
    plan = compare.rows(["method=relicv2", "data=synthetic"], tmp_path)
    mine, base = (load_config(plan[r][1]) for r in ("method", "baseline"))
    assert mine.model.pred_hidden == 0 and base.model.pred_hidden == mine.model.proj_hidden == 256
    assert base.views.recipe == "byol" and mine.views.recipe == "relicv2" and base.optim == mine.optim


def test_moco_v2_star_with_uota_is_compared_with_itself_without_the_reweighting(tiny_args, tmp_path) -> None:
    words = tiny_args("uota", tmp_path, "objective.base=mocov2star", "views.recipe=multicrop8",
                      "model.pred_hidden=0", "model.proj_out=16")
    plan = compare.rows(words, tmp_path)
    mine, base = (load_config(plan[r][1]) for r in ("method", "baseline"))
    assert base.method == "uota" and base.objective.base == "mocov2star" and base.objective.warmup == 1.0
    assert to_dict(base)["model"] == to_dict(mine)["model"] and mine.objective.warmup < 1


def test_a_baseline_is_not_compared(tiny_args, tmp_path) -> None:
    with pytest.raises(ConfigError, match="method=byol is a baseline"):
        compare.rows(tiny_args("byol", tmp_path), tmp_path)
    with pytest.raises(ConfigError, match=r"against=gaussian: method rsa is compared with none"):
        compare.rows(tiny_args("rsa", tmp_path), tmp_path, "gaussian")
    with pytest.raises(ConfigError, match=r"against=byol: method dacl is compared with simclr, gaussian"):
        compare.rows(tiny_args("dacl", tmp_path), tmp_path, "byol")


@pytest.mark.slow
def test_compare_trains_both_rows_over_the_seeds_and_reports_their_difference(tiny_args, tmp_path, capsys) -> None:
    words = [w for w in tiny_args("sdmp", tmp_path / "runs") if not w.startswith(("run.name", "run.out_dir"))]
    assert compare.main([*words, "seeds=2", "steps=2", f"report={tmp_path / 'report'}"]) == 0
    report = json.loads((tmp_path / "report" / "compare.json").read_text())
    assert [r["seed"] for r in report["results"]["method"]] == [0, 1] == [r["seed"] for r in report["results"]["baseline"]]
    for k in ("knn_top1", "linear_top1"):
        d = report["difference"][k]
        assert d["runs"] == pytest.approx([100 * (a[k] - b[k]) for a, b in zip(report["results"]["method"],
                                                                                report["results"]["baseline"])])
    out = capsys.readouterr().out
    assert "| difference (method − baseline) |" in out and "MoCo v3 beside SDMP" in out
    assert compare.main([*words, "seeds=2", "steps=2", f"report={tmp_path / 'report'}"]) == 0   # reuses its runs
    assert capsys.readouterr().out.count("done by an earlier run") == 4
