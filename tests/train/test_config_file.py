"""`config=<file.yaml>`: a config file is a layer after the presets and before `key=value` words; a
run's saved config.yaml re-runs that run; a bad file is one line `error: ...` and nothing is written."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.train.test_train_cli import fails_in_one_line
from train.config import ConfigError, dump_yaml
from train.objectives import OBJECTIVES
from train.resolve import load_config


@pytest.mark.parametrize("method", sorted(OBJECTIVES))
def test_a_runs_saved_config_yaml_resolves_to_the_same_config(method: str, tiny_args, tmp_path) -> None:
    cfg = load_config(tiny_args(method, tmp_path, "optim.lr=0.7", "data.mix.alpha=0.5"))
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_yaml(cfg))          # what the loop writes into the run folder
    assert load_config([f"config={saved}"]) == cfg


@pytest.mark.parametrize("world", [1, 2])
def test_a_per_gpu_batch_and_epochs_resolve_again_for_the_same_world(world: int, tmp_path) -> None:
    cfg = load_config(["method=relicv2", "data=imagenet", f"data.root={tmp_path}"], world_size=world)
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_yaml(cfg))
    assert load_config([f"config={saved}"], world_size=world) == cfg


def test_a_config_file_picks_the_presets_and_key_value_words_override_it(tiny_args, tmp_path) -> None:
    """The file's method and dataset pick the presets for the keys it does not set; its keys win over
    the presets, and `key=value` (and method=) words win over the file."""
    words = [w for w in tiny_args("byol", tmp_path) if not w.startswith(("method=", "data=", "data.root="))]
    root = next(w for w in tiny_args("byol", tmp_path) if w.startswith("data.root=")).split("=", 1)[1]
    file = tmp_path / "mine.yaml"
    file.write_text(yaml.safe_dump({"method": "simclr", "data": {"name": "synthetic", "root": root},
                                    "optim": {"lr": 0.05}, "objective": {"tau": 0.3}}))
    cfg = load_config([f"config={file}", *words])
    preset = load_config(["method=simclr", *words, f"data.root={root}"])
    assert cfg.method == "simclr" and cfg.optim.lr == 0.05 and cfg.objective.tau == 0.3
    assert cfg.views == preset.views and cfg.data.mix == preset.data.mix      # from the presets the file picks
    again = load_config([f"config={file}", *words, "optim.lr=0.2", "method=mocov3"])
    assert again.method == "mocov3" and again.optim.lr == 0.2 and again.objective.tau == 0.3
    with pytest.raises(ConfigError, match="method byol has no objective keys.*remove the objective section"):
        load_config([f"config={file}", *words, "method=byol"])


def test_a_bad_config_file_is_one_line_naming_the_file_and_the_fix_and_nothing_is_written(tiny_args, capsys,
                                                                                          tmp_path) -> None:
    out = tmp_path / "runs"
    words = tiny_args("simclr", out)
    saved = yaml.safe_load(dump_yaml(load_config(words)))

    def file(name: str, tree) -> str:
        path = tmp_path / name
        path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree))
        return f"config={path}"

    typo = {**saved, "optim": {**saved["optim"], "lrr": 0.1}}
    fails_in_one_line(capsys, [*words, file("typo.yaml", typo)], "typo.yaml", "unknown config key 'optim.lrr'",
                      "did you mean optim.lr", "change it in the file")
    fails_in_one_line(capsys, [*words, file("section.yaml", {**saved, "trainer": {"x": 1}})],
                      "section.yaml", "unknown config key 'trainer'")
    fails_in_one_line(capsys, [*words, file("objective.yaml", {**saved, "objective": {"taux": 0.1}})],
                      "objective.yaml", "'objective.taux'", "did you mean objective.tau", "method simclr")
    fails_in_one_line(capsys, [*words, file("type.yaml", {**saved, "optim": {"steps": "many"}})],
                      "type.yaml", "'optim.steps'", "int")
    fails_in_one_line(capsys, [*words, file("list.yaml", [1, 2])], "list.yaml", "not sections of keys")
    fails_in_one_line(capsys, [*words, file("broken.yaml", "optim: {lr: [\n")], "broken.yaml",
                      "does not read as YAML")
    fails_in_one_line(capsys, [*words, f"config={tmp_path / 'gone.yaml'}"], "gone.yaml", "no such file")
    assert not out.exists()


def test_there_is_no_config_key_named_config() -> None:
    """`config` chooses a layer; it is never stored as a key of the resolved config."""
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["config="])


@pytest.mark.slow
def test_re_running_a_runs_config_yaml_repeats_its_losses(tiny_args, tmp_path) -> None:
    from train.launch import train

    first = train(load_config(tiny_args("simclr", tmp_path)))
    again = train(load_config([f"config={first / 'config.yaml'}", "run.name=again"]))
    saved, resaved = (yaml.safe_load((d / "config.yaml").read_text()) for d in (first, again))
    assert resaved.pop("layers") == ["base", "dataset synthetic", "preset synthetic", "method simclr",
                                     f"file {first / 'config.yaml'}", "picks", "words", "world 1"]
    saved.pop("layers")
    assert again != first and resaved == saved | {"run": saved["run"] | {"name": "again"}}

    def losses(run_dir) -> list[float]:
        return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "train"]

    assert len(losses(first)) == 3 and losses(again) == pytest.approx(losses(first), rel=1e-5)
