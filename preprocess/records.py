"""The records every writer consumes: one source image after the size policy, ready to store.

Sources (synthetic, CIFAR, image folders) yield `Record`s; `PreparedSplit` is the indexable,
picklable view of one split that both writers read in their parallel workers, so both formats store
the same pixels, labels and indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Record:
    """One stored sample."""

    image: np.ndarray              # (H, W, 3) uint8 RGB, after the size policy
    label: int                     # 0 <= label < num_classes
    index: int                     # 0 <= index < len(split), unique within the split
    mask: np.ndarray | None = None # (H, W) uint8 {0, 255} saliency mask, same geometry, or None


class PreparedSplit(Protocol):
    """An indexable, picklable split: `split[i]` is the `Record` with `index == i`.

    Writers may call `__getitem__` from worker processes, in any order, any number of times; the
    result must be the same every time (deterministic, no shared mutable state).
    """

    mode: str                      # "jpg" (lossy, JPEG_QUALITY) or "raw" (bit-exact)
    jpeg_quality: int              # used when mode == "jpg"
    has_masks: bool                # records carry masks (write the mask fields)

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Record: ...
