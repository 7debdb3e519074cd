"""Unlabelled images: any folder (flat or nested, with or without val/) or a list of paths becomes a
dataset whose manifest says it has no labels, with a seeded held-out val split; bad input is one line
and writes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.schema import read_manifest
from pipelines.shards import scan_shards
from preprocess.__main__ import main as preprocess_main
from preprocess.imagefolder import VAL_MIN, held_out


def images(root: Path, n: int, nested: bool = True) -> list[Path]:
    """`n` small JPEGs under `root`, spread over nested folders (a camera dump, not classes)."""
    rng = np.random.default_rng(n)
    out = []
    for i in range(n):
        d = root / (f"day{i % 3}/cam{i % 2}" if nested and i % 4 else "")
        d.mkdir(parents=True, exist_ok=True)
        out.append(d / f"shot{i:03d}.jpg")
        Image.fromarray(rng.integers(0, 255, (20 + i % 7, 24, 3), dtype=np.uint8)).save(out[-1], quality=90)
    (root / "notes.txt").write_text("not an image")
    return out


def write(src: Path, out: Path, *extra: str) -> int:
    return preprocess_main(["--dataset", "imagefolder", "--src", str(src), "--out", str(out), "--name", "mine",
                            "--workers", "1", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_folder_of_images_without_classes_is_an_unlabelled_dataset_with_a_held_out_split(tmp_path, nested) -> None:
    files = images(tmp_path / "src", 60, nested)
    assert write(tmp_path / "src", tmp_path / "out") == 0
    m = read_manifest(tmp_path / "out" / "mine")
    assert not m.labelled and m.num_classes == 0 and m.params["labels"] == "auto"
    assert m.counts == {"train": 60 - held_out(60, 0.01), "val": held_out(60, 0.01)} and m.counts["val"] == 6
    stored = {}
    for split in ("train", "val"):
        records = scan_shards(tmp_path / "out" / "mine" / split, m.counts[split])
        assert {r.label for r in records} == {schema.NO_LABEL}
        stored[split] = records
    assert sum(len(r) for r in stored.values()) == len(files)        # every image once, the text file ignored
    # The held-out draw is seeded: the same again, another seed another draw.
    assert write(tmp_path / "src", tmp_path / "again") == 0
    assert write(tmp_path / "src", tmp_path / "other", "--val-seed", "1") == 0
    sizes = {d: [r.image_size for r in scan_shards(tmp_path / d / "mine" / "val")] for d in ("out", "again", "other")}
    assert sizes["out"] == sizes["again"] != sizes["other"]


def test_the_held_out_share_has_a_floor_when_the_data_allows() -> None:
    assert held_out(100_000, 0.01) == 1000 and held_out(10_000, 0.01) == VAL_MIN == 500
    assert held_out(60, 0.01) == 6 and held_out(3, 0.5) == 2 and held_out(2, 0.01) == 1


def test_a_val_folder_is_the_val_split_and_a_list_file_names_the_images(tmp_path) -> None:
    src = tmp_path / "src"
    images(src, 12)
    val = images(src / "val", 5, nested=False)
    assert write(src, tmp_path / "out") == 0
    m = read_manifest(tmp_path / "out" / "mine")
    assert m.counts == {"train": 12, "val": 5} and not m.labelled
    listed = tmp_path / "lists" / "mine.txt"
    listed.parent.mkdir()
    listed.write_text("# my picks\n" + "\n".join(f"../src/val/{p.name}" for p in val) + "\n\n")
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(listed), "--out", str(tmp_path / "o2"),
                            "--name", "picked", "--workers", "1"]) == 0
    m = read_manifest(tmp_path / "o2" / "picked")
    assert m.counts == {"train": 4, "val": 1} and not m.labelled


def test_labels_none_reads_a_class_layout_as_plain_images(tmp_path) -> None:
    for split, n in (("train", 8), ("val", 3)):
        for c in ("cat", "dog"):
            images(tmp_path / "src" / split / c, n, nested=False)
    assert write(tmp_path / "src", tmp_path / "out") == 0
    assert read_manifest(tmp_path / "out" / "mine").num_classes == 2          # auto: the labelled layout
    assert write(tmp_path / "src", tmp_path / "o2", "--labels", "none") == 0
    m = read_manifest(tmp_path / "o2" / "mine")
    assert not m.labelled and m.counts == {"train": 16, "val": 6}


@pytest.mark.parametrize("case, args, message", [
    ("empty", [], "holds no images"),
    ("missing", [], "do not exist (first: "),
    ("fraction0", ["--val-fraction", "0"], "--val-fraction is the share of images held out, in (0, 0.5]"),
    ("fraction", ["--val-fraction", "0.7"], "--val-fraction is the share of images held out, in (0, 0.5]"),
    ("class-list", ["--labels", "none", "--class-list", "x.txt"], "drop it for unlabelled images"),
])
def test_bad_unlabelled_input_is_one_line_and_writes_nothing(tmp_path, capsys, case, args, message) -> None:
    src = tmp_path / "src"
    src.mkdir()
    if case == "missing":
        images(src, 3, nested=False)
        src = tmp_path / "list.txt"
        src.write_text("src/shot000.jpg\nsrc/gone.jpg\n")
    elif case != "empty":
        images(src, 10)
    assert write(src, tmp_path / "out", *args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "out" / "mine").exists()
