"""Bad input: one-line refusals naming the fix, and counted skips of unreadable images."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.schema import DatasetError, Manifest, read_manifest
from preprocess import prepare
from preprocess.cifar import CifarError, load_cifar
from preprocess.imagefolder import ImageFolderError
from preprocess.prepare import prepare_dataset
from preprocess.sources import DATASETS, PreprocessError


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


# ---- manifests -------------------------------------------------------------------------------

def _fake_dataset(root: Path, version: int = schema.SCHEMA_VERSION) -> Path:
    """A dataset folder with two files and a manifest listing them (what readers check)."""
    d = root / "ds"
    (d / "train").mkdir(parents=True)
    (d / "train.beton").write_bytes(os.urandom(4000))
    (d / "train" / "shard-000000.tar").write_bytes(os.urandom(3000))
    files = {rel: {"sha256": schema.sha256_file(d / rel), "bytes": (d / rel).stat().st_size}
             for rel in ("train.beton", "train/shard-000000.tar")}
    m = Manifest(schema_version=version, dataset="ds", source="synthetic", counts={"train": 1},
                 class_names=("a", "b"), image_mode="raw", image_px=8, has_masks=False,
                 mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), files=files)
    (d / schema.MANIFEST_NAME).write_bytes(m.to_json())
    return d


def test_missing_folder_and_missing_manifest_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as e:
        read_manifest(tmp_path / "nope")
    assert "run make preprocess" in _one_line(e)
    d = _fake_dataset(tmp_path)
    (d / schema.MANIFEST_NAME).unlink()
    with pytest.raises(DatasetError) as e:
        read_manifest(d)
    assert "incomplete" in _one_line(e) and "make preprocess" in str(e.value)


def test_manifest_from_a_newer_schema_is_refused(tmp_path: Path) -> None:
    d = _fake_dataset(tmp_path, version=schema.SCHEMA_VERSION + 1)
    with pytest.raises(DatasetError) as e:
        read_manifest(d)
    assert "newer" in _one_line(e) and "upgrade" in str(e.value)


def test_malformed_manifest_is_refused(tmp_path: Path) -> None:
    d = _fake_dataset(tmp_path)
    assert read_manifest(d).counts == {"train": 1}
    (d / schema.MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(DatasetError) as e:
        read_manifest(d)
    assert "not valid JSON" in _one_line(e)


def test_manifest_without_a_required_key_is_refused(tmp_path: Path) -> None:
    d = _fake_dataset(tmp_path)
    m = json.loads((d / schema.MANIFEST_NAME).read_text())
    del m["counts"], m["mean"]
    (d / schema.MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(DatasetError) as e:
        read_manifest(d)
    assert "lacks counts, mean" in _one_line(e) and "--force" in str(e.value)


def test_size_mismatch_and_missing_file_are_refused(tmp_path: Path) -> None:
    d = _fake_dataset(tmp_path)
    read_manifest(d)
    with open(d / "train.beton", "ab") as f:
        f.write(b"x")
    with pytest.raises(DatasetError) as e:
        read_manifest(d)
    assert "bytes" in _one_line(e) and "--force" in str(e.value)
    (d / "train.beton").unlink()
    with pytest.raises(DatasetError) as e:
        read_manifest(d)
    assert "missing" in _one_line(e)


def test_checksum_policy_stamp_and_full(tmp_path: Path, monkeypatch) -> None:
    d = _fake_dataset(tmp_path)
    hashed: list[str] = []
    real = schema.sha256_file
    monkeypatch.setattr(schema, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    read_manifest(d)
    assert sorted(hashed) == ["shard-000000.tar", "train.beton"]     # first open: full hash, stamped
    hashed.clear()
    read_manifest(d)
    assert hashed == []                                              # unchanged files: no re-hash
    f = d / "train.beton"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF                                                 # same size, new content
    f.write_bytes(bytes(data))
    with pytest.raises(DatasetError) as e:                            # mtime changed → re-hashed
        read_manifest(d)
    assert "sha256" in _one_line(e)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))                  # a forger who keeps the mtime ...
    read_manifest(d)                                                  # ... passes the stamp check
    with pytest.raises(DatasetError):                                 # ... but not a full verification
        read_manifest(d, verify="full")


# ---- sources ---------------------------------------------------------------------------------

def test_unknown_dataset_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("imagenet", tmp_path)
    assert all(n in _one_line(e) for n in DATASETS)


def test_missing_not_a_folder_and_unreadable_src(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("cifar10", tmp_path / "out", src=tmp_path / "missing")
    assert "does not exist" in _one_line(e)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("cifar10", tmp_path / "out", src=tmp_path / "file")
    assert "not a folder" in _one_line(e)
    with pytest.raises(ImageFolderError) as e:          # an image folder may be a list of image paths
        prepare_dataset("imagefolder", tmp_path / "out", src=tmp_path / "file")
    assert "files" in _one_line(e) and "do not exist" in _one_line(e)
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("cifar100", tmp_path / "out")
    assert "--src is required" in _one_line(e)
    # Tests may run as root, for whom chmod 000 still reads: report what os.access says instead.
    monkeypatch.setattr(prepare.os, "access", lambda path, mode: Path(path) != tmp_path / "src")
    (tmp_path / "src").mkdir()
    with pytest.raises(PreprocessError) as e:
        prepare_dataset("cifar10", tmp_path / "out", src=tmp_path / "src")
    assert "not readable" in _one_line(e)
    assert not (tmp_path / "out").exists()                            # nothing written on bad input


def _cifar10(root: Path) -> None:
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(root / name, "wb") as f:
            pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 9]}, f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"x"] * 10}, f)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("damage,expect", [
    ("missing", "data_batch_3 is missing"),
    ("garbage", "not a readable CIFAR pickle"),
    ("shape", "expected (N, 3072) uint8"),
    ("labels", "labels outside [0, 10)"),
    ("count", "1 labels for 2 images"),
    ("evil", "not allowed"),
])
def test_cifar_missing_or_malformed_batch(tmp_path: Path, damage: str, expect: str) -> None:
    _cifar10(tmp_path)
    bad = tmp_path / "data_batch_3"
    content = {"garbage": b"\x80\x04garbage",
               "shape": pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}),
               "labels": pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}),
               "count": pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}),
               "evil": pickle.dumps({b"data": _Evil(), b"labels": [0, 1]})}
    if damage == "missing":
        bad.unlink()
    else:
        bad.write_bytes(content[damage])
    with pytest.raises(CifarError) as e:
        load_cifar("cifar10", tmp_path)
    assert expect in _one_line(e) and "cifar.html" in str(e.value)


def _folder(root: Path, layout: dict[str, dict[str, int]]) -> Path:
    for split, classes in layout.items():
        for cls, n in classes.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (12, 10), (i * 20, 50, 90)).save(root / split / cls / f"{i}.png")
    return root


@pytest.mark.parametrize("layout,expect", [
    ({"train": {"a": 2, "b": 0}, "val": {"a": 1}}, "has no image files"),
    ({"train": {"a": 2}, "val": {}}, "has no images (empty split)"),
    ({"train": {}, "val": {"a": 1}}, "no class folders (empty split)"),
    ({"train": {"a": 1}}, "has no class of 2 or more images"),
    ({"train": {"a": 1}, "val": {"z": 1}}, "classes not in train"),
])
def test_image_folder_structure_errors(tmp_path: Path, layout, expect: str) -> None:
    src = _folder(tmp_path / "src", layout)
    for split in ("train", "val"):
        if split in layout:
            (src / split).mkdir(parents=True, exist_ok=True)
    with pytest.raises(ImageFolderError) as e:
        prepare_dataset("imagefolder", tmp_path / "out", src=src)
    assert expect in _one_line(e)
    assert not (tmp_path / "out" / "imagefolder").exists()


def test_class_list_errors(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", {"train": {"a": 1, "b": 1}, "val": {"a": 1}})
    (tmp_path / "list.txt").write_text("a\nmissing\n")
    with pytest.raises(ImageFolderError) as e:
        prepare_dataset("imagefolder", tmp_path / "out", src=src, class_list=tmp_path / "list.txt")
    assert "'missing'" in _one_line(e)
    with pytest.raises(ImageFolderError) as e:
        prepare_dataset("imagefolder", tmp_path / "out", src=src, class_list=tmp_path / "nope.txt")
    assert "does not exist" in _one_line(e)


def test_unreadable_images_are_skipped_counted_and_listed(tmp_path: Path) -> None:
    """Odd colour modes are converted; corrupt, truncated and zero-byte files are skipped; .txt ignored."""
    src = _folder(tmp_path / "src", {"train": {"cat": 2, "dog": 2}, "val": {"cat": 1, "dog": 1}})
    cat, dog = src / "train" / "cat", src / "train" / "dog"
    Image.new("L", (16, 12), 90).save(cat / "gray.png")
    Image.new("CMYK", (16, 12), (0, 255, 0, 0)).save(cat / "cmyk.jpg")
    Image.new("RGBA", (16, 12), (1, 2, 3, 0)).save(dog / "rgba.png")
    Image.new("P", (16, 12), 3).save(dog / "pal.gif")
    Image.frombytes("I;16", (4, 2), np.full(8, 40000, "<u2").tobytes()).save(dog / "deep.png")
    good = (cat / "gray.png").read_bytes()
    jpg = np.random.default_rng(0).integers(0, 255, (40, 40, 3), np.uint8)
    Image.fromarray(jpg).save(cat / "full.jpg", quality=90)
    (cat / "trunc.jpg").write_bytes((cat / "full.jpg").read_bytes()[:300])
    (dog / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 50)
    (dog / "zero.jpg").write_bytes(b"")
    (dog / "notes.txt").write_text("not an image")
    (src / "val" / "cat" / "empty.png").write_bytes(b"")
    assert good
    d = prepare_dataset("imagefolder", tmp_path / "out", src=src, workers=2, max_side=14)
    m = read_manifest(d, verify="full")
    skipped = {s["path"]: s["reason"] for s in m.skipped}
    assert sorted(skipped) == ["train/cat/trunc.jpg", "train/dog/corrupt.png", "train/dog/zero.jpg",
                               "val/cat/empty.png"]
    assert skipped["train/dog/zero.jpg"] == "zero-byte file"
    assert m.counts == {"train": 4 + 3 + 3, "val": 2}               # 2+2 plain, gray/cmyk/full, rgba/pal/deep
    assert m.class_names == ("cat", "dog") and m.image_mode == "jpg" and m.jpeg_quality == 90
    assert m.size_policy == {"side": "longer", "max_side_px": 14} and m.image_px == 14
    assert all(0.0 <= v <= 1.0 for v in m.mean + m.std)
