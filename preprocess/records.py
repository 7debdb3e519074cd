"""The records every writer consumes: one source image after the size policy, ready to store.

Sources (synthetic, CIFAR, image folders) yield `Record`s; `PreparedSplit` is the indexable,
picklable view of one split that both writers read in their parallel workers, so both formats store
the same pixels, labels and indices; `ArraySplit` is one held in memory. `check_record` is the
contract both writers hold a record to, and `mask_coverage` the one definition of the coverage
stored with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import cv2
import numpy as np

from pipelines import schema
from pipelines.shards import coverage_ppm


@dataclass(frozen=True)
class Record:
    """One stored sample."""

    image: np.ndarray | None       # (H, W, 3) uint8 RGB, after the size policy; None only when
                                   # `encoded` and `size` are given (bytes copied between files)
    label: int                     # 0 <= label < num_classes
    index: int                     # 0 <= index < len(split), unique within the split
    mask: np.ndarray | None = None # (H, W) uint8 {0, 255} saliency mask, same geometry, or None
    encoded: bytes | None = None   # mode "jpg" only: the image's JPEG bytes, stored as they are
                                   # (no re-encode); `image`, when given, must be their decoded pixels
    size: tuple[int, int] | None = None   # (H, W) of `encoded` when `image` is None

    @property
    def shape(self) -> tuple[int, int]:
        """(H, W) of the stored image."""
        return tuple(self.image.shape[:2]) if self.image is not None else tuple(self.size)


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


@dataclass
class ArraySplit:
    """A `PreparedSplit` held in memory as arrays (CIFAR, and synthetic once generated); mode "raw"."""

    images: np.ndarray                 # (N, H, W, 3) uint8
    labels: np.ndarray                 # (N,) int64
    masks: np.ndarray | None = None    # (N, H, W) uint8 {0, 255} written into the mask field
    mode: str = "raw"
    jpeg_quality: int = schema.JPEG_QUALITY

    @property
    def has_masks(self) -> bool:
        return self.masks is not None

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Record:
        i = int(i)
        return Record(image=self.images[i], label=int(self.labels[i]), index=i,
                      mask=None if self.masks is None else self.masks[i])


def check_record(split: PreparedSplit, i: int) -> Record:
    """`split[i]`, checked against what both writers rely on.

    Args:
        split: the split being written.
        i: record position, 0 <= i < len(split).

    Returns:
        The record; its `mask` is None exactly when `split.has_masks` is False (a mask the split
        does not declare is dropped), else a (H, W) array matching the image.

    Raises:
        ValueError: the record's index is not i, its image is not uint8 (H, W, 3), or its mask is
            missing or shaped unlike the image (the message names record i).
    """
    rec = split[i]
    if rec.index != i:
        raise ValueError(f"record {i} carries index {rec.index}; PreparedSplit[i] must have index i")
    img = rec.image
    if img is None:
        if rec.encoded is None or rec.size is None:
            raise ValueError(f"record {i} has no image; give its pixels, or its encoded bytes and size")
    elif img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"record {i}: image must be uint8 (H, W, 3), got {img.dtype} {img.shape}")
    if rec.encoded is not None and split.mode != "jpg":
        raise ValueError(f"record {i} carries encoded bytes but the split's mode is {split.mode!r}; "
                         "only JPEG (mode 'jpg') is stored as given")
    if not split.has_masks:
        return rec if rec.mask is None else replace(rec, mask=None)
    if rec.mask is None:
        raise ValueError(f"record {i} has no mask but the split declares has_masks=True; "
                         "give every record a mask")
    if rec.mask.shape != rec.shape:
        raise ValueError(f"record {i}: mask shape {rec.mask.shape} differs from image {rec.shape}")
    return rec


def pixel_sums(images: np.ndarray) -> np.ndarray:
    """Per-channel rows [sum, sum of squares, count] in [0, 1] units of uint8 RGB pixels, a (3, 3)
    float64 array; sums of these over images give the dataset's mean and std (`mean_std`).

    Args:
        images: (H, W, 3) or (N, H, W, 3) uint8.
    """
    flat = np.ascontiguousarray(images).reshape(-1, images.shape[-2], 3)      # one tall image
    mean, std = (v[:, 0] for v in cv2.meanStdDev(flat))         # float64, ~50x faster than numpy
    n = flat.shape[0] * flat.shape[1]
    return np.stack([mean * n / 255.0, (std * std + mean * mean) * n / 255.0 ** 2, np.full(3, float(n))])


def mean_std(sums: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) per channel from summed `pixel_sums` rows."""
    mean = sums[0] / sums[2]
    std = np.sqrt(np.maximum(sums[1] / sums[2] - mean ** 2, 0.0))
    return tuple(float(x) for x in mean), tuple(float(x) for x in std)


def encode_mask_png(mask: np.ndarray) -> bytes:
    """A (H, W) uint8 mask as grayscale PNG bytes (lossless, compression level 1): the mask of both
    formats, the FFCV `mask` field and the DALI shards' `<key>.mask.png` (one encoder, the same bytes).

    Raises:
        ValueError: a mask OpenCV cannot encode (not (H, W) uint8).
    """
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(mask, dtype=np.uint8), [int(cv2.IMWRITE_PNG_COMPRESSION), 1])
    if not ok:
        raise ValueError("could not PNG-encode a mask; masks must be (H, W) uint8")
    return buf.tobytes()


def mask_coverage(mask: np.ndarray | None) -> float:
    """Fraction of mask pixels >= 128, in [0, 1] rounded to parts per million as the shards store it
    (so the FFCV file, copied from them or not, holds the same value), or `schema.NO_MASK_COVERAGE`
    without a mask.

    Args:
        mask: (H, W) uint8 mask, or None.
    """
    if mask is None:
        return schema.NO_MASK_COVERAGE
    return coverage_ppm(float(np.mean(mask >= 128))) / 1_000_000
