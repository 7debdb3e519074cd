"""The registry of dataset sources: what each needs, which parameters it takes, how it is read.

    SOURCES["synthetic"]     generated from a seed, with exact foreground masks (preprocess/synthetic.py)
    SOURCES["cifar10"]       --src: the official python-version batches (preprocess/cifar.py)
    SOURCES["cifar100"]      --src: the same, fine labels
    SOURCES["imagefolder"]   --src: SRC/train|val/<class>/*, or unlabelled: any folder of images or a
                             file listing image paths (preprocess/imagefolder.py)

`Source.prepare` checks the parameters and the source folder. A source held in memory (synthetic,
CIFAR) is then made or read in one parallel pass per split (mean/std, ground-truth masks) and
returned as a `PreparedSource`: the splits both writers read and the facts the manifest records. An
image folder is only listed (`ListedSource`); `preprocess/stream.py` reads each file once while
writing. The CLI builds its per-source options from `Source.params`; nothing else branches on a
dataset name.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipelines import schema
from pipelines.processes import fork_context
from preprocess import cifar, imagefolder, synthetic
from preprocess.progress import bar as progress_bar
from preprocess.records import ArraySplit, PreparedSplit, mean_std, pixel_sums

_CHUNK = 256                    # records per worker task in the synthetic check pass


class PreprocessError(ValueError):
    """Bad arguments or a failed write; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Param:
    """One source parameter: a keyword of `prepare_dataset` and the CLI option `--<name-with-dashes>`."""

    name: str                                  # keyword, manifest `params` key and argparse dest
    default: Any
    type: type = int                           # int | float | str | Path | bool (bool: a flag, default False)
    help: str | None = None                    # CLI help
    choices: tuple[str, ...] | None = None     # the CLI accepts only these

    @property
    def flag(self) -> str:
        """The CLI option, e.g. `--train-size`."""
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class PreparedSource:
    """A source read and checked: the splits both writers consume and the facts of the manifest."""

    splits: dict[str, PreparedSplit]           # schema.SPLITS -> records
    params: dict                               # recorded in the manifest: defaults filled in, paths resolved
    class_names: tuple[str, ...]
    image_px: int                              # largest stored image side, px
    mean: tuple[float, float, float]           # per-channel mean of the train split, [0, 1] units
    std: tuple[float, float, float]            # per-channel std of the train split, [0, 1] units
    size_policy: dict | None = None            # {"side", "max_side_px"} when images were resized
    skipped: tuple[dict, ...] = ()             # unreadable files: {"path" (relative to src), "reason"}
    gt_masks: dict[str, np.ndarray] = field(default_factory=dict)   # split -> (N, H, W) uint8 exact masks
    mask_source: str | None = None             # what the records' masks are, None without masks
    stored: dict = field(default_factory=dict) # split -> {"as_is", "re_encoded"}: JPEGs kept byte for byte


@dataclass(frozen=True)
class ListedSource:
    """A source written in one streamed pass (`preprocess/stream.py`): its files, listed, not yet read."""

    src: Path
    files: dict[str, list[tuple[str, int]]]    # split -> [(path, label)], sorted
    class_names: tuple[str, ...]
    params: dict                               # recorded in the manifest
    policy: dict                               # size policy: {"max_side", "side"}


def _no_check(params: dict) -> None:
    return None


def _as_given(params: dict, src: Path | None) -> dict:
    return params


@dataclass(frozen=True)
class Source:
    """One dataset source and its facts.

    `read(src, params, workers=, progress=)` gets checked parameters (defaults filled in) and, when
    `needs_src`, a checked readable folder.
    """

    name: str
    read: Callable[..., PreparedSource]
    needs_src: bool = False                    # --src is required and must be a readable folder
    src_file_ok: bool = False                  # ... or a readable file (a list of image paths)
    lists_src: bool = False                    # it reads whatever lies under --src: no dataset may be written there
    params: tuple[Param, ...] = ()
    check: Callable[[dict], None] = _no_check  # raises PreprocessError on a bad parameter value
    # The parameters as they act on `src` (an option whose default picks by the source: imagefolder's
    # `--labels auto`), so that a dataset written with `folders` is the one `auto` asks for there.
    acting: Callable[[dict, Path | None], dict] = _as_given

    @property
    def defaults(self) -> dict[str, Any]:
        """{parameter name: default}."""
        return {p.name: p.default for p in self.params}

    def resolve(self, params: dict) -> dict:
        """`params` with defaults filled in, checked.

        Raises:
            PreprocessError: an option this source does not take, or a bad value.
        """
        extra = sorted(set(params) - set(self.defaults))
        if extra:
            raise PreprocessError(f"unknown option(s) {', '.join(extra)} for {self.name}; valid: "
                                  f"{', '.join(sorted(self.defaults)) or 'none'}")
        resolved = {**self.defaults, **params}
        self.check(resolved)
        return resolved

    def prepare(self, src: Path | None, params: dict, *, workers: int, progress: bool
                ) -> PreparedSource | ListedSource:
        """Check the parameters and the source folder, then read every split (see the module docstring).

        Args:
            src: the source folder; ignored unless `needs_src`.
            params: source parameters by name (missing ones take their defaults).
            workers: parallel processes (>= 1).
            progress: show progress (`preprocess.progress`: a bar on a terminal, a line a minute in a log).

        Raises:
            PreprocessError, CifarError, ImageFolderError (all ValueError): bad input, one-line message.
        """
        resolved = self.resolve(params)
        if self.needs_src:
            src = _check_src(self.name, src, self.src_file_ok)
        return self.read(src, resolved, workers=workers, progress=progress)


def _check_src(dataset: str, src: Path | None, file_ok: bool = False) -> Path:
    if src is None:
        raise PreprocessError(f"--src is required for {dataset}: pass the folder holding the data")
    src = Path(src)
    if not src.exists():
        raise PreprocessError(f"source path {src} does not exist: pass --src with the folder holding "
                              f"the {dataset} data")
    if file_ok and src.is_file():
        if not os.access(src, os.R_OK):
            raise PreprocessError(f"source file {src} is not readable: fix its permissions (chmod u+r)")
        return src
    if not src.is_dir():
        raise PreprocessError(f"source path {src} is not a folder: pass --src with the folder holding "
                              f"the {dataset} data")
    if not os.access(src, os.R_OK | os.X_OK):
        raise PreprocessError(f"source folder {src} is not readable: fix its permissions (chmod u+rx) "
                              "or copy the data somewhere readable")
    return src


def _mean_std(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std in [0, 1] units of (N, H, W, 3) uint8 images."""
    return mean_std(sum(pixel_sums(images[a:a + 1024]) for a in range(0, len(images), 1024)))


# ------------------------------------------------------------------------------------------------
# synthetic
# ------------------------------------------------------------------------------------------------

def _check_synthetic(p: dict) -> None:
    for k in ("train_size", "val_size", "image_px", "seed"):
        if not isinstance(p[k], (int, np.integer)) or isinstance(p[k], bool):
            raise PreprocessError(f"synthetic option {k} must be an integer, got {p[k]!r}")
    if p["train_size"] < 1 or p["val_size"] < 1:
        raise PreprocessError("synthetic --train-size and --val-size must be >= 1")
    if not 16 <= p["image_px"] <= 1024:
        raise PreprocessError(f"synthetic --image-px must be in [16, 1024], got {p['image_px']}")


def _synthetic_chunk(args: tuple[synthetic.SyntheticSplit, int, int]) -> tuple[int, np.ndarray, np.ndarray]:
    split, a, b = args
    images = np.empty((b - a, split.image_px, split.image_px, 3), np.uint8)
    masks = np.empty((b - a, split.image_px, split.image_px), np.uint8)
    for j, i in enumerate(range(a, b)):
        bg, obj, inside = split.render(i)
        images[j] = np.where(inside[..., None], obj, bg)
        masks[j] = inside.astype(np.uint8) * 255
    return a, images, masks


def _generate_synthetic(split: synthetic.SyntheticSplit, workers: int, progress: bool
                        ) -> tuple[np.ndarray, np.ndarray]:
    """All images (N, H, W, 3) and exact masks (N, H, W) of a synthetic split, in parallel.

    Generating once and handing arrays to both writers costs one generation instead of three.
    """
    n, px = len(split), split.image_px
    images = np.empty((n, px, px, 3), np.uint8)
    masks = np.empty((n, px, px), np.uint8)
    jobs = [(split, a, min(a + _CHUNK, n)) for a in range(0, n, _CHUNK)]
    with progress_bar(n, f"generate {split.split}", progress) as bar:
        if workers <= 1 or len(jobs) == 1:
            results = map(_synthetic_chunk, jobs)
            pool = None
        else:
            pool = fork_context().Pool(min(workers, len(jobs)))
            results = pool.imap_unordered(_synthetic_chunk, jobs)
        try:
            for a, im, m in results:
                images[a:a + len(im)] = im
                masks[a:a + len(m)] = m
                bar.update(len(im))
        finally:
            if pool is not None:
                pool.terminate()
    return images, masks


def _read_synthetic(src: Path | None, p: dict, *, workers: int, progress: bool) -> PreparedSource:
    p = {**p, **{k: int(p[k]) for k in ("train_size", "val_size", "image_px", "seed")}}
    splits, gt_masks = {}, {}
    for split in schema.SPLITS:
        gen = synthetic.SyntheticSplit(p[f"{split}_size"], seed=p["seed"], split=split,
                                       image_px=p["image_px"])
        images, masks = _generate_synthetic(gen, workers, progress)
        splits[split] = ArraySplit(images, gen.labels.copy(), masks if p["gt_masks_as_mask"] else None)
        gt_masks[split] = masks
    mean, std = _mean_std(splits["train"].images)
    return PreparedSource(splits=splits, params=p, class_names=synthetic.CLASS_NAMES, image_px=p["image_px"],
                          mean=mean, std=std, gt_masks=gt_masks,
                          mask_source="synthetic_ground_truth" if p["gt_masks_as_mask"] else None)


# ------------------------------------------------------------------------------------------------
# cifar10, cifar100
# ------------------------------------------------------------------------------------------------

def _read_cifar(dataset: str, src: Path, p: dict, *, workers: int, progress: bool) -> PreparedSource:
    splits, names = cifar.load_cifar(dataset, src)
    mean, std = _mean_std(splits["train"].images)
    return PreparedSource(splits=splits, params={"src": str(src.resolve())}, class_names=tuple(names),
                          image_px=32, mean=mean, std=std)


# ------------------------------------------------------------------------------------------------
# imagefolder
# ------------------------------------------------------------------------------------------------

def _check_imagefolder(p: dict) -> None:
    if p["side"] not in imagefolder.SIDES:
        raise PreprocessError(f"unknown --side {p['side']!r}; use one of {', '.join(imagefolder.SIDES)}")
    if int(p["max_side"]) < 0:
        raise PreprocessError(f"--max-side must be >= 0 (0: keep the size), got {p['max_side']}")
    if p["labels"] not in imagefolder.LABELS:
        raise PreprocessError(f"unknown --labels {p['labels']!r}; use one of {', '.join(imagefolder.LABELS)}")
    if not 0 < float(p["val_fraction"]) <= 0.5:
        raise PreprocessError(f"--val-fraction is the share of images held out, in (0, 0.5]; got {p['val_fraction']}"
                              f" (default {imagefolder.VAL_FRACTION})")


def _imagefolder_acting(p: dict, src: Path | None) -> dict:
    return {**p, "labels": imagefolder.labels_of(src, p["labels"])} if src is not None and "labels" in p else p


def _list_imagefolder(src: Path, p: dict, *, workers: int, progress: bool) -> ListedSource:
    class_list = Path(p["class_list"]) if p["class_list"] else None
    if p["labels"] == "auto" and imagefolder.labels_of(src, "auto") == "none" and (n := imagefolder.class_folders(src)):
        print(f"{src} is read as unlabelled images (--labels auto takes class folders from SRC/train/ only); "
              f"if its {n} sub-folders are classes, give --labels folders to keep them as labels", flush=True)
    names, files = imagefolder.list_images(src, p["labels"], class_list, float(p["val_fraction"]), int(p["val_seed"]))
    params = {**p, "src": str(src.resolve()), "class_list": str(class_list.resolve()) if class_list else None}
    return ListedSource(src=src, files=files, class_names=tuple(names), params=params,
                        policy={"max_side": int(p["max_side"]), "side": p["side"]})


# ------------------------------------------------------------------------------------------------
# The registry.
# ------------------------------------------------------------------------------------------------

SOURCES: dict[str, Source] = {
    "synthetic": Source("synthetic", _read_synthetic, check=_check_synthetic, params=(
        Param("train_size", 10_000),
        Param("val_size", 2_000),
        Param("image_px", 64),
        Param("seed", 0),
        Param("gt_masks_as_mask", False, bool,
              help="store the ground-truth masks in the mask field (tests of the view pipelines)"),
    )),
    "cifar10": Source("cifar10", functools.partial(_read_cifar, "cifar10"), needs_src=True),
    "cifar100": Source("cifar100", functools.partial(_read_cifar, "cifar100"), needs_src=True),
    "imagefolder": Source("imagefolder", _list_imagefolder, needs_src=True, src_file_ok=True, lists_src=True,
                          check=_check_imagefolder, acting=_imagefolder_acting, params=(
        Param("max_side", schema.MAX_SIDE_PX,
              help="cap of the chosen side in px, only downscaling (0: keep sizes)"),
        Param("side", "longer", str, choices=imagefolder.SIDES),
        Param("class_list", None, Path, help="file with one class folder name per line (ImageNet-100)"),
        Param("labels", "auto", str, choices=imagefolder.LABELS,
              help="folders: SRC/train/<class>/* (with or without SRC/val/<class>/*) or SRC/<class>/*; none: any "
                   "images under SRC (or a list file), unlabelled; auto: folders when SRC/train/ exists"),
        Param("val_fraction", imagefolder.VAL_FRACTION, float,
              help="without SRC/val/: share held out as the val split, of each class when labelled (at least "
                   f"{imagefolder.VAL_MIN} images when there are 10x as many)"),
        Param("val_seed", 0, help="seed of the held-out draw"),
    )),
}
DATASETS = tuple(SOURCES)
