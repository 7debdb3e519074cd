"""The maps of every record of a dataset, kept on disk beside it until they are written (`run.py`):
per split one uint8 (count, side, side) array and one flag a record, memory-mapped, so that memory
stays bounded whatever the record count, and a run killed or failed after part of the map pass
resumes where it stopped.

A store resumes only when the key it was made with is the same: the dataset's
manifest, the stage and every setting its maps depend on, and for a network's maps the network
itself (`run.py`). The refinement's checkpoints are kept the same way (`checkpoint_folder`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

KEY = "key.json"


def stamped(folder: Path, key: dict) -> bool:
    """Whether `folder` was made under `key` (its stamp, written last, says so)."""
    try:
        return json.loads((Path(folder) / KEY).read_text()) == json.loads(json.dumps(key, sort_keys=True))
    except (OSError, ValueError):
        return False


def stamp(folder: Path, key: dict) -> None:
    """Write `folder`'s stamp, whole or not at all."""
    tmp = Path(folder) / f"{KEY}.tmp"
    tmp.write_text(json.dumps(key, sort_keys=True))
    tmp.replace(Path(folder) / KEY)


def checkpoint_folder(folder: Path, key: dict) -> bool:
    """`folder` ready for checkpoints made under `key`: kept when an earlier run made it under the
    same key (returns True), else emptied and stamped (False)."""
    if stamped(folder, key):
        return True
    shutil.rmtree(folder, ignore_errors=True)
    Path(folder).mkdir()
    stamp(folder, key)
    return False


class MapStore:
    """The maps of `counts` records a split at `side` x `side`, in folder `work`.

    Args:
        work: the store's folder (replaced unless it holds a store made with `key`).
        counts: split -> records.
        side: the maps' side.
        key: what the maps depend on (JSON-serialisable).
    """

    def __init__(self, work: Path, counts: dict[str, int], side: int, key: dict) -> None:
        self.work = Path(work)
        shape = {split: (count, side, side) for split, count in counts.items()}
        if self._made_with(key, shape):
            self.maps = {s: np.load(self.work / f"{s}.npy", mmap_mode="r+") for s in counts}
            self.done = {s: np.load(self.work / f"{s}.done.npy", mmap_mode="r+") for s in counts}
            self.resumed = int(sum(int(d.sum()) for d in self.done.values()))
            return
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir()
        self.maps = {s: np.lib.format.open_memmap(self.work / f"{s}.npy", mode="w+", dtype=np.uint8, shape=shape[s])
                     for s in counts}
        self.done = {s: np.lib.format.open_memmap(self.work / f"{s}.done.npy", mode="w+", dtype=np.uint8,
                                                  shape=(counts[s],)) for s in counts}
        self.resumed = 0
        stamp(self.work, key)              # written last: a store cut short while being made is not trusted

    def _made_with(self, key: dict, shape: dict[str, tuple]) -> bool:
        if not stamped(self.work, key):
            return False
        try:
            for s, want in shape.items():
                maps = np.load(self.work / f"{s}.npy", mmap_mode="r")
                done = np.load(self.work / f"{s}.done.npy", mmap_mode="r")
                if maps.shape != want or maps.dtype != np.uint8 or done.shape != want[:1]:
                    return False
        except (OSError, ValueError):
            return False
        return True

    def todo(self, split: str) -> list[int]:
        """The records of `split` without a map yet."""
        return np.flatnonzero(self.done[split] == 0).tolist()

    def put(self, split: str, i: int, p: np.ndarray) -> None:
        """Record i's map, then its flag (so a flag never stands for a map not written)."""
        self.maps[split][i] = p
        self.done[split][i] = 1

    def flush(self) -> None:
        for a in (*self.maps.values(), *self.done.values()):
            a.flush()

    def remove(self) -> None:
        self.maps, self.done = {}, {}
        shutil.rmtree(self.work, ignore_errors=True)
