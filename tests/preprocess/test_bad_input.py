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


# ---- the destination OUT/<name> ---------------------------------------------------------------

def _cli(capsys, *args: str) -> tuple[int, str]:
    """`python -m preprocess ARGS` in this process: (exit status, stderr)."""
    from preprocess.__main__ import main

    rc = main([*args, "--workers", "1"])
    return rc, capsys.readouterr().err.strip()


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else b"" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", ["user-folder", "file", "src-is-dest", "src-in-dest", "dest-in-src"])
def test_a_destination_no_viewmill_write_made_or_the_source_is_refused_and_left_alone(tmp_path, capsys, case) -> None:
    """OUT/<name> that is not a dataset folder (a user's thesis, a file) or is, holds or lies in the
    source is refused in one line before anything is read or written (it was deleted by the swap)."""
    out = tmp_path / "out"
    photos = _folder(out, {"photos": {"a": 2}}) / "photos"             # out/photos/a/{0,1}.png
    args = {"user-folder": ["--src", str(photos), "--name", "mine"],
            "file": ["--src", str(photos), "--name", "mine"],
            "src-is-dest": ["--src", str(photos), "--name", "photos"],
            "src-in-dest": ["--src", str(photos / "a"), "--name", "photos"],
            "dest-in-src": ["--src", str(out), "--name", "photos"]}[case]
    if case == "user-folder":
        (out / "mine").mkdir()
        (out / "mine" / "thesis.txt").write_text("four years of work")
    elif case == "file":
        (out / "mine").write_text("a file, not a folder")
    before = _tree(tmp_path)
    rc, err = _cli(capsys, "--dataset", "imagefolder", "--labels", "none", "--out",
                   str(out if case != "dest-in-src" else photos), *args)
    assert rc == 2 and err.startswith("error: ") and "\n" not in err, err
    assert {"user-folder": "not a viewmill dataset", "file": "not a folder", "src-is-dest": "is the destination",
            "src-in-dest": "is the destination", "dest-in-src": "inside --src"}[case] in err
    assert "--name" in err or "--out" in err
    assert _tree(tmp_path) == before                                    # nothing touched, not even a lock file


def test_a_dataset_folder_a_swap_left_without_its_manifest_is_still_rewritten(tmp_path, capsys) -> None:
    """What a viewmill write leaves at OUT/<name> stays replaceable: a swap that died after removing the
    manifest leaves the stamp and the files (rewritten without --force); a complete one with --force."""
    args = ["--dataset", "synthetic", "--train-size", "8", "--val-size", "4", "--image-px", "16",
            "--out", str(tmp_path), "--name", "ds"]
    assert _cli(capsys, *args)[0] == 0
    (tmp_path / "ds" / schema.MANIFEST_NAME).unlink()
    assert _cli(capsys, *args, "--seed", "1")[0] == 0
    assert read_manifest(tmp_path / "ds").params["seed"] == 1
    assert _cli(capsys, *args, "--seed", "2", "--force")[0] == 0
    assert read_manifest(tmp_path / "ds").params["seed"] == 2


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", ".hidden"])
def test_a_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, capsys, name) -> None:
    """`--name .` made OUT itself the dataset folder: it was moved to a hidden `.out.old` and deleted."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _cli(capsys, "--dataset", "synthetic", "--train-size", "8", "--val-size", "4", "--out", str(out),
                   "--name", name)
    assert rc == 2 and "\n" not in err and f"--name {name!r} is not a plain folder name" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and _tree(out) == {"keep.txt": b"mine"}


def test_an_image_given_as_the_source_is_not_read_as_a_list(tmp_path, capsys) -> None:
    """--src x.jpg was read as a list file: `'utf-8' codec can't decode byte 0xff`."""
    Image.new("RGB", (12, 10), (200, 50, 90)).save(tmp_path / "x.jpg")
    (tmp_path / "x.dat").write_bytes((tmp_path / "x.jpg").read_bytes())     # whatever its name
    for src in ("x.jpg", "x.dat"):
        rc, err = _cli(capsys, "--dataset", "imagefolder", "--src", str(tmp_path / src), "--out", str(tmp_path / "out"))
        assert rc == 2 and "\n" not in err and "not a text list of image paths" in err, err
        assert "pass the folder holding the images" in err and "codec" not in err
    assert not (tmp_path / "out").exists()


def test_a_list_naming_an_image_twice_is_refused(tmp_path, capsys) -> None:
    """Three lines, two images: the repeat passed the 'at least 2 images' check, then a 1-image train split."""
    _folder(tmp_path, {"img": {"c": 2}})
    (tmp_path / "list.txt").write_text("img/c/0.png\nimg/c/1.png\n./img/c/0.png\n")
    rc, err = _cli(capsys, "--dataset", "imagefolder", "--src", str(tmp_path / "list.txt"),
                   "--out", str(tmp_path / "out"))
    assert rc == 2 and "\n" not in err and "names 1 image(s) again" in err and "0.png" in err, err
    assert "list each image once" in err and not (tmp_path / "out").exists()


def test_a_symlink_loop_in_the_source_lists_each_image_once(tmp_path) -> None:
    """os.walk(followlinks=True) followed `sub/up -> ..` again and again: sub/up/sub/up/.../0.png.
    Each real folder is walked once; a link to a folder outside is still followed."""
    from preprocess.imagefolder import list_unlabelled

    src = _folder(tmp_path / "src", {"sub": {"c": 2}})                  # src/sub/c/{0,1}.png
    _folder(tmp_path / "elsewhere", {"more": {"d": 2}})
    (src / "sub" / "up").symlink_to("..", target_is_directory=True)
    (src / "more").symlink_to(tmp_path / "elsewhere" / "more", target_is_directory=True)
    splits = list_unlabelled(src, val_fraction=0.5, seed=0)
    names = sorted(os.path.relpath(p, src) for split in splits.values() for p, _ in split)
    assert names == ["more/d/0.png", "more/d/1.png", "sub/c/0.png", "sub/c/1.png"]
