"""The trainer's configuration: one tree of frozen dataclasses, the only place defaults live, and the
rules every value obeys wherever it comes from (a preset, a config file, a CLI word, a checkpoint's
saved config).

- Keys and types (`merge`, `parse_value`): an unknown key, a value that does not parse to its field's
  type, or a value outside the choices of an enumerated (`typing.Literal`) field is a `ConfigError`
  with a one-line message, so that a typo stops a run before anything is written. Retired keys
  (`RETIRED`) load at their old default and are refused otherwise.
- The batch rule (`BATCH_RULE`): `data.batch_size` is the global batch or `<n>/gpu` (`global_batch`),
  each process's share is the same and even (`per_process_batch`), and a length in epochs becomes
  steps at that batch (`for_world`).

How a run's config is resolved from its words (presets, the dataset's manifest, config files,
overrides) is `train.resolve`'s; the `objective:` section is validated there by the objective's own
`Config`. This module is the lowest floor of train/: it imports nothing else of train/.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from pipelines.loader import Backend
from pipelines.mixing import MixSpec
from pipelines.spec import DecoderHints, GpuBlur, GpuContrast, GpuTail, GraphDtype


class ConfigError(ValueError):
    """A bad key or value in a config file or a CLI override."""


BackendChoice = Literal["auto", Backend]        # "auto": dali on CUDA, the fastest on CPU (train.setup)
OptimName = Literal["lars", "sgd", "momentum", "adamw"]   # timm's: sgd is Nesterov, momentum is plain
DeviceName = Literal["auto", "cpu", "cuda"]     # no "cuda:N": torchrun's LOCAL_RANK picks the GPU
StreamName = Literal["default", "high"]          # run.train_stream
# run.checkpoint_on_signal ("": none; USR2+TERM: both, as launcher=slurm sets; not USR1, which NCCL may take)
SignalName = Literal["", "USR2", "TERM", "USR2+TERM"]
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
    gpu_blur: GpuBlur = "gaussian"  # DALI on a GPU: "gaussian" (DALI's blur, every sample) | "filter" (one pass of
                                    # per-sample kernels made on the host, 1 x 1 where none was drawn) | "conditional"
                                    # (DALI's blur on the samples that drew it only, as the CPU graph)
    graph_dtype: GraphDtype = "float32"   # DALI: views normalised in the graph, or "uint8" normalised on the device
    gpu_contrast: GpuContrast = "device"  # DALI on a GPU: the contrast offset made on the device (a float pass, an
                                    # add, a cast) | "host": each view's mean copied back, one uint8 colour pass
    graph_batches: int = 1          # DALI: training batches one run of its graph makes (the graph's batch: this x
                                    # the per-process batch; its operators' set-up paid once for them all)
    gpu_tail: GpuTail = "graph"     # DALI on a GPU: the colour tail, blur, solarize and normalisation in the graph
                                    # | "torch": the crops out as uint8, finished by batched torch ops on the device
    num_workers: int | str = "auto"  # reader workers per process; "auto": its share of the cores, capped where measured (`train.setup.loader_workers`)
    num_classes: int = 10           # classes, for kNN / linear-probe evaluation; 0: an unlabelled dataset
    mix: MixSpec = field(default_factory=MixSpec)   # intra-batch mixes: pipelines.mixing.MixSpec's fields

    def __post_init__(self) -> None:
        global_batch(self.batch_size, 1)            # a batch that reads as neither form: stop now
        n = self.num_workers
        if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ConfigError(f"data.num_workers={n!r}: give a number of workers (0: read in the training process) "
                              "or auto (this process's share of the cores)")


def at_least(section: Any, name: str, lows: dict[str, float]) -> None:
    """Refuse a value of `section` (the config section `name`) under its lowest sensible one in `lows`
    (or NaN): a negative length, rate or count, a zero interval.

    Raises:
        ConfigError: naming the key, the value and the range.
    """
    for key, low in lows.items():
        value = getattr(section, key)
        if not value >= low:                # NaN too
            raise ConfigError(f"{name}.{key}={value} is out of range; give a value of at least {low}")


@dataclass(frozen=True)
class ViewsConfig:
    recipe: str = "byol"            # preset name in pipelines/recipes/ or a YAML path
    global_px: int = 64             # side of global (large) views, px
    local_px: int = 32              # side of local (small) views, px

    def __post_init__(self) -> None:
        at_least(self, "views", {"global_px": 1, "local_px": 1})


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

    def __post_init__(self) -> None:
        at_least(self, "optim", {"lr": 0, "weight_decay": 0, "final_weight_decay": 0, "momentum": 0, "warmup_steps": 0,
                                 "min_lr_ratio": 0, "steps": 1, "epochs": 0, "warmup_epochs": 0, "clip": 0,
                                 "ema_start": 0, "ema_end": 0})


@dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs"           # parent folder of run folders
    name: str = ""                  # run folder name; "": <method>-<data>-<time>
    seed: int = 0                   # global seed (each rank adds its rank)
    log_every: int = 10             # steps between log lines (the only host syncs)
    ckpt_every: int = 500           # steps between checkpoints (and one at the end)
    ckpt_every_min: float = 30.0    # a checkpoint at the first log step this many minutes after the last; 0: off
    eval_every_epochs: int = 0      # kNN + linear probe every K epochs; 0: only at start and end
    resume: str = ""                # checkpoint file to resume from; "auto": the run folder's newest readable one, if any; "": fresh run
    keep_last: int = 1              # checkpoints kept in the run folder: checkpoint.pt and the N-1 before it
    amp: bool = True                # bf16 autocast (GPU only)
    dist_timeout_min: float = 30.0  # longest wait of one rank for the others in a collective, minutes
    device: DeviceName = "auto"     # "auto": torchrun's device; "cuda": cuda:<LOCAL_RANK>; "cpu"
    train_stream: StreamName = "high"  # a CUDA stream above the DALI graph's (launch.training_stream), or "default"
    eval: EvalName = "auto"          # labelled evaluations besides the label-free health metrics
    max_eval_samples: int = 0       # records per split for evaluation (evenly spread); 0: all up to a cap
    stop_after_steps: int = 0       # stop with a checkpoint after this step (resumable); 0: run to optim.steps
    checkpoint_on_signal: SignalName = ""  # these signals wait for a checkpoint at the next log step (dist.HeldSignal)
    wandb: bool = False             # the TensorBoard scalars to Weights & Biases too (rank 0; WANDB_MODE=offline works)
    wandb_project: str = "viewmill"  # the W&B project; the W&B run is named after the run folder

    def __post_init__(self) -> None:
        at_least(self, "run", {"log_every": 1, "ckpt_every": 1, "eval_every_epochs": 0, "max_eval_samples": 0,
                               "stop_after_steps": 0, "dist_timeout_min": 1e-3})
        if self.ckpt_every_min < 0:
            raise ConfigError(f"run.ckpt_every_min={self.ckpt_every_min} is negative; use minutes > 0, or 0 for "
                              "checkpoints every run.ckpt_every steps only")
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


def field_types(cls: type) -> dict[str, Any]:
    """{field name: its type} of a config dataclass (annotations resolved)."""
    return typing.get_type_hints(cls)


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        t = field_types(cls)[f.name]
        if dataclasses.is_dataclass(t):
            keys += _valid_keys(t, f"{prefix}{f.name}.")
        elif f.name not in ("objective", "layers"):
            keys.append(f"{prefix}{f.name}")
    return keys


def unknown_key(key: str, valid: list[str]) -> ConfigError:
    """The one-line error for an unknown key, naming the closest valid keys (or all of them)."""
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def parse_value(key: str, value: Any, t: Any) -> Any:
    """Convert `value` (from YAML or a CLI string) to type `t`, or raise ConfigError."""
    if typing.get_origin(t) is Literal:
        choices = typing.get_args(t)
        if value not in choices:            # compared as written: YAML would read `no`/`on` as bools
            shown = [str(c) if c != "" else '"" (none)' for c in choices]
            raise ConfigError(f"config key {key!r}: {value!r} is not a valid choice; choose one of {', '.join(shown)}")
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


def merge(tree: dict, update: dict, cls: type, prefix: str = "") -> None:
    """Merge the nested dict `update` into `tree` (in place), checking keys and types against `cls`."""
    hints = field_types(cls)
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
            raise unknown_key(dotted, _valid_keys(Config))
        t = hints[key]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted!r} is a section; set its fields, e.g. {dotted}.<key>=...")
            merge(tree.setdefault(key, {}), value, t, f"{dotted}.")
        else:
            tree[key] = parse_value(dotted, value, t)


def nested(key: str, value: Any) -> dict:
    """A dotted key and its value as a nested tree: `nested("optim.lr", v)` is {"optim": {"lr": v}}."""
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


def build(cls: type, tree: dict) -> Any:
    """The frozen dataclass `cls` from a tree `merge` checked; what the tree lacks keeps its default."""
    hints = field_types(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in tree and dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], tree[f.name])
        elif f.name in tree:
            kwargs[f.name] = tree[f.name]
    return cls(**kwargs)


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
    """The config as a run's config.yaml holds it."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
