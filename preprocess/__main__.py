"""`python -m preprocess`: write a dataset as FFCV + DALI files with a manifest.

    python -m preprocess --dataset synthetic --out data
    python -m preprocess --dataset cifar10 --src ~/cifar-10-batches-py
    python -m preprocess --dataset imagefolder --src /data/imagenet --name imagenet100 --class-list in100.txt

Errors are one line on stderr with exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.schema import DatasetError
from preprocess.prepare import (DATASETS, IMAGEFOLDER_DEFAULTS, SHARD_SIZE, SYNTHETIC_DEFAULTS,
                                prepare_dataset, summary)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:         # one line, exit code 2 (argparse prints usage too)
        print(f"preprocess: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; see the module docstring."""
    p = _Parser(prog="python -m preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic", help=f"one of {', '.join(DATASETS)} (default synthetic)")
    p.add_argument("--src", type=Path, help="source folder (CIFAR batches or SRC/train|val/<class>/)")
    p.add_argument("--out", type=Path, default=Path("data"), help="data root (default data)")
    p.add_argument("--name", help="dataset folder name under --out (default: the dataset)")
    p.add_argument("--force", action="store_true", help="rewrite a complete dataset")
    p.add_argument("--workers", type=int, help="parallel processes (default: all cores)")
    p.add_argument("--shard-size", type=int, default=SHARD_SIZE, help="records per DALI shard")
    g = p.add_argument_group("synthetic")
    g.add_argument("--train-size", type=int, default=SYNTHETIC_DEFAULTS["train_size"])
    g.add_argument("--val-size", type=int, default=SYNTHETIC_DEFAULTS["val_size"])
    g.add_argument("--image-px", type=int, default=SYNTHETIC_DEFAULTS["image_px"])
    g.add_argument("--seed", type=int, default=SYNTHETIC_DEFAULTS["seed"])
    g.add_argument("--gt-masks-as-mask", action="store_true",
                   help="store the ground-truth masks in the mask field (tests of the view pipelines)")
    g = p.add_argument_group("imagefolder")
    g.add_argument("--max-side", type=int, default=IMAGEFOLDER_DEFAULTS["max_side"],
                   help="cap of the chosen side in px, only downscaling (0: keep sizes)")
    g.add_argument("--side", choices=("longer", "shorter"), default=IMAGEFOLDER_DEFAULTS["side"])
    g.add_argument("--class-list", type=Path, help="file with one class folder name per line (ImageNet-100)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input or failed write)."""
    a = parse_args(argv)
    if a.dataset not in DATASETS:
        print(f"preprocess: error: unknown dataset {a.dataset!r}; choose one of {', '.join(DATASETS)}",
              file=sys.stderr)
        return 2
    params: dict = {}
    if a.dataset == "synthetic":
        params = dict(train_size=a.train_size, val_size=a.val_size, image_px=a.image_px, seed=a.seed,
                      gt_masks_as_mask=a.gt_masks_as_mask)
    elif a.dataset == "imagefolder":
        params = dict(max_side=a.max_side, side=a.side, class_list=a.class_list)
    try:
        path = prepare_dataset(a.dataset, a.out, src=a.src, force=a.force, workers=a.workers,
                               progress=True, name=a.name, shard_size=a.shard_size, **params)
        print(summary(path))
    except (ValueError, DatasetError, OSError) as e:
        print(f"preprocess: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("preprocess: interrupted; the next run removes the partial staging folder", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
