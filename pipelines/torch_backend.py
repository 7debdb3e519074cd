"""Reference backend: webdataset shards → PIL decode → the plain tensor ops of `augment.py` → `Batch`.

Each DataLoader worker reads a whole batch of records from the DALI-format webdataset shards
(`pipelines/shards.py`: members located once by offset, then one positioned read each), decodes them
with PIL, renders every view of the recipe with `augment.render_views` and the mixes with
`pipelines.mixing`, all drawn from one generator seeded per (seed, rank, epoch, batch)
(`EpochOrder.batch_seed`), so a run is reproducible whatever the number of workers and resumes
mid-epoch exactly. The epoch order, sharding and resume position are `pipelines.spec.EpochOrder`'s.
The workers read ahead across epoch boundaries (`EpochOrder.schedule`, as DALI's prefetch queue): the
next epoch's first batches are made while this epoch's last ones are used.
"""

from __future__ import annotations

import io
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from pipelines.augment import render_views
from pipelines.batch import Batch, make_batch, view_bytes
from pipelines.processes import iterate, worker_context, worker_started
from pipelines.shards import ShardReader
from pipelines.spec import DatasetInfo, EpochLoader, EpochOrder, LoaderSpec


def decode(data: bytes, mode: str) -> Tensor:
    """PIL-decode PNG/JPEG bytes as (C, H, W) uint8 ("RGB": C = 3, "L": C = 1)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        a = np.asarray(im.convert(mode))
    t = torch.from_numpy(a.copy())
    return t.permute(2, 0, 1) if t.ndim == 3 else t.unsqueeze(0)                      # (C, H, W)


PREFETCH = 2          # batches each DataLoader worker makes ahead


def shared_memory_bytes(spec: LoaderSpec, info: DatasetInfo) -> int:
    """/dev/shm a loader of `spec` fills at most: each worker hands its batches (whole float32 `Batch`es)
    over in shared memory, `PREFETCH` of them at a time."""
    return spec.num_workers * PREFETCH * spec.batch_size * view_bytes(spec.recipe, spec.mix)


class _BatchReader(torch.utils.data.Dataset):
    """Item (seed, indices) → one whole batch as a CPU `Batch` (runs in DataLoader workers)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo, reader: ShardReader) -> None:
        self.spec, self.info, self.reader = spec, info, reader
        self.masks = info.reads_masks(spec.recipe)

    def __len__(self) -> int:
        return 1 << 62                    # indexed by (seed, indices) items, never by position

    def __getitem__(self, item: tuple[int, np.ndarray]) -> Batch:
        seed, indices = item
        s, reader = self.spec, self.reader
        images = [decode(self.reader.image(i), "RGB") for i in indices]
        masks = None
        if self.masks:
            masks = [None if (m := self.reader.mask(i)) is None else decode(m, "L") for i in indices]
        coverage = torch.from_numpy(reader.coverage[np.asarray(indices)])
        gen = torch.Generator().manual_seed(seed)
        views = render_views(images, masks, coverage, s.recipe, gen)
        index = torch.as_tensor(np.asarray(indices, np.int64))
        label = torch.from_numpy(reader.labels[np.asarray(indices)])
        return make_batch(views, s.recipe, s.mix, gen, self.info.mean, self.info.std, index, label, "cpu")


class _Schedule:
    """The DataLoader's items, (seed, indices), of every batch from the loader's position on, epoch
    after epoch (`EpochOrder.schedule`): its workers make the next epoch's first batches while this
    epoch's last ones are used, so an epoch boundary costs no more than a batch."""

    def __init__(self, order: EpochOrder) -> None:
        self.order = order

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for epoch, k, idx in self.order.schedule():
            yield self.order.batch_seed(k, epoch=epoch), idx


class TorchLoader(EpochLoader):
    """The reference loader of one rank (see `pipelines.spec.Loader`)."""

    def __init__(self, spec: LoaderSpec, info: DatasetInfo) -> None:
        self.spec = spec
        self.order = EpochOrder(spec, info.count)
        self.batches = _BatchReader(spec, info, ShardReader.open(info.dir / spec.split, info.count))
        self._ahead: Iterator[Batch] | None = None     # batches read ahead from position `_ahead_at`
        self._ahead_at: tuple[int, int] | None = None

    def _read_ahead(self) -> Iterator[Batch]:
        items = _Schedule(self.order)
        if self.spec.num_workers == 0:
            return (self.batches[it] for it in items)
        # Forked workers (or a fork server's, `worker_context`), also in a process that was itself
        # spawned (a bench's fresh process, whose default start method is then spawn: each worker would
        # import torch again, seconds each).
        return iterate(torch.utils.data.DataLoader(self.batches, batch_size=None, sampler=items,
                                                   num_workers=self.spec.num_workers, prefetch_factor=PREFETCH,
                                                   worker_init_fn=worker_started,
                                                   multiprocessing_context=worker_context(__name__)))

    def __iter__(self) -> Iterator[Batch]:
        o = self.order
        epoch = o.epoch
        if self._ahead is None or self._ahead_at != (o.epoch, o.batches_done):   # a new position: set_epoch, resume
            self._end_ahead()           # the old workers end before new ones start
            self._ahead = self._read_ahead()
        while o.epoch == epoch and len(o):
            b = next(self._ahead)
            o.advance()
            self._ahead_at = (o.epoch, o.batches_done)
            if not self.spec.shuffle and o.epoch != epoch:
                # An evaluation loader (index order) is read again from its start: nothing to read
                # ahead, and its workers end instead of idling beside training.
                self._end_ahead()
            yield b.to(self.spec.device)

    def close(self) -> None:
        self._end_ahead()

    def _end_ahead(self) -> None:
        """End the workers reading ahead now (`processes.Watched.close`), also while an exception that
        passed through them is still held."""
        ahead, self._ahead, self._ahead_at = self._ahead, None, None
        if ahead is not None:
            ahead.close()


def build(spec: LoaderSpec, info: DatasetInfo) -> TorchLoader:
    """The reference torch loader of `spec` (called by `pipelines.loader.build_loader`).

    Raises:
        schema.DatasetError: shards missing or not matching the manifest.
    """
    return TorchLoader(spec, info)
