"""Forked preprocessing workers start in a process that once built a DALI pipeline (a test session,
a notebook): its leftover pipeline is finalised in the parent, not in a child without its threads."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from preprocess.workers import fork_context


def _collect() -> None:
    gc.collect()                                      # what a child's first collection would do


def test_a_forked_worker_does_not_finalise_the_parent_s_dali_pipeline() -> None:
    dali = pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, types

    @dali.pipeline_def(batch_size=1, num_threads=2, device_id=None)
    def tiny():
        return fn.cast(types.Constant(np.zeros(4, np.float32)), dtype=types.UINT8)

    pipe = tiny()
    pipe.build()
    pipe.run()
    cycle = [pipe]
    cycle.append(cycle)                               # garbage only a collection frees
    del pipe, cycle
    child = fork_context().Process(target=_collect)
    child.start()
    child.join(20)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0
