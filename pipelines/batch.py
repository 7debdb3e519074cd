"""The `Batch` every backend yields (one training step of input, on the training device), and the
bookkeeping that turns a batch's rendered views into it: fields in `Recipe.fields` order, mixes
(`pipelines.mixing`), normalisation with the dataset's mean/std.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from pipelines.mixing import MixSpec, mix_source_views, mix_sources, mix_views
from pipelines.views import Recipe


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

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on `device`. Copies to a GPU are non-blocking (ordered on its stream before any use
        there); copies to the host are blocking, so the data read there is finished."""
        to_gpu = torch.device(device).type == "cuda"
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else v.to(device, non_blocking=to_gpu)
                        for f in fields(self)})


def view_bytes(recipe: Recipe, mix: MixSpec, itemsize: int = 4) -> int:
    """Bytes of one sample's views in a `Batch` of `recipe` (the recipe of `mixing.with_mix_source`) and
    `mix`: every view of its fields and every mixed view, `itemsize` bytes a value (4: the normalised
    float32 batch; 1: uint8 views before normalisation, the mixes not yet made)."""
    px = sum(g.count * 3 * g.size_px ** 2 for groups in recipe.fields.values() for g in groups)
    if mix.kind != "none" and itemsize > 1:
        px += len(mix_source_views(recipe, mix)) * 3 * recipe.global_px ** 2
    return px * itemsize


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
    m, s = _statistics(tuple(mean), tuple(std), x.device, x.dtype)
    return (x - m) / s


def channels_last_views(x: Tensor) -> Tensor:
    """(V, B, 3, S, S) views copied into a channels-last network's memory layout: a permuted contiguous
    (V, B, S, S, 3) tensor, so that each view is a channels-last (B, 3, S, S) tensor without a copy."""
    return x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)


@functools.lru_cache(maxsize=16)
def _statistics(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device, dtype: torch.dtype
                ) -> tuple[Tensor, Tensor]:
    """`mean` and `std` as (3, 1, 1) tensors on `device`, made once per device: a new CUDA tensor from
    host values is a blocking copy that waits for the device's stream, which a batch normalised on a GPU
    (the torch loaders' views, the DALI graph's uint8 views) must not do every time."""
    return (torch.tensor(mean, device=device, dtype=dtype).view(3, 1, 1),
            torch.tensor(std, device=device, dtype=dtype).view(3, 1, 1))


def mix_batch(views: dict[str, Tensor], recipe: Recipe, mix: MixSpec, gen: torch.Generator,
              mean: tuple[float, ...], std: tuple[float, ...], device: torch.device | str
              ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The `Batch.mixed`, `mix_lam`, `mix_partner` of one batch (all None without mixes).

    Args:
        views: {group name: (count, B, 3, S, S)} rendered views, uint8 or float in [0, 1].
        recipe: the recipe the views were rendered from (with its mix source group).
        mix: the spec. gen: CPU generator of this batch's mix draws.
        mean, std: the dataset's per-channel statistics. device: where the mixes are made.

    Returns:
        (mixed (V, B, 3, S, S) normalised float32, lam (V, B) float32, partner (V, B) long).
    """
    if mix.kind == "none":
        return None, None, None
    src = mix_sources(views, recipe, mix).to(device, non_blocking=True)            # (V, B, 3, S, S)
    src = src.float().div_(255.0) if src.dtype == torch.uint8 else src
    out = mix_views(src, mix, gen)
    return normalize(out.mixed, mean, std), out.lam, out.partner


def make_batch(views: dict[str, Tensor], recipe: Recipe, mix: MixSpec, gen: torch.Generator,
               mean: tuple[float, ...], std: tuple[float, ...], index: Tensor, label: Tensor,
               device: torch.device | str) -> Batch:
    """One `Batch` from the rendered views of a batch: each field the concatenation of its groups
    (`Recipe.fields`), moved to `device` and normalised there, plus the mixes (`mix_batch`).

    Args:
        views: {group name: (count, B, 3, S, S)} uint8 or float in [0, 1]. index, label: (B,) long.
    """
    def field(groups) -> Tensor | None:
        if not groups:
            return None
        return normalize(torch.cat([views[g.name] for g in groups]).to(device, non_blocking=True), mean, std)

    mixed, lam, partner = mix_batch(views, recipe, mix, gen, mean, std, device)
    by_field = {name: field(groups) for name, groups in recipe.fields.items()}
    return Batch(**by_field, mixed=mixed, mix_lam=lam, mix_partner=partner,
                 index=index.to(device, non_blocking=True), label=label.to(device, non_blocking=True))


class ReusedBuffers:
    """Float32 output tensors that are written again once nothing refers to them any more.

    For a backend whose batches land in host memory (a CPU training device). Writing a batch into
    fresh memory pays the kernel's zero-filling of every page on first touch, which cost most of the
    normalisation time of a batch (docs/benchmarks.md, kernel notes).

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
