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
- `dali-plain` (DALI itself, as users write a multi-crop pipeline, e.g. solo-learn's): DALI's own
  `fn.readers.webdataset` over the shards (shuffled, one reader), the decoder on the spec's device, then
  per view `fn.random_resized_crop`, and each random op drawn in the graph and applied to every sample,
  its probability an arithmetic mux of the op's output and its input with a coin flip (colour jitter by
  `fn.color_twist`, grayscale as `fn.hsv` with a saturation of 0 or 1, `fn.gaussian_blur` of a random
  sigma, solarize), the flip folded into `fn.crop_mirror_normalize`; read through DALI's PyTorch
  iterator. What it leaves out is in `settings` (saliency, staged views, mixes).

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

PEERS = {"lightly": "lightly", "spdl": "spdl", "dali-plain": "nvidia-dali-cuda130"}   # peer -> the distribution it times
MODULES = {"dali-plain": "nvidia.dali"}            # a peer's module, where it is not named as its distribution
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
    module = MODULES.get(peer, peer)
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        extra = "dali" if peer == "dali-plain" else "peers"
        raise PeerSkip(f"{peer} is not installed (pip install 'viewmill[{extra}]'; make install-test installs it)")
    if peer == "dali-plain":
        if mix_kind != "none" or recipe.by_role("staged"):
            raise PeerSkip("the plain DALI pipeline has no intra-batch mixes or staged views")
        return ("DALI " + str(version(peer)) + ": fn.readers.webdataset, per view fn.random_resized_crop and every "
                "random op on every sample muxed by a coin flip (color_twist, hsv, gaussian_blur, solarize)"
                + ("; no saliency background removal" if any(g.saliency_p > 0 for g in recipe.groups) else ""))
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


# ----------------------------------------------------------------------------- plain DALI


def _mux(coin, a, b):
    """Arithmetic mux on uint8 views, as plain DALI pipelines write a random op: coin · a + (1 - coin) · b."""
    from nvidia.dali import fn, types

    return fn.cast(coin * a + (1 - coin) * b, dtype=types.UINT8)


def plain_dali_pipeline(spec: LoaderSpec, info: DatasetInfo, device_id: int | None):
    """The DALI pipeline of the `dali-plain` peer (module docstring); outputs: every view, normalised, CHW."""
    from nvidia.dali import fn, pipeline_def, types

    split = info.dir / spec.split
    shards = sorted(str(p) for p in split.glob("shard-*.tar"))
    gpu = device_id is not None
    mean, std = [255 * m for m in info.mean], [255 * s for s in info.std]

    @pipeline_def(batch_size=spec.batch_size, num_threads=max(1, spec.num_workers), device_id=device_id,
                  seed=spec.seed + 1)
    def pipe():
        jpegs = fn.readers.webdataset(paths=shards, index_paths=[p.replace(".tar", ".idx") for p in shards],
                                      ext=["jpg;png"], random_shuffle=True, name="reader")
        images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        out = []
        for g in spec.recipe.groups:
            for _ in range(g.count):
                x = fn.random_resized_crop(images, size=[g.size_px, g.size_px], random_area=list(g.area),
                                           random_aspect_ratio=list(g.ratio))
                if g.jitter_p > 0:
                    jittered = fn.color_twist(
                        x, brightness=fn.random.uniform(range=[1 - g.brightness, 1 + g.brightness]),
                        contrast=fn.random.uniform(range=[1 - g.contrast, 1 + g.contrast]),
                        saturation=fn.random.uniform(range=[1 - g.saturation, 1 + g.saturation]),
                        hue=fn.random.uniform(range=[-360 * g.hue, 360 * g.hue]))
                    x = _mux(fn.random.coin_flip(probability=g.jitter_p), jittered, x)
                if g.gray_p > 0:
                    keep = fn.cast(fn.random.coin_flip(probability=1 - g.gray_p), dtype=types.FLOAT)
                    x = fn.hsv(x, saturation=keep)                                  # 0: grayscale
                if g.blur_p > 0:
                    sigma = fn.random.uniform(range=list(blur_sigma_px(g)))
                    x = _mux(fn.random.coin_flip(probability=g.blur_p), fn.gaussian_blur(x, sigma=sigma), x)
                if g.solarize_p > 0:
                    inverted = fn.cast(255 - x, dtype=types.UINT8)
                    solar = _mux(x >= 128, inverted, x)
                    x = _mux(fn.random.coin_flip(probability=g.solarize_p), solar, x)
                out.append(fn.crop_mirror_normalize(x, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                                                    mirror=fn.random.coin_flip(probability=g.flip_p)))
        return tuple(out)

    return pipe()


class PlainDaliLoader:
    """The `dali-plain` peer through DALI's PyTorch iterator, one epoch (whole batches) per iteration."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo) -> None:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.spec = spec
        device = torch.device(spec.device)
        index = (device.index or 0) if device.type == "cuda" else None
        self.pipe = plain_dali_pipeline(spec, info, index)
        names = [f"view{k}" for k in range(sum(g.count for g in spec.recipe.groups))]
        self.it = DALIGenericIterator(self.pipe, names, reader_name="reader", last_batch_policy=LastBatchPolicy.DROP,
                                      auto_reset=True)

    def __len__(self) -> int:
        return len(self.it)

    def set_epoch(self, epoch: int) -> None:
        """The reader reshuffles each epoch itself."""

    def __iter__(self) -> Iterator[PeerBatch]:
        device = torch.device(self.spec.device)
        for out in self.it:
            views = [t.to(device, non_blocking=True) for t in out[0].values()]
            yield PeerBatch(views, len(views[0]))


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
    if name == "dali-plain":
        return PlainDaliLoader(spec, info)
    return LightlyLoader(spec, info, work) if name == "lightly" else SPDLLoader(spec, info)

