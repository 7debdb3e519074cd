"""`python -m preprocess.bench`: preprocessing throughput (images/s), 1 worker and all cores.

Two workloads: `synthetic` (generated, raw) and an ImageNet-like folder of `--n` JPEGs of about
500x375 px (generated once by the benchmark, quality 90, 10 classes, 90 % train / 10 % val) written
with the default size policy (longer side <= 512 px, i.e. no resize at this size) and with a
256-px cap (resize path). For each run the wall time of every pipeline stage comes from the
manifest's `build.seconds`: `read_decode` (check pass: generate, or read + decode + convert +
resize for folders), `ffcv_write` and `dali_write` (each re-reads records, encodes and writes),
`checksum`. A single-process microbenchmark on 100 files splits one image's cost into read/decode,
resize and JPEG encode. Results go to a JSON file and a table with the machine and versions.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import shutil
import statistics
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines import schema
from preprocess import imagefolder
from preprocess.prepare import default_workers, prepare_dataset


def make_jpeg_folder(root: Path, n: int, seed: int = 0) -> Path:
    """Write n JPEGs of about 500x375 px (smooth colour fields, edges and grain) as SRC/train|val/<class>/."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        split = "val" if (i // 10) % 10 == 9 else "train"        # 10 % val, every class
        w, h = int(rng.integers(450, 551)), int(rng.integers(340, 411))
        low = rng.random((6, 8, 3)) * 255
        img = Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
        a = np.asarray(img, dtype=np.float32) + rng.normal(0, 10, (h, w, 3)).astype(np.float32)
        y0, x0 = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
        a[y0:y0 + h // 3, x0:x0 + w // 3] = rng.random(3) * 255                # an object with edges
        d = root / split / f"class{i % 10:02d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(d / f"{i:06d}.jpg", quality=90)
    return root


def microbench(files: list[Path], max_side: int) -> dict[str, float]:
    """Median ms per image of read+decode, convert+resize and JPEG encode, one process."""
    dec, res, enc = [], [], []
    for f in files:
        t0 = time.perf_counter()
        with Image.open(f) as img:
            w, h = img.size
            tw, th = imagefolder.target_size(w, h, max_side, "longer")
            if (tw, th) != (w, h):
                img.draft("RGB", (tw, th))
            img.load()
            t1 = time.perf_counter()
            out = imagefolder.to_rgb(img)
            if out.size != (tw, th):
                out = out.resize((tw, th), Image.Resampling.BICUBIC)
            a = np.asarray(out)
        t2 = time.perf_counter()
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=schema.JPEG_QUALITY)
        t3 = time.perf_counter()
        dec.append(t1 - t0)
        res.append(t2 - t1)
        enc.append(t3 - t2)
    return {k: 1e3 * statistics.median(v) for k, v in
            (("read_decode_ms", dec), ("resize_ms", res), ("encode_ms", enc))}


def machine() -> dict:
    """CPU model, cores and package versions."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("numpy", "pillow", "ffcv", "nvidia-dali-cuda130", "opencv-python", "tqdm"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": model, "cores": default_workers(), "python": platform.python_version(), "versions": versions}


def run(n: int, synthetic_n: int, work: Path, worker_counts: list[int]) -> dict:
    """Run every workload at every worker count; returns the result dict."""
    src = make_jpeg_folder(work / "jpegs", n)
    # Warm-up, excluded: FFCV's numba kernels compile on first use (~10 s).
    prepare_dataset("synthetic", work / "warmup", force=True, workers=max(worker_counts), train_size=16,
                    val_size=8, image_px=32)
    results = []
    workloads = [("synthetic", dict(train_size=synthetic_n, val_size=max(synthetic_n // 5, 1)), None),
                 ("imagefolder", dict(max_side=512), src), ("imagefolder", dict(max_side=256), src)]
    for workers in worker_counts:
        for dataset, params, s in workloads:
            d = prepare_dataset(dataset, work / "out", src=s, force=True, workers=workers, **params)
            m = schema.read_manifest(d, verify="size")
            images = sum(m.counts.values())
            secs = m.build["seconds"]
            results.append({"dataset": dataset, "params": params, "workers": workers, "images": images,
                            "img_per_s": images / secs["total"], "seconds": secs, "skipped": len(m.skipped)})
    files = sorted((src / "train").rglob("*.jpg"))[:100]
    micro = {str(side): microbench(files, side) for side in (512, 256)}
    return {"machine": machine(), "runs": results, "per_image_ms_one_process": micro, "n_jpegs": n,
            "synthetic_n": synthetic_n}


def table(res: dict) -> str:
    """The results as a Markdown table."""
    mc = res["machine"]
    lines = [f"machine: {mc['cpu']}, {mc['cores']} cores, Python {mc['python']}, "
             + ", ".join(f"{k} {v}" for k, v in mc["versions"].items() if v), "",
             "| dataset | params | workers | images | img/s | read/decode s | ffcv write s | dali write s | checksum s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["runs"]:
        s = r["seconds"]
        p = ",".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"| {r['dataset']} | {p} | {r['workers']} | {r['images']} | {r['img_per_s']:.0f} | "
                     f"{s['read_decode']:.2f} | {s['ffcv_write']:.2f} | {s['dali_write']:.2f} | {s['checksum']:.2f} |")
    lines += ["", "one image, one process (median ms): "
              + "; ".join(f"max side {k}: " + ", ".join(f"{a} {b:.2f}" for a, b in v.items())
                          for k, v in res["per_image_ms_one_process"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON, print the table."""
    p = argparse.ArgumentParser(prog="python -m preprocess.bench", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="JPEGs in the ImageNet-like folder")
    p.add_argument("--synthetic-n", type=int, default=10_000, help="synthetic train size (val: n/5)")
    p.add_argument("--json", type=Path, default=Path("bench_preprocess.json"), help="result file")
    p.add_argument("--workers", type=int, nargs="*", help="worker counts (default: 1 and all cores)")
    a = p.parse_args(argv)
    counts = a.workers or sorted({1, default_workers()})
    work = Path(tempfile.mkdtemp(prefix="viewmill-bench-"))
    try:
        res = run(a.n, a.synthetic_n, work, counts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.json.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
