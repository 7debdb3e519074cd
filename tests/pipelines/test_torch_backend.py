"""The reference torch loader: views are the stored images, batches do not depend on the workers."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.loader import build_loader
from pipelines.schema import read_manifest
from pipelines.spec import LoaderSpec
from pipelines.views import Recipe, load_recipe


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    from preprocess.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("torch_data")
    prepare_dataset("synthetic", out, workers=1, train_size=24, val_size=10, image_px=32)
    return str(out)


def _spec(root: str, recipe: Recipe, **kw) -> LoaderSpec:
    base = dict(root=root, dataset="synthetic", split="train", recipe=recipe, batch_size=4, num_workers=0, seed=3)
    return LoaderSpec(**{**base, **kw})


def test_labels_and_plain_view_match_the_dataset(root):
    loader = build_loader("torch", _spec(root, load_recipe("plain", 32, 16), shuffle=False, drop_last=False,
                                         split="val", batch_size=4))
    batches = list(loader)
    assert [b.batch_size for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b.index for b in batches]), torch.arange(10))
    shard = sorted((Path(root) / "synthetic" / "val").glob("shard-*.tar"))[0]
    with tarfile.open(shard) as tf:
        img_name = next(n for n in tf.getnames() if n.startswith("000000003.") and n.endswith(("jpg", "png")))
        img = np.asarray(Image.open(tf.extractfile(img_name)).convert("RGB"))
        rec = np.frombuffer(tf.extractfile("000000003.rec").read(), dtype="<i8")
    m = read_manifest(Path(root) / "synthetic")
    want = (torch.from_numpy(img.copy()).permute(2, 0, 1).float() / 255 - torch.tensor(m.mean).view(3, 1, 1)) / torch.tensor(m.std).view(3, 1, 1)
    assert torch.allclose(batches[0].global_views[0, 3], want, atol=1e-5)
    assert int(batches[0].label[3]) == int(rec[0])


def test_batches_do_not_depend_on_the_number_of_workers(root):
    recipe = load_recipe("byol", 32, 16)
    a = list(build_loader("torch", _spec(root, recipe)))
    c = list(build_loader("torch", _spec(root, recipe, num_workers=2)))
    assert len(a) == len(c) == 6
    assert all(torch.equal(x.global_views, y.global_views) and torch.equal(x.index, y.index) for x, y in zip(a, c))


def test_the_workers_read_ahead_into_the_next_epoch_and_hand_out_what_a_fresh_loader_would(root):
    """One loader read epoch after epoch (the loop's `set_epoch(e)`, then a new iteration) keeps its
    workers' read-ahead across the boundary (no refill: the profile's epoch-boundary stall), and every
    epoch's batches are a fresh loader's; a jump (another epoch, a resumed position) starts over."""
    recipe = load_recipe("byol", 32, 16)
    loader = build_loader("torch", _spec(root, recipe, num_workers=2))

    def fresh(epoch: int, state: dict | None = None) -> list:
        other = build_loader("torch", _spec(root, recipe, num_workers=0))
        other.set_epoch(epoch)
        if state:
            other.load_state_dict(state)
        return list(other)

    def same(a: list, b: list) -> bool:
        return len(a) == len(b) and all(torch.equal(x.index, y.index) and torch.equal(x.global_views, y.global_views)
                                        for x, y in zip(a, b))

    ahead = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert same(list(loader), fresh(epoch)), epoch
        ahead.append(loader._ahead)
    assert ahead[0] is ahead[1] is ahead[2]                      # one read-ahead across both boundaries
    loader.set_epoch(7)
    assert same(list(loader), fresh(7)) and loader._ahead is not ahead[0]
    state = {"epoch": 2, "batches_done": 4}
    loader.load_state_dict(state)
    assert same(list(loader), fresh(2, state))
