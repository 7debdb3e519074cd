"""Processes started by a test, followed to the last one, two ways: every process a run starts carries the
run's marker in its environment (children inherit it, whatever starts them: a fork, an exec, Ray's
raylet, torch's elastic launcher in a new session), and the run's process tree is noted just before it
is killed (the environment /proc shows can be overwritten by a process title, as Ray's are). "No process
of that run is left" is a scan of /proc for both, not a walk of a tree whose branches re-parent to
init as they are orphaned."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipelines.processes import descendants, proc_stat, running

ROOT = Path(__file__).resolve().parent.parent
MARK = "VIEWMILL_TEST_RUN"


def free_port(low: int = 1024, high: int = 65536) -> int:
    """A TCP port on 127.0.0.1 that is free now, in [low, high)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if low <= port < high:
            return port


@contextlib.contextmanager
def none_left_on_failure(mark: str):
    """A failing block leaves none of the processes of `mark` behind (a rank stopped or waiting in a
    collective would outlive the test): they are killed before the failure goes on."""
    try:
        yield
    except BaseException:
        for pid in live(mark):
            os.kill(pid, signal.SIGKILL)
        raise


def start(args: list[str], mark: str | None = None, **env: str) -> subprocess.Popen:
    """`python args...` from this checkout, as the leader of a new process group (and session), with
    `MARK=mark` in its environment (a new mark by default; read it back from `popen.mark`)."""
    mark = mark or uuid.uuid4().hex
    popen = subprocess.Popen([sys.executable, *args], cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", MARK: mark, **env})
    popen.mark = mark
    return popen


def tree(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of `root` and its running descendants."""
    return descendants(root) | ({(root, proc_stat(root)[1])} if running(root) else set())


def live(mark: str, noted: set[tuple[int, str]] = frozenset()) -> list[int]:
    """Pids of the processes that carry `mark`, or are in `noted` (the same start time), and are not
    zombies (a dead child waiting to be reaped runs nothing; in a container, init may take its time
    to reap the orphans it inherits)."""
    needle = f"{MARK}={mark}".encode()
    pids = [pid for pid, since in noted if running(pid, since)]
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if running(int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(set(pids))


def left_after(mark: str, seconds: float, noted: set[tuple[int, str]] = frozenset()) -> list[str]:
    """The command lines of the processes of `mark` (or `noted`) still alive `seconds` from now (or as
    soon as none is)."""
    deadline = time.monotonic() + seconds
    while (pids := live(mark, noted)) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            continue
    return out


def wait_for(condition, timeout_s: float, what: str, popen: subprocess.Popen | None = None) -> None:
    """Poll `condition()` every 20 ms until it holds; fail naming `what` after `timeout_s`, or at once
    with its output when `popen` ends first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if popen is not None and popen.poll() is not None:
            raise AssertionError(f"the run ended (status {popen.returncode}) before {what}:\n{popen.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s} s")
        time.sleep(0.02)


def kill_and_reap(popen: subprocess.Popen, group: bool = False) -> set[tuple[int, str]]:
    """SIGKILL the run's main process (the OOM killer, `kill -9 PID`), or its whole process group (a
    scheduler's job kill), and reap the main process; returns its process tree just before the kill
    (`tree`), for `left_after`."""
    noted = tree(popen.pid)
    if group:
        os.killpg(popen.pid, signal.SIGKILL)
    else:
        popen.kill()
    popen.wait(timeout=30)
    popen.stdout.close()
    popen.stderr.close()
    return noted


def imported(queue, names: list[str]) -> None:
    """A worker's target: put on `queue` which of the modules `names` its process has imported (this
    module imports none of the heavy ones)."""
    queue.put([n for n in names if n in sys.modules])


def environ(pid: int) -> dict[str, str]:
    """The environment a process started with."""
    return dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)


# A process that holds a folder's lock as a writer does (`pipelines.processes.FolderLock`), until it is killed.
_LOCK_HOLDER = ("import sys, time; from pipelines.processes import FolderLock; FolderLock(sys.argv[1]).acquire(); "
                "print('held', flush=True); time.sleep(300)")


def holding(lock_path: Path) -> subprocess.Popen:
    """A process (`start`ed) that holds the `FolderLock` on `lock_path` once this returns."""
    holder = start(["-c", _LOCK_HOLDER, str(lock_path)])
    assert holder.stdout.readline().strip() == "held"
    return holder


def pids_under(root: int) -> set[int]:
    """The pids of `root`'s running descendants now: `workers_of`'s `before`."""
    return {pid for pid, _ in descendants(root)}


def workers_of(root: int, before: set[int] = frozenset()) -> list[int]:
    """The pids of `root`'s running descendants not in `before` that are loader workers: not
    multiprocessing's resource tracker, nor a fork server (the child of `root` that serves the forks;
    its workers share its command line)."""
    def helper(pid: int) -> bool:
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return True                                  # gone meanwhile
        return b"resource_tracker" in line or b"forkserver import main" in line and proc_stat(pid)[2] == root

    return sorted(pid for pid, _ in descendants(root) if pid not in before and not helper(pid))
