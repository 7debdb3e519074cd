"""`python -m train.memory`: activation memory per image grows with the views a method trains on, and
the batch that fits is the budget over the per-image bytes."""

from __future__ import annotations

import pytest

from train.memory import estimate, saved_bytes
from train.resolve import load_config


@pytest.mark.slow
def test_saved_activations_grow_linearly_with_the_batch_and_with_the_views() -> None:
    byol = load_config(["method=byol", "data=synthetic"])
    relic = load_config(["method=relicv2", "data=synthetic", "objective.num_negatives=2"])
    b2, b4, b6 = (saved_bytes(byol, b) for b in (2, 4, 6))
    assert b4 - b2 == pytest.approx(b6 - b4, rel=0.05) and b4 > b2       # linear in the batch
    small, large = estimate(byol, gpu_gib=1.0, batches=(4, 6)), estimate(relic, gpu_gib=1.0, batches=(4, 6))
    assert large.activations_mib_per_image > 1.5 * small.activations_mib_per_image    # 4 + 2 views against 2
    assert 0 < large.fits < small.fits and large.fits % 2 == 0
    per_image = (small.activations_mib_per_image + small.views_mib_per_image) / 1024     # GiB
    assert small.fits == int((0.8 - small.fixed_gib) / per_image) // 2 * 2


def test_runs_of_several_training_batches_and_the_torch_tail_hold_more_views_on_the_device() -> None:
    """With `data.graph_batches=k` the DALI loader holds runs of k batches (DALI's queue of 2, the one
    made ahead, the one in use, and the copy its batches are cut from): 4 batches of views at k=1, 5k
    above. With `data.gpu_tail=torch` DALI's queue holds uint8 crops (a quarter of the float views) and
    the run made ahead peaks at 3 runs of float views while the tail finishes it: 4.5 at k=1. The
    estimate counts them."""
    from train.memory import prefetched_batches

    assert [prefetched_batches(k) for k in (1, 2, 3)] == [4, 10, 15]
    assert prefetched_batches(1, torch_tail=True) == 4.5 and prefetched_batches(2, torch_tail=True) == 11
    one = estimate(load_config(["method=byol", "data=synthetic"]), gpu_gib=1.0, batches=(4, 6))
    two = estimate(load_config(["method=byol", "data=synthetic", "data.graph_batches=2"]), gpu_gib=1.0, batches=(4, 6))
    assert two.views_mib_per_image == pytest.approx(2.5 * one.views_mib_per_image) and two.fits < one.fits
    tail = estimate(load_config(["method=byol", "data=synthetic", "data.gpu_tail=torch"]), gpu_gib=1.0, batches=(4, 6))
    assert tail.views_mib_per_image == pytest.approx(4.5 / 4 * one.views_mib_per_image)
