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
# index IntFields, the mask a BytesField holding a grayscale PNG (empty when no mask exists) and
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
