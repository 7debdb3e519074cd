"""`python -m preprocess.saliency.control` (`make saliency-check` runs it): the control masks of the
downstream check, a copy of a dataset whose every mask is a centred rectangle with the coverage of
its saliency mask.

RELICv2 App. D.2 ("Random masks and mask corruptions", Table 14) compares the DeepUSPS masks with
centred rectangles covering a fixed share of the image. The control here keeps each image's own
coverage, so that the only thing it lacks is where the object is: the rectangle has the image's
aspect ratio and its mask's area (up to a row and a column), centred.

    python -m preprocess.saliency.control --dataset synthetic --root data     # -> data/synthetic-centre
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines import schema
from pipelines.errors import bad_input
from pipelines.shards import ShardReader
from preprocess.prepare import PreprocessError, remove_quietly
from preprocess.saliency.write import write_masks


def centred_rectangle(height: int, width: int, coverage: float) -> np.ndarray:
    """A (height, width) {0, 255} mask: a centred rectangle of the image's aspect ratio with sides
    round(sqrt(coverage) x side), i.e. coverage x height x width pixels up to a row and a column."""
    s = float(np.sqrt(np.clip(coverage, 0.0, 1.0)))
    h, w = round(s * height), round(s * width)
    mask = np.zeros((height, width), np.uint8)
    top, left = (height - h) // 2, (width - w) // 2
    mask[top:top + h, left:left + w] = 255
    return mask


def write_control(dataset_dir: Path, name: str | None = None, *, workers: int = 1) -> Path:
    """Copy `dataset_dir` to `<root>/<name>` (default `<dataset>-centre`) with centred-rectangle masks.

    Raises:
        PreprocessError: the dataset has no saliency masks (run make saliency first) or the copy
            failed (nothing under the new name is left).
    """
    dataset_dir = Path(dataset_dir)
    m = schema.read_manifest(dataset_dir, verify="size")
    if not m.has_masks:
        raise PreprocessError(f"{dataset_dir} has no masks to match: run `make saliency DATASET={dataset_dir.name}` first")
    out = dataset_dir.with_name(name or f"{dataset_dir.name}-centre")
    remove_quietly(out)
    readers = {split: ShardReader.open(dataset_dir / split, n) for split, n in m.counts.items()}

    def control(split: str):
        def mask_of(i: int) -> np.ndarray:
            source = np.asarray(Image.open(io.BytesIO(readers[split].mask(i))))
            return centred_rectangle(*source.shape, float(np.mean(source >= 128)))
        return mask_of

    try:
        shutil.copytree(dataset_dir, out)
        write_masks(out, {split: control(split) for split in m.counts},
                    {"control": "centred rectangle of each saliency mask's coverage", "from": dataset_dir.name,
                     "stage": "control"}, workers=workers)
    except OSError as e:
        remove_quietly(out)
        raise PreprocessError(f"copying {dataset_dir} to {out} failed ({e.strerror or e}): free space and re-run") from None
    except BaseException:
        remove_quietly(out)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m preprocess.saliency.control", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic", help="dataset with saliency masks (default synthetic)")
    p.add_argument("--root", type=Path, default=Path("data"), help="data root (default data)")
    p.add_argument("--name", help="the copy's name (default <dataset>-centre)")
    p.add_argument("--workers", type=int, default=1, help="writer processes")
    a = p.parse_args(argv)
    try:
        out = write_control(a.root / a.dataset, a.name, workers=a.workers)
    except (PreprocessError, schema.DatasetError) as e:
        return bad_input(e)
    print(f"control masks (centred rectangles of the same coverage) written into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
