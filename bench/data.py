"""Loader throughput benchmark: `python -m bench.data`.

For every recipe × dataset × backend it measures source images/s and views/s of the loader alone
(batches normalised on `--device`; a backend written `name@cpu` or `name@cuda` runs there instead, so
that `dali,dali@cpu` compares the DALI GPU and CPU graphs in one run), with the same number of CPU cores for every backend (`--cores`:
DataLoader workers / DALI threads, and torch's intra-op threads), as the median of `--repeats` runs,
each timed after `--warmup-batches` batches. The runs go in rounds: each round times the
decode + crops ceiling and every backend once, back to back, so that a slow spell of a shared
machine falls on all of them alike. Next to them it measures two ceilings on the same shard
files with the faster of two libjpeg-turbo decoders (PIL, `torchvision.io.decode_image`), run in
`--cores` DataLoader workers: decode-only, and decode + the recipe's crops and resizes (one decode per
sample, every crop view resized to its size, no colour ops). Each backend is also run on the recipe
with its colour, blur, solarize and saliency ops switched off, which splits its time into the stages
decode (ceiling decode time), crops + resizes, and colour ops (+ transfer and normalisation).

Datasets (cached in the output folder and reused):
- `imagenet-like`: a folder of JPEGs (~500×375, quality 90, textured procedural scenes) generated
  here, then written by `python -m preprocess --dataset imagefolder` (run as a subprocess: pipelines
  never import preprocess);
- `synthetic`: `python -m preprocess --dataset synthetic`.

A backend that fails to import or build is reported with its error, never skipped silently. The
JSON (`--out`) holds the machine, package versions, git commit, the resolved settings and every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from bench.report import header, header_lines
from pipelines import schema
from pipelines.loader import BACKENDS, LoaderSpec, build_loader
from pipelines.shards import ShardReader, scan_shards
from pipelines.views import Recipe, load_recipe

DATASETS = ("imagenet-like", "synthetic")
RECIPES = ("relicv2", "rsa")
IMAGENET_LIKE_SIZE = (500, 375)     # (W, H), the ImageNet average is about 400×350 after decode
IMAGENET_LIKE_CLASSES = 10
SIZES_PX = {"imagenet-like": (224, 96), "synthetic": (64, 32)}   # (global, local)
QUICK_SIZES_PX = (32, 16)


class BenchError(ValueError):
    """Bad benchmark arguments or a dataset that could not be prepared, with the fix."""


# ----------------------------------------------------------------------------- datasets


def _imagenet_like_image(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A textured scene: smooth colour field, a few shapes and fine noise; JPEG size like a photo."""
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


def _write_imagenet_like(job: tuple) -> None:
    """Write one generated JPEG; its draws come from (seed, split, i) alone, so any worker can make it."""
    from PIL import Image

    path, seed, split_id, i, (w0, h0) = job
    rng = np.random.default_rng([seed, split_id, i])
    # Sizes vary around the target like real photos; one in four is portrait.
    w, h = int(w0 * rng.uniform(0.85, 1.15)), int(h0 * rng.uniform(0.85, 1.15))
    if rng.random() < 0.25:
        w, h = h, w
    Image.fromarray(_imagenet_like_image(rng, w, h)).save(path, quality=schema.JPEG_QUALITY)


def make_imagenet_like(src: Path, n: int, size: tuple[int, int], seed: int = 0, workers: int = 1) -> Path:
    """Write `n` train JPEGs (and n // 10 val) in `src/{train,val}/<class>/`, in `workers` processes;
    skip if complete.

    Returns:
        `src`.
    """
    from concurrent.futures import ProcessPoolExecutor

    done = src / ".complete"
    stamp = f"{n} {size} {seed} per-image-seeds"
    if done.exists() and done.read_text() == stamp:
        return src
    jobs = []
    for split_id, (split, count) in enumerate((("train", n), ("val", max(n // 10, 2 * IMAGENET_LIKE_CLASSES)))):
        for i in range(count):
            cls = src / split / f"class{i % IMAGENET_LIKE_CLASSES:03d}"
            cls.mkdir(parents=True, exist_ok=True)
            jobs.append((cls / f"{split}_{i:06d}.jpg", seed, split_id, i, size))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_write_imagenet_like, jobs, chunksize=16))
    else:
        for job in jobs:
            _write_imagenet_like(job)
    done.write_text(stamp)
    return src


def _preprocess(args: list[str], log: Path) -> None:
    """Run `python -m preprocess ARGS` in a subprocess (pipelines must not import preprocess)."""
    cmd = [sys.executable, "-m", "preprocess", *args]
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise BenchError(f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}); see {log}")


def prepare(name: str, work: Path, n: int, quick: bool, cores: int) -> tuple[Path, str]:
    """Make dataset `name` under `work/data` (cached). Returns (root, dataset name on disk)."""
    root = work / "data"
    root.mkdir(parents=True, exist_ok=True)
    log = work / "preprocess.log"
    if name == "imagenet-like":
        size = (96, 72) if quick else IMAGENET_LIKE_SIZE
        src = make_imagenet_like(work / "imagenet-like-src", n, size, workers=cores)
        if not (root / "imagenet-like" / schema.MANIFEST_NAME).exists():
            _preprocess(["--dataset", "imagefolder", "--src", str(src), "--name", "imagenet-like",
                         "--out", str(root), "--workers", str(cores)], log)
        return root, "imagenet-like"
    if name == "synthetic":
        if not (root / "synthetic" / schema.MANIFEST_NAME).exists():
            # Ground-truth masks in the mask field, so that relicv2's saliency op has masks to use.
            _preprocess(["--dataset", "synthetic", "--out", str(root), "--workers", str(cores),
                         "--train-size", str(n), "--val-size", str(max(n // 10, 20)),
                         "--gt-masks-as-mask"], log)
        return root, "synthetic"
    raise BenchError(f"unknown bench dataset {name!r}; choose from {', '.join(DATASETS)}")


# ----------------------------------------------------------------------------- timing


def crops_only(recipe: Recipe) -> Recipe:
    """The recipe with every colour, grayscale, blur, solarize and saliency op switched off."""
    off = dict(jitter_p=0.0, gray_p=0.0, blur_p=0.0, solarize_p=0.0, saliency_p=0.0)
    return Recipe(name=f"{recipe.name}-crops", groups=tuple(dataclasses.replace(g, **off) for g in recipe.groups))


def without_blur(recipe: Recipe) -> Recipe:
    """The recipe with Gaussian blur switched off (everything else as it is)."""
    return Recipe(name=f"{recipe.name}-noblur", groups=tuple(dataclasses.replace(g, blur_p=0.0) for g in recipe.groups))


def views_per_sample(recipe: Recipe) -> int:
    """Views a sample yields: every group's count (weak parents of staged groups included)."""
    return sum(g.count for g in recipe.groups)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # sync: close the timed window on the device


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (None where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_utilisation(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """Share of the machine's cores busy between two `cpu_ticks()` readings (every process counts)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def time_loader(make, batches: int, warmup: int, repeats: int, device: str,
                utilisation: list | None = None) -> list[float]:
    """Images/s of `repeats` runs; each builds a fresh loader (`make(epoch)`), skips `warmup` batches,
    then times `batches` batches. With `utilisation`, appends each timed window's machine CPU share."""
    runs = []
    for r in range(repeats):
        loader = make(r)
        it = iter(loader)
        for _ in range(warmup):
            next(it)
        _sync(device)
        ticks, t0 = cpu_ticks(), time.perf_counter()
        n = 0
        for _ in range(batches):
            n += next(it).batch_size
        _sync(device)
        runs.append(n / (time.perf_counter() - t0))
        if utilisation is not None:
            utilisation.append(cpu_utilisation(ticks, cpu_ticks()))
        del it, loader
    return runs


class _CeilingDataset(torch.utils.data.Dataset):
    """Reads one record's image bytes from its shard, decodes it and (optionally) crops the views."""

    def __init__(self, reader: ShardReader, decoder: str, crop_groups: list | None) -> None:
        self.reader, self.decoder, self.crop_groups = reader, decoder, crop_groups

    def __len__(self) -> int:
        return len(self.reader.records)

    def __getitem__(self, i: int):
        import torchvision.transforms as T
        data = self.reader.image(i)
        if self.decoder == "read":                    # the bytes alone: the read ceiling
            return len(data)
        if self.decoder == "pil":
            from PIL import Image
            img = Image.open(io.BytesIO(data)).convert("RGB")
            if self.crop_groups is None:
                return img.width
            out = []
            for g in self.crop_groups:
                interp = Image.BICUBIC if g.interpolation == "bicubic" else Image.BILINEAR
                for _ in range(g.count):
                    top, left, h, w = T.RandomResizedCrop.get_params(img, list(g.area), list(g.ratio))
                    v = img.resize((g.size_px, g.size_px), interp, box=(left, top, left + w, top + h))
                    out.append(torch.from_numpy(np.asarray(v).copy()))
            return out
        import torchvision.io as tvio
        import torchvision.transforms.v2.functional as F
        img = tvio.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tvio.ImageReadMode.RGB)
        if self.crop_groups is None:
            return int(img.shape[-1])
        out = []
        for g in self.crop_groups:
            interp = (T.InterpolationMode.BICUBIC if g.interpolation == "bicubic"
                      else T.InterpolationMode.BILINEAR)
            for _ in range(g.count):
                top, left, h, w = T.RandomResizedCrop.get_params(img, list(g.area), list(g.ratio))
                out.append(F.resized_crop(img, top, left, h, w, [g.size_px, g.size_px], interp, antialias=True))
        return out


def _collate_views(items):
    if isinstance(items[0], int):
        return len(items)
    return [torch.stack([it[k] for it in items]) for k in range(len(items[0]))]  # each (B, ...)


def time_ceiling(entries, decoder: str, recipe: Recipe | None, batch_size: int, batches: int,
                 warmup: int, repeats: int, cores: int, first_seed: int = 0) -> list[float]:
    """Images/s of decode-only (`recipe` None) or decode + crops of `recipe`, in `cores` workers;
    run r reads the records in the order seeded with `first_seed + r`. `decoder="read"` times
    reading the bytes alone."""
    groups = None if recipe is None else list(recipe.crop_groups)
    ds = _CeilingDataset(ShardReader(entries), decoder, groups)
    need = (warmup + batches) * batch_size
    runs = []
    for r in range(repeats):
        g = torch.Generator().manual_seed(first_seed + r)
        order = torch.randperm(len(entries), generator=g).tolist()
        order = (order * (need // len(order) + 1))[:need]
        dl = torch.utils.data.DataLoader(
            torch.utils.data.Subset(ds, order), batch_size=batch_size, num_workers=cores,
            collate_fn=_collate_views, worker_init_fn=_seed_worker)
        it = iter(dl)
        for _ in range(warmup):
            next(it)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        runs.append(batches * batch_size / (time.perf_counter() - t0))
        del it, dl
    return runs


def _seed_worker(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)


# ----------------------------------------------------------------------------- report


def operator_counts(loader) -> dict[str, dict[str, int]] | None:
    """Operators per iteration, by device, of a loader that runs a graph (DALI: as defined on the CPU
    and for a GPU), or None."""
    counts = getattr(loader, "operator_counts", None)
    return counts() if counts is not None else None


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def stage_shares(full: float, crops: float | None, decode: float | None) -> dict | None:
    """Split one image's time (1/img_s) into decode, crops + resizes, and colour ops + the rest."""
    if not full or not crops or not decode:
        return None
    t_full, t_crop, t_dec = 1 / full, 1 / crops, 1 / decode
    dec = min(t_dec, t_crop, t_full)
    crop = max(min(t_crop, t_full) - dec, 0.0)
    return {"decode": dec / t_full, "crops_resizes": crop / t_full,
            "colour_and_rest": max(t_full - dec - crop, 0.0) / t_full}


def ratios(results: list[dict], ceilings: list[dict]) -> list[dict]:
    """Per dataset × recipe: best backend vs torchvision, DALI vs torchvision, best vs ceiling."""
    out = []
    for ds, rc in sorted({(r["dataset"], r["recipe"]) for r in results}):
        ok = {r["backend"]: r["img_per_s"] for r in results
              if r["dataset"] == ds and r["recipe"] == rc and r["status"] == "ok"}
        ceil = {c["kind"]: c["img_per_s"] for c in ceilings if c["dataset"] == ds and c["recipe"] == rc}
        best = max(ok, key=ok.get) if ok else None
        base = ok.get("torchvision")
        out.append({
            "dataset": ds, "recipe": rc, "best_backend": best,
            "best_vs_torchvision": ok[best] / base if best and base else None,
            "dali_vs_torchvision": ok["dali"] / base if "dali" in ok and base else None,
            "ffcv_vs_torchvision": ok["ffcv"] / base if "ffcv" in ok and base else None,
            "ceiling_decode_crops_vs_best": ceil["decode+crops"] / ok[best] if best and ceil.get("decode+crops") else None,
        })
    return out


def format_table(report: dict) -> str:
    """The Markdown table of a report (printed, and copied into docs/benchmarks.md)."""
    rows = ["| dataset | recipe | backend / ceiling | img/s | views/s | × torchvision | decode | crops+resize | colour+rest | status |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    pct = lambda s, k: f"{100 * s[k]:.0f} %" if s else "–"   # noqa: E731
    for r in report["results"]:
        base = next((b["img_per_s"] for b in report["results"] if b["dataset"] == r["dataset"]
                     and b["recipe"] == r["recipe"] and b["backend"] == "torchvision" and b["status"] == "ok"), None)
        if r["status"] != "ok":
            rows.append(f"| {r['dataset']} | {r['recipe']} | {r['backend']} | – | – | – | – | – | – | "
                        f"{r['status']}: {r['error'].splitlines()[0][:90]} |")
            continue
        s = r.get("stage_share")
        rows.append(f"| {r['dataset']} | {r['recipe']} | {r['backend']} | {r['img_per_s']:.0f} | "
                    f"{r['views_per_s']:.0f} | {r['img_per_s'] / base:.2f} |" if base else
                    f"| {r['dataset']} | {r['recipe']} | {r['backend']} | {r['img_per_s']:.0f} | "
                    f"{r['views_per_s']:.0f} | – |")
        rows[-1] += f" {pct(s, 'decode')} | {pct(s, 'crops_resizes')} | {pct(s, 'colour_and_rest')} | ok |"
    for c in report["ceilings"]:
        rows.append(f"| {c['dataset']} | {c['recipe']} | ceiling: {c['kind']} ({c['decoder']}) | "
                    f"{c['img_per_s']:.0f} | {c['views_per_s']:.0f} | – | – | – | – | ok |")
    return "\n".join(rows + operator_lines(report["results"]))


def operator_lines(rows: list[dict]) -> list[str]:
    """One line per graph-running backend and recipe: its operators per iteration, by device."""
    def fmt(counts: dict[str, int]) -> str:
        return " / ".join(f"{counts.get(d, 0)} {d}" for d in ("cpu", "gpu", "mixed") if counts.get(d, 0) or d == "cpu")

    lines = [f"{r['backend']} operators per iteration, {r['recipe']}: GPU graph {fmt(r['operators']['gpu_graph'])}; "
             f"CPU graph {fmt(r['operators']['cpu_graph'])}" for r in rows if r.get("operators")]
    return [""] + lines if lines else []


# ----------------------------------------------------------------------------- main


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise BenchError(f"unknown {what} {bad or value!r}; choose from {', '.join(allowed)}")
    return items


def fill_sizes(a: argparse.Namespace) -> argparse.Namespace:
    """The timing sizes left unset on a command line (`n`, `repeats`, `batch_size`, `batches`,
    `warmup_batches`): the defaults, or tiny ones with `quick` (also used by `make profile`)."""
    q = a.quick
    a.n = a.n or (48 if q else 2000)
    a.repeats = a.repeats or (1 if q else 3)
    a.batch_size = a.batch_size or (8 if q else 32)
    a.batches = a.batches or (2 if q else 16)
    a.warmup_batches = a.warmup_batches if a.warmup_batches is not None else (1 if q else 3)
    return a


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe presets")
    p.add_argument("--datasets", default=",".join(DATASETS), help="imagenet-like, synthetic")
    p.add_argument("--backends", default="dali,ffcv,torchvision,torch", help=f"from {', '.join(BACKENDS)}")
    p.add_argument("--n", type=int, default=None, help="train images generated per dataset (default 2000; quick 48)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per cell; the median is reported (default 3)")
    p.add_argument("--batch-size", type=int, default=None, help="images per batch (default 32; quick 8)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per run (default 16; quick 2)")
    p.add_argument("--warmup-batches", type=int, default=None, help="untimed batches per run (default 3; quick 1)")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU workers/threads for every backend")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where batches land")
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip the crops-only runs that split each backend's time into stages")
    p.add_argument("--quick", action="store_true", help="tiny data and runs (tests)")
    p.add_argument("--out", default="reports/pipelines.json", help="JSON report; datasets are cached next to it")
    a = fill_sizes(p.parse_args(argv))
    if a.batch_size % 2 or a.batch_size < 2:
        raise BenchError(f"--batch-size must be even and >= 2, got {a.batch_size}")
    if a.n < a.batch_size * (a.batches + a.warmup_batches):
        raise BenchError(f"--n {a.n} is smaller than (batches + warmup) × batch size; raise --n or lower --batches")
    return a


def run(a: argparse.Namespace) -> dict:
    """Run the benchmark described by parsed arguments; returns the report (also written to a.out)."""

    recipes = _csv(a.recipes, tuple(RECIPES) + ("byol", "multicrop8", "plain"), "recipe")
    datasets = _csv(a.datasets, DATASETS, "dataset")
    # A backend may name the device its graph runs on and its batches land on: "dali@cpu" is the DALI
    # CPU graph on a GPU machine; a bare name uses --device.
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    _csv(",".join(b.partition("@")[0] for b in backends), BACKENDS, "backend")
    bad = [b for b in backends if b.partition("@")[2] not in ("", "cpu", "cuda")]
    if bad or not backends:
        raise BenchError(f"bad backend {bad or a.backends!r}; write <backend> or <backend>@cpu / <backend>@cuda")
    out = Path(a.out)
    work = out.parent / "bench-data"
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.cores)
    report: dict = {
        **header(),
        "settings": {"recipes": recipes, "datasets": datasets, "backends": backends, "n_images": a.n,
                     "repeats": a.repeats, "batch_size": a.batch_size, "timed_batches": a.batches,
                     "warmup_batches": a.warmup_batches, "cores": a.cores, "device": a.device, "stages": a.stages,
                     "quick": a.quick, "sizes_px": {d: (QUICK_SIZES_PX if a.quick else SIZES_PX[d]) for d in datasets},
                     "imagenet_like_image_px": (96, 72) if a.quick else IMAGENET_LIKE_SIZE,
                     "jpeg_quality": schema.JPEG_QUALITY, "statistic": "median over repeats"},
        "results": [], "ceilings": [], "recipes": {},
    }
    for ds in datasets:
        root, name = prepare(ds, work, a.n, a.quick, a.cores)
        entries = scan_shards(root / name / "train")
        gpx, lpx = QUICK_SIZES_PX if a.quick else SIZES_PX[ds]
        decode_best: dict[str, float] = {}
        for dec in ("pil", "torchvision.io"):
            runs = time_ceiling(entries, dec, None, a.batch_size, a.batches, a.warmup_batches, a.repeats, a.cores)
            decode_best[dec] = _median(runs)
        decoder = max(decode_best, key=decode_best.get)
        for rc in recipes:
            recipe = load_recipe(rc, gpx, lpx)
            report["recipes"][f"{rc}@{gpx}/{lpx}"] = [dataclasses.asdict(g) for g in recipe.groups]
            vps = views_per_sample(recipe)
            crop_views = sum(g.count for g in recipe.crop_groups)
            report["ceilings"].append({"dataset": ds, "recipe": rc, "kind": "decode", "decoder": decoder,
                                       "img_per_s": decode_best[decoder], "views_per_s": 0.0,
                                       "all_decoders": decode_best})
            # One round per repeat, each timing the ceiling and every backend back to back, so that
            # a slow spell of a shared machine lands on all of them alike, not on one backend.
            ceiling_runs: list[float] = []
            rows = {be: {"dataset": ds, "recipe": rc, "backend": be, "views_per_sample": vps,
                         "runs": [], "crops_only_runs": []} for be in backends}
            for rnd in range(a.repeats):
                ceiling_runs += time_ceiling(entries, decoder, recipe, a.batch_size, a.batches,
                                             a.warmup_batches, 1, a.cores, first_seed=rnd)
                for be, row in rows.items():
                    if row.get("status") == "failed":
                        continue
                    try:
                        backend, _, device = be.partition("@")
                        device = device or a.device
                        row["device"] = device

                        def make(epoch, rec=recipe, backend=backend, device=device):
                            spec = LoaderSpec(root=str(root), dataset=name, split="train", recipe=rec,
                                              batch_size=a.batch_size, seed=0, device=device,
                                              num_workers=a.cores)
                            loader = build_loader(backend, spec)
                            loader.set_epoch(epoch + rnd)
                            return loader
                        row["runs"] += time_loader(make, a.batches, a.warmup_batches, 1, device)
                        if a.stages:
                            row["crops_only_runs"] += time_loader(lambda e: make(e, crops_only(recipe)),
                                                                  a.batches, a.warmup_batches, 1, device)
                        if rnd == 0:
                            row["operators"] = operator_counts(make(0))
                    except Exception as exc:  # a broken backend is reported, not silently skipped
                        row.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                                   traceback=traceback.format_exc(limit=4))
            report["ceilings"].append({"dataset": ds, "recipe": rc, "kind": "decode+crops", "decoder": decoder,
                                       "img_per_s": _median(ceiling_runs),
                                       "views_per_s": _median(ceiling_runs) * crop_views, "runs": ceiling_runs})
            for be, row in rows.items():
                if row.get("status") != "failed":
                    full, crops = _median(row["runs"]), _median(row["crops_only_runs"]) or None
                    row.update(status="ok", img_per_s=full, views_per_s=full * vps, crops_only_img_per_s=crops,
                               stage_share=stage_shares(full, crops, decode_best[decoder]))
                report["results"].append(row)
                print(f"{ds} {rc} {be}: " + (f"{row['img_per_s']:.1f} img/s" if row["status"] == "ok"
                                             else row["error"].splitlines()[0]), flush=True)
    report["ratios"] = ratios(report["results"], report["ceilings"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out)
    return report


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    report = run(a)
    print("\n" + "\n".join(header_lines(report)) + f"\ncores used {a.cores}; device {a.device}")
    print(format_table(report))
    for r in report["ratios"]:
        print(f"{r['dataset']} {r['recipe']}: best {r['best_backend']} "
              + ", ".join(f"{k} {r[k]:.2f}" for k in ("best_vs_torchvision", "dali_vs_torchvision",
                                                       "ceiling_decode_crops_vs_best") if r[k] is not None))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as exc:
        sys.exit(f"error: {exc}")
