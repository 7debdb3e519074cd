"""Worker processes of the preprocessors: forked, after a garbage collection in the parent.

A forked child inherits the parent's unreachable objects, and the first collection in the child
(multiprocessing runs one as it starts) would run their finalisers there. A DALI pipeline's
finaliser waits on its worker threads, which the child does not have, and so a child forked from a
process that once built a pipeline (a test session, a notebook) can hang before it runs anything.
Collecting first finalises such objects in the parent, where their threads exist. The loaders' torch
workers do the same (`pipelines.spec.collect_before_fork`; the import rules keep preprocess off it).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from multiprocessing.context import BaseContext


def fork_context() -> BaseContext:
    """The fork start method, with the parent's garbage collected first (module docstring)."""
    gc.collect()
    return mp.get_context("fork")
