"""Loader throughput benchmark: `python -m bench.data` (`make bench-data`).

For every recipe × dataset × backend it measures source images/s and views/s of the loader alone
(batches normalised on `--device`; a backend written `name@cpu` or `name@cuda` runs there instead, so
that `dali,dali@cpu` compares the DALI GPU and CPU graphs in one run), with the same number of CPU
cores for every backend (`--cores`: DataLoader workers / DALI threads, and torch's intra-op threads).
Each figure is a steady-state rate (`bench.timing.time_loader`: a fresh loader read epoch after epoch
as training reads it, its first batch — pipeline build, worker start-up, first decodes — reported
apart, then `--warmup-batches` untimed and `--batches` timed batches, whole rounds of the workers of a
DataLoader), the median of `--repeats` runs with their spread (min–max), beside the CPU time of the
thread that takes the batches (the training loop's). The runs go in rounds (`bench.timing.in_rounds`,
the one rounds loop of the benches): each round times the ceilings and every backend once, back to
back, so that a slow spell of a shared machine falls on all of them alike. The ceilings are measured
on the same shard files with the faster of two libjpeg-turbo decoders in `--cores` DataLoader workers
(`bench.timing.time_ceiling`): decode-only, and decode + the recipe's crops and resizes. Each backend is
also run on the recipe with its colour, blur, solarize and saliency ops switched off, which splits its
time into the stages decode (ceiling decode time), crops + resizes, and colour ops (+ transfer and
normalisation).

Datasets (`bench.datasets`, cached in the output folder and reused, all written before any timing):
- `imagenet-like`: generated JPEGs (~500×375, quality 90, textured scenes) written by preprocessing's
  image-folder source;
- `synthetic`: preprocessing's synthetic source.

The peers (`bench.peers`: lightly's transforms in a DataLoader over the same files as an image folder,
an SPDL thread pipeline) are timed in the same rounds as backends; their rows carry their versions and
settings, the ratios the best backend's rate to each peer's; a peer that is not installed or has no
composition for a recipe is a skipped row with why. A backend that fails to import or build is
reported with its error, never skipped silently. The
JSON (`--out`) holds the report header (`bench.report`: machine, versions, commit), the resolved
settings and every run. Other benches call `run(Settings(...))` directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import peers
from bench.datasets import DATASETS, IMAGE_PX, QUICK_IMAGE_PX, BenchError, prepare, view_px
from bench.report import header, header_lines
from bench.timing import crops_only, in_rounds, ladder_cell, stages_ms, time_ceiling, views_per_sample
from pipelines import schema
from pipelines.errors import bad_input
from pipelines.loader import BACKENDS
from pipelines.shards import scan_shards
from pipelines.spec import LoaderSpec
from pipelines.views import load_recipe

RECIPES = ("relicv2", "rsa")
ALL_RECIPES = RECIPES + ("byol", "multicrop8", "plain")
DEFAULT_BACKENDS = ("dali", "ffcv", "torchvision", "torch", *peers.PEERS)   # viewmill's, then the peers'
LOADERS = BACKENDS + tuple(peers.PEERS)


@dataclass(frozen=True)
class Settings:
    """One run of the loader bench (`run`); `parse_args` builds it from a command line."""
    recipes: tuple[str, ...] = RECIPES             # recipe presets (`ALL_RECIPES`)
    datasets: tuple[str, ...] = DATASETS           # bench datasets (`bench.datasets.DATASETS`)
    backends: tuple[str, ...] = DEFAULT_BACKENDS   # loader backends, each optionally `@cpu` / `@cuda`
    n: int = 2000                                  # generated train images per dataset
    repeats: int = 3                               # rounds; every figure is the median over them
    batch_size: int = 32                           # images per batch, even
    worker_batch_size: int | None = None           # batch of the loaders whose workers each make whole
                                                   # batches (`peers.BATCH_WORKERS`); None: batch_size
    batches: int = 16                              # timed batches per run
    warmup_batches: int = 3                        # untimed batches per run, before the timed ones
    cores: int = os.cpu_count() or 1               # workers / threads of every backend and ceiling
    device: str = "cpu"                            # where batches land, unless a backend names its own
    stages: bool = True                            # also time crops-only runs (the stage split)
    quick: bool = False                            # tiny images and views (tests, smoke checks)
    view_px: tuple[int, int] | None = None         # (global, local) view sides; None: each dataset's (`view_px`)
    graph: dict = field(default_factory=dict)      # the DALI graph's `LoaderSpec` options (gpu_contrast, gpu_blur,
                                                   # graph_batches); those not given: LoaderSpec's defaults
    out: Path = Path("reports/pipelines.json")     # the JSON report; the datasets are cached next to it

    def __post_init__(self) -> None:
        for what, items, allowed in (("recipe", self.recipes, ALL_RECIPES), ("dataset", self.datasets, DATASETS),
                                     ("backend", tuple(b.partition("@")[0] for b in self.backends), LOADERS)):
            bad = [x for x in items if x not in allowed]
            if bad or not items:
                raise BenchError(f"unknown {what} {bad or list(items)}; choose from {', '.join(allowed)}")
        bad = [b for b in self.backends if b.partition("@")[2] not in ("", "cpu", "cuda")]
        if bad:
            raise BenchError(f"bad backend {bad}; write <backend> or <backend>@cpu / <backend>@cuda")
        for flag, b in (("--batch-size", self.batch_size), ("--worker-batch-size", self.worker_batch_size)):
            if b is not None and (b % 2 or b < 2):
                raise BenchError(f"{flag} must be even and >= 2, got {b}")
        if self.n < 2 * self.batch_size:     # the runs read epoch after epoch; an epoch is 2 batches at least
            raise BenchError(f"--n {self.n} is smaller than 2 batches of {self.batch_size}; raise --n or lower "
                             "--batch-size")


# ----------------------------------------------------------------------------- report


def operator_counts(loader) -> dict[str, dict[str, int]] | None:
    """Operators per iteration, by device, of a loader that runs a graph (DALI: as defined on the CPU
    and for a GPU), or None."""
    counts = getattr(loader, "operator_counts", None)
    return counts() if counts is not None else None


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def spread(runs: list[float]) -> dict:
    """A rate over the rounds: its median (the figure), min and max (the spread) and the runs."""
    return {"img_per_s": _median(runs), "img_per_s_min": min(runs, default=0.0),
            "img_per_s_max": max(runs, default=0.0), "runs": list(runs)}


def batch_size(s: Settings, loader: str) -> int:
    """The batch of `loader`'s rows: `worker_batch_size` for the loaders whose workers each make whole
    batches, where it is set (their rate per image does not depend on it, and steady state needs whole
    rounds of their workers: `bench.timing.steady_batches`), else `batch_size`."""
    return s.worker_batch_size if s.worker_batch_size and peers.batch_workers(loader, 1) else s.batch_size


def _backend_cell(s: Settings, work: Path, root: Path, name: str, be: str, device: str, recipe):
    """One round of a backend's row: a steady-state run of the full recipe (and of its crops alone, for
    the stage split), and in the first round its graph's operators."""
    backend, batch = be.partition("@")[0], batch_size(s, be)

    def make(epoch: int, rec=recipe):
        spec = LoaderSpec(root=str(root), dataset=name, split="train", recipe=rec, batch_size=batch,
                          seed=0, device=device, num_workers=s.cores, **s.graph)
        loader = peers.build(backend, spec, work / "peer-folders")
        loader.set_epoch(epoch)
        return loader

    workers = 0 if s.quick else peers.batch_workers(be, s.cores)
    rungs = {"full": recipe, **({"crops_only": crops_only(recipe)} if s.stages else {})}
    timed = ladder_cell(lambda rec, epoch: make(epoch, rec), rungs, s.batches, s.warmup_batches, device, workers)

    def run(rnd: int) -> dict[str, list]:
        out = timed(rnd)
        print(f"{name} {recipe.name} {be} round {rnd + 1}: {out['full'][0]:,.0f} img/s, first batch "
              f"{out['first_batch_s'][0]:.1f} s", flush=True)
        if rnd == 0:
            out["operators"] = [operator_counts(make(0))]
        return out
    return run


def stage_shares(full: float, crops: float | None, decode: float | None) -> dict | None:
    """One image's time split into decode (with the read), crops + resizes, and colour ops + the rest,
    as shares of their sum (`bench.timing.stages_ms` of the full and crops-only runs)."""
    if not full or not crops or not decode:
        return None
    ms = stages_ms({"full": full, "crops_only": crops}, decode)
    parts = {"decode": ms["decode"], "crops_resizes": ms["crops_resize_rest"], "colour_and_rest": ms["colour"]}
    total = sum(parts.values())
    return {k: v / total for k, v in parts.items()}


def ratios(results: list[dict], ceilings: list[dict]) -> list[dict]:
    """Per dataset × recipe: best backend vs torchvision, DALI vs torchvision, best vs ceiling."""
    out = []
    for ds, rc in sorted({(r["dataset"], r["recipe"]) for r in results}):
        ok = {r["backend"]: r["img_per_s"] for r in results
              if r["dataset"] == ds and r["recipe"] == rc and r["status"] == "ok"}
        ceil = {c["kind"]: c["img_per_s"] for c in ceilings if c["dataset"] == ds and c["recipe"] == rc}
        ours = {be: v for be, v in ok.items() if be.partition("@")[0] not in peers.PEERS}
        best = max(ours, key=ours.get) if ours else None
        base = ok.get("torchvision")
        out.append({
            "dataset": ds, "recipe": rc, "best_backend": best,
            "best_vs_torchvision": ok[best] / base if best and base else None,
            "dali_vs_torchvision": ok["dali"] / base if "dali" in ok and base else None,
            "ffcv_vs_torchvision": ok["ffcv"] / base if "ffcv" in ok and base else None,
            "ceiling_decode_crops_vs_best": ceil["decode+crops"] / ok[best] if best and ceil.get("decode+crops") else None,
            **{f"best_vs_{p}": ok[best] / ok[p] if best and p in ok else None for p in peers.PEERS},
        })
    return out


def _rate(r: dict) -> str:
    """A rate with its spread over the rounds: median (min–max)."""
    if len(r.get("runs", [])) < 2:
        return f"{r['img_per_s']:,.0f}"
    return f"{r['img_per_s']:,.0f} ({r['img_per_s_min']:,.0f}–{r['img_per_s_max']:,.0f})"


def format_table(report: dict) -> str:
    """The Markdown table of a report (printed, and copied into docs/benchmarks.md): per row one
    steady-state rate, the median over the rounds with its spread (min–max); the first batch (build,
    workers, first decodes) and the CPU of the thread that takes the batches apart."""
    rows = ["| dataset | recipe | backend / ceiling | img/s (min–max) | views/s | × torchvision | first batch s | "
            "taking thread ms/batch | decode | crops+resize | colour+rest | status |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    pct = lambda s, k: f"{100 * s[k]:.0f} %" if s else "–"   # noqa: E731
    for r in report["results"]:
        base = next((b["img_per_s"] for b in report["results"] if b["dataset"] == r["dataset"]
                     and b["recipe"] == r["recipe"] and b["backend"] == "torchvision" and b["status"] == "ok"), None)
        notes = [f"{r['workers']} workers"] if peers.batch_workers(r["backend"], r["workers"]) else []
        if r.get("batch_size", report["settings"]["batch_size"]) != report["settings"]["batch_size"]:
            notes.append(f"batch {r['batch_size']}")
        label = r["backend"] + (f" ({', '.join(notes)})" if notes else "")
        if r["status"] != "ok":
            why = r["error"].splitlines()[0][:90] if r["status"] == "failed" else r["note"]
            rows.append(f"| {r['dataset']} | {r['recipe']} | {label} | – | – | – | – | – | – | – | – | "
                        f"{r['status']}: {why} |")
            continue
        s = r.get("stage_share")
        rows.append(f"| {r['dataset']} | {r['recipe']} | {label} | {_rate(r)} | {r['views_per_s']:,.0f} | "
                    f"{r['img_per_s'] / base:.2f} |" if base else
                    f"| {r['dataset']} | {r['recipe']} | {label} | {_rate(r)} | {r['views_per_s']:,.0f} | – |")
        rows[-1] += (f" {r['first_batch_s']:.2f} | {r['thread_cpu_ms']:.1f} | {pct(s, 'decode')} | "
                     f"{pct(s, 'crops_resizes')} | {pct(s, 'colour_and_rest')} | ok |")
    for c in report["ceilings"]:
        rows.append(f"| {c['dataset']} | {c['recipe']} | ceiling: {c['kind']} ({c['decoder']}, "
                    f"{report['settings']['cores']} workers) | {_rate(c)} | {c['views_per_s']:,.0f} | – | – | – | – | "
                    "– | – | ok |")
    return "\n".join(rows + operator_lines(report["results"]))


def operator_lines(rows: list[dict]) -> list[str]:
    """One line per graph-running backend and recipe: its operators per iteration, by device."""
    def fmt(counts: dict[str, int]) -> str:
        return " / ".join(f"{counts.get(d, 0)} {d}" for d in ("cpu", "gpu", "mixed") if counts.get(d, 0) or d == "cpu")

    lines = [f"{r['backend']} operators per iteration, {r['recipe']}: GPU graph {fmt(r['operators']['gpu_graph'])}; "
             f"CPU graph {fmt(r['operators']['cpu_graph'])}" for r in rows if r.get("operators")]
    return [""] + lines if lines else []


# ----------------------------------------------------------------------------- main


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


def _items(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _view_px(value: str | None) -> tuple[int, int] | None:
    sides = value.split(",") if value else []
    if value and (len(sides) != 2 or not all(x.strip().isdigit() and int(x) > 0 for x in sides)):
        raise BenchError(f"--view-px {value!r}: write two positive sides, global,local (e.g. 32,16)")
    return (int(sides[0]), int(sides[1])) if value else None


def parse_args(argv: list[str] | None = None) -> Settings:
    """The command line as `Settings`.

    Raises:
        BenchError: an unknown recipe, dataset or backend, or sizes that do not fit.
    """
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe presets")
    p.add_argument("--datasets", default=",".join(DATASETS), help="imagenet-like, synthetic")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help=f"from {', '.join(LOADERS)}")
    p.add_argument("--n", type=int, default=None, help="train images generated per dataset (default 2000; quick 48)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per cell; the median is reported (default 3)")
    p.add_argument("--batch-size", type=int, default=None, help="images per batch (default 32; quick 8)")
    p.add_argument("--worker-batch-size", type=int, default=None,
                   help="images per batch of the loaders whose DataLoader workers each make whole batches "
                        "(torchvision, torch, lightly; default --batch-size)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per run (default 16; quick 2)")
    p.add_argument("--warmup-batches", type=int, default=None, help="untimed batches per run (default 3; quick 1)")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU workers/threads for every backend")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where batches land")
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip the crops-only runs that split each backend's time into stages")
    p.add_argument("--quick", action="store_true", help="tiny data and runs (tests)")
    p.add_argument("--view-px", default=None, help="global,local view sides in px (default: each dataset's)")
    p.add_argument("--out", default="reports/pipelines.json", help="JSON report; datasets are cached next to it")
    a = fill_sizes(p.parse_args(argv))
    return Settings(recipes=_items(a.recipes), datasets=_items(a.datasets), backends=_items(a.backends), n=a.n,
                    repeats=a.repeats, batch_size=a.batch_size, worker_batch_size=a.worker_batch_size,
                    batches=a.batches, warmup_batches=a.warmup_batches,
                    cores=a.cores, device=a.device, stages=a.stages, quick=a.quick, out=Path(a.out),
                    view_px=_view_px(a.view_px))


def run(s: Settings) -> dict:
    """Run the benchmark; returns the report (also written to `s.out`)."""
    work = s.out.parent / "bench-data"
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(s.cores)
    # Every dataset is written before the first loader starts: preprocessing forks its workers from
    # this process, which is then still free of loader threads and pipelines.
    prepared = {ds: prepare(ds, work, s.n, s.quick, s.cores) for ds in s.datasets}
    report: dict = {
        **header(),
        "settings": {"recipes": list(s.recipes), "datasets": list(s.datasets), "backends": list(s.backends),
                     "n_images": s.n, "repeats": s.repeats, "batch_size": s.batch_size,
                     "worker_batch_size": s.worker_batch_size, "timed_batches": s.batches,
                     "warmup_batches": s.warmup_batches, "cores": s.cores, "device": s.device, "stages": s.stages,
                     "quick": s.quick, "sizes_px": {d: s.view_px or view_px(d, s.quick) for d in s.datasets},
                     "graph": s.graph,
                     "imagenet_like_image_px": QUICK_IMAGE_PX if s.quick else IMAGE_PX,
                     "jpeg_quality": schema.JPEG_QUALITY,
                     "statistic": "steady state after warm-up, median over repeats (min, max)"},
        "results": [], "ceilings": [], "recipes": {},
    }
    for ds, (root, name) in prepared.items():
        entries = scan_shards(root / name / "train")
        gpx, lpx = s.view_px or view_px(ds, s.quick)
        # The ceiling decoder: the faster of two libjpeg-turbo decoders, from one run each.
        steady = not s.quick                # quick: a smoke run, not whole rounds of the workers
        probe = {dec: time_ceiling(entries, dec, None, s.batch_size, s.batches, s.warmup_batches, 1, s.cores,
                                   steady=steady)[0] for dec in ("pil", "torchvision.io")}
        decoder = max(probe, key=probe.get)
        recipes = {rc: load_recipe(rc, gpx, lpx) for rc in s.recipes}
        cells = {("decode", None): lambda rnd: {"img_per_s": time_ceiling(
            entries, decoder, None, s.batch_size, s.batches, s.warmup_batches, 1, s.cores, rnd, steady)}}
        rows = {}
        for rc, recipe in recipes.items():
            report["recipes"][f"{rc}@{gpx}/{lpx}"] = [dataclasses.asdict(g) for g in recipe.groups]
            cells[("decode+crops", rc)] = lambda rnd, recipe=recipe: {"img_per_s": time_ceiling(
                entries, decoder, recipe, s.batch_size, s.batches, s.warmup_batches, 1, s.cores, rnd, steady)}
            for be in s.backends:
                device = be.partition("@")[2] or s.device
                rows[(rc, be)] = {"dataset": ds, "recipe": rc, "backend": be, "device": device,
                                  "workers": s.cores, "batch_size": batch_size(s, be),
                                  "views_per_sample": views_per_sample(recipe),
                                  **peers.row_fields(be, recipe, "none")}
                if rows[(rc, be)].get("status") != "skipped":
                    cells[(be, rc)] = _backend_cell(s, work, root, name, be, device, recipe)
        timed = in_rounds(s.repeats, cells, done=lambda rnd: print(f"{ds}: round {rnd + 1}/{s.repeats} done",
                                                                    flush=True))
        decode = timed[("decode", None)]
        for rc, recipe in recipes.items():
            crops = timed[("decode+crops", rc)]
            crop_views = sum(g.count for g in recipe.crop_groups)
            for kind, cell, views in (("decode", decode, 0), ("decode+crops", crops, crop_views)):
                report["ceilings"].append({"dataset": ds, "recipe": rc, "kind": kind, "decoder": decoder,
                                           **spread(cell.runs.get("img_per_s", [])), "views_per_s":
                                           _median(cell.runs.get("img_per_s", [])) * views, "probe": probe})
            for be in s.backends:
                row, cell = rows[(rc, be)], timed.get((be, rc))
                if cell is not None and not cell.ok:
                    row.update(status="failed", error=cell.error, traceback=cell.traceback)
                elif cell is not None:
                    r = cell.runs
                    full, crops_only_rate = _median(r["full"]), _median(r.get("crops_only", [])) or None
                    row.update(status="ok", **spread(r["full"]), views_per_s=full * row["views_per_sample"],
                               first_batch_s=_median(r["first_batch_s"]), thread_cpu_ms=_median(r["thread_cpu_ms"]),
                               cpu_utilisation=_median([u for u in r["cpu_utilisation"] if u is not None]) or None,
                               crops_only_runs=r.get("crops_only", []), crops_only_img_per_s=crops_only_rate,
                               stage_share=stage_shares(full, crops_only_rate,
                                                        _median(decode.runs.get("img_per_s", []))),
                               operators=(r.get("operators") or [None])[0])
                report["results"].append(row)
                print(f"{ds} {rc} {be}: " + (f"{row['img_per_s']:.1f} img/s" if row["status"] == "ok" else
                                             row.get("note") or row["error"]), flush=True)
    report["ratios"] = ratios(report["results"], report["ceilings"])
    s.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = s.out.with_name(f".{s.out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, s.out)
    return report


def main(argv: list[str] | None = None) -> None:
    """Run the command line, print the header, the table and the ratios."""
    s = parse_args(argv)
    report = run(s)
    print("\n" + "\n".join(header_lines(report)) + f"\ncores used {s.cores}; device {s.device}")
    print(format_table(report))
    for r in report["ratios"]:
        print(f"{r['dataset']} {r['recipe']}: best {r['best_backend']} "
              + ", ".join(f"{k} {r[k]:.2f}" for k in ("best_vs_torchvision", "dali_vs_torchvision",
                                                       *(f"best_vs_{p}" for p in peers.PEERS),
                                                       "ceiling_decode_crops_vs_best") if r[k] is not None))
    print(f"wrote {s.out}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as exc:
        sys.exit(bad_input(exc))
