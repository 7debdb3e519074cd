"""Shared fixtures: a tiny synthetic dataset written once per session by the real preprocessor; tests
marked `gpu` are skipped where torch sees no CUDA device; tests marked `long`, then `slow`, run first."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config) -> None:
    # Under pytest-xdist, each worker gets its share of the cores for torch's threads (and, through
    # OMP_NUM_THREADS, the processes its tests start): two workers with two spinning OpenMP threads
    # each oversubscribe 2 cores.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # Test modules import FFCV as they are collected: its typed-dict helpers from numba's on-disk cache
    # (`pipelines.jit`), as the product's processes load them, not compiled in every test process (6.5 s).
    try:
        from pipelines.jit import cache_typed_dict_helpers
        cache_typed_dict_helpers()
    except ImportError:                    # without numba (no FFCV) there is nothing to cache
        pass


def pytest_collection_modifyitems(config, items) -> None:
    # Longest first: under `make test` (two processes, work stealing) the minutes-long tests start at
    # once instead of ending the run alone. The sort is stable: the rest keep their file order.
    items.sort(key=lambda item: ("long" not in item.keywords, "slow" not in item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_data_root(tmp_path_factory):
    """A data root holding `synthetic/` with 64 train and 32 val images of 32 px (FFCV + DALI files)."""
    from preprocess.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    prepare_dataset("synthetic", root, workers=1, train_size=64, val_size=32, image_px=32, seed=0)
    return root


@pytest.fixture(scope="session")
def tiny_args(tiny_data_root):
    """CLI words of a 32-px, batch-16 run of `method` on the tiny dataset, into `out/run`, with timm's
    smallest ResNet (`test_resnet`, the demo's: 9x faster a step than resnet18)."""
    from train.objectives import OBJECTIVES

    def words(method: str, out, *extra: str) -> list[str]:
        return [f"method={method}", "data=synthetic", f"data.root={tiny_data_root}", "data.backend=torch",
                "data.batch_size=16", "data.num_workers=1", "views.global_px=32", "views.local_px=16",
                "model.backbone=test_resnet", "model.proj_hidden=32", "model.proj_out=16",
                f"model.pred_hidden={32 if OBJECTIVES[method].needs.target else 0}",
                "optim.steps=3", "optim.warmup_steps=1", "run.log_every=1", "run.ckpt_every=3",
                "run.max_eval_samples=16", f"run.out_dir={out}", "run.name=run", *extra]

    return words
