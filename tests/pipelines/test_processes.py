"""The processes viewmill starts (`pipelines.processes`): a child forked from a process that once built
a DALI pipeline freezes what it inherits, so it does not finalise the pipeline without its threads;
and children end with their parent, however it dies: children forked by our pools or by a library after
`before_fork`, children of children, and exec'd processes that call `end_with_parent`."""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest

from pipelines.processes import POLL_S, fork_context
from tests.processes import kill_and_reap, left_after, live, start, wait_for


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


def test_an_unreachable_dali_pipeline_of_a_loader_is_finalised_here_before_a_fork(tiny_data_root) -> None:
    """A DALI loader that is dropped leaves its pipeline in a reference cycle (the pipeline calls back
    into the loader): garbage that only a collection frees. The next fork's `before_fork` collects it
    in this process, where its threads exist, instead of leaving it to a child."""
    pytest.importorskip("nvidia.dali")
    import weakref

    from pipelines.loader import build_loader
    from pipelines.processes import before_fork
    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe

    loader = build_loader("dali", LoaderSpec(root=str(tiny_data_root), dataset="synthetic", split="train",
                                             recipe=load_recipe("byol", 32, 16), batch_size=8, num_workers=1))
    next(iter(loader))
    pipe = weakref.ref(loader._pipe)
    gc.disable()                                      # no collection but the one under test
    try:
        del loader
        assert pipe() is not None                     # unreachable, not yet finalised
        before_fork()
        assert pipe() is None
    finally:
        gc.enable()


# A parent that starts its children one way, says how many processes it started, then sleeps until killed.
PARENT = """
import multiprocessing as mp, os, subprocess, sys, time
from pipelines import processes

def sleeper():
    time.sleep(120)

def with_grandchild():                     # a worker that forks again (FFCV's writer inside our pool)
    mp.get_context("fork").Process(target=sleeper).start()
    time.sleep(120)

kind = sys.argv[1]
if kind == "pool":                         # our pools: fork_context
    processes.fork_context().Pool(2).apply_async(time.sleep, (120,))
    n = 2
elif kind == "library":                    # a library's own fork (FFCV, DataLoader) after before_fork
    processes.before_fork()
    mp.get_context("fork").Process(target=with_grandchild).start()
    n = 2
elif kind == "exec":                       # an exec'd child told its parent's pid (a rank of our launcher)
    code = "import sys, time; from pipelines import processes; processes.end_with_parent(int(sys.argv[1])); time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", code, str(os.getpid())])
    n = 1
elif kind == "unguarded":                  # the control: a fork without before_fork outlives its parent
    mp.get_context("fork").Process(target=sleeper).start()
    n = 1
print(n, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("kind", ["pool", "library", "exec", "unguarded"])
def test_children_end_when_their_parent_is_killed(kind) -> None:
    parent = start(["-c", PARENT, kind])
    expected = int(parent.stdout.readline())
    wait_for(lambda: len(live(parent.mark)) == expected + 1, 30, f"{expected} children", parent)
    noted = kill_and_reap(parent)
    left = left_after(parent.mark, 5 * POLL_S + 1, noted)
    if kind == "unguarded":                # the test can tell: without the rule, the child lives on
        orphans = live(parent.mark)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert len(left) == 1 and len(orphans) == 1
    else:
        assert left == []


LOCK_HOLDER = """
import os, sys, time
from pathlib import Path
from preprocess.prepare import DatasetLock
DatasetLock(Path(sys.argv[1]), "ds").acquire()
if os.fork() == 0:                         # a child without the rule: it inherits no record lock
    time.sleep(120)
    os._exit(0)
print("held", flush=True)
time.sleep(120)
"""


def test_the_dataset_lock_belongs_to_the_run_not_to_its_children_and_a_dead_run_s_lock_is_stale(tmp_path, capfd) -> None:
    from preprocess.prepare import DatasetLock
    from preprocess.sources import PreprocessError

    holder = start(["-c", LOCK_HOLDER, str(tmp_path)])
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(PreprocessError) as held:                  # a live run: named, with how to stop it
        DatasetLock(tmp_path, "ds").acquire()
    message = str(held.value)
    assert message.count("\n") == 0
    assert f"another run (pid {holder.pid}: " in message and "preprocess.prepare import DatasetLock" in message
    assert f"stop it with `kill {holder.pid}`" in message

    kill_and_reap(holder)                                         # its orphaned child lives on ...
    assert len(live(holder.mark)) == 1
    lock = DatasetLock(tmp_path, "ds")
    capfd.readouterr()
    lock.acquire()                                                # ... and does not hold the lock
    err = capfd.readouterr().err
    assert err == f"the lock of ds is stale: its run (pid {holder.pid}) ended without finishing; going on\n"
    lock.release()
    lock.acquire()                                                # released cleanly: nothing to say
    assert capfd.readouterr().err == ""
    lock.release()
    for pid in live(holder.mark):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("backend", ["torch", "torchvision"])
def test_loader_workers_are_forked_where_the_default_start_method_is_spawn(backend, tiny_data_root,
                                                                           monkeypatch) -> None:
    """In a process whose default start method is spawn (any process started by spawn, such as the
    benches' fresh processes), the DataLoader workers of the torch-based loaders are still forked: a
    spawned worker imports torch again (seconds) and is not watched (rule 2)."""
    import multiprocessing as mp
    from pathlib import Path

    from pipelines.loader import build_loader
    from pipelines.processes import descendants
    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe

    monkeypatch.setattr(mp.context._default_context, "_actual_context", mp.get_context("spawn"))
    spec = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", recipe=load_recipe("byol", 32, 16),
                      split="train", batch_size=8, num_workers=1)
    loader = build_loader(backend, spec)
    assert next(iter(loader)).global_views.shape[1] == 8
    # A forked worker has this process's command line; a spawned one that of multiprocessing's spawn.
    mine = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid, _ in descendants(os.getpid())]
    workers = [line for line in lines if b"resource_tracker" not in line]      # not multiprocessing's helper
    assert workers and all(line == mine for line in workers)
