"""The torchvision baseline: PIL images and torchvision transforms in `torch.utils.data` workers.

This is the pipeline users actually run (DINO, solo-learn, the torchvision reference scripts): each
worker reads one record from the DALI webdataset shards (`pipelines/schema.py` layout, opened with
Python's `tarfile`), decodes it with `PIL.Image.open(...).convert("RGB")` and builds every view of
the recipe with torchvision's PIL transforms:

    RandomResizedCrop (area, log-uniform ratio, interpolation) → saliency background removal (large
    crops; the mask is cropped with the same window) → RandomHorizontalFlip →
    RandomApply(ColorJitter, p) → RandomGrayscale → PIL ImageFilter.GaussianBlur with a random radius
    applied with p (as DINO and solo-learn do) → PIL ImageOps.solarize(threshold=128).

Staged groups (RSA) take the finished weak view of their parent and apply only their own colour,
grayscale, blur and solarize ops to it: one decode and one crop give both outputs. Views stay uint8
until they reach `spec.device`, where they are mixed with `pipelines/mixing.py` (on [0, 1] pixels,
from a generator seeded per (seed, rank, epoch, batch)) and normalised with the dataset's mean/std.

It is the measured baseline of `pipelines/bench.py` and a semantic reference for tests; speed tricks
that users do not apply (e.g. PIL draft-mode decoding) are deliberately left out.

Randomness: every sample draws from its own torch generator state seeded by (seed, epoch, index), so
batches depend on the seed only, not on the number of workers or the rank layout.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageOps
from torch import Tensor

from pipelines import schema
from pipelines.batch import Batch, normalize
from pipelines.loader import LoaderSpec
from pipelines.shards import ShardRecord, scan_shards
from pipelines.views import Recipe, ViewGroup

_INTERPOLATION = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}
_SALIENCY_MIN_COVERAGE = 0.05   # RELICv2 App. A.2: mask only when it covers at least 5 % of the image
_BLUR_REFERENCE_PX = 224        # ViewGroup.blur_sigma is given in px at a 224-px output


class TorchvisionBackendError(ValueError):
    """A dataset or recipe the torchvision backend cannot read, with the fix in the message."""


def split_groups(recipe: Recipe) -> tuple[list[ViewGroup], list[ViewGroup], list[ViewGroup]]:
    """Sort a recipe's groups into the `Batch` fields they fill.

    Staged groups (with a parent) and, in recipes without them, the crops at the largest size are
    `global_views`; the parents of staged groups are `weak_views`; smaller crops are `local_views`.

    Returns:
        (global groups, local groups, weak groups), each in recipe order.
    """
    parents = {g.parent for g in recipe.groups if g.parent is not None}
    staged = [g for g in recipe.groups if g.parent is not None]
    weak = [g for g in recipe.groups if g.name in parents]
    crops = [g for g in recipe.groups if g.parent is None and g.name not in parents]
    large_px = max((g.size_px for g in crops), default=0)
    large = [g for g in crops if g.size_px == large_px] if not staged else []
    local = [g for g in crops if g.size_px != large_px or staged]
    return staged + large, local, weak


def _sample_radius(low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(()))


class _ColourOps:
    """The colour, grayscale, blur and solarize ops of one group, applied to a PIL view."""

    def __init__(self, g: ViewGroup) -> None:
        import torchvision.transforms as T

        self.jitter = None
        if g.jitter_p > 0:
            self.jitter = T.RandomApply(
                [T.ColorJitter(g.brightness, g.contrast, g.saturation, g.hue)], p=g.jitter_p)
        self.gray = T.RandomGrayscale(p=g.gray_p) if g.gray_p > 0 else None
        scale = g.size_px / _BLUR_REFERENCE_PX
        self.blur_p = g.blur_p
        self.blur_radius = (g.blur_sigma[0] * scale, g.blur_sigma[1] * scale)
        self.solarize_p = g.solarize_p

    def __call__(self, img: Image.Image) -> Image.Image:
        if self.jitter is not None:
            img = self.jitter(img)
        if self.gray is not None:
            img = self.gray(img)
        if self.blur_p > 0 and float(torch.rand(())) < self.blur_p:
            # DINO / solo-learn: PIL's GaussianBlur with radius (its sigma) drawn uniformly.
            img = img.filter(ImageFilter.GaussianBlur(radius=_sample_radius(*self.blur_radius)))
        if self.solarize_p > 0 and float(torch.rand(())) < self.solarize_p:
            img = ImageOps.solarize(img, threshold=128)
        return img


class _CropGroup:
    """Crop, saliency and flip of one group that crops the decoded image itself."""

    def __init__(self, g: ViewGroup, saliency: bool) -> None:
        self.group = g
        self.size = (g.size_px, g.size_px)
        self.interpolation = _INTERPOLATION[g.interpolation]
        self.saliency_p = g.saliency_p if saliency else 0.0
        self.colour = _ColourOps(g)

    def __call__(self, img: Image.Image, mask: Image.Image | None, coverage: float) -> Image.Image:
        import torchvision.transforms as T
        import torchvision.transforms.functional as F

        g = self.group
        if g.crop_p >= 1.0 or (g.crop_p > 0 and float(torch.rand(())) < g.crop_p):
            top, left, h, w = T.RandomResizedCrop.get_params(img, list(g.area), list(g.ratio))
        else:
            top, left, h, w = 0, 0, img.height, img.width
        view = F.resized_crop(img, top, left, h, w, list(self.size), self.interpolation)
        if (self.saliency_p > 0 and mask is not None and coverage >= _SALIENCY_MIN_COVERAGE
                and float(torch.rand(())) < self.saliency_p):
            # RELICv2 App. A.2: background → one gray level per image; mask cropped with the same window.
            m = F.resized_crop(mask, top, left, h, w, list(self.size), Image.BILINEAR)
            level = int(torch.randint(0, 256, ()))
            background = Image.new("RGB", view.size, (level, level, level))
            view = Image.composite(view, background, m.point(lambda v: 255 if v >= 128 else 0))
        if g.flip_p > 0 and float(torch.rand(())) < g.flip_p:
            view = F.hflip(view)
        return self.colour(view)


def _to_uint8_chw(img: Image.Image) -> Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # (3, H, W)


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over the webdataset shards; item = (record position, per-sample seed).

    Returns per item a dict with `views` (one (count, 3, H, W) uint8 tensor per group, in recipe
    order), `index` and `label`.
    """

    def __init__(self, entries: list[ShardRecord], recipe: Recipe) -> None:
        self.entries = entries
        self.recipe = recipe
        global_groups, _, _ = split_groups(recipe)
        global_names = {g.name for g in global_groups}
        self.crops = {g.name: _CropGroup(g, saliency=g.name in global_names)
                      for g in recipe.groups if g.parent is None}
        self.staged = {g.name: _ColourOps(g) for g in recipe.groups if g.parent is not None}
        self._fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def _read(self, shard: str, offset: int, size: int) -> bytes:
        fd = self._fds.get(shard)
        if fd is None:  # one descriptor per shard and process; pread needs no seek, so no locking
            fd = self._fds[shard] = os.open(shard, os.O_RDONLY)
        return os.pread(fd, size, offset)

    def decode(self, pos: int) -> tuple[Image.Image, Image.Image | None, ShardRecord]:
        """Decode record `pos` as PIL RGB (and its mask as PIL L, or None)."""
        e = self.entries[pos]
        img = Image.open(io.BytesIO(self._read(e.shard, e.image_offset, e.image_size))).convert("RGB")
        mask = None
        if e.mask_offset >= 0:
            mask = Image.open(io.BytesIO(self._read(e.shard, e.mask_offset, e.mask_size))).convert("L")
        return img, mask, e

    def __getitem__(self, item: tuple[int, int]) -> dict:
        pos, seed = item
        if torch.utils.data.get_worker_info() is None:
            # In the training process itself: keep its global RNG stream untouched.
            with torch.random.fork_rng(devices=[]):
                return self._sample(pos, seed)
        return self._sample(pos, seed)

    def _sample(self, pos: int, seed: int) -> dict:
        torch.manual_seed(seed)
        img, mask, e = self.decode(pos)
        done: dict[str, list[Image.Image]] = {}
        views: list[Tensor] = []
        for g in self.recipe.groups:
            if g.parent is None:
                pil = [self.crops[g.name](img, mask, e.coverage) for _ in range(g.count)]
            else:
                pil = [self.staged[g.name](v) for v in done[g.parent]]
            done[g.name] = pil
            views.append(torch.stack([_to_uint8_chw(v) for v in pil]))  # (count, 3, H, W)
        return {"views": views, "index": e.index, "label": e.label}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fds"] = {}  # descriptors are per process
        return state


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's random draws: a mix of (seed, epoch, index) below 2**63."""
    return ((seed * 1_000_003 + epoch) * 2_654_435_761 + index * 40_503 + 12_345) % (2**63)


class _EpochBatches:
    """Batch sampler over this rank's records for the current epoch (evaluated in the main process)."""

    def __init__(self, spec: LoaderSpec, n: int) -> None:
        self.spec = spec
        self.n = n
        self.epoch = 0
        self.skip = 0

    def rank_positions(self) -> list[int]:
        s = self.spec
        if s.shuffle:
            g = torch.Generator().manual_seed(s.seed * 100_003 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if s.drop_last:
            per_rank = self.n // (s.world_size * s.batch_size) * s.batch_size
        else:
            per_rank = -(-self.n // s.world_size)
        return order[s.rank * per_rank:(s.rank + 1) * per_rank]

    def __len__(self) -> int:
        s = self.spec
        if s.drop_last:
            return self.n // (s.world_size * s.batch_size)
        return -(-len(self.rank_positions()) // s.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s = self.spec
        pos = self.rank_positions()
        for b in range(self.skip, len(self)):
            chunk = pos[b * s.batch_size:(b + 1) * s.batch_size]
            yield [(p, sample_seed(s.seed, self.epoch, p)) for p in chunk]


def _collate(items: list[dict]) -> dict:
    groups = [torch.stack([it["views"][k] for it in items], dim=1) for k in range(len(items[0]["views"]))]
    return {"views": groups,                                          # each (count, B, 3, H, W)
            "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
            "label": torch.tensor([it["label"] for it in items], dtype=torch.long)}


class TorchvisionLoader:
    """PIL + torchvision loader for one rank; see the module docstring."""

    def __init__(self, spec: LoaderSpec, entries: list[ShardRecord], mean: tuple[float, ...],
                 std: tuple[float, ...]) -> None:
        self.spec = spec
        self.mean, self.std = tuple(mean), tuple(std)
        self.dataset = ShardDataset(entries, spec.recipe)
        self.batches = _EpochBatches(spec, len(entries))
        self.global_groups, self.local_groups, self.weak_groups = split_groups(spec.recipe)
        self.device = torch.device(spec.device)
        self.loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self.batches, num_workers=spec.num_workers,
            collate_fn=_collate, pin_memory=self.device.type == "cuda",
            persistent_workers=spec.num_workers > 0)
        self._done = 0

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.batches.epoch = epoch
        self.batches.skip = 0

    def state_dict(self) -> dict:
        return {"epoch": self.batches.epoch, "batches_done": self._done}

    def load_state_dict(self, state: dict) -> None:
        self.batches.epoch = int(state["epoch"])
        self.batches.skip = int(state["batches_done"])

    def _views(self, groups: list[ViewGroup], by_name: dict[str, Tensor]) -> Tensor | None:
        if not groups:
            return None
        x = torch.cat([by_name[g.name] for g in groups])                    # (V, B, 3, H, W) uint8
        return x.to(self.device, non_blocking=True)

    def _mix(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mixes of the global views x (V, B, 3, H, W) in [0, 1]; SDMP shares lam and box per sample."""
        from pipelines import mixing

        s = self.spec
        gen = torch.Generator(device=self.device).manual_seed(
            sample_seed(s.seed, self.batches.epoch, s.rank * 1_000_000 + self._done))
        v, b, _, h, w = x.shape
        if s.mix.kind == "sdmp":
            p = mixing.sample_sdmp(b, h, w, s.mix.alpha, s.mix.sdmp_mixers, gen, self.device)
            outs = [mixing.apply_sdmp(x[k], p) for k in range(v)]
            partners = [p.partner] * v
        else:
            outs, partners = [], []
            for k in range(v):  # DACL: every positive draws its own partner, lam and noise
                p = mixing.sample_dacl(b, s.mix.alpha, len(s.mix.dacl_noises), gen, self.device)
                outs.append((mixing.apply_dacl(x[k], p, s.mix.dacl_noises, gen), p.lam))
                partners.append(p.partner)
        mixed = torch.stack([o[0] for o in outs])                         # (V, B, 3, H, W)
        return mixed, torch.stack([o[1] for o in outs]), torch.stack(partners)   # (V, B), (V, B)

    def __iter__(self) -> Iterator[Batch]:
        self._done = self.batches.skip
        for raw in self.loader:
            by_name = {g.name: v for g, v in zip(self.spec.recipe.groups, raw["views"])}
            norm = lambda x: None if x is None else normalize(x, self.mean, self.std)  # noqa: E731
            global_views = self._views(self.global_groups, by_name)
            mixed = mix_lam = mix_partner = None
            if self.spec.mix.kind != "none":
                mixed, mix_lam, mix_partner = self._mix(global_views.float().div_(255.0))
            self._done += 1
            yield Batch(
                global_views=norm(global_views),
                local_views=norm(self._views(self.local_groups, by_name)),
                weak_views=norm(self._views(self.weak_groups, by_name)),
                mixed=norm(mixed), mix_lam=mix_lam, mix_partner=mix_partner,
                index=raw["index"].to(self.device, non_blocking=True),
                label=raw["label"].to(self.device, non_blocking=True))
        self.batches.skip = 0


def build(spec: LoaderSpec) -> TorchvisionLoader:
    """Build the torchvision baseline loader for `spec` (see `pipelines.loader.build_loader`).

    Raises:
        TorchvisionBackendError: bad batch size / rank, or records that do not match the manifest.
        schema.DatasetError: a missing, incomplete or damaged dataset (from `read_manifest`).
    """
    if spec.batch_size < 1 or spec.batch_size % 2:
        raise TorchvisionBackendError(f"batch_size must be a positive even number, got {spec.batch_size}")
    if spec.mix.kind != "none" and spec.mix.source != "global":
        raise TorchvisionBackendError(
            f"the torchvision baseline mixes the global views only (mix.source={spec.mix.source!r}); "
            "set mix.source='global' or use the torch, dali or ffcv backend")
    if not 0 <= spec.rank < spec.world_size:
        raise TorchvisionBackendError(f"rank {spec.rank} is outside world_size {spec.world_size}")
    for g in spec.recipe.groups:
        if g.interpolation not in _INTERPOLATION:
            raise TorchvisionBackendError(
                f"group {g.name!r}: interpolation {g.interpolation!r} unknown; use one of {sorted(_INTERPOLATION)}")
    dataset_dir = Path(spec.root) / spec.dataset
    manifest = schema.read_manifest(dataset_dir)        # refuses incomplete or damaged datasets
    if spec.split not in manifest.counts:
        raise TorchvisionBackendError(
            f"dataset {dataset_dir} has no split {spec.split!r}; choose one of {sorted(manifest.counts)}")
    entries = scan_shards(dataset_dir / spec.split)
    if len(entries) != manifest.counts[spec.split]:
        raise TorchvisionBackendError(
            f"{dataset_dir / spec.split} holds {len(entries)} records, the manifest says "
            f"{manifest.counts[spec.split]}; re-run `python -m preprocess` with --force")
    mean, std = tuple(manifest.mean), tuple(manifest.std)
    if spec.drop_last and len(entries) < spec.world_size * spec.batch_size:
        raise TorchvisionBackendError(
            f"{spec.split} split has {len(entries)} records, fewer than world_size × batch_size = "
            f"{spec.world_size * spec.batch_size}; lower the batch size or use drop_last=False")
    return TorchvisionLoader(spec, entries, mean, std)
