"""`python -m bench.preprocess` (`make bench-preprocess`): preprocessing throughput against its ceiling.

Two generated image folders of `--n` images each (10 classes, 90 % train / 10 % val), written by
`bench.datasets.write_images`, the generator of the loader bench's textured scenes:
- `jpeg`: about 445x334 px (each side within ±15 %) at quality 90, all within the default size cap
  (longer side <= 512), so every image is stored as its own bytes;
- `mixed`: the same, but 30 % of the images with a longer side of 700-1000 px (resized and
  re-encoded), 5 % PNG, 5 % grayscale and 3 % CMYK JPEG (converted and re-encoded).
The ceiling is measured on the same files in the same run: one process reads, decodes, converts,
resizes and JPEG-encodes every file (`imagefolder.read_image` + `encode_image`, what a unit does
at most); cores x that rate is the ceiling the issue sets. Each folder is then written by the local
engine on 1 worker and on all cores, and by the Ray engine on all cores (Ray started once before the
timed runs, as a running cluster would be; its start-up is reported apart), `--repeats` times each;
the tables give medians, with the per-stage wall seconds from the manifests and the share of images
stored as they were. The in-memory `synthetic` source is timed on 1 worker and all cores too. An
estimate for ImageNet-1k on 32 cores scales the measured per-core unit rate and adds the serial
stages (FFCV copy, listing) at their measured per-image cost. Results go to a JSON file and Markdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.datasets import write_images
from bench.report import header, header_lines
from pipelines import schema
from preprocess import imagefolder
from preprocess.prepare import default_workers, prepare_dataset
from preprocess.write_dali import encode_image

IMAGENET_1K = 1_281_167         # training images
TARGET_CORES = 32
FOLDER_IMAGE_PX = (445, 334)    # (W, H); each side within ±15 %, so the longer one stays <= 512 px (the cap)


def make_folder(root: Path, n: int, *, mixed: bool = False, workers: int = 1) -> Path:
    """`n` generated images in `root/{train,val}/<class>/`, 10 % of them val (module docstring)."""
    return write_images(root, n - n // 10, n // 10, size_px=FOLDER_IMAGE_PX, mixed=mixed, workers=workers)


def ceiling(src: Path, max_side: int = schema.MAX_SIDE_PX) -> dict:
    """Images/s of one process that reads, decodes, converts, resizes and JPEG-encodes every file."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix.lower() in imagefolder.IMAGE_EXTENSIONS)
    t = time.perf_counter()
    for f in files:
        image, _ = imagefolder.read_image(f, max_side, "longer")
        encode_image(image, "jpg", schema.JPEG_QUALITY)
    return {"images": len(files), "img_per_s": len(files) / (time.perf_counter() - t)}


def _timed(dataset: str, out: Path, src: Path | None, workers: int, engine, repeats: int, **params) -> dict:
    """Median images/s and per-stage seconds of `repeats` fresh writes."""
    runs = []
    for _ in range(repeats):
        d = prepare_dataset(dataset, out, src=src, force=True, workers=workers, engine=engine, **params)
        m = schema.read_manifest(d, verify="size")
        runs.append((sum(m.counts.values()) / m.build["seconds"]["total"], m))
    rates = sorted(r for r, _ in runs)
    m = sorted(runs, key=lambda x: x[0])[len(runs) // 2][1]                 # the median run
    return {"img_per_s": statistics.median(rates), "range": [rates[0], rates[-1]],
            "images": sum(m.counts.values()), "seconds": m.build["seconds"],
            "cpu_seconds": m.build.get("cpu_seconds", {}), "stored": m.build.get("images", {}),
            "skipped": len(m.skipped)}


def run(n: int, synthetic_n: int, work: Path, cores: int, repeats: int, with_ray: bool) -> dict:
    """Every workload; returns the result dict."""
    prepare_dataset("synthetic", work / "warmup", force=True, workers=cores, train_size=16, val_size=8,
                    image_px=32)                    # excluded: first-use imports and compiles
    res: dict = {**header(), "workers": cores, "n": n, "repeats": repeats, "folders": {}}
    ray_engine, ray_start = None, None
    if with_ray:
        import ray

        from preprocess.ray_engine import RayEngine
        ray_engine = RayEngine(cores)
        t = time.perf_counter()
        ray_engine._connect()
        ray_start = time.perf_counter() - t
        tiny = make_folder(work / "tiny", 100, workers=cores)   # Ray Data's first execution starts its workers
        prepare_dataset("imagefolder", work / "warmup", src=tiny, force=True, workers=cores, engine=ray_engine,
                        shard_size=25)
    res["ray_start_s"] = ray_start
    try:
        for name in ("jpeg", "mixed"):
            src = make_folder(work / name, n, mixed=name == "mixed", workers=cores)
            ceil = [ceiling(src) for _ in range(repeats)]
            row = {"ceiling_img_per_s_one_core": statistics.median(c["img_per_s"] for c in ceil)}
            row["local_1"] = _timed("imagefolder", work / "out", src, 1, "local", repeats)
            row[f"local_{cores}"] = _timed("imagefolder", work / "out", src, cores, "local", repeats)
            if ray_engine is not None:
                row[f"ray_{cores}"] = _timed("imagefolder", work / "out", src, cores, ray_engine, repeats)
            res["folders"][name] = row
    finally:
        if ray_engine is not None:
            ray.shutdown()
    res["synthetic"] = {w: _timed("synthetic", work / "out", None, w, "local", repeats, train_size=synthetic_n,
                                  val_size=max(synthetic_n // 5, 1)) for w in sorted({1, cores})}
    return res


def estimate_imagenet(row: dict, cores: int) -> float:
    """Hours for ImageNet-1k's train split on TARGET_CORES cores from a folder's all-core run: the units
    scale with cores; the other stages (listing, the whole FFCV copy as fast as on this machine's cores,
    checksums) are taken as serial, as the copy of a split that is nearly all of the images overlaps
    little: an upper bound, since the copy's processes would have more cores too."""
    r = row[f"local_{cores}"]
    secs, n = r["seconds"], r["images"]
    per_core_unit = secs["units"] * cores / n                  # seconds of one core per image
    serial = (secs["total"] - secs["units"] + secs.get("ffcv_write_background", 0) - secs.get("ffcv_wait", 0)) / n
    return IMAGENET_1K * (per_core_unit / TARGET_CORES + serial) / 3600


def table(res: dict) -> str:
    """The results as Markdown."""
    cores = res["workers"]
    lines = [*header_lines(res), f"all cores: {cores} workers; medians of {res['repeats']} runs", "",
             f"| folder | stored as they are | ceiling, 1 core | {cores} × ceiling | local, 1 worker | "
             f"local, {cores} workers | {cores} ÷ 1 | of the ceiling | Ray, {cores} workers | local ÷ Ray |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in res["folders"].items():
        c1 = row["ceiling_img_per_s_one_core"]
        one, many = row["local_1"], row[f"local_{cores}"]
        ray = row.get(f"ray_{cores}")
        kept = sum(v["as_is"] for v in many["stored"].values())
        lines.append(
            f"| {name} | {100 * kept / many['images']:.0f} % | {c1:.0f} | {cores * c1:.0f} | {one['img_per_s']:.0f} | "
            f"{many['img_per_s']:.0f} | {many['img_per_s'] / one['img_per_s']:.2f}× | "
            f"{100 * many['img_per_s'] / (cores * c1):.0f} % | "
            + (f"{ray['img_per_s']:.0f} | {many['img_per_s'] / ray['img_per_s']:.2f}× |" if ray else "— | — |"))
    lines += ["", "Wall seconds per stage of the median run (units: read, decode, resize, encode, write and "
              "hash the DALI shards on every core; each split's FFCV copy runs beside the other splits' "
              "units, then the run waits for the last):", "",
              "| folder | run | images/s (range) | list | units | assemble | FFCV import, beside the units | "
              "FFCV copy, beside the units | waiting for it | checksum | other | total |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in res["folders"].items():
        for key, r in row.items():
            if key.startswith(("local_", "ray_")):
                s = r["seconds"]
                lines.append(f"| {name} | {key.replace('_', ', ')} | {r['img_per_s']:.0f} ({r['range'][0]:.0f}–"
                             f"{r['range'][1]:.0f}) | " + " | ".join(f"{s.get(k, 0):.2f}" for k in (
                                 "list", "units", "assemble", "ffcv_import_background", "ffcv_write_background",
                                 "ffcv_wait", "checksum", "other", "total"))
                             + " |")
    lines += ["", "| synthetic (in memory) | workers | images/s | total s |", "| --- | ---: | ---: | ---: |"]
    for w, r in res["synthetic"].items():
        lines.append(f"| {r['images']} images | {w} | {r['img_per_s']:.0f} | {r['seconds']['total']:.2f} |")
    if res.get("ray_start_s") is not None:
        lines += ["", f"Ray start-up (excluded above): {res['ray_start_s']:.1f} s."]
    est = {name: estimate_imagenet(row, cores) for name, row in res["folders"].items()}
    lines += ["", f"ImageNet-1k train ({IMAGENET_1K:,} images) on {TARGET_CORES} cores, from the per-core unit "
              "rate measured here plus the serial stages: " + ", ".join(f"{k} {v:.2f} h" for k, v in est.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON and Markdown, print the tables."""
    p = argparse.ArgumentParser(prog="python -m bench.preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="images per generated folder")
    p.add_argument("--synthetic-n", type=int, default=2000, help="synthetic train size (val: n/5)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (medians)")
    p.add_argument("--workers", type=int, default=default_workers(), help="the all-cores worker count")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray engine")
    p.add_argument("--out", type=Path, default=Path("reports/bench-preprocess"), help="result folder")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="viewmill-bench-"))
    try:
        res = run(a.n, a.synthetic_n, work, a.workers, a.repeats, with_ray=not a.no_ray)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench.json").write_text(json.dumps(res, indent=1))
    md = table(res)
    (a.out / "bench.md").write_text(md + "\n")
    print(md)
    print(f"wrote {a.out}/bench.json and bench.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
