"""`bench.timing.time_loader`: the one loader timing of the data bench, the profile and the GPU check."""

from __future__ import annotations

from dataclasses import dataclass

from bench.timing import LoaderTiming, cpu_utilisation, time_loader


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


def test_cpu_utilisation_is_the_busy_share_of_the_ticks_and_unknown_without_any() -> None:
    assert cpu_utilisation((100, 400), (250, 600)) == 0.75          # 150 busy of 200 ticks
    assert cpu_utilisation((100, 400), (100, 400)) is None          # a window shorter than a tick
    assert cpu_utilisation(None, (1, 2)) is None                    # no /proc/stat
