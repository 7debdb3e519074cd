"""`bench.rehearse`'s training stage plan: on a run of any length, a rank dies after a checkpoint exists
and before the whole run dies, and the whole run dies past the epoch boundary, before the run's end."""

from __future__ import annotations

import pytest

from bench.rehearse import IMAGENET, kill_plan


@pytest.mark.parametrize("scale, ranks", [(1.0, 8), (0.1, 8), (0.01, 2), (0.001, 2)])
def test_both_kills_happen_between_a_checkpoint_and_the_run_s_end(scale: float, ranks: int) -> None:
    per_epoch = round(IMAGENET["train"] * scale) // (ranks * 512)
    p = kill_plan(per_epoch, past_epoch=24, ckpt_every=50, log_every=10, kill_share=0.4)
    assert 1 <= p.log_every <= p.ckpt_every
    first_ckpt = p.ckpt_every
    assert first_ckpt + p.log_every <= p.kill_rank_at                  # the next start has a checkpoint to resume
    assert p.kill_rank_at + p.ckpt_every <= p.kill_run_at                # it saves again before the run dies
    assert p.kill_rank_at + p.log_every <= p.warn_at <= p.kill_run_at - p.log_every   # the warning between them
    assert per_epoch < p.kill_run_at < p.steps                          # past the boundary, before the end
    if scale == 1.0:   # docs/benchmarks.md's rehearsal: killed at steps 130 and 330 (the first logged at or
        # past 124 and 324), ended at 336, with a checkpoint every 50 steps and a line every 10
        assert (per_epoch, p.ckpt_every, p.log_every, p.kill_rank_at, p.kill_run_at, p.steps) == (312, 50, 10, 124, 324, 336)
        assert p.warn_at == 224
