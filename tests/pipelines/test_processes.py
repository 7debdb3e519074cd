"""The processes viewmill starts (`pipelines.processes`): a child forked from a process that once built
a DALI pipeline freezes what it inherits before any collection can run there, so it does not finalise
the pipeline without its threads; children end with their parent, however it dies: children forked by
our pools or by a library after `before_fork`, children of children, exec'd processes that call
`end_with_parent`, and the workers a fork server starts for a process holding CUDA (DataLoader's and
DALI's), which end with that process, not with the server; and such a process never forks."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.processes import POLL_S, fork_context, proc_stat, running
from tests.processes import ROOT, holding, kill_and_reap, left_after, live, pids_under, start, wait_for, workers_of


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


def test_no_collection_can_run_in_a_forked_child_before_it_freezes_what_it_inherits() -> None:
    """A hook that runs in the child before ours (as threading's after-fork clean-up does, registered at
    import) sees the collector off, so nothing there can start a collection that would finalise an
    inherited DALI pipeline without its threads; the child turns it on once it has frozen, and the
    parent is left as it was (a fresh process, so that the hook runs first)."""
    code = (
        "import gc, os, sys\n"
        "seen = []\n"
        "os.register_at_fork(after_in_child=lambda: seen.append(gc.isenabled()))\n"
        "from pipelines import processes\n"
        "processes.before_fork()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child', seen, gc.isenabled(), gc.get_freeze_count() > 0, flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent', gc.isenabled())\n")
    out, err = start(["-c", code]).communicate(timeout=60)
    assert out.split("\n")[:2] == ["child [False] True True", "parent True"], err


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
elif kind == "server":                     # DataLoader workers of a process holding CUDA: the fork server's
    import torch
    processes.cuda_in_use = lambda: True
    loader = torch.utils.data.DataLoader(range(4), num_workers=2, persistent_workers=True,
                                         worker_init_fn=processes.worker_started,
                                         multiprocessing_context=processes.worker_context("pipelines.processes"))
    it = iter(loader)
    next(it)
    n = 4                                  # the server, its 2 workers, multiprocessing's resource tracker
elif kind == "dali-server":                # DALI's workers where CUDA is initialised: the fork server's
    from pipelines import dali_backend
    from pipelines.loader import build_loader
    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe
    dali_backend.worker_start_method = lambda: "forkserver"
    spec = LoaderSpec(root=sys.argv[2], dataset="synthetic", recipe=load_recipe("byol", 32, 16), split="train",
                      batch_size=8, num_workers=4)
    batches = iter(build_loader("dali", spec))
    next(batches)
    n = 3                                  # the server, 1 DALI worker, multiprocessing's resource tracker
elif kind == "unguarded":                  # the control: a fork without before_fork outlives its parent
    mp.get_context("fork").Process(target=sleeper).start()
    n = 1
print(n, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("kind", ["pool", "library", "exec", pytest.param("server", marks=pytest.mark.slow),
                                  pytest.param("dali-server", marks=pytest.mark.slow), "unguarded"])
def test_children_end_when_their_parent_is_killed(kind, tiny_data_root) -> None:
    parent = start(["-c", PARENT, kind, str(tiny_data_root)])
    expected = int(parent.stdout.readline())
    wait_for(lambda: len(live(parent.mark)) == expected + 1, 30, f"{expected} children", parent)
    noted = kill_and_reap(parent)
    # A fork server ends once it reads its parent's death on its pipe and has shut down its interpreter
    # with the libraries it preloaded (seconds); the other processes within a few of their polls.
    left = left_after(parent.mark, 15 if kind.endswith("server") else 5 * POLL_S + 1, noted)
    if kind == "unguarded":                # the test can tell: without the rule, the child lives on
        orphans = live(parent.mark)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert len(left) == 1 and len(orphans) == 1
    else:
        assert left == []


# A DataLoader (this module's context) whose worker dies while another process holds every lock of the
# event that tells its workers to end, as a worker killed while it looks at the event leaves it held.
HELD_EVENT = """
import os, signal, time
import torch
from pipelines.processes import Watched, WorkerDiedError, worker_context, worker_started

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.01)
        return i

loader = torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=1, worker_init_fn=worker_started,
                                     multiprocessing_context=worker_context("__main__"))
before = signal.getsignal(signal.SIGCHLD)
it = iter(loader)
signal.signal(signal.SIGCHLD, before)      # torch's handler out, as `iterate` does: the death told at a batch
batches = Watched(it)
next(batches)
event = it._workers_done_event
if os.fork() == 0:                         # takes what a worker would, then dies holding it
    for part in vars(event).values():
        if hasattr(part, "acquire"):
            part.acquire(False)
    os._exit(0)
os.wait()
os.kill(it._workers[0].pid, signal.SIGKILL)
try:
    while True:
        next(batches)
except WorkerDiedError as e:
    print("told:", e, flush=True)
os._exit(0)
"""


@pytest.mark.slow
def test_a_worker_killed_while_it_looks_at_its_end_event_does_not_hang_the_loader() -> None:
    """The DataLoader's workers look at an event all the time (whether to end); a
    `multiprocessing.Event` takes a lock for that, and a worker killed in that instant left the process
    that started it waiting on the lock for good once it found the worker dead (seen: a `gpus=2 linear`
    run whose rank 1 lost its worker was still waiting 29 minutes later). With
    `worker_context`'s event (a byte, no lock) the death is told in one line, as ever."""
    done = subprocess.run([sys.executable, "-c", HELD_EVENT], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "told: DataLoader worker (pid" in done.stdout, done.stdout + done.stderr


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


def test_a_folder_lock_held_on_another_machine_names_it_and_a_filesystem_without_locks_refuses_nothing(
        tmp_path, monkeypatch) -> None:
    """On a network filesystem the kernel cannot name another machine's process: the holder's own record
    (its pid and host, written when it took the lock) does. Where the filesystem has no record locks
    (`ENOLCK`: Lustre without `flock`, some NFS mounts) the lock is not taken and refuses nothing, rather
    than failing every run there."""
    import errno
    import fcntl

    from pipelines.processes import FolderLock

    path = tmp_path / ".run.lock"
    holder = holding(path)
    assert FolderLock(path).acquire().pid == holder.pid                     # this machine: the kernel's word
    path.write_text("4242 node07")                                          # as a holder on node07 writes it
    other = FolderLock(path).acquire()
    assert (str(other), other.stop()) == ("pid 4242 on node07: a process of another machine", "kill 4242 on node07")
    kill_and_reap(holder)

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    lock = FolderLock(path)
    assert lock.acquire() is None and not lock.taken


@pytest.mark.parametrize("backend", ["torch", "torchvision"])
def test_loader_workers_are_forked_where_the_default_start_method_is_spawn(backend, tiny_data_root,
                                                                           monkeypatch) -> None:
    """In a process whose default start method is spawn (any process started by spawn, such as the
    benches' fresh processes), the DataLoader workers of the torch-based loaders are still forked: a
    spawned worker imports torch again (seconds) and is not watched (rule 2)."""
    import multiprocessing as mp

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
    workers = [line for line in lines                     # not multiprocessing's helpers (another test's)
               if b"resource_tracker" not in line and b"forkserver import main" not in line]
    assert workers and all(line == mine for line in workers)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "torchvision"])
def test_loader_workers_come_from_the_fork_server_in_a_process_holding_cuda(backend, tiny_data_root,
                                                                            monkeypatch) -> None:
    """In a process holding a CUDA context the torch-based loaders never fork (rule 3): their workers are
    the fork server's children, and their batches are the forked workers' batches."""
    from pipelines import processes
    from pipelines.loader import build_loader
    from pipelines.processes import descendants, proc_stat
    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe

    spec = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", recipe=load_recipe("byol", 32, 16),
                      split="train", batch_size=8, num_workers=2)

    def first_batches():
        before = pids_under(os.getpid())
        it = iter(build_loader(backend, spec))
        batches = [next(it) for _ in range(2)]
        started = {pid: proc_stat(pid)[2] for pid, _ in descendants(os.getpid()) if pid not in before}
        return batches, {pid: parent for pid, parent in started.items()
                         if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()}

    forked, by_fork = first_batches()
    assert len(by_fork) == 2 and set(by_fork.values()) == {os.getpid()}
    monkeypatch.setattr(processes, "cuda_in_use", lambda: True)
    served, by_server = first_batches()
    workers = {pid: parent for pid, parent in by_server.items() if parent != os.getpid()}
    (server,) = set(workers.values())                    # one server (started once per process) ...
    assert len(workers) == 2 and proc_stat(server)[2] == os.getpid()   # ... whose parent is this process
    assert b"forkserver import main" in Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\0", b" ")
    assert set(by_server) - set(workers) <= {server}     # nothing forked from this process
    for a, b in zip(forked, served):
        assert torch.equal(a.index, b.index) and torch.equal(a.global_views, b.global_views)


@pytest.mark.slow
def test_a_fork_server_s_workers_find_the_heavy_libraries_already_imported() -> None:
    """The fork server imports what every worker needs once, when it starts (rule 3), so that no worker
    imports torchvision or timm itself: the process starting the workers waits for each one's imports
    in turn once their arguments outgrow a pipe (the 16 torchvision workers on an H200's host had not
    started after 110 s). A fresh process holding (as if) CUDA starts one worker and asks it which of
    the libraries were there before the worker's own code ran (its function's module imports none)."""
    code = (
        "import json, sys\n"
        "from pipelines import processes\n"
        "from tests.processes import imported\n"
        "processes.cuda_in_use = lambda: True\n"
        "ctx = processes.worker_context('pipelines.processes')\n"
        "queue = ctx.SimpleQueue()\n"
        "worker = ctx.Process(target=imported, args=(queue, ['torchvision', 'timm', 'numba']))\n"
        "worker.start()\n"
        "print(json.dumps([ctx.get_start_method(), queue.get(), 'torchvision' in sys.modules]))\n"
        "worker.join(30)\n")
    run = start(["-c", code])
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[-2000:]
    method, found, parent_imported_it = json.loads(out)
    assert method == "forkserver" and not parent_imported_it     # this process never imported torchvision
    assert found == ["torchvision", "timm", "numba"]


def _leaving_worker(creator: int) -> None:
    from pipelines.processes import leave_signals_to_creator

    leave_signals_to_creator(creator)
    time.sleep(60)


@contextlib.contextmanager
def catching_term():
    """This process catches SIGTERM within (as a rank holding it, or submitit's task, does)."""
    before = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _term_from_elsewhere(pids) -> None:
    """SIGTERM sent by another process (a scheduler, a launcher), not this one."""
    subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)


@pytest.mark.parametrize("creator_catches", [True, False], ids=["creator-catches", "default"])
def test_a_worker_leaves_sigterm_to_a_creator_that_catches_it_but_ends_by_the_creator_s_own(creator_catches) -> None:
    """Rule 4: a worker lives through a SIGTERM from elsewhere while its creator has a handler for it,
    and ends by one from a creator without a handler as before; the creator's own SIGTERM (DALI's pool
    and torch's DataLoader end their workers with it) ends it either way."""
    before = signal.signal(signal.SIGTERM, (lambda *_: None) if creator_catches else signal.SIG_DFL)
    try:
        worker = fork_context().Process(target=_leaving_worker, args=(os.getpid(),), daemon=True)
        worker.start()
        time.sleep(0.5)                                   # its thread that takes SIGTERM runs
        for _ in range(5):                                # every thread of it blocks SIGTERM
            _term_from_elsewhere([worker.pid])
        worker.join(1)
        assert worker.is_alive() is creator_catches
        if creator_catches:
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(5)
        assert worker.exitcode == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
@pytest.mark.parametrize("backend,server", [("torch", False), ("torch", True), ("dali", False), ("dali", True)])
def test_loader_workers_leave_a_job_s_end_signals_to_the_training_process(backend, server, tiny_data_root,
                                                                         monkeypatch) -> None:
    """SLURM sends its warning before preemption or the time limit (SIGUSR2) to every process of a job
    step, and at preemption SIGTERM too, and the training process holds them back until its next
    checkpoint (`train.dist.HeldSignal`; submitit's tasks ignore SIGTERM): a loader's workers, forked
    or the fork server's (a process holding CUDA), live through both, and the loader goes on with the
    batches of an undisturbed one (rule 4); and the loader still ends them when it is done with them.
    The handler is installed after the workers started: a worker looks at its creator's, not at one
    it copied.
    This process's own disposition of SIGUSR2 is the default, which ends a process."""
    pytest.importorskip("nvidia.dali" if backend == "dali" else "torch")
    from pipelines import dali_backend, processes
    from pipelines.loader import build_loader
    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe

    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    if server and backend == "torch":
        monkeypatch.setattr(processes, "cuda_in_use", lambda: True)
    elif server:
        monkeypatch.setattr(dali_backend, "worker_start_method",
                            lambda: (processes.fork_server(dali_backend.__name__), "forkserver")[1])
    spec = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", recipe=load_recipe("byol", 32, 16),
                      split="train", batch_size=8, num_workers=2)

    def epoch(disturb: bool) -> tuple[list[torch.Tensor], list[int]]:
        before = pids_under(os.getpid())
        loader = build_loader(backend, spec)
        it = iter(loader)
        out = [next(it).index for _ in range(2)]           # a DataLoader's 2 workers have each made a batch
        workers = workers_of(os.getpid(), before)
        if disturb:                                        # caught from now on, after the workers started
            for pid in workers:
                os.kill(pid, signal.SIGUSR2)
            with catching_term():
                _term_from_elsewhere(workers)
                time.sleep(0.5)
            # before the next batch: a DALI loader whose fork-server workers died waits for them for good
            assert workers and all(running(pid) for pid in workers)
        out += [b.index for b in it]
        del it, loader
        gc.collect()
        return out, workers

    undisturbed, _ = epoch(False)
    disturbed, workers = epoch(True)
    assert len(disturbed) == len(undisturbed) == 8 and all(map(torch.equal, disturbed, undisturbed))
    wait_for(lambda: not any(running(pid) for pid in workers), 30, "the workers' end")


KILLED_WORKER = """
import os, signal, sys, time
from dataclasses import fields, replace
import torch
from pipelines import dali_backend, processes
from pipelines.loader import build_loader
from pipelines.mixing import MixSpec, with_mix_source
from pipelines.processes import WorkerDiedError
from pipelines.spec import LoaderError, LoaderSpec
from pipelines.views import load_recipe

if __name__ == "__main__":
    if sys.argv[2] == "server":
        dali_backend.worker_start_method = lambda: (processes.fork_server(dali_backend.__name__), "forkserver")[1]
    spec = LoaderSpec(root=sys.argv[1], dataset="synthetic", recipe=load_recipe("byol", 32, 16), split="train",
                      batch_size=8, num_workers=2)
    dacl = MixSpec("dacl", alpha=0.5, dacl_noises=("binary",))       # a graph that draws itself
    for spec in [spec] * 3 + [replace(spec, mix=dacl, recipe=with_mix_source(spec.recipe, dacl))]:
        loader = build_loader("dali", spec)
        it = iter(loader)
        next(it)
        handed = 1
        time.sleep(2)                      # the workers have made the batches asked ahead and wait for tasks
        for pid, _ in loader._workers:
            os.kill(pid, signal.SIGKILL)
        began = time.monotonic()
        try:
            for _ in it:
                handed += 1
        except WorkerDiedError as e:
            print(f"{time.monotonic() - began:.1f}", str(e).splitlines()[0], flush=True)
        try:                               # the position reached, for a checkpoint (`train.loop`)
            state = loader.state_dict()
            print("position", state["batches_done"] == handed, flush=True)
        except LoaderError as e:
            print("lost", e, flush=True)
            continue
        finally:
            loader.close()                 # as the training loop closes it when the death passes
        if spec.mix == dacl and sys.argv[2] == "fork":   # the graph's own draws (one start method: the state
            # is the main process's): resumed there, the batch an unkilled loader makes
            for k, batch in enumerate(build_loader("dali", spec)):
                if k == handed:
                    break
            for name, dali in (("resumed", state["dali"]), ("unsaved", None)):    # without them: other masks
                again = build_loader("dali", spec)
                again.load_state_dict({**state, "dali": dali})
                made = next(iter(again))
                print(name, all(torch.equal(getattr(made, f.name), x) for f in fields(batch)
                                if (x := getattr(batch, f.name)) is not None), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "server"])
def test_a_killed_dali_worker_fails_the_loader_in_one_line_instead_of_waiting_for_good(start, tiny_data_root) -> None:
    """The OOM killer's SIGKILL to a DALI loader's workers: the next batch fails within seconds with one
    line naming the worker and what to do, four times in a row, and the process ends. Killed while they
    wait for a task, DALI 2.4's task queue waits for them for good (`DaliLoader._wait`). The loader's
    state then names the batches it handed out (a run of one process checkpoints it), without asking
    the broken pipeline anything; a graph that draws itself (DACL's Binary Mixup) keeps DALI's checkpoint
    taken before the run its worker died in, from which a new loader makes the batch an unkilled one
    makes there (its masks differ without it)."""
    pytest.importorskip("nvidia.dali")
    from tests.train.two_ranks import ROOT, env_here

    done = subprocess.run([sys.executable, "-c", KILLED_WORKER, str(tiny_data_root), start], cwd=ROOT, env=env_here(),
                          capture_output=True, text=True, timeout=180)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == (10 if start == "fork" else 8), done.stderr
    for line in lines[0:8:2]:
        seconds, message = line.split(" ", 1)
        assert float(seconds) < 10 and message.startswith("DALI worker process ") and "OOM killer" in message
        assert "run.resume=auto continues" in message
    assert lines[1:8:2] == ["position True"] * 4
    assert lines[8:] == (["resumed True", "unsaved False"] if start == "fork" else [])


CREATOR_KILLED_MID_HANDOVER = """
import os, select, signal, socket, time
from multiprocessing import resource_sharer
from pipelines.processes import fork_context, worker_started

def worker(conn) -> None:
    worker_started()
    resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))   # a tensor handed over: the sharer's thread listens
    conn.send(resource_sharer._resource_sharer._address)
    time.sleep(60)                                            # until it ends with its creator (rule 2)

if __name__ == "__main__":
    ours, theirs = fork_context().Pipe()
    fork_context().Process(target=worker, args=(theirs,)).start()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(ours.recv())                                 # as the creator fetches the tensor's descriptor
    select.select([sock], [], [], 10)                         # the sharer's challenge has come, unread
    print("connected", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)                      # the OOM killer, in the middle of the handover
"""


def test_a_worker_whose_creator_is_killed_mid_handover_says_nothing_and_ends() -> None:
    """A loader worker hands a batch's tensors over through multiprocessing's resource sharer, whose
    thread reports its own errors through `sys.excepthook`; its creator killed in the middle of a
    handover (the connection reset) printed that thread's traceback before the launcher's one line. The
    worker now says nothing of it once its creator has ended, and ends too (rule 2)."""
    creator = start(["-c", CREATOR_KILLED_MID_HANDOVER])
    out, err = creator.communicate(timeout=60)                # the worker holds stderr until it ends
    assert creator.returncode == -signal.SIGKILL and out == "connected\n"
    assert err == "" and left_after(creator.mark, 3.0) == []


KILLED_DATALOADER_WORKERS = """
import os, signal, sys, time
from pipelines.loader import build_loader
from pipelines.processes import WorkerDiedError
from pipelines.spec import LoaderSpec
from pipelines.views import load_recipe
from tests.processes import workers_of

spec = LoaderSpec(root=sys.argv[1], dataset="synthetic", recipe=load_recipe("byol", 32, 16), split="train",
                  batch_size=8, num_workers=2)
it = iter(build_loader("torch", spec))     # the torchvision loader's DataLoader is iterated alike
next(it)
for pid in workers_of(os.getpid()):
    os.kill(pid, signal.SIGKILL)
time.sleep(0.5)                    # a training step, which the death must not interrupt
try:
    for _ in it:
        pass
except WorkerDiedError as e:
    print(str(e).replace(chr(10), " | "), flush=True)
"""


@pytest.mark.slow
def test_a_killed_dataloader_worker_fails_the_loader_at_its_next_batch_in_one_line(tiny_data_root) -> None:
    """The OOM killer's SIGKILL to a torch-based loader's DataLoader workers, in a fresh process as a
    run's: the death is told at the loader's next batch, the one place where a run can save the steps
    it reached (`train.loop`), as the same one line as DALI's (the worker, the OOM killer,
    run.resume=auto), not torch's traceback; not in the middle of what the process does meanwhile,
    where torch's SIGCHLD handler, which `processes.iterate` takes back, raised it (the sleep here
    failed before). `test_killed_training` kills both DataLoader-based loaders' workers in a run."""
    from tests.train.two_ranks import ROOT, env_here

    done = subprocess.run([sys.executable, "-c", KILLED_DATALOADER_WORKERS, str(tiny_data_root)], cwd=ROOT,
                          env=env_here(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [message] = done.stdout.splitlines()
    assert message.startswith("DataLoader worker (pid") and " | " not in message
    assert "OOM killer" in message and "run.resume=auto continues" in message


def test_a_batch_transfer_cut_by_its_worker_s_death_is_that_death() -> None:
    """A DataLoader worker killed just after it queued a batch: fetching the batch's tensors from it
    fails (a connection reset) before torch has seen the worker gone, and `Watched` tells it as the
    worker's death in one line; such an error with no worker ended is left as it is."""
    from pipelines.processes import Watched, WorkerDiedError, fork_context

    class Cut:                                   # a DataLoader iterator whose batch's transfer fails
        def __init__(self, workers) -> None:
            self._workers = workers

        def __next__(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    worker = fork_context().Process(target=time.sleep, args=(60,))
    worker.start()
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as e:
        next(Watched(Cut([worker])))
    worker.join()
    assert str(e.value).startswith(f"DataLoader worker (pid {worker.pid}) is killed by signal: Killed while")
    with pytest.raises(ConnectionResetError):
        next(Watched(Cut([])))
