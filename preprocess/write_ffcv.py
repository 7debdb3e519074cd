"""FFCV's fields and its own writer: one split → one `.beton` file with the fields of
`pipelines.schema.FFCV_FIELDS`.

Datasets are not written by `write_ffcv`: every split's `.beton` is copied from its DALI shards
(`preprocess.ffcv_copy`), byte for byte what `write_ffcv` makes of the same records with one
process, and the same bytes in every run, which `write_ffcv` with several processes does not give
(each takes 64-record chunks, and where a chunk lands depends on which process asked for a page
first). `write_ffcv` is the reference the copy is tested against, and writes the tests' `.beton`
files from records held in memory.

Fields, in storage order: image (`RGBImageField`, raw bytes for mode "raw" so that pixels are
bit-exact, JPEG at `split.jpeg_quality` for mode "jpg", a record's `encoded` JPEG byte for byte;
never resized here, the size policy was applied when the records were made), label and index
(`IntField`), mask (`BytesField` holding a grayscale PNG; one zero byte when the split has no
masks, see `NO_MASK`) and coverage (`FloatField`, fraction of mask pixels >= 128,
`schema.NO_MASK_COVERAGE` without a mask).

The file is written under a temporary name and renamed into place; the caller
(`preprocess/prepare.py`) also stages the dataset folder.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines import schema
from pipelines.jit import cache_typed_dict_helpers
from pipelines.processes import before_fork
from preprocess.progress import bar as progress_bar
from preprocess.records import PreparedSplit, check_record, encode_mask_png, mask_coverage

# "No mask" is one zero byte, not zero bytes: FFCV 1.0.2 files a zero-size allocation under the same
# pointer as the next sample's image, whose reads then return nothing. Readers tell a missing mask by
# coverage == NO_MASK_COVERAGE, never by the byte count.
NO_MASK = np.zeros(1, dtype=np.uint8)
MAX_SIDE = 65535           # FFCV stores an image's width and height as uint16
PAGE_SIZE = 1 << 23        # FFCV's DatasetWriter default (4 x 2 MiB)


@dataclass(frozen=True)
class _Jpeg:
    """A JPEG to store byte for byte (`Record.encoded`), with its decoded size."""

    data: bytes
    height: int
    width: int


def _encode_passing_jpegs_through(field, destination, image, malloc) -> None:
    """`RGBImageField.encode`, except that a `_Jpeg` is stored as it is instead of re-encoded.

    Set on the field instance: FFCV records a field's type by `type(field)`, so a subclass would be
    written as an unknown type that readers cannot decode.
    """
    from ffcv.fields.rgb_image import IMAGE_MODES, RGBImageField

    if not isinstance(image, _Jpeg):
        RGBImageField.encode(field, destination, image, malloc)
        return
    destination["mode"] = IMAGE_MODES["jpg"]
    destination["height"], destination["width"] = image.height, image.width
    destination["data_ptr"], storage = malloc(len(image.data))
    storage[:] = np.frombuffer(image.data, dtype=np.uint8)


class _FFCVRecords:
    """`split[i]` as the tuple of FFCV field values, in `schema.FFCV_FIELDS` order.

    FFCV's writer workers hang forever when `__getitem__` raises (the parent waits for a sample count
    that never comes), so an error is written to `error_path` and a 1-px placeholder is returned; the
    parent reads the file after the pass and refuses the output.
    """

    def __init__(self, split: PreparedSplit, error_path: str) -> None:
        self.split = split
        self.error_path = error_path

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple:
        try:
            return self._fields(int(i))
        except Exception as e:  # noqa: BLE001 — reported to the parent through the error file
            with open(self.error_path, "a", encoding="utf-8") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            return (np.zeros((1, 1, 3), np.uint8), 0, int(i), NO_MASK, schema.NO_MASK_COVERAGE)

    def _fields(self, i: int) -> tuple:
        rec = check_record(self.split, i)
        mask = rec.mask
        check_side(i, *rec.shape)
        mask_bytes = NO_MASK if mask is None else np.frombuffer(encode_mask_png(mask), np.uint8)
        image = (np.ascontiguousarray(rec.image) if rec.encoded is None else _Jpeg(rec.encoded, *rec.shape))
        return (image, int(rec.label), i, mask_bytes, mask_coverage(mask))


def check_side(i: int, height: int, width: int) -> None:
    """Raises ValueError when record i's image is too large for FFCV's uint16 width and height."""
    if max(height, width) > MAX_SIDE:
        raise ValueError(f"record {i}: image side {max(height, width)} px exceeds FFCV's {MAX_SIDE} px; "
                         "apply a max-side size policy")


def ffcv_fields(mode: str, jpeg_quality: int) -> dict:
    """The FFCV fields of `schema.FFCV_FIELDS`, in order, for a split of image `mode`."""
    from ffcv.fields import BytesField, FloatField, IntField, RGBImageField

    image = (RGBImageField(write_mode="raw") if mode == "raw"
             else RGBImageField(write_mode="jpg", jpeg_quality=int(jpeg_quality)))
    image.encode = functools.partial(_encode_passing_jpegs_through, image)
    by_name = {schema.IMAGE: image, schema.LABEL: IntField(), schema.INDEX: IntField(),
               schema.MASK: BytesField(), schema.COVERAGE: FloatField()}
    return {name: by_name[name] for name in schema.FFCV_FIELDS}


def temporary_file(path: Path) -> tuple[int, str]:
    """A new temporary file beside `path` (descriptor, name) with the permissions any new file of this
    process gets: `mkstemp`'s own are 0600, a dataset no one else on the machine could read."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0o022)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def warm_up() -> None:
    """Import FFCV's writer and compile what every record encode uses, in this process, so that the
    processes it forks (FFCV's workers, a background copy) inherit it: an image encode looks its mode
    up in FFCV's numba typed dict, whose first lookup compiles (0.26 s per process otherwise)."""
    cache_typed_dict_helpers()              # FFCV's import fills a typed dict (pipelines/jit.py)
    import ffcv.writer  # noqa: F401
    from ffcv.fields.rgb_image import IMAGE_MODES

    IMAGE_MODES["jpg"], IMAGE_MODES["raw"]                  # noqa: B018


def write_ffcv(split: PreparedSplit, path: Path, *, num_workers: int = 1, progress: bool = False,
               page_size: int = PAGE_SIZE) -> None:
    """Write `split` to the FFCV file `path` (temporary name, then an atomic rename).

    Args:
        split: the records; `split.mode` "raw" stores pixels bit-exact, "jpg" stores JPEG at
            `split.jpeg_quality`.
        path: destination `.beton` file; its folder must exist.
        num_workers: writer processes (>= 1).
        progress: show progress (`preprocess.progress`: a bar on a terminal, a line a minute in a log).
        page_size: FFCV's page (its default, 8 MiB; a power of two >= 2 MiB).

    Raises:
        ValueError: bad mode, empty split, a bad record (the message names it), or bad num_workers.
        FileNotFoundError: the destination folder does not exist.
    """
    path = Path(path)
    if split.mode not in schema.IMAGE_MODES:
        raise ValueError(f"unknown image mode {split.mode!r}; use one of {', '.join(schema.IMAGE_MODES)}")
    if len(split) == 0:
        raise ValueError(f"split for {path.name} is empty; an FFCV file needs at least one record")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {path.parent} does not exist; create it first")

    warm_up()
    import ffcv.writer

    fields = ffcv_fields(split.mode, split.jpeg_quality)

    fd, tmp = temporary_file(path)
    os.close(fd)
    err = tmp + ".err"
    original_bar = ffcv.writer.tqdm
    try:
        # FFCV's writer always opens a tqdm bar through its module-level name: ours instead (a bar on a
        # terminal, a line a minute in a log, nothing with progress off).
        ffcv.writer.tqdm = functools.partial(progress_bar, desc=path.name, progress=progress)
        # ... and polls its workers every 0.1 s, a fifth of a small file's write: poll every 5 ms.
        ffcv.writer.sleep = lambda _seconds: time.sleep(0.005)
        before_fork()                            # FFCV forks its writer processes
        writer = ffcv.writer.DatasetWriter(tmp, fields, page_size=page_size,
                                           num_workers=min(num_workers, len(split)))
        # chunksize: workers take 64 records at a time, so small splits still spread over workers.
        before = set(mp.active_children())
        writer.from_indexed_dataset(_FFCVRecords(split, err), chunksize=64)
        for worker in set(mp.active_children()) - before:
            # FFCV does not join its writer processes: reap them here rather than leave them to exit
            # (and hold the descriptors they inherited) while this process goes on.
            worker.join(timeout=60)
        if os.path.exists(err):
            with open(err, encoding="utf-8") as f:
                first = f.readline().strip()
            raise ValueError(f"could not write {path.name}: {first}")
        os.replace(tmp, path)
    finally:
        ffcv.writer.tqdm = original_bar
        ffcv.writer.sleep = time.sleep
        for leftover in (tmp, err):
            if os.path.exists(leftover):
                os.remove(leftover)
