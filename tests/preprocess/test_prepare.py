"""prepare_dataset: a complete synthetic dataset, manifest facts, rerun, --force, kills and disk failures."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import pickle
import shutil
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipelines import schema
from pipelines.schema import DatasetError, read_manifest
from preprocess import prepare
from preprocess.prepare import prepare_dataset
from preprocess.sources import PreprocessError
from preprocess.synthetic import SyntheticSplit

TINY = dict(train_size=48, val_size=16, image_px=32)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """One real tiny synthetic dataset (both writers, gt masks in the mask field)."""
    return prepare_dataset("synthetic", tmp_path_factory.mktemp("data"), workers=2, shard_size=20,
                           gt_masks_as_mask=True, **TINY)


def test_complete_dataset_layout_and_manifest(dataset: Path) -> None:
    m = read_manifest(dataset, verify="full")
    assert m.schema_version == schema.SCHEMA_VERSION and m.dataset == "synthetic" and m.source == "synthetic"
    assert m.counts == {"train": 48, "val": 16} and m.num_classes == 10 == len(m.class_names)
    assert m.image_mode == "raw" and m.image_px == 32 and m.has_masks is True and m.jpeg_quality is None
    assert m.params["gt_masks_as_mask"] is True and m.skipped == ()
    assert m.mask_source == "synthetic_ground_truth" and m.shard_size == 20 and m.size_policy is None
    assert m.gt_masks == {"train": "gt_masks/train.npy", "val": "gt_masks/val.npy"}
    assert m.formats == {"ffcv": {"train": "train.beton", "val": "val.beton"},
                         "dali": {"train": [f"train/shard-00000{k}.tar" for k in range(3)],
                                  "val": ["val/shard-000000.tar"]}}
    assert json.loads((dataset / schema.MANIFEST_NAME).read_text())["num_classes"] == 10   # for other tools
    on_disk = sorted(p.relative_to(dataset).as_posix() for p in dataset.rglob("*") if p.is_file())
    assert sorted(m.files) == [f for f in on_disk if f not in (schema.MANIFEST_NAME, schema.VERIFIED_NAME)]
    assert {"train.beton", "val.beton", "gt_masks/train.npy", "train/shard-000002.tar",
            "train/shard-000002.idx", "val/shard-000000.tar"} <= set(m.files)
    for rel, info in m.files.items():
        assert schema.sha256_file(dataset / rel) == info["sha256"]
        assert (dataset / rel).stat().st_size == info["bytes"]
    assert [p.name for p in dataset.parent.glob(".*")] == [".synthetic.lock"]   # no staging or old folder


def test_every_file_gets_the_permissions_of_a_new_file(dataset: Path) -> None:
    """Readable by whoever may read what this user writes (the umask), as the shards are: the FFCV files
    once kept their temporary files' 0600, a dataset no one else on a shared machine could read."""
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.relative_to(dataset).as_posix(): p.stat().st_mode & 0o777 for p in dataset.rglob("*") if p.is_file()}
    assert "train.beton" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_gt_masks_and_mean_std_match_the_source(dataset: Path) -> None:
    m = read_manifest(dataset)
    src = SyntheticSplit(48, image_px=32)
    masks = np.load(dataset / "gt_masks" / "train.npy")
    assert masks.shape == (48, 32, 32) and masks.dtype == np.uint8
    images = np.stack([src[i].image for i in range(48)]).reshape(-1, 3) / 255.0   # (N*H*W, 3)
    assert np.allclose(m.mean, images.mean(0)) and np.allclose(m.std, images.std(0))
    for i in (0, 31, 47):
        assert np.array_equal(masks[i], src.gt_mask(i))
    with tarfile.open(dataset / "train" / "shard-000000.tar") as tar:
        names = tar.getnames()
    assert f"{schema.record_key(0)}.{schema.DALI_MASK_EXT}" in names                 # masks were written
    assert len([n for n in names if n.endswith(".cls")]) == 20


def test_rerun_on_complete_dataset_does_nothing(dataset: Path, capsys) -> None:
    before = {p: p.stat().st_mtime_ns for p in dataset.rglob("*")}
    assert prepare_dataset("synthetic", dataset.parent, gt_masks_as_mask=True, **TINY) == dataset
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*")} == before


def test_a_rerun_asking_for_other_parameters_is_refused_in_one_line_and_changes_nothing(dataset: Path) -> None:
    """A complete dataset is not taken for one asked with other parameters (it was "nothing to do", and
    the run trained on the old records): the one line names what was written and what is asked."""
    before = {p: p.stat().st_mtime_ns for p in dataset.rglob("*")}
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("synthetic", dataset.parent, gt_masks_as_mask=True, **{**TINY, "train_size": 40, "seed": 1})
    assert str(e.value) == (f"{dataset} was written with --train-size 48, --seed 0, not --train-size 40, --seed 1 as "
                            "asked: pass --force to rewrite it, or give --name another name to write a second dataset")
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*")} == before


def test_a_rerun_adds_the_record_tables_a_dataset_written_before_them_lacks(dataset: Path, tmp_path: Path,
                                                                           monkeypatch, capsys) -> None:
    """A dataset written before the record tables existed (simulated: tables and their manifest entries
    removed, its stamp kept): `make preprocess` again writes each split's table, lists it in the manifest
    and re-hashes nothing else, then or when the dataset is next opened; the loaders map the tables."""
    from pipelines.shards import ShardReader
    from tests.readers import assert_table_is_the_scan

    old = tmp_path / "synthetic"
    shutil.copytree(dataset, old)
    m = read_manifest(old)
    tables = {f"{s}/{schema.RECORDS_NAME}" for s in m.counts}
    assert tables <= set(m.files)                                  # a dataset written now has them
    for rel in tables:
        (old / rel).unlink()
    stamp = {rel: schema.file_stat_key(old / rel) for rel in m.files if rel not in tables}
    prepare.write_manifest(old, replace(m, files={k: v for k, v in m.files.items() if k not in tables}), stamp)
    shards_before = {p: p.stat().st_mtime_ns for p in old.rglob("*.tar")}

    hashed: list[str] = []
    real = schema.sha256_file
    monkeypatch.setattr(schema, "sha256_file", lambda p, *a: hashed.append(Path(p).relative_to(old).as_posix())
                        or real(p, *a))
    assert prepare_dataset("synthetic", tmp_path, gt_masks_as_mask=True, **TINY) == old
    assert "added the record table of train, val" in capsys.readouterr().out
    assert sorted(hashed) == sorted(tables)
    hashed.clear()
    assert set(read_manifest(old).files) == set(m.files) and hashed == []
    assert {p: p.stat().st_mtime_ns for p in old.rglob("*.tar")} == shards_before
    for split, n in m.counts.items():
        assert_table_is_the_scan(old / split, n)
        assert ShardReader.open(old / split, n).table_path is not None
    assert read_manifest(old, verify="full").files == m.files
    assert prepare_dataset("synthetic", tmp_path, gt_masks_as_mask=True, **TINY) == old
    assert "nothing to do" in capsys.readouterr().out


def _partial_writer(exc: BaseException):
    """A DALI writer that writes part of a shard, then fails like a dying disk or a kill."""
    def write(split, out_dir, *, shard_size, num_workers, progress):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "shard-000000.tar").write_bytes(b"\0" * 1000)
        raise exc
    return write


def test_disk_failure_keeps_previous_dataset(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "data"
    first = prepare_dataset("synthetic", root, workers=1, **TINY)
    manifest_before = (first / schema.MANIFEST_NAME).read_bytes()
    monkeypatch.setattr(prepare, "write_dali", _partial_writer(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("synthetic", root, force=True, workers=1, seed=7, **TINY)
    msg = str(e.value)
    assert "\n" not in msg and "disk is full" in msg and "nothing was replaced" in msg
    assert (first / schema.MANIFEST_NAME).read_bytes() == manifest_before
    assert read_manifest(first, verify="full").params["seed"] == 0      # old dataset intact
    assert sorted(p.name for p in root.iterdir() if p.suffix != ".lock") == ["synthetic"]      # staging cleaned up


def test_killed_run_leaves_nothing_accepted_and_next_run_cleans_up(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "data"
    monkeypatch.setattr(prepare, "write_dali", _partial_writer(KeyboardInterrupt()))
    monkeypatch.setattr(prepare, "remove_quietly", lambda path: None)  # a kill runs no cleanup
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("synthetic", root, workers=1, **TINY)
    staging = root / ".synthetic.staging"
    assert (staging / "train" / "shard-000000.tar").exists()            # half-written leftovers
    for folder in (root / "synthetic", staging):
        with pytest.raises(DatasetError):
            read_manifest(folder)
    monkeypatch.undo()
    done = prepare_dataset("synthetic", root, workers=1, **TINY)
    assert read_manifest(done).counts == {"train": 48, "val": 16}
    assert not staging.exists()


def test_force_rewrites_and_swap_never_exposes_a_mixed_folder(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "data"
    first = prepare_dataset("synthetic", root, workers=1, **TINY)
    old_beton = (first / "train.beton").read_bytes()
    # Die inside the swap, after the old manifest is removed: no reader may accept what is there.
    real_replace = prepare.os.replace
    calls: list[tuple[str, str]] = []

    def dying_replace(a, b):
        calls.append((Path(a).name, Path(b).name))
        if Path(b).name == "synthetic":
            raise KeyboardInterrupt
        return real_replace(a, b)

    monkeypatch.setattr(prepare.os, "replace", dying_replace)
    monkeypatch.setattr(prepare, "remove_quietly", lambda path: None)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("synthetic", root, force=True, workers=1, seed=5, **TINY)
    monkeypatch.undo()
    assert (".synthetic.staging", "synthetic") in calls
    for folder in (root / "synthetic", root / ".synthetic.old"):       # readers open only the first
        with pytest.raises(DatasetError):
            read_manifest(folder)
    again = prepare_dataset("synthetic", root, workers=1, seed=5, **TINY)  # incomplete → rewritten
    m = read_manifest(again, verify="full")
    assert m.params["seed"] == 5 and (again / "train.beton").read_bytes() != old_beton
    assert sorted(p.name for p in root.iterdir() if p.suffix != ".lock") == ["synthetic"]
    forced = prepare_dataset("synthetic", root, force=True, workers=1, seed=6, **TINY)
    assert read_manifest(forced).params["seed"] == 6


def test_manifest_is_written_last(dataset: Path) -> None:
    m_time = (dataset / schema.MANIFEST_NAME).stat().st_mtime_ns
    assert all((dataset / rel).stat().st_mtime_ns <= m_time for rel in read_manifest(dataset).files)
    json.loads((dataset / schema.MANIFEST_NAME).read_text())


def test_cifar10_end_to_end(tmp_path: Path) -> None:
    src = tmp_path / "cifar-10-batches-py"
    src.mkdir()
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(src / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                         b"labels": [int(v) for v in rng.integers(0, 10, 4)]}, f)
    with open(src / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"k{i}".encode() for i in range(10)]}, f)
    d = prepare_dataset("cifar10", tmp_path / "out", src=tmp_path, workers=1)
    m = read_manifest(d)
    assert m.counts == {"train": 20, "val": 4} and m.class_names[3] == "k3"
    assert m.image_mode == "raw" and m.image_px == 32 and m.has_masks is False and m.mask_source is None
    assert "gt_masks/train.npy" not in m.files and m.gt_masks == {} and m.source == "cifar10"
    assert m.params == {"src": str(tmp_path.resolve())}


def test_fresh_dataset_is_not_rehashed_on_open(dataset: Path, monkeypatch) -> None:
    hashed: list[str] = []
    real = schema.sha256_file
    monkeypatch.setattr(schema, "sha256_file", lambda p, *a: hashed.append(str(p)) or real(p, *a))
    read_manifest(dataset)
    assert hashed == []          # preprocess stamped the checksums it computed while writing


def test_without_ffcv_the_dali_files_are_written_and_ffcv_refuses_with_the_fix(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    """A machine without FFCV (the GPU machine reads with DALI; its import blocked here as an absent
    package is): the DALI shards and the manifest are written, the manifest lists DALI only, said in one
    line naming the extra, the DALI loader reads it and, once ffcv is there, the ffcv backend names the fix."""
    import sys

    from pipelines.loader import build_loader
    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe

    with monkeypatch.context() as blocked:
        blocked.setitem(sys.modules, "ffcv", None)
        out = prepare.prepare_dataset("synthetic", tmp_path, workers=1, train_size=16, val_size=8, image_px=16)
    err = capsys.readouterr().err.strip()
    assert "writing the DALI shards only" in err and "pip install 'viewmill[ffcv]'" in err
    assert len(err.splitlines()) == 1, err
    m = read_manifest(out)
    assert set(m.formats) == {"dali"} and not list(out.glob("*.beton"))
    spec = LoaderSpec(root=str(tmp_path), dataset="synthetic", split="train", recipe=load_recipe("plain", 16, 8),
                      batch_size=8)
    assert next(iter(build_loader("dali", spec))).global_views.shape[1:] == (8, 3, 16, 16)
    if importlib.util.find_spec("ffcv") is not None:
        with pytest.raises(DatasetError, match="without ffcv installed.*--force"):
            build_loader("ffcv", spec)


def test_a_second_run_on_the_same_dataset_refuses_in_one_line(tmp_path: Path) -> None:
    from preprocess.prepare import DatasetLock
    from preprocess.saliency.run import Settings, compute
    from preprocess.sources import PreprocessError

    ds = prepare_dataset("synthetic", tmp_path, workers=1, train_size=8, val_size=4, image_px=16)
    before = (ds / schema.MANIFEST_NAME).read_bytes()
    other = DatasetLock(tmp_path, "synthetic")          # what a first run still writing holds
    other.acquire()
    try:
        for run in (lambda: prepare_dataset("synthetic", tmp_path, workers=1, force=True, train_size=8,
                                            val_size=4, image_px=16),
                    lambda: compute(ds, Settings(subset=4))):
            with pytest.raises(PreprocessError, match=rf"another run \(pid {os.getpid()}: this process\) is writing synthetic"):
                run()
        assert (ds / schema.MANIFEST_NAME).read_bytes() == before
    finally:
        other.release()
    prepare_dataset("synthetic", tmp_path, workers=1, force=True, train_size=8, val_size=4, image_px=16)


def test_a_dataset_made_in_memory_is_the_same_bytes_in_every_run(tmp_path: Path) -> None:
    """The same synthetic dataset written twice with 2 workers: every file has the same bytes, its
    `.beton` files included (FFCV's own writer, used before, put each 64-record chunk where the process
    that took it happened to be: 3 different files in 3 runs), and the manifest's checksums are the
    files'."""
    pytest.importorskip("ffcv")
    size = dict(TINY, train_size=640)                        # 10 chunks of FFCV's writer
    one, two = (prepare_dataset("synthetic", tmp_path / name, workers=2, shard_size=200, gt_masks_as_mask=True,
                                **size) for name in ("one", "two"))
    first, second = read_manifest(one, verify="full"), read_manifest(two, verify="full")
    assert "train.beton" in first.files and first.files == second.files
