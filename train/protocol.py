"""The papers' evaluation protocols, each a run of its own beside the pretraining run it evaluates:
linear evaluation and semi-supervised fine-tuning (DESIGN §6, the second kind of evaluation).

    python -m train linear ckpt=<run>/checkpoint.pt [preset=NAME] [compare=random_init] [key=value ...]
    python -m train finetune ckpt=<run>/checkpoint.pt labels=1%|10%|FILE [preset=NAME] [key=value ...]

Linear evaluation (BYOL App. C.1, RELICv2 App. B.1, SimCLR, MoCo v2/v3): the pretrained backbone
frozen in eval mode (its weights and BatchNorm statistics never change), a linear classifier (after a
non-affine BatchNorm where a protocol uses one, `bn`) trained with cross-entropy on one random-resized
crop and flip of each train image at the dataset's global view size (`augment: false`: the resized
image alone, DACL's domain-agnostic protocol), scored by top-1 and top-5 on centre crops of the val
split (resize to 256/224 of the view, centre crop: `views.ViewGroup.centre_crop`). Fine-tuning
(SimCLR Sec. B.5, RELICv2 App. B.2): the same, with the whole network trained (the backbone at
`backbone_lr_scale` times the head's learning rate) on a class-balanced, seeded share of the labels
(at least one image per class of its share: a class the share would leave empty is refused), or on
the train images a file lists by name (`labels=FILE`, one a line: SimCLR's published ImageNet 1 % and
10 % lists, `n01440764_10026.JPEG`, drop in; `listed_records`).

The views come from the loaders pretraining uses (`pipelines.loader`: DALI on a GPU, FFCV or DALI on
a CPU; the same backend as the run unless `data.backend=` says otherwise), sharded over the ranks of
a DDP run (`gpus=N`). The protocol's settings are a preset (`train/configs/protocol/<name>.yaml`, each
naming the paper and section it follows; `preset=auto`: the method's own on ImageNet-scale data, the
short `small` presets otherwise) with `key=value` overrides of `ProtocolConfig`; dotted `data.*` and
`run.*` words override the pretraining config the checkpoint saved (`data.root=`, `run.device=`).

Its folder is `<run>/<kind>-<preset>[-<labels_tag>]` (`-random_init` for the `compare=random_init` run: the
same protocol on the network at the pretraining run's initialisation): `config.yaml`, `metrics.jsonl`,
TensorBoard events, `checkpoint.pt` every `ckpt_every` steps and at the end. The same command after a
kill continues from that checkpoint and ends with the uninterrupted run's result (the positions of the
loaders, the RNG states and the optimiser are saved); after the end it prints the result again. The
results go beside the pretraining checkpoint: `<run>/linear_eval.json` or
`<run>/finetune_<labels>_eval.json` (top1, top5, the preset, its source, the epochs and, with
`compare=random_init`, the random-init network's figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipelines.loader import build_loader
from pipelines.processes import FolderLock, ensure_open_files
from pipelines.schema import NO_LABEL
from pipelines.spec import DatasetInfo, LoaderSpec
from pipelines.views import Recipe, ViewGroup
from train import checkpoint, dist
from train.config import Config, ConfigError, parse_value, per_process_batch, to_dict
from train.log import Log, Meter
from train.resolve import CONFIG_DIR, config_from_dict
from train.run import LINEAR_EVAL, check_free, check_same_network, hold, lock_of
from train.setup import (build_checked_loader, build_online, channels_last, check_dataset, check_processes, decoder_hints,
                         loader_workers, open_files_needed, resolve_backend, select_device)

Kind = Literal["linear", "finetune"]
KINDS: tuple[str, ...] = typing.get_args(Kind)
PROTOCOL_DIR = CONFIG_DIR / "protocol"
CENTRE_CROP = 224 / 256          # evaluation: resize the shorter side to 256/224 of the view, crop the view
SMALL_TRAIN = 100_000            # `preset=auto` below this many train records: the short `small` presets


@dataclass(frozen=True)
class ProtocolConfig:
    """One protocol's settings: a preset's YAML, then `key=value` overrides."""

    source: str = ""                # what the preset follows: paper, section (read-only in practice)
    epochs: float = 100.0           # passes over the (labelled) train records
    batch_size: int = 256           # global batch, over every rank
    lr: float = 0.1                 # the head's learning rate at global batch 256; scaled linearly with the batch
    optimizer: Literal["sgd", "lars"] = "sgd"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    schedule: Literal["cosine", "step"] = "cosine"
    milestones: tuple[float, ...] = ()  # step schedule: epochs where the lr is multiplied by `gamma`
    gamma: float = 0.1
    warmup_epochs: float = 0.0      # linear warmup from 0
    bn: bool = False                # a non-affine BatchNorm before the linear layer
    augment: bool = True            # random-resized crop and flip of the train images; false: the resized image
    backbone_lr_scale: float = 1.0  # fine-tuning: the backbone's lr as a share of the head's
    labels: str = ""                # fine-tuning: the share of labelled train images, "1%" or "10%", or a
                                    # file listing the labelled train images by name, one a line
    seed: int = 0                   # the labelled share, the head's initialisation, the loaders' draws
    log_every: int = 50             # steps between log lines
    ckpt_every: int = 500           # steps between checkpoints (and one at the end)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PROTOCOL_DIR.glob("*.yaml"))


# `preset=auto` on ImageNet-scale data: the protocol each method's paper reports (docs/evaluation.md's table).
METHOD_PRESETS: dict[str, dict[str, str]] = {
    "linear": {"relicv2": "relicv2", "byol": "byol", "uota": "byol-uota", "uota:mocov2star": "mocov2star",
               "rsa": "meanshift", "sdmp": "mocov3", "mocov3": "mocov3", "simclr": "simclr", "dacl": "dacl"},
    "finetune": {"relicv2": "relicv2-{labels}", "byol": "relicv2-{labels}", "uota": "relicv2-{labels}",
                 "rsa": "relicv2-{labels}", "sdmp": "simclr-{labels}", "mocov3": "simclr-{labels}",
                 "simclr": "simclr-{labels}", "dacl": "simclr-{labels}"},
}


def load_protocol(kind: Kind, preset: str, method: str, train_records: int, words: list[tuple[str, str]]
                  ) -> tuple[str, ProtocolConfig]:
    """(preset name, `ProtocolConfig`) of `kind`: the preset's YAML (`auto`: `METHOD_PRESETS` for `method`,
    "<method>:<objective base>" where the objective names a base, or `small` / `small-finetune` below
    `SMALL_TRAIN` train records), then the `key=value` words.

    Raises:
        ConfigError: an unknown preset or key, a bad value, a preset of the other kind.
    """
    labels = dict(words).get("labels", "")
    if preset == "auto":
        small = train_records < SMALL_TRAIN
        table = METHOD_PRESETS[kind]
        preset = ("small" if kind == "linear" else "small-finetune") if small else \
            table.get(method, table.get(method.split(":")[0], "byol")).format(labels=share_of(labels, train_records))
    path = PROTOCOL_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"no {kind} preset {preset!r}; choose one of {', '.join(preset_names())} (or preset=auto)")
    tree = yaml.safe_load(path.read_text()) or {}
    if tree.pop("kind", kind) != kind:
        raise ConfigError(f"preset {preset!r} is a {'fine-tuning' if kind == 'linear' else 'linear'} preset; "
                          f"use it with python -m train {'finetune' if kind == 'linear' else 'linear'}")
    hints = typing.get_type_hints(ProtocolConfig)
    values = {}
    for key, value in [*tree.items(), *words]:
        if key not in hints:
            raise ConfigError(f"unknown {kind} key {key!r}; valid keys: {', '.join(hints)}")
        values[key] = parse_value(key, value, hints[key])
    cfg = ProtocolConfig(**values)
    if kind == "finetune" and cfg.labels not in SHARES and not Path(cfg.labels).is_file():
        raise ConfigError(f"finetune needs labels=1%, labels=10% (the share of labelled train images) or labels=FILE "
                          f"(a file listing the labelled train images, one name a line), got {cfg.labels!r}"
                          + (": no such file" if cfg.labels not in ("", "1", "10") else ""))
    if cfg.epochs <= 0 or cfg.batch_size < 2 or cfg.lr <= 0:
        raise ConfigError(f"{kind}: epochs, lr must be > 0 and batch_size >= 2 (got {cfg.epochs}, {cfg.lr}, "
                          f"{cfg.batch_size})")
    return preset, cfg


SHARES = ("1%", "10%")            # labels= shares; anything else is a file of names
# What a second start of a running evaluation can do (wait), and one whose checkpoint's folder cannot be
# written (`train.run.hold`).
FIXES = ("", "copy the checkpoint into a folder this user can write: an evaluation writes its folder beside it")


def _listed(path: str) -> list[str]:
    """The names a labels file lists: one a line, blank lines and `#` comments left out."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def share_of(labels: str, train_records: int) -> str:
    """The schedule a `labels` setting follows: "1pct" or "10pct" (a file: "1pct" when it lists under 3 %
    of the train records, about the geometric mean of the two shares)."""
    if labels in SHARES or not Path(labels).is_file():             # not a file: refused by the caller
        return labels.rstrip("%") + "pct"
    return "1pct" if len(_listed(labels)) < 0.03 * max(train_records, 1) else "10pct"


def labels_tag(labels: str) -> str:
    """`labels` as a run's folder and results file name it: "1pct", "10pct", or "list-<file stem>"."""
    if labels in SHARES:
        return labels.rstrip("%") + "pct"
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(labels).stem)
    return f"list-{stem}"


def listed_records(path: str, names: list[str]) -> tuple[int, ...]:
    """The sorted record indices of the train images file `path` lists: a line names a record by its
    source file as the dataset stored it (`DatasetInfo.names`, relative to the source folder) or by that
    file's base name alone (the published ImageNet lists: `n01440764_10026.JPEG`).

    Raises:
        ConfigError: an empty list, a name no record has (how many, the first), or a base name that
            several records share (give the path).
    """
    listed = _listed(path)
    if not listed:
        raise ConfigError(f"labels={path} lists no image; give one train image name a line")
    by_base: dict[str, int] = {}                 # one int a record (ImageNet: 1.28 M), lists only where shared
    shared: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        base = n.rsplit("/", 1)[-1]
        if base in by_base:
            shared.setdefault(base, [by_base[base]]).append(i)
        else:
            by_base[base] = i
    chosen, missing = set(), []
    for name in listed:
        base = name.rsplit("/", 1)[-1]
        hits = shared.get(base) or ([by_base[base]] if base in by_base else [])
        if len(hits) > 1:                        # a path as stored tells them apart
            hits = [i for i in hits if names[i] == name] or hits
        if len(hits) > 1:
            raise ConfigError(f"labels={path}: {name!r} is the name of {len(hits)} train images (e.g. "
                              f"{names[hits[0]]}); give its path as the dataset lists it")
        if hits:
            chosen.add(hits[0])
        else:
            missing.append(name)
    if missing:
        raise ConfigError(f"labels={path}: {len(missing):,} of its {len(listed):,} names are no train image of this "
                          f"dataset (the first: {missing[0]!r}); list images of its train split")
    return tuple(sorted(chosen))


@functools.lru_cache(maxsize=2)
def labelled_records(labels: str, info: DatasetInfo, num_classes: int, seed: int) -> tuple[int, ...]:
    """The records fine-tuning trains on: a class-balanced share (`labelled_share`) or a file's list
    (`listed_records`); worked out once a process (the check at start, then the pretrained and the
    random-init runs: at ImageNet's size a list is matched against 1.28 M names).

    Raises:
        ConfigError: a share that leaves a class empty, a list that names no train image.
        schema.DatasetError: a list on a dataset that recorded no file names.
    """
    if labels in SHARES:
        return labelled_share(torch.from_numpy(info.labels()), labels, num_classes, seed)
    return listed_records(labels, info.names())


def labelled_share(labels: Tensor, share: str, num_classes: int, seed: int) -> tuple[int, ...]:
    """The sorted record indices of a class-balanced `share` ("1%", "10%") of the labels: per class
    round(share x its images) of them, drawn with `seed`.

    Raises:
        ConfigError: a class the share leaves without an image (or a class without images).
    """
    fraction = float(share.rstrip("%")) / 100
    gen = torch.Generator().manual_seed(seed)
    chosen = []
    for c in range(num_classes):
        members = torch.nonzero(labels == c)[:, 0]
        take = round(fraction * len(members))
        if take == 0:
            raise ConfigError(f"labels={share} leaves class {c} without a labelled image (it has {len(members)} "
                              "train images); use a larger share")
        chosen.append(members[torch.randperm(len(members), generator=gen)[:take]])
    return tuple(sorted(torch.cat(chosen).tolist()))


def train_recipe(global_px: int, augment: bool) -> Recipe:
    """One view of each train image: a random-resized crop (8-100 %) and flip at `global_px`, or with
    `augment` false the whole image resized (DACL's domain-agnostic protocol)."""
    group = ViewGroup("train", size_px=global_px, role="global", interpolation="bicubic")
    if not augment:
        group = dataclasses.replace(group, crop_p=0.0, flip_p=0.0)
    return Recipe("protocol-train", (group,))


def val_recipe(global_px: int) -> Recipe:
    """The centre crop of each val image at `global_px` (`CENTRE_CROP` of its shorter side)."""
    return Recipe("protocol-val", (ViewGroup("val", size_px=global_px, role="global", centre_crop=CENTRE_CROP,
                                             flip_p=0.0, interpolation="bicubic"),))


class Classifier(nn.Module):
    """The backbone, then (a non-affine BatchNorm and) a linear layer to the classes. With `frozen` the
    backbone stays in eval mode without gradients whatever `train()` asks, so that neither its weights
    nor its BatchNorm statistics change."""

    def __init__(self, backbone: nn.Module, width: int, classes: int, bn: bool, frozen: bool) -> None:
        super().__init__()
        self.backbone, self.frozen = backbone, frozen
        self.head = nn.Sequential(nn.BatchNorm1d(width, affine=False) if bn else nn.Identity(), nn.Linear(width, classes))
        nn.init.normal_(self.head[1].weight, std=0.01)          # MoCo's and SimCLR's linear head
        nn.init.zeros_(self.head[1].bias)
        if frozen:
            backbone.requires_grad_(False)
        self.train()                          # a frozen backbone in eval mode from the start

    def train(self, mode: bool = True) -> Classifier:
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad() if self.frozen else contextlib.nullcontext():
            feats = self.backbone(x)                                              # (B, F)
        return self.head(feats.float())                                            # (B, C)


def lr_at(p: ProtocolConfig, step: int, steps_per_epoch: int) -> float:
    """The head's learning rate at `step` (before batch scaling): linear warmup, then cosine to 0 or the
    step schedule's drops at `milestones`."""
    total = max(1, round(p.epochs * steps_per_epoch))
    warmup = round(p.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return p.lr * (step + 1) / warmup
    if p.schedule == "step":
        return p.lr * p.gamma ** sum(step >= round(m * steps_per_epoch) for m in p.milestones)
    return p.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def build_optimizer(p: ProtocolConfig, model: Classifier) -> torch.optim.Optimizer:
    """SGD (Nesterov where the preset says) or LARS (timm's) over the head and, fine-tuning, the
    backbone in its own group at `backbone_lr_scale`; each group's `lr_scale` is applied per step."""
    groups = [{"params": list(model.head.parameters()), "lr_scale": 1.0}]
    if not model.frozen:
        groups.append({"params": list(model.backbone.parameters()), "lr_scale": p.backbone_lr_scale})
    if p.optimizer == "lars":
        from timm.optim import Lars

        return Lars(groups, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    return torch.optim.SGD(groups, lr=p.lr, momentum=p.momentum, nesterov=p.nesterov, weight_decay=p.weight_decay)


def train_step(model: Classifier, trained: nn.Module, optimizer: torch.optim.Optimizer, views: Tensor,
               labels: Tensor) -> Tensor:
    """One optimiser step: the cross-entropy of the classes from `trained` (the head, or the whole
    `model` when fine-tuning; DDP-wrapped on several ranks), linear evaluation feeding it the frozen
    backbone's features.

    Args:
        views: (B, 3, S, S) this rank's views. labels: (B,) int64 classes.

    Returns:
        The loss (on the device; no host read).
    """
    x = views
    if model.frozen:
        with torch.no_grad():
            x = model.backbone(x).float()                                          # (B, F)
    loss = F.cross_entropy(trained(x).float(), labels.long())                      # (B, C) logits
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def top_k_correct(model: nn.Module, batches, device: torch.device) -> Tensor:
    """(3,) float64 on `device`: top-1 and top-5 correct and the records seen, summed over every rank."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)
    try:
        for batch in batches:
            logits = model(batch.global_views[0].to(device, non_blocking=True))            # (B, C)
            label = batch.label.to(device).long()
            top = logits.topk(min(5, logits.shape[1]), dim=1).indices                       # (B, 5)
            counts += torch.stack([(top[:, 0] == label).sum(), (top == label[:, None]).any(1).sum(),
                                   torch.tensor(len(label), device=device)]).double()
    finally:
        model.train(was_training)
    return dist.all_reduce_sum([counts])[0]


@dataclass
class Protocol:
    """One protocol run of a pretrained (or random-init) network: its settings and where it lives."""

    kind: Kind
    preset: str
    p: ProtocolConfig
    cfg: Config                      # the pretraining config (data, views, model, run.seed)
    folder: Path
    weights: dict | None             # the online network's state dict; None: the network at its initialisation

    def run(self, backend: str, device: torch.device, held: dist.HeldSignal | None = None) -> dict | None:
        """Train and score (resuming from the folder's checkpoint), returning {"top1", "top5", ...}; saving
        as pretraining does (`checkpoint.Cadence`: every `ckpt_every` steps, `run.ckpt_every_min`, and at
        the first log step after any rank caught `held`'s signal, where it returns None instead; the steps
        reached before a loader worker's death). One process writes the folder at a time (`train.run.hold`:
        the same evaluation started twice would overwrite its own checkpoint)."""
        lock = lock_of(self.folder)
        try:
            return self._run(backend, device, held, lock)
        finally:
            lock.release()

    def _run(self, backend: str, device: torch.device, held: dist.HeldSignal | None, lock: FolderLock) -> dict | None:
        cfg, p, world, rank = self.cfg, self.p, dist.world_size(), dist.rank()
        info = DatasetInfo.read(cfg.data.root, cfg.data.name, "train")
        subset = None
        if self.kind == "finetune":
            subset = labelled_records(p.labels, info, cfg.data.num_classes, p.seed)
        records = len(subset) if subset else info.count
        if p.batch_size > records:            # a preset's batch on a small (share of a) dataset: one batch an epoch
            batch = records // (2 * world) * 2 * world
            if dist.is_main():
                print(f"note: batch_size {p.batch_size} is more than the {records:,} labelled train records; "
                      f"{batch} (batch_size= sets another)", flush=True)
            p = self.p = dataclasses.replace(p, batch_size=batch)
        spec = LoaderSpec(root=cfg.data.root, dataset=cfg.data.name, split="train",
                          recipe=train_recipe(cfg.views.global_px, p.augment),
                          batch_size=per_process_batch(p.batch_size, world, "batch_size"),
                          rank=rank, world_size=world, seed=p.seed, device=str(device),
                          num_workers=loader_workers(cfg, backend, device), channels_last=channels_last(cfg, device),
                          decoder=decoder_hints(cfg), subset=subset)
        loader = build_checked_loader(backend, spec, f"batch_size={p.batch_size}", "batch_size")
        steps_per_epoch = len(loader)
        total = max(1, round(p.epochs * steps_per_epoch))

        torch.manual_seed(cfg.run.seed)                     # the pretraining run's initial network
        online = build_online(cfg, device)
        if self.weights is not None:
            online.load_state_dict(self.weights)
        width = int(online.backbone.num_features)           # timm's feature width (no probe: it would move BN's statistics)
        torch.manual_seed(p.seed)
        model = Classifier(online.backbone, width, cfg.data.num_classes, p.bn, frozen=self.kind == "linear").to(device)
        if world > 1 and not model.frozen and device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        optimizer = build_optimizer(p, model)
        trained = model.head if model.frozen else model       # what takes gradients: DDP's over several ranks
        if world > 1:
            trained = DistributedDataParallel(trained, device_ids=[device.index] if device.type == "cuda" else None)
        state = checkpoint.load(self.folder / checkpoint.LATEST) if (self.folder / checkpoint.LATEST).is_file() else None
        checkpoint.check_ranks_agree(self.folder, None if state is None else int(state["step"]))
        hold(lock, self.folder, FIXES)                      # before the first write
        log = Log(self.folder, enabled=dist.is_main())
        start = 0
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = int(state["step"])
            loader.set_epoch(start // steps_per_epoch)
            position, note = checkpoint.resume_rank(state, rank, world, p.seed, p.batch_size,
                                                    int(state["protocol"]["batch_size"]), steps_per_epoch)
            loader.load_state_dict(position)
            log.print(f"resuming {self.folder} from step {start}" + (f"; {note}" if note else ""))
        else:
            loader.set_epoch(0)
            if dist.is_main():
                self.folder.mkdir(parents=True, exist_ok=True)
                (self.folder / "config.yaml").write_text(yaml.safe_dump(
                    {"kind": self.kind, "preset": self.preset, "protocol": to_dict(p), "pretraining": to_dict(cfg)},
                    sort_keys=False))
        log.print(f"{self.kind} evaluation ({self.preset}: {p.source}) of {cfg.method} {cfg.model.backbone} "
                  f"{'at its initialisation ' if self.weights is None else ''}on {cfg.data.name}: {p.epochs:g} epochs of "
                  f"{steps_per_epoch} steps ({len(subset) if subset else info.count:,} labelled train records), "
                  f"batch {p.batch_size}, {world} rank(s), {backend} backend")

        def save(step: int, alone: bool = False) -> None:
            ranks = checkpoint.rank_states(loader, alone)         # alone: this rank by itself (`Cadence.next_batch`)
            if alone or dist.is_main():
                saved = checkpoint.save(self.folder / checkpoint.LATEST, {
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, **ranks,
                    "protocol": to_dict(p)})
                if short := checkpoint.space_short(self.folder, saved.stat().st_size, 1):
                    log.print(short)

        model.train()
        meter, batches = Meter(), _forever(loader)
        cadence = checkpoint.Cadence(p.ckpt_every, cfg.run.ckpt_every_min, held)
        with contextlib.closing(loader), cadence.held.holding():   # its workers end also when an exception passes
            for step in range(start, total):
                lr = lr_at(p, step, steps_per_epoch) * p.batch_size / 256
                for g in optimizer.param_groups:
                    g["lr"] = lr * g["lr_scale"]
                began = time.perf_counter()
                batch = cadence.next_batch(batches, step, start, lambda alone: save(step, alone))
                data_s = time.perf_counter() - began
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and cfg.run.amp):
                    loss = train_step(model, trained, optimizer, batch.global_views[0], batch.label)
                meter.tick(batch_size=spec.batch_size, data_s=data_s)
                done = step + 1
                if step == start and dist.is_main():    # a disk too small for the checkpoints: told before the first
                    size = checkpoint.state_bytes({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
                    if short := checkpoint.space_short(self.folder, size, 1):
                        log.print(short)
                if done % p.log_every == 0 or done == total:
                    log.step(done, total, {"loss": loss.item()}, lr, None, meter.read_and_reset())  # sync: log step
                    cadence.at_log_step(device)  # sync: the signal and the clocks of every rank
                if cadence.due(done, total):
                    save(done)
                    cadence.saved()
                if cadence.signalled:
                    break
        if cadence.signalled:
            log.print(f"caught {cadence.held.what()}: saved the checkpoint of step {done} in {self.folder} and "
                      "stopped; the same command continues there (a requeued SLURM job does so itself)")
            return None
        return self.score(backend, device, model, log)

    def score(self, backend: str, device: torch.device, model: nn.Module, log: Log) -> dict:
        """Top-1 / top-5 on the val split's centre crops."""
        cfg, world = self.cfg, dist.world_size()
        spec = LoaderSpec(root=cfg.data.root, dataset=cfg.data.name, split="val", recipe=val_recipe(cfg.views.global_px),
                          batch_size=max(2, self.p.batch_size // world // 2 * 2), rank=dist.rank(), world_size=world,
                          seed=self.p.seed, device=str(device), num_workers=loader_workers(cfg, backend, device),
                          shuffle=False, drop_last=False, channels_last=channels_last(cfg, device),
                          decoder=decoder_hints(cfg))
        with contextlib.closing(build_loader(backend, spec)) as batches:
            top1, top5, n = (float(v) for v in top_k_correct(model, batches, device))
        result = {"top1": top1 / n, "top5": top5 / n, "val_samples": n, "batch_size": self.p.batch_size}
        log.write({"kind": "eval", **result})
        return result


def _forever(loader):
    while True:
        yield from loader
        loader.set_epoch(loader.state_dict()["epoch"])


@dataclass(frozen=True)
class Plan:
    """A protocol command, read and checked: what `main` runs and `train.slurm` submits."""

    kind: Kind
    preset: str
    p: ProtocolConfig
    ckpt: Path                      # the pretraining checkpoint
    step: int                       # its step
    cfg: Config                     # its config, with the command's dotted words
    runs: dict[str, Protocol]       # "checkpoint" and, with compare=random_init, "random_init"
    results: Path                   # the results file, beside the checkpoint

    @property
    def done(self) -> bool:
        """Whether every run of the command has its result (an earlier start finished it)."""
        return all((r.folder / "result.json").is_file() for r in self.runs.values())


def prepare(kind: Kind, args: list[str], world: int) -> Plan:
    """Read and check `linear|finetune ckpt=... [preset=] [compare=random_init] [key=value ...]` for a run
    of `world` processes; nothing is written.

    Raises:
        ConfigError, CheckpointError, DatasetError: bad input, one line.
    """
    words = [a.split("=", 1) if "=" in a else (a, "") for a in args]
    for word, value in words:
        if not value:
            raise ConfigError(f"argument {word!r} is not key=value; e.g. ckpt=runs/<run>/checkpoint.pt")
    picks = {k: v for k, v in words if k in ("ckpt", "preset", "compare")}
    if "ckpt" not in picks:
        raise ConfigError(f"{kind} needs the pretraining checkpoint: make {kind} CKPT=<run dir>/checkpoint.pt")
    if picks.get("compare", "random_init") != "random_init":
        raise ConfigError(f"compare={picks['compare']}: the one comparison is compare=random_init")
    overrides = [f"{k}={v}" for k, v in words if "." in k and k not in picks]
    own = [(k, v) for k, v in words if "." not in k and k not in picks]
    ckpt = Path(picks["ckpt"])
    state = checkpoint.load_training(ckpt, "ckpt")
    cfg = config_from_dict(state["config"], overrides=overrides)
    check_same_network(cfg, state["config"], str(ckpt), f"{kind} evaluation rebuilds that network: drop the override")
    check_dataset(cfg)
    if cfg.data.num_classes <= 0:
        raise ConfigError(f"dataset {cfg.data.name} has no labels, so there is nothing to classify; {kind} evaluation "
                          "needs a labelled dataset (train/<class>/ folders)")
    train = DatasetInfo.read(cfg.data.root, cfg.data.name, "train")
    base = getattr(cfg.objective, "base", None)              # an objective on a base method (UOTA on MoCo-v2*)
    preset, p = load_protocol(kind, picks.get("preset", "auto"), f"{cfg.method}:{base}" if base else cfg.method,
                              train.count, own)
    per_process_batch(p.batch_size, world, "batch_size")      # an uneven split
    if kind == "finetune":
        labels = train.labels()
        if (labels == NO_LABEL).any():
            raise ConfigError(f"dataset {cfg.data.name} has unlabelled train records; fine-tuning needs labels")
        labelled_records(p.labels, train, cfg.data.num_classes, p.seed)   # a class left empty, a bad list
    name = f"{kind}-{preset}" + (f"-{labels_tag(p.labels)}" if kind == "finetune" else "")
    runs = {"checkpoint": Protocol(kind, preset, p, cfg, ckpt.parent / name, state["online"])}
    if "compare" in picks:
        runs["random_init"] = Protocol(kind, preset, p, cfg, ckpt.parent / f"{name}-random_init", None)
    results = ckpt.parent / (LINEAR_EVAL if kind == "linear" else f"finetune_{labels_tag(p.labels)}_eval.json")
    return Plan(kind, preset, p, ckpt, int(state.get("step", 0)), cfg, runs, results)


def is_protocol(words: list[str]) -> bool:
    """Whether command words (after the launcher words) run a protocol: `linear ...`, `finetune ...`."""
    return bool(words) and words[0] in KINDS


def preflight(kind: Kind, args: list[str], processes: int, nodes: int = 1, here: bool = True) -> Plan:
    """`prepare` in the process that starts the protocol's processes (`gpus=N`) or submits its job: bad
    input, or the same evaluation running, is one line there, before any process starts (`here`: this
    machine's devices counted too).

    Raises:
        ConfigError, CheckpointError, DatasetError: see `prepare`; `gpus=N` beyond this machine.
    """
    plan = prepare(kind, args, processes * nodes)
    if here:
        check_processes(processes, plan.cfg.run.device)
    for protocol in plan.runs.values():                 # the same evaluation running (`train.run.hold`)
        check_free(protocol.folder, FIXES)
    return plan


def main(kind: Kind, args: list[str], held: dist.HeldSignal | None = None) -> dict | None:
    """`python -m train linear|finetune ckpt=... [preset=] [compare=random_init] [key=value ...]` in this
    process (one rank of a `gpus=N` run or the whole run, a SLURM task): the protocol on the checkpoint's
    backbone (and the random-init one), the results file written by rank 0, printed, and returned.

    The steps hold `run.checkpoint_on_signal` (the pretraining config's, or a `run.` word's; `held`: the
    one pretraining installed, for `run.eval=linear`): caught, the protocol saves the step it reached and
    returns None, and the signal then takes its action (SLURM: the requeue; the same command continues).

    Raises:
        ConfigError, CheckpointError, DatasetError: bad input, one line, before anything is written.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = prepare(kind, args, world)
    cfg, p = plan.cfg, plan.p
    ensure_open_files(open_files_needed(cfg, dist.local_world_size(), world), f"the {kind} evaluation")
    device = select_device(cfg.run.device, cfg.run.dist_timeout_min)
    backend = resolve_backend(cfg, device)
    began = time.perf_counter()
    results = {}
    installs = held is None                     # standalone: this call holds the signal and lets it go
    held = held or dist.HeldSignal(cfg.run.checkpoint_on_signal)
    try:
        for label, protocol in plan.runs.items():
            done = protocol.folder / "result.json"
            if done.is_file():
                results[label] = json.loads(done.read_text())
                continue
            result = protocol.run(backend, device, held)
            if result is None:                  # the held signal stopped it at a checkpoint,
                dist.barrier()                  # which rank 0 has written before any rank lets the signal act
                return None
            results[label] = result
            if dist.is_main():
                done.write_text(json.dumps(result, indent=1) + "\n")
            dist.barrier()
    finally:
        if installs:
            held.release()                      # a signal held takes its action now (SLURM: requeue)
    out = {"kind": kind, "preset": plan.preset, "source": p.source, "epochs": p.epochs,
           "batch_size": results["checkpoint"].get("batch_size", p.batch_size),
           "labels": p.labels or None, "checkpoint": str(plan.ckpt), "checkpoint_step": plan.step,
           "top1": results["checkpoint"]["top1"], "top5": results["checkpoint"]["top5"],
           "val_samples": results["checkpoint"]["val_samples"], "protocol": to_dict(p),
           "seconds": round(time.perf_counter() - began, 1)}
    if "random_init" in results:
        out["random_init"] = {k: results["random_init"][k] for k in ("top1", "top5")}
    if dist.is_main():
        tmp = plan.results.with_name(f".{plan.results.name}.tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        os.replace(tmp, plan.results)
        ref = out.get("random_init")
        print(f"{kind} evaluation ({plan.preset}) of {plan.ckpt}: top-1 {out['top1']:.1%}, top-5 {out['top5']:.1%}"
              + (f" (random init {ref['top1']:.1%} / {ref['top5']:.1%}: {100 * (out['top1'] - ref['top1']):+.1f} "
                 "points)" if ref else "") + f"; {plan.results}", flush=True)
    return out
