"""Rank-0 logging: one fixed-order line per interval (STYLE §5) plus the same keys in metrics.jsonl."""

from __future__ import annotations

import json
import time
from pathlib import Path


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
        """Throughput since the last call: img/s, data wait and step time per step (ms)."""
        elapsed = time.perf_counter() - self.start
        steps = max(self.steps, 1)
        out = {"img_per_s": self.images / max(elapsed, 1e-9), "data_ms": 1e3 * self.data_s / steps,
               "step_ms": 1e3 * elapsed / steps}
        self.__init__()
        return out


class Log:
    """Writes log lines to stdout and JSON lines to `<run_dir>/metrics.jsonl` on rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def step(self, step: int, total_steps: int, terms: dict[str, float], lr: float, ema: float,
             speed: dict[str, float]) -> None:
        """One training line, e.g.
        `step 1200/100000 | loss 4.183 | lr 0.288 | ema 0.9961 | 2840 img/s/rank | data 3.1 ms | step 88.4 ms`.
        """
        others = " | ".join(f"{k.removeprefix('loss/')} {v:.3f}" for k, v in terms.items() if k != "loss")
        self.print(f"step {step}/{total_steps} | loss {terms['loss']:.3f} | "
                   + (f"{others} | " if others else "")
                   + f"lr {lr:.3g} | ema {ema:.4f} | {speed['img_per_s']:.0f} img/s/rank | "
                   f"data {speed['data_ms']:.1f} ms | step {speed['step_ms']:.1f} ms")
        self.write({"kind": "train", "step": step, **terms, "lr": lr, "ema": ema, **speed})

    def eval(self, step: int, epoch: float, result: dict[str, float], random_init: dict[str, float]) -> None:
        """Evaluation line: kNN and linear-probe top-1 of the backbone and of a random-init one."""
        self.print(f"eval step {step} (epoch {epoch:.1f}) | kNN {100 * result['knn_top1']:.1f}% "
                   f"(random init {100 * random_init['knn_top1']:.1f}%) | linear "
                   f"{100 * result['linear_top1']:.1f}% (random init {100 * random_init['linear_top1']:.1f}%)")
        self.write({"kind": "eval", "step": step, "epoch": epoch, **result,
                    **{f"random_init/{k}": v for k, v in random_init.items()}})
