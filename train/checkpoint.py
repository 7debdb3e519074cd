"""Checkpoints that resume exactly: written atomically, read with `torch.load(weights_only=True)`.

A checkpoint holds only tensors and primitive containers: `online`, `target` and `objective` state
dicts, `optimizer`, `scaler`, `step`, the loader position, the RNG states, the resolved config (as
plain dicts), the random-init evaluation and the git commit.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import numpy as np
import torch


class CheckpointError(FileNotFoundError):
    """A checkpoint that is missing or unreadable."""


def git_commit() -> str:
    """The commit of the source tree this process runs from ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rng_state() -> dict:
    """Python, NumPy and torch RNG states as tensors and primitives (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(path: Path, state: dict) -> Path:
    """Write `state` to `path` atomically (temp file in the same folder, then os.replace).

    Args:
        path: destination file; its folder is created.
        state: tensors and primitive containers only.

    Returns:
        `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)                   # atomic: a kill leaves the old file or the new one
    return path


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint written by `save` onto the CPU (weights_only: no code is unpickled).

    Raises:
        CheckpointError: the file is missing or not a checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found; pass run.resume=<run dir>/checkpoint.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}; pass a file written by the trainer") from e


def load_training(path: str | os.PathLike) -> dict:
    """`load`, and refuse a file that is not a training checkpoint (e.g. an exported backbone).

    Raises:
        CheckpointError: missing, unreadable, or without the saved config.
    """
    state = load(path)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{path} is not a training checkpoint (no saved config); pass <run dir>/checkpoint.pt")
    return state
