"""FFCV backend: Batch contract, rank shards, seeding, staged views, saliency, crop laws, resume, mixes.

Datasets are written with the real FFCV writer into tmp_path. Images are raw (bit-exact) and encode
their coordinates (R = 2x, G = 2y), so crop windows can be recovered from pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from scipy import stats

from pipelines.ffcv_backend import FFCVLoader
from pipelines import mixing
from pipelines.loader import LoaderSpec, MixSpec, build_loader
from pipelines.views import Recipe, ViewGroup
from preprocess.records import Record
from preprocess.write_ffcv import write_ffcv

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@dataclass
class CoordSplit:
    """Raw images whose R/G channels are 2x / 2y; B and the mask mark a centred square foreground."""

    n: int
    side: int
    mode: str = "raw"
    jpeg_quality: int = 90
    has_masks: bool = True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Record:
        s = self.side
        yy, xx = np.mgrid[0:s, 0:s]
        fg = (abs(yy - s / 2 + 0.5) < s / 4 + i % 3) & (abs(xx - s / 2 + 0.5) < s / 4)
        img = np.stack([2 * xx, 2 * yy, np.where(fg, 255, 40)], -1).astype(np.uint8)
        return Record(img, i % 7, i, fg.astype(np.uint8) * 255)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, CoordSplit]:
    split = CoordSplit(n=40, side=32)
    path = tmp_path_factory.mktemp("ffcv") / "train.beton"
    write_ffcv(split, path)
    return path, split


def loader(path: Path, recipe: Recipe, **kw) -> FFCVLoader:
    spec = LoaderSpec(root="", dataset="", split="train", recipe=recipe, num_workers=1,
                      **{"batch_size": 8, **kw})
    return FFCVLoader(spec, path, MEAN, STD)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Undo `normalize` (MEAN/STD above) back to uint8-valued floats."""
    return ((x * 0.25 + 0.5) * 255).round()


RELIC = Recipe("relicv2", (
    ViewGroup("large", count=4, size_px=16, area=(0.14, 1.0), jitter_p=0.8, brightness=0.4, contrast=0.4,
              saturation=0.2, hue=0.1, gray_p=0.2, blur_p=0.5, solarize_p=0.2, saliency_p=0.5),
    ViewGroup("small", count=2, size_px=8, area=(0.05, 0.14), jitter_p=0.8, brightness=0.4, gray_p=0.2),
))
RSA = Recipe("rsa", (
    ViewGroup("weak", count=2, size_px=16, area=(0.2, 1.0)),
    ViewGroup("aggressive", count=2, size_px=16, parent="weak", jitter_p=0.8, brightness=0.4, contrast=0.4,
              saturation=0.4, hue=0.1, gray_p=0.2, blur_p=0.5),
))


def check_range(x: torch.Tensor) -> None:
    lo, hi = (0 - 0.5) / 0.25, (1 - 0.5) / 0.25
    assert x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    assert float(x.min()) >= lo - 1e-5 and float(x.max()) <= hi + 1e-5


def test_batch_contract_relicv2_and_rsa(small) -> None:
    path, split = small
    batches = list(loader(path, RELIC))
    assert len(batches) == 5
    for b in batches:
        assert b.global_views.shape == (4, 8, 3, 16, 16) and b.local_views.shape == (2, 8, 3, 8, 8)
        assert b.weak_views is None and b.mixed is None
        check_range(b.global_views)
        check_range(b.local_views)
        assert b.index.dtype == torch.int64 and torch.equal(b.label, b.index % 7)
    seen = torch.cat([b.index for b in batches])
    assert sorted(seen.tolist()) == list(range(40))
    (b,) = list(loader(path, RSA, batch_size=40))
    assert b.global_views.shape == b.weak_views.shape == (2, 40, 3, 16, 16) and b.local_views is None
    check_range(b.weak_views)
    assert not torch.equal(b.global_views, b.weak_views)         # aggressive ops were applied


def test_rank_shards_disjoint_cover_and_reproducible(small) -> None:
    path, _ = small
    plain = Recipe("plain", (ViewGroup("image", size_px=8, crop_p=0.0, flip_p=0.0),))
    ranks = [loader(path, plain, rank=r, world_size=2, seed=3) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2                   # 40 // (2 * 8), drop-last
    for epoch in range(2):
        idx = []
        for ld in ranks:
            ld.set_epoch(epoch)
            idx.append(torch.cat([b.index for b in ld]).tolist())
        assert not set(idx[0]) & set(idx[1]) and len(set(idx[0]) | set(idx[1])) == 32
        if epoch == 0:
            first = idx
    assert first != idx                                          # reshuffled per epoch
    evaluation = loader(path, plain, world_size=2, rank=1, shuffle=False, drop_last=False)
    assert torch.cat([b.index for b in evaluation]).tolist() == list(range(20, 40))
    a, b = (list(loader(path, RELIC, seed=11)) for _ in range(2))
    for x, y in zip(a, b):
        assert torch.equal(x.index, y.index) and torch.equal(x.global_views, y.global_views)
        assert torch.equal(x.local_views, y.local_views)
    c = next(iter(loader(path, RELIC, seed=12)))                 # first batch is enough
    assert not torch.equal(a[0].global_views, c.global_views)


def test_mid_epoch_resume_gives_the_remaining_batches(small) -> None:
    path, _ = small
    ld = loader(path, RELIC, seed=5)
    ld.set_epoch(1)
    full = list(ld)
    ld.set_epoch(1)
    it = iter(ld)
    for _ in range(2):
        next(it)
    state = ld.state_dict()
    it.close()                                                   # the run is interrupted here
    assert state == {"epoch": 1, "batches_done": 2}
    resumed = loader(path, RELIC, seed=5)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 3
    for x, y in zip(rest, full[2:]):
        assert torch.equal(x.index, y.index) and torch.equal(x.global_views, y.global_views)


def test_staged_view_equals_weak_view_when_staged_ops_are_off(small) -> None:
    path, _ = small
    off = Recipe("rsa-off", (RSA.groups[0], ViewGroup("aggressive", count=2, size_px=16, parent="weak")))
    for b in loader(path, off):
        assert torch.equal(b.global_views, b.weak_views)


def test_saliency_never_grays_foreground(small) -> None:
    path, split = small
    group = ViewGroup("large", count=4, size_px=16, area=(0.14, 1.0), flip_p=0.0, saliency_p=1.0)
    ld = loader(path, Recipe("sal", (group,)))
    plain = list(loader(path, Recipe("sal", (replace(group, saliency_p=0.0),))))  # same crops
    grayed = 0
    for b, p in zip(ld, plain):
        win = ld.last_windows["large"]                                        # (4, B, 4)
        for v in range(4):
            for k, i in enumerate(b.index.tolist()):
                rec = split[i]
                y0, x0, h, w = win[v, k].tolist()
                # Ground-truth mask cropped with the view's window (foreground >= 128).
                m = cv2.resize(rec.mask[y0:y0 + h, x0:x0 + w], (16, 16), interpolation=cv2.INTER_LINEAR) >= 128
                out = b.global_views[v, k].permute(1, 2, 0).numpy()
                ref = p.global_views[v, k].permute(1, 2, 0).numpy()
                assert np.array_equal(out[m], ref[m])                       # foreground never grayed
                bg = out[~m]
                if bg.size:
                    assert np.ptp(bg, axis=0).max() < 1e-6                  # one gray level per image
                    grayed += 1
    assert grayed > 0


def test_crop_laws_and_flip_rate(tmp_path: Path) -> None:
    split = CoordSplit(n=16, side=128, has_masks=False)
    path = tmp_path / "train.beton"
    write_ffcv(split, path)
    group = ViewGroup("crops", count=64, size_px=4, area=(0.25, 0.5), flip_p=0.5, interpolation="bilinear")
    ld = loader(path, Recipe("law", (group,)), batch_size=16)
    areas, log_ratios, flips, n = [], [], 0, 0
    for epoch in range(2):
        ld.set_epoch(epoch)
        for b in ld:
            win = ld.last_windows["crops"].reshape(-1, 4).double()           # (V*B, 4) y0, x0, h, w
            areas.append(win[:, 2] * win[:, 3] / 128 ** 2)
            log_ratios.append(torch.log(win[:, 3] / win[:, 2]))
            px = to_uint8(b.global_views).double().reshape(-1, 3, 4, 4) / 2          # (V*B, 3, 4, 4) coordinates
            x_cols = px[:, 0].mean(1)                                         # (V*B, 4) x per column
            flipped = x_cols[:, 0] > x_cols[:, 3]
            flips += int(flipped.sum())
            n += len(flipped)
            # The pixels agree with the reported windows: column centres at x0 + (c + 0.5) w / 4 - 0.5.
            centre_x = x_cols.mean(1)
            assert torch.allclose(centre_x, win[:, 1] + win[:, 3] / 2 - 0.5, atol=1.0)
            span = (x_cols[:, 3] - x_cols[:, 0]).abs()
            assert torch.allclose(span, 0.75 * win[:, 3], atol=1.5)
            centre_y = px[:, 1].mean((1, 2))
            assert torch.allclose(centre_y, win[:, 0] + win[:, 2] / 2 - 0.5, atol=1.0)
    areas, log_ratios = torch.cat(areas).numpy(), torch.cat(log_ratios).numpy()
    assert len(areas) == 2048
    # Area ~ U(0.25, 0.5) and log(w/h) ~ U(log 3/4, log 4/3) (no rejection at these ranges).
    assert stats.kstest(areas, stats.uniform(0.25, 0.25).cdf).pvalue > 1e-3
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    assert stats.kstest(log_ratios, stats.uniform(lo, hi - lo).cdf).pvalue > 1e-3
    assert abs(flips - n / 2) <= 4 * math.sqrt(n / 4)                         # binomial, 4 sigma


MIX_RECIPE = Recipe("mix", (ViewGroup("g", count=2, size_px=16, area=(0.2, 1.0), jitter_p=0.5, brightness=0.4),))


def unnormalize(x: torch.Tensor) -> torch.Tensor:
    return x * 0.25 + 0.5


@pytest.mark.parametrize("mixer", ["mixup", "cutmix"])
def test_sdmp_mix_batch_contract_and_torch_reference(small, mixer: str) -> None:
    path, _ = small
    for b in loader(path, MIX_RECIPE, mix=MixSpec("sdmp", alpha=1.0, sdmp_mixers=(mixer,)), seed=2):
        x = b.global_views                                                    # (2, 8, 3, 16, 16)
        assert b.mixed.shape == x.shape and b.mix_lam.shape == b.mix_partner.shape == (2, 8)
        check_range(b.mixed)
        assert b.mix_lam.dtype == torch.float32 and b.mix_partner.dtype == torch.int64
        assert bool(((b.mix_lam >= 0) & (b.mix_lam <= 1)).all())
        assert torch.equal(b.mix_partner, torch.arange(7, -1, -1).expand(2, 8))   # flip partner n-1-i
        assert torch.equal(b.mix_lam[0], b.mix_lam[1])                     # same lam for both views
        part = b.mix_partner[0]
        for v in range(2):
            if mixer == "mixup":
                ref = mixing.mixup(unnormalize(x[v]), b.mix_lam[v], part)
                assert torch.allclose(unnormalize(b.mixed[v]), ref, atol=1e-5)
                continue
            # CutMix pastes partner pixels bit-exactly: the changed pixels lie in the box, whose
            # bounding box reproduces the output; lam is the kept fraction of the (larger) true box.
            changed = (b.mixed[v] != x[v]).any(1)                             # (B, 16, 16)
            for i in range(8):
                ys, xs = torch.nonzero(changed[i], as_tuple=True)
                box = (torch.tensor([[ys.min(), xs.min(), ys.max() + 1, xs.max() + 1]]) if len(ys)
                       else torch.zeros(1, 4, dtype=torch.long))
                out, kept = mixing.cutmix(x[v], box.expand(8, 4), part)
                assert torch.equal(out[i], b.mixed[v, i])
                assert float(b.mix_lam[v, i]) <= float(kept[i]) + 1e-6


def test_dacl_mix_batch_contract_and_torch_reference(small) -> None:
    path, _ = small
    noises = ("linear", "geometric")
    lams = []
    for b in loader(path, MIX_RECIPE, mix=MixSpec("dacl", alpha=0.6, dacl_noises=noises), seed=4):
        x = unnormalize(b.global_views)                                       # (2, 8, 3, 16, 16)
        assert b.mixed.shape == x.shape and b.mix_lam.shape == b.mix_partner.shape == (2, 8)
        check_range(b.mixed)
        assert b.mix_partner.dtype == torch.int64
        assert bool((b.mix_partner != torch.arange(8)).all()) and bool((b.mix_partner < 8).all())
        assert bool(((b.mix_lam >= 0.6) & (b.mix_lam <= 1)).all())           # lam ~ U(alpha, 1)
        got = unnormalize(b.mixed)
        for v in range(2):
            lin = mixing.dacl_linear(x[v], b.mix_partner[v], b.mix_lam[v])
            geo = mixing.dacl_geometric(x[v], b.mix_partner[v], b.mix_lam[v])
            is_lin = (got[v] - lin).flatten(1).abs().amax(1) < 1e-5
            is_geo = (got[v] - geo).flatten(1).abs().amax(1) < 1e-5
            assert bool((is_lin | is_geo).all())                              # each sample: one noise
        lams.append(b.mix_lam.flatten())
    lams = torch.cat(lams).numpy()
    assert stats.kstest(lams, stats.uniform(0.6, 0.4).cdf).pvalue > 1e-3


def test_build_loader_on_prepared_dataset_with_resizemix_and_dacl_image_source(tiny_data_root) -> None:
    """The registry path (`build_loader`, manifest, real preprocessor output) with both mix kinds."""
    groups = (ViewGroup("g", count=2, size_px=16, area=(0.2, 1.0)),
              ViewGroup("image", count=1, size_px=16, crop_p=0.0, flip_p=0.0))
    recipe = Recipe("mix-image", groups)
    base = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", split="train", recipe=recipe,
                      batch_size=16, num_workers=1, seed=1)
    b = next(iter(build_loader("ffcv", replace(base, mix=MixSpec("sdmp", sdmp_mixers=("resizemix",))))))
    x = b.global_views                                                        # (3, 16, 3, 16, 16)
    assert b.mixed.shape == x.shape and b.mix_lam.shape == (3, 16)
    assert torch.equal(b.mix_partner, torch.arange(15, -1, -1).expand(3, 16))
    assert torch.equal(b.mix_lam[0], b.mix_lam[1]) and bool(((b.mix_lam >= 0) & (b.mix_lam <= 1)).all())
    # ResizeMix keeps image i's own pixels outside the box: a fraction lam of them is unchanged.
    same = (unnormalize(b.mixed) - unnormalize(x)).abs().amax(2).flatten(2).lt(1e-6).float().mean(2)
    assert bool((same >= b.mix_lam - 1e-5).all())
    ld = build_loader("ffcv", replace(base, mix=MixSpec("dacl", alpha=0.5, dacl_noises=("linear",), source="image")))
    b = next(iter(ld))
    image = unnormalize(b.global_views[2])                                    # the crop_p 0 group
    assert b.mixed.shape == (2, 16, 3, 16, 16) and bool((b.mix_partner != torch.arange(16)).all())
    for v in range(2):
        ref = mixing.dacl_linear(image, b.mix_partner[v], b.mix_lam[v])
        assert torch.allclose(unnormalize(b.mixed[v]), ref, atol=1e-5)
