"""DeepUSPS refinement: the soft F-measure loss against a literal transcription of its equation, the
self-training rounds' bookkeeping, and that a network trained on noisy labels recovers the objects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preprocess.saliency import cases, quality
from preprocess.saliency.refine import RefineSettings, as_input, pixel_loss, predict, refine, soft_f_loss


def _literal_soft_f(p: np.ndarray, y: np.ndarray, beta2: float, eps: float = 1e-7) -> float:
    """DeepUSPS F_cont, written out per image and pixel in float64."""
    losses = []
    for b in range(p.shape[0]):
        tp = fp = fn = 0.0
        for i in range(p.shape[1]):
            for j in range(p.shape[2]):
                tp += p[b, i, j] * y[b, i, j]
                fp += p[b, i, j] * (1 - y[b, i, j])
                fn += (1 - p[b, i, j]) * y[b, i, j]
        prec, rec = tp / (tp + fp + eps), tp / (tp + fn + eps)
        losses.append(1 - (1 + beta2) * prec * rec / (beta2 * prec + rec + eps))
    return sum(losses) / len(losses)


def test_soft_f_loss_is_the_deepusps_equation() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.rand(3, 5, 4, generator=g, dtype=torch.float64)
    y = (torch.rand(3, 5, 4, generator=g) < 0.4).double()
    for beta2 in (1.0, 4.0, 0.3):
        assert abs(float(soft_f_loss(p, y, beta2)) - _literal_soft_f(p.numpy(), y.numpy(), beta2)) < 1e-12
    assert float(soft_f_loss(y, y)) < 1e-6                    # a perfect prediction costs nothing


def test_the_loss_over_several_targets_is_their_mean() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    t = (torch.rand(3, 2, 6, 6, generator=g) < 0.5).double()
    for kind in ("bce", "soft_f"):
        each = [float(pixel_loss(logits, t[k:k + 1], kind, 4.0)) for k in range(3)]
        assert abs(float(pixel_loss(logits, t, kind, 4.0)) - np.mean(each)) < 1e-9


@pytest.mark.slow
def test_rounds_train_on_noisy_labels_and_recover_the_objects() -> None:
    """Discs on smooth backgrounds whose 'handcrafted' labels are the true mask shifted by 4 px and with
    a false blob in a corner for a third of the images: the networks, which must generalise across
    images, end closer to the truth than the labels they were trained on."""
    px, n = 32, 48
    images, truth, noisy = [], [], []
    rng = np.random.default_rng(0)
    for i in range(n):
        image, gt = cases.make("clutter-low", i, px=px)
        g = gt.astype(np.float32) / 255
        lab = np.roll(g, 4 * int(rng.choice([-1, 1])), axis=int(rng.integers(2)))
        if i % 3 == 0:
            lab[:8, :8] = 1.0
        images.append(image), truth.append(gt), noisy.append(lab)
    x = as_input(np.stack(images), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    s = RefineSettings(rounds=2, epochs=6, final_epochs=6, batch_size=8, lr=3e-3, net_px=px, loss="bce", crf=False)
    out = refine(x, {"a": np.stack(noisy), "b": np.stack(noisy)}, s, log=lambda line: None)
    assert set(out.nets) == {"a-r1", "a-r2", "b-r1", "b-r2", "final"} and set(out.labels) == {"a-r1", "a-r2", "b-r1", "b-r2"}
    for lab in out.labels.values():
        assert lab.shape == (n, px, px) and lab.min() >= 0 and lab.max() <= 1
    label_iou = np.mean([quality.iou(lab, gt) for lab, gt in zip(noisy, truth)])
    net_iou = np.mean([quality.iou(p, gt) for p, gt in zip(predict(out.nets["final"], x), truth)])
    print(f"labels IoU {label_iou:.3f}, final network IoU {net_iou:.3f}")
    # net - label IoU over RefineSettings.seed 0-4 x 1 or 2 threads: 0.235 mean, 0.061 spread, 0.108 least; a bar
    # at 0 sits 3.8 spreads under the mean.
    assert net_iou > label_iou, (net_iou, label_iou)


def test_a_refinement_with_checkpoints_takes_the_stages_an_earlier_run_finished(tmp_path, monkeypatch) -> None:
    """Every finished stage is saved; a second run over the same folder trains nothing and returns the
    same labels and networks; one with its last stage missing trains that stage alone."""
    from preprocess.saliency import refine as module

    px, n = 32, 12
    images = np.stack([cases.make("clutter-low", i, px=px)[0] for i in range(n)])
    maps = np.stack([cases.make("clutter-low", i, px=px)[1] for i in range(n)]).astype(np.float32) / 255
    x = as_input(images, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    s = RefineSettings(rounds=2, epochs=2, final_epochs=2, batch_size=4, net_px=px, crf=False)
    first = refine(x, {"a": maps}, s, log=lambda line: None, checkpoints=tmp_path)
    trained = []
    real = module.train_net
    monkeypatch.setattr(module, "train_net", lambda *a, **k: trained.append(k["seed"]) or real(*a, **k))
    lines = []
    again = refine(x, {"a": maps}, s, log=lines.append, checkpoints=tmp_path)
    assert trained == [] and lines == ["  a-r1: kept from an earlier run", "  a-r2: kept from an earlier run",
                                       "  final: kept from an earlier run"]
    for stage in first.nets:
        assert all(torch.equal(u, v) for u, v in zip(first.nets[stage].state_dict().values(),
                                                      again.nets[stage].state_dict().values()))
        np.testing.assert_array_equal(predict(first.nets[stage], x), predict(again.nets[stage], x))
    for stage in first.labels:
        np.testing.assert_array_equal(first.labels[stage], again.labels[stage])
    (tmp_path / "final.pt").unlink()                      # as if killed while training stage II
    third = refine(x, {"a": maps}, s, log=lambda line: None, checkpoints=tmp_path)
    assert trained == [s.seed + 99]                        # stage II alone, with its own seed
    np.testing.assert_allclose(predict(third.nets["final"], x), predict(first.nets["final"], x), atol=1e-5)


def test_a_stage_killed_while_it_trains_continues_from_its_last_epoch(tmp_path, monkeypatch) -> None:
    """A refinement killed in the middle of a stage's training (in its third epoch of 4) continues that
    stage from the end of its second when it runs again, instead of training it from the start, and ends as an
    uninterrupted refinement (its networks' maps and the stage's labels); the per-epoch file is gone once
    the stage is kept."""
    from preprocess.saliency import refine as module

    px, n = 32, 12
    images = np.stack([cases.make("clutter-low", i, px=px)[0] for i in range(n)])
    maps = np.stack([cases.make("clutter-low", i, px=px)[1] for i in range(n)]).astype(np.float32) / 255
    x = as_input(images, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    s = RefineSettings(rounds=1, epochs=4, final_epochs=2, batch_size=4, net_px=px, crf=False)
    (tmp_path / "whole").mkdir()
    whole = refine(x, {"a": maps}, s, log=lambda line: None, checkpoints=tmp_path / "whole")

    class Killed(Exception):
        pass

    epochs: list[int] = []
    real_predict = module.predict

    def predict_then_kill(net, xs, *args):
        epochs.append(len(epochs))
        if len(epochs) == 2 and not (tmp_path / "cut" / "a-r1.pt").exists():
            raise Killed                                   # in the fold of epoch 2 (0-based; epoch 0 folds nothing)
        return real_predict(net, xs, *args)

    (tmp_path / "cut").mkdir()
    monkeypatch.setattr(module, "predict", predict_then_kill)
    with pytest.raises(Killed):
        refine(x, {"a": maps}, s, log=lambda line: None, checkpoints=tmp_path / "cut")
    assert (tmp_path / "cut" / "a-r1.partial.pt").exists() and not (tmp_path / "cut" / "a-r1.pt").exists()
    folds: list[int] = []
    monkeypatch.setattr(module, "predict", lambda *a: folds.append(1) or real_predict(*a))
    again = refine(x, {"a": maps}, s, log=lambda line: None, checkpoints=tmp_path / "cut")
    assert len(folds) == 2                                 # epochs 2 and 3 of a-r1 (from the start: 1, 2, 3)
    monkeypatch.setattr(module, "predict", real_predict)
    np.testing.assert_allclose(again.labels["a-r1"], whole.labels["a-r1"], atol=1e-5)
    for stage in whole.nets:
        np.testing.assert_allclose(predict(again.nets[stage], x), predict(whole.nets[stage], x), atol=1e-5)
    assert not list((tmp_path / "cut").glob("*.partial.pt"))
