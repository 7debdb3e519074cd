"""`--engine ray`: the units of `preprocess/stream.py` run as Ray Data tasks, on this machine or a cluster.

    python -m preprocess --dataset imagefolder --src /shared/imagenet --out /shared/data --engine ray

Without `RAY_ADDRESS` a local Ray instance starts with one CPU per worker (`--workers`); with it
(e.g. `RAY_ADDRESS=ray://head:10001` or `auto` on a cluster node) the tasks spread over the cluster.
Every node must see SRC and OUT at the same paths (a shared filesystem) and have viewmill installed.
Each task runs `run_unit` on one unit (one shard); Ray retries a task whose worker died, and since a
unit only counts once its record is written, a retried unit rewrites its shard from the start. A
unit whose worker dies `MAX_ATTEMPTS` times stops the run (Ray alone would retry it forever). The driver merges the records and writes the manifest; the FFCV file is
written afterwards on the driver from the shards. Ray is the optional extra `viewmill[ray]`.

A local instance ends with the run, however the run ends. Ray ties its GCS server and raylet to the
driver (a parent-death signal), and the raylet's workers to the raylet; but its agents (dashboard
and runtime-env) outlive a raylet killed by a signal for a minute, blocked on reporting the death to
the dead GCS (Ray 2.60: a fixed 60 s timeout). So the driver also starts a reaper process
(`reap_when_orphaned`) that, once the driver is gone, kills whatever that raylet started.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from pipelines import schema
from pipelines.processes import descendants, running
from preprocess.stream import Policy, Unit

MAX_ATTEMPTS = 4                # tries of one unit whose worker keeps dying (e.g. out of memory)
REAPER_POLL_S = 0.2             # how often the reaper of a local instance looks at the driver and the raylet


class UnitFailed(ValueError):
    """A unit's worker died MAX_ATTEMPTS times."""


class RayUnavailable(RuntimeError):
    """Ray is not installed."""


class RayEngine:
    """Units as Ray Data map tasks (`num_cpus=1` each); results stream back as tasks finish."""

    name = "ray"

    def __init__(self, workers: int, unit_fn: Callable[[Unit, Policy], dict] | None = None) -> None:
        """
        Args:
            workers: CPUs of a local Ray instance (ignored when connecting to a cluster).
            unit_fn: what runs per unit (default: `map`'s `fn`); tests wrap it to kill a worker.
        """
        try:
            import ray  # noqa: F401
            import ray.data  # noqa: F401
        except ImportError:
            raise RayUnavailable("--engine ray needs Ray: `pip install -e '.[ray]'` (make test installs it), "
                                 "or use --engine local") from None
        self.workers = workers
        self.unit_fn = unit_fn

    def _connect(self) -> None:
        import ray

        logging.getLogger("ray.data").setLevel(logging.ERROR)   # no lines per execution; our own bar and lines
        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False, logging_level="ERROR")
        else:
            ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     object_store_memory=256 * 2**20)     # results are small records, not images
            try:                 # Ray's own table of the processes it started (private in Ray 2.60)
                raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
            except (AttributeError, KeyError, IndexError):
                return           # a Ray that moved it: its agents still end, a minute after the run
            subprocess.Popen([sys.executable, "-c", f"from preprocess.ray_engine import reap_when_orphaned; "
                              f"reap_when_orphaned({raylet}, {os.getpid()})"], stdin=subprocess.DEVNULL,
                             start_new_session=True)

    def map(self, fn: Callable[[Unit, Policy], dict], units: list[Unit], policy: Policy) -> Iterator[dict]:
        """Yield `fn(unit, policy)` for every unit, in the order they finish."""
        if not units:
            return
        import ray.data

        self._connect()
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        # One map operator and small outputs: nothing to reserve resources for. With the reservation
        # on, a 2-CPU instance ran one task at a time until the first finished.
        ctx.op_resource_reservation_enabled = False
        run = self.unit_fn or fn

        def task(row: dict) -> dict:
            import cv2
            cv2.setNumThreads(1)     # a Ray worker is a fresh process: one task per CPU is the parallelism
            u = json.loads(row["unit"])
            unit = Unit(**{**u, "files": tuple(tuple(f) for f in u["files"])})
            # One line per attempt; a temporary name, so the next run starts counting afresh.
            tries = Path(policy.parts) / unit.split / f".{schema.SHARD_PATTERN.format(unit.number)}.tries.tmp"
            tries.parent.mkdir(parents=True, exist_ok=True)
            with open(tries, "a") as f:
                f.write(f"{os.getpid()}\n")
            if len(tries.read_text().splitlines()) > MAX_ATTEMPTS:
                raise UnitFailed(f"the worker writing {unit.split} shard {unit.number} died {MAX_ATTEMPTS} times "
                                 f"(files {unit.files[0][0]} ...); check memory and those files, then re-run")
            result = run(unit, policy)
            tries.unlink(missing_ok=True)
            return {"result": json.dumps(result)}

        rows = [{"unit": json.dumps(asdict(u))} for u in units]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map(task, num_cpus=1)
        try:
            for row in ds.iter_rows():
                yield json.loads(row["result"])
        except Exception as e:  # noqa: BLE001 — Ray wraps the task's error; say it in one line
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if isinstance(cause, OSError):
                raise cause from None
            raise UnitFailed(str(cause).strip().splitlines()[-1]) from None


def reap_when_orphaned(raylet: int, driver: int) -> None:
    """Run in a child process of a driver that started a local Ray instance: when the driver is gone
    (killed), kill every process that the instance's raylet started; when the raylet ends while the
    driver lives (`ray.shutdown`), return.

    The raylet's descendants are noted at every poll while it lives (a process's parent, not its
    environment, says who started it: Ray's process titles overwrite the environment /proc shows),
    each with its start time, so that a pid reused since is never killed.

    Args:
        raylet: the pid of the local instance's raylet.
        driver: the pid of the driver, this process's parent (given: it may be gone before this
            process has started).
    """
    started: set[tuple[int, str]] = set()
    while os.getppid() == driver and running(raylet):
        started |= descendants(raylet)
        time.sleep(REAPER_POLL_S)
    time.sleep(REAPER_POLL_S)             # a dying driver takes its raylet first: let the driver's exit end
    if os.getppid() == driver:
        return
    for pid, since in started:
        if running(pid, since):           # the same process, still there
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
