"""The data the benches measure on: generated ImageNet-like JPEGs, and the datasets written from them.

    write_images(src, train=2000, val=200)                    # src/{train,val}/class000/*.jpg, cached
    root, name = prepare("imagenet-like", work, n=2000, quick=False, cores=2)   # a written dataset

`write_images` is the one image generator of the benches (the loader bench, `make profile`, the GPU
check and the preprocessing bench): textured scenes, a smooth colour field with a few discs and fine
grain at two scales, at about `size_px` (each side drawn within ±15 %, one image in four portrait),
saved as JPEG at `schema.JPEG_QUALITY`, so that a file's size and decode cost are those of a photo.
Each image's draws come from (seed, split, index) alone, so any number of worker processes writes the
same bytes. `mixed=True` adds what a real folder brings, drawn per image: 30 % large (the longer side
700–1,000 px), 5 % PNG, 5 % grayscale and 3 % CMYK JPEGs.

`prepare` writes a bench dataset under `work/data` once and reuses it: `imagenet-like` (the generated
folder through preprocessing's image-folder source) or `synthetic`, with
`preprocess.prepare.prepare_dataset` in this process. Each preprocessing run is appended to
`work/preprocess.log` as its `python -m preprocess` command line, followed by what it printed.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines import schema
from pipelines.schema import DatasetError
from pipelines.processes import fork_context
from preprocess.prepare import prepare_dataset, summary

DATASETS = ("imagenet-like", "synthetic")
IMAGE_PX = (500, 375)               # (W, H), the ImageNet average is about 400×350 after decode
QUICK_IMAGE_PX = (96, 72)
CLASSES = 10
VIEW_PX = {"imagenet-like": (224, 96), "synthetic": (64, 32)}   # (global, local) views of each dataset
QUICK_VIEW_PX = (32, 16)
MIXED_SHARES = {"large": 0.30, "png": 0.05, "gray": 0.05, "cmyk": 0.03}   # of `mixed` folders, per image


class BenchError(ValueError):
    """Bad benchmark arguments or a dataset that could not be prepared, with the fix."""


def view_px(dataset: str, quick: bool) -> tuple[int, int]:
    """(global, local) view size in px the benches use on `dataset` (tiny ones with `quick`)."""
    return QUICK_VIEW_PX if quick else VIEW_PX[dataset]


# ----------------------------------------------------------------------------- images


def scene(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A textured scene: smooth colour field, a few discs and fine grain; (h, w, 3) uint8."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.2, 3.0), rng.uniform(0.2, 3.0), rng.uniform(0, 6.3)
        img[..., c] = 128 + 90 * np.sin(2 * np.pi * (fx * xx / w + fy * yy / h) + ph)
    for _ in range(int(rng.integers(2, 6))):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.08, 0.3) * min(w, h)
        inside = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
        img[inside] = rng.uniform(0, 255, 3)
    # Fine texture at two scales: photos carry this detail, and it sets the JPEG size and decode cost.
    coarse = rng.normal(0, 18, (h // 4 + 1, w // 4 + 1, 3)).repeat(4, 0).repeat(4, 1)[:h, :w]
    img += coarse + rng.normal(0, 10, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _write_image(job: tuple) -> None:
    """Write one image of `write_images`; its draws come from (seed, split, i) alone."""
    folder, split, split_id, i, (w0, h0), mixed, seed = job
    rng = np.random.default_rng([seed, split_id, i])
    # Sizes vary around the target like real photos; one in four is portrait.
    w, h = int(w0 * rng.uniform(0.85, 1.15)), int(h0 * rng.uniform(0.85, 1.15))
    if rng.random() < 0.25:
        w, h = h, w
    kind = rng.random() if mixed else 1.0       # drawn only for mixed folders: plain ones stay as they were
    cuts = np.cumsum(list(MIXED_SHARES.values()))
    if kind < cuts[0]:                          # large: the longer side 700-1000 px
        scale = rng.uniform(700, 1000) / max(w, h)
        w, h = int(w * scale), int(h * scale)
    pil = Image.fromarray(scene(rng, w, h))
    stem = folder / f"{split}_{i:06d}"
    if cuts[0] <= kind < cuts[1]:
        pil.save(stem.with_suffix(".png"), compress_level=1)
    elif cuts[1] <= kind < cuts[2]:
        pil.convert("L").save(stem.with_suffix(".jpg"), quality=schema.JPEG_QUALITY)
    elif cuts[2] <= kind < cuts[3]:
        pil.convert("CMYK").save(stem.with_suffix(".jpg"), quality=schema.JPEG_QUALITY)
    else:
        pil.save(stem.with_suffix(".jpg"), quality=schema.JPEG_QUALITY)


def write_images(src: Path, train: int, val: int, *, size_px: tuple[int, int] = IMAGE_PX, mixed: bool = False,
                 seed: int = 0, workers: int = 1) -> Path:
    """Write `train` and `val` generated images as `src/{train,val}/class<k>/` (`CLASSES` classes, round
    robin) in `workers` processes; skip when `src` already holds this exact set (a stamp file).

    Args:
        src: the folder to fill.
        train, val: images per split.
        size_px: nominal (W, H); each side is drawn within ±15 % of it.
        mixed: add large, PNG, grayscale and CMYK images (`MIXED_SHARES`, module docstring).
        seed: the draws of image i of a split depend on (seed, split, i) only.
        workers: writer processes; the files do not depend on it.

    Returns:
        `src`.
    """
    src = Path(src)
    done = src / ".complete"
    stamp = f"{train} {val} {tuple(size_px)} mixed={mixed} seed={seed} per-image-seeds"
    if done.exists() and done.read_text() == stamp:
        return src
    jobs = []
    for split_id, (split, count) in enumerate((("train", train), ("val", val))):
        for i in range(count):
            folder = src / split / f"class{i % CLASSES:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((folder, split, split_id, i, tuple(size_px), mixed, seed))
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=fork_context()) as pool:
            list(pool.map(_write_image, jobs, chunksize=16))
    else:
        for job in jobs:
            _write_image(job)
    done.write_text(stamp)
    return src


# ----------------------------------------------------------------------------- datasets


def _preprocess(log: Path, dataset: str, out: Path, **params) -> None:
    """`prepare_dataset(dataset, out, **params)`, logged to `log` as its command line and its output."""
    words = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in params.items()]
    with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print(f"$ python -m preprocess --dataset {dataset} --out {out} {' '.join(words)}", flush=True)
        try:
            print(summary(prepare_dataset(dataset, out, **params)), flush=True)
        except (ValueError, DatasetError, OSError) as exc:
            print(f"error: {exc}", flush=True)
            raise BenchError(f"preprocessing {params.get('name', dataset)} failed "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); see {log}") from None


def prepare(name: str, work: Path, n: int, quick: bool, cores: int) -> tuple[Path, str]:
    """Make bench dataset `name` (`DATASETS`) with `n` train images under `work/data`, once.

    Returns:
        (data root, the dataset's name on disk).

    Raises:
        BenchError: an unknown name, or preprocessing that failed (its output is in the log).
    """
    root = work / "data"
    root.mkdir(parents=True, exist_ok=True)
    log = work / "preprocess.log"
    if name not in DATASETS:
        raise BenchError(f"unknown bench dataset {name!r}; choose from {', '.join(DATASETS)}")
    if (root / name / schema.MANIFEST_NAME).exists():
        return root, name
    if name == "imagenet-like":
        src = write_images(work / "imagenet-like-src", n, max(n // 10, 2 * CLASSES),
                           size_px=QUICK_IMAGE_PX if quick else IMAGE_PX, workers=cores)
        _preprocess(log, "imagefolder", root, src=src, name=name, workers=cores)
    else:
        # Ground-truth masks in the mask field, so that relicv2's saliency op has masks to use.
        _preprocess(log, "synthetic", root, workers=cores, train_size=n, val_size=max(n // 10, 20),
                    gt_masks_as_mask=True)
    return root, name
