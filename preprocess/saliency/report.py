"""The saliency report, `reports/saliency-<dataset>/`: `report.json` (the manifest's `saliency` entry),
`report.md` (the quality table per stage, label-free statistics, each stage over clutter levels and
hard cases (`cases.py`), timings) and `grid.png`, a grid of
image / ground truth / each stage / the written mask / the composite RELICv2 trains on (background
replaced by gray), for a few dataset images and for natural photos that ship with scikit-image."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipelines.shards import ShardReader
from preprocess.saliency import handcrafted

TILE = 96
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def _stage_maps(image: np.ndarray, methods: tuple[str, ...], nets: dict | None, work_px: int = handcrafted.WORK_PX,
                max_work_px: int = handcrafted.MAX_WORK_PX) -> dict[str, np.ndarray]:
    """Every stage's [0, 1] map of one image at its size: the handcrafted methods, their fusion, and
    each refinement network (`refine.NetStage`)."""
    per = handcrafted.maps_and_fusion(image, methods, work_px=work_px, max_work_px=max_work_px)
    for k, stage in (nets or {}).items():
        per[k] = stage(image)
    return per


def case_scores(methods: tuple[str, ...], per_case: int = 16, work_px: int = handcrafted.WORK_PX,
                max_work_px: int = handcrafted.MAX_WORK_PX, nets: dict | None = None) -> dict:
    """IoU at 0.5 and MAE of every stage (handcrafted and refinement networks) on `cases` images with
    exact masks: three clutter levels and four hard cases, `per_case` images each (one BLAS thread:
    the maps are small)."""
    from threadpoolctl import threadpool_limits

    from preprocess.saliency import cases, quality

    out = {}
    with threadpool_limits(1):
        for case in cases.CASES:
            rows: dict[str, list] = {}
            for i in range(per_case):
                image, gt = cases.make(case, i)
                for k, v in _stage_maps(image, methods, nets, work_px, max_work_px).items():
                    rows.setdefault(k, []).append((quality.iou(v, gt), quality.mae(v, gt)))
            out[case] = {k: {"iou": float(np.mean([r[0] for r in v])), "mae": float(np.mean([r[1] for r in v]))}
                         for k, v in rows.items()}
    return out


def markdown(name: str, saliency: dict) -> str:
    scores = saliency["scores"]
    with_gt = all("iou" in s for s in scores.values())
    lines = [f"# Saliency masks of `{name}`", "",
             f"Stage used: **{saliency['stage']}** (of {', '.join(saliency['stages_scored'])}); scored on "
             f"{saliency['scored_on']} (subset of {saliency['subset']}, seed {saliency['seed']}) against "
             f"{saliency['scored_against']}; handcrafted maps at {saliency['work_px']}-{saliency['max_work_px']} px, binarised at "
             f"{saliency['threshold']} at each image's size. Refinement: {_refinement(saliency)}.", ""]
    head = "| stage | " + ("MAE | F-β (β² 0.3) at 0.5 | max-F | IoU at 0.5 | " if with_gt else "") + \
        "mean coverage | under the 5 % gate | touching ≥ 3 sides |"
    lines += [head, "| --- " * (head.count("|") - 1) + "|"]
    for stage, s in scores.items():
        gt = f"{s['mae']:.3f} | {s['f_beta']:.3f} | {s['max_f']:.3f} | {s['iou']:.3f} | " if with_gt else ""
        lines.append(f"| {stage} | {gt}{s['coverage_mean']:.2f} | {100 * s['under_5pct']:.1f} % | "
                     f"{100 * s['three_sides']:.1f} % |")
    if saliency.get("label_scores") and with_gt:
        lines += ["", "Refined labels (each round's moving average) on the subset the networks trained on, IoU at 0.5: "
                  + ", ".join(f"{k} {v['iou']:.3f}" for k, v in saliency["label_scores"].items()) + "."]
    if saliency.get("agreement"):
        lines += ["", "Agreement between stages (mean IoU of their masks on the scored images, no labels needed): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in saliency["agreement"].items()) + "."]
    if saliency.get("cases"):
        stages = list(next(iter(saliency["cases"].values())))
        lines += ["", "IoU at 0.5 on labelled test images (64 px, 16 per case, exact masks):", "",
                  "| case | " + " | ".join(stages) + " |", "| --- " * (len(stages) + 1) + "|"]
        lines += [f"| {case} | " + " | ".join(f"{v[k]['iou']:.3f}" for k in stages) + " |"
                  for case, v in saliency["cases"].items()]
    secs = saliency["seconds"]
    lines += ["", "Seconds: " + ", ".join(f"{k} {v}" for k, v in secs.items()) + ".", "", "![grid](grid.png)", ""]
    return "\n".join(lines)


def _refinement(saliency: dict) -> str:
    r, b = saliency["refinement"], saliency["backbone"]
    if not isinstance(r, dict):
        return str(r)
    source = "random init" if b["init"] == "random" else f"initialised from {b['init']}"
    return (f"{r['rounds']} rounds × {r['epochs']} epochs per method, a final network of {r['final_epochs']} epochs, "
            f"{r['loss']} loss, Adam lr {r['lr']} (doubled per round), batch {r['batch_size']}, moving average "
            f"{r['keep']} / {1 - r['keep']:.1f}{' of dense-CRF predictions (the maps through the CRF too)' if r.get('crf') else ''}, first-round "
            f"threshold {r['first_threshold']}, {r['net_px']} px; "
            f"backbone {b['timm_model']}, {source}")


def _tile(a: np.ndarray, label: str) -> Image.Image:
    img = Image.fromarray(a if a.ndim == 3 else np.stack([a] * 3, axis=-1)).resize((TILE, TILE), Image.NEAREST)
    ImageDraw.Draw(img).text((2, 1), label, fill=(255, 255, 0))
    return img


def _row(image: np.ndarray, gt: np.ndarray | None, saliency: dict, truth_column: bool,
         nets: dict | None) -> list[Image.Image]:
    stage = saliency["stage"]
    per = _stage_maps(image, tuple(saliency["methods"]), nets, saliency["work_px"], saliency["max_work_px"])
    mask = per[stage] >= 0.5
    composite = np.where(mask[..., None], image, 128).astype(np.uint8)
    tiles = [_tile(image, "image")]
    if truth_column:
        tiles.append(_tile(gt, "truth") if gt is not None else _tile(np.full((8, 8), 64, np.uint8), "no truth"))
    tiles += [_tile((per[k] * 255).astype(np.uint8), k) for k in per]
    tiles += [_tile(mask.astype(np.uint8) * 255, f"mask ({stage})"), _tile(composite, "composite")]
    return tiles


def photos() -> list[tuple[str, np.ndarray]]:
    """scikit-image's bundled photos that load without a download."""
    import skimage.data

    out = []
    for name in PHOTOS:
        try:
            img = getattr(skimage.data, name)()
        except Exception:                  # noqa: BLE001 — a photo that needs a download is left out
            continue
        side = 224
        out.append((name, np.asarray(Image.fromarray(img[..., :3]).resize((side, side * img.shape[0] // img.shape[1])))))
    return out


def grid(dataset_dir: Path, saliency: dict, subset: list[int], gt: np.ndarray | None, nets: dict | None = None,
         rows: int = 6) -> Image.Image:
    reader = ShardReader.open(dataset_dir / "train")
    lines = []
    for i in subset[:rows]:
        image = np.asarray(Image.open(io.BytesIO(reader.image(i))).convert("RGB"))
        lines.append(_row(image, None if gt is None else np.asarray(gt[i]), saliency, gt is not None, nets))
    for _, image in photos():
        lines.append(_row(image, None, saliency, gt is not None, nets))
    width = max(len(r) for r in lines)
    out = Image.new("RGB", (width * TILE, len(lines) * TILE), (0, 0, 0))
    for y, r in enumerate(lines):
        for x, t in enumerate(r):
            out.paste(t, (x * TILE, y * TILE))
    return out


def write_report(report_dir: Path, dataset_dir: Path, saliency: dict, sub_maps: dict, gt: np.ndarray | None,
                 nets: dict | None = None) -> None:
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.json").write_text(json.dumps({"dataset": dataset_dir.name, **saliency}, indent=1))
    (report_dir / "report.md").write_text(markdown(dataset_dir.name, saliency))
    grid(dataset_dir, saliency, sorted(sub_maps), gt, nets).save(report_dir / "grid.png")
