"""The torchvision baseline backend: batches independent of the workers and its mixes (the view laws are
test_view_laws.py's, on every engine; the Batch contract, rank shards, seeds and resume are
test_contract.py's)."""

from __future__ import annotations

import pytest
import torch

from pipelines.loader import build_loader
from pipelines.spec import LoaderSpec
from pipelines.views import Recipe, load_recipe

GLOBAL_PX, LOCAL_PX = 32, 16
N_TRAIN = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    from preprocess.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("tv_data")
    prepare_dataset("synthetic", out, workers=1, train_size=N_TRAIN, val_size=8, image_px=32,
                    gt_masks_as_mask=True)
    return str(out)


def _spec(root: str, recipe: Recipe, **kw) -> LoaderSpec:
    base = dict(root=root, dataset="synthetic", split="train", recipe=recipe, batch_size=4,
                num_workers=0, seed=7)
    return LoaderSpec(**{**base, **kw})


def test_same_seed_same_batches_across_workers(root: str) -> None:
    recipe = load_recipe("relicv2", GLOBAL_PX, LOCAL_PX)
    a = list(build_loader("torchvision", _spec(root, recipe, num_workers=0)))
    b = list(build_loader("torchvision", _spec(root, recipe, num_workers=2)))
    assert len(a) == len(b) == N_TRAIN // 4
    for x, y in zip(a, b):
        assert torch.equal(x.index, y.index)
        assert torch.equal(x.global_views, y.global_views) and torch.equal(x.local_views, y.local_views)


def test_sdmp_mix_pairs_flip_partners(root: str) -> None:
    from pipelines.mixing import MixSpec

    recipe = load_recipe("rsa", GLOBAL_PX, LOCAL_PX)
    b = next(iter(build_loader("torchvision", _spec(root, recipe, mix=MixSpec(kind="sdmp", sdmp_mixers=("mixup",))))))
    lam = b.mix_lam[:, :, None, None, None]                                  # (V, B, 1, 1, 1)
    # Mixup of normalised views equals the normalised mixup (normalisation is affine per channel).
    expect = lam * b.global_views + (1 - lam) * b.global_views.flip(1)
    assert b.mixed.shape == b.global_views.shape
    assert torch.equal(b.mix_partner[0], torch.arange(3, -1, -1))
    assert torch.allclose(b.mixed, expect, atol=1e-4)

