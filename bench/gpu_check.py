"""`python -m bench.gpu_check`: the GPU-resident path checked and measured in one go, into one report,
within about 7 minutes on one H100 or H200 (a GPU machine lent for a short time slot, DALI installed in it).

On the GPU machine, from the repository root, without `make install` (any Python >= 3.11 with torch,
torchvision and timm; DALI where `DALI_SITE` says, when it is not installed in that Python):

    DALI_SITE=<folder with nvidia/dali> bash bench/gpu_session.sh     # prints versions, runs the check below
    PYTHONPATH=<that folder>:$PWD python3 -m bench.gpu_check --out reports/gpu-check

Try it first on a CPU, with tiny sizes: `python -m bench.gpu_check --device cpu --quick`.

Sections, in the order `--sections` gives them (default: views, cores, train, tests, loader), each writing
its part of the report (`gpu_check.json`, `gpu_check.md` in `--out`) as soon as it is done; a section
whose estimate no longer fits in `--budget-s` is skipped with a note, and one still running at twice its
estimate (or `--limit-s`) is stopped, its threads' stacks written, so that the report comes back
within the slot. The loader comes last by default: its torchvision baseline is the slowest thing
measured (each of its 16 workers makes a whole batch on one core, 32-39 ms an image on the H200's
host). At the graph's batch of 256 an epoch of a few batches lets only some of the workers work and
ends in a drain (docs/benchmarks.md, "The GPU check's own figures"). So the baseline runs at
`--baseline-batch` 32, on enough images (`--n`) that one epoch holds its whole steady-state run
(`bench.timing.epoch_holds`).

- **views** — the GPU graph with relicv2's 6 views against its first large crop alone, an
  ablation of the 6 views (crops only: no colour, blur, solarize), and the 6 views with each view's
  contrast offset made on the host (`gpu_contrast="host"`: the view's mean copied back, one uint8
  colour pass where the default has a float pass, an add and a cast; 36 GPU operators instead of 54),
  with the blur in a conditional (`gpu_blur="conditional"`: the samples of the views of blur p 0.1
  that drew none skip it), with one run of the graph making 2 training batches (`graph_batches=2`: its
  operators' host set-up paid once for both) and with the graph stopping at the crops, finished by
  batched torch ops on the device (`gpu_tail="torch"`: 6 GPU operators), against the default (until
  this measures them faster). (The blur as per-sample host kernels, `gpu_blur="filter"`, and uint8
  views normalised on the device, `graph_dtype="uint8"`, were timed here on 29 Nov 2026, 0.74× and
  0.94×, and left the section; so did the ablation without blur, 11,425 and 11,282 img/s on 27 and 29
  Nov, to make room for the torch tail.);
- **cores** — the 6 views with the process pinned to 2, 4, 8 and all cores and as many reader workers
  (`data.num_workers=auto` takes 4 on a GPU: the best of the last such measurement), the contrast
  offset, the blur, the training batches a run of the graph makes and the tail as `--gpu-contrast`,
  `--gpu-blur`, `--graph-batches` and `--gpu-tail` say (default, each: the faster of the views
  section's two; so too in the training and loader sections);
- **train** — ResNet-50 `relicv2` at 224/96, bf16, channels-last: `bench.train.time_steps` with the
  DALI GPU loader against the same steps fed one batch already on the device (the data stall), 40
  timed steps a round, the median of 3 rounds (fewer could not tell a 1 % stall from noise);
  `--graph-dtype uint8` feeds it uint8 views normalised on the device (`data.graph_dtype`); the
  graph's other options as in the cores section;
  `--train-stream both` adds a run a round training on a CUDA stream of the highest priority, above the
  graph's (`run.train_stream=high`), and its stall;
- **tests** — the `gpu` tests (but those of **known** when it runs too; `--tests all`: the whole
  suite), in parallel processes, stopped after `--tests-timeout` as Ctrl-C stops them: the tests that
  finished are reported;
- **loader** — `bench.data` on generated ImageNet-like JPEGs, `relicv2` at `--batch-size`: the DALI
  GPU graph against the torchvision baseline (as many DataLoader workers as cores, at
  `--baseline-batch`), a plain DALI multi-crop pipeline as users write one (`bench.peers`, `dali-plain`:
  per-view operators, each random op muxed by a coin flip) and the CPU's
  decode ceilings; steady-state source images/s over `--repeats` rounds with their spread, each
  loader's first batch and the CPU per batch of the thread that takes the batches apart;
- **decoder** (when named) — the 6 views and 1 view with each share of the JPEGs sent to the hardware
  decoder in `HW_LOADS` (the rest on nvJPEG's hybrid path: the CPU's threads and CUDA cores);
- **profile** (when named) — the device's work per steady-state batch of the GPU graph, 6 views (the
  contrast offset made on the device and on the host; the torch tail) and 1 view
  (`bench.timing.profile_kernels`: every kernel and copy the process launched, DALI's included): the
  device busy against the batch's wall time, launches per batch, the kernels that take the most;
- **known** (when named) — the 7 `gpu` tests that failed on the first GPU run (docs/benchmarks.md;
  they have passed since): ResizeMix and CutMix on the GPU graph, relicv2 with saliency masks, SDMP's
  resume on CUDA.

The table printed last marks the issue's targets met or missed (`targets`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import typing
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import data as loader_bench
from bench.datasets import CLASSES, prepare, view_px
from bench.report import header, header_lines
from bench.timing import crops_only, in_rounds, profile_kernels, steady_batches, time_loader, views_per_sample
from pipelines.errors import bad_input
from pipelines.loader import build_loader
from pipelines.spec import DecoderHints, GpuBlur, GpuContrast, GpuTail, GraphDtype, LoaderSpec
from pipelines.views import Recipe, load_recipe

# The GPU issue's targets on one H100 (steady state, batch 256, generated ImageNet-like JPEGs).
TARGET_IMG_S, MOONSHOT_IMG_S = 12_000, 14_000   # relicv2 source images/s of the DALI GPU graph at 4 cores
TARGET_2_CORES_IMG_S = 9_000                     # ... and pinned to 2 cores
TARGET_VS_TORCHVISION, MOONSHOT_VS_TORCHVISION = 2.0, 3.0
TARGET_VS_PLAIN_DALI = 3.0                       # against a plain DALI pipeline of the same views
MAX_VIEW_COST = 1.4                              # 6 views cost at most 1.4x one view
MAX_STALL = 0.01                                 # data-stall fraction of ResNet-50 relicv2 training
MAX_THREAD_MS = 3.0                              # CPU of the thread that takes the batches, per batch
CORE_COUNTS = (2, 4, 8)                          # the cores section's pinnings, then all cores
# The gpu tests that failed on the first GPU run (H200, DALI 2.4.0), run first.
KNOWN_FAILURES = (
    "tests/pipelines/test_contract.py::test_contract[dali@cuda-relicv2]",
    "tests/pipelines/test_dali_backend.py::test_graph_views_stay_on_the_device[cuda]",
    "tests/pipelines/test_dali_backend.py::test_resizemix_pastes_partner_in_box[cuda]",
    "tests/pipelines/test_dali_backend.py::test_dali_mix_equals_torch_reference[cuda-resizemix]",
    "tests/pipelines/test_dali_backend.py::test_sdmp_laws_of_the_graph[cuda-cutmix]",
    "tests/pipelines/test_dali_backend.py::test_sdmp_laws_of_the_graph[cuda-resizemix]",
    "tests/train/test_cuda.py::test_objective_trains_and_resumes_on_cuda[sdmp]",
)
# Seconds each section takes on one H100 with 16 cores, for the budget and the sections' time limits:
# measured on a GPU where the section ran as it is, computed from those runs where it changed since
# (docs/benchmarks.md, "The GPU check's own figures").
ESTIMATE_S = {"known": 75, "loader": 150, "views": 100, "cores": 60, "decoder": 55, "profile": 40, "train": 100,
              "tests": 160}
TEST_PROCESSES = 4     # the gpu tests' processes: 4 ran them fastest on one GPU (docs/benchmarks.md)
# The default sections' estimates add up to 570 s (views 100, cores 60, train 100, tests 160, loader 150):
# the budget lets all five run in one call of the GPU machine (10 minutes at most; they took 500 s on 29 Nov
# with a views section of one cell fewer).
DEFAULT_BUDGET_S = 570.0
STOP_GRACE_S = 30      # seconds a test run stopped at its time limit has to write its report
LOADER_WARMUP = 3      # untimed batches a loader run starts with (more for DataLoaders: `steady_batches`)
LIMIT_X = 2            # a section still running at LIMIT_X times its estimate is stopped (`time_limit`)
HW_LOADS = (0.65, 0.85, 1.0)     # the decoder section's shares of hardware-decoded JPEGs (0.65: DALI's default)


class SectionTimeout(BaseException):
    """A section ran past its limit (a hang: the GPU machine's slot is too short to wait it out). Not an
    `Exception`, so that what catches a failed cell or backend (`bench.timing.in_rounds`) lets it through
    and the section stops (a loader section's rounds once caught it as the torchvision cell's error and
    went on past the limit)."""


@contextlib.contextmanager
def time_limit(seconds: int, stacks: Path):
    """Stop the block with `SectionTimeout` after `seconds`, writing every thread's stack of this process
    into `stacks` first (where it hung); no limit for seconds <= 0."""
    if seconds <= 0:
        yield
        return

    def stop(signum, frame):
        raise SectionTimeout(f"stopped after {seconds} s; the stacks of its threads are in {stacks.name}")

    with stacks.open("w") as f:
        faulthandler.dump_traceback_later(seconds, file=f)
        previous = signal.signal(signal.SIGALRM, stop)
        signal.alarm(seconds + 1)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            faulthandler.cancel_dump_traceback_later()
    if not stacks.stat().st_size:
        stacks.unlink()


def run_tests(which: str, out: Path, timeout_s: int, exclude: tuple[str, ...] = ()) -> dict:
    """Run tests in a subprocess (`run_pytest`): "known" (`KNOWN_FAILURES`), "gpu" (the `gpu`-marked
    tests but `exclude`) or "all". "gpu" and "all" run in parallel processes where pytest-xdist is
    installed (each test on its own: `--dist load`)."""
    args = []
    if which == "known":
        args += list(KNOWN_FAILURES)
    else:
        if which == "gpu":
            args += ["-m", "gpu", *(f"--deselect={t}" for t in exclude)]
        try:
            import xdist  # noqa: F401
            args += ["-n", str(min(TEST_PROCESSES, os.cpu_count() or 1)), "--dist", "load"]
        except ImportError:
            pass
    return {"which": which, **run_pytest(args, out / f"tests-{which}.xml", timeout_s)}


def run_pytest(args: list[str], xml: Path, timeout_s: float) -> dict:
    """Run pytest with `args` in a subprocess, every test's outcome from its JUnit report `xml`. A run
    still going after `timeout_s` is interrupted as Ctrl-C does, so that pytest (xdist's too) still writes
    the report of the tests that finished (`stopped_after_s` then says so): a slot that ends mid-run
    still tells which passed and which failed."""
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={xml}", *args]
    t0 = time.perf_counter()
    # SIGINT back to its default in the child: a process started in the background (a CI job, `cmd &`)
    # inherits it ignored, and a pytest that ignores it cannot be stopped so (nothing reported).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    stopped = False
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stopped = True
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    cases = []
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            if case.get("name") is None:          # the test that was running when the run was stopped
                continue
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            message = next((c.get("message", "")[:300] for c in case if c.tag in ("failure", "error", "skipped")), "")
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "seconds": float(case.get("time", 0)), "message": message})
    count = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "seconds": time.perf_counter() - t0,
            "stopped_after_s": timeout_s if stopped else None, "count": count, "cases": cases,
            "tail": (output or "")[-6000:]}


def run_loader(a: argparse.Namespace, graph: dict | None = None) -> dict:
    """`bench.data` on the ImageNet-like JPEGs: the GPU graph (or, on the CPU, the CPU graph; with the
    `graph` options, `faster_graph`) against torchvision, with the CPU's decode ceilings."""
    graph = graph or dict(DEFAULT_GRAPH)
    out = loader_bench.run(loader_bench.Settings(
        recipes=("relicv2",), datasets=("imagenet-like",), backends=("dali", "torchvision", "dali-plain"), n=a.n,
        repeats=a.repeats, batch_size=a.batch_size, worker_batch_size=a.baseline_batch, batches=a.batches,
        warmup_batches=LOADER_WARMUP, cores=a.cores, device=a.device, stages=False, quick=a.quick,
        out=Path(a.work) / f"pipelines-b{a.batch_size}.json", graph=graph))
    return {**out, "graph": graph}


def _view_recipes(a: argparse.Namespace) -> tuple[Recipe, Recipe]:
    """relicv2 at the bench's sizes, and its first large crop alone."""
    six = load_recipe("relicv2", *view_px("imagenet-like", a.quick))
    return six, Recipe("relicv2-1view", (six.groups[0],))


def _make_gpu_loader(a: argparse.Namespace, recipe: Recipe, epoch: int, hw_load: float = DecoderHints.hw_load,
                     cores: int | None = None, **graph):
    """The DALI loader of `recipe` on the bench's ImageNet-like JPEGs (the loader section's data), its
    decoder sending `hw_load` of the JPEGs to the hardware decoder, with `cores` workers (default
    `--cores`) and the `graph` options (`LoaderSpec`'s
    gpu_contrast, gpu_blur, graph_batches, gpu_tail, graph_dtype)."""
    root, name = prepare("imagenet-like", Path(a.work) / "bench-data", a.n, a.quick, a.cores)
    loader = build_loader("dali", LoaderSpec(root=str(root), dataset=name, split="train", recipe=recipe,
                                             batch_size=a.batch_size, device=a.device, num_workers=cores or a.cores,
                                             decoder=DecoderHints(hw_load=hw_load), **graph))
    loader.set_epoch(epoch)
    return loader


def _gpu_cell(a: argparse.Namespace, recipe: Recipe, hw_load: float = DecoderHints.hw_load,
              cores: int | None = None, **graph):
    """An `in_rounds` cell: one steady-state run of the GPU graph of `recipe` (`_make_gpu_loader`); with
    `cores`, the process pinned to that many cores while it runs (DALI's threads and workers, made at the
    pipeline's build, inherit it)."""
    def cell(rnd: int) -> dict:
        pinned = contextlib.nullcontext() if cores is None else pinned_to(cores)
        with pinned:
            make = lambda e: _make_gpu_loader(a, recipe, rnd + e, hw_load, cores, **graph)  # noqa: E731
            return {"img_per_s": list(time_loader(make, a.batches, LOADER_WARMUP, 1, a.device).img_per_s)}
    return cell


@contextlib.contextmanager
def pinned_to(cores: int):
    """This process on its first `cores` CPUs while the block runs (threads and processes started in it
    keep the pinning)."""
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(was)[:cores])
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


def run_views(a: argparse.Namespace) -> dict:
    """Steady-state images/s of the GPU graph with relicv2's 6 views, with its first large crop alone,
    with the 6 views' crops only, and the 6 views with the contrast offset made on the host, with the
    blur in a conditional, with a run of the graph making 2 training batches and with the torch tail,
    timed in rounds."""
    six, one = _view_recipes(a)
    cells = {r.name: r for r in (six, one, crops_only(six))}
    timed = in_rounds(a.repeats, {**{name: _gpu_cell(a, r) for name, r in cells.items()},
                                  **{alt.cell: _gpu_cell(a, six, **{key: alt.value})
                                     for key, alt in ALTERNATIVES.items()}})
    out: dict = {"batch_size": a.batch_size}
    for name, recipe in {**cells, **{alt.cell: six for alt in ALTERNATIVES.values()}}.items():
        cell_ = timed[name]
        if not cell_.ok and name in cells:
            raise RuntimeError(f"{name}: {cell_.error}")
        if not cell_.ok:                    # an alternative that fails: said in the report, never taken
            out[name] = {"error": cell_.error}
            continue
        runs = cell_.runs["img_per_s"]
        rate = loader_bench.spread(runs)["img_per_s"]                  # the median over the rounds
        out[name] = {"views": views_per_sample(recipe), "runs": runs, "img_per_s": rate,
                     "views_per_s": rate * views_per_sample(recipe)}
    out["cost_6_vs_1"] = out["relicv2-1view"]["img_per_s"] / out["relicv2"]["img_per_s"]
    for alt in ALTERNATIVES.values():
        out[alt.ratio] = out[alt.cell].get("img_per_s", 0.0) / out["relicv2"]["img_per_s"]
    return out


class Alternative(typing.NamedTuple):
    """A graph option's alternative, timed by the views section beside the default."""

    cell: str            # the views section's cell
    ratio: str           # its images/s over the default's, in the views section's report (0: it failed)
    value: object        # the option's value there
    what: str            # what the report calls it


ALTERNATIVES = {"gpu_contrast": Alternative("relicv2-hostcontrast", "hostcontrast_vs_device", "host",
                                            "the contrast offset made on the host"),
                "gpu_blur": Alternative("relicv2-condblur", "condblur_vs_every_sample", "conditional",
                                        "the blur in a conditional"),
                "graph_batches": Alternative("relicv2-graph2", "graph2_vs_graph1", 2,
                                             "2 training batches a run of the graph"),
                "gpu_tail": Alternative("relicv2-torchtail", "torchtail_vs_graph", "torch",
                                        "the crops finished by batched torch ops")}
# each of those options at `LoaderSpec`'s default
DEFAULT_GRAPH = {f.name: f.default for f in dataclasses.fields(LoaderSpec) if f.name in ALTERNATIVES}


def faster_graph(a: argparse.Namespace, report: dict) -> dict:
    """The graph options of the cores, training and loader sections: `--gpu-contrast`, `--gpu-blur`,
    `--graph-batches` and `--gpu-tail`, or for each one left at "faster" the alternative the views section
    timed where it was faster than the default (the default where that section did not run)."""
    views = report.get("views", {})
    out = {}
    for key, alt in ALTERNATIVES.items():
        chosen = getattr(a, key)
        out[key] = (type(DEFAULT_GRAPH[key])(chosen) if chosen != "faster" else
                    alt.value if views.get(alt.ratio, 0.0) > 1.0 else DEFAULT_GRAPH[key])
    return out


def run_cores(a: argparse.Namespace, graph: dict | None = None) -> dict:
    """Steady-state images/s of the GPU graph's 6 views (with the `graph` options) pinned to 2, 4, 8 and
    all cores with as many workers, timed in rounds."""
    graph = graph or dict(DEFAULT_GRAPH)
    six, _ = _view_recipes(a)
    counts = sorted({c for c in CORE_COUNTS if c < a.cores} | {a.cores})
    timed = in_rounds(a.repeats, {c: _gpu_cell(a, six, cores=c, **graph) for c in counts})
    out: dict = {"batch_size": a.batch_size, "graph": graph, "rows": []}
    for c, cell_ in timed.items():
        runs = cell_.runs.get("img_per_s", [])
        out["rows"].append({"cores": c, "runs": runs, "error": cell_.error,
                            "img_per_s": loader_bench.spread(runs)["img_per_s"] if runs else None})
    return out


def run_decoder(a: argparse.Namespace) -> dict:
    """Steady-state images/s of the GPU graph, relicv2's 6 views and its first view alone, with each
    share of the JPEGs sent to the hardware decoder in `HW_LOADS` (the rest decoded on the CPU's
    threads and CUDA cores: nvJPEG's hybrid path), timed in rounds."""
    six, one = _view_recipes(a)
    timed = in_rounds(a.repeats, {(r.name, h): _gpu_cell(a, r, h) for r in (six, one) for h in HW_LOADS})
    rows = []
    for (name, h), cell in timed.items():
        runs = cell.runs.get("img_per_s", [])
        rows.append({"recipe": name, "hw_load": h, "runs": runs, "error": cell.error,
                     "img_per_s": loader_bench.spread(runs)["img_per_s"] if runs else None})
    return {"batch_size": a.batch_size, "rows": rows}


def run_profile(a: argparse.Namespace) -> dict:
    """The device's work per steady-state batch of the GPU graph: relicv2's 6 views (the contrast offset
    made on the device and on the host; the crops finished by the torch tail) and 1 view
    (`profile_kernels`; the Chrome traces, gzipped, beside the report)."""
    six, one = _view_recipes(a)
    out: dict = {"batch_size": a.batch_size}
    for name, recipe, graph in (("relicv2", six, {}), ("relicv2-hostcontrast", six, {"gpu_contrast": "host"}),
                                ("relicv2-torchtail", six, {"gpu_tail": "torch"}), (one.name, one, {})):
        out[name] = profile_kernels(lambda r=recipe, g=graph: _make_gpu_loader(a, r, 0, **g),
                                    max(4, a.batches // 2), LOADER_WARMUP, a.device,
                                    trace=Path(a.out) / f"trace-{name}.json.gz")
    return out


def run_train(a: argparse.Namespace, graph: dict | None = None) -> dict:
    """ResNet-50 relicv2 steps with the DALI loader (with the `graph` options) against one batch kept on
    the device."""
    graph = graph or dict(DEFAULT_GRAPH)
    from bench.train import time_steps
    from train.config import to_dict
    from train.resolve import load_config

    gpx, lpx = view_px("imagenet-like", a.quick)
    root, name = prepare("imagenet-like", Path(a.work) / "bench-data", a.n, a.quick, a.cores)   # the loader's data
    cfg = load_config(["method=relicv2", "data=imagenet", f"data.name={name}", f"data.root={root}",
                       "data.backend=dali", f"data.batch_size={a.train_batch}", f"data.num_workers={a.cores}",
                       f"data.num_classes={CLASSES}", f"views.global_px={gpx}", f"views.local_px={lpx}",
                       f"model.backbone={'test_resnet' if a.quick else 'resnet50'}", f"run.amp={a.device == 'cuda'}",
                       f"model.channels_last={a.device == 'cuda'}", f"run.device={a.device}",
                       f"data.graph_dtype={a.graph_dtype}", *(f"data.{k}={v}" for k, v in graph.items()),
                       f"run.train_stream={'high' if a.train_stream == 'high' else 'default'}"])
    torch.backends.cudnn.benchmark = True
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = time_steps(cfg, torch.device(a.device), a.train_steps, a.repeats, warmup_steps=3,
                     high_stream=a.train_stream == "both")
    row["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20 if a.device == "cuda" else 0.0
    row["config"] = to_dict(cfg)
    return row


def _rows(report: dict, backend: str) -> list[dict]:
    rep = report.get("loader", {})
    return [r for r in rep.get("results", []) if r["backend"] == backend and r["status"] == "ok"]


def table(report: dict) -> str:
    """The report as Markdown: the loader table (`bench.data.format_table`), the view cost, training,
    tests, targets."""
    lines = []
    rep = report.get("loader")
    if rep and "error" not in rep:
        lines += [f"loader at batch {rep['settings']['batch_size']} (`dali`: the DALI graph on the run's device, "
                  f"{_options(rep.get('graph', DEFAULT_GRAPH))}; ceilings on the CPU):",
                  loader_bench.format_table(rep), ""]
    v = report.get("views")
    if v and "error" not in v:
        lines += [f"GPU graph, batch {v['batch_size']}: 6 views (relicv2) {v['relicv2']['img_per_s']:,.0f} img/s, "
                  f"1 view {v['relicv2-1view']['img_per_s']:,.0f} img/s: "
                  f"6 views cost {v['cost_6_vs_1']:.2f}× one view; 6 views, crops only "
                  f"{v['relicv2-crops']['img_per_s']:,.0f} img/s; "
                  + "; ".join(f"{alt.what} " + (f"{v[alt.cell]['img_per_s']:,.0f} img/s ({v[alt.ratio]:.2f}×)"
                                                 if "img_per_s" in v[alt.cell] else f"failed ({v[alt.cell]['error']})")
                              for alt in ALTERNATIVES.values() if alt.cell in v)]
    c = report.get("cores")
    if c and "error" not in c:
        lines += ["", f"GPU graph, 6 views, batch {c['batch_size']}, {_options(c.get('graph', DEFAULT_GRAPH))}, "
                  "pinned to N cores with N workers: "
                  + ", ".join(f"{r['cores']}: " + (f"{r['img_per_s']:,.0f} img/s" if r["img_per_s"] else "failed")
                              for r in c["rows"])]
    d = report.get("decoder")
    if d and "error" not in d:
        lines += ["", f"GPU graph, batch {d['batch_size']}, by the share of JPEGs sent to the hardware decoder:"]
        lines += [f"  {r['recipe']} hw_load {r['hw_load']:.2f}: "
                  + (f"{r['img_per_s']:,.0f} img/s" if r["img_per_s"] else f"failed ({r['error']})") for r in d["rows"]]
    p = report.get("profile")
    if p and "error" not in p:
        for name, r in p.items():
            if not isinstance(r, dict):
                continue
            lines += ["", f"profile {name}, batch {p['batch_size']}: {r['wall_ms']:.1f} ms a batch"
                      + (f", device busy {r['busy_ms']:.1f} ms (kernels and copies {r['kernel_ms']:.1f} ms), "
                         f"{r['kernels']:.0f} kernels a batch from {r['launching_threads']} threads"
                         if "busy_ms" in r else "")]
            st = r.get("busiest_stream")
            if st:
                lines += [f"  its busiest stream a batch: {st['work_ms']:.1f} ms of work, {st['waits_ms']:.1f} ms of "
                          f"waits of 1 ms or more, {st['gaps_ms']:.1f} ms of shorter gaps (operators' host set-up)"]
            lines += [f"  {x['ms']:7.2f} ms {x['calls']:6.1f}× {x['name']}" for x in r.get("top", [])]
    t = report.get("train")
    if t and "error" not in t:
        c = t["config"]
        lines += ["", f"{c['model']['backbone']} relicv2 {c['views']['global_px']}/{c['views']['local_px']}"
                  + (" bf16, channels-last" if c["run"]["amp"] else "") + f", batch {c['data']['batch_size']}: "
                  f"{t['img_per_s']:,.0f} img/s with the DALI loader, "
                  f"{t['cached_steps_per_s'] * c['data']['batch_size']:,.0f} img/s on one batch on the device, "
                  f"data stall {100 * t['data_stall_fraction']:.1f} %, peak {t['peak_mem_mib']:,.0f} MiB, "
                  f"{_options({k: c['data'].get(k, v) for k, v in DEFAULT_GRAPH.items()})}"
                  + (f" (training on stream priority {c['run']['train_stream']})" if c["run"]["train_stream"] != "default"
                     else "")]
        if "high_stream_stall_fraction" in t:
            lines += [f"training on a stream of the highest priority: "
                      f"{t['high_stream_steps_per_s'] * c['data']['batch_size']:,.0f} img/s with the DALI loader, "
                      f"data stall {100 * t['high_stream_stall_fraction']:.1f} %"]
    for name in ("loader", "views", "cores", "decoder", "profile", "train"):
        if report.get(name, {}).get("error"):
            lines += ["", f"{name} failed: {report[name]['error']}"]
    for name in ("known", "tests"):
        tests = report.get(name)
        if tests and "count" in tests:
            c = tests["count"]
            lines += ["", f"tests ({tests['which']}): {c['passed']} passed, {c['failure'] + c['error']} failed, "
                      f"{c['skipped']} skipped in {tests['seconds']:.0f} s"
                      + (f"; stopped at its limit of {tests['stopped_after_s']} s, the tests still running not counted"
                         if tests.get("stopped_after_s") else "")]
            lines += [f"  {x['outcome']}: {x['test']}: {x['message'][:200]}" for x in tests["cases"]
                      if x["outcome"] in ("failure", "error")]
    lines += [f"skipped: {name} ({why})" for name, why in report.get("skipped", {}).items()]
    lines += ["", "targets: " + "; ".join(targets(report))]
    return "\n".join(lines)


def _options(graph: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in graph.items())


def targets(report: dict) -> list[str]:
    """The issue's targets, each with its measured value, met or missed."""
    out = []
    dali, base = _rows(report, "dali"), _rows(report, "torchvision")
    if dali:
        r = dali[0]
        b = r["img_per_s"]
        verdict = "moonshot met" if b >= MOONSHOT_IMG_S else "met" if b >= TARGET_IMG_S else "missed"
        out.append(f"relicv2 GPU graph {b:,.0f} img/s (target {TARGET_IMG_S:,}, moonshot {MOONSHOT_IMG_S:,}): "
                   + verdict)
        if base:
            x = b / base[0]["img_per_s"]
            verdict = ("moonshot met" if x >= MOONSHOT_VS_TORCHVISION else "met" if x >= TARGET_VS_TORCHVISION
                       else "missed")
            own = base[0].get("batch_size", r.get("batch_size"))          # the baseline's batch, where its own
            batch = f", batch {own}" if own != r.get("batch_size") else ""
            out.append(f"{x:.2f}× torchvision with {base[0]['workers']} workers{batch} "
                       f"(target {TARGET_VS_TORCHVISION:g}×, "
                       f"moonshot {MOONSHOT_VS_TORCHVISION:g}×): {verdict}")
        ms = r.get("thread_cpu_ms")
        if ms is not None:
            out.append(f"taking thread {ms:.1f} ms CPU per batch (≤ {MAX_THREAD_MS:g}): "
                       + ("met" if ms <= MAX_THREAD_MS else "missed"))
    plain = _rows(report, "dali-plain")
    if dali and plain:
        x = dali[0]["img_per_s"] / plain[0]["img_per_s"]
        out.append(f"{x:.2f}× a plain DALI pipeline of the same views (≥ {TARGET_VS_PLAIN_DALI:g}×): "
                   + ("met" if x >= TARGET_VS_PLAIN_DALI else "missed"))
    rows = {r["cores"]: r["img_per_s"] for r in report.get("cores", {}).get("rows", []) if r.get("img_per_s")}
    for c, target in ((4, TARGET_IMG_S), (2, TARGET_2_CORES_IMG_S)):
        if c in rows:
            out.append(f"relicv2 at {c} cores {rows[c]:,.0f} img/s (≥ {target:,}): " + ("met" if rows[c] >= target else "missed"))
    v = report.get("views", {})
    for key, alt in ALTERNATIVES.items():
        if alt.ratio in v:
            out.append(f"{alt.what} {v[alt.ratio]:.2f}× the default (> 1: make data.{key}={alt.value} the GPU "
                       "default" + ("; well above 1: try more)" if key == "graph_batches" else ")"))
    if "cost_6_vs_1" in v:
        out.append(f"6 views cost {v['cost_6_vs_1']:.2f}× 1 view (≤ {MAX_VIEW_COST}): "
                   + ("met" if v["cost_6_vs_1"] <= MAX_VIEW_COST else "missed"))
    t = report.get("train", {})
    if "data_stall_fraction" in t:
        out.append(f"stall {100 * t['data_stall_fraction']:.1f} % (≤ {100 * MAX_STALL:.0f} %): "
                   + ("met" if t["data_stall_fraction"] <= MAX_STALL else "missed"))
    if "high_stream_stall_fraction" in t:
        out.append(f"stall {100 * t['high_stream_stall_fraction']:.1f} % training on a high-priority stream "
                   "(run.train_stream=high, the default since 29 Nov 2026: it was lower there)")
    runs = [report[k] for k in ("known", "tests") if "count" in report.get(k, {})]
    if runs:
        passed = sum(r["count"]["passed"] for r in runs)
        failed = sum(r["count"]["failure"] + r["count"]["error"] for r in runs)
        stopped = any(r.get("stopped_after_s") for r in runs)
        out.append(f"gpu tests {passed} passed, {failed} failed" + (" before the run was stopped" if stopped else "")
                   + ": " + ("missed" if failed else "not all ran" if stopped else "met" if passed else "none ran"))
    return out or ["nothing measured"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="reports/gpu-check", help="folder of gpu_check.json and gpu_check.md")
    p.add_argument("--work", default="reports/gpu-check", help="folder of the generated data and the bench JSON files")
    p.add_argument("--sections", default="views,cores,train,tests,loader",
                   help="comma-separated sections to run, in that order")
    p.add_argument("--tests", choices=("gpu", "all"), default="gpu",
                   help="the tests section: the other gpu tests, or all")
    p.add_argument("--tests-timeout", type=int, default=240, help="seconds before a test run is stopped")
    p.add_argument("--limit-s", type=int, default=0,
                   help="stop a section after this many seconds, writing its threads' stacks (default: twice "
                        "its estimate)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip a section whose estimate no longer fits (default 570 s; none with --quick)")
    p.add_argument("--batch-size", type=int, default=None, help="loader batch size (default 256; quick 8)")
    p.add_argument("--baseline-batch", type=int, default=None,
                   help="the torchvision baseline's batch size (default 32; quick 8): its rate per image does "
                        "not depend on it, and its steady state (whole rounds of its workers, in one epoch) "
                        "then fits the slot")
    p.add_argument("--batches", type=int, default=None, help="timed loader batches per run (default 24; quick 2)")
    p.add_argument("--train-batch", type=int, default=None, help="ResNet-50 batch size (default 128; quick 12)")
    p.add_argument("--train-steps", type=int, default=None, help="timed training steps per run (default 40; quick 2)")
    p.add_argument("--graph-dtype", default="float32", choices=typing.get_args(GraphDtype),
                   help="the training section's DALI views: normalised in the graph, or uint8 normalised on the device")
    p.add_argument("--gpu-contrast", default="faster", choices=("faster", *typing.get_args(GpuContrast)),
                   help="where the cores, training and loader sections make the contrast offset "
                        "(data.gpu_contrast); faster: the faster of the views section's two")
    p.add_argument("--gpu-blur", default="faster", choices=("faster", *typing.get_args(GpuBlur)),
                   help="the blur of the cores, training and loader sections (data.gpu_blur); faster: the faster "
                        "of the views section's two (on every sample, in a conditional)")
    p.add_argument("--graph-batches", default="faster",
                   help="training batches a run of the graph makes in the cores, training and loader sections "
                        "(data.graph_batches); faster: 2 where the views section found it faster than 1")
    p.add_argument("--gpu-tail", default="faster", choices=("faster", *typing.get_args(GpuTail)),
                   help="what finishes the crops in the cores, training and loader sections (data.gpu_tail); "
                        "faster: the faster of the views section's two (the graph, batched torch ops)")
    p.add_argument("--train-stream", default="default", choices=("default", "high", "both"),
                   help="the training section's CUDA stream (run.train_stream); both: a third run a round, "
                        "training on the high-priority stream, beside the default one")
    p.add_argument("--n", type=int, default=None,
                   help="generated ImageNet-like train images (default: 2000, or more where the torchvision "
                        "baseline's steady state needs them in one epoch; quick 48)")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds per figure (median and spread; default 3, quick 1)")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="CPU threads / workers for every loader")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda; cpu only to try the script")
    p.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs")
    a = p.parse_args(argv)
    q = a.quick
    a.batch_size = a.batch_size or (8 if q else 256)
    a.batches = a.batches or (2 if q else 24)
    a.train_batch = a.train_batch or (12 if q else 128)
    a.train_steps = a.train_steps or (2 if q else 40)
    a.baseline_batch = a.baseline_batch or (a.batch_size if q else 32)
    # One epoch of the baseline holds its steady-state run (`bench.timing.epoch_holds`): 16 workers,
    # 24 timed batches: 32 warm-up and 64 timed batches of 32, 3,072 images.
    a.n = a.n or (48 if q else max(2000, a.baseline_batch * sum(steady_batches(a.batches, LOADER_WARMUP, a.cores))))
    a.repeats = a.repeats or (1 if q else 3)
    a.budget_s = a.budget_s if a.budget_s is not None else (float("inf") if q else DEFAULT_BUDGET_S)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit(bad_input("torch sees no CUDA device; run this on a GPU machine (or --device cpu --quick to try it)"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **header(), "settings": vars(a),
              "skipped": {}}
    sections = a.sections.split(",")

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_check.md").write_text(table(report) + "\n")

    def section(name: str, fn) -> None:
        elapsed = time.perf_counter() - start
        if elapsed + ESTIMATE_S[name] > a.budget_s:
            report["skipped"][name] = (f"{elapsed:.0f} s spent, about {ESTIMATE_S[name]} s more would pass "
                                       f"{a.budget_s:.0f} s")
            print(f"== {name} skipped: {report['skipped'][name]}", flush=True)
            save()
            return
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            limit = a.limit_s or LIMIT_X * ESTIMATE_S[name]
            with time_limit(0 if a.quick else limit, out / f"{name}-stacks.txt"):
                report[name] = fn()
        except (Exception, SectionTimeout) as e:  # one broken or hung section is reported; the others run
            report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            print(report[name]["traceback"], flush=True)
        print(f"== {name} done in {time.perf_counter() - t0:.0f} s ({time.perf_counter() - start:.0f} s in all)",
              flush=True)
        save()

    run = {"known": lambda: run_tests("known", out, timeout_s=a.tests_timeout),
           "loader": lambda: run_loader(a, faster_graph(a, report)),
           "views": lambda: run_views(a),
           "cores": lambda: run_cores(a, faster_graph(a, report)),
           "decoder": lambda: run_decoder(a),
           "profile": lambda: run_profile(a),
           "train": lambda: run_train(a, faster_graph(a, report)),
           "tests": lambda: run_tests(a.tests, out, timeout_s=a.tests_timeout,
                                      exclude=KNOWN_FAILURES if "known" in sections else ())}
    unknown = [n for n in sections if n not in run]
    if unknown:
        sys.exit(bad_input(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(run)}"))
    for name in sections:                   # in the order given
        section(name, run[name])
    print("\n" + "\n".join(header_lines(report)))
    print(table(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
