"""`python -m bench.train [methods=rsa,byol] [steps=20] [repeats=3] [minutes=M] [key=value ...]`: full
training steps per objective on the synthetic dataset.

Per objective: median steps/s and images/s with the real loader and with one batch already on the
device (their ratio gives the data-stall fraction), peak memory, and kNN / linear-probe top-1 after
a training run next to a random-init backbone. Every objective is timed first; then each trains for
`optim.steps`, or with `minutes=M` for as many steps as its measured rate fits into M minutes (an
equal time budget per objective: the fair comparison on one machine, whatever each objective costs
per step). Writes `bench_train.json` (the report header of `bench.report`: machine, versions, commit;
then the resolved configs and the numbers) into `run.out_dir` and prints a table.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import resource
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from bench.report import header, header_lines
from bench.timing import sync
from train import schedules
from train.config import Config, ConfigError, dump_yaml, to_dict
from train.launch import train, training_stream
from train.loop import check_finite, epochs_from, train_step
from train.objectives import OBJECTIVES
from train.resolve import load_config
from train.run import folder_of
from train.setup import Parts, build_parts, resolve_backend, select_device


def time_steps(cfg: Config, device: torch.device, steps: int, repeats: int, warmup_steps: int = 2,
               parts: Parts | None = None, batches=None, high_stream: bool = False) -> dict:
    """Median steps/s of the loop's `train_step` with the real loader and with one batch kept on the
    device (no loader at all), after `warmup_steps` untimed steps; on `parts` and its `batches`
    iterator when given (built here otherwise). Timed in `repeats` rounds of one
    real run then one on-device run, so that a slow spell of the machine falls on both; with
    `high_stream`, a third run a round: the real loader with training on a stream of the highest
    priority (`train.launch.training_stream`, `run.train_stream=high`; the others on `cfg`'s).

    Returns:
        medians (`steps_per_s`, `cached_steps_per_s`, `img_per_s`), every run (`*_runs`) and the
        data-stall fraction `1 - real / on-device`; with `high_stream` also `high_stream_steps_per_s`
        (and its runs) and `high_stream_stall_fraction`.

    Raises:
        NonFiniteLossError: a timed step had a non-finite loss (checked once, after the timing).
    """
    parts = parts or build_parts(cfg, device, resolve_backend(cfg, device))
    batches = batches or epochs_from(parts.loader, 0, len(parts.loader), None)
    cached = next(batches)
    done = 0

    def run(n: int, feed, priority: str = cfg.run.train_stream) -> float:
        nonlocal done
        with training_stream(device, priority):
            sync(device)
            start = time.perf_counter()
            for _ in range(n):
                train_step(parts, feed(), schedules.at(cfg.optim, done, len(parts.loader), cfg.data.batch_size))
                done += 1
            sync(device)
        return n / (time.perf_counter() - start)

    run(warmup_steps, lambda: next(batches))
    real, fed, high = [], [], []
    for _ in range(repeats):
        real.append(run(steps, lambda: next(batches)))
        fed.append(run(steps, lambda: cached))
        if high_stream:
            high.append(run(steps, lambda: next(batches), "high"))
    check_finite(parts, cfg.method, done, {})
    median = statistics.median
    out = {"steps_per_s": median(real), "steps_per_s_runs": real, "img_per_s": median(real) * cfg.data.batch_size,
           "cached_steps_per_s": median(fed), "cached_steps_per_s_runs": fed,
           "data_stall_fraction": max(0.0, 1.0 - median(real) / median(fed))}
    if high_stream:
        out |= {"high_stream_steps_per_s": median(high), "high_stream_steps_per_s_runs": high,
                "high_stream_stall_fraction": max(0.0, 1.0 - median(high) / median(fed))}
    return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: kB → MiB (process peak)


def last_eval(run_dir: Path) -> tuple[int, dict[str, float]] | None:
    """(step, top-1 of the backbone and of the random-init one) of a run's last evaluation in
    metrics.jsonl, or None without one."""
    records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    if not evals:
        return None
    last = evals[-1]
    return last["step"], {k: last[k] for k in ("knn_top1", "linear_top1", "random_init/knn_top1",
                                               "random_init/linear_top1")}


def finished_eval(words: list[str]) -> dict[str, float] | None:
    """The final evaluation of an earlier run of exactly the config `words` resolve to (the same
    config.yaml, an evaluation at its last step), or None: an interrupted comparison resumes there."""
    cfg = load_config(words)
    run_dir = folder_of(cfg)
    try:
        if (run_dir / "config.yaml").read_text() != dump_yaml(cfg):
            return None
        last = last_eval(run_dir)
    except (OSError, ValueError, KeyError):
        return None
    return last[1] if last is not None and last[0] == cfg.optim.steps else None


def accuracy_after(cfg) -> dict[str, float]:
    """Train `cfg` and return its last evaluation (and the random-init one) from metrics.jsonl. Its run
    folder is the bench's own (`run.name` set by the bench: bench-*, compare-*, saliency-check-*): an
    earlier measurement there (another setting, or one interrupted) is started over, as a fresh start in a
    run's folder is otherwise refused (`train.run.resume_state`)."""
    run_dir = folder_of(cfg)
    if run_dir.is_dir():
        print(f"starting {run_dir} over (an earlier measurement of this bench)", flush=True)
        shutil.rmtree(run_dir)
    return last_eval(train(cfg))[1]


def bench_config(method: str, rest: list[str], train_steps: int = 0) -> Config:
    cfg = load_config([f"method={method}", "data=synthetic", *rest, f"run.name=bench-{method}"])
    if train_steps > 0:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, steps=train_steps,
                                                                 warmup_steps=train_steps // 10))
    return cfg


def time_one(method: str, rest: list[str], steps: int, repeats: int) -> dict:
    """Step rates and peak memory of one objective; run in a fresh process (see `main`)."""
    device = select_device("auto")
    cfg = bench_config(method, rest)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return {**time_steps(cfg, device, steps, repeats), "peak_mem_mb": peak_memory_mb(device)}


def steps_in(minutes: float, steps_per_s: float) -> int:
    """The equal time budget as a run length: the steps the measured rate fits into `minutes`."""
    return max(1, round(60 * minutes * steps_per_s))


def train_one(method: str, rest: list[str], train_steps: int) -> tuple[dict, dict]:
    """Accuracy after a training run of `train_steps` (0: the config's `optim.steps`, else with a
    warmup of 10 % of it), and the resolved config."""
    cfg = bench_config(method, rest, train_steps)
    return {"train_steps": cfg.optim.steps, **accuracy_after(cfg)}, to_dict(cfg)


def in_fresh_process(fn, *args):
    # One fresh process per measurement: the CPU peak (ru_maxrss) is per process and never goes
    # down, so measuring every objective in one process would report the running maximum.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main(argv: list[str]) -> int:
    own = ("methods", "steps", "repeats", "minutes")
    opts = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in own)
    rest = [a for a in argv if a.split("=", 1)[0] not in own]
    methods = opts.get("methods", ",".join(sorted(OBJECTIVES))).split(",")
    steps, repeats, minutes = int(opts.get("steps", 10)), int(opts.get("repeats", 3)), float(opts.get("minutes", 0))
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:                                     # bad words fail here in one line, before any process starts
        for method in methods:
            bench_config(method, rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = select_device("auto")
    head = header()
    print("\n".join(header_lines(head)) + f"\nbench-train on {device}: {steps} steps x {repeats}")
    # Two rounds: every objective is timed first, back to back, then trained for the steps its rate
    # fits into the budget. The budgets are fixed before any long run starts, so a busy spell of the
    # machine during training makes the bench slower but cannot give one objective fewer steps.
    rows = {m: in_fresh_process(time_one, m, rest, steps, repeats) for m in methods}
    print("timed: " + ", ".join(f"{m} {r['steps_per_s']:.2f} steps/s" for m, r in rows.items()), flush=True)
    configs = {}
    for method in methods:
        budget = steps_in(minutes, rows[method]["steps_per_s"]) if minutes > 0 else 0
        accuracy, configs[method] = in_fresh_process(train_one, method, rest, budget)
        rows[method].update(accuracy)
        print(f"{method}: {accuracy['train_steps']} steps, kNN {100 * accuracy['knn_top1']:.1f}%", flush=True)
    columns = (f"{'method':<8} {'steps/s (min-max)':>18} {'img/s':>8} {'cached steps/s':>18} {'stall':>6} {'peak MiB':>9}"
              f" {'steps':>6} {'kNN':>6} {'kNN rnd':>7} {'linear':>6} {'lin rnd':>7}")
    print(columns)
    spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}"   # noqa: E731
    for m, r in rows.items():
        print(f"{m:<8} {r['steps_per_s']:>6.2f} ({spread(r['steps_per_s_runs']):>9}) {r['img_per_s']:>8.1f} "
              f"{r['cached_steps_per_s']:>6.2f} ({spread(r['cached_steps_per_s_runs']):>9}) {r['data_stall_fraction']:>6.2f} "
              f"{r['peak_mem_mb']:>9.0f} {r['train_steps']:>6} {100 * r['knn_top1']:>5.1f}% {100 * r['random_init/knn_top1']:>6.1f}% "
              f"{100 * r['linear_top1']:>5.1f}% {100 * r['random_init/linear_top1']:>6.1f}%")
    out = Path(next(iter(configs.values()))["run"]["out_dir"]) / "bench_train.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**head, "device": str(device), "steps": steps, "repeats": repeats, "minutes": minutes,
                               "results": rows, "configs": configs}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
