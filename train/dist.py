"""Process-group helpers: one code path for a single process and torchrun DDP.

Every function falls back to single-process behaviour when torch.distributed is not initialised,
so objectives and the loop run unchanged in tests on one CPU process.
"""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def local_world_size() -> int:
    """The processes of this run on this machine (torchrun's and SLURM's `LOCAL_WORLD_SIZE`; 1 alone)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def init_from_env(use_cuda: bool | None = None, timeout_min: float = 30.0) -> torch.device:
    """Join the process group that torchrun describes in the environment, if any.

    The GPU is set before the group is made and named to it (`device_id`), so that NCCL binds its
    communicator to this rank's GPU at once instead of guessing one at the first collective; the
    timeout is explicit: the longest any collective waits for the other ranks before the run stops.

    Args:
        use_cuda: train on the GPU; None: when CUDA is present.
        timeout_min: the process group's timeout, minutes.

    Returns:
        The device this process trains on: `cuda:<LOCAL_RANK>` with NCCL when `use_cuda`, else CPU
        with gloo.
    """
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not is_distributed():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(minutes=timeout_min),
                                device_id=device if use_cuda else None)
    return device


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()


def gather(x: Tensor) -> Tensor:
    """Concatenate `x` from all ranks along dim 0, in rank order, keeping the autograd graph.

    The backward pass sums, over ranks, the gradients that reach each rank's slice (a reduce-scatter:
    torch's functional `all_gather_single_autograd`, which replaced torch.distributed.nn's all_gather),
    so a loss averaged per rank and then averaged by DDP gets the gradient of the loss over the global
    batch.

    Args:
        x: (B, ...) tensor, the same shape on every rank.

    Returns:
        (world_size * B, ...) tensor; `x` itself in a single process.
    """
    if not is_distributed():
        return x
    import torch.distributed._functional_collectives as fc

    if not hasattr(fc, "all_gather_single_autograd"):            # torch < 2.14: the one that is not deprecated
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(x), dim=0)                    # (M, ...) with M = world * B
    return fc.wait_tensor(fc.all_gather_single_autograd(x.contiguous(), 0, dist.group.WORLD))  # (M, ...)


@torch.no_grad()
def gather_nograd(x: Tensor) -> Tensor:
    """`gather` for tensors that need no gradient (targets, labels, indices)."""
    if not is_distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)                            # (M, ...)


@torch.no_grad()
def gather_rows(x: Tensor) -> Tensor:
    """Concatenate `x` from all ranks along dim 0, in rank order, when ranks hold different numbers of
    rows (the shards of an evaluation split); `x` itself in a single process.

    Args:
        x: (N_rank, ...) tensor on this rank's device (NCCL: a GPU), the same trailing shape and
            dtype on every rank.

    Returns:
        (sum of N_rank, ...) on every rank.
    """
    if not is_distributed():
        return x
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.empty_like(n) for _ in range(world_size())]
    dist.all_gather(sizes, n)
    most = int(max(int(s) for s in sizes))
    padded = torch.zeros((most, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    return torch.cat([p[:int(k)] for p, k in zip(parts, sizes)], dim=0)          # (M, ...)


@torch.no_grad()
def all_reduce_sum(xs: list[Tensor]) -> list[Tensor]:
    """The sums over all ranks of each tensor of `xs` (on this rank's device; NCCL: a GPU); the tensors
    themselves in a single process. One collective per tensor."""
    if not is_distributed():
        return xs
    out = [x.clone() for x in xs]
    for x in out:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return out


def broadcast_object(obj):
    """`obj` of rank 0 on every rank (e.g. a run folder name); `obj` itself in a single process."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def gather_objects(obj) -> list:
    """`obj` of every rank in rank order (picklable objects, e.g. loader positions); `[obj]` alone."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(device: torch.device, *flags: bool) -> tuple[bool, ...]:
    """Each of `flags` or'ed over every rank: one all-reduce, which every rank calls at the same point
    (a host sync); the flags themselves without a process group."""
    if not is_distributed():
        return tuple(bool(f) for f in flags)
    t = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())         # sync: the flags of every rank


# What gloo's collectives and the process group's store raise when a process of another rank has ended
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_lost(e: BaseException) -> str | None:
    """One line for `e` when it is what a collective (gloo) or the process group's store raises because a
    process of another rank ended (on another node: its own output says why), else None. NCCL's
    collectives wait for `run.dist_timeout_min` instead."""
    if not isinstance(e, RuntimeError):
        return None
    why = next((m for m in PEER_LOST if m in str(e)), None)
    if why is None and isinstance(e, dist.DistNetworkError):
        why = "its connection was lost"
    if why is None:
        return None
    return (f"rank {rank()} lost another process of the run ({why}): it ended, on this node or another, and its "
            "own output says why")


class HeldSignal:
    """Signals held back while the loop trains, so that the run stops at a checkpoint of the step it
    reached (`run.checkpoint_on_signal`): SLURM's warning before preemption or the time limit (USR2),
    the SIGTERM of its preemption (both: "USR2+TERM", what `train.slurm` sets), or the TERM a scheduler
    or a launcher sends a run some seconds before it kills it (the loader workers leave it to their
    rank: `pipelines.processes`, rule 4).

    Every rank installs it (`HeldSignal("")`: nothing is installed and no rank ever stops). Inside
    `holding()` a signal is only noted; at each log step the loop or's `caught` over the ranks
    (`any_rank`, the collective it makes there anyway) and tells `agree` the result, and when any rank
    caught one every rank saves the checkpoint of that step and leaves the loop; `release()`, after the
    ranks' last barrier, gives each signal some rank caught the action it had before, in the order
    named: submitit's handlers (USR2: rank 0 requeues the job and exits; TERM: ignored) or the default
    (the process ends by the signal). Outside `holding()` (the evaluations, the export) a signal acts at
    once, as it would without this.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._signums = [getattr(signal, f"SIG{n}") for n in name.split("+")] if name else []
        self.caught = [False] * len(self._signums)  # each signal: caught while held, by this rank or another
        self._held = False
        self._previous = {signum: signal.signal(signum, self._catch) for signum in self._signums}

    def what(self) -> str:
        """The signals caught, for the line that says so: "SIGUSR2", "SIGUSR2 and SIGTERM"."""
        return " and ".join(signal.Signals(s).name for s, c in zip(self._signums, self.caught) if c)

    def _catch(self, signum: int, frame) -> None:
        if self._held:
            self.caught[self._signums.index(signum)] = True
        else:
            self._act(signum, frame)

    def _act(self, signum: int, frame) -> None:
        previous = self._previous[signum]
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def holding(self, held: bool = True):
        """Hold the signals (or, `held=False`, let them act at once: an evaluation inside the loop) within."""
        before, self._held = self._held, held
        try:
            yield self
        finally:
            self._held = before

    def agree(self, caught: Sequence[bool]) -> bool:
        """Take `caught` or'ed over every rank (`any_rank`) and return whether any signal was: every rank
        then acts for the same signals at `release`. A signal caught after `caught` was read counts at
        the next log step (or'ed here, not replaced)."""
        self.caught = [mine or some for mine, some in zip(self.caught, caught)]
        return any(caught)

    def release(self) -> None:
        """Put the former handlers back and, for each signal caught, take its action now."""
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        for signum, caught in zip(self._signums, self.caught):
            if caught:
                self._act(signum, None)
