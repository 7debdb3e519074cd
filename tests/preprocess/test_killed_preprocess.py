"""Killed mid-run, nothing stays behind: `python -m preprocess` (2 workers) and `python -m
preprocess.saliency`, started as process-group leaders, are killed with SIGKILL part-way, on their main
process alone (the OOM killer, `kill -9 PID`) and on their whole group (a scheduler's job kill). Within a
few seconds no process of the run is left; the same command again says the dead run's lock is stale,
resumes, and writes files identical, checksum by checksum, to an uninterrupted run's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from preprocess import stream
from tests.processes import kill_and_reap, left_after, live, start, wait_for
from tests.readers import _Beton, read_masks

FILES = 600                      # 30 % of them val; 640 x 480 JPEGs, re-encoded at --max-side: about 2 s of work
SHARD = 20                       # files per unit: 21 train units and 9 val units
GONE_S = 3.0                     # "within a few seconds": a child polls its parent every 0.2 s


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory) -> Path:
    """600 JPEGs in 3 classes: 12 drawn images, each written under 50 names (distinct files, cheap to make)."""
    src = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    drawn = []
    for k in range(12):
        smooth = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        image = Image.fromarray(smooth).resize((640, 480), Image.BILINEAR)
        noisy = np.asarray(image, np.int16) + rng.integers(-20, 21, (480, 640, 3))
        path = src / f"drawn{k}.jpg"
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        drawn.append(path)
    for i in range(FILES):
        folder = src / ("val" if i % 10 < 3 else "train") / f"c{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(drawn[i % len(drawn)], folder / f"{i:04d}.jpg")
    for path in drawn:
        path.unlink()
    return src


def checksums(dataset: Path) -> dict[str, str]:
    """sha256 of every file of a written dataset but the manifest and its stamp (they hold timings);
    the manifest's own table of files and checksums is compared as a whole."""
    out = {f.relative_to(dataset).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
           for f in sorted(dataset.rglob("*")) if f.is_file() and f.name not in (schema.MANIFEST_NAME, ".verified.json")}
    out["manifest files"] = json.dumps(json.loads((dataset / schema.MANIFEST_NAME).read_text())["files"], sort_keys=True)
    return out


def finished_units(out: Path) -> int:
    parts = out / ".imagefolder.staging" / stream.PARTS
    return sum(1 for _ in parts.glob("*/shard-*.json")) if parts.is_dir() else 0


def preprocess_words(src: Path, out: Path) -> list[str]:
    return ["-m", "preprocess", "--dataset", "imagefolder", "--src", str(src), "--out", str(out), "--workers", "2",
            "--shard-size", str(SHARD), "--max-side", "320"]


@pytest.mark.slow
def test_preprocess_killed_on_its_main_process_then_on_its_group_leaves_nothing_and_resumes_exactly(
        jpeg_folder, tmp_path) -> None:
    reference = start(preprocess_words(jpeg_folder, tmp_path / "reference"))
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    out = tmp_path / "out"

    # 1. kill -9 of the main process once a unit is done: its workers, forked in the middle of their
    #    units, end with it, and the lock it recorded is stale.
    run = start(preprocess_words(jpeg_folder, out))
    wait_for(lambda: finished_units(out) >= 1 and len(live(run.mark)) >= 3, 120, "finished unit with workers at work", run)
    noted = kill_and_reap(run)
    assert left_after(run.mark, GONE_S, noted) == []
    done_first = finished_units(out)
    assert 1 <= done_first < FILES // SHARD and not (out / "imagefolder").exists()

    # 2. The same command resumes; killed with its whole group after one more unit.
    run = start(preprocess_words(jpeg_folder, out))
    wait_for(lambda: finished_units(out) > done_first and len(live(run.mark)) >= 3, 120, "another unit", run)
    noted = kill_and_reap(run, group=True)
    assert left_after(run.mark, GONE_S, noted) == []
    assert finished_units(out) < FILES // SHARD and not (out / "imagefolder").exists()

    # 3. The same command again finishes what is left.
    run = start(preprocess_words(jpeg_folder, out))
    assert run.wait(timeout=300) == 0, run.stderr.read()
    err = run.stderr.read()
    assert "the lock of imagefolder is stale: its run (pid " in err and "resuming: " in err
    assert left_after(run.mark, GONE_S) == []
    assert checksums(out / "imagefolder") == checksums(tmp_path / "reference" / "imagefolder")


@pytest.mark.slow
def test_saliency_killed_while_its_workers_run_leaves_nothing_and_the_rerun_writes_the_same_masks(tmp_path) -> None:
    from preprocess.prepare import prepare_dataset

    prepare_dataset("synthetic", tmp_path / "a", workers=1, train_size=32, val_size=8, image_px=32, seed=4)
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    def saliency(root: Path):
        return start(["-m", "preprocess.saliency", "--root", str(root), "--subset", "16", "--workers", "2",
                      "--work-px", "64", "--report", str(root / "reports"), "--case-images", "2", "--score-images",
                      "4", "--rounds", "1", "--epochs", "1", "--final-epochs", "1"])

    reference = saliency(tmp_path / "a")
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    run = saliency(tmp_path / "b")
    wait_for(lambda: len(live(run.mark)) >= 3, 120, "saliency workers", run)
    noted = kill_and_reap(run)
    assert left_after(run.mark, GONE_S, noted) == []
    rerun = saliency(tmp_path / "b")
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read()
    assert "the lock of synthetic is stale" in rerun.stderr.read()
    assert checksums(tmp_path / "b" / "synthetic") == checksums(tmp_path / "a" / "synthetic")
    assert os.listdir(tmp_path / "b") == os.listdir(tmp_path / "a")          # no work folder left


@pytest.mark.slow
def test_saliency_killed_in_its_handcrafted_pass_resumes_from_the_maps_it_kept(tmp_path) -> None:
    from preprocess.prepare import prepare_dataset

    prepare_dataset("synthetic", tmp_path / "a", workers=1, train_size=160, val_size=8, image_px=32, seed=5)
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    def saliency(root: Path):           # no refinement: a handcrafted stage is written, its maps kept
        return start(["-m", "preprocess.saliency", "--root", str(root), "--subset", "8", "--workers", "2",
                      "--rounds", "0", "--report", str(root / "reports"), "--case-images", "1", "--score-images",
                      "4"])

    reference = saliency(tmp_path / "a")
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    run = saliency(tmp_path / "b")
    flags = tmp_path / "b" / ".synthetic.saliency-maps" / "train.done.npy"

    def some_maps_kept() -> bool:
        try:
            return 32 <= int(np.load(flags, mmap_mode="r").sum()) <= 112
        except (OSError, ValueError):    # not made yet
            return False
    wait_for(some_maps_kept, 120, "part of the train maps", run)
    noted = kill_and_reap(run, group=True)
    kept = int(np.load(flags).sum())
    assert left_after(run.mark, GONE_S, noted) == []
    rerun = saliency(tmp_path / "b")
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read()
    assert f"resuming: {kept} of 168 maps kept from an earlier run" in rerun.stdout.read()
    # Every file as the uninterrupted run wrote it but the .beton files: FFCV's own writer, which
    # writes this split's pixels, places records on its pages in the order its two processes reach
    # them (the same records, another layout); read back, their masks and images are equal.
    a, b = checksums(tmp_path / "a" / "synthetic"), checksums(tmp_path / "b" / "synthetic")
    assert set(a) == set(b)
    assert all(a[k] == b[k] for k in a if not k.endswith(".beton") and k != "manifest files")
    for split, count in (("train", 160), ("val", 8)):
        ma, mb = (read_masks(tmp_path / r / "synthetic" / f"{split}.beton")[0] for r in "ab")
        ba, bb = (_Beton(tmp_path / r / "synthetic" / f"{split}.beton") for r in "ab")
        assert all(np.array_equal(ma[i], mb[i]) and np.array_equal(ba.image(i), bb.image(i)) for i in range(count))
    assert os.listdir(tmp_path / "b") == os.listdir(tmp_path / "a")          # no work folder left


@pytest.mark.slow
def test_a_local_ray_instance_ends_with_the_run_that_started_it(jpeg_folder, tmp_path) -> None:
    """`--engine ray` without RAY_ADDRESS starts Ray on this machine (GCS, raylet, agents, workers):
    killed on its main process once a unit is done, nothing of it is left within a few seconds (Ray's
    agents alone would live on for a minute)."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    run = start([*preprocess_words(jpeg_folder, out), "--engine", "ray"], RAY_ADDRESS="")
    wait_for(lambda: finished_units(out) >= 1, 180, "a finished unit", run)
    noted = kill_and_reap(run)
    assert left_after(run.mark, GONE_S, noted) == []
