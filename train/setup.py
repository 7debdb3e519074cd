"""Start-up, written once for the loop, `python -m train eval` and `python -m bench.train`: the device,
the loader backend, and the parts a training step touches (objective, loader, online and target
networks, optimiser, gradient scaler), built in the same order everywhere so that one seed gives the
same networks.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from models.backbone import init_weights
from models.ema import make_target
from models.multicrop import build_model
from pipelines.loader import auto_backend, build_loader, cores_per_process, default_workers, shared_memory_bytes
from pipelines.processes import check_shared_memory, descriptors_needed
from pipelines.schema import read_manifest
from pipelines.spec import DecoderHints, Loader, LoaderSpec
from pipelines.views import Recipe, load_recipe
from train import dist
from train.config import Config, ConfigError, per_process_batch
from train.objectives import OBJECTIVES
from train.objectives.base import Objective, check_needs
from train.optim import build_optimizer


def select_device(name: str, timeout_min: float = 30.0) -> torch.device:
    """The device of `run.device` ("auto", "cpu" or "cuda"), after joining the torchrun group (if any,
    with `timeout_min`: `run.dist_timeout_min`). On a GPU, cuDNN picks the fastest convolution
    algorithms for the run's fixed shapes (`cudnn.benchmark`).

    "auto" is `cuda:<LOCAL_RANK>` when CUDA is present, else the CPU; "cuda" is `cuda:<LOCAL_RANK>`.

    Raises:
        ConfigError: "cuda" on a machine where torch sees no CUDA device.
    """
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device=cuda but torch sees no CUDA device; use run.device=auto or run.device=cpu")
    device = dist.init_from_env(use_cuda=None if name == "auto" else name == "cuda", timeout_min=timeout_min)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    return device


def resolve_backend(cfg: Config, device: torch.device) -> str:
    """`data.backend` with "auto" resolved by `pipelines.loader.auto_backend`: the DALI graphs on a GPU,
    the fastest backend the dataset has files for on a CPU (ffcv, else the torch reference)."""
    if cfg.data.backend != "auto":
        return cfg.data.backend
    return auto_backend(device.type, cfg.data.root, cfg.data.name)


def init_backbone(cfg: Config, backbone: nn.Module) -> None:
    """Load `model.init`'s weights into `backbone` (built from `cfg`), in place; nothing when it is "".

    Raises:
        ConfigError: a missing or unreadable file, or weights of another network (`init_weights`).
    """
    if not cfg.model.init:
        return
    try:
        weights = init_weights(cfg.model.init, backbone, cfg.model.backbone, cfg.views.global_px)
    except ValueError as e:
        raise ConfigError(f"model.init: {e}") from None
    backbone.load_state_dict(weights)


def check_dataset(cfg: Config) -> None:
    """The dataset folder has a complete manifest (file sizes checked; the loader verifies the rest).

    Raises:
        DatasetError: a missing, incomplete or damaged dataset, naming `make preprocess`.
    """
    read_manifest(os.path.join(cfg.data.root, cfg.data.name), verify="size")


def check_processes(n: int, device_name: str) -> None:
    """Refuse `gpus=N` beyond this machine: N CUDA devices on a GPU machine, N CPU cores without one
    (a typo, or GPUs expected where there are none). `run.device=cpu` asks for N CPU processes in so many
    words, which may share fewer cores (a rehearsal of an 8-GPU run on a small machine).

    Raises:
        ConfigError: N < 1 or more processes than devices (or cores, unless run.device=cpu).
    """
    cuda = torch.cuda.is_available() and device_name != "cpu"
    have = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    what = "CUDA devices" if cuda else "CPU cores and no CUDA device"
    if n < 1 or (n > have and device_name != "cpu"):
        hint = "" if cuda or n < 1 else f" (or run.device=cpu to run {n} CPU processes on them)"
        raise ConfigError(f"GPUS={n} but this machine has {have} {what}; use GPUS between 1 and {have}{hint}")


def build_train_loader(cfg: Config, recipe: Recipe, backend: str, device: torch.device) -> Loader:
    """This rank's training loader: its share of `data.batch_size`, shuffled, drop-last, with the mixes.

    Raises:
        ConfigError: a global batch that does not split into even per-rank batches.
    """
    world = dist.world_size()
    spec = LoaderSpec(
        root=cfg.data.root, dataset=cfg.data.name, split="train", recipe=recipe,
        batch_size=per_process_batch(cfg.data.batch_size, world), mix=cfg.data.mix, rank=dist.rank(), world_size=world,
        seed=cfg.run.seed, device=str(device), num_workers=loader_workers(cfg, backend, device),
        channels_last=channels_last(cfg, device), decoder=decoder_hints(cfg), gpu_blur=cfg.data.gpu_blur,
        graph_dtype=cfg.data.graph_dtype, gpu_contrast=cfg.data.gpu_contrast, graph_batches=cfg.data.graph_batches,
        gpu_tail=cfg.data.gpu_tail)
    return build_checked_loader(backend, spec, f"data.batch_size={cfg.data.batch_size}", "data.batch_size")


def build_checked_loader(backend: str, spec: LoaderSpec, batch: str, batch_key: str) -> Loader:
    """`build_loader(backend, spec)` for a training loop (pretraining's, a protocol's) once /dev/shm has
    room for what the loaders of every process on this machine put there: each process's training loader
    and, at times, an evaluation loader of the same batch (the same encoded files in DALI's chunks; fewer
    views elsewhere).

    Args:
        batch: the batch setting as the user gave it, for the message (`data.batch_size=256`).
        batch_key: the key that lowers it.

    Raises:
        LimitError: too little free shared memory, naming the size and `batch_key` / `data.num_workers`.
    """
    local = dist.local_world_size()
    check_shared_memory(2 * local * shared_memory_bytes(backend, spec),
                        f"the {backend} loaders of {local} process(es) ({batch}, {spec.num_workers} workers each)",
                        f"lower {batch_key}, data.num_workers or data.graph_batches"
                        if backend == "dali" and spec.graph_batches > 1
                        else f"lower {batch_key} or data.num_workers")
    return build_loader(backend, spec)


def loader_workers(cfg: Config, backend: str, device: torch.device) -> int:
    """`data.num_workers`, with "auto" this process's share of the machine's cores as
    `pipelines.loader.default_workers` rules it (the cores over the run's processes on this machine,
    at most the count measured best for the backend)."""
    if cfg.data.num_workers != "auto":
        return cfg.data.num_workers
    return default_workers(backend, device.type, dist.local_world_size())


def channels_last(cfg: Config, device: torch.device) -> bool:
    """Whether the loader lays its views out channels-last: on a GPU when the network runs so
    (`model.channels_last`; the DALI graph writes that layout). On the CPU the views stay NCHW and
    the network's first convolution takes them as they are."""
    return device.type == "cuda" and cfg.model.channels_last


def decoder_hints(cfg: Config) -> DecoderHints:
    """The GPU JPEG decoder's settings of `cfg.data`."""
    return DecoderHints(hw_load=cfg.data.hw_decoder_load, size_hint_px=cfg.data.decode_size_hint_px)


def build_online(cfg: Config, device: torch.device) -> nn.Module:
    """The online `SSLModel` of `cfg.model` on `device`, randomly initialised; channels-last with
    `model.channels_last` (the default) on a GPU and on the CPU, where oneDNN's convolutions run
    faster so: the demo's step 567 -> 411 ms on 1 core, 306 -> 232 ms on 2 (the same losses)."""
    m = cfg.model
    try:
        online = build_model(m.backbone, cfg.views.global_px, m.proj_hidden, m.proj_out, m.pred_hidden,
                             m.proj_layers, m.bn_per_view, m.proj_last_bn, m.pred_last_bn).to(device)
    except ValueError as e:             # models.backbone: a name timm does not know, a size it cannot take
        raise ConfigError(f"model.backbone={m.backbone}: {e}") from None
    if cfg.model.channels_last:
        online = online.to(memory_format=torch.channels_last)
    return online


def open_files_needed(cfg: Config, local_processes: int, world_size: int) -> int:
    """Open files one process of a run needs at most (`pipelines.processes.descriptors_needed`): the
    training loader and one evaluation loader at a time, each with its workers (`data.num_workers`; with
    "auto" at most the process's share of the cores) and a shard reader, and a collective's sockets to
    every other rank."""
    workers = cfg.data.num_workers if cfg.data.num_workers != "auto" else cores_per_process(local_processes)
    return descriptors_needed(workers=2 * workers, readers=2, peers=world_size - 1)


@dataclass
class Parts:
    """Everything a training step touches, built once by `build_parts`."""

    objective: Objective
    loader: Loader
    online: nn.Module                   # the SSLModel, wrapped in DDP under torchrun
    target: nn.Module | None            # EMA target (None when the objective has none)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device                # the training device
    amp: bool                           # bf16 autocast of the forward pass
    clip: float                         # max global grad norm; 0 disables clipping
    first_non_finite: Tensor            # () int64 on the device: first non-finite step (1-based), -1: none

    def state_dict(self) -> dict:
        """The trained state a checkpoint holds: online (unwrapped), target, objective, optimiser, scaler."""
        return {"online": dist.unwrap(self.online).state_dict(),
                "target": self.target.state_dict() if self.target is not None else {},
                "objective": self.objective.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (a checkpoint's dict may hold more keys)."""
        dist.unwrap(self.online).load_state_dict(state["online"])
        if self.target is not None:
            self.target.load_state_dict(state["target"])
        self.objective.load_state_dict(state["objective"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


def build_parts(cfg: Config, device: torch.device, backend: str, init: bool = True) -> Parts:
    """Objective, loader, networks, optimiser and scaler of `cfg` for this rank.

    The objective comes first: its `ViewNeeds` are checked against the recipe before any other work.
    The networks are built from `run.seed` on every rank, so online and target start identical
    everywhere; with `init`, the online backbone takes `model.init`'s weights before the target is
    copied from it.

    Args:
        init: load `model.init` (a run that resumes from a checkpoint passes False: it holds the weights).

    Raises:
        ConfigError: views or mixes that cannot feed the objective, a batch that does not split, or a
            `model.init` that does not fit the backbone.
    """
    objective = OBJECTIVES[cfg.method](cfg.objective).to(device)
    recipe = load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px)
    check_needs(cfg.method, objective.needs, recipe, cfg.data.mix.kind)
    loader = build_train_loader(cfg, recipe, backend, device)
    torch.manual_seed(cfg.run.seed)
    online = build_online(cfg, device)
    if init:
        init_backbone(cfg, online.backbone)
    if dist.world_size() > 1:
        # SyncBatchNorm needs CUDA; on CPU/gloo each rank normalises with its own batch statistics.
        sync_bn = device.type == "cuda"
        if sync_bn:
            online = nn.SyncBatchNorm.convert_sync_batchnorm(online)
        # Under SyncBatchNorm the running statistics are already the same on every rank: DDP's
        # broadcast of rank 0's buffers before each forward would be a wasted collective (torch 2.14
        # names that switch forward_sync_buffers; on the CPU DDP's default, a broadcast, stays).
        buffers = {}
        if sync_bn:
            new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            buffers = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
        online = DistributedDataParallel(online, device_ids=[device.index] if sync_bn else None, **buffers)
    target = make_target(dist.unwrap(online)) if objective.needs.target else None
    return Parts(
        objective=objective, loader=loader, online=online, target=target,
        optimizer=build_optimizer(cfg, [dist.unwrap(online), objective]),
        scaler=torch.amp.GradScaler(device.type, enabled=False),   # bf16 autocast needs no loss scaling
        device=device, amp=cfg.run.amp and device.type == "cuda", clip=cfg.optim.clip,
        first_non_finite=torch.full((), -1, dtype=torch.long, device=device))
