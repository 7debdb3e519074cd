"""`make saliency`: compute saliency masks for a written dataset and write them into its files.

Stages, each scored where the dataset has exact masks (`synthetic`'s ground truth) and the best one
used (RELICv2 App. D.2, Tables 14-15: poor masks cost more accuracy than no masks, so a mask's quality
is measured before it is used):

1. a seeded subset of the training split (default min(2,500, N), the paper's 2,500 images);
2. the handcrafted maps on it, in parallel over cores: RBD and MR over SLIC superpixels
   (`handcrafted.py`) and their fusion (the mean);
3. the chosen stage over every record of every split, in parallel, with a progress bar; maps kept
   as uint8 probabilities at the working size (`work_px` square, whatever the image size) in a
   memory-mapped file beside the dataset, so memory stays bounded;
4. `write.write_masks`: binarised at 0.5 at each stored image's geometry, into both formats,
   atomically; the manifest's `saliency` records the methods, parameters, seed, subset, per-stage
   scores and the stage used.

The DeepUSPS refinement networks (stage I and II) are not part of this version: the stages are the
handcrafted ones, so the masks are the best handcrafted map (the fallback DeepUSPS-style
refinement must beat to be used).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from pipelines import schema
from pipelines.shards import ShardReader, scan_shards
from preprocess.prepare import DatasetLock
from preprocess.saliency import handcrafted, quality
from preprocess.saliency.write import write_masks

SUBSET = 2500
FUSION = "fusion"


@dataclass(frozen=True)
class Settings:
    methods: tuple[str, ...] = handcrafted.METHODS
    subset: int = SUBSET
    seed: int = 0
    work_px: int = handcrafted.WORK_PX
    workers: int = 1
    progress: bool = True
    case_images: int = 16          # labelled test images per case in the report


# ----------------------------------------------------------------------------- parallel maps

_READER: ShardReader | None = None
_SETTINGS: Settings | None = None


def _init(split_dir: str, count: int, settings: Settings) -> None:
    global _READER, _SETTINGS
    _READER, _SETTINGS = ShardReader(scan_shards(Path(split_dir), count)), settings
    # One BLAS thread per process: the solves are 150 x 150, and several BLAS threads per process
    # fighting over the cores made a map 2.3x slower (0.34 vs 0.15 s per image on 2 busy cores).
    threadpool_limits(1)


def _image(i: int) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(_READER.image(i))).convert("RGB"))


def _maps_of(indices: list[int]) -> list[dict[str, np.ndarray]]:
    """Every method's map (and the fusion) of records `indices`, at the working size, uint8."""
    s = _SETTINGS
    out = []
    for i in indices:
        per = handcrafted.maps(_image(i), s.methods, work_px=s.work_px, size=(s.work_px, s.work_px))
        per[FUSION] = handcrafted.fuse(per)
        out.append({k: np.round(v * 255).astype(np.uint8) for k, v in per.items()})
    return out


def map_records(split_dir: Path, count: int, indices: list[int], settings: Settings, what: str,
                sink) -> float:
    """Compute the maps of `indices` in `settings.workers` processes; `sink(i, maps)` receives each.

    Returns:
        Seconds taken. Shows a bar with images/s and ETA on a terminal, one summary line otherwise.
    """
    chunk = 16
    jobs = [indices[a:a + chunk] for a in range(0, len(indices), chunk)]
    show = settings.progress and sys.stderr.isatty()
    bar = tqdm(total=len(indices), unit="img", desc=what, disable=not show)
    t0 = time.perf_counter()
    if settings.workers <= 1:
        limits = threadpool_limits(1)          # undone below: this is the caller's process
        _init(str(split_dir), count, settings)
        results = map(_maps_of, jobs)
        pool = None
    else:
        pool = mp.get_context("fork").Pool(settings.workers, _init, (str(split_dir), count, settings))
        results = pool.imap(_maps_of, jobs)
    try:
        for job, maps in zip(jobs, results):
            for i, m in zip(job, maps):
                sink(i, m)
            bar.update(len(job))
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
        else:
            limits.restore_original_limits()
    seconds = time.perf_counter() - t0
    print(f"  {what}: {len(indices)} images in {seconds:.1f} s ({len(indices) / max(seconds, 1e-9):.1f} images/s "
          f"on {settings.workers} workers)", flush=True)
    return seconds


# ----------------------------------------------------------------------------- scoring


def score(maps: dict[int, dict[str, np.ndarray]], gt: np.ndarray | None) -> dict[str, dict]:
    """Per stage: MAE, F-β at 0.5, max-F and IoU at 0.5 against the ground truth (means over the
    subset), and label-free statistics (coverage at 0.5, share under the 5 % gate, share touching
    three or more image sides)."""
    stages = next(iter(maps.values())).keys()
    out = {}
    for stage in stages:
        rows = {"mae": [], "f_beta": [], "max_f": [], "iou": [], "coverage": [], "three_sides": []}
        for i, per in maps.items():
            p = per[stage].astype(np.float32) / 255.0
            if gt is not None:            # scored at the image's geometry, as the masks are written
                p = _resize(p, gt[i].shape)
            mask = p >= 0.5
            rows["coverage"].append(float(mask.mean()))
            sides = [mask[0].any(), mask[-1].any(), mask[:, 0].any(), mask[:, -1].any()]
            rows["three_sides"].append(float(sum(sides) >= 3))
            if gt is not None:
                g = gt[i]
                rows["mae"].append(quality.mae(p, g))
                rows["f_beta"].append(quality.f_beta(p, g))
                rows["max_f"].append(quality.max_f(p, g))
                rows["iou"].append(quality.iou(p, g))
        cov = np.array(rows["coverage"])
        out[stage] = {"coverage_mean": float(cov.mean()), "under_5pct": float((cov < 0.05).mean()),
                      "three_sides": float(np.mean(rows["three_sides"])),
                      "coverage_histogram": np.histogram(cov, bins=10, range=(0, 1))[0].tolist()}
        if gt is not None:
            out[stage].update({k: float(np.mean(rows[k])) for k in ("mae", "f_beta", "max_f", "iou")})
    return out


def _resize(p: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    import cv2

    return p if p.shape == shape else cv2.resize(p, (shape[1], shape[0]), interpolation=cv2.INTER_LINEAR)


def best_stage(scores: dict[str, dict]) -> str:
    """The stage with the highest IoU against the ground truth; the fusion without one."""
    if all("iou" in s for s in scores.values()):
        return max(scores, key=lambda k: scores[k]["iou"])
    return FUSION


# ----------------------------------------------------------------------------- main


def compute(dataset_dir: Path, settings: Settings, report_dir: Path | None = None) -> dict:
    """Run every stage on `dataset_dir` and write the masks; returns the `saliency` manifest entry."""
    dataset_dir = Path(dataset_dir)
    lock = DatasetLock(dataset_dir.parent, dataset_dir.name)
    lock.acquire()                 # before reading: `make preprocess --force` may not swap it meanwhile
    try:
        return _compute(dataset_dir, settings, report_dir)
    finally:
        lock.release()


def _compute(dataset_dir: Path, settings: Settings, report_dir: Path | None) -> dict:
    m = schema.read_manifest(dataset_dir)
    n = m.counts["train"]
    rng = np.random.default_rng(settings.seed)
    subset = sorted(rng.choice(n, size=min(settings.subset, n), replace=False).tolist())
    gt = np.load(dataset_dir / m.gt_masks["train"], mmap_mode="r") if "train" in m.gt_masks else None
    print(f"saliency for {dataset_dir.name}: {len(subset)} of {n} train images, methods "
          f"{', '.join(settings.methods)} at {settings.work_px} px, seed {settings.seed}", flush=True)

    sub_maps: dict[int, dict[str, np.ndarray]] = {}
    seconds = {"handcrafted_subset": map_records(dataset_dir / "train", n, subset, settings, "handcrafted maps",
                                                 lambda i, maps: sub_maps.__setitem__(i, maps))}
    scores = score(sub_maps, gt)
    stage = best_stage(scores)
    print("  " + " | ".join(f"{k}: IoU {v['iou']:.3f}" if "iou" in v else f"{k}: coverage {v['coverage_mean']:.2f}"
                            for k, v in scores.items()) + f" → using {stage}", flush=True)

    work = dataset_dir.with_name(f".{dataset_dir.name}.saliency-maps")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        stored: dict[str, np.memmap] = {}
        for split, count in m.counts.items():
            side = settings.work_px       # stored at the working size, resized to each image when written
            arr = np.lib.format.open_memmap(work / f"{split}.npy", mode="w+", dtype=np.uint8, shape=(count, side, side))
            todo = list(range(count))
            if split == "train":          # the subset's maps are already computed
                for i in subset:
                    arr[i] = sub_maps[i][stage]
                done = set(subset)
                todo = [i for i in todo if i not in done]

            def sink(i, maps, arr=arr, side=side):
                arr[i] = maps[stage]
            seconds[f"maps_{split}"] = map_records(dataset_dir / split, count, todo, settings, f"{split} masks", sink) if todo else 0.0
            arr.flush()
            stored[split] = arr
        saliency = {"stage": stage, "methods": list(settings.methods), "stages_scored": sorted(scores),
                    "scores": scores, "scored_against": "ground truth (synthetic)" if gt is not None else "none (label-free statistics)",
                    "subset": len(subset), "seed": settings.seed, "work_px": settings.work_px,
                    "slic": {"segments": handcrafted.segments_for(settings.work_px), "compactness": 20.0, "sigma": 1.0},
                    "threshold": 0.5, "refinement": "none (handcrafted stages only)", "backbone": None,
                    "seconds": {k: round(v, 2) for k, v in seconds.items()}}
        t = time.perf_counter()
        write_masks(dataset_dir, {s: (lambda i, a=a: a[i]) for s, a in stored.items()}, saliency,
                    workers=settings.workers, progress=settings.progress)
        saliency["seconds"]["write"] = round(time.perf_counter() - t, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if report_dir is not None:
        from preprocess.saliency.report import case_scores, write_report
        t = time.perf_counter()
        saliency["cases"] = case_scores(settings.methods, per_case=settings.case_images, work_px=settings.work_px)
        saliency["seconds"]["cases"] = round(time.perf_counter() - t, 2)
        write_report(report_dir, dataset_dir, saliency, sub_maps, gt)
    return saliency


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
