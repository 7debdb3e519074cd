"""Schedules are pure functions of the step: they hit their endpoints and are monotone."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from train import schedules
from train.config import OptimConfig

values = st.floats(0.0, 10.0, allow_nan=False)


@given(total=st.integers(1, 10_000), start=values, end=values)
def test_cosine_endpoints_and_monotone(total: int, start: float, end: float) -> None:
    ys = [schedules.cosine(k, total, start, end) for k in range(0, total + 1, max(total // 50, 1))]
    assert abs(schedules.cosine(0, total, start, end) - start) < 1e-9
    assert abs(schedules.cosine(total, total, start, end) - end) < 1e-9
    assert abs(schedules.cosine(total + 5, total, start, end) - end) < 1e-9
    sign = 1 if end >= start else -1
    assert all(sign * (b - a) >= -1e-12 for a, b in zip(ys, ys[1:]))


@given(total=st.integers(2, 5_000), warmup_frac=st.floats(0.0, 0.9), peak=st.floats(1e-4, 10.0),
       floor_frac=st.floats(0.0, 1.0))
def test_warmup_cosine_rises_then_falls_to_the_floor(total, warmup_frac, peak, floor_frac) -> None:
    warmup = int(total * warmup_frac)
    floor = peak * floor_frac
    ys = [schedules.warmup_cosine(k, total, warmup, peak, floor) for k in range(total + 1)]
    assert all(0 < y <= peak + 1e-9 for y in ys[:warmup])
    assert all(b >= a for a, b in zip(ys[:warmup], ys[1:warmup]))
    assert abs(ys[warmup] - peak) < 1e-9
    assert all(b <= a + 1e-12 for a, b in zip(ys[warmup:], ys[warmup + 1:]))
    assert abs(ys[total] - floor) < 1e-9


@given(steps=st.integers(10, 2_000), batch=st.integers(1, 64).map(lambda n: 32 * n))
def test_step_values_scale_lr_and_run_ema_from_start_to_one(steps: int, batch: int) -> None:
    optim = OptimConfig(lr=0.3, steps=steps, warmup_steps=0, ema_start=0.99, ema_end=1.0)
    first, last = schedules.at(optim, 0, 10, batch), schedules.at(optim, steps, 10, batch)
    assert abs(first.lr - 0.3 * batch / 256) < 1e-9            # linear scaling rule
    assert abs(first.ema - 0.99) < 1e-12 and abs(last.ema - 1.0) < 1e-12
    emas = [schedules.at(optim, k, 10, batch).ema for k in range(0, steps + 1, max(steps // 20, 1))]
    assert all(b >= a for a, b in zip(emas, emas[1:]))
    assert first.epoch == 0 and schedules.at(optim, 25, 10, batch).epoch == 2.5
