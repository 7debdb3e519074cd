"""DALI backend: webdataset shards → the graph of `dali_graph` → `Batch`.

One DALI pipeline per rank and epoch, built with `enable_conditionals` and DALI checkpointing; its
webdataset reader shards the split by rank (contiguous ranges, `loader.rank_range`), with the shard
order permuted per epoch by a seed shared by all ranks and records shuffled within the rank's shard
by the pipeline's seed (per seed, rank and epoch). The loader position is `loader.EpochOrder`'s
({"epoch", "batches_done"}), plus DALI's own checkpoint of the reader for a mid-epoch resume.

Outputs land on the training device without a round trip: each view output is copied with DALI's
`feed_ndarray` straight into the batch tensor (device to device on a GPU; into a reused host buffer,
`batch.ReusedBuffers`, on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from nvidia.dali import pipeline_def
from nvidia.dali.backend import TensorListGPU
from nvidia.dali.plugin.pytorch import feed_ndarray

from pipelines import schema
from pipelines.batch import Batch, ReusedBuffers
from pipelines.dali_graph import graph
from pipelines.loader import DatasetInfo, EpochOrder, LoaderSpec, derive_seed, rank_range


def _shards(info: DatasetInfo, split: str) -> tuple[list[str], list[str]]:
    """(tar paths, index paths) of one split.

    Raises:
        schema.DatasetError: no shards, or a shard without its index file.
    """
    folder = info.dir / split
    tars = sorted(str(p) for p in folder.glob("shard-*.tar"))
    if not tars:
        raise schema.DatasetError(f"no DALI shards in {folder}; run `python -m preprocess` for this dataset")
    idxs = [t[: -len(".tar")] + ".idx" for t in tars]
    missing = [i for i in idxs if not Path(i).is_file()]
    if missing:
        raise schema.DatasetError(f"missing DALI index file {missing[0]}; re-run preprocessing with --force")
    return tars, idxs


def _to_torch(tl) -> torch.Tensor:
    if isinstance(tl, TensorListGPU):
        tl = tl.as_cpu()
    return torch.from_numpy(tl.as_array())


def _feed(tls: list, dev: torch.device, buffers: ReusedBuffers, k: int) -> torch.Tensor | None:
    """Copy V view outputs (DALI batches of (3, S, S) float32 samples) into one (V, k, 3, S, S) tensor
    on `dev`, one `feed_ndarray` per view: GPU outputs device to device (no round trip through the
    host), CPU outputs into a reused host buffer."""
    if not tls:
        return None
    dense = [tl.as_tensor() for tl in tls]                                 # (B, 3, S, S) each
    shape = (len(dense), *dense[0].shape())
    on_gpu = isinstance(tls[0], TensorListGPU)
    out = torch.empty(shape, dtype=torch.float32, device=dev) if on_gpu else buffers.take(shape)
    stream = torch.cuda.current_stream(dev) if on_gpu else None
    for v, t in enumerate(dense):
        feed_ndarray(t, out[v], cuda_stream=stream)
    return out[:, :k].to(dev, non_blocking=True)


class DaliLoader:
    """The DALI `Loader` of one rank (see `pipelines.loader.Loader`)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo, *, debug: bool = False) -> None:
        self.spec, self.info, self.debug = spec, info, debug
        self.tars, self.idxs = _shards(info, spec.split)
        self.masks = info.reads_masks(spec.recipe)
        self.order = EpochOrder(spec, info.count)
        lo, hi = rank_range(info.count, spec.rank, spec.world_size)
        self.rank_count = hi - lo                    # records DALI's reader gives this rank
        self._buffers = ReusedBuffers()              # CPU device: the views land in reused host memory
        self._pipe, self._pipe_epoch, self._names, self._resume = None, None, None, None
        self.last_debug: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.order)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def state_dict(self) -> dict:
        ckpt = self._pipe.checkpoint() if self._pipe is not None and self._pipe_epoch == self.order.epoch else None
        return {**self.order.state_dict(), "dali": ckpt}

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
        self._pipe, self._resume = None, state.get("dali")

    def _pipeline(self):
        """The pipeline of the current epoch (resumed from a loaded DALI checkpoint if any)."""
        o, s = self.order, self.spec
        if self._pipe is not None and self._pipe_epoch == o.epoch:
            return self._pipe
        ckpt, self._resume = self._resume, None
        tars, idxs = self.tars, self.idxs
        if s.shuffle:    # shard order per epoch, the same on every rank, so ranks see new records each epoch
            perm = np.random.default_rng(derive_seed(s.seed, o.epoch, 8)).permutation(len(tars))
            tars, idxs = [tars[i] for i in perm], [idxs[i] for i in perm]
        gpu = s.device.startswith("cuda")
        seed = o.batch_seed(0, purpose=3) % (2**31 - 1)
        names: list[str] = []

        @pipeline_def(batch_size=s.batch_size, num_threads=max(1, s.num_workers),
                      device_id=(torch.device(s.device).index or 0) if gpu else None, seed=seed,
                      prefetch_queue_depth=2, enable_checkpointing=True, checkpoint=ckpt, enable_conditionals=True)
        def pipe():
            out = graph(s, tars, idxs, self.masks, seed, self.info.mean, self.info.std, self.debug)
            names.extend(out.names)
            return tuple(out.nodes)

        self._pipe = pipe()
        self._pipe.build()
        self._pipe_epoch, self._names = o.epoch, names
        return self._pipe

    def __iter__(self) -> Iterator[Batch]:
        o, s = self.order, self.spec
        dev = torch.device(s.device)
        epoch = o.epoch
        while o.epoch == epoch and len(o):
            outs = self._pipeline().run()
            k = min(s.batch_size, self.rank_count - o.batches_done * s.batch_size)
            parts: dict[str, list] = {}
            self.last_debug = {}
            for name, tl in zip(self._names, outs):
                if name.startswith("debug:"):
                    self.last_debug[name[6:]] = _to_torch(tl)[:k].numpy()
                else:
                    parts.setdefault(name, []).append(tl)
            rec = _to_torch(parts["rec"][0])[:k]                              # (k, 3) label, index, coverage
            lam = partner = None
            if "mix_lam" in parts:
                lam = torch.stack([_to_torch(t)[:k] for t in parts["mix_lam"]]).float().to(dev)   # (Vm, k)
                if "mix_partner" in parts:
                    partner = torch.stack([_to_torch(t)[:k] for t in parts["mix_partner"]])
                else:                                                     # SDMP: mixing.partner_index
                    partner = torch.arange(k - 1, -1, -1).expand(len(parts["mix_lam"]), k)
                partner = partner.to(dev)
            fields = {f: _feed(parts.get(f, []), dev, self._buffers, k)
                      for f in ("global_views", "local_views", "weak_views", "mixed")}
            batch = Batch(**fields, mix_lam=lam, mix_partner=partner, index=rec[:, 1].to(dev), label=rec[:, 0].to(dev))
            o.advance()
            yield batch
        if o.epoch != self._pipe_epoch:
            self._pipe = None


def build(spec: LoaderSpec, info: DatasetInfo, *, debug: bool = False) -> DaliLoader:
    """The DALI loader of `spec` (called by `pipelines.loader.build_loader`); `spec.device` "cuda[:i]"
    runs decode on nvJPEG and the ops on the GPU.

    Args:
        debug: also record the drawn parameters of the last batch in `loader.last_debug`.

    Raises:
        schema.DatasetError: shards or index files missing.
    """
    return DaliLoader(spec, info, debug=debug)
