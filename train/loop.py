"""The training loop (STYLE §3): set up once, then one story per step — schedules, batch, loss,
backward, optimiser, EMA target, objective state, log, evaluate, checkpoint — then export.

One code path for a single CPU process and torchrun DDP (train/dist.py). Host syncs happen only at
log, evaluation and checkpoint steps, each marked `# sync:`.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from models.backbone import export_backbone_state
from models.ema import make_target
from models.multicrop import build_model
from pipelines.loader import LoaderSpec, MixSpec, build_loader
from pipelines.views import load_recipe
from train import checkpoint, dist, schedules
from train.config import Config, ConfigError, check_needs, dump_yaml, to_dict
from train.log import Log, Meter
from train.objectives import OBJECTIVES
from train.optim import apply_lr_wd, build_optimizer, clip_and_step


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


def train(cfg: Config) -> Path:
    """Train `cfg.method` on `cfg.data`; returns the run folder (config.yaml, metrics.jsonl,
    checkpoint.pt, backbone.pt)."""
    device = select_device(cfg.run.device)
    world, rank = dist.world_size(), dist.rank()
    if cfg.data.batch_size % (2 * world):
        raise ValueError(f"data.batch_size={cfg.data.batch_size} must split into even per-rank batches "
                         f"over {world} ranks; use a multiple of {2 * world}")
    batch_per_rank = cfg.data.batch_size // world
    backend = cfg.data.backend if cfg.data.backend != "auto" else ("dali" if device.type == "cuda" else "torch")
    run_dir = Path(cfg.run.resume).parent if cfg.run.resume else Path(cfg.run.out_dir) / dist.broadcast_object(
        cfg.run.name or f"{cfg.method}-{cfg.data.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    log = Log(run_dir, enabled=dist.is_main())
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        log.print(f"config ({run_dir / 'config.yaml'}):\n{dump_yaml(cfg)}")

    # Objective first: its ViewNeeds are checked against the views before any work is done.
    objective = OBJECTIVES[cfg.method](cfg.objective).to(device)
    recipe = load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px)
    check_needs(cfg.method, objective.needs, recipe, cfg.data.mix.kind)
    loader = build_loader(backend, LoaderSpec(
        root=cfg.data.root, dataset=cfg.data.name, split="train", recipe=recipe, batch_size=batch_per_rank,
        mix=MixSpec(kind=cfg.data.mix.kind, alpha=cfg.data.mix.alpha, source=cfg.data.mix.source),
        rank=rank, world_size=world, seed=cfg.run.seed, device=str(device), num_workers=cfg.data.num_workers))

    # Networks: the same seed on every rank, so online and target start identical everywhere.
    torch.manual_seed(cfg.run.seed)
    online: nn.Module = build_model(cfg.model.backbone, cfg.views.global_px, cfg.model.proj_hidden,
                                    cfg.model.proj_out, cfg.model.pred_hidden, cfg.model.proj_layers).to(device)
    if device.type == "cuda" and cfg.model.channels_last:
        online = online.to(memory_format=torch.channels_last)
    if world > 1:
        # SyncBatchNorm needs CUDA; on CPU/gloo each rank normalises with its own batch statistics.
        if device.type == "cuda":
            online = nn.SyncBatchNorm.convert_sync_batchnorm(online)
        online = DistributedDataParallel(online, device_ids=[device.index] if device.type == "cuda" else None)
    target = make_target(unwrap(online)) if objective.needs.target else None
    optimizer = build_optimizer(cfg, [unwrap(online), objective])
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # bf16 autocast needs no loss scaling
    amp = cfg.run.amp and device.type == "cuda"

    start_step, random_init = 0, None
    steps_per_epoch = len(loader)
    if cfg.run.resume:
        state = checkpoint.load(cfg.run.resume)
        unwrap(online).load_state_dict(state["online"])
        if target is not None:
            target.load_state_dict(state["target"])
        objective.load_state_dict(state["objective"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_step, random_init = state["step"], state["random_init"]
        checkpoint.set_rng_state(state["rng"][rank])
    batches = epochs_from(loader, start_step, steps_per_epoch, state["loader"][rank] if cfg.run.resume else None)
    if random_init is None:                  # measured once, before the first step, and kept in checkpoints
        random_init = evaluate_backbone(cfg, unwrap(online).backbone, backend, device)

    def save_checkpoint(step: int) -> None:
        rng, position = dist.gather_objects(checkpoint.rng_state()), dist.gather_objects(loader.state_dict())
        if dist.is_main():
            checkpoint.save(run_dir / "checkpoint.pt", {
                "online": unwrap(online).state_dict(), "target": target.state_dict() if target else {},
                "objective": objective.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "step": step, "loader": position, "rng": rng,
                "config": to_dict(cfg), "random_init": random_init, "git_commit": checkpoint.git_commit()})

    log.print(f"training {cfg.method} on {cfg.data.name} ({backend} backend, {world} rank(s), {device}) "
              f"from step {start_step} to {cfg.optim.steps}, {steps_per_epoch} steps/epoch")
    meter, first_bad = Meter(), torch.full((), -1, dtype=torch.long, device=device)
    stop = cfg.optim.steps if not cfg.run.stop_after_steps else min(cfg.run.stop_after_steps, cfg.optim.steps)
    for step in range(start_step, stop):
        s = schedules.at(cfg.optim, step, steps_per_epoch, cfg.data.batch_size)
        apply_lr_wd(optimizer, s)
        wait_start = time.perf_counter()
        batch = next(batches)
        data_s = time.perf_counter() - wait_start
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = objective(online, target, batch, s)
        # Remember the first non-finite step (1-based, as logged) on the device: no host sync here.
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(out.loss.detach()), step + 1, first_bad)
        scaler.scale(out.loss).backward()
        clip_and_step(optimizer, scaler, cfg.optim.clip)
        optimizer.zero_grad(set_to_none=True)
        if target is not None:
            target.update_from(unwrap(online), momentum=s.ema)
        objective.after_step(out)
        meter.tick(batch_size=batch_per_rank, data_s=data_s)
        done = step + 1
        if done % cfg.run.log_every == 0 or done == stop:
            terms = {"loss": out.loss.detach().float().item()}  # sync: the only host reads of a step
            terms |= {k: v.float().item() for k, v in out.logs.items()}  # sync: log terms
            if first_bad.item() >= 0:  # sync: non-finite check at log steps
                raise NonFiniteLossError(
                    f"non-finite loss at step {first_bad.item()} ({cfg.method}); terms at step {done}: "
                    + ", ".join(f"{k}={v:.4g}" for k, v in terms.items())
                    + "; lower optim.lr, set optim.clip=1.0 or check the data")
            log.step(done, cfg.optim.steps, terms, s.lr, s.ema, meter.read_and_reset())
        k = cfg.run.eval_every_epochs * steps_per_epoch
        if k and done % k == 0 and done < cfg.optim.steps:
            result = evaluate_backbone(cfg, unwrap(online).backbone, backend, device)
            log.eval(done, done / steps_per_epoch, result, random_init)
        if done % cfg.run.ckpt_every == 0 or done == stop:
            save_checkpoint(done)
    if stop < cfg.optim.steps:
        log.print(f"stopped after step {stop}; resume with run.resume={run_dir / 'checkpoint.pt'}")
        return run_dir

    result = evaluate_backbone(cfg, unwrap(online).backbone, backend, device)
    log.eval(cfg.optim.steps, cfg.optim.steps / steps_per_epoch, result, random_init)
    if dist.is_main():
        torch.save(export_backbone_state(unwrap(online).backbone), run_dir / "backbone.pt")
        log.print(f"results in {run_dir}: metrics.jsonl, config.yaml, checkpoint.pt, "
                  f"backbone.pt (timm {cfg.model.backbone}, num_classes=0)")
    dist.barrier()
    return run_dir


def select_device(name: str) -> torch.device:
    """The device of `run.device` ("auto", "cpu" or "cuda"), after joining the torchrun group (if any).

    "auto" is `cuda:<LOCAL_RANK>` when CUDA is present, else the CPU; "cuda" is `cuda:<LOCAL_RANK>`.

    Raises:
        ConfigError: "cuda" on a machine where torch sees no CUDA device.
    """
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device=cuda but torch sees no CUDA device; use run.device=auto or run.device=cpu")
    return dist.init_from_env(use_cuda=None if name == "auto" else name == "cuda")


def unwrap(model: nn.Module) -> nn.Module:
    """The SSLModel inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def epochs_from(loader, start_step: int, steps_per_epoch: int, position: dict | None):
    """Batches forever, epoch after epoch, starting mid-epoch at `position` when resuming."""
    epoch = start_step // steps_per_epoch
    loader.set_epoch(epoch)
    if position is not None:
        loader.load_state_dict(position)
    while True:
        yield from loader
        epoch += 1
        loader.set_epoch(epoch)


def evaluate_backbone(cfg: Config, backbone: nn.Module, backend: str, device: torch.device) -> dict:
    """kNN and linear-probe top-1 of `backbone` on rank 0 (train → val split, `plain` views)."""
    from train.evaluate import evaluate

    result = {"knn_top1": math.nan, "linear_top1": math.nan}
    if dist.is_main():
        plain = load_recipe("plain", cfg.views.global_px, cfg.views.local_px)
        batch = cfg.data.batch_size // dist.world_size()
        cap = math.ceil(cfg.run.max_eval_samples / batch) if cfg.run.max_eval_samples else None

        def batches(split: str):
            spec = LoaderSpec(root=cfg.data.root, dataset=cfg.data.name, split=split, recipe=plain,
                              batch_size=batch, seed=cfg.run.seed, device=str(device),
                              num_workers=cfg.data.num_workers, shuffle=False, drop_last=False)
            return itertools.islice(build_loader(backend, spec), cap)

        was_training = backbone.training
        backbone.eval()
        result = evaluate(backbone, batches("train"), batches("val"), cfg.data.num_classes, device)
        backbone.train(was_training)
    dist.barrier()
    return dist.broadcast_object(result)
