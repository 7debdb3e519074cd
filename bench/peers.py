"""The loaders users would pick instead of viewmill, timed beside its backends on the same files.

    loader = build("lightly", spec, work)       # or "spdl"; any other name: pipelines.loader.build_loader
    loader.set_epoch(1); for batch in loader: batch.batch_size

- `lightly` (PyPI `lightly`, the transforms LightlyTrain also uses): lightly's multi-view transform in
  a torch `DataLoader` over an image folder, as lightly's documentation sets it up (`LightlyDataset`,
  shuffle, default collate, `num_workers` = the bench's cores): `DINOTransform` for `multicrop8`,
  `BYOLTransform` for `byol`, and for any other recipe without staged views one `BYOLView1Transform`
  per view (lightly's most general single view: crop, flip, jitter, grayscale, blur, solarize), each
  with the recipe's sizes, crop areas and colour law. What lightly cannot express is listed in
  `settings` (its crops go up to the whole image; no saliency background removal; no intra-batch
  mixes, so a recipe with a mix is skipped). Views come out normalised float, made in the workers.
- `spdl` (PyPI `spdl`, Meta's thread pipelines): a `spdl.pipeline` over the shard records: read,
  decode with `spdl.io.load_image` (FFmpeg), then the torchvision baseline's transforms of the recipe
  (`pipelines.torchvision_backend`), `concurrency` = cores threads as SPDL's ImageNet example sets it,
  aggregated into batches that `pipelines.batch.make_batch` mixes and normalises as every backend.
  Its views are random but, drawn from one generator by concurrent threads, not reproducible.

The image folder lightly reads holds the shard records' own bytes (`image_folder`), so every loader
decodes the same files. A peer that is not installed, or that has no composition for a recipe, is
`PeerSkip` with a one-line reason; the benches report it as skipped.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Iterator

import torch

from pipelines.augment import blur_sigma_px
from pipelines.batch import Batch, make_batch
from pipelines.loader import build_loader
from pipelines.processes import before_fork
from pipelines.shards import ShardReader
from pipelines.spec import DatasetInfo, EpochOrder, LoaderSpec, Stream, derive_seed
from pipelines.views import Recipe, ViewGroup

PEERS = {"lightly": "lightly", "spdl": "spdl"}      # peer name -> the PyPI distribution it times
JPEG_MAGIC = b"\xff\xd8"


class PeerSkip(Exception):
    """A peer that cannot run this cell (not installed, or no composition for the recipe), with why."""


def version(peer: str) -> str | None:
    """The installed version of the peer's distribution, or None."""
    try:
        return importlib.metadata.version(PEERS[peer])
    except importlib.metadata.PackageNotFoundError:
        return None


def check(peer: str, recipe: Recipe, mix_kind: str) -> str:
    """The peer's settings for this cell, in one line.

    Raises:
        PeerSkip: the peer is not installed, or cannot make this recipe or mix.
    """
    if importlib.util.find_spec(peer) is None:           # each peer's module is named as its distribution
        raise PeerSkip(f"{peer} is not installed (pip install 'viewmill[peers]'; make install-test installs it)")
    if peer == "spdl":
        return (f"spdl {version(peer)}: spdl.io.load_image decode + the torchvision baseline's transforms, "
                "one pipe stage with concurrency = cores threads, batches made and normalised by make_batch")
    if mix_kind != "none":
        raise PeerSkip("lightly has no intra-batch mixes")
    if recipe.by_role("staged"):
        raise PeerSkip("lightly has no staged (weak -> aggressive) views")
    return f"lightly {version(peer)}: {_lightly_name(recipe)} in a DataLoader over the image folder; " + \
        "; ".join(_lightly_differences(recipe))


BATCH_WORKERS = ("torch", "torchvision", "lightly")    # loaders whose DataLoader workers each make whole batches


def batch_workers(loader: str, cores: int) -> int:
    """How many processes of `loader` (a backend, optionally `name@device`, or a peer) each make whole
    batches (`bench.timing.time_loader`'s `workers`): its `cores` DataLoader workers, or 0."""
    return cores if loader.partition("@")[0] in BATCH_WORKERS else 0


def row_fields(loader: str, recipe: Recipe, mix_kind: str) -> dict[str, str]:
    """What a bench row of `loader` (a backend, optionally `name@device`, or a peer) starts with: a
    peer's `settings`, or `status` "skipped" with its `note`; nothing for a backend."""
    name = loader.partition("@")[0]
    if name not in PEERS:
        return {}
    try:
        return {"settings": check(name, recipe, mix_kind)}
    except PeerSkip as skip:
        return {"status": "skipped", "note": str(skip)}


# ----------------------------------------------------------------------------- lightly


def _dino_shaped(recipe: Recipe) -> bool:
    g = recipe.groups
    return recipe.name.startswith("multicrop") and len(g) == 2 and g[0].count == 2


def _lightly_name(recipe: Recipe) -> str:
    if _dino_shaped(recipe):
        return "DINOTransform"
    if recipe.name == "byol" and len(recipe.groups) == 2:
        return "BYOLTransform"
    return f"MultiViewTransform of {sum(g.count for g in recipe.groups)} BYOLView1Transforms"


def _lightly_differences(recipe: Recipe) -> list[str]:
    out = []
    if not _dino_shaped(recipe) and any(g.area[1] < 1.0 for g in recipe.groups):
        out.append("crop areas up to the whole image (lightly's BYOL views have no upper bound)")
    if any(g.saliency_p > 0 for g in recipe.groups):
        out.append("no saliency background removal")
    return out or ["the recipe's crops and colour law"]


def _byol_view(g: ViewGroup):
    from lightly.transforms import BYOLView1Transform
    return BYOLView1Transform(
        input_size=g.size_px, cj_prob=g.jitter_p, cj_strength=1.0, cj_bright=g.brightness,
        cj_contrast=g.contrast, cj_sat=g.saturation, cj_hue=g.hue, min_scale=g.area[0],
        random_gray_scale=g.gray_p, gaussian_blur=g.blur_p, solarization_prob=g.solarize_p,
        sigmas=blur_sigma_px(g), hf_prob=g.flip_p)


def lightly_transform(recipe: Recipe):
    """lightly's transform for `recipe` (module docstring): a callable PIL image -> list of views."""
    from lightly.transforms import BYOLTransform, DINOTransform
    from lightly.transforms.multi_view_transform import MultiViewTransform
    if _dino_shaped(recipe):
        g, loc = recipe.groups
        return DINOTransform(
            global_crop_size=g.size_px, global_crop_scale=tuple(g.area), local_crop_size=loc.size_px,
            local_crop_scale=tuple(loc.area), n_local_views=loc.count, hf_prob=g.flip_p, cj_prob=g.jitter_p,
            cj_strength=1.0, cj_bright=g.brightness, cj_contrast=g.contrast, cj_sat=g.saturation, cj_hue=g.hue,
            random_gray_scale=g.gray_p, gaussian_blur=(g.blur_p, g.blur_p, loc.blur_p),
            sigmas=blur_sigma_px(g), solarization_prob=g.solarize_p)
    if _lightly_name(recipe) == "BYOLTransform":
        a, b = recipe.groups
        return BYOLTransform(view_1_transform=_byol_view(a), view_2_transform=_byol_view(b))
    return MultiViewTransform([_byol_view(g) for g in recipe.groups for _ in range(g.count)])


def image_folder(spec: LoaderSpec, info: DatasetInfo, work: Path) -> Path:
    """`work/<dataset>-<split>/`: every record's encoded bytes as a file named by its index (once)."""
    folder = Path(work) / f"{spec.dataset}-{spec.split}"
    done = folder / ".complete"
    if done.exists() and done.read_text() == str(info.count):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    reader = ShardReader.open(info.dir / spec.split, info.count)
    for i in range(len(reader)):
        data = reader.image(i)
        suffix = ".jpg" if data[:2] == JPEG_MAGIC else ".png"
        (folder / f"{i:08d}{suffix}").write_bytes(data)
    done.write_text(str(info.count))
    return folder


class PeerBatch:
    """What a peer yields: its views as it makes them, and the batch size the benches count."""

    def __init__(self, views, batch_size: int) -> None:
        self.views, self.batch_size = views, batch_size


class LightlyLoader:
    """lightly's transform in a torch DataLoader over `image_folder`, one epoch per iteration."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo, work: Path) -> None:
        from lightly.data import LightlyDataset
        self.spec, self.epoch = spec, 0
        folder = image_folder(spec, info, work)
        files = sorted(p.name for p in folder.iterdir() if p.suffix in (".jpg", ".png"))
        chosen = [files[i] for i in EpochOrder(spec, len(files)).records]     # `spec.limit`, as every loader
        self.dataset = LightlyDataset(str(folder), transform=lightly_transform(spec.recipe), filenames=chosen)

    def __len__(self) -> int:
        return len(self.dataset) // self.spec.batch_size          # batches per epoch (`drop_last`)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[PeerBatch]:
        s = self.spec
        if s.num_workers > 0:
            before_fork()           # its workers, as every process a bench starts, end with it
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=s.batch_size, shuffle=True, drop_last=True, num_workers=s.num_workers,
            generator=torch.Generator().manual_seed(s.seed * 1000 + self.epoch))
        for views, _, _ in loader:
            yield PeerBatch([v.to(s.device) for v in views], len(views[0]))


# ----------------------------------------------------------------------------- SPDL


class SPDLLoader:
    """An SPDL thread pipeline: decode with spdl.io, the torchvision baseline's views, make_batch."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo) -> None:
        from pipelines.torchvision_backend import ShardDataset
        import spdl.io

        class _Decoded(ShardDataset):
            def decode(self, data: bytes):
                from PIL import Image
                return Image.fromarray(spdl.io.to_numpy(spdl.io.load_image(data)))

        self.spec, self.info = spec, info
        self.order = EpochOrder(spec, info.count)
        reader = ShardReader.open(info.dir / spec.split, info.count)
        self.dataset = _Decoded(reader, spec.recipe, info.reads_masks(spec.recipe))
        self.device = torch.device(spec.device)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        from spdl.pipeline import PipelineBuilder
        from pipelines.torchvision_backend import collate
        s, o = self.spec, self.order
        items = [(int(i), derive_seed(s.seed, o.epoch, Stream.TORCHVISION_VIEWS, int(i)))
                 for i in o.indices()[: len(o) * s.batch_size]]
        pipeline = (PipelineBuilder().add_source(items)
                    .pipe(self.dataset.__getitem__, concurrency=s.num_workers)
                    .aggregate(s.batch_size, drop_last=True)
                    .pipe(collate)
                    .add_sink(3)
                    .build(num_threads=s.num_workers))
        with pipeline.auto_stop():
            for b, raw in enumerate(pipeline.get_iterator(timeout=600)):
                gen = torch.Generator().manual_seed(o.batch_seed(b, Stream.TORCHVISION_MIXES))
                yield make_batch(raw["views"], s.recipe, s.mix, gen, self.info.mean, self.info.std,
                                 raw["index"], raw["label"], self.device)


# ----------------------------------------------------------------------------- dispatch


def build(name: str, spec: LoaderSpec, work: Path):
    """The loader `name` of `spec`: a peer (`PEERS`) or one of viewmill's backends.

    Raises:
        PeerSkip: a peer that is not installed or cannot make `spec`'s recipe or mix.
    """
    if name not in PEERS:
        return build_loader(name, spec)
    check(name, spec.recipe, spec.mix.kind)
    info = DatasetInfo.read(spec.root, spec.dataset, spec.split)
    return LightlyLoader(spec, info, work) if name == "lightly" else SPDLLoader(spec, info)

