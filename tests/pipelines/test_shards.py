"""`shards.image_size` reads the size a decoder will produce from the header alone (the DALI backend
draws its crop windows from it before anything is decoded)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.shards import image_size


def encoded(h: int, w: int, fmt: str, **save) -> bytes:
    rng = np.random.default_rng(h * 1000 + w)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize("h, w", [(375, 500), (500, 333), (17, 1), (1, 9)])
@pytest.mark.parametrize("fmt, save", [
    ("JPEG", {"quality": 90}),
    ("JPEG", {"progressive": True}),                           # SOF2 frame header
    ("JPEG", {"restart_marker_blocks": 1, "optimize": True}),  # DRI before the frame, Huffman tables
    ("JPEG", {"exif": b"Exif\x00\x00" + b"\x00" * 3000}),    # a long APP1 before the frame
    ("PNG", {}),
])
def test_header_size_is_the_decoded_size(h: int, w: int, fmt: str, save: dict) -> None:
    data = encoded(h, w, fmt, **save)
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (w, h) and np.asarray(im).shape[:2] == (h, w)
    assert image_size(data) == (h, w)


@pytest.mark.parametrize("data", [b"", b"GIF89a" + b"\x00" * 40, b"\xff\xd8\xff\xe0\x00\x10JFIF" + b"\x00" * 8,
                                  b"\xff\xd8\xff\xc0\x00\x11\x08\x01"])      # a frame header cut short
def test_bytes_without_a_frame_header_are_a_dataset_error(data: bytes) -> None:
    with pytest.raises(schema.DatasetError, match="re-run `python -m preprocess`"):
        image_size(data)
