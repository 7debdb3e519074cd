"""The GPU report's verdicts: each target of the GPU issue is marked met or missed from the numbers."""

from __future__ import annotations

from bench.gpu_check import targets


def _report(img_s: float, base_s: float, thread_ms: float, cost: float, stall: float, failed: int) -> dict:
    rows = [{"backend": "dali", "recipe": "relicv2", "status": "ok", "img_per_s": img_s, "thread_cpu_ms": thread_ms},
            {"backend": "torchvision", "recipe": "relicv2", "status": "ok", "img_per_s": base_s, "workers": 16}]
    count = {"passed": 42 - failed, "failure": failed, "error": 0, "skipped": 0}
    return {"loader": {"results": rows}, "views": {"cost_6_vs_1": cost}, "train": {"data_stall_fraction": stall},
            "tests": {"count": count}}


def verdicts(report: dict) -> list[str]:
    return [t.rsplit(": ", 1)[1] for t in targets(report)]


def test_targets_met_moonshot_and_missed() -> None:
    assert verdicts(_report(12_500, 4_000, 1.2, 1.3, 0.02, 0)) == ["moonshot met", "moonshot met", "met", "met",
                                                                   "met", "met"]
    assert verdicts(_report(10_500, 5_000, 2.9, 1.4, 0.03, 0)) == ["met", "met", "met", "met", "met", "met"]
    assert verdicts(_report(6_094, 4_196, 23.5, 2.01, 0.135, 7)) == ["missed"] * 6      # the first GPU runs
    assert targets({}) == ["nothing measured"]
