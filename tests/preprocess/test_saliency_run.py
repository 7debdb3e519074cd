"""`make saliency` end to end on a few dozen tiny images: scored stages, the best one written into
both formats at each image's geometry, the report, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines import schema
from preprocess.prepare import prepare_dataset
from preprocess.saliency import quality
from preprocess.saliency.__main__ import main
from preprocess.saliency.run import disk_needed
from tests.readers import COVERAGE_ATOL, _Beton, read_masks


@pytest.mark.slow
def test_make_saliency_writes_the_best_stage_into_both_formats_with_a_report(tmp_path, capsys) -> None:
    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=24, val_size=8, image_px=32, seed=4)
    need = disk_needed(schema.read_manifest(ds), 64)       # checked against the free space before any map
    argv = ["--root", str(root), "--subset", "12", "--workers", "2", "--work-px", "64",
            "--report", str(tmp_path / "reports"), "--case-images", "2", "--score-images", "8",
            "--rounds", "1", "--epochs", "1", "--final-epochs", "1", "--methods", "rbd,mr,dsr"]
    assert main(argv) == 0
    m = schema.read_manifest(ds, verify="full")
    sal = m.saliency
    # The estimate covers what was written beside the old dataset: the new one and the 64-px maps.
    written = sum(f["bytes"] for f in m.files.values()) + sum(m.counts.values()) * 64 * 64
    assert written <= need <= 2 * written
    assert m.has_masks and m.mask_source == "saliency" and sal["subset"] == 12
    # Every stage is scored on held-out images: the handcrafted ones, each round's network, the final one.
    assert set(sal["scores"]) == {"rbd", "mr", "dsr", "fusion", "rbd-r1", "mr-r1", "dsr-r1", "final"}
    assert set(sal["label_scores"]) == {"rbd-r1", "mr-r1", "dsr-r1"} and sal["scored_on"] == "8 held-out train images"
    assert sal["refinement"]["rounds"] == 1 and sal["backbone"] == {"timm_model": "test_resnet", "init": "random"}
    assert sal["methods"] == ["rbd", "mr", "dsr"] and sal["dsr"]["scales"][-1] == [400, 30.0]
    assert set(sal["agreement"]) == {"rbd vs mr", "rbd vs dsr", "mr vs dsr", "rbd vs rbd-r1", "mr vs mr-r1",
                                     "dsr vs dsr-r1", "fusion vs final"}
    assert all(0 <= v <= 1 for v in sal["agreement"].values())
    # The stage used is the one with the best IoU against the synthetic ground truth.
    assert sal["stage"] == max(sal["scores"], key=lambda k: sal["scores"][k]["iou"])
    gt = np.load(ds / m.gt_masks["train"])
    masks, coverage = read_masks(ds / "train.beton")
    beton = _Beton(ds / "train.beton")
    ious = []
    for i, mask in enumerate(masks):
        assert mask.shape == beton.image(i).shape[:2] and set(np.unique(mask)) <= {0, 255}
        assert coverage[i] == pytest.approx(np.mean(mask >= 128), abs=COVERAGE_ATOL)
        ious.append(quality.iou(mask / 255.0, gt[i]))
    # Far from perfect on 32-px images, but the masks find the objects (a random mask scores ~0.15).
    assert np.mean(ious) > 0.35
    report = tmp_path / "reports" / "saliency-synthetic"
    assert json.loads((report / "report.json").read_text())["stage"] == sal["stage"]
    md = (report / "report.md").read_text()
    assert "| fusion |" in md and "| final |" in md and "| border |" in md and "| thin |" in md
    assert set(json.loads((report / "report.json").read_text())["cases"]["thin"]) == set(sal["scores"])
    assert (report / "grid.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in root.iterdir() if p.suffix != ".lock") == ["synthetic"]        # no work files left


@pytest.mark.slow
def test_an_image_folder_without_ground_truth_gets_the_handcrafted_fusion_at_each_image_geometry(tmp_path, capsys) -> None:
    """ImageNet's case: JPEGs of several sizes, no exact masks, no INIT=. Every stage is scored by
    label-free statistics only, the handcrafted fusion is written (maps of the larger images worked at
    `--max-work-px`), and each mask has its image's geometry and finds the drawn object."""
    from PIL import Image

    rng = np.random.default_rng(3)
    sizes = [(150, 200), (200, 150), (96, 120), (64, 64)]
    discs = {}
    for split, n in (("train", 12), ("val", 4)):
        for k in range(n):
            h, w = sizes[k % len(sizes)]
            image = (rng.integers(150, 200, (1, 1, 3)) + rng.normal(0, 6, (h, w, 3))).clip(0, 255)
            yy, xx = np.mgrid[0:h, 0:w]
            disc = (yy - h * rng.uniform(0.4, 0.6)) ** 2 + (xx - w * rng.uniform(0.4, 0.6)) ** 2 < (0.25 * min(h, w)) ** 2
            image[disc] = rng.integers(0, 80, 3)
            folder = tmp_path / "src" / split / f"c{k % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.astype(np.uint8)).save(folder / f"{k:02d}.jpg", quality=92)
            discs[f"{split}/c{k % 2}/{k:02d}.jpg"] = disc
    root = tmp_path / "data"
    ds = prepare_dataset("imagefolder", root, src=tmp_path / "src", workers=1, max_side=0)
    files = sorted(p.relative_to(ds).as_posix() for p in ds.rglob("*"))
    argv = ["--root", str(root), "--dataset", "imagefolder", "--workers", "1", "--subset", "8", "--score-images", "4",
            "--max-work-px", "160", "--rounds", "1", "--epochs", "1", "--final-epochs", "1", "--case-images", "1",
            "--report", str(tmp_path / "reports")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no ground truth and no INIT=: the masks written will be the handcrafted fusion" in out
    m = schema.read_manifest(ds, verify="full")
    sal = m.saliency
    assert sal["stage"] == "fusion" and sal["scored_against"] == "none (label-free statistics)"
    assert all("iou" not in v and "coverage_mean" in v for v in sal["scores"].values())
    assert sal["max_work_px"] == 160 and "final" in sal["scores"]
    assert sorted(p.relative_to(ds).as_posix() for p in ds.rglob("*")) == files      # nothing dropped
    ious = []
    for split, count in m.counts.items():
        masks, _ = read_masks(ds / f"{split}.beton")
        names = (ds / split / schema.NAMES_NAME).read_text().splitlines()       # record i's source file
        for i in range(count):
            disc = discs[names[i]]
            assert masks[i].shape == disc.shape
            ious.append(quality.iou(masks[i] / 255.0, disc.astype(np.float32)))
    assert len(ious) == 16 and min(ious) > 0.6 and np.mean(ious) > 0.8


def test_too_little_disk_stops_before_any_map_and_leaves_the_dataset(tmp_path, capsys, monkeypatch) -> None:
    import shutil

    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=8, val_size=4, image_px=32, seed=1)
    before = {p.name: p.stat().st_mtime_ns for p in ds.rglob("*")}
    need = disk_needed(schema.read_manifest(ds), 128)
    usage = shutil.disk_usage(root)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    assert main(["--root", str(root), "--rounds", "0", "--workers", "1", "--report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "make saliency needs about" in err and "free space" in err
    assert {p.name: p.stat().st_mtime_ns for p in ds.rglob("*")} == before
    assert sorted(p.name for p in root.iterdir() if p.suffix != ".lock") == ["synthetic"]
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need))
    assert main(["--root", str(root), "--rounds", "0", "--workers", "1", "--subset", "4", "--score-images", "2",
                 "--case-images", "1", "--report", str(tmp_path / "r")]) == 0


@pytest.mark.slow
def test_a_failed_write_keeps_the_maps_and_the_same_command_resumes_from_them(tmp_path, capsys, monkeypatch) -> None:
    import shutil

    from preprocess.prepare import PreprocessError
    from preprocess.saliency import run

    def argv(root, *more):
        return ["--root", str(root), "--rounds", "0", "--workers", "1", "--subset", "6", "--score-images", "4",
                "--case-images", "1", "--report", str(root / "r"), *more]

    prepare_dataset("synthetic", tmp_path / "a", workers=1, train_size=16, val_size=6, image_px=32, seed=2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(argv(tmp_path / "a")) == 0                              # the reference, in one go

    def full_disk(*args, **kwargs):
        raise PreprocessError("writing masks failed (disk is full); the dataset is unchanged")
    monkeypatch.setattr(run, "write_masks", full_disk)
    assert main(argv(tmp_path / "b")) == 2
    work = run.work_dir(tmp_path / "b" / "synthetic")
    assert "the maps computed so far are kept in" in capsys.readouterr().err
    assert json.loads((work / "key.json").read_text())["max_work_px"] == 256
    assert main(argv(tmp_path / "b", "--max-work-px", "200")) == 2      # other settings: made afresh
    assert "resuming" not in capsys.readouterr().out
    assert json.loads((work / "key.json").read_text())["max_work_px"] == 200
    # As if killed partway through the val split: two of its maps never written.
    done = np.load(work / "val.done.npy", mmap_mode="r+")
    maps = np.load(work / "val.npy", mmap_mode="r+")
    done[[1, 4]], maps[[1, 4]] = 0, 0
    done.flush(), maps.flush()
    del done, maps
    monkeypatch.undo()
    assert main(argv(tmp_path / "b", "--max-work-px", "200")) == 0
    out = capsys.readouterr().out
    assert "resuming: 20 of 22 maps kept from an earlier run" in out and "val masks: 2 images" in out
    assert "train masks:" not in out                                      # nothing left to do there
    assert schema.read_manifest(tmp_path / "b" / "synthetic").files == schema.read_manifest(tmp_path / "a" / "synthetic").files
    assert not work.exists()


@pytest.mark.slow
def test_a_failed_write_after_the_refinement_resumes_without_training_or_mapping_again(tmp_path, capsys,
                                                                                       monkeypatch) -> None:
    """The refinement's finished stages and a network's maps are kept like a handcrafted stage's: the
    same command takes them (the same masks as an uninterrupted run); other refinement settings make
    them afresh."""
    import shutil

    from preprocess.prepare import PreprocessError
    from preprocess.saliency import run

    def argv(root, *more):
        return ["--root", str(root), "--rounds", "1", "--epochs", "1", "--final-epochs", "1", "--workers", "1",
                "--subset", "8", "--score-images", "4", "--work-px", "64", "--case-images", "1",
                "--report", str(root / "r"), *more]

    monkeypatch.setattr(run, "best_stage", lambda scores, refined=False: "final")    # a network's maps written
    prepare_dataset("synthetic", tmp_path / "a", workers=1, train_size=16, val_size=6, image_px=32, seed=3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(argv(tmp_path / "a")) == 0                              # the reference, in one go
    capsys.readouterr()
    def full_disk(*args, **kwargs):
        raise PreprocessError("writing masks failed (disk is full); the dataset is unchanged")
    with monkeypatch.context() as patched:
        patched.setattr(run, "write_masks", full_disk)
        assert main(argv(tmp_path / "b", "--epochs", "2")) == 2         # other settings: trained, then failed
        assert "kept from an earlier run" not in capsys.readouterr().out
        assert main(argv(tmp_path / "b")) == 2
        out, err = capsys.readouterr()
        assert "kept from an earlier run" not in out and "resuming" not in out
        assert "and the refined networks in" in err
    assert main(argv(tmp_path / "b")) == 0
    out = capsys.readouterr().out
    assert "refinement: resuming from the stages an earlier run finished" in out
    assert "rbd-r1: kept from an earlier run" in out and "final: kept from an earlier run" in out
    assert "resuming: 22 of 22 maps kept from an earlier run" in out and "images/s, network" not in out
    assert schema.read_manifest(tmp_path / "b" / "synthetic").files == schema.read_manifest(tmp_path / "a" / "synthetic").files
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.suffix != ".lock") == ["r", "synthetic"]


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    assert main(["--root", str(tmp_path), "--dataset", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: dataset folder") and "make preprocess" in err and "\n" not in err
    assert main(["--root", str(tmp_path), "--methods", "rbd,hs"]) == 2
    assert "unknown saliency method hs" in capsys.readouterr().err
    assert main(["--root", str(tmp_path), "--work-px", "128", "--max-work-px", "96"]) == 2
    assert "--max-work-px >= --work-px" in capsys.readouterr().err


def test_a_missing_dataset_is_named_before_the_lock_and_a_read_only_root_is_one_line(tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """The lock file `.<name>.lock` was made before the dataset was looked for, and on a read-only root
    its OSError (Errno 30) ended the command with a traceback and exit status 1."""
    import errno

    from pipelines.processes import FolderLock

    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=8, val_size=4, image_px=16, seed=1)
    before = {p.relative_to(root): p.stat().st_mtime_ns for p in root.rglob("*")}
    argv = ["--root", str(root), "--rounds", "0", "--workers", "1", "--report", str(tmp_path / "r")]
    assert main([*argv, "--dataset", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: dataset folder") and "nosuch" in err, err
    assert not (root / ".nosuch.lock").exists()                      # looked for before its lock is made

    def read_only(lock):
        raise OSError(errno.EROFS, "Read-only file system", str(lock.path))

    monkeypatch.setattr(FolderLock, "acquire", read_only)
    for dataset in ("nosuch", ds.name):
        assert main([*argv, "--dataset", dataset]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("error: "), err
    assert f"data root {root} cannot be written (Read-only file system)" in err and "writable" in err
    assert {p.relative_to(root): p.stat().st_mtime_ns for p in root.rglob("*")} == before
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_init_starts_the_networks_from_a_viewmill_backbone_and_the_manifest_says_so(tmp_path) -> None:
    from models.backbone import build_backbone, save_backbone

    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=16, val_size=4, image_px=32, seed=5)
    backbone, _ = build_backbone("test_resnet", 32)           # as a 32-px run exports it: small stem
    (tmp_path / "run").mkdir()
    path = save_backbone(backbone, tmp_path / "run" / "backbone.safetensors", "test_resnet", 32,
                         metadata={"method": "dacl"})
    argv = ["--root", str(root), "--subset", "12", "--workers", "1", "--work-px", "64", "--score-images", "4",
            "--rounds", "1", "--epochs", "1", "--final-epochs", "1", "--init", str(tmp_path / "run"),
            "--report", str(tmp_path / "reports"), "--case-images", "1"]
    assert main(argv) == 0
    sal = schema.read_manifest(ds).saliency
    assert sal["backbone"] == {"timm_model": "test_resnet", "init": str(path), "small_stem": "true", "method": "dacl"}
    assert "initialised from" in (tmp_path / "reports" / "saliency-synthetic" / "report.md").read_text()


def test_a_bad_init_is_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=8, val_size=4, image_px=32, seed=6)
    before = sorted(p.name for p in ds.iterdir())
    assert main(["--root", str(root), "--init", str(tmp_path / "nosuch-run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: INIT: no backbone file") and "make train" in err and "\n" not in err
    assert sorted(p.name for p in ds.iterdir()) == before and not schema.read_manifest(ds).has_masks


def test_agreement_is_the_mean_iou_between_two_stages_masks() -> None:
    from preprocess.saliency.run import agreement

    left = np.zeros((8, 8), np.uint8)
    left[:, :4] = 255
    right = left[:, ::-1].copy()
    half = np.zeros((16, 16), np.uint8)              # another size: resized to the first map's
    half[:, :8] = 255
    maps = {0: {"rbd": left, "mr": right, "fusion": left, "final": half},
            1: {"rbd": left, "mr": left, "fusion": right, "final": half}}
    got = agreement(maps, ("rbd", "mr"), rounds=0)
    assert got == {"rbd vs mr": 0.5}                 # disjoint on one image, equal on the other
    maps = {i: {**per, "rbd-r1": per["rbd"], "mr-r1": per["rbd"]} for i, per in maps.items()}
    got = agreement(maps, ("rbd", "mr"), rounds=1)
    assert got["rbd vs rbd-r1"] == 1.0 and got["mr vs mr-r1"] == 0.5 and got["fusion vs final"] == 0.5


def test_the_stage_used_is_the_best_by_iou_else_the_networks_only_from_init_else_the_fusion() -> None:
    from preprocess.saliency.run import best_stage

    scored = {"rbd": {"iou": 0.5}, "fusion": {"iou": 0.55}, "rbd-r1": {"iou": 0.7}, "final": {"iou": 0.65}}
    assert best_stage(scored) == best_stage(scored, refined=True) == "rbd-r1"
    label_free = {k: {"coverage_mean": 0.2} for k in scored}            # a dataset without ground truth
    assert best_stage(label_free, refined=True) == "final"              # networks started from INIT=
    assert best_stage(label_free) == "fusion"                           # random init: they may drift
    assert best_stage({"rbd": {}, "mr": {}, "fusion": {}}, refined=True) == "fusion"    # --rounds 0
