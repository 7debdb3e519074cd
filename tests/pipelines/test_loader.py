"""pipelines/spec.py and loader.py: the epoch order every loader shares, the spec checks and their errors, the
choice of a backend."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pipelines import schema
from pipelines.loader import build_loader
from pipelines.mixing import MixSpec
from pipelines.spec import DatasetInfo, EpochOrder, LoaderError, LoaderSpec, Stream, rank_range
from pipelines.views import load_recipe

RECIPE = load_recipe("byol", 32, 16)


def _spec(**kw) -> LoaderSpec:
    return LoaderSpec(root="", dataset="", recipe=RECIPE, **{"split": "train", "batch_size": 4, **kw})


@pytest.mark.parametrize("n, world, bs", [(40, 1, 4), (41, 2, 4), (50, 3, 6), (7, 2, 2)])
def test_drop_last_shards_are_disjoint_equal_and_whole_batches(n, world, bs):
    per_rank = []
    for r in range(world):
        o = EpochOrder(_spec(rank=r, world_size=world, batch_size=bs, seed=5), n)
        batches = o.remaining()
        assert len(batches) == len(o) == n // (world * bs)
        assert all(len(idx) == bs for _, idx in batches)
        per_rank.append(np.concatenate([idx for _, idx in batches]))
    allidx = np.concatenate(per_rank)
    assert len(set(allidx.tolist())) == len(allidx) and set(allidx.tolist()) <= set(range(n))


@pytest.mark.parametrize("n, world", [(10, 3), (41, 2), (5, 4)])
def test_keep_all_covers_every_record_once_in_contiguous_ranges(n, world):
    got = []
    for r in range(world):
        o = EpochOrder(_spec(rank=r, world_size=world, batch_size=4, shuffle=False, drop_last=False), n)
        idx = np.concatenate([i for _, i in o.remaining()]) if len(o) else np.zeros(0, np.int64)
        lo, hi = rank_range(n, r, world)
        assert idx.tolist() == list(range(lo, hi))
        got += idx.tolist()
    assert got == list(range(n))


def test_a_limit_reads_records_spread_evenly_over_the_split():
    """An evaluation's cap on a split written in class order still sees every part of it."""
    got = []
    for r in range(2):
        o = EpochOrder(_spec(rank=r, world_size=2, batch_size=2, shuffle=False, drop_last=False, limit=5), 20)
        got += np.concatenate([i for _, i in o.remaining()]).tolist()
    assert got == [0, 4, 8, 12, 16]
    assert sorted(EpochOrder(_spec(seed=3, limit=8, batch_size=2), 20).indices().tolist()) == [0, 2, 5, 7, 10, 12, 15, 17]
    assert EpochOrder(_spec(limit=50, shuffle=False, drop_last=False), 20).indices().tolist() == list(range(20))


def test_shuffle_is_per_epoch_and_shared_by_ranks():
    a, b = (EpochOrder(_spec(rank=r, world_size=2, seed=1), 40) for r in range(2))
    e0 = np.concatenate([a.indices(), b.indices()])
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = np.concatenate([a.indices(), b.indices()])
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(40)) and not np.array_equal(e0, e1)
    assert np.array_equal(EpochOrder(_spec(seed=1), 40).indices(), EpochOrder(_spec(seed=1), 40).indices())


def test_position_names_the_next_batch_and_resumes_there():
    o = EpochOrder(_spec(seed=2), 20)                                       # 5 batches
    assert o.state_dict() == {"epoch": 0, "batches_done": 0}
    for _ in range(2):
        o.advance()
    state = o.state_dict()
    assert state == {"epoch": 0, "batches_done": 2}
    r = EpochOrder(_spec(seed=2), 20)
    r.load_state_dict(state)
    assert [k for k, _ in r.remaining()] == [2, 3, 4]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(r.remaining(), o.remaining()))
    for _ in range(3):
        o.advance()
    assert o.state_dict() == {"epoch": 1, "batches_done": 0}                # after the last batch: next epoch
    o.set_epoch(1)
    assert o.state_dict() == {"epoch": 1, "batches_done": 0}
    assert o.batch_seed(0) != r.batch_seed(0) and r.batch_seed(1) != r.batch_seed(2)


def test_each_random_stream_has_its_own_seeds_for_every_batch_and_epoch():
    """The streams of `Stream` never share a seed: no two (stream, batch, epoch) give the same one,
    so the ffcv key, the mixes or the shuffle cannot draw what another stream draws."""
    o = EpochOrder(_spec(seed=3), 20)
    seeds = [o.batch_seed(k, stream, epoch) for stream in Stream for k in range(4) for epoch in range(3)]
    assert len(set(seeds)) == len(seeds) == len(Stream) * 12


def test_bad_specs_are_one_loader_error(tmp_path):
    from preprocess.prepare import prepare_dataset

    prepare_dataset("synthetic", tmp_path, workers=1, train_size=16, val_size=8, image_px=16)
    good = LoaderSpec(root=str(tmp_path), dataset="synthetic", split="train", recipe=RECIPE, batch_size=4)
    for bad, needle in ((replace(good, batch_size=3), "even"), (replace(good, batch_size=0), "even"),
                        (replace(good, rank=2, world_size=2), "rank 2"), (replace(good, batch_size=32), "too small"),
                        (replace(good, split="test"), "no split 'test'"),
                        (replace(good, mix=MixSpec("sdmp"), drop_last=False), "full batches"),
                        (replace(good, mix=MixSpec("dacl", alpha=1.0)), "alpha"),
                        (replace(good, mix=MixSpec("sdmp", sdmp_mixers=("cutup",))), "cutup"),
                        (replace(good, gpu_contrast="cpu"), "gpu_contrast='cpu' is not one of device, host"),
                        (replace(good, gpu_tail="numpy"), "gpu_tail='numpy' is not one of graph, torch"),
                        (replace(good, graph_batches=0), "graph_batches=0 must be a whole number"),
                        (replace(good, graph_batches=True), "graph_batches=True must be a whole number")):
        with pytest.raises(LoaderError, match=needle) as e:
            build_loader("torch", bad)
        assert "\n" not in str(e.value)
    with pytest.raises(LoaderError, match="choose one of torch, torchvision, ffcv, dali"):
        build_loader("trch", good)
    with pytest.raises(schema.DatasetError, match="does not exist"):
        build_loader("torch", replace(good, dataset="nope"))


def test_dataset_info_reads_the_manifest_once(tmp_path):
    from preprocess.prepare import prepare_dataset

    prepare_dataset("synthetic", tmp_path, workers=1, train_size=16, val_size=8, image_px=16, gt_masks_as_mask=True)
    info = DatasetInfo.read(tmp_path, "synthetic", "val")
    m = schema.read_manifest(tmp_path / "synthetic")
    assert (info.count, info.mean, info.std, info.has_masks) == (8, m.mean, m.std, True)


def test_auto_backend_is_the_fastest_the_dataset_has_files_for(tiny_data_root, tmp_path):
    """GPU: the DALI graph; CPU: ffcv when the dataset has .beton files, else the torch reference on the shards."""
    import json

    from pipelines.loader import auto_backend

    assert auto_backend("cuda", tiny_data_root, "synthetic") == "dali"
    assert auto_backend("cpu", tiny_data_root, "synthetic") == "ffcv"
    manifest = json.loads((tiny_data_root / "synthetic" / "manifest.json").read_text())
    del manifest["formats"]["ffcv"]                     # as written where ffcv is not installed
    manifest["files"] = {}
    (tmp_path / "dali-only").mkdir()
    (tmp_path / "dali-only" / "manifest.json").write_text(json.dumps(manifest))
    assert auto_backend("cpu", tmp_path, "dali-only") == "torch"


def test_a_backend_whose_package_is_not_installed_says_so_in_one_line(tiny_data_root, monkeypatch, capsys):
    """Without FFCV and DALI (their imports blocked as an absent package is): their loaders are one
    LoaderError line naming the extra to install and the backends that work; `auto` reads with the torch
    reference on a CPU and on a GPU (where it says once that DALI is missing), which builds."""
    import sys

    from pipelines import loader
    from pipelines.loader import auto_backend

    monkeypatch.setattr(loader, "_NOTED", set())
    monkeypatch.setitem(sys.modules, "ffcv", None)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    spec = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", split="train", recipe=RECIPE, batch_size=4,
                      num_workers=1)
    for backend in ("ffcv", "dali"):
        with pytest.raises(LoaderError) as e:
            build_loader(backend, spec)
        message = str(e.value)
        assert "\n" not in message and f"pip install 'viewmill[{backend}]'" in message, message
        assert message.endswith("another backend: torch, torchvision"), message
    assert auto_backend("cpu", tiny_data_root, "synthetic") == "torch"
    assert capsys.readouterr().err == ""
    assert auto_backend("cuda", tiny_data_root, "synthetic") == "torch"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'viewmill[dali]'" in err, err
    assert auto_backend("cuda", tiny_data_root, "synthetic") == "torch" and capsys.readouterr().err == ""
    assert len(build_loader("torch", spec)) == 16


def test_background_removal_without_masks_is_said_once_and_with_masks_nothing(tiny_data_root, tmp_path, capsys):
    from preprocess.prepare import prepare_dataset

    from pipelines import loader

    loader._NOTED.clear()
    recipe = load_recipe("relicv2", 32, 16)                 # saliency_p 0.1 on the large views
    spec = LoaderSpec(root=str(tiny_data_root), dataset="synthetic", split="train", recipe=recipe,
                      batch_size=4, num_workers=1)
    build_loader("torch", spec)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: recipe relicv2 removes backgrounds")
    assert "make saliency DATASET=synthetic" in err[0]
    build_loader("torch", spec)                                            # said once per process
    build_loader("torch", replace(spec, rank=1, world_size=2))             # other ranks stay quiet
    build_loader("torch", replace(spec, recipe=load_recipe("byol", 32, 16)))  # no background removal
    assert capsys.readouterr().err == ""

    masked = prepare_dataset("synthetic", tmp_path, workers=1, train_size=16, val_size=8, image_px=32,
                             gt_masks_as_mask=True)
    capsys.readouterr()
    info = DatasetInfo.read(tmp_path, masked.name, "train")
    assert info.reads_masks(recipe) and not info.reads_masks(load_recipe("byol", 32, 16))
    build_loader("torch", replace(spec, root=str(tmp_path)))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("backend", ["torch", pytest.param("torchvision", marks=pytest.mark.slow),   # those whose
                                     pytest.param("dali", marks=pytest.mark.slow)])          # workers are processes
def test_close_ends_the_workers_while_an_error_that_came_out_of_them_is_still_held(backend, tiny_data_root,
                                                                                   monkeypatch):
    """A worker's error (a record it cannot read) comes out of the loader with a traceback whose frames
    keep the loader's iterator or pipeline; `close()` ends the workers at once all the same, not when the
    garbage collector finds that cycle (the evaluation, the training loop and the protocols close their
    loaders when an exception, a requeue, passes)."""
    pytest.importorskip({"torch": "torch", "torchvision": "torchvision", "dali": "nvidia.dali"}[backend])
    import os

    from pipelines.shards import ShardReader
    from tests.processes import pids_under, workers_of

    def unreadable(self, i: int) -> bytes:
        raise ValueError(f"record {i} cannot be read")

    monkeypatch.setattr(ShardReader, "image", unreadable)      # the forked workers read with it
    before = pids_under(os.getpid())
    loader = build_loader(backend, LoaderSpec(root=str(tiny_data_root), dataset="synthetic", split="train",
                                              recipe=RECIPE, batch_size=4, num_workers=2))
    with pytest.raises(Exception, match="cannot be read") as held:      # kept, with its traceback, to the end
        next(iter(loader))
    assert workers_of(os.getpid(), before) and held.value
    loader.close()
    assert workers_of(os.getpid(), before) == []
