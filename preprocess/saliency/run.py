"""`make saliency`: compute saliency masks for a written dataset and write them into its files.

Stages, each scored and the best one used (RELICv2 App. D.2, Tables 14-15: poor masks cost more
accuracy than no masks, so a mask's quality is measured before it is used):

1. a seeded subset of the training split (default min(2,500, N), the paper's 2,500 images) and a
   disjoint held-out set of train images (default 500) every stage is scored on;
2. the handcrafted maps of both, in parallel over cores: RBD and MR over SLIC superpixels
   (`handcrafted.py`; MC and DSR when asked for) and their fusion (the mean);
3. the DeepUSPS refinement on the subset (`refine.py`): per method, self-training rounds of a fresh
   network on the previous round's moving-average labels (stage I), then one network trained on
   every refined label set (stage II); each round's network and the final one are scored on the
   held-out images, and so are the round's labels on the subset;
4. the best stage by IoU against the ground truth (`synthetic`); without one, the final network when
   its backbone came from a self-supervised run (`--init`), else the handcrafted fusion;
5. that stage over every record of every split (batched network inference, or the handcrafted maps in
   parallel), with a progress bar; maps kept as uint8 probabilities in memory-mapped files beside
   the dataset (`store.py`), so memory stays bounded and the pass, killed or failed, resumes where
   it stopped (the refinement too: its finished stages are kept);
6. `write.write_masks`: binarised at 0.5 at each stored image's geometry, into both formats,
   atomically; the manifest's `saliency` records the methods, parameters, rounds, backbone source,
   seed, subset, per-stage scores and the stage used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from pipelines import schema
from pipelines.shards import ShardReader
from pipelines.processes import LimitError, fork_context
from preprocess.prepare import DatasetLock
from preprocess.progress import bar as progress_bar
from preprocess.saliency import handcrafted, quality, refine
from preprocess.saliency.crf import CrfPool
from preprocess.saliency.dsr import DsrParams
from preprocess.saliency.store import MapStore, checkpoint_folder
from preprocess.saliency.superpixels import SlicParams
from preprocess.saliency.write import write_masks

SUBSET = 2500


@dataclass(frozen=True)
class Settings:
    methods: tuple[str, ...] = handcrafted.DEFAULT_METHODS
    subset: int = SUBSET
    seed: int = 0
    work_px: int = handcrafted.WORK_PX          # the maps' working side: smaller images are upsampled to it
    max_work_px: int = handcrafted.MAX_WORK_PX  # and larger ones shrunk to this
    workers: int = 1
    progress: bool = True
    case_images: int = 16          # labelled test images per case in the report
    score_images: int = 500        # held-out train images every stage is scored on (outside the subset)
    refinement: refine.RefineSettings = refine.RefineSettings()

    @property
    def crf_workers(self) -> int:
        """Processes of the dense CRF beside the maps' (none without it or without a refinement)."""
        return self.workers if self.refinement.crf and self.refinement.rounds else 0


# ----------------------------------------------------------------------------- disk

# What masks add to a dataset: per record a mask PNG in each format (2-3 KB each at 500 x 375 on four
# photos, 6-7 % of the bytes of their JPEGs in both formats: counted twice over) and in a DALI shard one
# more tar member (a 512-byte header and up to 511 bytes of padding).
MASK_SHARE = 0.15
MASK_RECORD_BYTES = 1024


def disk_needed(m: schema.Manifest, side: int) -> int:
    """Bytes `make saliency` writes beside a dataset at its peak: the dataset rewritten with masks
    (staged beside the old one until the swap) and the maps, kept as `side` x `side` uint8 a record.
    The refinement's checkpoints fit in the masks' margin (computed, not measured, at ImageNet's
    size: 0.7 GB of the subset's float32 labels at 128 px and five networks, about 0.1 GB each for
    a ResNet-50 from INIT=, and the training stage's last epoch, its network with Adam's two moments
    and its labels, about 0.5 GB; against some 20 GB of margin)."""
    records = sum(m.counts.values())
    data = sum(f["bytes"] for f in m.files.values())
    return int(data * (1 + MASK_SHARE)) + records * (MASK_RECORD_BYTES + side * side)


def work_dir(dataset_dir: Path) -> Path:
    """Where the maps are kept until they are written (`MapStore`)."""
    return dataset_dir.with_name(f".{dataset_dir.name}.saliency-maps")


def refine_dir(dataset_dir: Path) -> Path:
    """Where the refinement's finished stages are kept until the masks are written."""
    return dataset_dir.with_name(f".{dataset_dir.name}.saliency-refine")


def check_disk(dataset_dir: Path, m: schema.Manifest, side: int) -> None:
    """Stop in one line, before any map is computed, when the dataset's file system has too little
    free space for `disk_needed` (the rewrite would otherwise fail at the end of hours of maps).

    Raises:
        LimitError: naming what is needed, what is free and the fix.
    """
    kept = [f for d in (work_dir(dataset_dir), refine_dir(dataset_dir)) if d.is_dir() for f in d.iterdir()]
    reclaimable = sum(f.stat().st_blocks * 512 for f in kept)     # an earlier run's: reused or replaced
    need, free = disk_needed(m, side), shutil.disk_usage(dataset_dir.parent).free + reclaimable
    if free < need:
        gib = 2 ** 30
        raise LimitError(f"make saliency needs about {need / gib:.1f} GiB free beside {dataset_dir} (the dataset "
                         f"rewritten with masks next to the old one until the swap, and the maps of "
                         f"{sum(m.counts.values()):,} records), but only {free / gib:.1f} GiB is free; free space "
                         "there, or write the dataset to a larger disk (make preprocess OUT=...)")


# ----------------------------------------------------------------------------- parallel maps

_READER: ShardReader | None = None
_SETTINGS: Settings | None = None


def _init(split_dir: str, count: int, settings: Settings) -> None:
    global _READER, _SETTINGS
    _READER, _SETTINGS = ShardReader.open(Path(split_dir), count), settings
    # One BLAS thread per process: the solves are 150 x 150, and several BLAS threads per process
    # fighting over the cores made a map 2.3x slower (0.34 vs 0.15 s per image on 2 busy cores).
    threadpool_limits(1)


def decode(reader: ShardReader, i: int) -> np.ndarray:
    """Record i of a split as an (H, W, 3) uint8 RGB image."""
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(reader.image(i))).convert("RGB"))


def as_uint8(p: np.ndarray) -> np.ndarray:
    """A [0, 1] map as the uint8 0-255 probabilities the maps are kept and written as."""
    return np.round(p * 255).astype(np.uint8)


def _maps_of(indices: list[int]) -> list[dict[str, np.ndarray]]:
    """Every method's map (and the fusion) of records `indices`, at the working size, uint8."""
    s = _SETTINGS
    side = (s.work_px, s.work_px)
    return [{k: as_uint8(v) for k, v in handcrafted.maps_and_fusion(decode(_READER, i), s.methods, s.work_px, side,
                                                                     s.max_work_px).items()}
            for i in indices]


def _drain(batches, total: int, settings: Settings, what: str, how: str, sink) -> float:
    """Hand every map of `batches` ((indices, maps) pairs) to `sink(i, maps)`, with a bar showing
    images/s and ETA on a terminal (a line a minute in a log) and one summary line; returns the
    seconds taken."""
    t0 = time.perf_counter()
    with progress_bar(total, what, settings.progress) as bar:
        for part, maps in batches:
            for i, m in zip(part, maps):
                sink(i, m)
            bar.update(len(part))
    seconds = time.perf_counter() - t0
    print(f"  {what}: {total} images in {seconds:.1f} s ({total / max(seconds, 1e-9):.1f} images/s, {how})", flush=True)
    return seconds


def map_records(split_dir: Path, count: int, indices: list[int], settings: Settings, what: str,
                sink) -> float:
    """Compute the maps of `indices` in `settings.workers` processes; `sink(i, maps)` receives each.

    Returns:
        Seconds taken. Shows a bar with images/s and ETA on a terminal (a line a minute in a log), and
        one summary line.
    """
    chunk = 16
    jobs = [indices[a:a + chunk] for a in range(0, len(indices), chunk)]
    if settings.workers <= 1:
        limits = threadpool_limits(1)          # undone below: this is the caller's process
        _init(str(split_dir), count, settings)
        results = map(_maps_of, jobs)
        pool = None
    else:
        pool = fork_context().Pool(settings.workers, _init, (str(split_dir), count, settings))
        results = pool.imap(_maps_of, jobs)
    try:
        return _drain(zip(jobs, results), len(indices), settings, what, f"{settings.workers} workers", sink)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        else:
            limits.restore_original_limits()


# ----------------------------------------------------------------------------- scoring


def score(maps: dict[int, dict[str, np.ndarray]], gt: np.ndarray | None) -> dict[str, dict]:
    """Per stage: MAE, F-β at 0.5, max-F and IoU at 0.5 against the ground truth (means over the
    subset), and label-free statistics (coverage at 0.5, share under the 5 % gate, share touching
    three or more image sides)."""
    stages = next(iter(maps.values())).keys()
    out = {}
    for stage in stages:
        rows = {"mae": [], "f_beta": [], "max_f": [], "iou": [], "coverage": [], "three_sides": []}
        for i, per in maps.items():
            p = per[stage].astype(np.float32) / 255.0
            if gt is not None:            # scored at the image's geometry, as the masks are written
                p = handcrafted.resize_map(p, gt[i].shape)
            mask = p >= 0.5
            rows["coverage"].append(float(mask.mean()))
            sides = [mask[0].any(), mask[-1].any(), mask[:, 0].any(), mask[:, -1].any()]
            rows["three_sides"].append(float(sum(sides) >= 3))
            if gt is not None:
                g = gt[i]
                rows["mae"].append(quality.mae(p, g))
                rows["f_beta"].append(quality.f_beta(p, g))
                rows["max_f"].append(quality.max_f(p, g))
                rows["iou"].append(quality.iou(p, g))
        cov = np.array(rows["coverage"])
        out[stage] = {"coverage_mean": float(cov.mean()), "under_5pct": float((cov < 0.05).mean()),
                      "three_sides": float(np.mean(rows["three_sides"])),
                      "coverage_histogram": np.histogram(cov, bins=10, range=(0, 1))[0].tolist()}
        if gt is not None:
            out[stage].update({k: float(np.mean(rows[k])) for k in ("mae", "f_beta", "max_f", "iou")})
    return out


def agreement(maps: dict[int, dict[str, np.ndarray]], methods: tuple[str, ...], rounds: int) -> dict[str, float]:
    """Label-free stability: the mean IoU at 0.5 between the masks of two stages on the same images,
    for the methods against each other, each method against its first round, each round against the
    next, and the final network against the handcrafted fusion."""
    pairs = [(a, b) for j, a in enumerate(methods) for b in methods[j + 1:]]
    for m in methods:
        chain = [m] + [f"{m}-r{k}" for k in range(1, rounds + 1)]
        pairs += list(zip(chain[:-1], chain[1:]))
    if rounds:
        pairs.append((handcrafted.FUSION, "final"))
    out = {}
    for a, b in pairs:
        ious = []
        for per in maps.values():
            pa = per[a].astype(np.float32) / 255
            pb = handcrafted.resize_map(per[b].astype(np.float32) / 255, pa.shape)
            ious.append(quality.iou(pa, (pb >= 0.5).astype(np.float32)))
        out[f"{a} vs {b}"] = float(np.mean(ious))
    return out


def map_key(dataset_dir: Path, stage: str, settings: Settings, side: int) -> dict:
    """What a stage's maps depend on besides a network's weights: the dataset (its manifest's
    checksum), the stage, the methods, working sides and every method's parameters; a `MapStore`
    resumes only under the same key."""
    manifest = (dataset_dir / schema.MANIFEST_NAME).read_bytes()
    return {"manifest_sha256": hashlib.sha256(manifest).hexdigest(), "stage": stage, "side": side,
            "methods": list(settings.methods), "work_px": settings.work_px, "max_work_px": settings.max_work_px,
            "slic": asdict(SlicParams()), "rbd": asdict(handcrafted.RbdParams()), "mr": asdict(handcrafted.MrParams()),
            "mc": asdict(handcrafted.McParams()), "dsr": asdict(DsrParams())}


def refine_key(dataset_dir: Path, settings: Settings, r: refine.RefineSettings, subset: list[int]) -> dict:
    """What the refinement depends on: the handcrafted maps it starts from (`map_key`), the subset
    and its settings; its checkpoints are used only under the same key."""
    return {**map_key(dataset_dir, "refinement", settings, r.net_px), "refinement": asdict(r),
            "subset_sha256": hashlib.sha256(np.asarray(subset, np.int64).tobytes()).hexdigest()}


def net_digest(net) -> str:
    """SHA-256 of a network's parameters and buffers, in order: a network's maps are resumed only
    with the same network."""
    h = hashlib.sha256()
    for name, value in net.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def best_stage(scores: dict[str, dict], refined: bool = False) -> str:
    """The stage with the highest IoU against the ground truth. Without one: the final network when
    it was refined from a self-supervised backbone (`INIT=`, the setting DeepUSPS's gains rely on),
    else the handcrafted fusion (a random-init network can drift rather than refine)."""
    if all("iou" in s for s in scores.values()):
        return max(scores, key=lambda k: scores[k]["iou"])
    return "final" if refined and "final" in scores else handcrafted.FUSION


# ----------------------------------------------------------------------------- main


def compute(dataset_dir: Path, settings: Settings, report_dir: Path | None = None) -> dict:
    """Run every stage on `dataset_dir` and write the masks; returns the `saliency` manifest entry.

    Raises:
        DatasetError: no complete dataset at `dataset_dir` (checked before its lock file is made).
        PreprocessError: its data root cannot be written (the lock file cannot be made), or another run
            writes the dataset.
    """
    dataset_dir = Path(dataset_dir)
    schema.read_manifest(dataset_dir, verify="size")     # a missing dataset is named before its lock is made
    lock = DatasetLock(dataset_dir.parent, dataset_dir.name)
    lock.acquire()                 # before reading: `make preprocess --force` may not swap it meanwhile
    r = settings.refinement
    try:
        # The dense CRF's processes, forked once before anything is read or trained, for the whole run.
        with CrfPool(settings.crf_workers or 1) as crf:
            return _compute(dataset_dir, settings, report_dir, crf if r.crf else None)
    finally:
        lock.release()


def _compute(dataset_dir: Path, settings: Settings, report_dir: Path | None, crf: CrfPool | None) -> dict:
    m = schema.read_manifest(dataset_dir)
    n = m.counts["train"]
    rng = np.random.default_rng(settings.seed)
    order = rng.permutation(n).tolist()
    subset = sorted(order[:min(settings.subset, n)])
    held = sorted(order[len(subset):len(subset) + settings.score_images])
    gt = np.load(dataset_dir / m.gt_masks["train"], mmap_mode="r") if "train" in m.gt_masks else None
    r = settings.refinement
    if r.rounds and r.net_px == 0:        # the images' own side, within 64-128 px
        r = replace(r, net_px=int(min(max(m.image_px, 64), 128)))
    check_disk(dataset_dir, m, max(settings.work_px, r.net_px))
    print(f"saliency for {dataset_dir.name}: {len(subset)} of {n} train images, methods "
          f"{', '.join(settings.methods)} at {settings.work_px}-{settings.max_work_px} px, seed {settings.seed}; "
          + (f"refinement: {r.rounds} rounds of {r.epochs} epochs, final {r.final_epochs} epochs, {r.loss} loss, "
             f"{'backbone from ' + str(r.init) if r.init else r.backbone + ' at random init'}, {r.net_px} px"
             if r.rounds else "no refinement") + f"; scored on {len(held) or len(subset)} "
          + ("held-out" if held else "subset") + " images", flush=True)
    if gt is None and r.rounds and not r.init:
        print("  no ground truth and no INIT=: the masks written will be the handcrafted fusion; the "
              "networks are trained and scored for the report only (--rounds 0 skips them, INIT=runs/<run> uses them)",
              flush=True)
    train_dir = dataset_dir / "train"

    sub_maps: dict[int, dict[str, np.ndarray]] = {}
    seconds = {"handcrafted_subset": map_records(train_dir, n, subset, settings, "handcrafted maps",
                                                 lambda i, maps: sub_maps.__setitem__(i, maps))}
    held_maps: dict[int, dict[str, np.ndarray]] = {}
    if held:
        seconds["handcrafted_scored"] = map_records(train_dir, n, held, settings, "handcrafted maps (scored)",
                                                    lambda i, maps: held_maps.__setitem__(i, maps))
    scored = held_maps or sub_maps           # a dataset the subset covers whole is scored in-sample
    nets: dict[str, refine.NetStage] = {}
    label_scores = {}
    if r.rounds:
        import torch

        torch.set_num_threads(settings.workers)
        subset_images = read_images(train_dir, n, subset, r.net_px)
        x = refine.as_input(subset_images, m.mean, m.std)
        targets = {k: np.stack([handcrafted.resize_map(sub_maps[i][k].astype(np.float32) / 255, (r.net_px, r.net_px))
                                for i in subset]) for k in settings.methods}
        if checkpoint_folder(refine_dir(dataset_dir), refine_key(dataset_dir, settings, r, subset)):
            print("  refinement: resuming from the stages an earlier run finished", flush=True)
        out = refine.refine(x, targets, r, images=subset_images, crf=crf, checkpoints=refine_dir(dataset_dir))
        seconds.update({f"refine_{k}": round(v, 2) for k, v in out.seconds.items()})
        nets = {k: refine.NetStage(net, r.net_px, m.mean, m.std, crf=crf) for k, net in out.nets.items()}
        images = read_images(train_dir, n, list(scored), r.net_px)
        for k, stage in nets.items():
            for i, p in zip(scored, stage.maps(images)):
                scored[i][k] = as_uint8(p)
        label_scores = score({i: {k: as_uint8(v[j]) for k, v in out.labels.items()} for j, i in enumerate(subset)}, gt)
    scores = score(scored, gt)
    stage = best_stage(scores, refined=bool(r.rounds and r.init))
    print("  " + " | ".join(f"{k}: IoU {v['iou']:.3f}" if "iou" in v else f"{k}: coverage {v['coverage_mean']:.2f}"
                            for k, v in scores.items()) + f" → using {stage}", flush=True)

    side = r.net_px if stage in nets else settings.work_px   # resized to each image when written
    key = map_key(dataset_dir, stage, settings, side)
    if stage in nets:                  # and the network itself
        key |= {"refinement": asdict(r), "net_sha256": net_digest(nets[stage].net)}
    work = work_dir(dataset_dir)
    store = MapStore(work, m.counts, side, key)
    if store.resumed:
        print(f"  resuming: {store.resumed:,} of {sum(m.counts.values()):,} maps kept from an earlier run", flush=True)
    written = False
    try:
        for split, count in m.counts.items():
            if split == "train" and stage not in nets:   # the subset's handcrafted maps are already computed
                for i in subset:
                    store.put(split, i, sub_maps[i][stage])
            todo = store.todo(split)

            def sink(i, maps, split=split):
                store.put(split, i, maps[stage])
            if not todo:
                seconds[f"maps_{split}"] = 0.0
            elif stage in nets:
                seconds[f"maps_{split}"] = net_records(dataset_dir / split, count, todo, nets[stage], stage, settings,
                                                       f"{split} masks", sink)
            else:                        # only the methods the stage is made of (all of them for the fusion)
                needs = replace(settings, methods=(stage,) if stage in settings.methods else settings.methods)
                seconds[f"maps_{split}"] = map_records(dataset_dir / split, count, todo, needs, f"{split} masks",
                                                       sink)
        store.flush()
        saliency = {"stage": stage, "methods": list(settings.methods), "stages_scored": sorted(scores),
                    "scores": scores, "label_scores": label_scores,
                    "agreement": agreement(scored, settings.methods, r.rounds),
                    "scored_against": "ground truth (synthetic)" if gt is not None else "none (label-free statistics)",
                    "scored_on": f"{len(held)} held-out train images" if held else f"the {len(subset)} subset images",
                    "subset": len(subset), "seed": settings.seed, "work_px": settings.work_px,
                    "max_work_px": settings.max_work_px,
                    "slic": {"segments": "side²/600, 150-500, >= 100 working px each",
                             "compactness": SlicParams.compactness, "sigma": SlicParams.sigma},
                    **({"dsr": asdict(DsrParams())} if "dsr" in settings.methods else {}),
                    "threshold": 0.5, "refinement": _describe(r), "backbone": _backbone(r),
                    "seconds": {k: round(v, 2) for k, v in seconds.items()}}
        t = time.perf_counter()
        write_masks(dataset_dir, {s: (lambda i, a=a: a[i]) for s, a in store.maps.items()}, saliency,
                    workers=settings.workers, progress=settings.progress)
        saliency["seconds"]["write"] = round(time.perf_counter() - t, 2)
        written = True
    finally:
        if written:
            store.remove()
            shutil.rmtree(refine_dir(dataset_dir), ignore_errors=True)
        else:
            print(f"the maps computed so far are kept in {work}" + (f" and the refined networks in "
                  f"{refine_dir(dataset_dir)}" if r.rounds else "") + ": the same command resumes from them "
                  "(delete them to start afresh)", file=sys.stderr)
    if report_dir is not None:
        from preprocess.saliency.report import case_scores, write_report
        t = time.perf_counter()
        saliency["cases"] = case_scores(settings.methods, per_case=settings.case_images, work_px=settings.work_px,
                                        max_work_px=settings.max_work_px, nets=nets)
        saliency["seconds"]["cases"] = round(time.perf_counter() - t, 2)
        write_report(report_dir, dataset_dir, saliency, sub_maps, gt, nets)
    return saliency


def _describe(r: refine.RefineSettings) -> dict | str:
    return asdict(r) if r.rounds else "none (handcrafted stages only)"


def _backbone(r: refine.RefineSettings) -> dict | None:
    if not r.rounds:
        return None
    if r.init is None:
        return {"timm_model": r.backbone, "init": "random"}
    from models.saliency import backbone_source

    meta = backbone_source(r.init)
    return {"timm_model": meta["timm_model"], "init": meta["path"], "small_stem": meta.get("small_stem"),
            "method": meta.get("method")}


def read_images(split_dir: Path | ShardReader, count: int, indices: list[int], px: int) -> np.ndarray:
    """Records `indices` of a split (its folder, or a reader of it) decoded and resized to
    (len, px, px, 3) uint8."""
    reader = split_dir if isinstance(split_dir, ShardReader) else ShardReader.open(Path(split_dir), count)
    out = np.empty((len(indices), px, px, 3), np.uint8)
    for j, i in enumerate(indices):
        out[j] = handcrafted.resize_square(decode(reader, i), px)
    return out


def net_records(split_dir: Path, count: int, indices: list[int], stage: refine.NetStage, name: str,
                settings: Settings, what: str, sink) -> float:
    """The network's maps of `indices` in batches, `sink(i, {name: uint8 map})` for each; a progress bar
    with images/s on a terminal, one summary line otherwise. Returns seconds taken."""
    chunk = 256
    parts = [indices[a:a + chunk] for a in range(0, len(indices), chunk)]
    reader = ShardReader.open(Path(split_dir), count)         # one for the whole split: its descriptors bounded
    batches = ((part, [{name: as_uint8(p)} for p in stage.maps(read_images(reader, count, part, stage.px))])
               for part in parts)
    return _drain(batches, len(indices), settings, what, f"network {name}", sink)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
