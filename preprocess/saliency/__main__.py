"""`python -m preprocess.saliency` (`make saliency`): saliency masks for a dataset `make preprocess`
wrote, into its FFCV and DALI files, with a quality report.

    python -m preprocess.saliency --dataset synthetic --root data
    python -m preprocess.saliency --dataset mine --root data --subset 1000 --workers 8
    python -m preprocess.saliency --dataset synthetic --init runs/<run>      # networks from a viewmill backbone

Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.errors import bad_input
from pipelines.processes import LimitError, descriptors_needed, ensure_open_files
from pipelines.schema import DatasetError
from preprocess.prepare import PreprocessError
from preprocess.saliency import crf, handcrafted
from models.saliency import backbone_source
from preprocess.saliency.refine import LOSSES, RefineSettings
from preprocess.saliency.run import SUBSET, Settings, compute, default_workers


def main(argv: list[str] | None = None, prog: str = "python -m preprocess.saliency") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic", help="dataset folder name under --root (default synthetic)")
    p.add_argument("--root", type=Path, default=Path("data"), help="data root (default data)")
    p.add_argument("--methods", default=",".join(handcrafted.DEFAULT_METHODS),
                   help=f"handcrafted methods, of {', '.join(handcrafted.METHODS)} (default "
                        f"{','.join(handcrafted.DEFAULT_METHODS)})")
    p.add_argument("--subset", type=int, default=SUBSET, help=f"train images scored and searched (default {SUBSET})")
    p.add_argument("--seed", type=int, default=0, help="seed of the subset")
    p.add_argument("--work-px", type=int, default=handcrafted.WORK_PX,
                   help=f"the maps' smallest working side: smaller images are upsampled (default {handcrafted.WORK_PX})")
    p.add_argument("--max-work-px", type=int, default=handcrafted.MAX_WORK_PX,
                   help=f"the maps' largest working side: larger images are shrunk (default {handcrafted.MAX_WORK_PX})")
    p.add_argument("--workers", type=int, default=default_workers(), help="processes (default: all cores)")
    p.add_argument("--report", type=Path, default=Path("reports"), help="reports/saliency-<dataset>/ goes here")
    p.add_argument("--rounds", type=int, default=RefineSettings.rounds,
                   help="DeepUSPS self-training rounds per method (stage I); 0: handcrafted stages only")
    p.add_argument("--epochs", type=int, default=RefineSettings.epochs, help="epochs per stage I round")
    p.add_argument("--final-epochs", type=int, default=RefineSettings.final_epochs, help="epochs of the stage II network")
    p.add_argument("--loss", default=RefineSettings.loss, choices=LOSSES, help="refinement loss")
    p.add_argument("--lr", type=float, default=RefineSettings.lr, help="Adam learning rate of round 1 (doubled per round)")
    p.add_argument("--backbone", default=RefineSettings.backbone, help="timm ResNet of the networks at random init")
    p.add_argument("--init", default=None, help="backbone of the networks from a viewmill run: its folder or "
                   "backbone.safetensors (make saliency INIT=...)")
    p.add_argument("--crf", action=argparse.BooleanOptionalAction, default=RefineSettings.crf,
                   help="DeepUSPS's dense CRF on the refinement's predictions and the networks' maps (default on; "
                        "needs pydensecrf, the crf extra, which make saliency installs)")
    p.add_argument("--net-px", type=int, default=0, help="input side of the networks (default: the images' side, 64-128)")
    p.add_argument("--score-images", type=int, default=500, help="held-out train images every stage is scored on")
    p.add_argument("--case-images", type=int, default=16, help="labelled test images per case in the report")
    a = p.parse_args(argv)
    try:
        methods = tuple(m.strip() for m in a.methods.split(",") if m.strip())
        bad = [m for m in methods if m not in handcrafted.METHODS]
        if bad or not methods:
            raise PreprocessError(f"unknown saliency method {', '.join(bad) or repr(a.methods)}; choose from "
                                  f"{', '.join(handcrafted.METHODS)}")
        if a.subset < 1 or a.workers < 1 or a.work_px < 32 or a.max_work_px < a.work_px:
            raise PreprocessError("--subset and --workers must be >= 1, --work-px >= 32 and --max-work-px >= --work-px")
        if a.rounds < 0 or a.epochs < 1 or a.final_epochs < 1 or a.score_images < 0 or not (a.net_px == 0 or a.net_px >= 32):
            raise PreprocessError("--rounds and --score-images must be >= 0, --epochs and --final-epochs >= 1, "
                                  "--net-px 0 (auto) or >= 32")
        if a.init is not None:
            try:
                backbone_source(a.init)
            except ValueError as e:
                raise PreprocessError(f"INIT: {e}") from None
        refinement = RefineSettings(rounds=a.rounds, epochs=a.epochs, final_epochs=a.final_epochs, loss=a.loss, lr=a.lr,
                                    backbone=a.backbone, init=a.init, net_px=a.net_px, seed=a.seed, crf=a.crf)
        if a.crf and a.rounds:
            crf.require()
        settings = Settings(methods=methods, subset=a.subset, seed=a.seed, work_px=a.work_px,
                            max_work_px=a.max_work_px, workers=a.workers,
                            case_images=a.case_images, score_images=a.score_images, refinement=refinement)
        report = a.report / f"saliency-{a.dataset}"
        # the maps' worker processes, and the dense CRF's beside them
        ensure_open_files(descriptors_needed(workers=a.workers + settings.crf_workers), "the saliency stage")
        saliency = compute(a.root / a.dataset, settings, report)
    except (PreprocessError, DatasetError, LimitError, handcrafted.SaliencyError) as e:
        return bad_input(e)
    print(f"masks written into {a.root / a.dataset} (stage {saliency['stage']}); report in {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
