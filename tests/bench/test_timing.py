"""`bench.timing`: the one loader timing of the data bench, the profile and the GPU check (steady state,
first batch and the taking thread's CPU apart), the one rounds loop they time their cells in, the
first-batch and epoch-boundary timing of the profile, and the one stage split of the data bench and the
profile."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from bench import data
from bench.timing import (EpochTiming, LoaderTiming, cpu_utilisation, device_work, in_rounds, ladder_cell,
                          stages_ms, steady_batches, time_epochs, time_loader)


@dataclass
class _Batch:
    batch_size: int


class _Loader:
    def __init__(self, batch_size: int, made: list[int], epoch: int) -> None:
        self.batch_size, self.taken = batch_size, 0
        made.append(epoch)

    def __iter__(self):
        while True:
            self.taken += 1
            yield _Batch(self.batch_size)


def test_each_run_builds_a_fresh_loader_skips_its_warmup_and_times_the_rest() -> None:
    made: list[int] = []
    loaders: list[_Loader] = []

    def make(r: int) -> _Loader:
        loaders.append(_Loader(8, made, r))
        return loaders[-1]

    timing = time_loader(make, batches=4, warmup=2, repeats=3, device="cpu")
    assert isinstance(timing, LoaderTiming) and made == [0, 1, 2]
    assert [ld.taken for ld in loaders] == [6, 6, 6]
    assert len(timing.img_per_s) == len(timing.cpu_utilisation) == 3 and all(r > 0 for r in timing.img_per_s)
    assert all(u is None or 0.0 <= u <= 1.0 for u in timing.cpu_utilisation)
    assert min(timing.img_per_s) <= timing.median <= max(timing.img_per_s)


def test_a_ladder_cell_times_each_rung_in_order_at_the_round_s_epoch() -> None:
    """Round 2 builds one loader a rung, in the ladder's order, at epoch 2; the first rung's run gives the
    first batch, the thread's CPU and the machine's share as well."""
    made: list[tuple[str, int]] = []

    def make(rung: str, epoch: int) -> _Loader:
        made.append((rung, epoch))
        return _Loader(8, [], epoch)

    cell = ladder_cell(make, {"full": "full", "crops_only": "crops"}, batches=3, warmup=1, device="cpu")
    out = cell(2)
    assert made == [("full", 2), ("crops", 2)]
    assert set(out) == {"full", "crops_only", "first_batch_s", "thread_cpu_ms", "cpu_utilisation"}
    assert all(len(v) == 1 for v in out.values()) and out["full"][0] > 0 and out["crops_only"][0] > 0


class _Bursts:
    """A DataLoader of `workers` processes that each make a whole batch in `round_s`: the batches come in
    bursts of `workers`, the first after `round_s`, one epoch of `epoch` batches after another; an epoch's
    batches are asked for only when it starts, so its last round drains (fewer batches than workers)."""

    def __init__(self, workers: int, round_s: float, epoch: int) -> None:
        self.workers, self.round_s, self.epoch = workers, round_s, epoch

    def __len__(self) -> int:
        return self.epoch

    def __iter__(self):
        for i in range(self.epoch):
            if i % self.workers == 0:
                time.sleep(self.round_s)
            yield _Batch(8)


def test_steady_state_is_timed_over_whole_rounds_of_the_workers_in_one_epoch() -> None:
    assert steady_batches(8, 2, 16) == (64, 32) and steady_batches(100, 40, 16) == (112, 48)
    assert steady_batches(16, 3, 0) == (16, 3)
    # 4 workers, a round of 4 batches of 8 every 20 ms: 1,600 img/s. 2 warm-up and 2 timed batches
    # (the former GPU check's window) fall inside one burst: an impossible rate.
    burst = time_loader(lambda r: _Bursts(4, 0.02, 24), batches=2, warmup=2, repeats=1, device="cpu")
    steady = time_loader(lambda r: _Bursts(4, 0.02, 24), batches=2, warmup=2, repeats=1, device="cpu", workers=4)
    assert burst.median > 10_000
    assert (steady.batches, steady.warmup) == (16, 8)                  # 4 and 2 rounds, in an epoch of 24
    assert 800 < steady.median <= 1_700                                # sleeps only ever run long
    assert steady.first_batch_s[0] >= 0.02 and steady.thread_cpu_ms[0] < 5


def test_a_worker_loader_whose_epoch_is_shorter_than_a_steady_state_run_is_refused() -> None:
    """On an H200, 16 DataLoader workers on an epoch of 7 batches of 256 spent most of the run at epoch
    ends (7 workers busy at best): the 'torchvision baseline' would be the epoch ends' rate."""
    with pytest.raises(ValueError, match=r"an epoch of this loader has 6 batches, fewer than the 24 .*--n"):
        time_loader(lambda r: _Bursts(4, 0.02, 6), batches=2, warmup=2, repeats=1, device="cpu", workers=4)
    # What the refusal saves: across epochs of 6 the rate is the drained epochs' (2 rounds for 6 batches).
    drained = time_loader(lambda r: _Bursts(4, 0.02, 6), batches=24, warmup=6, repeats=1, device="cpu")
    assert drained.median < 0.8 * 1_600


def test_rounds_time_every_cell_once_per_round_and_report_a_broken_one() -> None:
    order: list[tuple[str, int]] = []

    def cell(name: str, fail_at: int | None = None):
        def run(rnd: int) -> dict[str, list]:
            order.append((name, rnd))
            if rnd == fail_at:
                raise RuntimeError(f"{name} broke\nsecond line")
            return {"img_per_s": [10.0 * rnd]}
        return run

    got = in_rounds(3, {"ceiling": cell("ceiling"), "dali": cell("dali", fail_at=1), "torch": cell("torch")})
    assert order == [("ceiling", 0), ("dali", 0), ("torch", 0), ("ceiling", 1), ("dali", 1), ("torch", 1),
                     ("ceiling", 2), ("torch", 2)]
    assert got["ceiling"].runs == {"img_per_s": [0.0, 10.0, 20.0]} and got["ceiling"].ok
    assert not got["dali"].ok and got["dali"].error == "RuntimeError: dali broke" and "Traceback" in got["dali"].traceback


def test_cpu_utilisation_is_the_busy_share_of_the_ticks_and_unknown_without_any() -> None:
    assert cpu_utilisation((100, 400), (250, 600)) == 0.75          # 150 busy of 200 ticks
    assert cpu_utilisation((100, 400), (100, 400)) is None          # a window shorter than a tick
    assert cpu_utilisation(None, (1, 2)) is None                    # no /proc/stat


class _Clock:
    """A clock the fake loader advances: its time is what the loader says it spent."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _EpochLoader:
    """`batches` per epoch, `gap` s apart; the first batch of an epoch `start` s after its iteration begins."""

    def __init__(self, clock: _Clock, build: float, start: float, gap: float, batches: int) -> None:
        clock.now += build
        self.clock, self.start, self.gap, self.batches, self.epochs = clock, start, gap, batches, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        for k in range(self.batches):
            self.clock.now += self.start if k == 0 else self.gap
            yield _Batch(4)


def test_epoch_timing_gives_the_first_batch_and_the_boundary_gap_in_mean_gaps() -> None:
    clock, made = _Clock(), []

    def make(epoch: int) -> _EpochLoader:
        made.append(_EpochLoader(clock, build=1.5, start=0.5, gap=0.1, batches=5))
        made[-1].epochs.append(epoch)
        return made[-1]

    e = time_epochs(make, epochs=3, device="cpu", first_epoch=6, clock=clock)
    assert len(made) == 1 and made[0].epochs == [6, 7, 8]          # one loader, set_epoch as the loop calls it
    assert e.first_batch_s == pytest.approx(1.5 + 0.5)            # building it, then its first batch
    assert len(e.gaps_s) == 3 * 4 and e.mean_gap_s == pytest.approx(0.1) == e.median_gap_s
    assert e.boundary_gaps_s == pytest.approx((0.5, 0.5))
    assert e.boundary_stall == pytest.approx(5.0)
    # Batches in bursts (three workers finishing together: 0.19 s, then 0.01 s twice): the median gap
    # is 0.01 s, the rate one batch per 0.07 s; the stall is counted in the rate's gaps.
    bursty = EpochTiming(1.0, (0.19, 0.01, 0.01) * 4, (0.19,))
    assert bursty.median_gap_s == pytest.approx(0.01) and bursty.boundary_stall == pytest.approx(0.19 / 0.07)
    # A loader whose next epoch is ready when the last one ends has no stall.
    e = time_epochs(lambda ep: _EpochLoader(clock, 0.0, 0.1, 0.1, 5), epochs=2, device="cpu", clock=clock)
    assert e.boundary_stall == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2 batches per epoch"):
        time_epochs(lambda ep: _EpochLoader(clock, 0.0, 0.1, 0.1, 1), epochs=2, device="cpu", clock=clock)


def test_device_work_is_the_union_of_the_device_intervals_per_batch() -> None:
    """Two streams overlapping: the device is busy for the union of the intervals, less than the sum of
    the kernels' times; host-side events are not device work."""
    events = [{"cat": "kernel", "name": "resize", "ts": 0, "dur": 400, "args": {"stream": 1}},   # 0-400 us
              {"cat": "kernel", "name": "blur", "ts": 300, "dur": 300, "args": {"stream": 2}},    # overlaps
              {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 1000, "dur": 200, "args": {"stream": 1}},
              {"cat": "kernel", "name": "resize", "ts": 1100, "dur": 50, "args": {"stream": 2}},  # in the copy
              {"cat": "kernel", "name": "resize", "ts": 3000, "dur": 100, "args": {"stream": 1}},  # after 1.8 ms
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5, "tid": 1},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 290, "dur": 5, "tid": 2},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 900, "tid": 3},
              {"cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 5000}]
    w = device_work(events, batches=2)
    assert w["busy_ms"] == pytest.approx((600 + 200 + 100) / 1000 / 2)
    assert w["kernel_ms"] == pytest.approx((400 + 300 + 200 + 50 + 100) / 1000 / 2)
    assert w["kernels"] == 2 and w["launching_threads"] == 2
    assert [(r["name"], r["calls"]) for r in w["top"]] == [("resize", 1.5), ("blur", 0.5), ("Memcpy DtoD", 0.5)]
    assert w["top"][0]["ms"] == pytest.approx(0.275)
    # Stream 1 (700 us of work) waited 1.8 ms once (an input) and had a 600-us gap (an operator's set-up).
    assert w["busiest_stream"] == pytest.approx({"stream": 1, "work_ms": 0.35, "waits_ms": 0.9, "gaps_ms": 0.3})


def test_stages_are_differences_of_the_ablation_ladder() -> None:
    # Per-image ms: full 10 ms, no mix 8, no blur 5, crops only 4; read 0.5 ms, decode 2 ms.
    rates = {"full": 100.0, "no_mix": 125.0, "no_blur": 200.0, "crops_only": 250.0}
    got = stages_ms(rates, decode=500.0, read=2000.0)
    want = {"read": 0.5, "decode": 2.0 - 0.5, "crops_resize_rest": 4.0 - 2.0, "colour": 5.0 - 4.0,
            "blur": 8.0 - 5.0, "mix": 10.0 - 8.0}
    assert got == pytest.approx(want)
    # A recipe without blur or mix has no such stage; a backend faster than the ceiling decoder
    # gets 0 for crops, not a negative time.
    got = stages_ms({"full": 500.0, "crops_only": 1000.0}, decode=500.0, read=2000.0)
    assert got["blur"] is None and got["mix"] is None and got["crops_resize_rest"] == 0.0
    assert got["colour"] == pytest.approx(1.0)



def test_the_data_bench_splits_an_image_s_time_by_the_same_ladder() -> None:
    # Per-image ms: full 10, crops only 4, decode 2 (no read ceiling: decode holds it): 2 + 2 + 6 of 10.
    assert data.stage_shares(100.0, 250.0, 500.0) == pytest.approx(
        {"decode": 0.2, "crops_resizes": 0.2, "colour_and_rest": 0.6})
    # A loader faster than the ceiling's decoder: all of its time is the decode's.
    assert data.stage_shares(1000.0, 1000.0, 500.0) == pytest.approx(
        {"decode": 1.0, "crops_resizes": 0.0, "colour_and_rest": 0.0})
