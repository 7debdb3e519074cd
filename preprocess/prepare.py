"""Turn a source (synthetic, CIFAR, image folder) into a complete dataset folder, atomically.

    OUT/.<name>.staging/            everything is written here first
        <split>.beton               FFCV file          (preprocess/write_ffcv.py)
        <split>/shard-*.tar|.idx    DALI shards        (preprocess/write_dali.py)
        gt_masks/<split>.npy        synthetic only: exact foreground masks
        .verified.json              checksum stamp (see pipelines/schema.py, verification policy)
        manifest.json               written last (temporary name + os.replace)
    OUT/<name>/                     the staging folder renamed into place

Per split there is one check pass over the source (generate / read+decode, in parallel workers:
mean/std, skips, ground-truth masks), then the two writers. Nothing under OUT/<name> changes until
the new dataset is complete: with --force the old folder is moved aside (its manifest removed
first, so a reader never accepts a half-swapped folder), the staging folder renamed in, and the old
one deleted. An interrupted run leaves only the staging folder, which the next run deletes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipelines import schema
from pipelines.schema import DatasetError
from preprocess import cifar, imagefolder, synthetic
from preprocess.write_dali import write_dali
from preprocess.write_ffcv import write_ffcv

DATASETS = ("synthetic", "cifar10", "cifar100", "imagefolder")
SYNTHETIC_DEFAULTS = dict(train_size=10_000, val_size=2_000, image_px=64, seed=0, gt_masks_as_mask=False)
IMAGEFOLDER_DEFAULTS = dict(max_side=schema.MAX_SIDE_PX, side="longer", class_list=None)
SHARD_SIZE = 1000
_CHUNK = 256                    # records per worker task in the check pass


class PreprocessError(ValueError):
    """Bad arguments or a failed write; the message is one line naming the problem and the fix."""


def default_workers() -> int:
    """CPU cores available to this process."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="img", disable=not (progress and sys.stderr.isatty()))


# ------------------------------------------------------------------------------------------------
# Check pass: one parallel pass per split over the source.
# ------------------------------------------------------------------------------------------------

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
    with _bar(n, f"generate {split.split}", progress) as bar:
        if workers <= 1 or len(jobs) == 1:
            results = map(_synthetic_chunk, jobs)
            pool = None
        else:
            pool = mp.get_context("fork").Pool(min(workers, len(jobs)))
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


def _check_files(files: list[tuple[str, int]], *, max_side: int, side: str, stats: bool, workers: int,
                 progress: bool, desc: str) -> tuple[list[tuple[str, int]], list[dict], list[tuple[int, int]],
                                                      np.ndarray]:
    """Decode every file once in parallel: (good files, skipped [{path, reason}], shapes, stats (3, 3))."""
    args = [(p, max_side, side, stats) for p, _ in files]
    label = dict(files)
    good, skipped, shapes = [], [], []
    acc = np.zeros((3, 3))
    with _bar(len(files), desc, progress) as bar:
        if workers <= 1:
            results = map(imagefolder.check_image, args)
            pool = None
        else:
            pool = mp.get_context("fork").Pool(workers)
            results = pool.imap(imagefolder.check_image, args, chunksize=16)
        try:
            for path, reason, shape, st in results:
                if reason is None:
                    good.append((path, label[path]))
                    shapes.append(shape)
                    if st is not None:
                        acc += st
                else:
                    skipped.append({"path": path, "reason": reason})
                bar.update(1)
        finally:
            if pool is not None:
                pool.terminate()
    return good, skipped, shapes, acc


def _mean_std(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel mean and std in [0, 1] units of (N, H, W, 3) uint8 images (float64 sums)."""
    s = np.zeros(3)
    ss = np.zeros(3)
    for a in range(0, len(images), 1024):                     # bounded float64 temporaries
        f = images[a:a + 1024].reshape(-1, 3).astype(np.float64) / 255.0   # (n*H*W, 3)
        s += f.sum(0)
        ss += (f * f).sum(0)
    count = images.shape[0] * images.shape[1] * images.shape[2]
    return _from_sums(np.stack([s, ss, np.full(3, count)]))


def _from_sums(acc: np.ndarray) -> tuple[list[float], list[float]]:
    mean = acc[0] / acc[2]
    std = np.sqrt(np.maximum(acc[1] / acc[2] - mean ** 2, 0.0))
    return [float(x) for x in mean], [float(x) for x in std]


# ------------------------------------------------------------------------------------------------
# Sources → prepared splits plus manifest facts.
# ------------------------------------------------------------------------------------------------

def _check_src(dataset: str, src: Path | None) -> Path:
    if src is None:
        raise PreprocessError(f"--src is required for {dataset}: pass the folder holding the data")
    src = Path(src)
    if not src.exists():
        raise PreprocessError(f"source path {src} does not exist: pass --src with the folder holding "
                              f"the {dataset} data")
    if not src.is_dir():
        raise PreprocessError(f"source path {src} is not a folder: pass --src with the folder holding "
                              f"the {dataset} data")
    if not os.access(src, os.R_OK | os.X_OK):
        raise PreprocessError(f"source folder {src} is not readable: fix its permissions (chmod u+rx) "
                              "or copy the data somewhere readable")
    return src


def _unknown_params(dataset: str, params: dict, allowed: dict) -> None:
    extra = sorted(set(params) - set(allowed))
    if extra:
        raise PreprocessError(f"unknown option(s) {', '.join(extra)} for {dataset}; valid: "
                              f"{', '.join(sorted(allowed)) or 'none'}")


def _prepare_sources(dataset: str, src: Path | None, params: dict, workers: int, progress: bool,
                     timings: dict) -> tuple[dict, dict]:
    """Build the prepared splits. Returns ({split: PreparedSplit}, manifest facts)."""
    t0 = time.perf_counter()
    facts: dict = {"skipped": [], "gt_masks": {}}
    if dataset == "synthetic":
        _unknown_params(dataset, params, SYNTHETIC_DEFAULTS)
        p = {**SYNTHETIC_DEFAULTS, **params}
        for k in ("train_size", "val_size", "image_px", "seed"):
            if not isinstance(p[k], (int, np.integer)) or isinstance(p[k], bool):
                raise PreprocessError(f"synthetic option {k} must be an integer, got {p[k]!r}")
        if p["train_size"] < 1 or p["val_size"] < 1:
            raise PreprocessError("synthetic --train-size and --val-size must be >= 1")
        if not 16 <= p["image_px"] <= 1024:
            raise PreprocessError(f"synthetic --image-px must be in [16, 1024], got {p['image_px']}")
        splits = {}
        for split in schema.SPLITS:
            gen = synthetic.SyntheticSplit(int(p[f"{split}_size"]), seed=int(p["seed"]), split=split,
                                           image_px=int(p["image_px"]))
            images, masks = _generate_synthetic(gen, workers, progress)
            splits[split] = cifar.ArraySplit(images, gen.labels.copy(),
                                             masks if p["gt_masks_as_mask"] else None)
            facts["gt_masks"][split] = masks
        facts.update(params=p, class_names=list(synthetic.CLASS_NAMES), image_px=int(p["image_px"]),
                     size_policy=None, mean_std=_mean_std(splits["train"].images))
    elif dataset in ("cifar10", "cifar100"):
        _unknown_params(dataset, params, {})
        src = _check_src(dataset, src)
        splits, names = cifar.load_cifar(dataset, src)
        facts.update(params={"src": str(src.resolve())}, class_names=names, image_px=32, size_policy=None,
                     mean_std=_mean_std(splits["train"].images))
    else:
        _unknown_params(dataset, params, IMAGEFOLDER_DEFAULTS)
        p = {**IMAGEFOLDER_DEFAULTS, **params}
        if p["side"] not in imagefolder.SIDES:
            raise PreprocessError(f"unknown --side {p['side']!r}; use one of {', '.join(imagefolder.SIDES)}")
        if int(p["max_side"]) < 0:
            raise PreprocessError(f"--max-side must be >= 0 (0: keep the size), got {p['max_side']}")
        src = _check_src(dataset, src)
        class_list = Path(p["class_list"]) if p["class_list"] else None
        names, files = imagefolder.list_image_folder(src, class_list)
        splits, max_px = {}, 0
        for split in schema.SPLITS:
            good, skipped, shapes, acc = _check_files(
                files[split], max_side=int(p["max_side"]), side=p["side"], stats=split == "train",
                workers=workers, progress=progress, desc=f"read/decode {split}")
            facts["skipped"] += [{**s, "path": os.path.relpath(s["path"], src)} for s in skipped]
            if not good:
                raise PreprocessError(f"split {split} of {src} has no decodable image ({len(skipped)} "
                                      "skipped, see their reasons with a viewer): add valid images")
            if split == "train":
                facts["mean_std"] = _from_sums(acc)
            max_px = max(max_px, max(max(s) for s in shapes))
            splits[split] = imagefolder.ImageFolderSplit([f for f, _ in good], [lab for _, lab in good],
                                                         max_side=int(p["max_side"]), side=p["side"],
                                                         jpeg_quality=schema.JPEG_QUALITY)
        facts.update(params={**p, "src": str(src.resolve()),
                             "class_list": str(class_list.resolve()) if class_list else None},
                     class_names=names, image_px=int(max_px),
                     size_policy={"side": p["side"], "max_side_px": int(p["max_side"])})
    timings["read_decode"] = time.perf_counter() - t0
    return splits, facts


# ------------------------------------------------------------------------------------------------
# Orchestration.
# ------------------------------------------------------------------------------------------------

def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _hash_files(root: Path) -> dict[str, dict]:
    files = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel in (schema.MANIFEST_NAME, schema.VERIFIED_NAME):
            continue
        files[rel] = {"sha256": schema.sha256_file(f), "bytes": f.stat().st_size}
    return files


def _write_manifest(staging: Path, manifest: dict) -> None:
    """Write the verification stamp, then manifest.json (temporary name + os.replace), last."""
    raw = (json.dumps(manifest, indent=1) + "\n").encode()
    stamp = {rel: schema.file_stat_key(staging / rel) for rel in manifest["files"]}
    schema.write_verified_stamp(staging, hashlib.sha256(raw).hexdigest(), stamp)
    tmp = staging / f".{schema.MANIFEST_NAME}.tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / schema.MANIFEST_NAME)


def _swap_in(staging: Path, final: Path) -> None:
    """Rename the complete staging folder to `final`, moving a previous dataset aside first."""
    old = final.with_name(f".{final.name}.old")
    _remove(old)
    if final.exists():
        # Remove the manifest first: if we die between the renames, no reader accepts a mixed folder.
        (final / schema.MANIFEST_NAME).unlink(missing_ok=True)
        os.replace(final, old)
    os.replace(staging, final)
    _remove(old)


def _is_complete(final: Path) -> dict | None:
    try:
        return schema.read_manifest(final, verify="size")
    except DatasetError:
        return None


def prepare_dataset(dataset: str, out_root: Path, *, src: Path | None = None, force: bool = False,
                    workers: int | None = None, progress: bool = False, name: str | None = None,
                    shard_size: int = SHARD_SIZE, **source_params) -> Path:
    """Write `dataset` as FFCV + DALI files with a manifest into `out_root/<name>` (atomically).

    Args:
        dataset: one of DATASETS.
        out_root: the data root; the dataset lands in `out_root/<name>`.
        src: source folder (CIFAR batches or the image folder); unused for synthetic.
        force: rewrite a complete dataset (otherwise a complete dataset is left as it is).
        workers: parallel processes (default: all available cores).
        progress: tqdm bars (only shown when stderr is a terminal).
        name: dataset folder name (default: `dataset`).
        shard_size: records per DALI shard.
        **source_params: synthetic: train_size, val_size, image_px, seed, gt_masks_as_mask;
            imagefolder: max_side (px, 0 keeps the size), side ("longer" | "shorter"), class_list.

    Returns:
        The dataset folder `out_root/<name>`.

    Raises:
        PreprocessError, CifarError, ImageFolderError (all ValueError): bad input or a failed write,
            with a one-line message; a previous complete dataset is then left intact.
    """
    if dataset not in DATASETS:
        raise PreprocessError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if shard_size < 1:
        raise PreprocessError(f"--shard-size must be >= 1, got {shard_size}")
    name = name or dataset
    out_root = Path(out_root)
    final = out_root / name
    staging = out_root / f".{name}.staging"
    if not force and (done := _is_complete(final)) is not None:
        counts = ", ".join(f"{k} {v}" for k, v in done.counts.items())
        print(f"{final} is complete ({counts}); nothing to do (pass --force to rewrite)")
        return final
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    existing = next(p for p in (out_root.resolve(), *out_root.resolve().parents) if p.exists())
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise PreprocessError(f"output folder {out_root} cannot be created or written ({existing} is not a "
                              "writable folder): choose a writable --out")
    # Sources are checked (and read) before anything is written under OUT.
    splits, facts = _prepare_sources(dataset, src, dict(source_params), workers, progress, timings)
    try:
        out_root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            print(f"removing {staging} left by an interrupted run", file=sys.stderr)
            _remove(staging)
    except OSError as e:
        raise PreprocessError(f"cannot prepare output folder {out_root}: {e.strerror or e}; choose a "
                              "writable --out") from None

    try:
        staging.mkdir()
        timings["ffcv_write"] = timings["dali_write"] = 0.0
        for split_name, split in splits.items():
            t = time.perf_counter()
            write_ffcv(split, staging / f"{split_name}.beton", num_workers=workers, progress=progress)
            timings["ffcv_write"] += time.perf_counter() - t
            t = time.perf_counter()
            write_dali(split, staging / split_name, shard_size=shard_size, num_workers=workers,
                       progress=progress)
            timings["dali_write"] += time.perf_counter() - t
        for split_name, masks in facts["gt_masks"].items():
            (staging / "gt_masks").mkdir(exist_ok=True)
            np.save(staging / "gt_masks" / f"{split_name}.npy", masks)
        t = time.perf_counter()
        files = _hash_files(staging)
        timings["checksum"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t_start
        mean, std = facts["mean_std"]
        first = splits["train"]
        manifest = {
            "schema_version": schema.SCHEMA_VERSION,
            "dataset": name,
            "source": dataset,
            "params": facts["params"],
            "counts": {k: len(v) for k, v in splits.items()},
            "class_names": facts["class_names"],
            "num_classes": len(facts["class_names"]),
            "image_mode": first.mode,
            "jpeg_quality": schema.JPEG_QUALITY if first.mode == "jpg" else None,
            "size_policy": facts["size_policy"],
            "image_px": facts["image_px"],
            "has_masks": bool(first.has_masks),
            "mask_source": ("synthetic_ground_truth" if first.has_masks else None),
            "gt_masks": {k: f"gt_masks/{k}.npy" for k in facts["gt_masks"]},
            "mean": mean,
            "std": std,
            "skipped": facts["skipped"],
            "formats": {"ffcv": {k: f"{k}.beton" for k in splits},
                        "dali": {k: sorted(f for f in files if f.startswith(f"{k}/") and f.endswith(".tar"))
                                 for k in splits}},
            "shard_size": shard_size,
            "files": files,
            "build": {"workers": workers, "seconds": {k: round(v, 3) for k, v in timings.items()}},
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        _write_manifest(staging, manifest)
        _swap_in(staging, final)
    except OSError as e:
        _remove_quietly(staging)
        what = "disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise PreprocessError(f"writing {name} into {out_root} failed ({what}); nothing was replaced: "
                              "free space or choose another --out, then re-run") from None
    except BaseException:
        _remove_quietly(staging)
        raise
    return final


def _remove_quietly(path: Path) -> None:
    try:
        _remove(path)
    except OSError:
        pass        # the next run removes a stale staging folder


def summary(dataset_dir: Path) -> str:
    """A short human summary of a complete dataset: counts, files, sizes, throughput."""
    m = schema.read_manifest(dataset_dir, verify="size")
    n = sum(m.counts.values())
    size = sum(f["bytes"] for f in m.files.values())
    secs = m.build.get("seconds", {})
    lines = [f"{m.dataset} ({m.source}): " + ", ".join(f"{k} {v}" for k, v in m.counts.items())
             + f" images, {m.num_classes} classes, {m.image_mode} {m.image_px} px, masks "
             + ("yes" if m.has_masks else "no")]
    by_kind: dict[str, list[int]] = {}
    for rel, f in m.files.items():
        kind = ("ffcv .beton" if rel.endswith(".beton") else "dali shards" if rel.endswith((".tar", ".idx"))
                else "ground-truth masks" if rel.startswith("gt_masks/") else "other")
        by_kind.setdefault(kind, [0, 0])
        by_kind[kind][0] += 1
        by_kind[kind][1] += f["bytes"]
    for kind, (count, b) in sorted(by_kind.items()):
        lines.append(f"  {kind:20s} {count:5d} files {b / 2**20:9.1f} MiB")
    lines.append(f"  total {len(m.files)} files, {size / 2**20:.1f} MiB in {dataset_dir}")
    if m.skipped:
        lines.append(f"  skipped {len(m.skipped)} unreadable files (listed in manifest.json)")
    if secs.get("total"):
        stages = ", ".join(f"{k} {v:.1f}s" for k, v in secs.items() if k != "total")
        lines.append(f"  {n / secs['total']:.0f} images/s on {m.build['workers']} workers "
                     f"({secs['total']:.1f}s: {stages})")
    return "\n".join(lines)
