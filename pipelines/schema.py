"""The on-disk format of a viewmill dataset: the single source of field names, dtypes and version.

Writers (`preprocess/`) and readers (`pipelines/*_backend.py`) both import this module, so a
renamed field breaks a test rather than a training run.

Layout of one dataset, `<root>/<dataset>/`:

    manifest.json                  written last and atomically; a dataset without it is incomplete
    <split>.beton                  FFCV file: fields FFCV_FIELDS, in that order
    <split>/shard-NNNNNN.tar       DALI webdataset shards, members `<key>.<ext>` for ext in DALI_EXT
    <split>/shard-NNNNNN.idx       DALI index file of the shard (`wds2idx` format)
    <split>/records.npy            the split's record table, (N, 8) int64 (`shards.TABLE_COLUMNS`), so
                                   that a reader maps it instead of reading every `.rec` member
    <split>/names.txt              image folders: record i's source file (line i, UTF-8), relative to
                                   the source folder, so that published subsets (ImageNet's 1 % / 10 %
                                   label lists) select records by name
    gt_masks/<split>.npy           synthetic only: exact foreground masks (N, H, W) uint8 {0, 255},
                                   kept for saliency evaluation, never read by training

`key` is the record index zero-padded to KEY_DIGITS digits, so a shard's members sort by index.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

SCHEMA_VERSION = 1          # bump on any change a reader of the old version would misread
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")

# Record fields (one record = one source image).
IMAGE = "image"             # uint8 HWC RGB
LABEL = "label"             # int, 0 <= label < num_classes, or NO_LABEL in an unlabelled dataset
NO_LABEL = -1
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
RECORDS_NAME = "records.npy"
NAMES_NAME = "names.txt"
INDEX_PATTERN = "shard-{:06d}.idx"

# Image encoding policy.
IMAGE_MODES = ("jpg", "raw")  # raw: bit-exact (FFCV raw, DALI PNG); jpg: lossy at JPEG_QUALITY
JPEG_QUALITY = 90
MAX_SIDE_PX = 512             # default cap for imagefolder sources (see preprocess CLI)


def record_key(index: int) -> str:
    """The webdataset key of record `index` (zero-padded so that keys sort by index)."""
    return f"{index:0{KEY_DIGITS}d}"


INDEX_VERSION = "v1.2"      # the `wds2idx` format: "v1.2 <records>", then per record "ext offset size name ..."


def read_index(idx_path: str | os.PathLike) -> list[dict[str, tuple[int, int]]]:
    """The records of a shard from its index file: per record {ext: (offset, size)} of its members
    inside the tar, in the shard's order."""
    lines = Path(idx_path).read_text(encoding="ascii").splitlines()
    records = []
    for line in lines[1:]:
        f = line.split()
        records.append({f[k]: (int(f[k + 1]), int(f[k + 2])) for k in range(0, len(f), 4)})
    return records


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
VERIFY_MODES = ("stamp", "full", "size")


class DatasetError(ValueError):
    """A dataset folder a reader must refuse; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Manifest:
    """`manifest.json`: what a dataset folder holds; written by `preprocess`, read by every loader.

    `to_json` / `from_json` are the only code that knows the JSON layout; `num_classes` and `labelled`
    are written into the JSON too (for other tools) but derived from `class_names` here.
    """

    schema_version: int                    # SCHEMA_VERSION of the writer
    dataset: str                           # folder name under the data root
    source: str                            # source kind: synthetic | cifar10 | cifar100 | imagefolder
    counts: dict[str, int]                 # records per split
    class_names: tuple[str, ...]           # label i is class_names[i]
    image_mode: str                        # one of IMAGE_MODES
    image_px: int                          # largest stored image side, px
    has_masks: bool                        # every record has a saliency mask
    mean: tuple[float, float, float]       # per-channel mean of the train split, [0, 1] units
    std: tuple[float, float, float]        # per-channel std of the train split, [0, 1] units
    files: dict[str, dict]                 # relpath -> {"sha256": hex, "bytes": int}
    params: dict = field(default_factory=dict)        # the source's parameters (seed, sizes, src, ...)
    skipped: tuple[dict, ...] = ()                    # unreadable source files: {"path", "reason"}
    jpeg_quality: int | None = None                   # JPEG quality when image_mode is "jpg"
    size_policy: dict | None = None                   # {"side", "max_side_px"} of image folders
    mask_source: str | None = None                    # where the masks came from, None without masks
    saliency: dict = field(default_factory=dict)      # computed masks: methods, parameters, stage scores
    gt_masks: dict[str, str] = field(default_factory=dict)   # split -> relpath of exact masks (synthetic)
    formats: dict = field(default_factory=dict)       # {"ffcv": {split: file}, "dali": {split: [tars]}}
    shard_size: int | None = None                     # records per DALI shard
    build: dict = field(default_factory=dict)         # workers and seconds per stage
    created_at: str = ""                              # ISO time of writing

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def labelled(self) -> bool:
        """Whether the records carry class labels (an unlabelled dataset has no classes and every
        label is NO_LABEL)."""
        return self.num_classes > 0

    def to_json(self) -> bytes:
        """The manifest file's bytes (indented JSON, keys in field order, `num_classes` and `labelled`
        added)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["num_classes"], d["labelled"] = self.num_classes, self.labelled
        return (json.dumps(d, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes | str, where: str | os.PathLike = MANIFEST_NAME) -> "Manifest":
        """Parse and check a manifest file's content.

        Raises:
            DatasetError: not a JSON object, no integer schema_version, a version newer than this
                code, or a missing required key (the message names `where` and the fix).
        """
        redo = "re-write the dataset (make preprocess ARGS=--force)"
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise DatasetError(f"{where} is not valid JSON ({e}): {redo}") from None
        if not isinstance(d, dict):
            raise DatasetError(f"{where} is not a JSON object: {redo}")
        version = d.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise DatasetError(f"{where} has no integer schema_version: {redo}")
        if version > SCHEMA_VERSION:
            raise DatasetError(f"{where} has schema_version {version}, newer than this code's {SCHEMA_VERSION}: "
                               f"upgrade viewmill, or {redo} with this version")
        names = {f.name: f for f in fields(cls)}
        required = [n for n, f in names.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise DatasetError(f"{where} lacks {', '.join(missing)}: {redo}")
        kw = {k: v for k, v in d.items() if k in names}
        kw.update(class_names=tuple(d["class_names"]), mean=tuple(d["mean"]), std=tuple(d["std"]),
                  skipped=tuple(d.get("skipped", ())))
        return cls(**kw)


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


def read_stamp(dataset_dir: Path, manifest_sha256: str) -> dict[str, list[int]]:
    """The files the verification stamp says match the manifest whose sha256 is `manifest_sha256`
    ({} without a stamp for that manifest)."""
    try:
        stamp = json.loads((dataset_dir / VERIFIED_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stamp, dict) or stamp.get("manifest_sha256") != manifest_sha256:
        return {}
    files = stamp.get("files")
    return files if isinstance(files, dict) else {}


def read_manifest(dataset_dir: str | os.PathLike, *, verify: str = "stamp") -> Manifest:
    """Read and verify `<dataset_dir>/manifest.json`; refuse an incomplete or damaged dataset.

    Args:
        dataset_dir: the dataset folder, `<root>/<dataset>`.
        verify: "stamp" (default): sizes always, sha256 of files whose (size, mtime_ns) changed
            since the last verification; "full": re-hash every file; "size": sizes only.

    Returns:
        The `Manifest`.

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
    manifest = Manifest.from_json(raw, path)
    manifest_sha = hashlib.sha256(raw).hexdigest()
    stamp = read_stamp(dataset_dir, manifest_sha) if verify == "stamp" else {}
    verified: dict[str, list[int]] = {}
    rehashed = False
    for rel, info in sorted(manifest.files.items()):
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
