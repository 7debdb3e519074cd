"""The `Batch` contract, once for every backend × every preset recipe × an odd recipe and the mixes.

For each case: shapes, dtypes and value ranges of every field; the role and the order of the views
(the odd recipe: a weak crop with a staged view on it, one more global crop and a local crop, each
with an op that marks it); rank shards disjoint and covering the split; the same seed giving the same
batches in a new loader and another seed other batches; a mid-epoch resume giving exactly the
remaining batches; the next epoch reshuffled. Then the evaluation path (index order, keep-all) agrees across backends.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipelines.loader import BACKENDS, build_loader
from pipelines.mixing import DACL_NOISES, MixSpec
from pipelines.schema import read_manifest
from pipelines.spec import LoaderSpec
from pipelines.views import PRESETS, Recipe, ViewGroup, load_recipe
from tests.devices import OnHost

N_TRAIN, N_VAL, B, PX = 48, 20, 8, 32
_PACKAGE = {"ffcv": "ffcv", "dali": "nvidia.dali"}
INSTALLED = [b for b in BACKENDS if b not in _PACKAGE or importlib.util.find_spec(_PACKAGE[b]) is not None]
EVERY_BACKEND = [pytest.param(b, marks=pytest.mark.skipif(b not in INSTALLED, reason=f"{_PACKAGE.get(b)} not installed"))
                 for b in BACKENDS]
# ... and the DALI graph on the GPU (nvJPEG decode, GPU ops), where there is one.
EVERY_BACKEND.append(pytest.param("dali@cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    "dali" not in INSTALLED, reason="nvidia.dali not installed")]))


ODD = Recipe("odd", (
    ViewGroup("extra", count=1, size_px=PX, area=(0.3, 1.0), solarize_p=1.0),     # a global crop, solarized
    ViewGroup("weak", count=2, size_px=PX, area=(0.3, 1.0)),                      # the staged views' parents
    ViewGroup("small", count=1, size_px=PX // 2, area=(0.1, 0.3)),               # a local crop
    ViewGroup("gray", count=2, size_px=PX, parent="weak", gray_p=1.0),            # staged: gray of the weak view
))
CASES = {name: (load_recipe(name, PX, PX // 2), MixSpec()) for name in PRESETS}
CASES["byol+sdmp"] = (load_recipe("byol", PX, PX // 2), MixSpec("sdmp"))
CASES["plain+dacl"] = (load_recipe("plain", PX, PX // 2), MixSpec("dacl", alpha=0.5, source="image",
                                                                  dacl_noises=DACL_NOISES))     # DACL+
CASES["plain+gaussian"] = (load_recipe("plain", PX, PX // 2), MixSpec("dacl", alpha=0.5, source="image",
                                                                      dacl_noises=("gaussian",)))
CASES["odd"] = (ODD, MixSpec())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A synthetic dataset with its exact masks in the mask field (so saliency runs), written by the
    real preprocessor."""
    from preprocess.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("contract")
    prepare_dataset("synthetic", root, workers=1, train_size=N_TRAIN, val_size=N_VAL, image_px=PX, seed=0,
                    gt_masks_as_mask=True, shard_size=16)
    return root


def _spec(root: Path, recipe: Recipe, mix: MixSpec, **kw) -> LoaderSpec:
    return LoaderSpec(root=str(root), dataset="synthetic", recipe=recipe, mix=mix,
                      **{"split": "train", "batch_size": B, "num_workers": 1, "seed": 1, **kw})


def _loader(target: str, spec: LoaderSpec) -> OnHost:
    """The loader of `target` ("<backend>" on the CPU, "<backend>@cuda" on the GPU), its batches
    checked to land on that device and handed over on the host."""
    backend, _, device = target.partition("@")
    return OnHost(build_loader(backend, replace(spec, device=device or "cpu")), device or "cpu")


def _pixels(x: torch.Tensor, root: Path) -> torch.Tensor:
    """Normalised views (..., 3, H, W) back to pixel levels in [0, 255]."""
    m = read_manifest(root / "synthetic")
    mean, std = torch.tensor(m.mean).view(3, 1, 1), torch.tensor(m.std).view(3, 1, 1)
    return (x * std + mean) * 255


def _check_fields(b, recipe: Recipe, mix: MixSpec, root: Path) -> None:
    """Shapes, dtypes, ranges of every field, and the mixes' partners and lam."""
    m = read_manifest(root / "synthetic")
    lo = min((0 - mu) / sd for mu, sd in zip(m.mean, m.std)) - 1e-4
    hi = max((1 - mu) / sd for mu, sd in zip(m.mean, m.std)) + 1e-4
    for name, groups in recipe.fields.items():
        x = getattr(b, name)
        if not groups:
            assert x is None, name
            continue
        assert x.shape == (sum(g.count for g in groups), B, 3, groups[0].size_px, groups[0].size_px), name
        assert x.dtype == torch.float32 and lo <= float(x.min()) and float(x.max()) <= hi, name
    assert b.index.dtype == b.label.dtype == torch.int64 and b.index.shape == b.label.shape == (B,)
    if mix.kind == "none":
        assert b.mixed is None and b.mix_lam is None and b.mix_partner is None
        return
    vm = 2 if mix.source == "image" else b.global_views.shape[0]
    assert b.mixed.shape == (vm, B, 3, PX, PX) and b.mixed.dtype == torch.float32
    assert lo <= float(b.mixed.min()) and float(b.mixed.max()) <= hi
    assert b.mix_lam.shape == b.mix_partner.shape == (vm, B) and b.mix_partner.dtype == torch.int64
    assert bool(((b.mix_lam >= 0) & (b.mix_lam <= 1)).all())
    if mix.dacl_noises == ("gaussian",) and mix.kind == "dacl":
        # DACL's Gaussian-noise baseline, x + alpha delta, delta ~ N(0, I) per positive: no partner (lam 1);
        # the plain recipe's view is the source image, so the positives' residuals are alpha delta
        # (where neither is clipped)
        assert torch.equal(b.mix_lam, torch.ones(vm, B))
        p, x = _pixels(b.mixed, root), _pixels(b.global_views[:1], root)
        inside = ((p > 1) & (p < 254)).all(0)
        r = (p - x)[:, inside] / (mix.gauss_scale * 255)                           # (2, pixels)
        assert float(r.mean().abs()) < 0.1 and 0.9 < float(r.std()) < 1.1
        assert float(torch.corrcoef(r)[0, 1].abs()) < 0.1                         # a delta per positive
        return
    if mix.kind == "sdmp":                         # flip partner; the same lam for every view of a sample
        assert torch.equal(b.mix_partner, torch.arange(B - 1, -1, -1).expand(vm, B))
        assert torch.allclose(b.mix_lam, b.mix_lam[:1].expand(vm, B))
    else:                                          # DACL: a partner other than itself, lam ~ U(alpha, 1)
        assert not bool((b.mix_partner == torch.arange(B)).any()) and float(b.mix_lam.min()) >= mix.alpha


def _check_odd_roles(b, root: Path) -> None:
    """global_views = [gray(weak 0), gray(weak 1), extra (solarized colour)], weak_views = the weak crops,
    local_views = the small crop: the order `views.Recipe.fields` defines."""
    g, w = _pixels(b.global_views, root), _pixels(b.weak_views, root)          # (3, B, 3, S, S), (2, B, 3, S, S)
    assert g.shape[0] == 3 and w.shape[0] == 2 and b.local_views.shape == (1, B, 3, PX // 2, PX // 2)
    gray = g[:2]
    assert float((gray - gray[:, :, :1]).abs().max()) < 0.5                     # R = G = B
    luma = 0.2989 * w[:, :, 0] + 0.5870 * w[:, :, 1] + 0.1140 * w[:, :, 2]     # staged view k on weak view k
    assert float((gray[:, :, 0] - luma).abs().max()) <= 1.6
    extra = g[2]
    assert float(extra.max()) <= 128.5                                           # solarized: levels >= 128 inverted
    assert float((extra - extra[:, :1]).abs().amax((1, 2, 3)).mean()) > 5.0     # still colour


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x is y is None
               for x, y in zip((a.global_views, a.local_views, a.weak_views, a.mixed, a.mix_lam, a.index),
                               (b.global_views, b.local_views, b.weak_views, b.mixed, b.mix_lam, b.index)))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", EVERY_BACKEND)
def test_contract(root: Path, backend: str, case: str) -> None:
    recipe, mix = CASES[case]
    ranks = [_loader(backend, _spec(root, recipe, mix, rank=r, world_size=2)) for r in range(2)]
    n_batches = N_TRAIN // (2 * B)
    assert [len(ld) for ld in ranks] == [n_batches, n_batches]
    first, state = [], None
    for k, b in enumerate(ranks[0]):
        first.append(b)
        if k == 0:
            state = ranks[0].state_dict()              # between batch 0 and batch 1
    second = list(ranks[1])
    assert len(first) == len(second) == n_batches
    for b in first + second:
        _check_fields(b, recipe, mix, root)
        if case == "odd":
            _check_odd_roles(b, root)
    idx = [set(torch.cat([b.index for b in bs]).tolist()) for bs in (first, second)]
    assert not idx[0] & idx[1] and len(idx[0]) == len(idx[1]) == n_batches * B
    assert idx[0] | idx[1] == set(range(N_TRAIN))
    labels = {int(i): int(l) for b in first + second for i, l in zip(b.index, b.label)}
    assert len(set(labels.values())) > 1
    # The position moved on to epoch 1, which is reshuffled.
    assert ranks[0].state_dict()["epoch"] == 1 and ranks[0].state_dict()["batches_done"] == 0
    assert not torch.equal(next(iter(ranks[0])).index, first[0].index)
    # Same seed, new loader, resumed after batch 0: exactly batches 1.. of the first run.
    resumed = _loader(backend, _spec(root, recipe, mix, rank=0, world_size=2))
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == n_batches - 1 and all(_same(x, y) for x, y in zip(rest, first[1:]))
    # Another seed: other views.
    other = next(iter(_loader(backend, _spec(root, recipe, mix, rank=0, world_size=2, seed=2))))
    assert not torch.equal(other.global_views, first[0].global_views)


def test_contract_fails_on_a_view_in_the_wrong_role(root: Path) -> None:
    """The role check above catches a backend that files the extra global crop under local views or
    puts it before the staged views."""
    b = next(iter(build_loader("torch", _spec(root, ODD, MixSpec()))))
    _check_odd_roles(b, root)
    swapped = type(b)(**{**b.__dict__, "global_views": b.global_views[[2, 0, 1]]})
    with pytest.raises(AssertionError):
        _check_odd_roles(swapped, root)
    moved = type(b)(**{**b.__dict__, "global_views": b.global_views[:2]})
    with pytest.raises(AssertionError):
        _check_odd_roles(moved, root)


@pytest.mark.slow
def test_evaluation_order_and_plain_views_agree_across_backends(root: Path) -> None:
    """Keep-all, index order, two ranks: every backend yields the val split once, in order, with the
    same labels and the same whole-image views (within one level: decoders and resizers differ)."""
    plain = load_recipe("plain", PX, PX // 2)
    got = {}
    for backend in INSTALLED:
        parts = [list(build_loader(backend, _spec(root, plain, MixSpec(), split="val", rank=r, world_size=2,
                                                  shuffle=False, drop_last=False))) for r in range(2)]
        batches = parts[0] + parts[1]
        assert [b.batch_size for b in batches] == [8, 2, 8, 2]                    # 10 per rank
        index = torch.cat([b.index for b in batches])
        assert torch.equal(index, torch.arange(N_VAL))
        got[backend] = (torch.cat([b.global_views[0] for b in batches]), torch.cat([b.label for b in batches]))
    ref_views, ref_labels = got["torch"]
    for backend, (views, labels) in got.items():
        assert torch.equal(labels, ref_labels), backend
        assert float((_pixels(views, root) - _pixels(ref_views, root)).abs().max()) <= 1.01, backend


@pytest.mark.parametrize("backend", EVERY_BACKEND)
def test_a_subset_is_read_alone_once_an_epoch_on_every_backend(root: Path, backend: str) -> None:
    """`LoaderSpec.subset` (fine-tuning's labelled share): every backend reads those records and no
    other, each once an epoch over two ranks, shuffled anew each epoch, with their own labels."""
    from pipelines.spec import DatasetInfo

    subset = tuple(range(1, N_TRAIN, 3))                                     # 16 records
    labels = torch.from_numpy(DatasetInfo.read(root, "synthetic", "train").labels())
    plain = load_recipe("plain", PX, PX // 2)
    orders = []
    for epoch in range(2):
        seen = []
        for r in range(2):
            loader = _loader(backend, _spec(root, plain, MixSpec(), subset=subset, rank=r, world_size=2, batch_size=4))
            loader.set_epoch(epoch)
            for b in loader:
                assert torch.equal(b.label, labels[b.index])
                seen += b.index.tolist()
        assert sorted(seen) == list(subset)
        orders.append(seen)
    assert orders[0] != orders[1]


@pytest.fixture(scope="module")
def wide_and_tall(tmp_path_factory) -> tuple[Path, list[torch.Tensor]]:
    """An image folder of non-square images (aspect 4:1 to 1:3), each a gradient rising left to right
    in red and top to bottom in green, written by the real preprocessor; and the images themselves."""
    from PIL import Image

    from preprocess.__main__ import main as preprocess_main

    src, out = tmp_path_factory.mktemp("nonsquare-src"), tmp_path_factory.mktemp("nonsquare")
    images = []
    for i, (h, w) in enumerate([(24, 96), (96, 32), (40, 64), (64, 40)] * 2):
        y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        img = torch.stack([x * 255, y * 255, torch.full_like(x, 40.0 + 20 * i)]).round().to(torch.uint8)
        folder = src / ("train" if i < 6 else "val") / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(folder / f"img{i}.png")
        images.append(img)
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(src), "--out", str(out), "--name", "nonsquare",
                            "--workers", "1"]) == 0
    return out, images


def test_whole_image_views_of_non_square_images_are_the_whole_image_on_every_backend(wide_and_tall) -> None:
    """A view with no random crop (`plain`, and DACL's `image` mix source) is the whole image resized to
    the square (squashed), on every backend: not a centre crop with the ratio clamped to [3/4, 4/3]
    (which on a 4:1 image would lose the left and right thirds of the red gradient)."""
    from torchvision.transforms import functional as tvf

    root, images = wide_and_tall
    plain = load_recipe("plain", PX, PX // 2)
    err = {}
    for backend in INSTALLED:
        spec = LoaderSpec(root=str(root), dataset="nonsquare", recipe=plain, split="train", batch_size=6,
                          num_workers=1, shuffle=False, drop_last=False)
        for b in build_loader(backend, spec):
            m = read_manifest(root / "nonsquare")
            mean, std = torch.tensor(m.mean).view(3, 1, 1), torch.tensor(m.std).view(3, 1, 1)
            got = (b.global_views[0] * std + mean) * 255                          # (B, 3, PX, PX)
            for k in range(b.batch_size):
                img = next(im for im in images if abs(float(im[2, 0, 0]) - float(got[k, 2].mean())) < 6)
                want = tvf.resize(img.float(), [PX, PX], antialias=True)
                err[backend] = max(err.get(backend, 0.0), float((got[k] - want).abs().amax()))
                assert float(got[k, 0, :, 0].mean()) < 20 and float(got[k, 0, :, -1].mean()) > 235, backend
    assert max(err.values()) <= 12, err            # JPEG re-encoding and resizers differ by a few levels
