"""Rank-0 logging: one fixed-order line per interval (STYLE §5), the same keys in metrics.jsonl, and
TensorBoard event files beside it (`tensorboard --logdir runs`): every number of a log line under
`train/`, every evaluation under `eval/` (with the random-init backbone's under `eval/random_init/`).
With `run.wandb=true` the same scalars, names and steps go to Weights & Biases too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from pathlib import Path

from train.config import Config, ConfigError, to_dict


class Meter:
    """Wall-clock throughput between log steps (host time; no device sync of its own)."""

    def __init__(self) -> None:
        self.images = 0
        self.steps = 0
        self.data_s = 0.0
        self.start = time.perf_counter()

    def tick(self, batch_size: int, data_s: float) -> None:
        """Count one step of `batch_size` images that waited `data_s` seconds for its batch."""
        self.images += batch_size
        self.steps += 1
        self.data_s += data_s

    def read_and_reset(self) -> dict[str, float]:
        """Throughput since the last call: img/s, data wait and step time per step (ms), steps."""
        elapsed = time.perf_counter() - self.start
        steps = max(self.steps, 1)
        out = {"img_per_s": self.images / max(elapsed, 1e-9), "data_ms": 1e3 * self.data_s / steps,
               "step_ms": 1e3 * elapsed / steps, "steps": self.steps}
        self.__init__()
        return out


def format_duration(seconds: float) -> str:
    """A duration as `1h02m`, `3m07s` or `42s`."""
    s = int(round(max(seconds, 0.0)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# The figures of an evaluation, in the order of the line: (key, label, format of the number).
EVAL_FIGURES = (("knn_top1", "kNN", "{:.1%}"), ("linear_top1", "linear", "{:.1%}"), ("rankme", "rankme", "{:.1f}"),
                ("feature_std", "std", "{:.4f}"), ("alignment", "alignment", "{:.3f}"))


def eval_line(result: dict[str, float], random_init: dict[str, float] | None = None) -> str:
    """`kNN 28.6% (random init 17.3%: +11.3 points) | linear ... | rankme 41.2 (random init ...) | ...`:
    the figures `result` has, each with the random-init backbone's when given (the run's own starting
    weights: what the gain is measured against), accuracies with their gain in points."""
    parts = []
    for key, label, fmt in EVAL_FIGURES:
        if key in result:
            ref = ""
            if random_init and key in random_init:
                gain = f": {100 * (result[key] - random_init[key]):+.1f} points" if key.endswith("_top1") else ""
                ref = f" (random init {fmt.format(random_init[key])}{gain})"
            parts.append(f"{label} {fmt.format(result[key])}{ref}")
    return " | ".join(parts)


def check_wandb(cfg: Config) -> None:
    """Stop before any write when `run.wandb=true` has no wandb package to log with.

    Raises:
        ConfigError: naming the extra to install.
    """
    if cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb=true needs the wandb package: pip install 'viewmill[wandb]' (or drop run.wandb)")


def start_wandb(cfg: Config, run_dir: Path):
    """A W&B run (`wandb.init`) for the run folder: project `run.wandb_project`, named after the folder,
    its files under `<run_dir>/wandb/`, the resolved config; WANDB_MODE, WANDB_ENTITY and the API key come
    from the environment. The id is drawn from the folder's path, so a resumed or requeued run continues
    the same W&B run (W&B drops steps it already has: a resume repeats them bit for bit anyway).

    Raises:
        ConfigError: W&B refused to start (no API key where nobody can type one in, as in a batch job).
    """
    import wandb

    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    try:
        return wandb.init(project=cfg.run.wandb_project, name=run_dir.name, id=run_id, resume="allow",
                          dir=str(run_dir), config=to_dict(cfg))
    except wandb.errors.UsageError as e:
        raise ConfigError(f"run.wandb=true: W&B did not start ({str(e).splitlines()[0]}); log in (wandb login, or "
                          "WANDB_API_KEY), or set WANDB_MODE=offline, then continue with run.resume=auto") from None


class Log:
    """Writes log lines to stdout, JSON lines to `<run_dir>/metrics.jsonl`, TensorBoard events to
    `<run_dir>/events.out.tfevents.*` and, with `run.wandb`, the same scalars to W&B, on rank 0 only;
    `close` flushes the events and ends the W&B run."""

    def __init__(self, run_dir: Path, enabled: bool, cfg: Config | None = None) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_dir = Path(run_dir)
        self.tb = None                          # SummaryWriter, opened at the first record
        self.wandb_cfg = cfg if cfg is not None and cfg.run.wandb else None
        self.wandb = None                       # W&B run, started at the first record when wandb_cfg
        self.steps_timed, self.seconds = 0, 0.0  # for the ETA
        self.warm_data_s = self.warm_step_s = 0.0  # after the first (warm-up) interval: the stall share

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def scalars(self, prefix: str, step: int, values: dict[str, float]) -> None:
        """TensorBoard scalars `<prefix>/<key>` at `step`."""
        if not self.enabled:
            return
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir), flush_secs=30)
        for key, value in values.items():
            self.tb.add_scalar(f"{prefix}/{key}", value, step)
        if self.wandb_cfg is not None:
            if self.wandb is None:
                self.wandb = start_wandb(self.wandb_cfg, self.run_dir)
            self.wandb.log({f"{prefix}/{key}": value for key, value in values.items()}, step=step)

    def stall_fraction(self) -> float:
        """Share of the step time spent waiting for batches, after the first log interval (which holds
        the loaders' start-up and compilation)."""
        return self.warm_data_s / max(self.warm_step_s, 1e-9)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def started(self, key: str, seconds: float | None, line: str) -> None:
        """A start-up figure: `line` printed, `{"kind": "start", key: seconds}` recorded
        (`first_step_s`: from this process's start to its first step; `random_init_eval_s`)."""
        if seconds is not None:
            self.print(line)
            self.write({"kind": "start", key: seconds})

    def step(self, step: int, total_steps: int, terms: dict[str, float], lr: float, ema: float | None,
             speed: dict[str, float]) -> None:
        """One training line, e.g. `step 1200/100000 | loss 4.183 | lr 0.288 | ema 0.9961 |
        2840 img/s/rank | data 3.1 ms | step 88.4 ms | eta 2h26m`; `speed` also has `steps`, the
        steps it covers. The ETA is the remaining steps at the mean step time logged so far.
        """
        if self.steps_timed:
            self.warm_data_s += speed["steps"] * speed["data_ms"] / 1e3
            self.warm_step_s += speed["steps"] * speed["step_ms"] / 1e3
        self.steps_timed += speed["steps"]
        self.seconds += speed["steps"] * speed["step_ms"] / 1e3
        eta_s = (total_steps - step) * self.seconds / max(self.steps_timed, 1)
        others = " | ".join(f"{k.removeprefix('loss/')} {v:.3f}" for k, v in terms.items() if k != "loss")
        self.print(f"step {step}/{total_steps} | loss {terms['loss']:.3f} | "
                   + (f"{others} | " if others else "")
                   + f"lr {lr:.3g} | " + (f"ema {ema:.4f} | " if ema is not None else "")
                   + f"{speed['img_per_s']:.0f} img/s/rank | "
                   f"data {speed['data_ms']:.1f} ms | step {speed['step_ms']:.1f} ms | eta {format_duration(eta_s)}")
        numbers = {**terms, "lr": lr, **({"ema": ema} if ema is not None else {}),
                   **{k: v for k, v in speed.items() if k != "steps"},
                   "eta_s": eta_s}
        self.write({"kind": "train", "step": step, **numbers})
        self.scalars("train", step, numbers)

    def eval(self, step: int, epoch: float, result: dict[str, float], random_init: dict[str, float],
             seconds: float | None = None) -> None:
        """Evaluation line: each figure of the backbone next to the random-init backbone's (`eval_line`);
        the record also holds how long the evaluation took (`seconds`)."""
        self.print(f"eval step {step} (epoch {epoch:.1f}) | {eval_line(result, random_init)}")
        record = {**result, **{f"random_init/{k}": v for k, v in random_init.items()}}
        if seconds is not None:
            record["eval_s"] = seconds
        self.write({"kind": "eval", "step": step, "epoch": epoch, **record})
        self.scalars("eval", step, record)
        if self.tb is not None:
            self.tb.flush()
