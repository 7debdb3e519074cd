"""Write saliency masks into a dataset folder `make preprocess` wrote: the FFCV `mask` and `coverage`
fields and `<key>.mask.png` with the coverage in each record's `.rec` of the DALI shards.

The dataset is rewritten through the same writers and the same staging, manifest-last and swap
steps as `preprocess/prepare.py`, so an interrupted run leaves the previous dataset and its manifest
valid. Records are read back from the DALI shards: JPEG images are stored again byte for byte
(`Record.encoded`, never decoded) and the `.beton` copied from the new shards (`preprocess.ffcv_copy`),
lossless ones decoded and re-encoded losslessly by both writers; labels, indices, the ground-truth
masks of `synthetic` and the records' file names of image folders are kept. Masks arrive as
probability maps (uint8, 0-255) of any size per record; each is resized bilinearly to its stored
image and binarised at 0.5 (the DeepUSPS convention), so the mask has exactly the image's geometry.
"""

from __future__ import annotations

import io
import shutil
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from pipelines import schema
from pipelines.shards import ShardReader, image_size
from preprocess.ffcv_copy import copy_to_ffcv
from preprocess.prepare import Hashed, Known, PreprocessError, ffcv_installed, remove_quietly, write_staged
from preprocess.records import Record
from preprocess.saliency.handcrafted import resize_map
from preprocess.write_dali import write_dali


def binarise(prob: np.ndarray, height: int, width: int) -> np.ndarray:
    """A probability map (uint8 0-255 or float [0, 1], any size) as a {0, 255} mask of (height, width):
    bilinear resize of the probabilities, then >= 0.5."""
    p = resize_map(prob.astype(np.float32) / (255.0 if prob.dtype == np.uint8 else 1.0), (height, width))
    return np.where(p >= 0.5, 255, 0).astype(np.uint8)


@dataclass
class StoredSplit:
    """A `PreparedSplit` over one split of a written dataset, with new masks: record i is read from
    the DALI shards and gets `binarise(masks(i))`."""

    split_dir: Path
    count: int
    mode: str
    masks: Callable[[int], np.ndarray]
    jpeg_quality: int = schema.JPEG_QUALITY
    has_masks: bool = True

    def __post_init__(self) -> None:
        self._reader = ShardReader.open(self.split_dir, self.count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Record:
        i = int(i)
        data = self._reader.image(i)
        label = int(self._reader.labels[i])
        if self.mode == "jpg":                         # stored again as it is: only its size is read
            rec = Record(image=None, label=label, index=i, encoded=data, size=image_size(data))
        else:
            rec = Record(image=np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), label=label, index=i)
        return replace(rec, mask=binarise(self.masks(i), *rec.shape))


def write_masks(dataset_dir: Path, masks: dict[str, Callable[[int], np.ndarray]], saliency: dict, *,
                workers: int = 1, progress: bool = False) -> schema.Manifest:
    """Rewrite `dataset_dir` with a mask for every record of every split.

    Args:
        dataset_dir: a complete dataset folder.
        masks: split -> (record index -> probability map); every split of the dataset.
        saliency: what made the masks (methods, parameters, scores), recorded in the manifest.
        workers: writer processes.
        progress: the writers' progress (a bar on a terminal, a line a minute in a log).

    Returns:
        The new manifest.

    Raises:
        PreprocessError: a split without masks, or a failed write (the dataset is then unchanged).
    """
    dataset_dir = Path(dataset_dir)
    old = schema.read_manifest(dataset_dir, verify="size")
    missing = sorted(set(old.counts) - set(masks))
    if missing:
        raise PreprocessError(f"no masks for split(s) {', '.join(missing)} of {dataset_dir.name}; "
                              "compute masks for every split")
    staging = dataset_dir.with_name(f".{dataset_dir.name}.staging")
    remove_quietly(staging)
    t0 = time.perf_counter()
    with_ffcv = ffcv_installed() and "ffcv" in old.formats
    if "ffcv" in old.formats and not with_ffcv:
        print("ffcv is not installed: the masks go into the DALI shards only and the .beton files are dropped "
              "(pip install 'viewmill[ffcv]', then make saliency again, keeps them)", file=sys.stderr)

    def fill(staging: Path) -> Known:
        copied = Known()                                    # the .beton files hashed as they were copied
        for split, count in old.counts.items():
            quality = old.jpeg_quality or schema.JPEG_QUALITY
            stored = StoredSplit(dataset_dir / split, count, old.image_mode, masks[split], jpeg_quality=quality)
            write_dali(stored, staging / split, shard_size=old.shard_size or count, num_workers=workers,
                       progress=progress)
            if with_ffcv:                                   # the new shards copied: no mask made twice
                copied.known[f"{split}.beton"] = copy_to_ffcv(
                    ShardReader.open(staging / split, count), staging / f"{split}.beton", has_masks=True,
                    mode=old.image_mode, jpeg_quality=quality, num_workers=workers, progress=progress)
        names = [f"{split}/{schema.NAMES_NAME}" for split in old.counts]      # image folders' record names
        kept = [*old.gt_masks.values(), *(rel for rel in names if (dataset_dir / rel).exists())]
        for rel in kept:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(dataset_dir / rel, staging / rel)
        return copied

    def manifest_of(_: Known, hashed: Hashed) -> schema.Manifest:
        build = {**old.build, "saliency_write_seconds": round(time.perf_counter() - t0, 3)}
        formats = old.formats if with_ffcv else {k: v for k, v in old.formats.items() if k != "ffcv"}
        return replace(old, files=hashed.files, formats=formats, has_masks=True, mask_source="saliency", saliency=saliency,
                       build=build, created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))

    manifest = write_staged(staging, dataset_dir, fill, manifest_of,
                            f"writing masks into {dataset_dir} failed ({{what}}); the dataset is unchanged: "
                            "free space and re-run make saliency")
    return manifest
