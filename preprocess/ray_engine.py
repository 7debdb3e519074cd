"""`--engine ray`: the units of `preprocess/stream.py` run as Ray Data tasks, on this machine or a cluster.

    python -m preprocess --dataset imagefolder --src /shared/imagenet --out /shared/data --engine ray

Without `RAY_ADDRESS` a local Ray instance starts with one CPU per worker (`--workers`); with it
(e.g. `RAY_ADDRESS=ray://head:10001` or `auto` on a cluster node) the tasks spread over the cluster.
Every node must see SRC and OUT at the same paths (a shared filesystem) and have viewmill installed.
Each task runs `run_unit` on one unit (one shard); Ray retries a task whose worker died
(`MAX_RETRIES`), and since a unit only counts once its record is written, a retried unit rewrites
its shard from the start. The driver merges the records and writes the manifest; the FFCV file is
written afterwards on the driver from the shards. Ray is the optional extra `viewmill[ray]`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Callable, Iterator

from preprocess.stream import Policy, Unit

MAX_RETRIES = 3                 # attempts after a worker dies mid-unit (Ray Data's default is unlimited)


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

        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False, logging_level="ERROR")
        else:
            ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     object_store_memory=256 * 2**20)     # results are small records, not images

    def map(self, fn: Callable[[Unit, Policy], dict], units: list[Unit], policy: Policy) -> Iterator[dict]:
        """Yield `fn(unit, policy)` for every unit, in the order they finish."""
        if not units:
            return
        import ray.data

        self._connect()
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        run = self.unit_fn or fn

        def task(row: dict) -> dict:
            u = json.loads(row["unit"])
            unit = Unit(**{**u, "files": tuple(tuple(f) for f in u["files"])})
            return {"result": json.dumps(run(unit, policy))}

        rows = [{"unit": json.dumps(asdict(u))} for u in sorted(units, key=lambda u: -len(u.files))]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
            task, num_cpus=1, ray_remote_args_fn=lambda: {"max_retries": MAX_RETRIES})
        for row in ds.iter_rows():
            yield json.loads(row["result"])
