"""The training loop (STYLE §3): set up once, then one story per step — schedules, batch, loss,
backward, optimiser, EMA target, objective state, log, evaluate, checkpoint — then export.

One code path for a single CPU process and torchrun DDP (train/dist.py). Host syncs happen only at
log, evaluation and checkpoint steps, each marked `# sync:`. `train_step` is the one step that both
this loop and `bench.train` (and `make profile`) run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from models.backbone import export_backbone_state, save_backbone
from pipelines.batch import Batch
from pipelines.spec import Loader
from train import checkpoint, dist, schedules
from train.config import Config, dump_yaml, to_dict
from train.evaluate import EvalLoaders, evaluate_backbone
from train.log import Log, Meter, check_wandb
from train.objectives.base import LossOut, StepValues
from train.optim import apply_lr_wd, clip_and_step
from train.setup import Parts, build_parts, resolve_backend, resume_state, run_folder, select_device


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


def train(cfg: Config) -> Path:
    """Train `cfg.method` on `cfg.data`; returns the run folder (config.yaml, versions.json: the library
    versions of the latest start, metrics.jsonl, TensorBoard
    events, checkpoint.pt (and checkpoint-<step>.pt with run.keep_last > 1), backbone.pt,
    backbone.safetensors)."""
    check_wandb(cfg)
    device = select_device(cfg.run.device, cfg.run.dist_timeout_min)
    backend = resolve_backend(cfg, device)
    world, rank = dist.world_size(), dist.rank()
    resumed = resume_state(cfg)                     # checked before any write
    state = resumed.state
    if state is not None and state["step"] >= cfg.optim.steps and (run_folder(cfg) / "backbone.safetensors").is_file():
        # A finished run started again (a requeued job, the same command twice): its results stand.
        if dist.is_main():
            print(f"{run_folder(cfg)} finished at step {state['step']} (its results are there); nothing to do: "
                  "raise optim.steps to train on, or give another run.name", flush=True)
        return run_folder(cfg)
    parts = build_parts(cfg, device, backend, init=state is None)   # views, model.init: before any write
    online = dist.unwrap(parts.online)
    run_dir = run_folder(cfg)
    log = Log(run_dir, enabled=dist.is_main(), cfg=cfg)
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ".config.yaml.tmp").write_text(dump_yaml(cfg))     # whole or not at all: auto reads it
        os.replace(run_dir / ".config.yaml.tmp", run_dir / "config.yaml")
        (run_dir / "versions.json").write_text(json.dumps(checkpoint.library_versions(), indent=1) + "\n")
        log.print(f"config ({run_dir / 'config.yaml'}):\n{dump_yaml(cfg)}")
    for note in resumed.skipped:
        log.print(f"skipped {note}")
    if resumed.path is not None:
        log.print(f"resuming from {resumed.path} (step {state['step']})")
    elif cfg.model.init:
        log.print(f"backbone initialised from {cfg.model.init}")

    start_step, random_init, position = 0, None, None
    steps_per_epoch = len(parts.loader)
    if state is not None:
        parts.load_state_dict(state)
        start_step, random_init, position = state["step"], state["random_init"], state["loader"][rank]
        checkpoint.set_rng_state(state["rng"][rank])
    batches = epochs_from(parts.loader, start_step, steps_per_epoch, position)
    eval_loaders = EvalLoaders()
    if random_init is None:                  # measured once, before the first step, and kept in checkpoints
        random_init = evaluate_backbone(cfg, online.backbone, backend, device, eval_loaders)

    def save_checkpoint(step: int) -> None:
        rng, position = dist.gather_objects(checkpoint.rng_state()), dist.gather_objects(parts.loader.state_dict())
        if dist.is_main():
            checkpoint.save_latest(run_dir, {
                **parts.state_dict(), "step": step, "loader": position, "rng": rng, "config": to_dict(cfg),
                "random_init": random_init, "git_commit": checkpoint.git_commit(),
                "versions": checkpoint.library_versions()}, cfg.run.keep_last)

    log.print(f"training {cfg.method} on {cfg.data.name} ({backend} backend, {world} rank(s), {device}) "
              f"from step {start_step} to {cfg.optim.steps}, {steps_per_epoch} steps/epoch")
    if note := parts.objective.describe(cfg.optim.steps, steps_per_epoch):
        log.print(note)
    meter = Meter()
    stop = cfg.optim.steps if not cfg.run.stop_after_steps else min(cfg.run.stop_after_steps, cfg.optim.steps)
    for step in range(start_step, stop):
        s = schedules.at(cfg.optim, step, steps_per_epoch, cfg.data.batch_size)
        wait_start = time.perf_counter()
        with phase("data_wait"):
            batch = next(batches)
        data_s = time.perf_counter() - wait_start
        out = train_step(parts, batch, s)
        meter.tick(batch_size=cfg.data.batch_size // world, data_s=data_s)
        done = step + 1
        if done % cfg.run.log_every == 0 or done == stop:
            terms = {"loss": out.loss.detach().float().item()}  # sync: the only host reads of a step
            terms |= {k: v.float().item() for k, v in out.logs.items()}  # sync: log terms
            check_finite(parts, cfg.method, done, terms)
            log.step(done, cfg.optim.steps, terms, s.lr, parts.objective.target_momentum(s), meter.read_and_reset())
        k = cfg.run.eval_every_epochs * steps_per_epoch
        if k and done % k == 0 and done < cfg.optim.steps:
            result = evaluate_backbone(cfg, online.backbone, backend, device, eval_loaders)
            log.eval(done, done / steps_per_epoch, result, random_init)
        if done % cfg.run.ckpt_every == 0 or done == stop:
            save_checkpoint(done)
    log.print(f"data stall: {100 * log.stall_fraction():.1f}% of the step time waited for batches (after warm-up)")
    if stop < cfg.optim.steps:
        log.close()
        again = "run.resume=auto" if cfg.run.resume == "auto" else f"run.resume={run_dir / checkpoint.LATEST}"
        log.print(f"stopped after step {stop}; resume with {again} and a later run.stop_after_steps (or none)")
        return run_dir

    result = evaluate_backbone(cfg, online.backbone, backend, device, eval_loaders)
    log.eval(cfg.optim.steps, cfg.optim.steps / steps_per_epoch, result, random_init)
    log.close()
    if dist.is_main():
        torch.save(export_backbone_state(online.backbone), run_dir / "backbone.pt")
        save_backbone(online.backbone, run_dir / "backbone.safetensors", cfg.model.backbone, cfg.views.global_px,
                      {"method": cfg.method, "dataset": cfg.data.name, "git_commit": checkpoint.git_commit()})
        log.print(f"results in {run_dir}: metrics.jsonl, TensorBoard events (tensorboard --logdir {run_dir.parent}), "
                  f"config.yaml, versions.json, checkpoint.pt, backbone.pt and backbone.safetensors "
                  f"(timm {cfg.model.backbone}, num_classes=0; models.backbone.load_backbone reads it)")
    dist.barrier()
    return run_dir


STEP_PHASES = ("data_wait", "forward", "backward", "optimizer", "ema")


def phase(name: str) -> torch.profiler.record_function:
    """A named range of the training step (`STEP_PHASES`) for torch.profiler."""
    return torch.profiler.record_function(f"step/{name}")


def train_step(parts: Parts, batch: Batch, s: StepValues) -> LossOut:
    """One optimiser step: schedules, forward under autocast, backward, clip + step, EMA target,
    objective state. No host sync: a non-finite loss is only recorded on the device (`check_finite`).

    Args:
        parts: what `build_parts` built; changed in place.
        batch: this step's views, on the training device.
        s: schedule values at this step (`s.step` 0-based).

    Returns:
        The objective's output (loss still on the device).
    """
    # The `phase(...)` ranges name the step's parts in a torch.profiler trace (`make profile`);
    # outside a profiler they cost next to nothing.
    with phase("forward"):
        apply_lr_wd(parts.optimizer, s)
        with torch.autocast(parts.device.type, dtype=torch.bfloat16, enabled=parts.amp):
            out = parts.objective(parts.online, parts.target, batch, s)
        bad = (parts.first_non_finite < 0) & ~torch.isfinite(out.loss.detach())
        parts.first_non_finite.masked_fill_(bad, s.step + 1)      # 1-based, as logged
    with phase("backward"):
        parts.scaler.scale(out.loss).backward()
    with phase("optimizer"):
        clip_and_step(parts.optimizer, parts.scaler, parts.clip)
        parts.optimizer.zero_grad(set_to_none=True)
    with phase("ema"):
        if parts.target is not None:
            parts.target.update_from(dist.unwrap(parts.online), momentum=parts.objective.target_momentum(s))
        parts.objective.after_step(out)
    return out


def check_finite(parts: Parts, method: str, step: int, terms: dict[str, float]) -> None:
    """Stop the run if any step so far had a non-finite loss; one host read, so call it at log steps.

    Raises:
        NonFiniteLossError: naming the first bad step and the loss terms at `step`.
    """
    bad = int(parts.first_non_finite.item())  # sync: non-finite check at log steps
    if bad >= 0:
        detail = ", ".join(f"{k}={v:.4g}" for k, v in terms.items())
        raise NonFiniteLossError(f"non-finite loss at step {bad} ({method}); terms at step {step}: {detail}; "
                                 "lower optim.lr, set optim.clip=1.0 or check the data")


def epochs_from(loader: Loader, start_step: int, steps_per_epoch: int, position: dict | None):
    """Batches forever, epoch after epoch, starting mid-epoch at `position` when resuming."""
    epoch = start_step // steps_per_epoch
    loader.set_epoch(epoch)
    if position is not None:
        loader.load_state_dict(position)
    while True:
        yield from loader
        epoch += 1
        loader.set_epoch(epoch)
