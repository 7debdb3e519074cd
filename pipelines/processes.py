"""The processes viewmill starts: forked children that leave what they inherit alone, and that end when
their parent ends.

Every process viewmill starts (preprocessing work units, DALI-shard and saliency workers, FFCV's writer
processes, the torch DataLoader workers of the loaders, the ranks the training launcher starts) follows
two rules, kept here for preprocess, pipelines and train alike:

1. A child does not finalise what it inherits. A forked child inherits the parent's unreachable
   objects, whose finalisers could run there: a DALI pipeline's waits on its worker threads, which
   the child does not have, so a child forked from a process that once built a pipeline (a test
   session, a notebook) hung before doing anything (in its first collection, or in threading's
   after-fork clean-up). So the fork happens with the collector off (the at-fork hooks turn it off
   just before and back on after, in the parent as it was), and a forked child freezes what it
   inherits (`gc.freeze`) before it turns the collector back on: no collection in the child, not even
   one that threading's after-fork clean-up would start, ever looks at the inherited objects (which
   also keeps it off the pages the child shares with its parent, as Python's documentation of
   `gc.freeze` says). The parent finalises its own garbage when it collects. A full collection before
   every fork did the same at 0.2 s a fork in a process holding torch and up to 1 s in a test session,
   and so did one before every fork while a DALI pipeline existed (each DALI loader forks its workers).
2. End with the parent, however the parent ends (`kill -9`, the OOM killer, a crash). An orphan is
   re-parented to init and works on: it holds memory and cores, and writes into a staging or run
   folder that the next run resumes from. Each child runs a watchdog thread that polls its parent's pid
   and kills itself once the parent is gone. Linux's parent-death signal (PR_SET_PDEATHSIG) is not
   used: it fires when the parent *thread* that forked the child ends, and a pool's helper thread
   that replaces a worker would then kill a healthy child; polling the pid holds for every start
   method. Forked children freeze and get the watchdog in an at-fork hook that `before_fork` registers
   once per process (so also the children a library forks: FFCV's writers, DataLoader workers); a process
   started by exec (a rank of the elastic launcher or torchrun) calls `end_with_parent` itself.
3. No fork of a process that holds a CUDA context: a DataLoader's workers start from a fork server
   there (`worker_context`), as DALI's do (`dali_backend.worker_start_method`). Forking such a process
   copies the locks its CUDA, pin-memory and DALI threads hold at that instant into a child that has
   none of those threads; on an H200 (torch 2.11, DALI 2.4.0) the second torchvision loader forked in
   one process hung for good, its workers idle and the thread taking the batches waiting for one.
   PyTorch's documentation says the same of CUDA with fork. The server is started by exec once per
   process, imports the heavy libraries every worker needs (`SERVER_PRELOAD`) and the module of the
   first that asked for it, and forks each worker from itself; a worker it starts ends with the process
   that asked for it (`worker_started`). Preloading matters beyond start-up time: the process starting
   a worker writes the worker's arguments into a pipe that the worker reads only after importing the
   parent's main module, so once the arguments outgrow the pipe's buffer (64 KiB; a reader's records
   take 64 bytes each) the parent waits for each worker's imports in turn. On an H200's 16-core host
   the 16 workers of one torchvision loader, each importing torchvision and timm itself, had not
   started after 110 s.
4. A loader's worker leaves the signals of a job's end to the process it works for. SLURM signals every
   process of a job step: with the `--signal` it was given before preemption or the time limit (SIGUSR2
   for submitit), and with SIGTERM when it preempts or cancels the job (some sites send both at once);
   torch's launcher sends SIGTERM to each rank's process group. The training process holds such a
   signal back until its next checkpoint (`train.dist.HeldSignal`; submitit's tasks also ignore
   SIGTERM), and a worker that died of it meanwhile would fail the loader before the checkpoint. So a
   worker ignores the warning (`SCHEDULER_SIGNALS`), and takes SIGTERM in a thread of its own, which
   leaves it to the creator while the creator catches SIGTERM (a handler there, as its /proc status
   shows), unless the creator sent it itself: DALI's pool and torch's DataLoader end their workers with
   SIGTERM, and DALI waits for them without a timeout. Otherwise SIGTERM ends the worker as it did
   before; either way the worker ends with its creator (rule 2). The watchdog and that thread block
   every signal, so that none is delivered to a thread that would take its default action there.
   Other children (preprocessing's pools) keep both signals' defaults.

`proc_stat`, `running` and `descendants` read /proc for who runs and who started whom (the reaper of
a local Ray instance, `preprocess.ray_engine`, and the tests that kill runs use them).

`FolderLock` says who writes a folder: one process of one command at a time writes a dataset
(`preprocess`) or a run's folder (`train`), and a second is refused in one line naming the first.

The limits a process meets at a user's site, checked when a command starts rather than met as a
traceback hours in: open files (`ensure_open_files`: a soft limit below what the command needs is
raised up to the hard limit, which its children inherit, else one line says what to set) and the
shared memory that worker processes hand batches through (`check_shared_memory`: a container's
/dev/shm is often 64 MiB).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import multiprocessing as mp
import os
import resource
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Iterator, NamedTuple

POLL_S = 0.2                     # how often a child looks at its parent's pid: a dead parent's children end within it
_forking_pid: int | None = None  # the pid of the process that is forking, read by the child it forks
_collecting = True               # whether the collector was on when the fork began
_hooked = False                  # the at-fork hooks are registered in this process (inherited by its children)
_watched_in: int | None = None   # the pid of the process whose watchdog runs (a forked child's differs)
_forking_workers = False         # the children forked now are loader workers (rule 4), read by the child
# What a fork server imports when it starts (rule 3), those not installed skipped: the libraries that
# the workers of every loader import (through the main module of the process that starts them).
SERVER_PRELOAD = ("numpy", "PIL.Image", "torch", "torchvision", "timm", "nvidia.dali", "numba")
# The warning SLURM sends every process of a job step before it ends the job, as submitit asks (rule 4).
SCHEDULER_SIGNALS = (signal.SIGUSR2,)
# The signal a scheduler or a launcher ends a job with, left to a creator that catches it (rule 4).
END_SIGNAL = signal.SIGTERM


class WorkerDiedError(RuntimeError):
    """A loader's worker process ended while the loader waited for it; the message is one line
    (`worker_died`)."""


def worker_died(what: str) -> WorkerDiedError:
    """The one-line error of a loader whose worker ended; `what` names the worker and how it ended."""
    return WorkerDiedError(f"{what} while the loader waited for its batch (killed: by the OOM killer when memory "
                           "ran out, see `dmesg`); the same command with run.resume=auto continues from the last "
                           "checkpoint, and data.num_workers lower or a smaller data.batch_size needs less memory")


def worker_death(e: BaseException) -> WorkerDiedError | None:
    """`e` as `worker_died`'s one line if it tells a loader worker's death (torch's "DataLoader worker
    (pid N) is killed by signal: ..." or "... exited unexpectedly", which torch's SIGCHLD handler may
    also raise outside the loader, in whatever the main thread runs then), else None."""
    if isinstance(e, WorkerDiedError):
        return e
    if isinstance(e, RuntimeError) and str(e).startswith("DataLoader worker (pid"):
        return worker_died(str(e).strip().rstrip("."))
    return None


def iterate(loader) -> Iterator:
    """The batches of a torch DataLoader (`Watched`), a worker's death told at the next batch only.

    The first DataLoader iterator of a process sets a SIGCHLD handler that raises a worker's death in
    whatever the main thread runs then, mostly in the middle of a training step, where nothing can be
    saved. The iterator itself tells the death at its next batch (it looks at its workers whenever it
    has waited 5 s for one, torch's only way on platforms without SIGCHLD): the one place where a run
    can save the steps it reached (`train.loop`). So the handler there before comes back once the
    iterator has set its own.
    """
    before = signal.getsignal(signal.SIGCHLD)
    batches = iter(loader)
    if signal.getsignal(signal.SIGCHLD) is not before:     # set in the main thread only, as torch does
        signal.signal(signal.SIGCHLD, before)
    return Watched(batches)


class Watched:
    """The batches of a DataLoader's iterator, a worker's death raised as `worker_died`'s one line;
    `close()` ends the iterator's workers at once.

    A worker killed just after it queued a batch fails the batch's transfer instead (its tensors'
    file descriptors are fetched from the worker: a connection reset, an EOF), sometimes before torch
    sees the worker gone (2 of 40 tries with the workers killed one batch in); that is the same death,
    told once the worker has ended (`_ended_worker`).

    Without `close()` the workers end when the iterator is collected, and an exception raised while it
    waited for a batch (a worker's error, a scheduler's signal) keeps it, through the frames of its
    traceback, until the garbage collector finds that cycle: seconds to minutes later, or never.
    """

    def __init__(self, batches: Iterator) -> None:
        self.batches = batches

    def __iter__(self) -> Watched:
        return self

    def __next__(self):
        batches = self.batches
        try:
            return next(batches)
        except RuntimeError as e:
            if (died := worker_death(e)) is None:
                raise
            raise died from None
        except (OSError, EOFError) as e:
            workers = getattr(batches, "_workers", ())      # torch's iterator keeps its processes there
            if (died := _ended_worker(workers)) is None:
                raise
            raise died from e

    def close(self) -> None:
        """End the iterator's worker processes now (torch's own shutdown, as when it is collected)."""
        if (shutdown := getattr(self.batches, "_shutdown_workers", None)) is not None:
            shutdown()


def _ended_worker(workers, wait_s: float = 5.0) -> WorkerDiedError | None:
    """`worker_died`'s error for the first of a DataLoader iterator's `workers` (its processes) that has
    ended or ends within `wait_s` (a killed process closes its files a moment before it ends); None if
    all still run then."""
    deadline = time.monotonic() + wait_s
    while workers:
        for w in workers:
            if (code := w.exitcode) is not None:
                how = f"is killed by signal: {signal.strsignal(-code)}" if code < 0 else f"exited with status {code}"
                return worker_died(f"DataLoader worker (pid {w.pid}) {how}")
        if time.monotonic() > deadline:
            break
        try:
            time.sleep(0.05)
        except RuntimeError as e:           # torch's SIGCHLD handler told it first (not set by `iterate`)
            if (died := worker_death(e)) is None:
                raise
            return died
    return None


def end_with_parent(parent: int | None = None) -> None:
    """End this process (SIGKILL) as soon as `parent` is no longer its parent (module docstring, 2);
    once per process (a second call in the same process does nothing).

    Args:
        parent: the pid of the process whose death ends this one; default the current parent. A
            parent that is already gone ends this process at once.
    """
    parent = os.getppid() if parent is None else parent
    _end_when(lambda: os.getppid() != parent)     # re-parented (to init or a subreaper) once the parent dies


def end_with_process(pid: int) -> None:
    """End this process (SIGKILL) as soon as process `pid`, not its parent, has ended (a worker of a fork
    server ends with the process that asked for it); once per process, as `end_with_parent`."""
    _, started, _ = proc_stat(pid)

    def gone() -> bool:
        state, since, _ = proc_stat(pid)
        return state in ("", "Z") or since != started        # ended, or its pid is another process's now

    _end_when(gone)


def _end_when(gone) -> None:
    global _watched_in
    if _watched_in == os.getpid():
        return
    if gone():
        os.kill(os.getpid(), signal.SIGKILL)
    _watched_in = os.getpid()
    _start_deaf_thread(_watch, (gone,), "viewmill-end-with-parent")


def _start_deaf_thread(target, args: tuple, name: str) -> None:
    """Start a daemon thread that blocks every signal (it inherits this thread's mask, blocked for the
    moment of its start), so that the kernel delivers none to it (module docstring, 4)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _watch(gone) -> None:
    while not gone():
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _before_fork_hook() -> None:
    global _forking_pid, _collecting
    _forking_pid = os.getpid()
    _collecting = gc.isenabled()
    gc.disable()                             # rule 1: no collection until the child has frozen


def _in_parent() -> None:
    if _collecting:
        gc.enable()


def _in_forked_child() -> None:
    gc.freeze()                              # rule 1: the inherited objects are the parent's to collect
    if _collecting:
        gc.enable()
    end_with_parent(_forking_pid)            # the pid before the fork: a parent dead already ends us now
    if _forking_workers:
        leave_signals_to_creator(_forking_pid)   # rule 4, from the child's first instant


@contextlib.contextmanager
def forking_workers():
    """Within, the children this process forks are loader workers (a library's: DALI's pool), which leave
    the scheduler's warning to it from their first instant (module docstring, 4)."""
    global _forking_workers
    before_fork()
    before, _forking_workers = _forking_workers, True
    try:
        yield
    finally:
        _forking_workers = before


def before_fork() -> None:
    """Call before forking workers (or before a library does): makes every child forked from this
    process from now on leave the objects it inherits to it (module docstring, 1) and end with it (2)."""
    global _hooked
    if not _hooked:
        os.register_at_fork(before=_before_fork_hook, after_in_parent=_in_parent, after_in_child=_in_forked_child)
        _hooked = True


def fork_context() -> BaseContext:
    """The multiprocessing fork start method, after `before_fork`."""
    before_fork()
    return mp.get_context("fork")


def cuda_in_use() -> bool:
    """Whether this process holds a CUDA context (torch has initialised CUDA): then it must not fork
    (module docstring, 3). False without torch imported."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def worker_context(preload: str) -> BaseContext:
    """The start method of a DataLoader's workers: fork (`fork_context`: cheap, the reader's pages shared)
    while this process holds no CUDA context, else the fork server (module docstring, 3), which
    imports `preload` (the loader's module, and torch with it) once, when it starts. Pass
    `worker_init_fn=worker_started` with it, and a dataset that pickles small (`shards.ShardReader`).
    Its events have no lock (`FlagEvent`)."""
    if not cuda_in_use():
        before_fork()
        return _ForkWorkers()
    fork_server(preload)                    # its preload
    return _ForkServerWorkers()


class FlagEvent:
    """A `multiprocessing.Event` for a DataLoader's workers, without its lock: one shared byte.

    torch's DataLoader tells its workers to end with an event that each worker looks at all the time.
    A `multiprocessing.Event` takes a lock to be looked at, and a worker killed in that instant (the OOM
    killer) leaves the lock held for good: the process that started the worker then waits on it when
    it finds the worker dead (`_mark_worker_as_unavailable`), and so does its shutdown, for ever (a
    2-rank `linear` run whose rank 1 lost its worker was still waiting 29 minutes later, when it was
    stopped by hand). The DataLoader only sets the event and reads it (`set`, `is_set`), and a
    byte needs no lock for either.
    """

    def __init__(self, ctx: BaseContext) -> None:
        self._flag = ctx.RawValue("b", 0)

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def set(self) -> None:
        self._flag.value = 1


class _FlagEvents:
    """A start method whose `Event` is a `FlagEvent` (`worker_context`)."""

    def Event(self) -> FlagEvent:  # noqa: N802 (multiprocessing's name)
        return FlagEvent(self)


class _ForkWorkers(_FlagEvents, mp.context.ForkContext):
    pass


class _ForkServerWorkers(_FlagEvents, mp.context.ForkServerContext):
    pass


def fork_server(preload: str) -> BaseContext:
    """The fork-server start method (rule 3), whose server, when this process first starts it, imports
    `SERVER_PRELOAD` and `preload` (a later call's module is imported by each worker that needs it)."""
    mp.set_forkserver_preload([*SERVER_PRELOAD, preload])
    return mp.get_context("forkserver")


def worker_started(worker_id: int = 0) -> None:
    """A DataLoader's `worker_init_fn`: the worker ends with the process that started it, whichever
    start method made it (rule 2; `end_with_creator`), and leaves it the scheduler's warning (rule 4)."""
    parent = mp.parent_process()
    creator = os.getppid() if parent is None else parent.pid
    end_with_creator(creator)
    leave_signals_to_creator(creator)
    sys.excepthook = _silent_once_orphaned(creator, sys.excepthook)
    threading.excepthook = _silent_once_orphaned(creator, threading.excepthook)


def _silent_once_orphaned(creator: int, hook):
    """A worker's `sys.excepthook` or `threading.excepthook` that says nothing of an error once `creator`
    has ended (waiting up to 1 s for a creator that is ending): the thread that hands tensors to it
    (multiprocessing's resource sharer, which catches its own errors and reports them through
    `sys.excepthook`) fails with a connection reset when the creator is killed in the middle of a batch,
    and its traceback came before the launcher's one line (rule 2 ends the worker within `POLL_S`
    anyway); another thread's uncaught error goes to `threading.excepthook`."""
    def quiet(*args) -> None:
        deadline = time.monotonic() + 1.0
        while running(creator) and time.monotonic() < deadline:
            time.sleep(0.05)
        if running(creator):
            hook(*args)
    return quiet


def leave_signals_to_creator(creator: int) -> None:
    """In this loader worker of process `creator` (module docstring, 4: a DataLoader's, `worker_started`;
    DALI's, forked within `forking_workers` or the fork server's, `dali_backend`): ignore the warning a
    job scheduler sends every process of a job (`SCHEDULER_SIGNALS`), and leave SIGTERM to `creator`
    while it catches it (`_take_end_signal`). From the worker's main thread, before it starts threads
    of its own (they inherit SIGTERM blocked); elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SCHEDULER_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {END_SIGNAL})      # pending until `_take_end_signal` takes it
    signal.signal(END_SIGNAL, signal.SIG_DFL)       # not the handler a fork copied from the creator (a held one)
    _start_deaf_thread(_take_end_signal, (creator,), "viewmill-end-signal")


def _take_end_signal(creator: int) -> None:
    """Take each SIGTERM sent to this worker: one from elsewhere than `creator` (a scheduler, a launcher)
    while `creator` catches SIGTERM is left to it (this worker ends with it, rule 2); any other ends
    the worker by it (its default action, as before)."""
    while True:
        sender = signal.sigwaitinfo({END_SIGNAL}).si_pid
        if sender != creator and _catches(creator, END_SIGNAL):
            continue
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {END_SIGNAL})
        signal.pthread_kill(threading.get_ident(), END_SIGNAL)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (its SigCgt in /proc); False once it
    is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signum - 1) & 1)


def end_with_creator(creator: int) -> None:
    """End this worker with `creator`, the process that asked for it (rule 2): its parent when forked (the
    at-fork hook did that already), else the process itself: the parent of a fork server's worker is
    the server, which lives as long as any of its workers does (each holds the server's liveness pipe).
    """
    if creator == os.getppid():
        end_with_parent()
    else:
        end_with_process(creator)


def proc_stat(pid: int) -> tuple[str, str, int]:
    """(state, start time in clock ticks since boot, parent pid) of a process, from /proc/<pid>/stat;
    ("", "", 0) when it is gone. Its pid and start time name one process: a pid can be reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19], int(fields[1])
    except (OSError, IndexError, ValueError):
        return "", "", 0


def process_age_s(pid: int | None = None) -> float | None:
    """Seconds since a process (default: this one) started, interpreter start-up included, from /proc
    (clock-tick resolution, 10 ms on Linux); None where /proc cannot tell."""
    _, started, _ = proc_stat(os.getpid() if pid is None else pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - int(started) / os.sysconf("SC_CLK_TCK")) if started else None


def running(pid: int, since: str | None = None) -> bool:
    """Whether `pid` runs (exists and is not a zombie) and, given `since`, is the process that started then."""
    state, started, _ = proc_stat(pid)
    return state not in ("", "Z") and since in (None, started)


def descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every running descendant of `root`, from one scan of /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            state, since, parent = proc_stat(int(entry.name))
            if state not in ("", "Z"):
                children.setdefault(parent, []).append((int(entry.name), since))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


# ------------------------------------------------------------------------------------------------
# Who writes a folder: a dataset being written, a run folder
# ------------------------------------------------------------------------------------------------


class Holder(NamedTuple):
    """The process that holds a `FolderLock`."""

    pid: int
    host: str                        # "": this machine
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}{f' on {self.host}' if self.host else ''}: {self.command}"

    def stop(self) -> str:
        """What stops it, for a message."""
        return f"kill {self.pid}" + (f" on {self.host}" if self.host else "")


class FolderLock:
    """An exclusive lock on writing a folder (a dataset written, a run's folder): a POSIX record lock on
    the file `path`, in which the holder records its pid and host. Two writers of one folder would delete
    or overwrite each other's files.

    The lock belongs to the process that takes it alone: a record lock is not inherited by the processes
    it forks (an `flock` was, and orphaned workers of a killed run kept it), and the kernel drops it when
    the process ends, however it ends. A network filesystem with POSIX locks (NFS; Lustre mounted with
    `flock`) holds it across the machines that share the folder; on one without (`ENOLCK`, `EOPNOTSUPP`)
    it is not taken and refuses nothing (`taken` stays False). Record locks do not exclude two holders in
    one process (and closing any descriptor of the file drops them), so the files this process holds are
    kept in `_HELD` and a second lock on one is refused before it opens one.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.taken = False
        self.stale: str = ""         # the pid a holder that ended without `release` left in the file

    def acquire(self) -> Holder | None:
        """Take the lock (nothing when this object holds it); None when taken (or not supported here),
        else the live process that holds it."""
        if self.fd is not None:
            return None
        if _file_id(self.path) in _HELD:
            return Holder(os.getpid(), "", "this process")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                holder = _holder(fd)
                os.close(fd)
                return holder
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):     # no record locks here
                return None
            raise
        recorded = os.pread(fd, 256, 0).decode(errors="replace").split()
        if recorded and recorded[0] != str(os.getpid()):
            self.stale = recorded[0]
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}".encode(), 0)
        self.fd, self.taken = fd, True
        _HELD.add(_file_id(self.path))
        return None

    def release(self) -> None:
        """Drop the lock, leaving the file empty: an empty lock file is one that no writer left behind."""
        if self.fd is not None:
            _HELD.discard(_file_id(self.path))
            os.ftruncate(self.fd, 0)
            os.close(self.fd)                 # closing the descriptor drops the record lock
            self.fd, self.taken = None, False


_HELD: set[tuple[int, int]] = set()       # (device, inode) of the lock files this process holds


def _file_id(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except FileNotFoundError:
        return -1, -1


# struct flock on Linux (x86-64, aarch64): l_type, l_whence, l_start, l_len, l_pid, with padding.
_FLOCK = struct.Struct("hh4xqqi4x")


def _holder(fd: int) -> Holder:
    """Who holds a write lock on `fd`'s file: the pid the kernel names (F_GETLK) on this machine, else
    the pid and host the holder wrote into the file."""
    got = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    kind, _, _, _, pid = _FLOCK.unpack(got)
    recorded = os.pread(fd, 256, 0).decode(errors="replace").split()
    host = recorded[1] if len(recorded) > 1 and recorded[1] != socket.gethostname() else ""
    if host or not pid:              # another machine's (its kernel's pid means nothing here)
        pid = int(recorded[0]) if recorded and recorded[0].isdigit() else pid
    return Holder(pid, host, "a process of another machine" if host else _command_of(pid))


def _command_of(pid: int) -> str:
    """A process's command line, for a message."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
        line = " ".join(words)
        return (line[:157] + "...") if len(line) > 160 else line or "a process without a command line"
    except OSError:
        return "a process of another user"


# ------------------------------------------------------------------------------------------------
# Limits: open files and shared memory
# ------------------------------------------------------------------------------------------------


class LimitError(OSError):
    """A limit of this machine or shell that a command cannot run under; the message is one line naming
    what to set."""


# What one viewmill process holds open beside its shard readers (`shards.MAX_OPEN_SHARDS` each), from
# /proc/<pid>/fd of runs on 1,250 shards (docs/benchmarks.md, "Open files"): a rank's libraries, run
# folder, logs and TensorBoard writer; per worker it starts, the pipes and shared-memory handles it
# keeps; per other rank, a collective's sockets.
BASE_DESCRIPTORS = 128
PER_WORKER_DESCRIPTORS = 12
PER_PEER_DESCRIPTORS = 4
OPEN_FILES_CAP = 1 << 20        # the soft limit set where the hard limit is unlimited


def descriptors_needed(workers: int = 0, readers: int = 1, peers: int = 0) -> int:
    """Open files one process needs at most: `BASE_DESCRIPTORS`, `readers` shard readers, `workers`
    worker processes it starts, `peers` other ranks of its collectives."""
    from pipelines.shards import MAX_OPEN_SHARDS

    return (BASE_DESCRIPTORS + readers * MAX_OPEN_SHARDS + workers * PER_WORKER_DESCRIPTORS
            + peers * PER_PEER_DESCRIPTORS)


def ensure_open_files(need: int, what: str) -> int:
    """Make sure this process (and every process it starts after this) may open `need` files: a soft
    limit below `need` is raised to the hard limit.

    Args:
        need: descriptors the command needs per process (`descriptors_needed`).
        what: the command, for the message ("this run", "preprocessing").

    Returns:
        The soft limit now in force.

    Raises:
        LimitError: the hard limit is below `need`; one line naming `ulimit -n`.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise LimitError(f"{what} needs {need} open files per process, but this shell allows {soft} and at most "
                         f"{hard} (ulimit -n, ulimit -Hn); run `ulimit -n {need}` as root or ask for a hard limit of "
                         f"{need} or more (limits.conf, the container's --ulimit nofile=, the job's settings)")
    new = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new


SHM = "/dev/shm"


def check_shared_memory(need_bytes: int, what: str, fix: str, path: str = SHM) -> None:
    """Stop in one line when `path` (the shared memory worker processes hand batches through) has
    less than `need_bytes` free.

    Args:
        need_bytes: what every process of this command on this machine puts there at most.
        what: who needs it, for the message. fix: the settings that lower the need.

    Raises:
        LimitError: too little free; naming the size to give the container (`--shm-size`) and `fix`.
    """
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return                           # no such file system here: the libraries fall back on their own
    if free >= need_bytes:
        return
    gib = 2 ** 30
    raise LimitError(f"{what} need about {_size(need_bytes)} of shared memory in {path}, which has {_size(free)} "
                     f"free; give the container more (docker run --shm-size={-(-need_bytes // gib) + 1}g, or a larger "
                     f"/dev/shm mount) or {fix}")


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"
