"""The `Batch` every backend yields: one training step of input, on the training device."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Per-channel statistics used to normalise uint8 images on the device. Datasets store their own
# mean/std in the manifest; backends pass those in, these are the ImageNet defaults.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Batch:
    """One training step of input, on the training device, normalised float."""

    global_views: Tensor          # (Vg, B, 3, Hg, Wg) large crops, or the aggressive views of staged recipes
    local_views: Tensor | None    # (Vl, B, 3, Hl, Wl) small crops
    weak_views: Tensor | None     # (Vw, B, 3, Hg, Wg) weak parents of staged (RSA) recipes
    mixed: Tensor | None          # (Vm, B, 3, Hg, Wg) intra-batch mixes
    mix_lam: Tensor | None        # (Vm, B) weight of sample i itself, after area correction
    mix_partner: Tensor | None    # (Vm, B) index of the sample mixed into sample i
    index: Tensor                 # (B,) dataset indices
    label: Tensor | None = None   # (B,) class labels; read only by evaluation, never by objectives

    @property
    def batch_size(self) -> int:
        return int(self.index.shape[0])


def normalize(x: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """Turn images in [0, 1] (or uint8 in [0, 255]) into normalised float32.

    Args:
        x: (..., 3, H, W) uint8 in [0, 255] or float in [0, 1].
        mean, std: per-channel statistics in [0, 1] units.

    Returns:
        (..., 3, H, W) float32, (x - mean) / std.
    """
    if x.dtype == torch.uint8:
        x = x.float().div_(255.0)
    m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(3, 1, 1)
    s = torch.tensor(std, device=x.device, dtype=x.dtype).view(3, 1, 1)
    return (x - m) / s


class ReusedBuffers:
    """Float32 output tensors that are written again once nothing refers to them any more.

    For a backend whose batches land in host memory (a CPU training device). Writing a batch into
    fresh memory pays the kernel's zero-filling of every page on first touch: on the 2-core machine
    32 ms of the 41 ms it took to normalise the 4 x 224-px views of a 32-image relicv2 batch (9 ms
    into a buffer written before), about 1 ms per image.

    Each buffer is a numpy array and the tensors handed out are `torch.from_numpy` views of it; their
    storage holds a reference to the array, so the array's reference count says whether any tensor
    made from a handed-out one (a slice, a reshape, a `Batch` kept by the caller) is still alive. Only
    a buffer with no such tensor is written again; otherwise a new one is made, and at most `keep`
    per shape are kept for reuse.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.made = 0                      # buffers allocated so far; reuse keeps it from growing
        self._arrays: dict[tuple[int, ...], list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...]) -> Tensor:
        """An uninitialised float32 tensor of `shape` that no live tensor shares."""
        arrays = self._arrays.setdefault(tuple(shape), [])
        for a in arrays:
            if sys.getrefcount(a) == 3:    # the list, `a` and getrefcount's argument: no tensor
                return torch.from_numpy(a)
        a = np.empty(shape, np.float32)
        self.made += 1
        if len(arrays) < self.keep:
            arrays.append(a)
        return torch.from_numpy(a)
