"""Labelled folders without a val/ split (`SRC/train/<class>/*` alone, or torchvision's ImageFolder
layout `SRC/<class>/*`): each class keeps its label and a seeded share of each class is held out as the
val split; read back from the written shards. Under `--labels auto` the ImageFolder layout is named in
one line, since it is read as unlabelled images, and the rerun it suggests is not taken for done."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.schema import read_manifest
from pipelines.shards import ShardReader
from preprocess.__main__ import main as preprocess_main
from preprocess.imagefolder import held_out, held_out_per_class

CLASSES = {"cat": 7, "dog": 12, "owl": 1}       # uneven, and a class too small to hold anything out


def class_folders(root: Path) -> dict[bytes, str]:
    """JPEGs in `root/<class>/`, RGB and small, so that each is stored as its own bytes: {bytes: class}."""
    rng = np.random.default_rng(0)
    out = {}
    for name, n in CLASSES.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            path = root / name / f"{i:02d}.jpg"
            Image.fromarray(rng.integers(0, 255, (16, 20, 3), dtype=np.uint8)).save(path, quality=90)
            out[path.read_bytes()] = name
    return out


def write(src: Path, out: Path, *extra: str) -> Path:
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(src), "--out", str(out), "--name", "mine",
                            "--workers", "1", *extra]) == 0
    return out / "mine"


def splits(ds: Path) -> dict[str, list[tuple[bytes, str]]]:
    """Each split's records as (image bytes, class name), read back from the DALI shards."""
    names = read_manifest(ds).class_names
    out = {}
    for split in ("train", "val"):
        reader = ShardReader.open(ds / split)
        out[split] = [(reader.image(i), names[label]) for i, label in enumerate(reader.labels)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["SRC/train/<class>", "SRC/<class>"])
def test_a_labelled_folder_without_val_holds_out_a_seeded_share_of_each_class(tmp_path, layout) -> None:
    src = tmp_path / "src"
    truth = class_folders(src / "train" if layout.startswith("SRC/train") else src)
    # Jupyter's copies beside the classes are not a class (nor images of one).
    copies = (src / "train" if layout.startswith("SRC/train") else src) / ".ipynb_checkpoints"
    copies.mkdir()
    (copies / "00-checkpoint.jpg").write_bytes(next(iter(truth)))
    ds = write(src, tmp_path / "out", "--labels", "folders", "--val-fraction", "0.2")
    m = read_manifest(ds)
    assert m.labelled and list(m.class_names) == sorted(CLASSES)
    got = splits(ds)
    # Every image once, with its own folder's label.
    assert sorted(b for b, _ in got["train"] + got["val"]) == sorted(truth)
    assert all(truth[b] == name for b, name in got["train"] + got["val"])
    # Of each class of two or more some are held out and some kept; the one-image class is kept whole;
    # the val split is about the share asked for.
    val = {c: sum(name == c for _, name in got["val"]) for c in CLASSES}
    assert val["owl"] == 0 and all(1 <= val[c] < CLASSES[c] for c in ("cat", "dog"))
    assert abs(len(got["val"]) - 0.2 * sum(CLASSES.values())) <= 1
    # The draw is seeded: the same again, another seed another draw.
    again = splits(write(src, tmp_path / "again", "--labels", "folders", "--val-fraction", "0.2"))
    other = splits(write(src, tmp_path / "other", "--labels", "folders", "--val-fraction", "0.2", "--val-seed", "1"))
    assert got["val"] == again["val"] and sorted(got["val"]) != sorted(other["val"])


def test_the_share_held_out_of_each_class_follows_the_folder_s_and_leaves_each_class_an_image() -> None:
    for counts in ([7, 12, 1], [1300] * 1000, [2, 2, 2], [5000, 40, 3], [1, 1, 9]):
        for fraction in (0.01, 0.1, 0.5):
            k = held_out_per_class(counts, fraction)
            assert all(0 <= kc < n or n == kc == 0 for kc, n in zip(k, counts))     # each class keeps one
            assert all(kc >= 1 for kc, n in zip(k, counts) if n >= 2)
            assert abs(sum(k) - held_out(sum(counts), fraction)) <= len(counts)


def test_auto_names_a_folder_that_looks_like_classes_and_reads_it_unlabelled(tmp_path, capsys) -> None:
    class_folders(tmp_path / "src")
    ds = write(tmp_path / "src", tmp_path / "out")
    said = capsys.readouterr().out
    assert "its 3 sub-folders are classes, give --labels folders" in said
    assert not read_manifest(ds).labelled
    # Doing as told: the unlabelled dataset is not taken for the labelled one asked, --force rewrites it.
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                            "--name", "mine", "--labels", "folders"]) == 2
    assert "was written with --labels auto, not --labels folders as asked: pass --force" in capsys.readouterr().err
    assert read_manifest(write(tmp_path / "src", tmp_path / "out", "--labels", "folders", "--force")).labelled


def test_a_val_folder_without_train_is_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    class_folders(tmp_path / "src" / "val")
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                            "--labels", "folders"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "has a val/ folder but no train/ folder: lay it out as SRC/train/<class>/* and SRC/val/<class>/*" in err
    assert not (tmp_path / "out" / "imagefolder").exists()


def test_a_rerun_with_the_default_labels_takes_a_folder_written_with_the_layout_they_pick(tmp_path, capsys) -> None:
    """`--labels auto` reads SRC/train/<class>/* as `folders` does: a dataset written with `--labels folders`
    is the one a rerun without the option asks for (nothing to do, not a refusal that offers --force)."""
    class_folders(tmp_path / "src" / "train")
    ds = write(tmp_path / "src", tmp_path / "out", "--labels", "folders")
    manifest = (ds / "manifest.json").read_bytes()
    capsys.readouterr()
    write(tmp_path / "src", tmp_path / "out")
    assert "nothing to do" in capsys.readouterr().out and (ds / "manifest.json").read_bytes() == manifest
