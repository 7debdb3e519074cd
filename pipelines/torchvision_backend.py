"""The torchvision baseline: PIL images and torchvision transforms in `torch.utils.data` workers.

This is the pipeline users actually run (DINO, solo-learn, the torchvision reference scripts): each
worker reads one record from the webdataset shards (`pipelines/shards.py`), decodes it with
`PIL.Image.open(...).convert("RGB")` and builds every view of the recipe with torchvision's PIL
transforms, the laws of `pipelines/augment.py`:

    RandomResizedCrop (area, log-uniform ratio, interpolation) → RandomHorizontalFlip → saliency
    background removal (global crops; the mask cropped with the same window and flipped with it) →
    RandomApply(ColorJitter, p) → RandomGrayscale → PIL ImageFilter.GaussianBlur with a random radius
    applied with p (as DINO and solo-learn do) → PIL ImageOps.solarize(threshold=128).

Staged groups (RSA) take the finished view of their parent and apply only their own colour,
grayscale, blur and solarize ops to it: one decode and one crop give both outputs. Views stay uint8
until they reach `spec.device`, where `pipelines.batch.make_batch` mixes and normalises them.

It is the measured baseline of `bench/data.py`; speed tricks that users do not apply (e.g. PIL
draft-mode decoding) are deliberately left out.

Randomness: every sample draws from its own torch generator state seeded by (seed, epoch, index),
so views depend on the seed only, not on the number of workers or the rank layout; the mixes of a
batch draw from a generator seeded per (seed, rank, epoch, batch).
"""

from __future__ import annotations

import io
from typing import Iterator

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
from PIL import Image, ImageFilter, ImageOps
from torch import Tensor

from pipelines.augment import SALIENCY_MIN_COVERAGE, blur_sigma_px
from pipelines.batch import Batch, make_batch, view_bytes
from pipelines.processes import before_fork, iterate, worker_context, worker_started
from pipelines.shards import ShardReader
from pipelines.spec import DatasetInfo, EpochLoader, EpochOrder, LoaderSpec, Stream, derive_seed
from pipelines.views import Recipe, ViewGroup

_INTERPOLATION = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def _coin(p: float) -> bool:
    return p >= 1.0 or (p > 0 and float(torch.rand(())) < p)


class _ColourOps:
    """The colour, grayscale, blur and solarize ops of one group, applied to a PIL view."""

    def __init__(self, g: ViewGroup) -> None:
        self.jitter = None
        if g.jitter_p > 0:
            self.jitter = T.RandomApply([T.ColorJitter(g.brightness, g.contrast, g.saturation, g.hue)], p=g.jitter_p)
        self.gray = T.RandomGrayscale(p=g.gray_p) if g.gray_p > 0 else None
        self.blur_p, self.blur_sigma = g.blur_p, blur_sigma_px(g)
        self.solarize_p = g.solarize_p

    def __call__(self, img: Image.Image) -> Image.Image:
        if self.jitter is not None:
            img = self.jitter(img)
        if self.gray is not None:
            img = self.gray(img)
        if _coin(self.blur_p):
            # DINO / solo-learn: PIL's GaussianBlur with radius (its sigma) drawn uniformly.
            lo, hi = self.blur_sigma
            img = img.filter(ImageFilter.GaussianBlur(radius=lo + (hi - lo) * float(torch.rand(()))))
        if _coin(self.solarize_p):
            img = ImageOps.solarize(img, threshold=128)
        return img


class _CropGroup:
    """Crop, flip, saliency and the colour ops of one group that crops the decoded image itself."""

    def __init__(self, g: ViewGroup) -> None:
        self.group = g
        self.size = [g.size_px, g.size_px]
        self.interpolation = _INTERPOLATION[g.interpolation]
        self.colour = _ColourOps(g)

    def __call__(self, img: Image.Image, mask: Image.Image | None, coverage: float) -> Image.Image:
        g = self.group
        if g.centre_crop > 0:                # evaluation: the central square (augment.crop_boxes)
            h = w = max(1, round(min(img.height, img.width) * g.centre_crop))
            top, left = (img.height - h) // 2, (img.width - w) // 2
        elif _coin(g.crop_p):
            top, left, h, w = T.RandomResizedCrop.get_params(img, list(g.area), list(g.ratio))
        else:
            top, left, h, w = 0, 0, img.height, img.width
        view = F.resized_crop(img, top, left, h, w, self.size, self.interpolation)
        flip = _coin(g.flip_p)
        if flip:
            view = F.hflip(view)
        if g.saliency_p > 0 and mask is not None and coverage >= SALIENCY_MIN_COVERAGE and _coin(g.saliency_p):
            # RELICv2 App. A.2: background → one gray level per view; mask cropped with the same window.
            m = F.resized_crop(mask, top, left, h, w, self.size, Image.BILINEAR)
            m = F.hflip(m) if flip else m
            level = int(torch.randint(0, 256, ()))
            background = Image.new("RGB", view.size, (level, level, level))
            view = Image.composite(view, background, m.point(lambda v: 255 if v >= 128 else 0))
        return self.colour(view)


def _to_uint8_chw(img: Image.Image) -> Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # (3, H, W)


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over the shards; item = (dataset index, per-sample seed)."""

    def __init__(self, reader: ShardReader, recipe: Recipe, masks: bool) -> None:
        self.reader, self.recipe, self.masks = reader, recipe, masks
        self.crops = {g.name: _CropGroup(g) for g in recipe.crop_groups}
        self.staged = {g.name: _ColourOps(g) for g in recipe.by_role("staged")}

    def __len__(self) -> int:
        return len(self.reader)

    def decode(self, data: bytes) -> Image.Image:
        """The RGB image of encoded bytes, as the users' pipelines decode it (PIL, libjpeg-turbo)."""
        return Image.open(io.BytesIO(data)).convert("RGB")

    def render(self, i: int, seed: int) -> dict[str, Tensor]:
        """{group name: (count, 3, S, S) uint8} views of record i with the draws of `seed`."""
        torch.manual_seed(seed)
        img = self.decode(self.reader.image(i))
        data = self.reader.mask(i) if self.masks else None
        mask = Image.open(io.BytesIO(data)).convert("L") if data is not None else None
        coverage = float(self.reader.coverage[i])
        done = {g.name: [self.crops[g.name](img, mask, coverage) for _ in range(g.count)]
                for g in self.recipe.crop_groups}
        for g in self.recipe.by_role("staged"):
            done[g.name] = [self.staged[g.name](v) for v in done[g.parent]]
        return {name: torch.stack([_to_uint8_chw(v) for v in pil]) for name, pil in done.items()}

    def __getitem__(self, item: tuple[int, int]) -> dict:
        i, seed = item
        if torch.utils.data.get_worker_info() is None:
            # In the training process itself: keep its global RNG stream untouched.
            with torch.random.fork_rng(devices=[]):
                views = self.render(i, seed)
        else:
            views = self.render(i, seed)
        return {"views": views, "index": int(self.reader.indices[i]), "label": int(self.reader.labels[i])}


class _Batches:
    """Batch sampler: the rest of the epoch of `order`, as lists of (index, per-sample seed)."""

    def __init__(self, order: EpochOrder) -> None:
        self.order = order

    def __len__(self) -> int:
        return len(self.order.remaining())

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s, epoch = self.order.spec, self.order.epoch
        for _, idx in self.order.remaining():
            yield [(int(i), derive_seed(s.seed, epoch, Stream.TORCHVISION_VIEWS, int(i))) for i in idx]


def collate(items: list[dict]) -> dict:
    """Stack rendered samples into one raw batch: views {group: (count, B, 3, S, S) uint8}, index, label."""
    names = items[0]["views"]
    return {"views": {n: torch.stack([it["views"][n] for it in items], dim=1) for n in names},  # (count, B, 3, S, S)
            "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
            "label": torch.tensor([it["label"] for it in items], dtype=torch.long)}


def shared_memory_bytes(spec: LoaderSpec, info: DatasetInfo) -> int:
    """/dev/shm a loader of `spec` fills at most: each worker hands its collated uint8 views over in
    shared memory, DataLoader's default of 2 batches at a time."""
    return spec.num_workers * 2 * spec.batch_size * view_bytes(spec.recipe, spec.mix, itemsize=1)


class TorchvisionLoader(EpochLoader):
    """PIL + torchvision loader for one rank (see `pipelines.spec.Loader`)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo) -> None:
        self.spec, self.info = spec, info
        self.order = EpochOrder(spec, info.count)
        reader = ShardReader.open(info.dir / spec.split, info.count)
        masks = info.reads_masks(spec.recipe)
        self.device = torch.device(spec.device)
        self.loader = torch.utils.data.DataLoader(
            ShardDataset(reader, spec.recipe, masks), batch_sampler=_Batches(self.order),
            num_workers=spec.num_workers, collate_fn=collate, pin_memory=self.device.type == "cuda",
            persistent_workers=spec.num_workers > 0, worker_init_fn=worker_started,
            multiprocessing_context=worker_context(__name__) if spec.num_workers > 0 else None)

    def __iter__(self) -> Iterator[Batch]:
        s, o = self.spec, self.order
        if s.num_workers > 0:
            before_fork()          # the first epoch forks the (persistent) workers
        for raw in iterate(self.loader):
            gen = torch.Generator().manual_seed(o.batch_seed(o.batches_done, Stream.TORCHVISION_MIXES))
            batch = make_batch(raw["views"], s.recipe, s.mix, gen, self.info.mean, self.info.std,
                               raw["index"], raw["label"], self.device)
            o.advance()
            yield batch

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)    # the persistent workers' iterator, once they started
        if it is not None:
            it._shutdown_workers()
            self.loader._iterator = None


def build(spec: LoaderSpec, info: DatasetInfo) -> TorchvisionLoader:
    """The torchvision baseline loader of `spec` (called by `pipelines.loader.build_loader`).

    Raises:
        schema.DatasetError: shards missing or not matching the manifest.
    """
    return TorchvisionLoader(spec, info)
