"""Launching a run: where its processes start and a rank's whole life, for `python -m train` and for the
tasks of a SLURM job (`train/slurm.py`) alike.

A command's way: `take_processes` and `take_cluster` take the launcher words (`gpus=`, `nodes=`,
`rdzv=`, the SLURM options); `start` resolves the config for the run's processes. The process that
launches them (not yet a rank) checks what can be checked before a process is launched or a file is
written (`preflight`) and starts them (`elastic`: torch's elastic launcher, the launcher behind
torchrun; on several nodes it also ends its ranks when another node's failure closed the rendezvous,
`ClosedRendezvous`), unless an earlier start finished the run. A rank (one of those, one of torchrun's, a SLURM
task, or the one process of a one-process run) runs `train`: the device and process group, the run
(`train.run.Run`), the parts, the loop (`train.loop.train`) and the export. `exit_status` turns the
errors of any of it into the command's exit status and one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import resource
import signal
import sys
import threading
import typing
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch

from pipelines.errors import EXIT_BAD_INPUT, bad_input
from pipelines.processes import (LimitError, descendants, end_with_parent, ensure_open_files, proc_stat,
                                 worker_death)
from pipelines.schema import DatasetError
from pipelines.spec import LoaderError
from train import checkpoint, dist, loop
from train.config import Config, ConfigError, parse_value, per_process_batch
from train.evaluate import eval_kinds
from train.log import Log, check_wandb
from train.resolve import load_config
from train.run import RUN_FIXES, Interrupted, Run, check_free, hold, lock_of
from train.setup import (build_parts, check_dataset, check_processes, init_backbone,
                         open_files_needed, resolve_backend, select_device)

LAUNCHER_PID = "VIEWMILL_LAUNCHER_PID"   # set by `elastic` for the processes it starts
# How long torch's launcher, once stopped by a signal that it passes on to its ranks, waits for them before
# it kills them: torch's 30 s, or, for ranks that hold SIGTERM (`run.checkpoint_on_signal=TERM`, `USR2+TERM`), time to
# reach the next log step and save its checkpoint (a scheduler's grace period is what bounds it then).
STOP_S, HELD_STOP_S = 30, 300
WATCH_S = 1.0          # how often a node's launcher looks whether another node closed the rendezvous
# How long a node's launcher waits at the rendezvous for the other nodes, and for an answer of its store
# (torch's defaults, said here so that the one-line errors can name them).
JOIN_S, READ_S = 600, 60

LauncherName = Literal["local", "slurm"]     # local: this machine's processes (or torchrun's); slurm: a submitit job


@dataclass(frozen=True)
class ClusterConfig:
    """Where the processes of a run start: the launcher words of `python -m train` (not stored in the run's
    config: a requeued SLURM job or another node runs the same training config)."""

    nodes: int = 1                  # machines, each running `gpus=` processes (one per GPU)
    rdzv: str = ""                  # nodes > 1 under torchrun's rendezvous: HOST:PORT of a node every node reaches
    launcher: LauncherName = "local"  # "slurm": submit a job that starts nodes x gpus processes (submitit)
    partition: str = ""             # SLURM partition; "": the cluster's default
    time_min: int = 4320            # SLURM time limit of one job, minutes; a requeued job gets it again
    cpus_per_task: int = 10         # SLURM CPU cores per process (loader workers and the training thread)
    mem_gb: int = 0                 # SLURM memory per node, GB; 0: the partition's default
    account: str = ""               # SLURM account to charge; "": the user's default
    qos: str = ""                   # SLURM quality of service; "": the default
    constraint: str = ""            # SLURM node features, e.g. "a100|h100"; "": any node of the partition


def take_cluster(args: Sequence[str]) -> tuple[ClusterConfig, list[str]]:
    """The `ClusterConfig` of the launcher words among `args` (`nodes=2 rdzv=host:29500`,
    `launcher=slurm partition=gpu ...`) and the other words, in order.

    Raises:
        ConfigError: a value of the wrong type, an unknown launcher, `nodes=` below 1, nodes > 1 under the
            local launcher without a rendezvous address (`rdzv=`, else `$MASTER_ADDR[:$MASTER_PORT]`), or a
            word the launcher does not use (a SLURM option without `launcher=slurm`, `rdzv=` on one node or
            under SLURM): never silently ignored.
    """
    hints, values, rest = typing.get_type_hints(ClusterConfig), {}, []
    for word in args:
        key, _, value = word.partition("=")
        if key in hints and "=" in word:
            values[key] = parse_value(key, value, hints[key])
        else:
            rest.append(word)
    cluster = ClusterConfig(**values)
    slurm_only = sorted(set(values) - {"nodes", "rdzv", "launcher"})
    if slurm_only and cluster.launcher != "slurm":
        raise ConfigError(f"{slurm_only[0]}= is an option of the SLURM launcher; add LAUNCHER=slurm (launcher=slurm) "
                          "or drop it")
    if cluster.rdzv and (cluster.nodes == 1 or cluster.launcher == "slurm"):
        raise ConfigError(f"rdzv={cluster.rdzv} joins the nodes of a torchrun run; give NODES=<n> > 1, or drop it "
                          "(one node, or SLURM, which names the nodes itself)")
    if cluster.nodes < 1:
        raise ConfigError(f"nodes={cluster.nodes}: a run needs 1 node or more; use NODES=1 on one machine")
    if cluster.nodes > 1 and cluster.launcher == "local" and not cluster.rdzv:
        if not os.environ.get("MASTER_ADDR"):
            raise ConfigError(f"NODES={cluster.nodes} needs the rendezvous address every node reaches: add "
                              "RDZV=<first node's host>:29500 (rdzv=<host>:<port>), the same on every node")
        address = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', 29500)}"
        cluster = dataclasses.replace(cluster, rdzv=address)
    return cluster, rest


def take_processes(argv: list[str]) -> tuple[int, list[str]]:
    """(N of a `gpus=N` word, default 1; the other words).

    Raises:
        ConfigError: N is not a whole number.
    """
    words = [a for a in argv if a.startswith(("gpus=", "gpus_per_node="))]      # per node
    rest = [a for a in argv if not a.startswith(("gpus=", "gpus_per_node="))]
    if not words:
        return 1, rest
    try:
        return int(words[-1].split("=", 1)[1]), rest
    except ValueError:
        raise ConfigError(f"{words[-1]!r}: GPUS must be a whole number of processes, e.g. GPUS=2") from None


def preflight(cfg: Config, processes: int, nodes: int = 1, here: bool = True) -> Run:
    """Everything that can be checked in the process that launches a run, before a process is launched or a
    file written (`here`: the processes start on this machine, so its devices are counted): W&B, the
    processes, the batch split, the evaluations asked for, the dataset, the run folder's resume state and,
    with more than one process, `model.init` (a single process checks it itself, before any write).

    Returns:
        The run, opened in this process (not a rank: no collective).

    Raises:
        ConfigError, DatasetError, CheckpointError: one line each (`train.__main__`'s docstring lists them).
    """
    from models.backbone import build_backbone

    check_wandb(cfg)
    if here:
        check_processes(processes, cfg.run.device)
    per_process_batch(cfg.data.batch_size, processes * nodes)      # before any process starts
    eval_kinds(cfg)                                                 # a labelled evaluation of unlabelled data
    check_dataset(cfg)
    run = Run.open(cfg)
    check_free(run.folder, RUN_FIXES)                                 # another run writing its folder
    if processes * nodes > 1 and run.resume.state is None and cfg.model.init:   # timm is imported only then
        init_backbone(cfg, build_backbone(cfg.model.backbone, cfg.views.global_px)[0])
    return run


class ClosedRendezvous:
    """Whether another node closed the rendezvous of a run of several nodes while this node's processes
    still run: a node's torch launcher closes it when one of its processes fails, and tells the other
    nodes nothing else. Their ranks then wait in the next collective: with NCCL until the process group's
    timeout (`run.dist_timeout_min`, 30 minutes of every GPU). A thread looks every `WATCH_S` (one read
    of the rendezvous's state) and, once closed, kills this launcher's processes (each rank's process
    group; they cannot save a checkpoint without their peers), which its torch launcher then reports as
    failed; `seen` says so. A rendezvous that stopped answering is torch's launcher's to tell.

    The thread reads the rendezvous only once this node's processes run (`started`: the rendezvous was
    done), so that a rendezvous that never answers is not asked twice (each try of torch's is a
    warning with its C++ stack), and `started` tells such a rendezvous from one that stopped answering."""

    def __init__(self, rdzv: str, run_id: str, nodes: int) -> None:
        self.seen = self.started = False
        self._done = threading.Event()
        self._params = dict(backend="c10d", endpoint=rdzv, run_id=run_id, min_nodes=nodes, max_nodes=nodes,
                            is_host=False)
        threading.Thread(target=self._watch, name="viewmill-rendezvous-watch", daemon=True).start()

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        while not _children():              # the rendezvous is done once this node's processes run
            if self._done.wait(WATCH_S):
                return
        self.started = True
        handler = None
        while handler is None:              # a client of its store
            try:
                handler = get_rendezvous_handler(RendezvousParameters(**self._params))
            except Exception:
                if self._done.wait(WATCH_S):
                    return
        try:
            while not self._done.wait(WATCH_S):
                if handler.is_closed() and (ranks := _children()):
                    self.seen = True
                    for pid in ranks:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(pid, signal.SIGKILL)
                    return
        except Exception:                   # the store unreachable or gone: nothing more to watch
            return


# A line of torch's C++ log from its c10d store client, and the lines of the exception stack after it.
_STORE_LOG = re.compile(rb"^\[[WEI]\d{4} [\d:.]+ [^\]]*\] \[c10d\] ")
_STORE_STACK = (b"Exception raised from ", b"frame #", b"<omitting python frames>", b"\n")


class QuietRendezvous:
    """While a node's launcher waits for its rendezvous, torch's c10d store client logs every failed try to
    reach it on the process's stderr: a C++ warning or error and the stack of its exception, 20 to 40
    lines a try, dozens of tries before the one line `elastic` prints (103 lines in 5 s where another
    program held the port). So the launcher's file descriptor 2 goes through a thread that leaves those
    blocks out until `started()` (this node's ranks run; they inherit the descriptor), and from then on
    passes whatever comes as it comes: what the ranks print, NCCL's warnings included, is theirs. `close`
    restores the descriptor."""

    def __init__(self, started: Callable[[], bool]) -> None:
        self._started = started
        self._stderr = os.dup(2)
        read, write = os.pipe()
        sys.stderr.flush()
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._pass, args=(read,), name="viewmill-quiet-rendezvous",
                                        daemon=True)
        self._thread.start()

    def _pass(self, read: int) -> None:
        dropping = False
        with os.fdopen(read, "rb", buffering=0) as pipe:     # lines while it waits, then whatever comes
            while data := (pipe.read(1 << 16) if (started := self._started()) else pipe.readline()):
                if not started:
                    dropping = bool(_STORE_LOG.match(data)) or dropping and data.startswith(_STORE_STACK)
                    if dropping:
                        continue
                with contextlib.suppress(OSError):           # a closed console: the output is lost, not the run
                    os.write(self._stderr, data)

    def close(self) -> None:
        sys.stderr.flush()
        os.dup2(self._stderr, 2)             # the pipe's last writer here closed: the thread reads to its end
        self._thread.join(timeout=2.0)
        os.close(self._stderr)


def _children() -> list[int]:
    """The running processes this one started (a launcher's: its ranks)."""
    return [pid for pid, _ in descendants(os.getpid()) if proc_stat(pid)[2] == os.getpid()]


def elastic(processes: int, argv: list[str], cluster: ClusterConfig = ClusterConfig(), held: str = "") -> int:
    """Run `python -m train argv` in `processes` local processes (torchrun --standalone), or, with
    `cluster.nodes` > 1, in `processes` processes on each node, joined at `cluster.rdzv` (torchrun
    --nnodes --rdzv-backend=c10d); the exit status is the first failed process's, and each process
    prints its own error line. `held`: the run's `run.checkpoint_on_signal` (holding TERM, a SIGTERM
    passed on to the ranks gets `HELD_STOP_S` to save a checkpoint)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not torch.cuda.is_available():       # torchrun's rule: one thread per process unless told
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)   # no launcher tracebacks
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the processes' parent, whose death ends them
    many = cluster.nodes > 1                # every node's launcher must name the same rendezvous
    config = LaunchConfig(min_nodes=cluster.nodes, max_nodes=cluster.nodes, nproc_per_node=processes,
                          run_id=f"viewmill-{cluster.rdzv}" if many else uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint=cluster.rdzv if many else "localhost:0", max_restarts=0,
                          rdzv_configs={"join_timeout": JOIN_S, "read_timeout": READ_S},
                          shutdown_timeout=HELD_STOP_S if "TERM" in held.split("+") else STOP_S)
    # a protocol (linear, finetune) continues from its folder's checkpoint by itself; a run needs the word
    from train.protocol import is_protocol

    again = "the same command" + ("" if is_protocol(argv) else " with run.resume=auto")
    watch = ClosedRendezvous(cluster.rdzv, config.run_id, cluster.nodes) if many else None
    quiet = QuietRendezvous(lambda: watch.started) if many else None
    try:
        elastic_launch(config, sys.executable)("-m", "train", *argv)
    except ChildFailedError as e:
        first = min(e.failures.values(), key=lambda f: f.timestamp)
        if watch is not None and watch.seen:
            print(f"error: another node closed the rendezvous at {cluster.rdzv} (one of its processes failed, and "
                  f"its output says why), so this node's processes were stopped; {again} on every node continues "
                  "from the last checkpoint", file=sys.stderr)
            return 1
        if first.exitcode < 0:              # a signal: the OOM killer, kill -9, a node's shutdown
            print(f"error: process {first.local_rank} was killed by signal {-first.exitcode} "
                  f"({signal.strsignal(-first.exitcode)}) and the others stopped; {again} continues from the "
                  "last checkpoint", file=sys.stderr)
        elif first.exitcode != EXIT_BAD_INPUT:
            print(f"error: process {first.local_rank} failed with exit status {first.exitcode}; "
                  "its output is above", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    except RendezvousConnectionError:
        if watch is not None and not watch.started:     # a wrong address, a closed port, a port of another program
            host, port = cluster.rdzv.rsplit(":", 1)
            print(f"error: no rendezvous answered at {cluster.rdzv} (torch's launcher tried for {READ_S} s at a time), "
                  "so no process started here: the first node's launcher, the same command started on the node named "
                  f"there, holds it; check that {host} names that node from here and that port {port} is open to this "
                  "node and used by nothing else, then run the same command on every node", file=sys.stderr)
            return 1
        # the node holding the rendezvous's store ended: torch's launcher then stops this node's processes (a
        # node whose process failed tells the others no more than that)
        print(f"error: the rendezvous at {cluster.rdzv} stopped answering, so this node's processes were stopped: "
              f"the node that holds it ended, and its output says why; {again} on every node continues from the "
              "last checkpoint", file=sys.stderr)
        return 1
    except RendezvousTimeoutError:         # a node not started, or started with other launcher words
        print(f"error: the rendezvous at {cluster.rdzv} did not gather {cluster.nodes} nodes in {JOIN_S} s, so no "
              f"process started here: start the same command (the same nodes={cluster.nodes} and "
              f"rdzv={cluster.rdzv}) on every node, each within {JOIN_S} s of the first", file=sys.stderr)
        return 1
    except SignalException as e:            # this launcher stopped (kill, a scheduler): its ranks with it
        print(f"error: stopped by signal {int(e.sigval)} ({signal.strsignal(e.sigval)}) and so were the processes; "
              f"{again} continues from the last checkpoint", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        if watch is not None:
            watch.close()
        if quiet is not None:
            quiet.close()
    return 0


def train(cfg: Config, run: Run | None = None) -> Path:
    """Train `cfg` in this process: one rank of a run of several (`gpus=N`, torchrun, a SLURM task) or the
    whole run (then `run` may be the one `preflight` opened); returns the run folder.

    Every rank takes the same way, and makes the same collectives: it joins the process group and opens the
    run (checked before any write); a run finished by an earlier start ends here with one line. Otherwise
    it pretrains (`pretrain`; not a run an earlier start trained) and, with `run.eval=linear`, runs the
    linear protocol on the last checkpoint (continuing where an earlier start left it). Both hold
    `run.checkpoint_on_signal` while they train.

    Raises:
        ConfigError, DatasetError, LoaderError, CheckpointError: bad input, before any write.
        NonFiniteLossError: the loss became NaN or infinite.
    """
    check_wandb(cfg)
    eval_kinds(cfg)                         # a labelled evaluation of unlabelled data: before any write
    device = select_device(cfg.run.device, cfg.run.dist_timeout_min)
    run = run or Run.open(cfg)
    if run.finished:                        # a requeued job, the same command twice: its results stand
        if dist.is_main():
            print(run.finished_line(), flush=True)
        return run.folder
    backend = resolve_backend(cfg, device)
    held = dist.HeldSignal(cfg.run.checkpoint_on_signal)     # the loops hold it back until a checkpoint
    try:
        if (run.trained or pretrain(run, device, backend, held)) and cfg.run.eval == "linear":
            from train import protocol      # the papers' figure: the linear protocol on the last checkpoint

            dist.barrier()
            protocol.main("linear", [f"ckpt={run.folder / checkpoint.LATEST}"], held)
        dist.barrier()
    finally:
        held.release()                      # a signal the loops held takes its action now (SLURM: requeue)
    return run.folder


def pretrain(run: Run, device: torch.device, backend: str, held: dist.HeldSignal) -> bool:
    """Build the parts (the views and `model.init` checked before any write), take the run folder's lock
    (`train.run.hold`: another run writing it is refused), write the run's start files, train (`loop.train`) and
    export the backbone of a run that reached `optim.steps`; returns whether it did."""
    cfg = run.cfg
    parts = build_parts(cfg, device, backend, init=run.resume.state is None)
    lock = lock_of(run.folder)
    try:
        hold(lock, run.folder, RUN_FIXES)     # one run writes the folder at a time: before its first write
        log = Log(run.folder, enabled=dist.is_main(), cfg=cfg)
        run.begin(log)
        with training_stream(device, cfg.run.train_stream):
            trained = loop.train(run, parts, log, backend, held)
        if trained:
            run.export(dist.unwrap(parts.online).backbone, log)
    except KeyboardInterrupt:           # Ctrl-C: every checkpoint written is whole; say which to go on from
        raise Interrupted(run.interrupted_line()) from None
    finally:
        lock.release()
        parts.loader.close()            # its workers end now, also when an exception (a requeue) passes
    return trained


@contextlib.contextmanager
def training_stream(device: torch.device, priority: str):
    """Within, this thread's CUDA work on `device` goes to a stream of the highest priority
    (`run.train_stream=high`), or stays on the current one ("default", and on a CPU). DALI 2.4's pipelines
    make their own streams at the default priority (`default_cuda_stream_priority` has no effect there),
    so training above them is how the graph's kernels come to fill the gaps that training leaves rather
    than delay it (the GPU check's training section compares the two: `--train-stream both`). The
    stream starts after the work queued on the current one and the current one waits for it at the end;
    the loaders copy each batch on the stream current when they hand it out."""
    if device.type != "cuda" or priority == "default":
        yield None
        return
    before = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])   # (lowest, highest)
    stream.wait_stream(before)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        before.wait_stream(stream)


def start(argv: list[str], processes: int = 1, cluster: ClusterConfig = ClusterConfig()) -> int:
    """`python -m train` on this machine after the launcher words: in a rank, `train`; in the process that
    launches the run's processes (or is the run's one process), `preflight`, then `elastic` for more than
    one process (none for a run an earlier start finished: the line that says so), else `train`.

    Args:
        argv: the config words (`method=`, `data=`, `key=value`, ...).
        processes: processes on this machine (`gpus=`).
        cluster: the nodes and their rendezvous.

    Returns:
        The exit status (0; or the first failed process's, from `elastic`).
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:     # a rank of the elastic launcher (ours, torchrun): it and
        # its loader workers end when the launcher dies, even one that dies while this process starts
        end_with_parent(int(os.environ.pop(LAUNCHER_PID, os.getppid())))
    world = int(os.environ.get("WORLD_SIZE", processes * cluster.nodes))
    cfg = load_config(argv, world_size=world)
    # raised here, before any process is started: the ranks and their workers inherit the limit
    ensure_open_files(open_files_needed(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", processes)), world), "this run")
    if "LOCAL_RANK" in os.environ:          # a rank: of `elastic`, of torchrun, a SLURM task
        train(cfg)
        return 0
    run = preflight(cfg, processes, cluster.nodes)      # once, by the launching process (of each node)
    if processes == 1 and cluster.nodes == 1:
        train(cfg, run)
    elif run.finished:
        print(run.finished_line(), flush=True)
    else:
        return elastic(processes, argv, cluster, cfg.run.checkpoint_on_signal)
    return 0


def exit_status(body: Callable[[], int]) -> int:
    """Run `body` (a command) and return its exit status: bad input is one line `error: ...` on stderr
    (from rank 0 alone) and status 2, a non-finite loss, a loader worker's death or another rank's
    (`dist.peer_lost`) one line and status 1; the process group is left in every case."""
    try:
        return body()
    except (ConfigError, DatasetError, LoaderError, LimitError, FileNotFoundError) as e:
        return bad_input(e) if os.environ.get("RANK", "0") == "0" else EXIT_BAD_INPUT
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):     # a checkpoint, the metrics or the events written
            where = f" in {e.filename}" if e.filename else " in the run folder"
            print(f"error: {e.strerror}{where}: what was written before is whole (a checkpoint is written whole or "
                  "not at all); free space there, or give run.out_dir on another disk, and the same command with "
                  "run.resume=auto continues from the last checkpoint", file=sys.stderr)
            return 1
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        if os.environ.get("RANK", "0") != "0":      # a limit met after all (another library's descriptors)
            return EXIT_BAD_INPUT
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return bad_input(f"too many open files ({e.strerror}; this process may open {soft}); raise the limit "
                         f"(ulimit -n {4 * soft}) and run the same command again (run.resume=auto continues a run)")
    except loop.NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C reaches every process of the foreground group
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {str(e) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 128 + signal.SIGINT
    except RuntimeError as e:
        # A loader's WorkerDiedError, or torch's own error for a dead DataLoader worker (its SIGCHLD
        # handler, where one is set, raises it in whatever runs then); or another rank's end.
        if (died := worker_death(e)) is not None:
            print(f"error: {died}", file=sys.stderr)
        elif (lost := dist.peer_lost(e)) is not None:
            print(f"error: {lost}; the same command (on every node) with run.resume=auto continues from the last "
                  "checkpoint", file=sys.stderr)
        else:
            raise
        return 1
    finally:
        dist.cleanup()
