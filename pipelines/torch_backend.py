"""Reference backend in plain tensor ops (no torchvision): batched view engine + shard reader.

Part 1, the batched view engine (public: the FFCV backend calls it on already-cropped views):
`sample_crop_boxes`, `render_crops`, `sample_color_params`, `apply_color_ops`, `apply_saliency`,
`render_views`, `mix_views`. Every random parameter is drawn per sample and per view from an explicit
`torch.Generator`; rendering runs on any device, vectorised over the batch (crops loop per sample:
one `F.interpolate` per box).

Part 2, `build(spec)`: reads the DALI-format webdataset shards of `pipelines/schema.py` with
`tarfile` + PIL inside torch DataLoader workers (members located once by offset, then read with a
seek), shards the split disjointly across ranks, shuffles per (seed, epoch), seeds every batch from
(seed, rank, epoch, batch number) so a run is reproducible and resumable mid-epoch.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pipelines import mixing, schema
from pipelines.batch import Batch, normalize
from pipelines.loader import LoaderSpec
from pipelines.shards import ShardRecord, scan_shards
from pipelines.augment import render_views
from pipelines.views import Recipe, ViewGroup

class TorchBackendError(ValueError):
    """Bad loader input for the torch backend; one line naming the problem and the fix."""


def mix_views(views: Tensor, spec_mix, gen: torch.Generator, image: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Intra-batch mixes on [0, 1] views (DESIGN §4).

    Args:
        views: (V, B, 3, H, W) global views. spec_mix: `MixSpec`. image: (B, 3, H, W) the plain
            resized image (DACL source "image").

    Returns:
        (mixed (Vm, B, 3, H, W), lam (Vm, B), partner (Vm, B) long), unnormalised.
    """
    v, b, _, h, w = views.shape
    dev = views.device
    if spec_mix.kind == "sdmp":
        p = mixing.sample_sdmp(b, h, w, spec_mix.alpha, tuple(spec_mix.sdmp_mixers), gen)
        p = mixing.SDMPParams(p.mixer, p.lam.to(dev), p.boxes.to(dev), p.partner.to(dev))
        outs = [mixing.apply_sdmp(views[k], p) for k in range(v)]
        mixed = torch.stack([o[0] for o in outs])                                         # (V, B, 3, H, W)
        lam = torch.stack([o[1] for o in outs])
        partner = p.partner.expand(v, b)
    elif spec_mix.kind == "dacl":
        srcs = [image, image] if spec_mix.source == "image" else list(views)
        outs, lams, parts = [], [], []
        for src in srcs:
            p = mixing.sample_dacl(b, spec_mix.alpha, len(spec_mix.dacl_noises), gen)
            p = mixing.DACLParams(p.partner.to(dev), p.lam.to(dev), p.noise.to(dev))
            outs.append(mixing.apply_dacl(src, p, tuple(spec_mix.dacl_noises), gen if dev == torch.device("cpu") else _dev_gen(gen, dev)))
            lams.append(p.lam)
            parts.append(p.partner)
        mixed, lam, partner = torch.stack(outs), torch.stack(lams), torch.stack(parts)
    else:
        raise TorchBackendError(f"unknown mix kind {spec_mix.kind!r}; use one of none, sdmp, dacl")
    return mixed, lam.float(), partner.long()


def _dev_gen(gen: torch.Generator, dev: torch.device) -> torch.Generator:
    g = torch.Generator(device=dev)
    g.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    return g


# ------------------------------------------------------------------------------------------------
# Shard reading and the loader
# ------------------------------------------------------------------------------------------------


class _Reader(torch.utils.data.Dataset):
    """Decodes and augments one whole batch per item (runs in DataLoader workers)."""

    def __init__(self, spec: LoaderSpec, records: list[ShardRecord], mean, std):
        self.spec, self.records, self.mean, self.std = spec, records, mean, std
        self.files: dict[str, object] = {}

    def _read(self, shard: str, offset: int, size: int) -> bytes:
        f = self.files.get(shard)
        if f is None:
            f = self.files[shard] = open(shard, "rb")
        f.seek(offset)
        return f.read(size)

    def _decode(self, data: bytes, mode: str) -> Tensor:
        from PIL import Image
        with Image.open(io.BytesIO(data)) as im:
            a = np.asarray(im.convert(mode))
        t = torch.from_numpy(a.copy())
        return t.permute(2, 0, 1) if t.ndim == 3 else t.unsqueeze(0)                      # (C, H, W)

    def __len__(self) -> int:
        return 1 << 62

    def __getitem__(self, item):
        seed_key, indices = item
        spec = self.spec
        images, masks, labels, cov = [], [], [], []
        for i in indices:
            r = self.records[i]
            images.append(self._decode(self._read(r.shard, r.image_offset, r.image_size), "RGB"))
            labels.append(r.label)
            cov.append(r.coverage)
            masks.append(self._decode(self._read(r.shard, r.mask_offset, r.mask_size), "L")
                         if r.mask_offset >= 0 else None)
        gen = torch.Generator().manual_seed(seed_key)
        need_masks = any(g.saliency_p > 0 for g in spec.recipe.groups)
        views = render_views(images, masks if need_masks else None, torch.tensor(cov), spec.recipe, gen)
        def cat(groups):
            return torch.cat([views[g.name] for g in groups]) if groups else None

        gl, lo, wk = (cat(groups) for groups in spec.recipe.fields.values())
        mixed = lam = partner = None
        if spec.mix.kind != "none":
            image = None
            if spec.mix.kind == "dacl" and spec.mix.source == "image":
                g = ViewGroup(name="_plain", size_px=gl.shape[-1], crop_p=0.0, flip_p=0.0)
                image = render_views(images, None, torch.tensor(cov), Recipe("_", (g,)), gen)["_plain"][0]
            mixed, lam, partner = mix_views(gl, spec.mix, gen, image)
            mixed = normalize(mixed, self.mean, self.std)
        nz = lambda t: None if t is None else normalize(t, self.mean, self.std)  # noqa: E731
        return dict(global_views=nz(gl), local_views=nz(lo), weak_views=nz(wk), mixed=mixed, mix_lam=lam,
                    mix_partner=partner, index=torch.tensor(indices, dtype=torch.long),
                    label=torch.tensor(labels, dtype=torch.long))


class TorchLoader:
    """The reference loader (see `pipelines.loader.Loader`)."""

    def __init__(self, spec: LoaderSpec):
        if spec.batch_size < 1 or (spec.mix.kind != "none" and spec.batch_size % 2):
            raise TorchBackendError(f"batch_size {spec.batch_size} must be positive and even with mixes; use an even batch size")
        if not 0 <= spec.rank < spec.world_size:
            raise TorchBackendError(f"rank {spec.rank} outside [0, world_size={spec.world_size}); pass a valid rank")
        ddir = Path(spec.root) / spec.dataset
        man = schema.read_manifest(ddir)
        if spec.split not in man.counts:
            raise TorchBackendError(f"split {spec.split!r} not in dataset {spec.dataset!r}; use one of {sorted(man.counts)}")
        self.n = int(man.counts[spec.split])
        split_dir = ddir / spec.split
        self.records = scan_shards(split_dir)           # sorted by index, indices 0..N-1
        if len(self.records) != self.n:
            raise schema.DatasetError(f"{split_dir} holds {len(self.records)} records, manifest says {self.n}: "
                                      "re-run make preprocess")
        self.spec = spec
        self.mean, self.std = tuple(man.mean or (0.5,) * 3), tuple(man.std or (0.25,) * 3)
        self.epoch = 0
        self.done = 0                     # batches of the current epoch already yielded
        if len(self) == 0:
            raise TorchBackendError(f"split {spec.split!r} ({self.n} records) too small for one batch of "
                                    f"{spec.batch_size} per rank on {spec.world_size} ranks; lower batch_size")

    def _rank_indices(self) -> list[int]:
        s, n, w, r = self.spec, self.n, self.spec.world_size, self.spec.rank
        if s.shuffle:
            g = torch.Generator().manual_seed(s.seed * 1_000_003 + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if s.drop_last:
            per = n // w
            return order[r::w][:per]
        return order[r * n // w:(r + 1) * n // w]

    def _batches(self) -> list[list[int]]:
        idx, bs = self._rank_indices(), self.spec.batch_size
        if self.spec.drop_last:
            return [idx[i:i + bs] for i in range(0, len(idx) - bs + 1, bs)]
        return [idx[i:i + bs] for i in range(0, len(idx), bs)]

    def __len__(self) -> int:
        if self.spec.drop_last:
            return (self.n // self.spec.world_size) // self.spec.batch_size
        return len(self._batches())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.done = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.done = int(state["epoch"]), int(state["batches_done"])

    def _seed(self, k: int) -> int:
        s = self.spec
        return (((s.seed * 1_000_003 + s.rank) * 1_000_003 + self.epoch) * 1_000_003 + k) & ((1 << 63) - 1)

    def __iter__(self):
        s = self.spec
        batches = self._batches()
        start = self.done
        items = [(self._seed(k), batches[k]) for k in range(start, len(batches))]
        reader = _Reader(s, self.records, self.mean, self.std)
        if s.num_workers > 0 and len(items) > 1:
            dl = torch.utils.data.DataLoader(reader, batch_size=None, sampler=items, num_workers=s.num_workers,
                                             persistent_workers=False, prefetch_factor=2)
        else:
            dl = (reader[it] for it in items)
        for d in dl:
            dev = torch.device(s.device)
            moved = {k: (v.to(dev, non_blocking=True) if isinstance(v, Tensor) else v) for k, v in d.items()}
            self.done += 1
            yield Batch(**moved)
        self.done = 0


def build(spec: LoaderSpec) -> TorchLoader:
    """Build the reference torch loader for `spec` (see `pipelines.loader.build_loader`).

    Raises:
        TorchBackendError: bad batch size / rank / split, or a split too small for one batch per rank.
        schema.DatasetError / FileNotFoundError: incomplete or damaged dataset, missing shards.
    """
    return TorchLoader(spec)
