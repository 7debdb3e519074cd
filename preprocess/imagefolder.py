"""The `imagefolder` source: labelled `SRC/train/<class>/*`, `SRC/val/<class>/*` (ImageNet, ImageNet-100,
...), or unlabelled: any folder of images searched recursively, or a text file listing image paths.

Layouts (`list_images`, `--labels auto|folders|none`): `folders` is the labelled layout, one
sub-folder per class in train/ and val/, in train/ alone, or in SRC itself (torchvision's ImageFolder,
`SRC/<class>/*`; a folder whose name starts with a dot is not a class); without val/ a seeded share
of each class is held out as the val split (`--val-fraction`, `held_out_per_class`). `none` takes
every image under SRC (or every path the list file names, relative to the file's folder) with no
label (`schema.NO_LABEL`): the images under `SRC/val/` are the val split when that folder exists,
else a seeded random share of the images is held out (`--val-fraction`, `held_out`). `auto` is
`folders` when SRC has a train/ folder, else `none` (a folder that looks like `SRC/<class>/*` is
named in one line: `--labels folders` keeps its labels).

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
import os
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from pipelines import schema


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
                    ".pbm", ".jfif")
SIDES = ("longer", "shorter")
LABELS = ("auto", "folders", "none")
VAL_FRACTION = 0.01                # folders without val/: the share held out (of each class when labelled)
VAL_MIN = 500                      # ... but at least this many when the folder has 10x as many
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


def list_image_folder(src: Path, class_list: Path | None, val_fraction: float = VAL_FRACTION,
                      seed: int = 0) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """Find classes and image files of a labelled folder: `SRC/train/<class>/*` with `SRC/val/<class>/*`;
    `SRC/train/<class>/*` alone, or `SRC/<class>/*` (torchvision's ImageFolder), whose val split is a
    seeded share of each class held out (`held_out_per_class`, `val_fraction`, `seed`).

    Returns:
        (class_names, {split: [(path, label), ...]}) with files sorted by (class, name).

    Raises:
        ImageFolderError: a val/ folder without train/, empty split, empty class folder, a class-list
            entry with no folder, a val class unknown to train, or too few images to hold some out.
    """
    train_dir = src / "train" if (src / "train").is_dir() else src
    val_dir = src / "val" if (src / "val").is_dir() else None
    if train_dir == src and val_dir is not None:
        raise ImageFolderError(f"image folder {src} has a val/ folder but no train/ folder: lay it out as "
                               f"SRC/train/<class>/* and SRC/val/<class>/* (or SRC/<class>/* alone)")
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
            if not (train_dir / n).is_dir():
                raise ImageFolderError(f"class {n!r} of {class_list} has no folder {train_dir / n}: "
                                       "fix the class list or the folder")
    else:
        names = sorted(p.name for p in train_dir.iterdir() if _a_class(p))
        if not names:
            raise ImageFolderError(f"{train_dir} has no class folders (empty split): add {train_dir}/<class>/<images>")
        extra = sorted(p.name for p in val_dir.iterdir() if _a_class(p) and p.name not in set(names)) if val_dir else []
        if extra:
            raise ImageFolderError(f"{val_dir} has classes not in train ({', '.join(extra[:5])}): "
                                   "give both splits the same class folders")
    label_of = {n: i for i, n in enumerate(names)}
    files: dict[str, list[tuple[str, int]]] = {}
    for split, root in (("train", train_dir), ("val", val_dir)):
        if root is None:
            continue
        out = []
        for n in names:
            d = root / n
            if not d.is_dir():
                continue
            imgs = _images_in(d)
            if not imgs:
                raise ImageFolderError(f"class folder {d} has no image files ({', '.join(IMAGE_EXTENSIONS[:4])}, "
                                       "...): add images or remove the folder (or the class from the list)")
            out += [(p, label_of[n]) for p in imgs]
        if not out:
            raise ImageFolderError(f"split {root} has no images (empty split): add {root}/<class>/<images>")
        files[split] = out
    if val_dir is None:
        files = _hold_out_per_class(files["train"], len(names), val_fraction, seed, train_dir)
    return names, files


def _a_class(entry: Path | os.DirEntry) -> bool:
    """Whether an entry of a labelled split is a class folder: a folder whose name does not start with a
    dot (Jupyter's .ipynb_checkpoints, a file manager's .thumbnails hold copies, not a class)."""
    return entry.is_dir() and not entry.name.startswith(".")


def _an_image(entry: os.DirEntry) -> bool:
    """Whether a folder's entry is an image file (by its extension). scandir's entries know their type
    without a stat of each file: 1.28 M stats are minutes on a network filesystem."""
    return os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS and entry.is_file()


def _images_in(folder: Path) -> list[str]:
    """The image files directly in `folder`, sorted."""
    with os.scandir(folder) as entries:
        return sorted(e.path for e in entries if _an_image(e))


def held_out_per_class(counts: list[int], fraction: float) -> list[int]:
    """How many images of each class (`counts`) a labelled folder without val/ holds out as its val
    split: `held_out` of them all, shared in proportion to the classes' sizes, at least one of a class
    of two or more images, and each class keeps one image to train on."""
    total = sum(counts)
    k = held_out(total, fraction)
    return [min(n - 1, max(1, round(n * k / total))) if n >= 2 else 0 for n in counts]


def _hold_out_per_class(train: list[tuple[str, int]], classes: int, fraction: float, seed: int,
                        where: Path) -> dict[str, list[tuple[str, int]]]:
    """The splits of a labelled folder without val/: of each class, `held_out_per_class` images drawn
    with `seed` (one generator, classes in order) are the val split."""
    by_class: list[list[tuple[str, int]]] = [[] for _ in range(classes)]
    for item in train:
        by_class[item[1]].append(item)
    keep = held_out_per_class([len(c) for c in by_class], fraction)
    if not any(keep):
        raise ImageFolderError(f"{where} has no class of 2 or more images: at least one is needed to hold "
                               "images out as the val split (or add SRC/val/<class>/*)")
    rng = np.random.default_rng(seed)
    splits: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
    for items, k in zip(by_class, keep):
        pick = set(rng.permutation(len(items))[:k].tolist())
        splits["val"] += [x for i, x in enumerate(items) if i in pick]
        splits["train"] += [x for i, x in enumerate(items) if i not in pick]
    return splits


def class_folders(src: Path) -> int:
    """How many sub-folders of `src` look like classes (torchvision's ImageFolder layout: no images at
    the top, two or more folders, each holding images directly), 0 if it does not look so; a look at
    the top level and one entry per folder, however large the folder."""
    if not src.is_dir():
        return 0
    with os.scandir(src) as entries:
        top = list(entries)
    if any(map(_an_image, top)):
        return 0
    folders = [e.path for e in top if _a_class(e)]
    return len(folders) if len(folders) >= 2 and all(_holds_an_image(f) for f in folders) else 0


def _holds_an_image(folder: str) -> bool:
    with os.scandir(folder) as entries:
        return any(map(_an_image, entries))


def held_out(n: int, fraction: float) -> int:
    """How many of a folder's `n` images are held out as the val split where it has no val/ (shared over
    the classes of a labelled one by `held_out_per_class`): `fraction` of them, at least `VAL_MIN` when the
    folder has ten times as many (a monitoring set large enough to be stable), and at least one; the
    train split keeps the rest."""
    return min(n - 1, max(1, round(fraction * n), min(VAL_MIN, n // 10)))


def _images_under(root: Path, skip: Path | None = None) -> list[str]:
    """Every image file under `root`, recursively, sorted; without the folder `skip`. Symlinked folders
    are followed, but each real folder is walked once: a link back up (`sub/up -> ..`) would otherwise
    list the same images again under ever longer names, and two links to one folder would list it twice."""
    found = []
    seen = {os.path.realpath(skip)} if skip is not None else set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        found += [os.path.join(folder, n) for n in names if Path(n).suffix.lower() in IMAGE_EXTENSIONS]
    return sorted(found)


def list_unlabelled(src: Path, val_fraction: float, seed: int) -> dict[str, list[tuple[str, int]]]:
    """The splits of an unlabelled source: every image of a folder (recursively), or every path of a
    list file; `SRC/val/` is the val split when it exists, else `held_out` images drawn with `seed`.

    Returns:
        {split: [(path, schema.NO_LABEL), ...]}, each sorted by path.

    Raises:
        ImageFolderError: no images, a list file that is not text, names missing files or one image
            twice, or too few images to hold some out.
    """
    if src.is_file():
        paths = _listed(src)
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise ImageFolderError(f"{len(missing)} of the {len(paths)} files {src} lists do not exist "
                                   f"(first: {missing[0]}): fix the list (paths relative to its folder)")
        if repeated := [p for p, n in Counter(paths).items() if n > 1]:
            raise ImageFolderError(f"list {src} names {len(paths) - len(set(paths))} image(s) again that it "
                                   f"already lists (first: {repeated[0]}): list each image once (e.g. sort -u)")
        train, val = sorted(paths), []
        where = f"list {src}"
    else:
        val_dir = src / "val"
        val = _images_under(val_dir) if val_dir.is_dir() else []
        train = _images_under(src, skip=val_dir if val_dir.is_dir() else None)
        where = f"folder {src}"
    if not train:
        raise ImageFolderError(f"{where} holds no images ({', '.join(IMAGE_EXTENSIONS[:4])}, ...): point --src "
                               "at a folder of images (searched recursively) or a file listing image paths")
    if not val:
        if len(train) < 2:
            raise ImageFolderError(f"{where} holds 1 image: at least 2 are needed (one to train on, one held out)")
        k = held_out(len(train), val_fraction)
        pick = set(np.random.default_rng(seed).permutation(len(train))[:k].tolist())
        val = [p for i, p in enumerate(train) if i in pick]
        train = [p for i, p in enumerate(train) if i not in pick]
    return {"train": [(p, schema.NO_LABEL) for p in train], "val": [(p, schema.NO_LABEL) for p in sorted(val)]}


def _listed(src: Path) -> list[str]:
    """The resolved paths a list file names, one a line (relative to its folder; blank lines and `#`
    comments skipped).

    Raises:
        ImageFolderError: `src` is not a text file (an image passed as --src, say).
    """
    not_a_list = (f"--src {src} is a file but not a text list of image paths (one a line): pass the folder "
                  "holding the images, or a text file listing them")
    if src.suffix.lower() in IMAGE_EXTENSIONS:
        raise ImageFolderError(not_a_list)
    try:
        text = src.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ImageFolderError(not_a_list) from None
    if "\0" in text:
        raise ImageFolderError(not_a_list)
    lines = [ln.strip() for ln in text.splitlines()]
    return [str((src.parent / ln).resolve()) for ln in lines if ln and not ln.startswith("#")]


def labels_of(src: Path, labels: str) -> str:
    """The layout `labels` reads `src` in: `auto` is `folders` when SRC has a train/ folder, else `none`."""
    if labels != "auto":
        return labels
    return "folders" if Path(src).is_dir() and (Path(src) / "train").is_dir() else "none"


def list_images(src: Path, labels: str, class_list: Path | None, val_fraction: float, seed: int
                ) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """The class names and splits of an image source in the layout `labels` names (module docstring).

    Returns:
        (class names, {split: [(path, label), ...]}): no class names and `schema.NO_LABEL` everywhere
        for an unlabelled source.

    Raises:
        ImageFolderError: see `list_image_folder` and `list_unlabelled`.
    """
    labels = labels_of(src, labels)
    if labels == "folders":
        if src.is_file():
            raise ImageFolderError(f"{src} is a file: a labelled source is a folder SRC/train/<class>/*; "
                                   "use --labels none for a list of image paths")
        return list_image_folder(src, class_list, val_fraction, seed)
    if class_list is not None:
        raise ImageFolderError("--class-list picks classes of a labelled folder; drop it for unlabelled images "
                               "(--labels none) or lay the folder out as SRC/train/<class>/*")
    return [], list_unlabelled(src, val_fraction, seed)
