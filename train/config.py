"""The trainer's configuration: one tree of frozen dataclasses, the only place defaults live.

Merge order (STYLE §4), as a list of named layers (`config_layers`) merged by one loop (`load_config`)
over the dataclass defaults: `base` (configs/base.yaml) → `dataset NAME` (the values derived from the
dataset's `manifest.json`, `derived_from_manifest`: classes, view sizes, batch and schedule; any dataset
`make preprocess` wrote trains without a YAML) → `preset P` (configs/data/P.yaml, the dataset's name
or `preset=`) → `method M` (configs/method/M.yaml) → `method M on P` (the preset's `per_method` section:
a paper's setting for one method on that data, e.g. RSA's beta_base 0.3 on CIFAR) → `file F` for each
`config=F` (`read_config_file`; a run's saved `config.yaml` holds every key, so it re-runs that run) →
`picks` (method, dataset name and class count) → `words` (dotted `key=value` CLI overrides) → `world N`
(`for_world`). A run's config.yaml records the names under `layers`. Unknown keys and values that do
not parse to the field's type are `ConfigError`s with a one-line message; so is a value outside the
choices of an enumerated (`typing.Literal`) field, whichever source it comes from (a preset, a CLI
override, a checkpoint's config), so that a typo stops the run before anything is written. The
`objective:` section is validated by the chosen objective's own `Config` dataclass.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence

import yaml

from pipelines.loader import Backend
from pipelines.mixing import MixSpec
from pipelines.schema import DatasetError, Manifest, read_manifest
from pipelines.spec import DecoderHints
from pipelines.views import Recipe, dataset_sizes

if TYPE_CHECKING:
    from train.objectives.base import ViewNeeds

CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A bad key or value in a config file or a CLI override."""


BackendChoice = Literal["auto", Backend]        # "auto": dali on CUDA, the fastest on CPU (train.setup)
OptimName = Literal["lars", "sgd", "momentum", "adamw"]   # timm's: sgd is Nesterov, momentum is plain
DeviceName = Literal["auto", "cpu", "cuda"]     # no "cuda:N": torchrun's LOCAL_RANK picks the GPU
EvalName = Literal["auto", "knn", "probe", "linear", "none"]   # auto: kNN and probe when the data has labels; linear: and
                                                    # the papers' linear evaluation after the last step (train.protocol)


@dataclass(frozen=True)
class DataConfig:
    name: str = "synthetic"         # dataset folder under `root` (written by `python -m preprocess`)
    root: str = "data"              # data root folder
    backend: BackendChoice = "auto"  # "torch" | "torchvision" | "ffcv" | "dali"; "auto": ffcv on CPU, dali on GPU
    batch_size: int | str = 256     # the global batch (all processes), or "<n>/gpu": n per process (`global_batch`)
    max_batch_per_gpu: int = 0      # the largest per-process batch the preset says fits one GPU; 0: no limit
    hw_decoder_load: float = DecoderHints.hw_load   # DALI on a GPU: share of the JPEGs for the hardware decoder
    decode_size_hint_px: int = 0    # DALI on a GPU: image side the decoder preallocates for; 0: none
    num_workers: int | str = "auto"  # reader workers per process; "auto": its share of the cores, capped where measured (`train.setup.loader_workers`)
    num_classes: int = 10           # classes, for kNN / linear-probe evaluation; 0: an unlabelled dataset
    mix: MixSpec = field(default_factory=MixSpec)   # intra-batch mixes: pipelines.mixing.MixSpec's fields

    def __post_init__(self) -> None:
        global_batch(self.batch_size, 1)            # a batch that reads as neither form: stop now
        n = self.num_workers
        if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ConfigError(f"data.num_workers={n!r}: give a number of workers (0: read in the training process) "
                              "or auto (this process's share of the cores)")


@dataclass(frozen=True)
class ViewsConfig:
    recipe: str = "byol"            # preset name in pipelines/recipes/ or a YAML path
    global_px: int = 64             # side of global (large) views, px
    local_px: int = 32              # side of local (small) views, px


@dataclass(frozen=True)
class ModelConfig:
    backbone: str = "resnet18"      # timm model name (small-image stem when global_px <= 64)
    proj_hidden: int = 2048         # projector hidden width
    proj_out: int = 256             # projector output dim D
    proj_layers: int = 2            # projector Linear layers
    proj_last_bn: bool = False      # BatchNorm (no affine) on the projector's output (MoCo v3)
    pred_hidden: int = 2048         # predictor hidden width; 0: no predictor
    pred_last_bn: bool = False      # BatchNorm (no affine) on the predictor's output (MoCo v3's ResNet head)
    channels_last: bool = True      # channels-last memory format of the network (GPU and CPU)
    bn_per_view: bool = False       # one backbone call (BatchNorm batch) per view, not per resolution
    init: str = ""                  # a fresh run's backbone weights: a backbone.safetensors or a timm checkpoint; "": random


@dataclass(frozen=True)
class OptimConfig:
    name: OptimName = "lars"        # "lars" | "sgd" (Nesterov) | "momentum" (plain SGD) | "adamw"
    decay_all: bool = False         # weight decay on biases and norms too (default: on weights only)
    lr: float = 0.3                 # at global batch 256; scaled linearly with the batch
    weight_decay: float = 1e-6      # at step 0; cosine to `final_weight_decay`
    final_weight_decay: float = 1e-6  # weight decay at the last step
    momentum: float = 0.9           # SGD/LARS momentum (AdamW: beta1)
    warmup_steps: int = 100         # linear LR warmup from 0, optimiser steps
    min_lr_ratio: float = 0.0       # final LR as a fraction of the peak LR
    steps: int = 1000               # optimiser steps of the whole run
    epochs: float = 0.0             # > 0: the run's length in passes over the train split (sets `steps`)
    warmup_epochs: float = 0.0      # > 0: the warmup in passes over the train split (sets `warmup_steps`)
    clip: float = 0.0               # max global grad norm; 0 disables clipping
    ema_start: float = 0.99         # EMA momentum of the target at step 0 (BYOL: cosine to 1)
    ema_end: float = 1.0            # EMA momentum at the last step


@dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs"           # parent folder of run folders
    name: str = ""                  # run folder name; "": <method>-<data>-<time>
    seed: int = 0                   # global seed (each rank adds its rank)
    log_every: int = 10             # steps between log lines (the only host syncs)
    ckpt_every: int = 500           # steps between checkpoints (and one at the end)
    eval_every_epochs: int = 0      # kNN + linear probe every K epochs; 0: only at start and end
    resume: str = ""                # checkpoint file to resume from; "auto": the run folder's newest readable one, if any; "": fresh run
    keep_last: int = 1              # checkpoints kept in the run folder: checkpoint.pt and the N-1 before it
    amp: bool = True                # bf16 autocast (GPU only)
    dist_timeout_min: float = 30.0  # longest wait of one rank for the others in a collective, minutes
    device: DeviceName = "auto"     # "auto": torchrun's device; "cuda": cuda:<LOCAL_RANK>; "cpu"
    eval: EvalName = "auto"          # labelled evaluations besides the label-free health metrics
    max_eval_samples: int = 0       # records per split for evaluation (evenly spread); 0: all up to a cap
    stop_after_steps: int = 0       # stop with a checkpoint after this step (resumable); 0: run to optim.steps
    wandb: bool = False             # the TensorBoard scalars to Weights & Biases too (rank 0; WANDB_MODE=offline works)
    wandb_project: str = "viewmill"  # the W&B project; the W&B run is named after the run folder

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"run.keep_last={self.keep_last} keeps no checkpoint; use run.keep_last=1 (the newest "
                              "alone) or more")
        if self.resume == "auto" and not self.name:
            raise ConfigError("run.resume=auto needs a run folder that the next start finds again; set run.name=<name> "
                              "(the same on every restart)")


@dataclass(frozen=True)
class Config:
    method: str = "rsa"             # key of train.objectives.OBJECTIVES
    # Where the values came from: the names of the layers `load_config` merged, in order (config.yaml
    # records them); not a setting, and not part of a config's equality.
    layers: tuple[str, ...] = field(default=(), compare=False)
    data: DataConfig = field(default_factory=DataConfig)
    views: ViewsConfig = field(default_factory=ViewsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    objective: Any = None           # the objective's own frozen Config (validated by its class)


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        t = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(t):
            keys += _valid_keys(t, f"{prefix}{f.name}.")
        elif f.name not in ("objective", "layers"):
            keys.append(f"{prefix}{f.name}")
    return keys


def _unknown(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def parse_value(key: str, value: Any, t: Any) -> Any:
    """Convert `value` (from YAML or a CLI string) to type `t`, or raise ConfigError."""
    if typing.get_origin(t) is Literal:
        choices = typing.get_args(t)
        if value not in choices:            # compared as written: YAML would read `no`/`on` as bools
            raise ConfigError(f"config key {key!r}: {value!r} is not a valid choice; "
                              f"choose one of {', '.join(map(str, choices))}")
        return value
    try:
        if isinstance(value, str) and t is not str:
            value = yaml.safe_load(value)
        origin = typing.get_origin(t)
        if origin is tuple:
            return tuple(parse_value(key, v, typing.get_args(t)[0]) for v in value)
        if t is bool:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if t is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError
            return value
        if t is float:
            if isinstance(value, str):      # YAML 1.1 reads `1e-4` (no dot) as a string
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError
            return float(value)
        if t is str:
            return str(value)
    except (TypeError, ValueError, yaml.YAMLError):
        pass
    else:
        if origin in (types.UnionType, typing.Union):
            return value
    name = getattr(t, "__name__", str(t))
    raise ConfigError(f"config key {key!r}: cannot read {value!r} as {name}; give a value of type {name}")


# Keys that were removed: {key: (the value it always had by default, why it went)}. A run's saved
# config.yaml or checkpoint that holds one at that value still loads (the key is dropped); a config
# that sets it otherwise is refused with the reason.
RETIRED = {
    "data.parallel_gpu_ops": (False, "DALI's concurrent GPU operators were not faster on a GPU "
                                     "(docs/benchmarks.md, 27 Nov 2026)"),
    "data.sequence_views": (False, "stacking same-size views in the DALI GPU graph was not faster on a GPU "
                                   "(docs/benchmarks.md, 27 Nov 2026)"),
}


def _merge(tree: dict, update: dict, cls: type, prefix: str = "") -> None:
    """Merge the nested dict `update` into `tree` (in place), checking keys and types against `cls`."""
    hints = _field_types(cls)
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if dotted in RETIRED:
            default, why = RETIRED[dotted]
            if parse_value(dotted, value, type(default)) == default:
                continue
            raise ConfigError(f"config key {dotted!r} was removed ({why}); remove it")
        if key == "layers" and not prefix:
            raise ConfigError("'layers' is where a config's values came from (config.yaml records it), not a "
                              "setting; remove it")
        if key == "objective" and not prefix:
            if not isinstance(value, dict):
                raise ConfigError(f"config key 'objective' must be a mapping, got {value!r}")
            tree.setdefault("objective", {}).update(value)
            continue
        if key not in hints:
            raise _unknown(dotted, _valid_keys(Config))
        t = hints[key]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted!r} is a section; set its fields, e.g. {dotted}.<key>=...")
            _merge(tree.setdefault(key, {}), value, t, f"{dotted}.")
        else:
            tree[key] = parse_value(dotted, value, t)


def _dotted_to_nested(key: str, value: Any) -> dict:
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


def _build(cls: type, tree: dict) -> Any:
    hints = _field_types(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in tree and dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], tree[f.name])
        elif f.name in tree:
            kwargs[f.name] = tree[f.name]
    return cls(**kwargs)


def _load_yaml(path: Path) -> dict:
    if not path.is_file():
        options = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no config file {path.name} in {path.parent.name}/; choose one of {', '.join(options)}")
    return yaml.safe_load(path.read_text()) or {}


def build_objective_config(method: str, section: dict) -> Any:
    """Validate the `objective:` section with the objective's own Config dataclass."""
    from train.objectives import OBJECTIVES

    if method not in OBJECTIVES:
        raise _unknown_method(method, sorted(OBJECTIVES))
    cls = OBJECTIVES[method].Config
    hints = _field_types(cls)
    kwargs = {}
    for key, value in section.items():
        if key not in hints:
            raise _unknown(f"objective.{key}", [f"objective.{k}" for k in hints])
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
PER_GPU = "/gpu"                # `data.batch_size=256/gpu`: 256 per process
BATCH_RULE = ("data.batch_size=B is the global batch (all processes together); B/gpu is B per process, the "
              "global batch B x processes; the lr scales with the global batch, and each process's batch is even")


def global_batch(batch_size: int | str, world_size: int) -> int:
    """The global batch that `data.batch_size` gives `world_size` processes (`BATCH_RULE`): an int is the
    global batch itself, `"<n>/gpu"` is n per process, n x `world_size` in all.

    Raises:
        ConfigError: a value of neither form, or an odd per-process n.
    """
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
        return batch_size
    per_gpu = batch_size.removesuffix(PER_GPU) if isinstance(batch_size, str) else ""
    if isinstance(batch_size, str) and batch_size.endswith(PER_GPU) and per_gpu.isdigit() and int(per_gpu) > 0:
        if int(per_gpu) % 2:
            raise ConfigError(f"data.batch_size={batch_size}: the batch of each process must be even (the mixes and "
                              f"paired views need pairs); use data.batch_size={int(per_gpu) + 1}{PER_GPU}")
        return int(per_gpu) * world_size
    raise ConfigError(f"data.batch_size={batch_size!r}: give the global batch (e.g. data.batch_size=512) or the "
                      f"batch of each process (e.g. data.batch_size=256{PER_GPU})")


def per_process_batch(batch_size: int, processes: int, key: str = "data.batch_size") -> int:
    """Each process's share of the global batch `batch_size` (`BATCH_RULE`): the same on every process
    and even (the mixes and paired views need pairs).

    Raises:
        ConfigError: a global batch that does not split so, naming the multiple to use (`key` names the
            setting: `batch_size` for the evaluation protocols).
    """
    if batch_size % (2 * processes):
        raise ConfigError(f"{key}={batch_size} must split into even per-process batches over {processes} "
                          f"process(es); use a multiple of {2 * processes}")
    return batch_size // processes


DERIVED_MAX_BATCH = 256         # the batch every lr in the presets is quoted at
DERIVED_MIN_STEPS_PER_EPOCH = 8  # a small folder still gets several steps (BatchNorm batches) per epoch


def eval_kinds(cfg: Config) -> tuple[str, ...]:
    """The labelled evaluations `run.eval` asks for: kNN and the probe ("auto" on labelled data, and
    "linear", which adds `train.protocol`'s linear evaluation after the last step), one of them, or none;
    the label-free health metrics run in every case.

    Raises:
        ConfigError: kNN or the probe asked for on a dataset without labels.
    """
    labelled = cfg.data.num_classes > 0
    if cfg.run.eval in ("knn", "probe", "linear") and not labelled:
        raise ConfigError(f"run.eval={cfg.run.eval} needs labels, and dataset {cfg.data.name!r} has none; use "
                          "run.eval=auto (label-free health metrics) or train on a labelled dataset")
    return {"auto": ("knn", "probe") if labelled else (), "knn": ("knn",), "probe": ("probe",),
            "linear": ("knn", "probe"), "none": ()}[cfg.run.eval]


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
        _merge({}, tree, Config)
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}; change it in the file (nothing was written)") from None
    return tree


def check_objective_keys(path: str, method: str, section: Any) -> None:
    """The `objective:` keys of config file `path` exist for `method`.

    Raises:
        ConfigError: naming the file, the key and the keys `method` has.
    """
    from train.objectives import OBJECTIVES

    if method not in OBJECTIVES or not section:
        return
    hints = _field_types(OBJECTIVES[method].Config)
    for key in section:
        if not hints:
            raise ConfigError(f"config file {path}: method {method} has no objective keys, so 'objective.{key}' is "
                              "unknown; remove the objective section from the file (nothing was written)")
        if key not in hints:
            raise ConfigError(f"config file {path}: {_unknown(f'objective.{key}', [f'objective.{k}' for k in hints])} "
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
        _merge(from_files, tree, Config)
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
        _merge(cli, _dotted_to_nested(key, value), Config)
    for explicit, preset in (("optim.steps", "optim.epochs"), ("optim.warmup_steps", "optim.warmup_epochs")):
        if explicit in said and preset not in said:
            _merge(cli, _dotted_to_nested(preset, "0"), Config)
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
        _merge(tree, layer.tree, Config)
    method = tree.pop("method")
    objective = build_objective_config(method, tree.pop("objective", {}))
    names = (*(layer.name for layer in layers), f"world {world_size}")
    cfg = dataclasses.replace(_build(Config, tree), method=method, objective=objective, layers=names)
    eval_kinds(cfg)                                     # a labelled evaluation of unlabelled data: stop now
    return resolve_objective(for_world(cfg, world_size, int(manifest.counts.get("train", 0)) if manifest is not None else 0))


def resolve_objective(cfg: Config) -> Config:
    """`cfg` with the objective's config resolved against the run (`Objective.resolve`).

    Raises:
        ConfigError: a setup the objective refuses.
    """
    from train.objectives import OBJECTIVES

    try:
        return dataclasses.replace(cfg, objective=OBJECTIVES[cfg.method].resolve(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def for_world(cfg: Config, world_size: int, train_size: int) -> Config:
    """`cfg` as `world_size` processes run it: `data.batch_size` becomes the global batch (`global_batch`;
    the learning rate scales with it, `schedules.scaled_lr`); with `optim.epochs` /
    `optim.warmup_epochs` the steps are those passes over `train_size` records at that batch.

    Epochs need the train split's size from the dataset's manifest; without one (`train_size` 0: a
    preset read before its dataset is written, e.g. by `python -m train.memory`) the steps keep their
    values, and training stops at its dataset check anyway.

    Raises:
        ConfigError: a per-process batch above the preset's `data.max_batch_per_gpu`.
    """
    d, o = cfg.data, cfg.optim
    batch = global_batch(d.batch_size, world_size)
    per_process = batch // max(world_size, 1)
    if d.max_batch_per_gpu and per_process > d.max_batch_per_gpu:
        raise ConfigError(f"a batch of {per_process} per GPU is more than the {d.max_batch_per_gpu} that fit one 80 GB "
                          f"GPU with this preset (train/configs/data/{d.name}.yaml); set "
                          f"data.batch_size={d.max_batch_per_gpu}{PER_GPU} or less, with more GPUS for a larger global "
                          "batch")
    steps, warmup = o.steps, o.warmup_steps
    if train_size > 0 and (o.epochs > 0 or o.warmup_epochs > 0):
        steps_per_epoch = max(1, train_size // batch)
        steps = max(1, round(o.epochs * steps_per_epoch)) if o.epochs > 0 else steps
        warmup = round(o.warmup_epochs * steps_per_epoch) if o.warmup_epochs > 0 else warmup
    return dataclasses.replace(cfg, data=dataclasses.replace(d, batch_size=batch),
                               optim=dataclasses.replace(o, steps=steps, warmup_steps=warmup))


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
    _merge(checked, tree, Config)
    for key, value in _pairs(overrides):
        if key == "method":
            raise ConfigError(f"method={value} cannot override the saved method {method}; start a new run instead")
        _merge(checked, _dotted_to_nested(key, value), Config)
    objective.update(checked.pop("objective", {}))
    cfg = _build(Config, checked)
    data = dataclasses.replace(cfg.data, batch_size=global_batch(cfg.data.batch_size, 1))   # a saved one is global
    return resolve_objective(dataclasses.replace(cfg, method=method, data=data, layers=layers,
                                                 objective=build_objective_config(method, objective)))


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts/lists (for YAML, JSON and checkpoints)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def check_needs(method: str, needs: ViewNeeds, recipe: Recipe, mix_kind: str) -> None:
    """Fail at start-up, in one line, when the views of the data config cannot feed the objective.

    Counts the views of each `Batch` field from the roles the recipe resolved (`Recipe.fields`).

    Args:
        method: objective name (for the message).
        needs: the objective instance's `ViewNeeds`.
        recipe: the resolved `pipelines.views.Recipe`.
        mix_kind: `data.mix.kind`.

    Raises:
        ConfigError: naming the missing views and the setting that provides them.
    """
    views = {name: sum(g.count for g in groups) for name, groups in recipe.fields.items()}
    n_global, n_local, weak = views["global_views"], views["local_views"], views["weak_views"]
    problems = []
    if n_global < needs.global_views:
        problems.append(f"{needs.global_views} global views (recipe has {n_global})")
    if n_local < needs.local:
        problems.append(f"{needs.local} local views (recipe has {n_local})")
    if needs.weak and not weak:
        problems.append("staged weak views (recipe has none)")
    if needs.mix != "none" and mix_kind != needs.mix:
        problems.append(f"data.mix.kind={needs.mix} (config has {mix_kind})")
    if problems:
        raise ConfigError(f"method {method} needs {', '.join(problems)} but views.recipe={recipe.name} "
                          f"gives fewer; use configs/method/{method}.yaml's recipe or fix views.recipe / data.mix.kind")
