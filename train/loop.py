"""The training loop (STYLE §3): from the run's first step, one story per step — schedules, batch,
loss, backward, optimiser, EMA target, objective state, log, evaluate, checkpoint — then the final
evaluation. What comes before (the device, the run folder, the parts) and after (the export) is a rank's
life, `train.launch.train`.

One code path for a single CPU process and torchrun DDP (train/dist.py). Host syncs happen only at
log, evaluation and checkpoint steps, each marked `# sync:`. `train_step` is the one step that both
this loop and `bench.train` (and `make profile`) run.
"""

from __future__ import annotations

import time

import torch

from pipelines.batch import Batch
from pipelines.processes import process_age_s
from pipelines.spec import Loader
from train import checkpoint, dist, schedules
from train.config import per_process_batch, to_dict
from train.evaluate import evaluate_backbone
from train.log import Log, Meter, format_duration
from train.objectives.base import LossOut, StepValues
from train.optim import apply_lr_wd, clip_and_step
from train.run import Run
from train.setup import Parts


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite."""


def train(run: Run, parts: Parts, log: Log, backend: str, held: dist.HeldSignal | None = None) -> bool:
    """Train `run.cfg` from where `run` starts to `optim.steps` (or `run.stop_after_steps`) with `parts`,
    logging to `log`, checkpointing into the run folder (every `run.ckpt_every` steps, and at the first
    log step `run.ckpt_every_min` minutes after the last checkpoint by any rank's clock), evaluating the
    backbone before the first step, every `run.eval_every_epochs` and after the last. With `held`
    (`run.checkpoint_on_signal`) the steps hold its signal back: at the first log step after any rank
    caught it, every rank checkpoints and the loop ends there. An evaluation does not hold it (it may
    last longer than the warning), so with `held` a checkpoint comes before each periodic evaluation: the
    signal caught in it requeues from that step, and the next start evaluates first. A rank whose loader
    worker dies (the OOM killer) checkpoints the steps it reached before it fails, alone where there are
    several (`checkpoint.Cadence.next_batch`).

    Returns:
        Whether the run reached `optim.steps` (its backbone is then for `Run.export`).

    Raises:
        NonFiniteLossError: at the first log step after a non-finite loss.
    """
    cfg, state, device = run.cfg, run.resume.state, parts.device
    world, rank = dist.world_size(), dist.rank()
    online = dist.unwrap(parts.online)
    start_step, random_init, position = 0, None, None
    steps_per_epoch = len(parts.loader)
    if state is not None:
        parts.load_state_dict(state)
        start_step, random_init = state["step"], state["random_init"]
        position, note = checkpoint.resume_rank(state, rank, world, cfg.run.seed, cfg.data.batch_size,
                                                state["config"]["data"]["batch_size"], steps_per_epoch)
        if note:                             # saved by other processes, with another batch, or by one rank alone
            log.print(note)
    batches = epochs_from(parts.loader, start_step, steps_per_epoch, position)
    if random_init is None:                  # measured once, before the first step, and kept in checkpoints
        began = time.perf_counter()
        random_init = evaluate_backbone(cfg, online.backbone, backend, device)
        seconds = time.perf_counter() - began
        log.started("random_init_eval_s", seconds, f"random-init evaluation: {format_duration(seconds)}")

    def evaluate(step: int) -> None:
        began = time.perf_counter()
        result = evaluate_backbone(cfg, online.backbone, backend, device)
        log.eval(step, step / steps_per_epoch, result, random_init, time.perf_counter() - began)

    def save_checkpoint(step: int, evaluate_first: bool = False, alone: bool = False) -> None:
        ranks = checkpoint.rank_states(parts.loader, alone)      # alone: this rank by itself (`Cadence.next_batch`)
        if alone or dist.is_main():
            short = run.save({**parts.state_dict(), "step": step, **ranks, "config": to_dict(cfg),
                              "random_init": random_init, "evaluate_first": evaluate_first,
                              "git_commit": checkpoint.git_commit(), "versions": checkpoint.library_versions()})
            if short:                        # the disk will not hold the next checkpoint
                log.print(short)

    if state is not None and state.get("evaluate_first"):   # the evaluation a warning cut short, first
        log.print(f"a signal stopped the evaluation of step {start_step}: it runs again first")
        evaluate(start_step)

    log.print(f"training {cfg.method} on {cfg.data.name} ({backend} backend, {world} rank(s), {device}) "
              f"from step {start_step} to {cfg.optim.steps}, {steps_per_epoch} steps/epoch")
    if note := parts.objective.describe(cfg.optim.steps, steps_per_epoch):
        log.print(note)
    meter, rank_batch = Meter(), per_process_batch(cfg.data.batch_size, world)
    stop = cfg.optim.steps if not cfg.run.stop_after_steps else min(cfg.run.stop_after_steps, cfg.optim.steps)
    cadence = checkpoint.Cadence(cfg.run.ckpt_every, cfg.run.ckpt_every_min, held)
    with cadence.held.holding():
        for step in range(start_step, stop):
            s = schedules.at(cfg.optim, step, steps_per_epoch, cfg.data.batch_size)
            wait_start = time.perf_counter()
            with phase("data_wait"):         # a loader worker's death saves the steps reached, then fails
                batch = cadence.next_batch(batches, step, start_step, lambda alone: save_checkpoint(step, alone=alone))
            data_s = time.perf_counter() - wait_start
            out = train_step(parts, batch, s)
            meter.tick(batch_size=rank_batch, data_s=data_s)
            done = step + 1
            if step == start_step:           # what a start costs before training: imports, loaders, evaluation
                age = process_age_s()
                log.started("first_step_s", age, f"first step {format_duration(age or 0)} after this process started")
                if dist.is_main():           # a disk too small for the checkpoints: told before the first
                    size = checkpoint.state_bytes(parts.state_dict())    # the optimiser's state made by now
                    if short := checkpoint.space_short(run.folder, size, cfg.run.keep_last):
                        log.print(short)
            if done % cfg.run.log_every == 0 or done == stop:
                terms = {"loss": out.loss.detach().float().item()}  # sync: the only host reads of a step
                terms |= {k: v.float().item() for k, v in out.logs.items()}  # sync: log terms
                check_finite(parts, cfg.method, done, terms)
                log.step(done, cfg.optim.steps, terms, s.lr, parts.objective.target_momentum(s),
                         meter.read_and_reset())
                cadence.at_log_step(device)          # sync: the signal and the clocks of every rank
            k = cfg.run.eval_every_epochs * steps_per_epoch
            if k and done % k == 0 and done < cfg.optim.steps and not cadence.signalled:
                if cadence.held.name:                # a warning in the evaluation requeues from this step,
                    save_checkpoint(done, evaluate_first=True)      # and the next start evaluates first
                    cadence.saved(done)
                with cadence.held.holding(False):    # a long evaluation must not hold the signal back
                    evaluate(done)
            if cadence.due(done, stop):
                save_checkpoint(done)
                cadence.saved(done)
            if cadence.signalled:
                break
    log.print(f"data stall: {100 * log.stall_fraction():.1f}% of the step time waited for batches (after warm-up)")
    if cadence.signalled:
        log.close()
        log.print(f"caught {cadence.held.what()}: saved the checkpoint of step {done} and stopped; the same command "
                  f"with {run.resume_hint()} continues there (a requeued SLURM job does so itself)")
        return False
    if stop < cfg.optim.steps:
        log.close()
        log.print(f"stopped after step {stop}; resume with {run.resume_hint()} and a later run.stop_after_steps "
                  "(or none)")
        return False
    evaluate(cfg.optim.steps)
    log.close()
    return True


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
    """Batches forever, epoch after epoch, starting mid-epoch at `position` when resuming (its epoch,
    which is not the step's when a resume changed the global batch)."""
    epoch = start_step // steps_per_epoch if position is None else int(position["epoch"])
    loader.set_epoch(epoch)
    if position is not None:
        loader.load_state_dict(position)
    while True:
        yield from loader
        epoch += 1
        loader.set_epoch(epoch)
