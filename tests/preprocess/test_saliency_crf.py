"""DeepUSPS's dense CRF on saliency predictions: it pulls a soft, misplaced prediction onto the
object's colour edges; the refinement folds the CRF of each prediction, made with its own image,
into the moving average, and a network stage's maps are the CRF of its predictions; the CRF without
pydensecrf is one line."""

from __future__ import annotations

import numpy as np
import pytest

from preprocess.saliency import cases, crf, quality
from preprocess.saliency.refine import RefineSettings, as_input, refine

needs_crf = pytest.mark.skipif(not crf.available(), reason="pydensecrf is not installed (the crf extra)")


def _soft_shifted(gt: np.ndarray, shift: int) -> np.ndarray:
    """The true mask moved by `shift` px, blurred: a network's soft, misplaced prediction."""
    import cv2

    g = np.roll(gt.astype(np.float32) / 255, shift, axis=1)
    return np.clip(cv2.GaussianBlur(g, (0, 0), 2.0) * 0.8 + 0.1, 0, 1)


@needs_crf
def test_the_crf_moves_a_soft_misplaced_prediction_onto_the_object() -> None:
    before, after = [], []
    for i in range(8):
        image, gt = cases.make("clutter-low", i, px=64)
        p = _soft_shifted(gt, 3)
        q = crf.dense_crf(p, image)
        assert q.shape == p.shape and q.dtype == np.float32 and 0.0 <= q.min() and q.max() <= 1.0
        before.append(quality.iou(p, gt))
        after.append(quality.iou(q, gt))
    # IoU 0.68-0.78 before, 1.0 after (measured): every image gains, and the object is found whole.
    assert all(a > b for a, b in zip(after, before)) and np.mean(after) > 0.95, (before, after)


@needs_crf
def test_the_crf_of_many_maps_in_processes_is_that_of_each_map() -> None:
    made = [cases.make("clutter-medium", i, px=32) for i in range(20)]
    images = np.stack([im for im, _ in made])
    p = np.stack([_soft_shifted(gt, 2) for _, gt in made])
    one = crf.CrfPool(1)(p, images)
    with crf.CrfPool(2) as pool:                     # forked once, called twice
        assert np.array_equal(pool(p, images), one) and np.array_equal(pool(p[:9], images[:9]), one[:9])
    assert np.array_equal(one[7], crf.dense_crf(p[7], images[7])) and one.shape == p.shape


@needs_crf
def test_a_map_and_an_image_of_other_sizes_are_an_error() -> None:
    with pytest.raises(ValueError, match="uint8 image of the map's size"):
        crf.dense_crf(np.zeros((16, 16), np.float32), np.zeros((16, 8, 3), np.uint8))


@needs_crf
def test_the_refinement_folds_the_crf_of_each_prediction_with_its_own_image() -> None:
    px, n = 32, 8
    made = [cases.make("clutter-low", i, px=px) for i in range(n)]
    images = np.stack([im for im, _ in made])
    x = as_input(images, (0.5,) * 3, (0.25,) * 3)
    maps = {"rbd": np.stack([gt.astype(np.float32) / 255 for _, gt in made])}
    calls = []

    def recording(p, imgs):
        calls.append(imgs)
        return crf.CrfPool(1)(p, imgs)

    s = RefineSettings(rounds=1, epochs=3, final_epochs=1, batch_size=4, net_px=px, crf=True)
    out = refine(x, maps, s, log=lambda _line: None, images=images, crf=recording)
    assert len(calls) == s.epochs - s.epochs // 3                 # every averaged epoch, none before
    assert all(c is images for c in calls)
    # Without its images the CRF cannot run: an error before any training.
    with pytest.raises(ValueError, match="needs the subset's uint8 images"):
        refine(x, maps, s, log=lambda _line: None)
    assert out.labels["rbd-r1"].shape == (n, px, px)


@needs_crf
def test_a_network_stage_with_the_crf_gives_the_crf_of_its_maps() -> None:
    from models.saliency import build_saliency_net
    from preprocess.saliency.handcrafted import resize_square
    from preprocess.saliency.refine import NetStage

    net = build_saliency_net("test_resnet", None, 8)
    images = [cases.make("two-objects", i, px=48)[0] for i in range(3)]          # resized to the side 32
    plain = NetStage(net, 32, (0.5,) * 3, (0.25,) * 3)
    with_crf = NetStage(net, 32, (0.5,) * 3, (0.25,) * 3, crf=crf.CrfPool(1))
    square = np.stack([resize_square(im, 32) for im in images])
    np.testing.assert_array_equal(with_crf.maps(images), crf.CrfPool(1)(plain.maps(images), square))


def test_the_crf_without_pydensecrf_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    from preprocess.saliency.__main__ import main

    monkeypatch.setattr(crf, "available", lambda: False)
    assert main(["--dataset", "synthetic", "--root", str(tmp_path)]) == 2          # on by default
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dense CRF needs pydensecrf" in err[0] and "pip install 'viewmill[crf]'" in err[0]
    assert "--no-crf" in err[0] and not any(tmp_path.iterdir())
    # --no-crf (or no refinement) does not need it: the run goes on to find no dataset there.
    for args in (["--no-crf"], ["--rounds", "0"]):
        assert main(["--dataset", "synthetic", "--root", str(tmp_path), *args]) == 2
        assert "pydensecrf" not in capsys.readouterr().err
