"""The `.beton` file of a split whose shards are written, copied from the shards by several processes
at once, byte for byte the file FFCV's own writer makes from the same records with one process.

FFCV's writer (`preprocess/write_ffcv.py`) runs each record through its field encoders in worker
processes that take the file's pages in turn and wait for each other to write them in order. For
bytes already encoded that is all overhead: one process copied faster than two, about 100 µs a
record, and it was the serial part of preprocessing an image folder (docs/measured.md). Here the place
of every byte is computed first, from the records' sizes in the shards' record table, exactly as
FFCV's allocator places it with one worker (`plan`); then processes write disjoint runs of pages at
once, a page's pieces in one gathered, positioned write (`copy_to_ffcv`), while this process hashes
the pages already written for the manifest.

The layout of a `.beton` (FFCV 1.0.2: ffcv/writer.py, ffcv/memory_allocator.py, ffcv/types.py):

    header (HeaderType: version, fields, page size, records, where the allocation table starts)
    field descriptors (FieldDescType, one per field of `schema.FFCV_FIELDS`)
    metadata (one row a record: the image's mode, width, height and pointer; label; index; the
              mask's pointer and size; coverage)
    zeros up to a page boundary
    pages of `page_size` bytes: each record's image bytes, then its mask bytes, packed in record
              order from the start of a page, the rest of the page zeros. A record's allocation that
              does not fit in what is left of the page opens the next page; when its image fitted
              but its mask did not, FFCV's allocator retries the whole record on the new page and
              the image bytes it had already copied stay behind on the old page, unreferenced ("a
              stray copy"), which this copy reproduces so that the files are equal.
    the allocation table (ALLOC_TABLE_TYPE: record, pointer, size of every allocation kept)

A "jpg" split's images are copied as they are. A "raw" split's `.beton` stores pixels (H x W x 3 bytes
each) where its shards hold lossless PNGs: its images are decoded on the way, its sizes read first. FFCV's
writer with several processes places each 64-record chunk of a split where its process happened to be
when it asked for a page: the same records read back, but not the same bytes (3 different files in 3
runs of a 50,000-record split with 2 processes); the copy's are the same in every run.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines import schema
from pipelines.processes import fork_context
from pipelines.shards import ShardReader, image_size
from preprocess.progress import bar as progress_bar
from preprocess.write_ffcv import MAX_SIDE, NO_MASK, PAGE_SIZE, check_side, ffcv_fields, temporary_file, warm_up

_IMAGE, _MASK = 0, 1       # what a piece of a page holds
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else -1        # buffers one pwritev takes
_IOV_MAX = _IOV_MAX if _IOV_MAX > 0 else 16                                    # (-1: not stated; 16, the least POSIX allows)


@dataclass
class Layout:
    """Where `plan` puts every byte of a split's records."""

    data_start: int            # file offset of page 0
    page_size: int
    pages: int
    image_ptr: np.ndarray      # (N,) uint64 file offset of each record's image
    mask_ptr: np.ndarray       # (N,) uint64 file offset of each record's mask (or its one zero byte)
    table: np.ndarray          # FFCV's allocation table, in allocation order
    # Every copy into the file, sorted by pointer (pages are then runs of consecutive pieces):
    piece_record: np.ndarray   # (P,) int64 record
    piece_kind: np.ndarray     # (P,) int8 _IMAGE or _MASK (the mask, or the one zero byte without)
    piece_ptr: np.ndarray      # (P,) int64 file offset
    piece_size: np.ndarray     # (P,) int64 bytes

    @property
    def table_ptr(self) -> int:
        """File offset of the allocation table: right after the last page."""
        return self.data_start + self.pages * self.page_size

    @property
    def file_size(self) -> int:
        return self.table_ptr + self.table.nbytes

    def page_of(self, ptr: np.ndarray) -> np.ndarray:
        return (np.asarray(ptr, np.int64) - self.data_start) // self.page_size


def plan(image_sizes: np.ndarray, mask_sizes: np.ndarray, data_start: int, page_size: int = PAGE_SIZE) -> Layout:
    """Place each record's image (`image_sizes[i]` bytes) and then its mask (`mask_sizes[i]`) as FFCV's
    `MemoryAllocator` does with one worker, from `data_start` rounded up to a page.

    Raises:
        ValueError: an allocation larger than a page (the message names the record).
    """
    from ffcv.types import ALLOC_TABLE_TYPE

    start = -(-data_start // page_size) * page_size
    n = len(image_sizes)
    offsets = []                                # each record's image, past `start`
    strays = []                                 # (record, pointer) of each image copy left behind
    page, used = -1, page_size                  # no page yet: nothing left in it
    for i, (a, b) in enumerate(zip(np.asarray(image_sizes).tolist(), np.asarray(mask_sizes).tolist())):
        if a + b > page_size - used:
            if a + b > page_size:               # FFCV's writer fails on it too (its retry cannot fit)
                raise ValueError(f"record {i} takes {a + b:,} bytes, more than FFCV's page of {page_size:,}; "
                                 "apply a max-side size policy")
            if a <= page_size - used:           # the image fits, the mask does not: retried on a new page
                strays.append((i, start + page * page_size + used))
            page, used = page + 1, 0
        offsets.append(page * page_size + used)
        used += a + b
    image_ptr = np.array(offsets, np.uint64) + np.uint64(start)
    mask_ptr = image_ptr + np.asarray(image_sizes, np.uint64)
    table = np.zeros(2 * n, ALLOC_TABLE_TYPE)
    table["sample_id"] = np.repeat(np.arange(n), 2)
    table["ptr"][0::2], table["ptr"][1::2] = image_ptr, mask_ptr
    table["size"][0::2], table["size"][1::2] = image_sizes, mask_sizes
    stray = np.array(strays, np.int64).reshape(-1, 2)
    record = np.concatenate([np.arange(n), np.arange(n), stray[:, 0]])
    kind = np.concatenate([np.full(n, _IMAGE, np.int8), np.full(n, _MASK, np.int8), np.full(len(stray), _IMAGE, np.int8)])
    ptr = np.concatenate([image_ptr.astype(np.int64), mask_ptr.astype(np.int64), stray[:, 1]])
    size = np.concatenate([image_sizes, mask_sizes, np.asarray(image_sizes)[stray[:, 0]]]).astype(np.int64)
    order = np.argsort(ptr, kind="stable")
    return Layout(start, page_size, page + 1, image_ptr, mask_ptr, table, record[order], kind[order], ptr[order],
                  size[order])


# ------------------------------------------------------------------------------------------------
# The processes: each writes runs of whole pages.
# ------------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(reader: ShardReader, layout: Layout, has_masks: bool, path: str, read_sizes: bool,
                 pixels: bool) -> None:
    _WORKER.update(reader=reader, layout=layout, has_masks=has_masks, path=path, read_sizes=read_sizes,
                   pixels=pixels)


def _pixels(png: bytes) -> bytes:
    """A "raw" record's image as FFCV's writer stores it: its (H, W, 3) uint8 RGB pixels, row by row
    (OpenCV, which FFCV needs: 36 µs a 32-px PNG where PIL took 61-73)."""
    import cv2

    return cv2.cvtColor(cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB).tobytes()


def _write_run(fd: int, buffers: list[bytes], offset: int) -> None:
    """Write `buffers` back to back from `offset`: `_IOV_MAX` of them a call (a page of small records
    holds thousands), a short write finished by `pwrite` (a full disk raises there)."""
    for k in range(0, len(buffers), _IOV_MAX):
        part = buffers[k:k + _IOV_MAX]
        size, done = sum(map(len, part)), os.pwritev(fd, part, offset)
        rest = memoryview(b"".join(part))[done:] if done < size else b""
        while rest:
            n = os.pwrite(fd, rest, offset + size - len(rest))
            rest = rest[n:]
        offset += size


def _write_pages(span: tuple[int, int]) -> tuple[int, np.ndarray]:
    """Write the pieces `span` (whole pages); returns how many records' images it wrote and, when the
    sizes are read here, their rows (record, H, W)."""
    reader, layout = _WORKER["reader"], _WORKER["layout"]
    lo, hi = span
    records, kinds = layout.piece_record[lo:hi].tolist(), layout.piece_kind[lo:hi].tolist()
    ptrs, lengths = layout.piece_ptr[lo:hi].tolist(), layout.piece_size[lo:hi].tolist()
    pages = layout.page_of(layout.piece_ptr[lo:hi]).tolist()
    sizes: list[tuple[int, int, int]] = []
    images = 0
    fd = os.open(_WORKER["path"], os.O_WRONLY | os.O_CLOEXEC)
    try:
        run: list[bytes] = []
        for j, (rec, kind, ptr, length) in enumerate(zip(records, kinds, ptrs, lengths)):
            if kind == _IMAGE:
                data = _pixels(reader.image(rec)) if _WORKER["pixels"] else reader.image(rec)
                if ptr == int(layout.image_ptr[rec]):                 # not a stray copy
                    images += 1
                    if _WORKER["read_sizes"]:
                        h, w = image_size(data)
                        check_side(rec, h, w)
                        sizes.append((rec, h, w))
            elif kind == _MASK and _WORKER["has_masks"]:
                data = reader.mask(rec)
            else:
                data = NO_MASK.tobytes()
            if len(data) != length:                                     # a read past a shard's end
                shard = reader.shards[int(reader.cols[rec, 0])]
                raise ValueError(f"record {rec}: {os.path.basename(shard)} holds {len(data)} of its {length} "
                                 "bytes (the shard is damaged or was changed); write the dataset again with --force")
            if not run:
                first = ptr
            run.append(data)
            if j + 1 == len(records) or pages[j + 1] != pages[j]:      # the page is complete
                _write_run(fd, run, first)
                run = []
    finally:
        os.close(fd)
        reader.close()
    return images, np.array(sizes, np.int64).reshape(-1, 3)


def _spans(layout: Layout, parts: int) -> list[tuple[int, int]]:
    """The pieces cut into about `parts` runs of whole pages of about equal bytes."""
    pages = layout.page_of(layout.piece_ptr)
    bounds = np.searchsorted(pages, np.linspace(0, layout.pages, parts + 1).round().astype(np.int64))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def copy_to_ffcv(reader: ShardReader, path: Path, *, sizes: np.ndarray | None = None, has_masks: bool = False,
                 mode: str = "jpg", jpeg_quality: int = schema.JPEG_QUALITY, num_workers: int = 1,
                 progress: bool = False, page_size: int = PAGE_SIZE) -> dict:
    """Write the FFCV file `path` of the records `reader` reads, equal byte for byte to
    `write_ffcv(split, path, num_workers=1, page_size=page_size)` of the same records; under a
    temporary name, renamed into place when whole. Returns the file's checksum as the manifest records
    it, {"sha256", "bytes"}: with `sizes` given, each run of pages is hashed as soon as it is written, while the processes
    write the next ones (for ILSVRC-2012's ~140 GB a sequential hash after the copy would be minutes).

    Args:
        reader: the split's shards (records in index order).
        path: destination `.beton`; its folder must exist.
        sizes: (N, 2) H, W of each image when known; None reads them from the images' headers (as the
            pages are written; for mode "raw" first, since they size the pixels' allocations).
        has_masks: store each record's mask from the shards (else FFCV's one-zero-byte "no mask").
        mode: the split's image mode: "jpg" (JPEGs copied as they are) or "raw" (PNGs stored as pixels).
        jpeg_quality: recorded in the image field's parameters, as the writer records it.
        num_workers: copying processes.
        progress: show progress (`preprocess.progress`: a bar on a terminal, a line a minute in a log).

    Raises:
        ValueError: an empty split, an unknown mode, a record larger than a page or wider than FFCV's
            65,535 px, or a shard shorter than its record table says.
        FileNotFoundError: the destination folder does not exist.
    """
    warm_up()            # before any import of FFCV: its compiled helpers then come from the cache (5 s otherwise)
    from ffcv.fields.rgb_image import IMAGE_MODES
    from ffcv.types import CURRENT_VERSION, FieldDescType, HeaderType, TYPE_ID_HANDLER, get_metadata_type

    path = Path(path)
    n = len(reader)
    if n == 0:
        raise ValueError(f"split for {path.name} is empty; an FFCV file needs at least one record")
    if mode not in schema.IMAGE_MODES:
        raise ValueError(f"unknown image mode {mode!r}; use one of {', '.join(schema.IMAGE_MODES)}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {path.parent} does not exist; create it first")
    pixels = mode == "raw"
    if pixels and sizes is None:
        sizes = np.array([image_size(reader.image(i)) for i in range(n)], np.int64).reshape(-1, 2)
    if sizes is not None:
        sizes = np.asarray(sizes, np.int64)
        too_wide = np.flatnonzero(sizes.max(axis=1) > MAX_SIDE)
        if len(too_wide):
            check_side(int(too_wide[0]), *(int(v) for v in sizes[too_wide[0]]))
    fields = ffcv_fields(mode, jpeg_quality)
    handlers = list(fields.values())
    meta = np.zeros(n, get_metadata_type(handlers))
    image, label, index, mask, coverage = (meta[name] for name in meta.dtype.names)

    cols = np.asarray(reader.cols)
    mask_sizes = cols[:, 4] if has_masks else np.full(n, NO_MASK.size, np.int64)
    if has_masks and (cols[:, 3] < 0).any():
        raise ValueError(f"record {int(np.argmax(cols[:, 3] < 0))} has no mask in the shards but the split "
                         "declares masks; write the masks first")
    metadata_start = HeaderType.itemsize + len(fields) * FieldDescType.itemsize
    image_sizes = sizes[:, 0] * sizes[:, 1] * 3 if pixels else cols[:, 2]
    layout = plan(image_sizes, mask_sizes, metadata_start + meta.nbytes, page_size)

    image["mode"] = IMAGE_MODES[mode]
    image["data_ptr"] = layout.image_ptr
    label[:], index[:] = reader.labels, reader.indices
    mask["ptr"], mask["size"] = layout.mask_ptr, mask_sizes
    coverage[:] = reader.coverage if has_masks else schema.NO_MASK_COVERAGE
    if sizes is not None:
        image["height"], image["width"] = sizes[:, 0], sizes[:, 1]

    header = np.zeros((), HeaderType)
    header["version"], header["num_fields"], header["page_size"] = CURRENT_VERSION, len(fields), page_size
    header["num_samples"], header["alloc_table_ptr"] = n, layout.table_ptr
    descriptors = np.zeros(len(fields), FieldDescType)
    type_ids = {handler: type_id for type_id, handler in TYPE_ID_HANDLER.items()}
    for desc, (name, field) in zip(descriptors, fields.items()):
        desc["type_id"] = type_ids[type(field)]
        desc["name"][:len(name)] = np.frombuffer(name.encode("ascii")[:16], np.uint8)
        desc["arguments"][:] = field.to_binary()[0]

    fd, tmp = temporary_file(path)
    digest, hashed = hashlib.sha256(), 0               # the file's hash, over its first `hashed` bytes
    try:
        os.ftruncate(fd, layout.file_size)                 # pages read as zeros where nothing is written
        os.pwrite(fd, layout.table.tobytes(), layout.table_ptr)
        if sizes is not None:                              # the metadata is whole: written and hashed first
            os.pwrite(fd, header.tobytes() + descriptors.tobytes() + meta.tobytes(), 0)
        spans = _spans(layout, 4 * num_workers)
        args = (reader, layout, has_masks, tmp, sizes is None, pixels)
        # Processes even for one worker: this one hashes what they wrote meanwhile (30,000 records of 41 KB
        # copied and hashed in 1.09 s instead of 1.44 s, one worker on 2 cores).
        pool = fork_context().Pool(min(num_workers, len(spans)), _init_worker, args) if len(spans) > 1 else None
        if pool is None:
            _init_worker(*args)
        bar = progress_bar(n, path.name, progress)
        try:
            done = pool.imap(_write_pages, spans) if pool else map(_write_pages, spans)
            for (_, hi), (count, rows) in zip(spans, done):
                image["height"][rows[:, 0]], image["width"][rows[:, 0]] = rows[:, 1], rows[:, 2]
                bar.update(count)
                if sizes is not None:                      # pages up to the end of this run are final
                    end = layout.data_start + (int(layout.page_of(layout.piece_ptr[hi - 1])) + 1) * page_size
                    hashed = _hash(fd, digest, hashed, end)
            if pool:
                pool.close()                     # the workers end on their own (no SIGTERM in a user's log)
        except BaseException:
            if pool:
                pool.terminate()
            raise
        finally:
            if pool:
                pool.join()
            bar.close()
            _WORKER.clear()
        if sizes is None:
            os.pwrite(fd, header.tobytes() + descriptors.tobytes() + meta.tobytes(), 0)
        _hash(fd, digest, hashed, layout.file_size)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"sha256": digest.hexdigest(), "bytes": layout.file_size}


def _hash(fd: int, digest, start: int, end: int, chunk: int = 1 << 24) -> int:
    """Feed bytes [start, end) of `fd` to `digest`; returns `end`."""
    while start < end:
        data = os.pread(fd, min(chunk, end - start), start)
        if not data:
            raise OSError(f"the file ended at byte {start} of {end} while it was hashed")
        digest.update(data)
        start += len(data)
    return end
