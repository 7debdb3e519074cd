"""The `imagefolder` source: `SRC/train/<class>/*`, `SRC/val/<class>/*` (ImageNet, ImageNet-100, ...).

Colour policy (any image PIL can read becomes uint8 RGB):
- EXIF orientation is applied (`ImageOps.exif_transpose`), so pixels are stored upright.
- Grayscale ("L", "1") and CMYK go through PIL's RGB conversion.
- 16-bit ("I;16*", "I") is scaled with round(v * 255 / 65535); float ("F") is clipped to [0, 1]
  then scaled when its maximum is <= 1, else clipped to [0, 255].
- Transparency (RGBA, LA, PA, palette with a transparent index) is composited on white: the
  transparent parts of product shots and icons are meant as background, and white is what a
  viewer shows; dropping alpha would expose arbitrary colours stored under alpha = 0.
Size policy: only downscale, so that the longer (default) or shorter side is at most `max_side` px;
JPEG files are decoded at reduced scale (`Image.draft`) when that still leaves at least the target
size, then resized with bicubic filtering. A JPEG that needs none of this (RGB, upright, within the
size policy) is stored as its own bytes in both formats. Corrupt, truncated and zero-byte files are
skipped (`try_read`), counted and listed in the manifest; files whose extension is not an image
extension are ignored. The folder is written in one streamed pass by `preprocess/stream.py`.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
                    ".pbm", ".jfif")
SIDES = ("longer", "shorter")
_ORIENTATION = 0x0112              # the EXIF orientation tag


class ImageFolderError(ValueError):
    """A source folder that cannot be read as an image folder (one-line message with the fix)."""


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB following the module's colour policy."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(img, dtype=np.float64)
        a = np.clip(np.rint(a * (255.0 / 65535.0)), 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "F":
        a = np.asarray(img, dtype=np.float64)
        a = np.clip(a, 0, 1) * 255 if np.nanmax(a) <= 1.0 else np.clip(a, 0, 255)
        return Image.fromarray(np.rint(np.nan_to_num(a)).astype(np.uint8), "L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img, mode = img.convert("RGBA"), "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def target_size(w: int, h: int, max_side: int, side: str) -> tuple[int, int]:
    """(w, h) after the size policy: only downscale so that the chosen side is <= max_side."""
    ref = max(w, h) if side == "longer" else min(w, h)
    if max_side <= 0 or ref <= max_side:
        return w, h
    s = max_side / ref
    return max(1, round(w * s)), max(1, round(h * s))


def read_image(path: str | Path, max_side: int, side: str) -> tuple[np.ndarray, bytes | None]:
    """Decode `path` to (H, W, 3) uint8 RGB, upright, after the size policy; with the file's bytes
    when they can be stored as they are (a JPEG that decodes to RGB, needs no EXIF rotation and
    already fits the size policy: no re-encode, no generational loss), else None.

    Raises:
        OSError, ValueError, SyntaxError, Image.DecompressionBombError: corrupt or truncated file.
    """
    raw = Path(path).read_bytes()
    with Image.open(io.BytesIO(raw)) as img:
        w, h = img.size                                  # stored orientation: the scale is the same
        tw, th = target_size(w, h, max_side, side)
        as_is = (img.format == "JPEG" and img.mode == "RGB" and (tw, th) == (w, h)
                 and img.getexif().get(_ORIENTATION, 1) == 1)
        if (tw, th) != (w, h) and img.format == "JPEG":
            # draft: libjpeg decodes at 1/2, 1/4 or 1/8 scale; a 500x375 JPEG capped to 256 px
            # decodes ~2x faster.
            img.draft("RGB", (tw, th))
        img.load()
        img = ImageOps.exif_transpose(img)
        img = to_rgb(img)
        if img.size[0] >= img.size[1]:
            tw, th = max(tw, th), min(tw, th)            # exif may have swapped the axes
        else:
            tw, th = min(tw, th), max(tw, th)
        if img.size != (tw, th):
            img = img.resize((tw, th), Image.Resampling.BICUBIC)
        return np.asarray(img, dtype=np.uint8).copy(), raw if as_is else None


def load_image(path: str | Path, max_side: int, side: str) -> np.ndarray:
    """The pixels of `read_image`."""
    return read_image(path, max_side, side)[0]


def try_read(path: str | Path, max_side: int, side: str) -> tuple[np.ndarray | None, bytes | None, str | None]:
    """`read_image` that turns a bad file into a skip reason: (pixels, bytes kept as they are, None)
    or (None, None, reason) for a missing, zero-byte, corrupt or truncated file."""
    try:
        if Path(path).stat().st_size == 0:
            return None, None, "zero-byte file"
        image, raw = read_image(path, max_side, side)
    except Exception as e:  # noqa: BLE001 — any read or decode failure is a counted skip
        msg = str(e).splitlines()[0] if str(e) else ""
        return None, None, f"{type(e).__name__}: {msg}"[:200]
    return image, raw, None


def list_image_folder(src: Path, class_list: Path | None) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """Find classes and image files.

    Returns:
        (class_names, {split: [(path, label), ...]}) with files sorted by (class, name).

    Raises:
        ImageFolderError: missing split folder, empty split, empty class folder, a class-list entry
            with no folder, or a val class unknown to train.
    """
    for split in ("train", "val"):
        if not (src / split).is_dir():
            raise ImageFolderError(f"image folder {src} has no {split}/ folder: lay it out as "
                                   f"SRC/train/<class>/* and SRC/val/<class>/*")
    if class_list is not None:
        if not class_list.is_file():
            raise ImageFolderError(f"class-list file {class_list} does not exist: pass a file with one "
                                   "class folder name per line")
        names = [ln.strip() for ln in class_list.read_text().splitlines() if ln.strip()]
        if not names:
            raise ImageFolderError(f"class-list file {class_list} is empty: list one class per line")
        if len(set(names)) != len(names):
            raise ImageFolderError(f"class-list file {class_list} repeats a class: list each once")
        for n in names:
            if not (src / "train" / n).is_dir():
                raise ImageFolderError(f"class {n!r} of {class_list} has no folder {src / 'train' / n}: "
                                       "fix the class list or the folder")
    else:
        names = sorted(p.name for p in (src / "train").iterdir() if p.is_dir())
        if not names:
            raise ImageFolderError(f"{src / 'train'} has no class folders (empty split): add "
                                   f"{src / 'train'}/<class>/<images>")
        extra = sorted(p.name for p in (src / "val").iterdir() if p.is_dir() and p.name not in set(names))
        if extra:
            raise ImageFolderError(f"{src / 'val'} has classes not in train ({', '.join(extra[:5])}): "
                                   "give both splits the same class folders")
    label_of = {n: i for i, n in enumerate(names)}
    files: dict[str, list[tuple[str, int]]] = {}
    for split in ("train", "val"):
        out = []
        for n in names:
            d = src / split / n
            if not d.is_dir():
                continue
            imgs = sorted(str(p) for p in d.iterdir()
                          if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
            if not imgs:
                raise ImageFolderError(f"class folder {d} has no image files ({', '.join(IMAGE_EXTENSIONS[:4])}, "
                                       "...): add images or remove the folder (or the class from the list)")
            out += [(p, label_of[n]) for p in imgs]
        if not out:
            raise ImageFolderError(f"split {src / split} has no images (empty split): add "
                                   f"{src / split}/<class>/<images>")
        files[split] = out
    return names, files
