"""`python -m bench.gpu_check --out DIR`: the GPU-resident path checked and measured in one go, one report.

Run on a GPU machine (`make gpu-check`; without `make install` there: `PYTHONPATH=$PWD python3 -m
bench.gpu_check`). In order, each section writing its part of the report as soon as it is done:

1. **loader** — `bench.data` on the same generated ImageNet-like JPEGs: the DALI GPU graph
   (`dali`), the DALI CPU graph (`dali@cpu`) and the torchvision baseline, for `relicv2` and `rsa`
   at batch 128 and 256, source images/s and views/s, with the decode ceilings of the CPU;
2. **views** — the GPU graph with 1 view (relicv2's first large crop) against relicv2's 6 views;
3. **train** — ResNet-50 `relicv2` at 224/96, bf16, channels-last: `bench.train.time_steps` with the
   DALI GPU loader against the same steps fed one batch already on the device (the data-stall
   fraction `1 - real/on-device`);
4. **tests** — the `gpu`-marked tests (`--tests all`: the whole suite, in parallel processes when
   pytest-xdist is there), with every test that ran and its outcome; last, so that the measurements
   are saved even if a test hangs.

Writes `gpu_check.json` (machine, versions, commit, date, settings, every run) and `gpu_check.md` (the
table) into `--out` and prints the table last, with the issue's targets marked met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import data as loader_bench
from bench.datasets import CLASSES, prepare, view_px
from bench.report import header, header_lines
from bench.timing import time_loader, views_per_sample
from pipelines.loader import build_loader
from pipelines.spec import LoaderSpec
from pipelines.views import Recipe, load_recipe

TARGET_IMG_S, FLOOR_IMG_S = 6000, 3000      # relicv2 source images/s on one H100 (target, floor)
MAX_VIEW_COST = 1.5                          # 6 views cost at most 1.5x one view
MAX_STALL = 0.05                             # data-stall fraction of ResNet-50 relicv2 training


def run_tests(which: str, out: Path, timeout_s: int) -> dict:
    """Run the `gpu`-marked tests (or all) in a subprocess; every test's outcome from its JUnit XML."""
    xml = out / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={xml}"]
    if which == "gpu":
        cmd += ["-m", "gpu"]
    else:
        try:
            import xdist  # noqa: F401
            cmd += ["-n", str(min(8, os.cpu_count() or 1)), "--dist", "loadfile"]
        except ImportError:
            pass
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        tail, rc = (proc.stdout + proc.stderr)[-6000:], proc.returncode
    except subprocess.TimeoutExpired as e:
        tail, rc = f"timed out after {timeout_s} s\n{(e.stdout or b'')[-4000:]!r}", None
    cases = []
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            message = next((c.get("message", "")[:300] for c in case if c.tag in ("failure", "error", "skipped")), "")
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "seconds": float(case.get("time", 0)), "message": message})
    count = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    return {"which": which, "command": " ".join(cmd[1:]), "returncode": rc, "seconds": time.perf_counter() - t0,
            "count": count, "cases": cases, "tail": tail}


def run_loader(work: Path, batch_size: int, cores: int, n: int, repeats: int, quick: bool, device: str) -> dict:
    """`bench.data` on the ImageNet-like JPEGs: the GPU graph, the CPU graph and torchvision."""
    images = 2048 if not quick else 32                         # timed source images per run
    return loader_bench.run(loader_bench.Settings(
        recipes=("relicv2", "rsa"), datasets=("imagenet-like",), backends=("dali", "dali@cpu", "torchvision"),
        n=n, repeats=repeats, batch_size=batch_size, batches=max(2, images // batch_size), warmup_batches=2,
        cores=cores, device=device, stages=False, quick=quick, out=work / f"pipelines-b{batch_size}.json"))


def run_views(work: Path, batch_size: int, cores: int, n: int, repeats: int, quick: bool, device: str) -> dict:
    """Images/s of the GPU graph with relicv2's 6 views and with its first large crop alone."""
    six = load_recipe("relicv2", *view_px("imagenet-like", quick))
    one = Recipe("relicv2-1view", (six.groups[0],))
    root, name = prepare("imagenet-like", work / "bench-data", n, quick, cores)     # the loader section's data
    batches = 2 if quick else max(2, 2048 // batch_size)
    out = {}
    for recipe in (six, one):
        def make(epoch, recipe=recipe):
            loader = build_loader("dali", LoaderSpec(root=str(root), dataset=name, split="train",
                                                     recipe=recipe, batch_size=batch_size, device=device,
                                                     num_workers=cores))
            loader.set_epoch(epoch)
            return loader
        timing = time_loader(make, batches, 2, repeats, device)
        views = views_per_sample(recipe)
        out[recipe.name] = {"views": views, "runs": list(timing.img_per_s), "img_per_s": timing.median,
                            "views_per_s": timing.median * views}
    out["cost_6_vs_1"] = out["relicv2-1view"]["img_per_s"] / out["relicv2"]["img_per_s"]
    return out


def run_train(work: Path, batch_size: int, cores: int, n: int, steps: int, repeats: int, quick: bool,
              device: str) -> dict:
    """ResNet-50 relicv2 steps with the DALI GPU loader against one batch kept on the device."""
    from bench.train import time_steps
    from train.config import load_config, to_dict

    gpx, lpx = view_px("imagenet-like", quick)
    root, name = prepare("imagenet-like", work / "bench-data", n, quick, cores)     # the loader section's data
    cfg = load_config(["method=relicv2", "data=imagenet", f"data.name={name}", f"data.root={root}",
                       "data.backend=dali", f"data.batch_size={batch_size}", f"data.num_workers={cores}",
                       f"data.num_classes={CLASSES}", f"views.global_px={gpx}", f"views.local_px={lpx}",
                       "model.backbone=resnet50", "run.amp=true", "model.channels_last=true", f"run.device={device}"])
    torch.backends.cudnn.benchmark = True
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = time_steps(cfg, torch.device(device), steps, repeats, warmup_steps=3)
    row["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
    row["config"] = to_dict(cfg)
    return row


def table(report: dict) -> str:
    """The report as Markdown: the loader tables (`bench.data.format_table`), the view cost, training,
    tests, targets."""
    lines = []
    for key, rep in sorted(report.get("loader", {}).items()):
        if "error" in rep:
            lines += [f"loader {key} failed: {rep['error']}", ""]
            continue
        lines += [f"loader at batch {rep['settings']['batch_size']} (`dali`: the DALI GPU graph, `dali@cpu`: "
                  "the DALI CPU graph; ceilings on the CPU):", loader_bench.format_table(rep), ""]
    v = report.get("views")
    if v and "error" not in v:
        lines += [f"GPU graph, batch {v['batch_size']}: 6 views (relicv2) {v['relicv2']['img_per_s']:.0f} img/s, "
                  f"1 view {v['relicv2-1view']['img_per_s']:.0f} img/s: 6 views cost {v['cost_6_vs_1']:.2f}× one view"]
    t = report.get("train")
    if t and "error" not in t:
        lines += ["", f"ResNet-50 relicv2 224/96 bf16, batch {t['config']['data']['batch_size']}: "
                  f"{t['img_per_s']:.0f} img/s with the DALI GPU loader, "
                  f"{t['cached_steps_per_s'] * t['config']['data']['batch_size']:.0f} img/s on one batch on the device, "
                  f"data stall {100 * t['data_stall_fraction']:.1f} %, peak {t['peak_mem_mib']:.0f} MiB"]
    for name in ("views", "train"):
        if report.get(name, {}).get("error"):
            lines += ["", f"{name} failed: {report[name]['error']}"]
    tests = report.get("tests")
    if tests:
        c = tests["count"]
        lines += ["", f"tests ({tests['which']}): {c['passed']} passed, {c['failure']} failed, {c['error']} errors, "
                  f"{c['skipped']} skipped in {tests['seconds']:.0f} s"]
        lines += [f"  {x['outcome']}: {x['test']}: {x['message'][:200]}" for x in tests["cases"]
                  if x["outcome"] in ("failure", "error")]
    lines += ["", "targets: " + "; ".join(targets(report))]
    return "\n".join(lines)


def targets(report: dict) -> list[str]:
    """The issue's targets, each with its measured value, met or missed."""
    out = []
    best = [r["img_per_s"] for rep in report.get("loader", {}).values() if "results" in rep
            for r in rep["results"] if r["backend"] == "dali" and r["recipe"] == "relicv2" and r["status"] == "ok"]
    if best:
        b = max(best)
        verdict = "met" if b >= TARGET_IMG_S else "floor met" if b >= FLOOR_IMG_S else "missed"
        out.append(f"relicv2 GPU graph {b:.0f} img/s (target {TARGET_IMG_S}, floor {FLOOR_IMG_S}): {verdict}")
    v = report.get("views", {})
    if "cost_6_vs_1" in v:
        out.append(f"6 views cost {v['cost_6_vs_1']:.2f}× 1 view (≤ {MAX_VIEW_COST}): "
                   + ("met" if v["cost_6_vs_1"] <= MAX_VIEW_COST else "missed"))
    t = report.get("train", {})
    if "data_stall_fraction" in t:
        out.append(f"stall {100 * t['data_stall_fraction']:.1f} % (< {100 * MAX_STALL:.0f} %): "
                   + ("met" if t["data_stall_fraction"] < MAX_STALL else "missed"))
    return out or ["nothing measured"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/gpu-check", help="folder of gpu_check.json and gpu_check.md")
    p.add_argument("--work", default="reports/gpu-check", help="folder of the generated data and the bench JSON files")
    p.add_argument("--tests", choices=("gpu", "all", "none"), default="gpu", help="which tests to run first")
    p.add_argument("--tests-timeout", type=int, default=900, help="seconds before the test run is stopped")
    p.add_argument("--sections", default="loader,views,train,tests", help="comma-separated sections to run")
    p.add_argument("--batch-sizes", default="128,256", help="loader batch sizes")
    p.add_argument("--train-batch", type=int, default=128, help="ResNet-50 batch size")
    p.add_argument("--n", type=int, default=4000, help="generated ImageNet-like train images")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (medians)")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU threads for every loader")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device; run this on a GPU machine (or --quick --device cpu to try it)")
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **header(), "settings": vars(a)}
    sections = a.sections.split(",")

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_check.md").write_text(table(report) + "\n")

    def section(name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            report[name] = fn()
        except Exception as e:  # one broken section is reported; the others still run
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            print(report[name]["traceback"], flush=True)
        print(f"== {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        save()

    if "loader" in sections:
        report["loader"] = {}
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            try:
                report["loader"][f"b{bs}"] = run_loader(work, bs, a.cores, a.n, a.repeats, a.quick, a.device)
            except Exception as e:
                report["loader"][f"b{bs}"] = {"error": f"{type(e).__name__}: {e}",
                                              "traceback": traceback.format_exc(limit=6)}
            save()
    bs = max(int(x) for x in a.batch_sizes.split(","))
    if "views" in sections:
        section("views", lambda: {"batch_size": bs, **run_views(work, bs, a.cores, a.n, a.repeats, a.quick, a.device)})
    if "train" in sections:
        section("train", lambda: run_train(work, a.train_batch, a.cores, a.n, 8, a.repeats, a.quick, a.device))
    if "tests" in sections and a.tests != "none":        # last: the measurements come back even if they hang
        section("tests", lambda: run_tests(a.tests, out, timeout_s=a.tests_timeout))
    print("\n" + "\n".join(header_lines(report)))
    print(table(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
