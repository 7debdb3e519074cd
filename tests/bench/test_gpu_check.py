"""The GPU report's verdicts: each target of the GPU issue is marked met or missed from the numbers."""

from __future__ import annotations

from bench.gpu_check import targets


def _report(img_s: float, cost: float, stall: float) -> dict:
    rows = [{"backend": "dali", "recipe": "relicv2", "status": "ok", "img_per_s": img_s},
            {"backend": "dali@cpu", "recipe": "relicv2", "status": "ok", "img_per_s": 10 * img_s}]  # not the GPU graph
    return {"loader": {"b256": {"results": rows}}, "views": {"cost_6_vs_1": cost},
            "train": {"data_stall_fraction": stall}}


def test_targets_met_floor_and_missed() -> None:
    assert [t.rsplit(": ", 1)[1] for t in targets(_report(6500, 1.4, 0.03))] == ["met", "met", "met"]
    assert [t.rsplit(": ", 1)[1] for t in targets(_report(3500, 1.6, 0.05))] == ["floor met", "missed", "missed"]
    assert targets(_report(2000, 1.0, 0.0))[0].endswith("missed")
    assert targets({}) == ["nothing measured"]
