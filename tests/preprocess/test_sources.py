"""Sources: synthetic determinism, exact masks and balance; CIFAR pickles; image-folder colour modes."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from preprocess import cifar, imagefolder
from preprocess.synthetic import NUM_CLASSES, SyntheticSplit


def test_synthetic_is_deterministic_and_picklable() -> None:
    a, b = SyntheticSplit(40, seed=3, image_px=32), SyntheticSplit(40, seed=3, image_px=32)
    c = pickle.loads(pickle.dumps(a))
    for i in (0, 17, 39, 5):                                   # any order, any process
        assert np.array_equal(a[i].image, b[i].image) and np.array_equal(a[i].image, c[i].image)
        assert a[i].label == b[i].label and a[i].index == i
    other = SyntheticSplit(40, seed=4, image_px=32)
    assert not np.array_equal(a[0].image, other[0].image)
    val = SyntheticSplit(40, seed=3, split="val", image_px=32)
    assert not np.array_equal(a[0].image, val[0].image)       # splits draw different images


def test_synthetic_masks_are_exactly_the_object_pixels() -> None:
    split = SyntheticSplit(30, image_px=48, gt_masks_as_mask=True)
    for i in range(30):
        bg, obj, inside = split.render(i)
        rec = split[i]
        assert rec.image.shape == (48, 48, 3) and rec.image.dtype == np.uint8
        assert rec.mask.dtype == np.uint8 and set(np.unique(rec.mask)) <= {0, 255}
        assert np.array_equal(rec.mask > 0, inside)
        assert np.array_equal(rec.image[inside], obj[inside])       # object colour exactly on the mask
        assert np.array_equal(rec.image[~inside], bg[~inside])      # background everywhere else
        assert 0.03 < inside.mean() < 0.6
        assert np.array_equal(split.gt_mask(i), rec.mask)
    assert SyntheticSplit(3)[0].mask is None                        # default: no mask field


def test_synthetic_classes_are_balanced_and_colour_varies_within_class() -> None:
    split = SyntheticSplit(200, image_px=32)
    counts = np.bincount(split.labels, minlength=NUM_CLASSES)
    assert counts.min() == counts.max() == 20
    colours = [split.render(i)[1][split.render(i)[2]].mean(0) for i in np.flatnonzero(split.labels == 0)]
    assert np.std(colours, axis=0).mean() > 25          # uint8 units: colour is not the class


def _write_pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def make_cifar10(root: Path, n: int = 5, rng=np.random.default_rng(0)) -> dict:
    """Official-layout CIFAR-10 batches with n images each; returns the arrays written."""
    root.mkdir(parents=True, exist_ok=True)
    data = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, n)]
        _write_pickle(root / name, {b"data": x, b"labels": y, b"batch_label": name.encode()})
        data[name] = (x, y)
    _write_pickle(root / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    return data


def test_cifar10_batches_parse_to_hwc_images(tmp_path: Path) -> None:
    data = make_cifar10(tmp_path / "cifar-10-batches-py")
    splits, names = cifar.load_cifar("cifar10", tmp_path)      # parent folder also accepted
    assert names == [f"c{i}" for i in range(10)]
    assert len(splits["train"]) == 25 and len(splits["val"]) == 5
    x, y = data["data_batch_2"]
    rec = splits["train"][5]                                   # first image of batch 2
    assert rec.label == y[0]
    assert np.array_equal(rec.image[..., 1], x[0, 1024:2048].reshape(32, 32))   # green plane
    assert rec.image.shape == (32, 32, 3) and splits["train"].mode == "raw"
    assert splits["val"][4].label == data["test_batch"][1][4]


def test_cifar100_uses_fine_labels(tmp_path: Path) -> None:
    x = np.arange(4 * 3072, dtype=np.int64).astype(np.uint8).reshape(4, 3072)
    _write_pickle(tmp_path / "train", {b"data": x, b"fine_labels": [0, 99, 5, 7], b"coarse_labels": [0] * 4})
    _write_pickle(tmp_path / "test", {b"data": x[:2], b"fine_labels": [3, 4], b"coarse_labels": [0] * 2})
    _write_pickle(tmp_path / "meta", {b"fine_label_names": [f"f{i}".encode() for i in range(100)]})
    splits, names = cifar.load_cifar("cifar100", tmp_path)
    assert len(names) == 100 and [splits["train"][i].label for i in range(4)] == [0, 99, 5, 7]
    assert np.array_equal(splits["train"][1].image[..., 0], x[1, :1024].reshape(32, 32))


def _save(img: Image.Image, path: Path, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


def test_image_modes_convert_to_rgb(tmp_path: Path) -> None:
    load = lambda p: imagefolder.load_image(p, 512, "longer")   # noqa: E731
    gray = load(_save(Image.new("L", (8, 6), 77), tmp_path / "g.png"))
    assert gray.shape == (6, 8, 3) and (gray == 77).all()
    cmyk = load(_save(Image.new("CMYK", (8, 6), (0, 255, 255, 0)), tmp_path / "c.jpg", quality=100))
    assert abs(cmyk[..., 0].astype(int) - 255).max() < 8 and cmyk[..., 1:].max() < 8   # pure red
    rgba = Image.new("RGBA", (8, 6), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    out = load(_save(rgba, tmp_path / "a.png"))
    assert out[0, 0].tolist() == [10, 20, 30] and (out[1:, 1:] == 255).all()    # composited on white
    pal = Image.new("P", (8, 6), 1)
    pal.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    assert (load(_save(pal, tmp_path / "p.png"))[0, 0] == [200, 100, 50]).all()
    deep = Image.frombytes("I;16", (4, 1), np.array([0, 65535, 32896, 257], dtype="<u2").tobytes())
    out16 = load(_save(deep, tmp_path / "d.png"))
    assert out16[0, :, 0].tolist() == [0, 255, 128, 1]                          # v * 255 / 65535
    assert out16.dtype == np.uint8


def test_exif_rotation_is_applied(tmp_path: Path) -> None:
    a = np.zeros((20, 40, 3), np.uint8)                        # stored landscape 40 x 20
    a[:, :20] = [255, 0, 0]                                    # left half red
    img = Image.fromarray(a)
    exif = img.getexif()
    exif[0x0112] = 6                                           # Orientation: rotate 90° clockwise to view
    out = imagefolder.load_image(_save(img, tmp_path / "r.jpg", exif=exif, quality=95), 512, "longer")
    assert out.shape == (40, 20, 3)                            # viewed portrait
    assert out[5, 10, 0] > 200 and out[35, 10, 0] < 60         # red (stored left) is now on top


@pytest.mark.parametrize("side,expect", [("longer", (32, 64)), ("shorter", (64, 128))])
def test_size_policy_only_downscales(tmp_path: Path, side: str, expect: tuple[int, int]) -> None:
    big = _save(Image.new("RGB", (600, 300), (1, 2, 3)), tmp_path / "big.png")
    assert imagefolder.load_image(big, 64, side).shape[:2] == expect
    small = _save(Image.new("RGB", (30, 20), (1, 2, 3)), tmp_path / "small.png")
    assert imagefolder.load_image(small, 64, side).shape[:2] == (20, 30)


def test_corrupt_truncated_and_zero_byte_files_are_reported(tmp_path: Path) -> None:
    good = _save(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)),
                 tmp_path / "ok.jpg", quality=90)
    raw = good.read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "bad.jpg").write_bytes(b"this is not an image at all" * 10)
    (tmp_path / "zero.png").write_bytes(b"")
    check = lambda name: imagefolder.try_read(str(tmp_path / name), 512, "longer")  # noqa: E731
    image, raw, reason = check("ok.jpg")
    assert reason is None and image.shape == (64, 64, 3) and raw == good.read_bytes()
    for name in ("trunc.jpg", "bad.jpg", "zero.png", "missing.jpg"):
        assert check(name)[:2] == (None, None) and check(name)[2]
    assert check("zero.png")[2] == "zero-byte file"


def test_jpegs_that_need_no_work_are_stored_byte_for_byte_in_both_formats(tmp_path: Path) -> None:
    from pipelines.shards import ShardReader, scan_shards
    from preprocess.prepare import prepare_dataset, summary
    from tests.readers import _Beton

    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    kept = {}
    for split in ("train", "val"):
        d = src / split / "a"
        d.mkdir(parents=True)
        pixels = Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8))
        kept[split] = _save(pixels, d / "0_fits.jpg", quality=80).read_bytes()
        _save(pixels.resize((128, 96)), d / "1_too_big.jpg", quality=80)       # needs a resize
        _save(pixels, d / "2_lossless.png")                                     # needs a new container
        _save(pixels.convert("L"), d / "3_gray.jpg", quality=80)                # needs a colour conversion
        exif = pixels.getexif()
        exif[0x0112] = 6
        _save(pixels, d / "4_rotated.jpg", exif=exif, quality=80)               # needs a rotation
    ds = prepare_dataset("imagefolder", tmp_path / "data", src=src, workers=1, max_side=64)
    m = schema.read_manifest(ds)
    assert m.build["images"] == {"train": {"as_is": 1, "re_encoded": 4}, "val": {"as_is": 1, "re_encoded": 4}}
    assert "JPEGs stored as they are / re-encoded: train 1 / 4, val 1 / 4" in summary(ds)
    for split in ("train", "val"):
        shards = ShardReader(scan_shards(ds / split, 5))
        beton = _Beton(ds / f"{split}.beton")
        stored = [beton.bytes_at(beton.meta[schema.IMAGE][i]["data_ptr"]).tobytes() for i in range(5)]
        assert shards.image(0) == kept[split] and stored[0] == kept[split]
        assert all(shards.image(i) != (src / split / "a").joinpath(n).read_bytes()
                   for i, n in ((1, "1_too_big.jpg"), (3, "3_gray.jpg"), (4, "4_rotated.jpg")))
        assert shards.image(2)[:2] == b"\xff\xd8"                 # the PNG became a JPEG record


def test_an_image_folder_is_listed_by_class_and_name_without_a_stat_of_each_file(tmp_path: Path, monkeypatch) -> None:
    """Images sorted within each class, classes in order, other files and folders left out; the
    directory entries' own types decide what is a file (a stat of each of ImageNet's 1.28 M files is
    minutes on a network filesystem)."""
    for split, n in (("train", 4), ("val", 2)):
        for c in ("b", "a"):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for i in reversed(range(n)):
                (d / f"{i}.JPEG").write_bytes(b"x")
            (d / "notes.txt").write_bytes(b"x")
            (d / "folder.jpg").mkdir()                      # a folder named like an image is not one
    stats = []
    real = imagefolder.os.stat
    monkeypatch.setattr(imagefolder.os, "stat", lambda *a, **k: stats.append(a[0]) or real(*a, **k))
    classes, files = imagefolder.list_image_folder(tmp_path, None)
    assert classes == ["a", "b"]
    assert files["train"] == [(str(tmp_path / "train" / c / f"{i}.JPEG"), label)
                              for label, c in enumerate(classes) for i in range(4)]
    assert [label for _, label in files["val"]] == [0, 0, 1, 1]
    assert not [p for p in stats if str(p).endswith(".JPEG")]
