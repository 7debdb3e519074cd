"""A run's config from its words: named layers merged in order by one loop (`load_config`).

The layers (`config_layers`), as a run's config.yaml records them under `layers`: `base`
(configs/base.yaml) → `dataset NAME` (the values derived from the dataset's `manifest.json`,
`derived_from_manifest`: classes, view sizes, batch and schedule; any dataset `make preprocess` wrote
trains without a YAML) → `preset P` (configs/data/P.yaml, the dataset's name or `preset=`) → `method M`
(configs/method/M.yaml) → `method M on P` (the preset's `per_method` section: a paper's setting for
one method on that data, e.g. RSA's beta_base 0.3 on CIFAR) → `file F` for each `config=F`
(`read_config_file`; a run's saved `config.yaml` holds every key, so it re-runs that run) → `picks`
(method, dataset name and class count) → `words` (dotted `key=value` CLI overrides) → `world N`
(`train.config.for_world`). Every layer is checked against the schema of `train.config` as it is
merged; the `objective:` section by the chosen objective's own `Config` dataclass, then resolved
against the run (`Objective.resolve`). A saved config (a checkpoint's, a config.yaml) is rebuilt and
checked again by `config_from_dict`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from pipelines.schema import DatasetError, Manifest, read_manifest
from pipelines.views import dataset_sizes
from train.config import (Config, ConfigError, DataConfig, build, field_types, for_world, global_batch, merge,
                          nested, parse_value, unknown_key)
from train.objectives import OBJECTIVES


CONFIG_DIR = Path(__file__).parent / "configs"


def _load_yaml(path: Path) -> dict:
    if not path.is_file():
        options = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no config file {path.name} in {path.parent.name}/; choose one of {', '.join(options)}")
    return yaml.safe_load(path.read_text()) or {}


def build_objective_config(method: str, section: dict) -> Any:
    """Validate the `objective:` section with the objective's own Config dataclass."""
    if method not in OBJECTIVES:
        raise _unknown_method(method, sorted(OBJECTIVES))
    cls = OBJECTIVES[method].Config
    hints = field_types(cls)
    kwargs = {}
    for key, value in section.items():
        if key not in hints:
            raise unknown_key(f"objective.{key}", [f"objective.{k}" for k in hints])
        kwargs[key] = parse_value(f"objective.{key}", value, hints[key])
    try:
        return cls(**kwargs)
    except ValueError as e:                 # the Config's own checks (`__post_init__`), one line each
        raise ConfigError(str(e)) from None


def _unknown_method(method: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(method, valid, n=3, cutoff=0.4)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ConfigError(f"unknown method {method!r}{hint}; choose one of {', '.join(valid)}")


# What a dataset's manifest decides when no data preset does (`derived_from_manifest`).
DERIVED_EPOCHS = 100            # training length: short for SSL, long enough to learn on a small folder
DERIVED_WARMUP_EPOCHS = 10      # linear warmup (BYOL, RELICv2: 10 epochs)
DERIVED_MAX_BATCH = 256         # the batch every lr in the presets is quoted at
DERIVED_MIN_STEPS_PER_EPOCH = 8  # a small folder still gets several steps (BatchNorm batches) per epoch


def derived_from_manifest(manifest: Manifest) -> dict:
    """The data-preset values a dataset's manifest decides, as a config tree.

    Classes from `class_names`; view sizes from the stored image side (`dataset_sizes`: 224/96 for
    ImageNet-size images, the image side and half of it below; global views of 64 px and less get the
    small-image stem); the batch is the largest power of two up to 256 that still gives 8 steps per
    epoch; `DERIVED_EPOCHS` epochs with a 10-epoch warmup; a checkpoint every 5 % of the run.

    Raises:
        ConfigError: a manifest without train images or without classes (name the fix).
    """
    n_train = int(manifest.counts.get("train", 0))
    if n_train < 2:
        raise ConfigError(f"dataset {manifest.dataset!r} has {n_train} train images in its manifest; the trainer "
                          "needs a train split of 2 or more images: re-run make preprocess on a folder with more")
    batch = 2
    while batch * 2 <= min(DERIVED_MAX_BATCH, n_train // DERIVED_MIN_STEPS_PER_EPOCH):
        batch *= 2
    steps_per_epoch = n_train // batch
    steps = DERIVED_EPOCHS * steps_per_epoch
    global_px, local_px = dataset_sizes(manifest.image_px)
    return {"data": {"num_classes": manifest.num_classes, "batch_size": batch},
            "views": {"global_px": global_px, "local_px": local_px},
            "optim": {"steps": steps, "warmup_steps": DERIVED_WARMUP_EPOCHS * steps_per_epoch},
            "run": {"ckpt_every": max(1, steps // 20), "eval_every_epochs": 0}}


DERIVED_KEYS = ("data.num_classes", "data.batch_size", "views.global_px", "views.local_px",
                "optim.steps", "optim.warmup_steps", "run.ckpt_every", "run.eval_every_epochs")


def dataset_manifest(root: str | Path, name: str) -> Manifest | None:
    """The manifest of `<root>/<name>` (sizes checked, no hashing), None when the folder does not exist.

    Raises:
        ConfigError: the folder exists but its manifest is missing, damaged or incomplete.
    """
    folder = Path(root) / name
    if not folder.is_dir():
        return None
    try:
        return read_manifest(folder, verify="size")
    except DatasetError as e:
        raise ConfigError(str(e)) from None


PICKS = ("method", "data", "preset", "config")    # CLI words that choose layers rather than set a key


def read_config_file(path: str) -> dict:
    """The tree of a `config=<file.yaml>` layer (or `config=<name>`, a setup of `configs/setups/`: a
    paper's setting of a method that its words alone would spell out, e.g. `uota-mocov2star`), its keys
    and values checked against the schema (the `objective:` section's keys once the method is known,
    `check_objective_keys`).

    Raises:
        ConfigError: a missing or unreadable file, a file that is not a mapping, an unknown key or a bad
            value; one line naming the file and what to change in it.
    """
    file = Path(path)
    if not file.is_file() and (CONFIG_DIR / "setups" / f"{path}.yaml").is_file():     # a setup by its name
        file = CONFIG_DIR / "setups" / f"{path}.yaml"
    if not file.is_file():
        setups = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "setups").glob("*.yaml")))
        raise ConfigError(f"config={path}: no such file or setup; give a YAML config file (e.g. a run's <run "
                          f"folder>/config.yaml) or a setup of train/configs/setups: {setups}")
    try:
        tree = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config file {path} does not read as YAML ({first}); fix the file") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} holds a {type(tree).__name__}, not sections of keys (data:, optim:, "
                          "...); write it as the config.yaml of a run is written")
    tree.pop("layers", None)                # a run's config.yaml: where its values came from, not a setting
    try:
        merge({}, tree, Config)
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}; change it in the file (nothing was written)") from None
    return tree


def check_objective_keys(path: str, method: str, section: Any) -> None:
    """The `objective:` keys of config file `path` exist for `method`.

    Raises:
        ConfigError: naming the file, the key and the keys `method` has.
    """
    if method not in OBJECTIVES or not section:
        return
    hints = field_types(OBJECTIVES[method].Config)
    for key in section:
        if not hints:
            raise ConfigError(f"config file {path}: method {method} has no objective keys, so 'objective.{key}' is "
                              "unknown; remove the objective section from the file (nothing was written)")
        if key not in hints:
            raise ConfigError(f"config file {path}: {unknown_key(f'objective.{key}', [f'objective.{k}' for k in hints])} "
                              f"(method {method}); change it in the file (nothing was written)")


def _presets(config_dir: Path) -> list[str]:
    return sorted(p.stem for p in (config_dir / "data").glob("*.yaml"))


@dataclass(frozen=True)
class Layer:
    """One source of config values: its name, as config.yaml's `layers` records it, and the nested keys it
    sets. `load_config` merges the layers of `config_layers` in order; a later layer's value wins."""
    name: str
    tree: dict


def config_layers(args: Sequence[str], config_dir: Path = CONFIG_DIR) -> tuple[list[Layer], Manifest | None]:
    """The layers that CLI words `method=... data=... [preset=...] [config=FILE] key=value ...` stack, in
    merge order, and the dataset's manifest (None without a dataset folder).

    The layers: `base` (configs/base.yaml); `dataset NAME` (`derived_from_manifest`, when the folder
    `<data.root>/NAME` exists); `preset P` (configs/data/P.yaml: the `preset=` word, by default the
    dataset's name when such a file exists); `method M` (configs/method/M.yaml); `method M on P` (the
    preset's `per_method: {M: ...}`: a paper's setting for one method on that data); `file F` for each
    `config=F` (in the order given; a file's `method` and `data.name` pick the presets when no word
    does); `picks` (the method, the dataset folder's name and, from its manifest, its class count: facts
    of the run whichever preset or file trains on it); `words` (the `key=value` words; a word
    `optim.steps` (`optim.warmup_steps`) also sets a preset's `optim.epochs` (`optim.warmup_epochs`) to 0,
    the user's own number over the preset's rule). Layers that set nothing are left out.

    Raises:
        ConfigError: a malformed word, an unknown dataset, preset or method, a bad config file
            (`read_config_file`, `check_objective_keys`), or a dataset folder with a missing or damaged
            manifest.
    """
    pairs = _pairs(args)
    picks = dict(p for p in pairs if p[0] in PICKS)
    words = [(k, v) for k, v in pairs if k not in PICKS]
    files = [(value, read_config_file(value)) for key, value in pairs if key == "config"]
    from_files: dict = {}                   # what the files set, merged: the presets they pick
    for _, tree in files:
        merge(from_files, tree, Config)
    base, said = _load_yaml(config_dir / "base.yaml"), dict(words)

    def chosen(key: str, default: Any) -> Any:      # data.<key> from the files, else base.yaml, else the default
        return from_files.get("data", {}).get(key, base.get("data", {}).get(key, default))

    data_name = picks.get("data", chosen("name", DataConfig.name))
    preset_name = picks.get("preset", data_name)
    preset_file = config_dir / "data" / f"{preset_name}.yaml"
    if "preset" in picks and not preset_file.is_file():
        raise ConfigError(f"no data preset {preset_name!r}; choose one of {', '.join(_presets(config_dir))}")
    root, folder = said.get("data.root", chosen("root", DataConfig.root)), said.get("data.name", data_name)
    manifest = dataset_manifest(root, folder)
    if manifest is None and not preset_file.is_file():
        raise ConfigError(f"no dataset {folder!r}: {Path(root) / folder} does not exist and there is no data preset "
                          f"of that name; write it with make preprocess DATASET=imagefolder SRC=<image folder> ARGS=\"--name {folder}\" (or point "
                          f"data.root at its parent), or choose a preset: {', '.join(_presets(config_dir))}")
    method = picks.get("method", from_files.get("method", base.get("method", Config.method)))
    method_file = config_dir / "method" / f"{method}.yaml"
    if not method_file.is_file():
        raise _unknown_method(method, sorted(p.stem for p in (config_dir / "method").glob("*.yaml")))
    data_preset = _load_yaml(preset_file) if preset_file.is_file() else {}
    per_method = (data_preset.pop("per_method", None) or {}).get(method) or {}
    for path, tree in files:
        check_objective_keys(path, method, tree.get("objective"))
    facts: dict = {"method": method, "data": {"name": folder}}
    if manifest is not None:
        facts["data"]["num_classes"] = manifest.num_classes
    cli: dict = {}
    for key, value in words:
        merge(cli, nested(key, value), Config)
    for explicit, preset in (("optim.steps", "optim.epochs"), ("optim.warmup_steps", "optim.warmup_epochs")):
        if explicit in said and preset not in said:
            merge(cli, nested(preset, "0"), Config)
    layers = [Layer("base", base),
              Layer(f"dataset {folder}", derived_from_manifest(manifest) if manifest is not None else {}),
              Layer(f"preset {preset_name}", data_preset),
              Layer(f"method {method}", _load_yaml(method_file)),
              Layer(f"method {method} on {preset_name}", per_method),
              *(Layer(f"file {path}", tree) for path, tree in files),
              Layer("picks", facts),
              Layer("words", cli)]
    return [layer for layer in layers if layer.tree], manifest


def load_config(args: list[str], config_dir: Path = CONFIG_DIR, world_size: int = 1) -> Config:
    """Resolve the config from CLI words `method=... data=... [preset=...] [config=FILE] key=value ...`
    for a run of `world_size` processes: the layers of `config_layers` merged in order by one loop over
    the dataclass defaults, then `for_world` (the layer `world N`): a per-GPU batch and a length in
    epochs become the global batch and the steps of this run. `Config.layers` names them all.

    `data=NAME` names the dataset folder `<data.root>/NAME`; a name with neither a dataset folder nor a
    data preset is an error. `data.batch_size` is one key, whichever form sets it last wins.

    Args:
        args: `key=value` strings; `method`, `data` and `preset` pick the presets, `config` names a
            config file, the rest are dotted overrides.
        config_dir: folder with base.yaml, data/ and method/.
        world_size: processes of the run (GPUs, or CPU processes under gloo).

    Returns:
        The frozen, validated Config.

    Raises:
        ConfigError: a malformed word, an unknown key (with the closest valid keys), a bad value, an
            unknown dataset or preset, a config file that is missing, unreadable or holds an unknown key or bad
            value (`read_config_file`), a dataset folder with a missing or damaged manifest, or a
            per-GPU batch larger than the preset says fits (`for_world`).
    """
    layers, manifest = config_layers(args, config_dir)
    tree: dict = {}
    for layer in layers:
        merge(tree, layer.tree, Config)
    method = tree.pop("method")
    objective = build_objective_config(method, tree.pop("objective", {}))
    names = (*(layer.name for layer in layers), f"world {world_size}")
    cfg = dataclasses.replace(build(Config, tree), method=method, objective=objective, layers=names)
    return resolve_objective(for_world(cfg, world_size, int(manifest.counts.get("train", 0)) if manifest is not None else 0))


def resolve_objective(cfg: Config) -> Config:
    """`cfg` with the objective's config resolved against the run (`Objective.resolve`).

    Raises:
        ConfigError: a setup the objective refuses.
    """
    try:
        return dataclasses.replace(cfg, objective=OBJECTIVES[cfg.method].resolve(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _pairs(words: Sequence[str]) -> list[tuple[str, str]]:
    """CLI words `key=value` as (key, value) pairs, or a ConfigError naming the malformed word."""
    pairs = []
    for word in words:
        if "=" not in word:
            raise ConfigError(f"argument {word!r} is not key=value; write e.g. optim.lr=0.5")
        key, value = word.split("=", 1)
        pairs.append((key.strip(), value))
    return pairs


def config_from_dict(tree: dict, overrides: Sequence[str] = ()) -> Config:
    """Rebuild a Config from `to_dict` output (a checkpoint's or config.yaml's), checking it again.

    Args:
        tree: nested dicts as `to_dict` writes them.
        overrides: dotted `key=value` words applied on top (e.g. `data.root=...`); not `method`.

    Returns:
        The frozen, validated Config.

    Raises:
        ConfigError: an unknown key, a bad value, or an override of `method`.
    """
    tree = dict(tree)
    method = tree.pop("method", Config.method)
    layers = tuple(tree.pop("layers", None) or ())
    objective = dict(tree.pop("objective", None) or {})
    checked: dict = {}
    merge(checked, tree, Config)
    for key, value in _pairs(overrides):
        if key == "method":
            raise ConfigError(f"method={value} cannot override the saved method {method}; start a new run instead")
        merge(checked, nested(key, value), Config)
    objective.update(checked.pop("objective", {}))
    cfg = build(Config, checked)
    data = dataclasses.replace(cfg.data, batch_size=global_batch(cfg.data.batch_size, 1))   # a saved one is global
    return resolve_objective(dataclasses.replace(cfg, method=method, data=data, layers=layers,
                                                 objective=build_objective_config(method, objective)))
