"""`python -m bench.evaluation [rows=10000,100000] [processes=1,2] [width=512] [classes=100]`: the
evaluation's scoring time on synthetic features, in 1 and N gloo processes.

Features of `classes` Gaussian clusters (val: a fifth as many rows as train) are split into the
ranks' shards as the loaders shard a split; each process then runs `train.evaluate.score_features`
(gather the train features, kNN on its val shard, the probe, the health sums, the reductions), timed
from the first gather to the last reduction, the slowest rank counted. Medians of `repeats` runs.
Prints one line per (rows, processes) and writes `reports/bench-evaluation.json`.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from bench.report import header
from pipelines.spec import rank_range
from train.evaluate import PROBE_LBFGS_MAX, score_features


def features(rows: int, width: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, width, generator=torch.Generator().manual_seed(0))            # noise 6x a centre
    y = torch.randint(0, classes, (rows,), generator=g)
    return centres[y] + 6.0 * torch.randn(rows, width, generator=g), y


def run_rank(rank: int, world: int, port: int, rows: int, width: int, classes: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        tdist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    xt, yt = features(rows, width, classes, 1)
    xv, yv = features(rows // 5, width, classes, 2)
    lo, hi = rank_range(rows, rank, world)
    vlo, vhi = rank_range(rows // 5, rank, world)
    train = (xt[lo:hi], yt[lo:hi], torch.arange(lo, hi))
    align = (torch.zeros((), dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    seconds, result = [], {}
    for _ in range(repeats):
        if world > 1:
            tdist.barrier()
        t = time.perf_counter()
        result = score_features(train, xv[vlo:vhi], yv[vlo:vhi], align, ("knn", "probe"), classes)
        took = torch.tensor([time.perf_counter() - t])
        if world > 1:
            tdist.all_reduce(took, op=tdist.ReduceOp.MAX)            # the slowest rank
        seconds.append(float(took))
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "result": result}))
    if world > 1:
        tdist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str]) -> int:
    words = dict(a.split("=", 1) for a in argv)
    rows_list = [int(x) for x in words.get("rows", "10000,100000").split(",")]
    procs = [int(x) for x in words.get("processes", "1,2").split(",")]
    width, classes = int(words.get("width", 512)), int(words.get("classes", 100))
    repeats = int(words.get("repeats", 3))
    out_dir = Path(words.get("out", "reports"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {**header(), "width": width, "classes": classes, "repeats": repeats, "runs": []}
    for rows in rows_list:
        for world in procs:
            tmp = out_dir / f".bench-evaluation-{rows}-{world}.json"
            mp.spawn(run_rank, args=(world, free_port(), rows, width, classes, repeats, str(tmp)), nprocs=world)
            got = json.loads(tmp.read_text())
            tmp.unlink()
            probe = "lbfgs" if rows * width * classes <= PROBE_LBFGS_MAX else "sgd"
            row = {"rows": rows, "processes": world, "median_s": statistics.median(got["seconds"]),
                   "seconds": got["seconds"], "probe": probe, **got["result"]}
            report["runs"].append(row)
            print(f"{rows:>7} train rows, {world} process(es): {row['median_s']:.1f} s (probe {probe}; kNN "
                  f"{row['knn_top1']:.3f}, linear {row['linear_top1']:.3f})", flush=True)
    (out_dir / "bench-evaluation.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
