"""`python -m bench.profile` (`make profile`): one throughput report, where the time goes, against the
torchvision baseline and the decode ceilings; `python -m bench.profile compare A B`
(`make profile-compare`) compares two reports.

Sections, each figure the median of `--repeats` timed runs after warm-up with its min and max:

1. **loader**: per recipe × backend on `--dataset` (the loader alone, batches on `--device`): source
   images/s, views/s, the machine's CPU utilisation while timed, the ratios to the torchvision
   baseline and to the read / decode / decode + crops ceilings measured on the same shard files
   (`bench.timing`, as the data bench times them), and the time per image split into stages by an
   ablation ladder: the backend with the recipe's mix off, then blur off, then every colour op off
   (crops only).
   A recipe may name an intra-batch mix: `byol+sdmp`, `plain+dacl`.
   The peers (`bench.peers`: lightly's transforms in a DataLoader, an SPDL thread pipeline) are timed
   as backends on the same files, with their versions and settings; each row gives its ratio to each
   peer; a peer that is not installed or has no composition for a recipe is a skipped row with why.
   On the first recipe every backend and peer is also built once more and read for `--epochs` whole
   epochs of `--epoch-batches` batches: the time from building it to its first batch, and the longest
   gap at an epoch boundary against the mean gap between batches (`bench.timing.time_epochs`).
2. **train**: per method, the loop's `train_step` with the real loader and with the same batch kept
   on the device (`bench.train.time_steps`), the data-stall fraction `1 - real / on-device`, the
   step split into data wait, forward, backward, optimiser and EMA (the `train.loop.phase` ranges,
   read from one torch.profiler round; `--trace` also writes its Chrome trace) and peak memory.
   Each method runs in a fresh process, so that the CPU peak (ru_maxrss) is its own.
3. **scaling**: loader images/s against worker count (1, 2, 4, ... up to `--cores`) and on-device
   trainer images/s against batch size.

Loader cells are timed in rounds (`bench.timing.in_rounds`, as the data bench's): each round times
every ceiling and every backend once, back to back, so that a slow spell of the machine falls on all of
them alike; a method's real and on-device runs alternate the same way. Loader rates are steady state
(`bench.timing.time_loader`), each row with the CPU of the thread that takes the batches. On a CPU the
trainer runs the `synthetic` preset (the demo's network); on a GPU, ResNet-50 with bf16 and
channels-last on the loader's dataset. The report states the device of every figure. Writes
`<out>/profile-<UTC time>/` with `profile.json` (schema: `bench/profile_schema.json`, version 1),
`profile.md` and PNG charts.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import peers, profile_report
from bench.data import fill_sizes, operator_counts
from bench.datasets import DATASETS, BenchError, prepare, view_px
from bench.report import header
from bench.timing import (crops_only, in_rounds, ladder_cell, stages_ms, sync, time_ceiling, time_epochs,
                          time_loader, views_per_sample, without_blur)
from bench.train import in_fresh_process, peak_memory_mb, time_steps
from pipelines.errors import bad_input
from pipelines.loader import BACKENDS
from pipelines.mixing import MIX_KINDS, MixSpec
from pipelines.shards import scan_shards
from pipelines.spec import LoaderSpec
from pipelines.views import Recipe, load_recipe
from train import schedules
from train.config import ConfigError, to_dict
from train.loop import STEP_PHASES, epochs_from, phase, train_step
from train.objectives import OBJECTIVES
from train.resolve import load_config
from train.setup import build_parts, resolve_backend, select_device

RECIPES = "relicv2,rsa,byol+sdmp,multicrop8"
LOADERS = BACKENDS + tuple(peers.PEERS)           # viewmill's backends, then the peers (`bench.peers`)


class ProfileError(ValueError):
    """Bad profile arguments, with the fix."""


def stat(runs: list[float]) -> dict:
    """A timed figure: median, min, max and the runs."""
    runs = [float(x) for x in runs]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def worker_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below `cores`, then `cores`."""
    counts, k = [], 1
    while k < cores:
        counts.append(k)
        k *= 2
    return counts + [cores]


def recipe_cell(name: str, gpx: int, lpx: int) -> tuple[Recipe, MixSpec]:
    """`relicv2` or `byol+sdmp`: a recipe preset and an optional intra-batch mix, with the settings of
    the method of that name (`sdmp`: Beta(1, 1) on the global views; `dacl`: U(0.9, 1) on the image)."""
    recipe, _, mix = name.partition("+")
    if mix and mix not in MIX_KINDS:
        raise ProfileError(f"unknown mix {mix!r} in recipe {name!r}; write <recipe>+<mix> with a mix from "
                           f"{', '.join(k for k in MIX_KINDS if k != 'none')}")
    spec = load_config([f"method={mix}", "data=synthetic"]).data.mix if mix else MixSpec()
    return load_recipe(recipe, gpx, lpx), spec


# ----------------------------------------------------------------------------- 1. loader


def _ladder(recipe: Recipe, mix: MixSpec) -> dict[str, tuple[Recipe, MixSpec]]:
    """The runs whose differences give the stages: full, then mix off, blur off, colour off."""
    no_mix = MixSpec()
    runs = {"full": (recipe, mix)}
    if mix.kind != "none":
        runs["no_mix"] = (recipe, no_mix)
    if any(g.blur_p > 0 for g in recipe.groups):
        runs["no_blur"] = (without_blur(recipe), no_mix)
    runs["crops_only"] = (crops_only(recipe), no_mix)
    return runs


def profile_loader(a: argparse.Namespace, root: Path, name: str, recipes: list[str], backends: list[str],
                   sizes: tuple[int, int]) -> tuple[list[dict], list[dict], list[dict]]:
    """Loader rows, ceilings and worker scaling on one dataset (see the module docstring)."""
    entries = scan_shards(root / name / "train")
    ceil_args = (a.batch_size, a.batches, a.warmup_batches)
    # The ceiling decoder: the faster of two libjpeg-turbo decoders, from one probe run each.
    steady = not a.quick                    # quick: a smoke run, not whole rounds of the workers
    probe = {d: time_ceiling(entries, d, None, *ceil_args, 1, a.cores, steady=steady)[0]
             for d in ("pil", "torchvision.io")}
    decoder = max(probe, key=probe.get)
    cells = {rc: recipe_cell(rc, *sizes) for rc in recipes}
    folders = Path(a.out) / "bench-data" / "peer-folders"

    def make(be: str, recipe: Recipe, mix: MixSpec, workers: int, epoch: int, limit: int = 0):
        backend, _, device = be.partition("@")
        spec = LoaderSpec(root=str(root), dataset=name, split="train", recipe=recipe, mix=mix,
                          batch_size=a.batch_size, seed=0, device=device or a.device, num_workers=workers,
                          limit=limit)
        loader = peers.build(backend, spec, folders)
        loader.set_epoch(epoch)
        return loader

    def backend_cell(rc: str, be: str):
        recipe, mix = cells[rc]
        device = be.partition("@")[2] or a.device
        workers = 0 if a.quick else peers.batch_workers(be, a.cores)
        timed = ladder_cell(lambda rung, epoch: make(be, *rung, a.cores, epoch), _ladder(recipe, mix), a.batches,
                            a.warmup_batches, device, workers)

        def run(rnd: int) -> dict[str, list]:
            out = timed(rnd)
            if rnd == 0:
                out["operators"] = [operator_counts(make(be, recipe, mix, a.cores, 0))]
            if rc == recipes[0]:   # first batch and epoch boundaries: whole short epochs
                e = time_epochs(lambda ep: make(be, recipe, mix, a.cores, ep, a.epoch_batches * a.batch_size),
                                a.epochs, device, first_epoch=rnd * a.epochs)
                out.update(first=[e.first_batch_s], median=[1000 * e.median_gap_s], gap=[1000 * e.mean_gap_s],
                           boundary=[1000 * max(e.boundary_gaps_s)])
            return out
        return run

    ceiling = lambda d, recipe=None: lambda rnd: {"img_per_s": time_ceiling(   # noqa: E731
        entries, d, recipe, *ceil_args, 1, a.cores, rnd, steady)}
    timed_cells = {("read", None): ceiling("read"), ("decode", None): ceiling(decoder)}
    rows = {}
    for rc, (recipe, mix) in cells.items():
        timed_cells[("decode+crops", rc)] = ceiling(decoder, recipe)
        for be in backends:
            rows[(rc, be)] = {"recipe": rc, "backend": be, "device": be.partition("@")[2] or a.device, "status": "ok",
                              **peers.row_fields(be, recipe, mix.kind)}
            if rows[(rc, be)]["status"] == "ok":
                timed_cells[(rc, be)] = backend_cell(rc, be)
    timed = in_rounds(a.repeats, timed_cells, done=lambda rnd: print(f"  loader round {rnd + 1}/{a.repeats} done",
                                                                       flush=True))

    read, decode = stat(timed[("read", None)].runs["img_per_s"]), stat(timed[("decode", None)].runs["img_per_s"])
    crop_ceiling = {rc: timed[("decode+crops", rc)].runs["img_per_s"] for rc in recipes}
    ceilings = [{"recipe": None, "kind": "read", "decoder": "none", "img_per_s": read},
                {"recipe": None, "kind": "decode", "decoder": decoder, "img_per_s": decode, "probe": probe}]
    ceilings += [{"recipe": rc, "kind": "decode+crops", "decoder": decoder, "img_per_s": stat(runs)}
                 for rc, runs in crop_ceiling.items()]
    out = []
    for (rc, be), row in rows.items():
        cell = timed.get((rc, be))
        if cell is not None and not cell.ok:
            row.update(status="failed", error=cell.error, traceback=cell.traceback)
        if row["status"] == "ok":
            r = cell.runs
            ladder = {k: r[k] for k in _ladder(*cells[rc])}
            util = [u for u in r["cpu_utilisation"] if u is not None]
            full = stat(ladder["full"])
            row.update(img_per_s=full, views_per_s=full["median"] * views_per_sample(cells[rc][0]),
                       cpu_utilisation=statistics.median(util) if util else None,
                       thread_cpu_ms=stat(r["thread_cpu_ms"]), operators=r["operators"][0],
                       vs_ceiling_decode=full["median"] / decode["median"],
                       vs_ceiling_decode_crops=statistics.median(crop_ceiling[rc]) / full["median"],
                       stages_ms=stages_ms({k: statistics.median(v) for k, v in ladder.items()},
                                           decode=decode["median"], read=read["median"]),
                       ladder_img_per_s={k: stat(v) for k, v in ladder.items()})
            if rc == recipes[0]:
                row.update(first_batch_s=stat(r["first"]), epoch_boundary={
                    "median_gap_ms": stat(r["median"]), "mean_gap_ms": stat(r["gap"]),
                    "longest_boundary_gap_ms": stat(r["boundary"]),
                    "stall": stat([b / g for b, g in zip(r["boundary"], r["gap"])])})
        out.append(row)
    for row in out:                       # the ratios to the baseline and the peers, once every row has its rate
        if row["status"] != "ok":
            continue
        ratio = {}                        # every peer asked for: None where it was skipped or failed
        for other in ("torchvision", *(p for p in peers.PEERS if (row["recipe"], p) in rows)):
            o = rows.get((row["recipe"], other))
            ratio[other] = (row["img_per_s"]["median"] / o["img_per_s"]["median"]
                            if o and o["status"] == "ok" else None)
        row["vs_torchvision"] = ratio.pop("torchvision")
        row["vs_peers"] = ratio

    scaling = []
    counts = [w for w in worker_counts(a.cores) if w != a.cores] if a.scaling else []
    rc0 = recipes[0]
    ok = [r for r in out if r["recipe"] == rc0 and r["status"] == "ok" and r["backend"] not in peers.PEERS]
    points = in_rounds(a.repeats, {(r["backend"], w): (lambda rnd, be=r["backend"], w=w: {"img_per_s": list(time_loader(
        lambda e: make(be, *cells[rc0], w, rnd + e), a.batches, a.warmup_batches, 1, be.partition("@")[2] or a.device,
        0 if a.quick else peers.batch_workers(be, w)).img_per_s)}) for r in ok for w in counts})
    for (be, w), cell in points.items():
        if cell.ok:
            scaling.append({"recipe": rc0, "backend": be, "workers": w, "img_per_s": stat(cell.runs["img_per_s"])})
    if a.scaling:
        scaling += [{"recipe": rc0, "backend": r["backend"], "workers": a.cores, "img_per_s": r["img_per_s"]}
                    for r in ok]
    return out, ceilings, sorted(scaling, key=lambda s: (s["backend"], s["workers"]))


# ----------------------------------------------------------------------------- 2. train


def step_split(cfg, parts, batches, device: torch.device, steps: int, trace: Path | None) -> dict[str, float]:
    """Mean ms per step in each `STEP_PHASES` range, from one torch.profiler round of `steps` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for i in range(steps):
            with phase("data_wait"):
                batch = next(batches)
            train_step(parts, batch, schedules.at(cfg.optim, i, len(parts.loader), cfg.data.batch_size))
        sync(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    split = dict.fromkeys(STEP_PHASES, 0.0)
    for event in prof.key_averages():
        name = event.key.removeprefix("step/")
        if event.key.startswith("step/") and name in split:
            # On a GPU the ranges' device time where the profiler has one; else their wall time.
            device_us = getattr(event, "device_time_total", 0) if device.type == "cuda" else 0
            split[name] = (device_us or event.cpu_time_total) / 1000.0 / steps
    return split


def profile_method(method: str, words: list[str], steps: int, repeats: int, trace: str | None) -> dict:
    """One method's train row (run in a fresh process, see the module docstring)."""
    cfg = load_config([f"method={method}", *words])
    device = select_device(cfg.run.device)
    row: dict = {"method": method, "device": device.type, "status": "ok"}
    try:
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
            torch.cuda.reset_peak_memory_stats()
        parts = build_parts(cfg, device, resolve_backend(cfg, device))
        batches = epochs_from(parts.loader, 0, len(parts.loader), None)    # one iterator for both
        t = time_steps(cfg, device, steps, repeats, warmup_steps=2, parts=parts, batches=batches)
        split = step_split(cfg, parts, batches, device, steps, Path(trace) if trace else None)
        row.update(batch_size=cfg.data.batch_size, backend=resolve_backend(cfg, device),
                   steps_per_s=stat(t["steps_per_s_runs"]), on_device_steps_per_s=stat(t["cached_steps_per_s_runs"]),
                   img_per_s=t["img_per_s"], data_stall_fraction=t["data_stall_fraction"], split_ms=split,
                   peak_mem_mb=peak_memory_mb(device), config=to_dict(cfg))
    except Exception as exc:              # reported in the table, never skipped silently
        row.update(status="failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0],
                   traceback=traceback.format_exc(limit=4))
    return row


def profile_batches(method: str, words: list[str], sizes: list[int], steps: int, repeats: int) -> list[dict]:
    """On-device trainer images/s of `method` at each batch size (fresh process); a size the method
    refuses (relicv2 needs more samples than its negatives) is left out with a printed note."""
    out = []
    for b in sizes:
        cfg = load_config([f"method={method}", *words, f"data.batch_size={b}"])
        device = select_device(cfg.run.device)
        try:
            t = time_steps(cfg, device, steps, repeats, warmup_steps=2)
        except ValueError as e:
            print(f"  batch scaling: {method} at batch {b} left out ({e})", flush=True)
            continue
        out.append({"method": method, "batch_size": b, "img_per_s": stat([r * b for r in t["cached_steps_per_s_runs"]])})
    return out


def train_words(a: argparse.Namespace, work: Path) -> list[str]:
    """The trainer's config words: the demo preset on a CPU, ResNet-50 on the loader's data on a GPU."""
    if a.device == "cuda":
        root, name = prepare(a.dataset, work, a.n, a.quick, a.cores)
        gpx, lpx = view_px(a.dataset, a.quick)
        words = ["data=imagenet", f"data.name={name}", f"data.root={root}", "data.backend=dali",
                 f"views.global_px={gpx}", f"views.local_px={lpx}", "model.backbone=resnet50",
                 "run.amp=true", "model.channels_last=true", "run.device=cuda", "data.batch_size=128"]
    else:
        root, name = prepare("synthetic", work, a.n, a.quick, a.cores)
        words = ["data=synthetic", f"data.root={root}", "run.device=cpu"]
    # quick: the smallest batch every method takes (relicv2 samples 10 negatives among the others)
    words += [f"data.num_workers={a.cores}"] + (["data.batch_size=12"] if a.quick else [])
    return words + a.train_args


# ----------------------------------------------------------------------------- main


def _csv(value: str, allowed, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v.partition("@")[0].partition("+")[0] not in allowed]
    if bad or not items:
        raise ProfileError(f"unknown {what} {', '.join(bad) or repr(value)}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: list[str], prog: str = "python -m bench.profile") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="imagenet-like", choices=DATASETS,
                   help="the loader's data (generated, cached under <out>/bench-data)")
    p.add_argument("--recipes", default=RECIPES, help="view recipes, each optionally +sdmp or +dacl")
    p.add_argument("--backends", default=",".join(LOADERS),
                   help="from " + ", ".join(LOADERS) + " (the last two: peers, bench.peers)")
    p.add_argument("--methods", default=",".join(sorted(OBJECTIVES)), help="objectives to time")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 3; quick 1)")
    p.add_argument("--n", type=int, default=None, help="train images per generated dataset (default 2000; quick 48)")
    p.add_argument("--batch-size", type=int, default=None, help="loader batch (default 32; quick 8)")
    p.add_argument("--batches", type=int, default=None, help="timed loader batches per run (default 16; quick 2)")
    p.add_argument("--warmup-batches", type=int, default=None, help="untimed batches per run (default 3; quick 1)")
    p.add_argument("--epochs", type=int, default=3, help="epochs read for the first-batch and epoch-boundary "
                   "figures (first recipe), >= 2")
    p.add_argument("--epoch-batches", type=int, default=None, help="batches per epoch there (default 8; quick 2)")
    p.add_argument("--train-steps", type=int, default=None, help="timed training steps per run (default 10; quick 2)")
    p.add_argument("--train-args", default="", help="extra trainer key=value words, space-separated")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="workers / threads of every loader")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--no-scaling", dest="scaling", action="store_false", help="skip the scaling section")
    p.add_argument("--trace", action="store_true", help="write a torch.profiler Chrome trace per method")
    p.add_argument("--quick", action="store_true", help="tiny data and runs (seconds: tests, smoke checks)")
    p.add_argument("--out", default="reports", help="the report folder goes here")
    a = fill_sizes(p.parse_args(argv))
    a.train_steps = a.train_steps or (2 if a.quick else 10)
    a.epoch_batches = a.epoch_batches or (2 if a.quick else 8)
    a.train_args = a.train_args.split()
    a.recipes = _csv(a.recipes, ("relicv2", "rsa", "byol", "multicrop8", "plain"), "recipe")
    a.backends = _csv(a.backends, LOADERS, "backend")
    a.methods = _csv(a.methods, sorted(OBJECTIVES), "method")
    for rc in a.recipes:
        recipe_cell(rc, 32, 16)
    if a.batch_size % 2 or a.n < 2 * a.batch_size:
        raise ProfileError(f"--batch-size {a.batch_size} must be even and --n {a.n} at least 2 batches")
    if a.epochs < 2 or a.epoch_batches < 2 or a.n < a.batch_size * a.epoch_batches:
        raise ProfileError(f"--epochs {a.epochs} and --epoch-batches {a.epoch_batches} must be >= 2, and --n "
                           f"{a.n} at least epoch batches × batch size")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda on a machine without CUDA; drop it (the default follows the machine)")
    return a


def run(a: argparse.Namespace) -> tuple[dict, Path]:
    """Measure everything; returns the report and its folder (written by `profile_report.write`)."""
    created = datetime.datetime.now(datetime.timezone.utc)
    out = Path(a.out) / f"profile-{created:%Y%m%d-%H%M%S}"
    work = Path(a.out) / "bench-data"
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.cores)
    words = train_words(a, work)
    for method in a.methods:                       # bad trainer words fail here, before any timing
        load_config([f"method={method}", *words])
    out.mkdir(parents=True)
    sizes = view_px(a.dataset, a.quick)
    print(f"profile → {out}: loader on {a.dataset} ({', '.join(a.recipes)}; {', '.join(a.backends)}), "
          f"{a.repeats} rounds", flush=True)
    root, name = prepare(a.dataset, work, a.n, a.quick, a.cores)
    t0 = time.perf_counter()
    rows, ceilings, loader_scaling = profile_loader(a, root, name, a.recipes, a.backends, sizes)
    print(f"  loader: {time.perf_counter() - t0:.0f} s", flush=True)
    train_rows = []
    for method in a.methods:
        trace = str(out / f"trace-{method}.json") if a.trace else None
        train_rows.append(in_fresh_process(profile_method, method, words, a.train_steps, a.repeats, trace))
        r = train_rows[-1]
        print(f"  train {method}: " + (f"{r['steps_per_s']['median']:.2f} steps/s, stall "
                                      f"{100 * r['data_stall_fraction']:.1f}%" if r["status"] == "ok" else r["error"]),
              flush=True)
    batch_scaling = []
    first_ok = next((r for r in train_rows if r["status"] == "ok"), None)
    if a.scaling and first_ok:
        b = first_ok["batch_size"]
        sizes_b = sorted({max(2, b // 4 // 2 * 2), max(2, b // 2 // 2 * 2), b, 2 * b})
        batch_scaling = in_fresh_process(profile_batches, first_ok["method"], words, sizes_b,
                                         a.train_steps, a.repeats)
    configs = {r["method"]: r.pop("config") for r in train_rows if "config" in r}
    head = header()                      # the schema keeps the commit under config
    report = {
        "schema_version": profile_report.SCHEMA_VERSION, "created": created.isoformat(timespec="seconds"),
        "machine": head["machine"], "versions": head["versions"],
        "config": {"git": head["git"], "dataset": a.dataset, "recipes": a.recipes,
                   "backends": a.backends, "methods": a.methods, "repeats": a.repeats,
                   "warmup_batches": a.warmup_batches, "warmup_steps": 2, "batch_size": a.batch_size,
                   "batches": a.batches, "train_steps": a.train_steps, "cores": a.cores, "device": a.device,
                   "epochs": a.epochs, "epoch_batches": a.epoch_batches,
                   "peers": {p: peers.version(p) for p in peers.PEERS if p in a.backends},
                   "quick": a.quick, "sizes_px": list(sizes), "n_images": a.n, "train_overrides": words,
                   "train_config": configs},
        "loader": {"rows": rows, "ceilings": ceilings},
        "train": {"rows": train_rows},
        "scaling": {"loader": loader_scaling, "batch": batch_scaling},
    }
    return report, out


def main(argv: list[str] | None = None, prog: str = "python -m bench.profile") -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["compare"]:
            return profile_report.compare_main(argv[1:])
        a = parse_args(argv, prog)
        missing = [m for m in ("matplotlib", "jsonschema") if importlib.util.find_spec(m) is None]
        if missing:
            raise ProfileError(f"the profile report needs {' and '.join(missing)}; install them with "
                               "pip install 'viewmill[profile]' (a checkout: make install)")
        report, out = run(a)
    except (ProfileError, ConfigError, profile_report.ReportError, BenchError) as exc:
        return bad_input(exc)
    profile_report.write(report, out)
    print(profile_report.markdown(report, charts=False))
    print(f"wrote {out / 'profile.json'}, {out / 'profile.md'} and {len(report['charts'])} charts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
