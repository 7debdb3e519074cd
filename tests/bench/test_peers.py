"""`bench.peers`: lightly and SPDL, as users run them, make the recipe's views from the same files as
viewmill's backends; what a peer cannot make is skipped with why. Nothing here asserts a speed."""

from __future__ import annotations

import hashlib

import pytest
import torch

from bench import peers
from pipelines.mixing import MixSpec
from pipelines.shards import ShardReader, scan_shards
from pipelines.spec import DatasetInfo, LoaderSpec
from pipelines.views import load_recipe


def _spec(root, recipe: str, **kw) -> LoaderSpec:
    return LoaderSpec(root=str(root), dataset="synthetic", split="train", recipe=load_recipe(recipe, 32, 16),
                      batch_size=8, num_workers=2, **kw)


def test_lightly_reads_the_shard_records_own_bytes_as_an_image_folder(tiny_data_root, tmp_path) -> None:
    spec = _spec(tiny_data_root, "byol")
    info = DatasetInfo.read(spec.root, spec.dataset, spec.split)
    folder = peers.image_folder(spec, info, tmp_path)
    reader = ShardReader(scan_shards(info.dir / "train", info.count))
    files = sorted(p for p in folder.iterdir() if p.suffix in (".jpg", ".png"))
    assert len(files) == info.count == 64
    digest = lambda b: hashlib.sha256(b).hexdigest()   # noqa: E731
    assert [digest(f.read_bytes()) for f in files] == [digest(reader.image(i)) for i in range(info.count)]


@pytest.mark.parametrize("recipe, transform, sizes", [
    ("multicrop8", "DINOTransform", [32] * 2 + [16] * 6),
    ("byol", "BYOLTransform", [32, 32]),
    ("relicv2", "MultiViewTransform of 6 BYOLView1Transforms", [32] * 4 + [16] * 2),
])
def test_lightly_makes_every_view_of_the_recipe_at_its_size(tiny_data_root, tmp_path, recipe, transform, sizes) -> None:
    spec = _spec(tiny_data_root, recipe, limit=32)
    assert transform in peers.check("lightly", spec.recipe, "none")
    loader = peers.build("lightly", spec, tmp_path)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 32 // 8                       # `limit` records, whole batches, as every loader
        views = batches[0].views
        assert [v.shape for v in views] == [(8, 3, s, s) for s in sizes]
        assert all(v.dtype == torch.float32 for v in views)  # lightly normalises in its workers
    # Each view draws its own crop: two views of one image differ.
    assert not torch.equal(views[0], views[1])


def test_spdl_makes_the_batches_every_backend_makes_mixes_and_staged_views_included(tiny_data_root) -> None:
    for recipe, mix, fields in (("rsa", MixSpec(), ("global_views", "weak_views")),
                                ("byol", MixSpec(kind="sdmp"), ("global_views", "mixed"))):
        spec = _spec(tiny_data_root, recipe, mix=mix, limit=32)
        assert "spdl.io.load_image" in peers.check("spdl", spec.recipe, mix.kind)
        loader = peers.build("spdl", spec, None)
        loader.set_epoch(1)
        batches = list(loader)
        assert len(batches) == 4
        seen = torch.cat([b.index for b in batches])
        assert len(set(seen.tolist())) == 32                 # every record of the epoch once
        for name in fields:
            v = getattr(batches[0], name)
            assert v is not None and v.shape[1:] == (8, 3, 32, 32) and v.dtype == torch.float32


def test_a_peer_without_a_composition_or_not_installed_is_skipped_with_why(monkeypatch) -> None:
    rsa, byol = load_recipe("rsa", 32, 16), load_recipe("byol", 32, 16)
    with pytest.raises(peers.PeerSkip, match="no staged"):
        peers.check("lightly", rsa, "none")
    with pytest.raises(peers.PeerSkip, match="no intra-batch mixes"):
        peers.check("lightly", byol, "sdmp")
    with pytest.raises(peers.PeerSkip, match="no intra-batch mixes or staged views"):
        peers.check("dali-plain", rsa, "none")
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    for peer in peers.PEERS:
        extra = "dali" if peer == "dali-plain" else "peers"
        with pytest.raises(peers.PeerSkip, match=rf"not installed \(pip install 'viewmill\[{extra}\]'"):
            peers.check(peer, byol, "none")


def test_the_plain_dali_pipeline_makes_every_view_of_the_recipe_at_its_size(tiny_data_root) -> None:
    """`dali-plain`: DALI's own reader over the shards and per-view operators, through DALI's PyTorch
    iterator: whole batches of every view, normalised float, epoch after epoch."""
    pytest.importorskip("nvidia.dali")
    spec = _spec(tiny_data_root, "relicv2")
    assert "fn.readers.webdataset" in peers.check("dali-plain", spec.recipe, "none")
    loader = peers.build("dali-plain", spec, None)
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader) == 64 // 8
        sizes = [tuple(v.shape) for v in batches[0].views]
        assert sizes == [(8, 3, 32, 32)] * 4 + [(8, 3, 16, 16)] * 2
        assert all(v.dtype == torch.float32 and -8 < float(v.min()) < float(v.max()) < 8 for v in batches[0].views)
