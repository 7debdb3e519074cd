"""The on-disk format of a viewmill dataset: the single source of field names, dtypes and version.

Writers (`preprocess/`) and readers (`pipelines/*_backend.py`) both import this module, so a
renamed field breaks a test rather than a training run.

Layout of one dataset, `<root>/<dataset>/`:

    manifest.json                  written last and atomically; a dataset without it is incomplete
    <split>.beton                  FFCV file: fields FFCV_FIELDS, in that order
    <split>/shard-NNNNNN.tar       DALI webdataset shards, members `<key>.<ext>` for ext in DALI_EXT
    <split>/shard-NNNNNN.idx       DALI index file of the shard (`wds2idx` format)
    gt_masks/<split>.npy           synthetic only: exact foreground masks (N, H, W) uint8 {0, 255},
                                   kept for saliency evaluation, never read by training

`key` is the record index zero-padded to KEY_DIGITS digits, so a shard's members sort by index.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SCHEMA_VERSION = 1          # bump on any change a reader of the old version would misread
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")

# Record fields (one record = one source image).
IMAGE = "image"             # uint8 HWC RGB
LABEL = "label"             # int, 0 <= label < num_classes
INDEX = "index"             # int, position of the record in its split, 0 <= index < count
MASK = "mask"               # uint8 HW {0, 255}, same geometry as the stored image; saliency mask
COVERAGE = "coverage"       # float32, fraction of mask pixels >= 128; NO_MASK_COVERAGE when absent
NO_MASK_COVERAGE = -1.0

# FFCV .beton fields, in storage order. The image is an RGBImageField (JPEG or raw), label and
# index IntFields, the mask a BytesField holding a grayscale PNG (a single zero byte when no mask
# exists: FFCV 1.0.2 aliases empty allocations with the next field; tell "no mask" by coverage) and
# the coverage a FloatField.
FFCV_FIELDS = (IMAGE, LABEL, INDEX, MASK, COVERAGE)

# DALI webdataset members of one record.
KEY_DIGITS = 9
DALI_IMAGE_EXT = "jpg;png"  # JPEG when encoded lossy, PNG for raw (lossless) datasets
DALI_LABEL_EXT = "cls"      # ASCII decimal label, the webdataset convention (for other tools)
DALI_RECORD_EXT = "rec"     # little-endian int64 [label, index, coverage in parts per million or -1]
DALI_MASK_EXT = "mask.png"  # grayscale PNG, present only once masks exist
SHARD_PATTERN = "shard-{:06d}.tar"
INDEX_PATTERN = "shard-{:06d}.idx"

# Image encoding policy.
IMAGE_MODES = ("jpg", "raw")  # raw: bit-exact (FFCV raw, DALI PNG); jpg: lossy at JPEG_QUALITY
JPEG_QUALITY = 90
MAX_SIDE_PX = 512             # default cap for imagefolder sources (see preprocess CLI)


def record_key(index: int) -> str:
    """The webdataset key of record `index` (zero-padded so that keys sort by index)."""
    return f"{index:0{KEY_DIGITS}d}"


# ---------------------------------------------------------------------------------------------
# Manifest reading and verification (readers call `read_manifest` before opening any file).
#
# Verification policy. Every open checks that every listed file exists with its recorded size
# (cheap: one stat per file). The sha256 of a file is re-computed only when the file's
# (size, mtime_ns) differs from the stamp `VERIFIED_NAME` that records the last full verification
# against this exact manifest; `preprocess` writes that stamp from the checksums it computes while
# writing, so a fresh dataset is never re-hashed (re-hashing a 140 GB ImageNet on every open is
# not acceptable). A file rewritten in place with the same size and a preserved mtime_ns is caught
# only by `read_manifest(..., verify="full")`, which re-hashes everything and refreshes the stamp.
# ---------------------------------------------------------------------------------------------


VERIFIED_NAME = ".verified.json"    # stamp: manifest sha256 + {relpath: [bytes, mtime_ns]}
MANIFEST_KEYS = ("schema_version", "dataset", "counts", "class_names", "num_classes", "image_mode",
                 "has_masks", "mean", "std", "image_px", "files", "source", "params", "skipped")
VERIFY_MODES = ("stamp", "full", "size")


class DatasetError(ValueError):
    """A dataset folder a reader must refuse; the message is one line naming the problem and the fix."""


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def file_stat_key(path: str | os.PathLike) -> list[int]:
    """[bytes, mtime_ns] of a file: what the verification stamp records."""
    st = os.stat(path)
    return [int(st.st_size), int(st.st_mtime_ns)]


def write_verified_stamp(dataset_dir: str | os.PathLike, manifest_sha256: str,
                         files: dict[str, list[int]]) -> None:
    """Atomically write the stamp saying `files` (relpath → [bytes, mtime_ns]) match the manifest."""
    dataset_dir = Path(dataset_dir)
    tmp = dataset_dir / f".{VERIFIED_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"manifest_sha256": manifest_sha256, "files": files}))
    os.replace(tmp, dataset_dir / VERIFIED_NAME)


def _read_stamp(dataset_dir: Path, manifest_sha256: str) -> dict[str, list[int]]:
    try:
        stamp = json.loads((dataset_dir / VERIFIED_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stamp, dict) or stamp.get("manifest_sha256") != manifest_sha256:
        return {}
    files = stamp.get("files")
    return files if isinstance(files, dict) else {}


def read_manifest(dataset_dir: str | os.PathLike, *, verify: str = "stamp") -> dict:
    """Read and verify `<dataset_dir>/manifest.json`; refuse an incomplete or damaged dataset.

    Args:
        dataset_dir: the dataset folder, `<root>/<dataset>`.
        verify: "stamp" (default): sizes always, sha256 of files whose (size, mtime_ns) changed
            since the last verification; "full": re-hash every file; "size": sizes only.

    Returns:
        The manifest dict: schema_version, dataset, counts {split: n}, class_names, num_classes,
        image_mode, has_masks, mean, std (per channel, [0, 1] units, train split), image_px,
        files {relpath: {sha256, bytes}}, source, params, skipped [{path, reason}], and more
        (size_policy, jpeg_quality, created_at, ...).

    Raises:
        DatasetError: no manifest (incomplete dataset), unreadable manifest, schema version newer
            than this code, a missing file, or a size / checksum mismatch.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"unknown verify mode {verify!r}; use one of {', '.join(VERIFY_MODES)}")
    dataset_dir = Path(dataset_dir)
    redo = f"run `python -m preprocess --dataset <name> --out {dataset_dir.parent} --force` (make preprocess)"
    path = dataset_dir / MANIFEST_NAME
    if not dataset_dir.is_dir():
        raise DatasetError(f"dataset folder {dataset_dir} does not exist: run make preprocess "
                           f"(python -m preprocess --dataset <name> --out {dataset_dir.parent}) first")
    if not path.is_file():
        raise DatasetError(f"dataset {dataset_dir} is incomplete (no {MANIFEST_NAME}; an earlier run was "
                           f"interrupted or is still running): run make preprocess ({redo})")
    raw = path.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise DatasetError(f"{path} is not valid JSON ({e}): {redo}") from None
    if not isinstance(manifest, dict):
        raise DatasetError(f"{path} is not a JSON object: {redo}")
    version = manifest.get("schema_version")
    if not isinstance(version, int):
        raise DatasetError(f"{path} has no integer schema_version: {redo}")
    if version > SCHEMA_VERSION:
        raise DatasetError(f"{path} has schema_version {version}, newer than this code's {SCHEMA_VERSION}: "
                           f"upgrade viewmill, or re-write the dataset with this version ({redo})")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise DatasetError(f"{path} lacks {', '.join(missing)}: {redo}")
    manifest_sha = hashlib.sha256(raw).hexdigest()
    stamp = _read_stamp(dataset_dir, manifest_sha) if verify == "stamp" else {}
    verified: dict[str, list[int]] = {}
    rehashed = False
    for rel, info in sorted(manifest["files"].items()):
        f = dataset_dir / rel
        if not f.is_file():
            raise DatasetError(f"{f} listed in {MANIFEST_NAME} is missing: {redo}")
        key = file_stat_key(f)
        if key[0] != info["bytes"]:
            raise DatasetError(f"{f} has {key[0]} bytes, the manifest says {info['bytes']} (damaged or "
                               f"replaced file): {redo}")
        if verify == "size" or (verify == "stamp" and stamp.get(rel) == key):
            verified[rel] = key
            continue
        if sha256_file(f) != info["sha256"]:
            raise DatasetError(f"{f} fails its sha256 check against {MANIFEST_NAME} (damaged or replaced "
                               f"file): {redo}")
        verified[rel] = key
        rehashed = True
    if rehashed:
        try:
            write_verified_stamp(dataset_dir, manifest_sha, verified)
        except OSError:
            pass    # read-only dataset: verification still happened, it just is not remembered
    return manifest
