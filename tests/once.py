"""Expensive test inputs made once per test session, also under pytest-xdist (where each worker process
has its own session-scoped fixtures): the first worker that needs one makes it under a file lock, the
others wait for it and read the same folder."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

DONE = ".made"


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `make(folder)` once for the whole test session (all workers)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base     # one folder for all workers
    out = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / DONE).exists():
            shutil.rmtree(out, ignore_errors=True)                             # a make that failed half-way
            out.mkdir()
            make(out)
            (out / DONE).touch()
    return out
