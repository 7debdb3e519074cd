"""Masks written into a dataset land in both formats aligned with their images; the images and the
rest of the dataset stay as they were; an interrupted write leaves the previous dataset valid."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.shards import ShardReader, scan_shards
from preprocess.prepare import prepare_dataset
from preprocess.saliency.write import binarise, write_masks
from tests.readers import _Beton, read_masks


def dali_masks(split_dir: Path) -> dict[int, np.ndarray]:
    """`<key>.mask.png` of every record, by index."""
    out = {}
    for shard in sorted(split_dir.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar:
                if info.name.endswith("." + schema.DALI_MASK_EXT):
                    index = int(info.name.split(".")[0])
                    out[index] = np.asarray(Image.open(io.BytesIO(tar.extractfile(info).read())))
    return out


def test_known_masks_read_back_pixel_aligned_from_both_formats(tmp_path) -> None:
    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=24, val_size=8, image_px=32, seed=1)
    before = schema.read_manifest(ds)
    assert not before.has_masks
    gt = {s: np.load(ds / rel) for s, rel in before.gt_masks.items()}
    images_before = {s: [_Beton(ds / f"{s}.beton").image(i) for i in range(n)] for s, n in before.counts.items()}

    # The exact object masks, as probability maps: what comes back must be them, pixel for pixel.
    manifest = write_masks(ds, {s: (lambda i, s=s: gt[s][i]) for s in gt}, {"methods": ["gt"]}, workers=2)
    after = schema.read_manifest(ds, verify="full")
    assert after.has_masks and after.mask_source == "saliency" and after.saliency == {"methods": ["gt"]}
    assert manifest == after and after.gt_masks == before.gt_masks and after.counts == before.counts
    for split, n in after.counts.items():
        masks, coverage = read_masks(ds / f"{split}.beton")
        from_dali = dali_masks(ds / split)
        records = scan_shards(ds / split, n)
        beton = _Beton(ds / f"{split}.beton")
        for i in range(n):
            assert np.array_equal(masks[i], gt[split][i]) and np.array_equal(from_dali[i], gt[split][i])
            assert coverage[i] == pytest.approx(np.mean(gt[split][i] >= 128), abs=1e-6)
            assert records[i].coverage == coverage[i]          # both formats store the same value
            assert np.array_equal(beton.image(i), images_before[split][i])    # pixels untouched (raw mode)
    assert not any(p.name.startswith(".") and "staging" in p.name for p in root.iterdir())


def _jpeg_folder(src: Path, n: int = 6) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for k in range(n):
            d = src / split / f"class{k % 2}"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(d / f"{k}.jpg", quality=80)


def test_jpegs_are_stored_again_byte_for_byte_and_masks_take_each_image_geometry(tmp_path) -> None:
    _jpeg_folder(tmp_path / "src")
    ds = prepare_dataset("imagefolder", tmp_path / "data", src=tmp_path / "src", workers=1, max_side=0)
    before = schema.read_manifest(ds)
    assert before.image_mode == "jpg"
    jpeg_before = {s: [ShardReader(scan_shards(ds / s, n)).image(i) for i in range(n)] for s, n in before.counts.items()}
    beton_before = {s: [_Beton(ds / f"{s}.beton").bytes_at(_Beton(ds / f"{s}.beton").meta[schema.IMAGE][i]["data_ptr"])
                        .tobytes() for i in range(n)] for s, n in before.counts.items()}

    # A 16x16 map whose left half is salient, for 30x40 images: resized to each image, then >= 0.5.
    half = np.zeros((16, 16), np.uint8)
    half[:, :8] = 255
    write_masks(ds, {s: (lambda i: half) for s in before.counts}, {"methods": ["half"]})
    after = schema.read_manifest(ds, verify="full")
    for split, n in after.counts.items():
        beton = _Beton(ds / f"{split}.beton")
        reader = ShardReader(scan_shards(ds / split, n))
        masks, coverage = read_masks(ds / f"{split}.beton")
        assert np.array_equal(coverage, reader.coverage) and (coverage == 0.5).all()   # copied from the shards
        for i in range(n):
            assert reader.image(i) == jpeg_before[split][i]
            meta = beton.meta[schema.IMAGE][i]
            assert beton.bytes_at(meta["data_ptr"]).tobytes() == beton_before[split][i]
            assert (int(meta["height"]), int(meta["width"])) == (30, 40)
            assert masks[i].shape == (30, 40) and np.array_equal(masks[i], binarise(half, 30, 40))
            assert (masks[i][:, :20] == 255).all() and (masks[i][:, 20:] == 0).all()


def test_an_interrupted_mask_write_leaves_the_previous_dataset_readable(tmp_path) -> None:
    root = tmp_path / "data"
    ds = prepare_dataset("synthetic", root, workers=1, train_size=16, val_size=8, image_px=32, seed=2)
    before = (ds / schema.MANIFEST_NAME).read_bytes()

    def masks(i: int) -> np.ndarray:
        if i == 5:
            raise RuntimeError("inference died")
        return np.zeros((32, 32), np.uint8)

    with pytest.raises(RuntimeError, match="inference died"):        # the shards are written first
        write_masks(ds, {"train": masks, "val": masks}, {})
    assert (ds / schema.MANIFEST_NAME).read_bytes() == before
    assert not schema.read_manifest(ds, verify="full").has_masks
    assert sorted(p.name for p in root.iterdir() if p.suffix != ".lock") == ["synthetic"]           # no staging left behind


def test_a_split_without_masks_is_refused_before_anything_is_written(tmp_path) -> None:
    ds = prepare_dataset("synthetic", tmp_path, workers=1, train_size=16, val_size=8, image_px=32, seed=2)
    from preprocess.sources import PreprocessError

    with pytest.raises(PreprocessError, match="no masks for split.*val"):
        write_masks(ds, {"train": lambda i: np.zeros((32, 32), np.uint8)}, {})
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["synthetic"]


def test_without_ffcv_the_masks_go_into_the_shards_and_the_beton_files_leave_the_manifest(tmp_path, monkeypatch,
                                                                                          capsys) -> None:
    """A dataset written with FFCV, masked where FFCV is not installed: the shards get the masks, the
    `.beton` files (which would keep the old, maskless records) are dropped from the folder and from the
    manifest's formats, said in one line naming the extra; the dataset verifies."""
    import sys

    ds = prepare_dataset("synthetic", tmp_path, workers=1, train_size=16, val_size=8, image_px=32, seed=2)
    assert "ffcv" in schema.read_manifest(ds).formats
    monkeypatch.setitem(sys.modules, "ffcv", None)
    write_masks(ds, {s: (lambda i: np.full((32, 32), 255, np.uint8)) for s in ("train", "val")}, {})
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'viewmill[ffcv]'" in err, err
    after = schema.read_manifest(ds, verify="full")
    assert after.has_masks and set(after.formats) == {"dali"} and not list(ds.glob("*.beton"))
    assert all(m.min() == 255 for m in dali_masks(ds / "train").values())

