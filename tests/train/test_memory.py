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
