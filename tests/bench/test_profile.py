"""`make profile` writes one report that follows its schema, with charts; `make profile-compare` flags
what changed beyond the spread. Nothing here asserts a speed."""

from __future__ import annotations

import copy
import json

import pytest

from bench import profile, profile_report


@pytest.mark.slow
def test_quick_profile_writes_a_schema_valid_report_with_stages_split_and_charts(tiny_data_root, tmp_path) -> None:
    # The tiny dataset stands in for the profile's cached synthetic data (no preprocessing here).
    (tmp_path / "bench-data" / "data").mkdir(parents=True)
    (tmp_path / "bench-data" / "data" / "synthetic").symlink_to(tiny_data_root / "synthetic")
    argv = ["--quick", "--dataset", "synthetic", "--recipes", "byol+sdmp", "--backends", "torch,torchvision,lightly,spdl",
            "--methods", "byol", "--cores", "2", "--train-args", "data.backend=torch model.backbone=test_resnet",
            "--trace", "--out", str(tmp_path)]
    assert profile.main(argv) == 0
    (out,) = tmp_path.glob("profile-*")
    report = json.loads((out / "profile.json").read_text())
    profile_report.validate(report)                      # the schema, as the compare command reads it

    rows = {r["backend"]: r for r in report["loader"]["rows"]}
    assert set(rows) == {"torch", "torchvision", "lightly", "spdl"}
    assert [rows[b]["status"] for b in ("torch", "torchvision", "spdl")] == ["ok"] * 3
    # The peers: lightly has no batch mixes (skipped, with why); SPDL ran as a backend, on the same files.
    assert rows["lightly"]["status"] == "skipped" and "no intra-batch mixes" in rows["lightly"]["note"]
    assert rows["spdl"]["settings"].startswith(f"spdl {report['config']['peers']['spdl']}:")
    assert report["versions"]["spdl"] == report["config"]["peers"]["spdl"] is not None
    assert rows["torchvision"]["vs_torchvision"] == 1.0
    tv = rows["torch"]
    assert tv["vs_torchvision"] == tv["img_per_s"]["median"] / rows["torchvision"]["img_per_s"]["median"]
    assert tv["vs_peers"] == {"lightly": None, "spdl": tv["img_per_s"]["median"] / rows["spdl"]["img_per_s"]["median"]}
    # First batch and epoch boundaries, for every backend and peer that ran: whole epochs of one loader.
    for r in (rows[b] for b in ("torch", "torchvision", "spdl")):
        e = r["epoch_boundary"]
        assert r["first_batch_s"]["median"] > 0
        assert e["stall"]["runs"] == pytest.approx([b / g for b, g in zip(e["longest_boundary_gap_ms"]["runs"],
                                                                          e["mean_gap_ms"]["runs"])])
    # byol+sdmp has blur and a mix: every rung of the ladder ran, so every stage has a time.
    assert set(tv["ladder_img_per_s"]) == {"full", "no_mix", "no_blur", "crops_only"}
    assert all(tv["stages_ms"][s] is not None and tv["stages_ms"][s] >= 0 for s in profile_report.STAGES)
    # None only where the timed window is shorter than the kernel's tick (quick mode's tiny batches)
    assert tv["cpu_utilisation"] is None or 0.0 < tv["cpu_utilisation"] <= 1.0
    assert {c["kind"] for c in report["loader"]["ceilings"]} == {"read", "decode", "decode+crops"}

    (row,) = report["train"]["rows"]
    assert row["status"] == "ok", row.get("error")
    assert row["method"] == "byol" and row["device"] == "cpu" and row["batch_size"] == 12
    # The loop's phase ranges reached the profiler: forward, backward, optimiser and BYOL's EMA target.
    assert all(row["split_ms"][k] > 0 for k in ("forward", "backward", "optimizer", "ema"))
    assert row["data_stall_fraction"] == max(0.0, 1 - row["steps_per_s"]["median"] / row["on_device_steps_per_s"]["median"])
    assert report["config"]["train_config"]["byol"]["model"]["backbone"] == "test_resnet"
    trace = json.loads((out / "trace-byol.json").read_text())
    assert any(e.get("name") == "step/backward" for e in trace["traceEvents"])

    assert [s["workers"] for s in report["scaling"]["loader"] if s["backend"] == "torch"] == [1, 2]
    assert [s["batch_size"] for s in report["scaling"]["batch"]] == [2, 6, 12, 24]
    for chart in ("loader.png", "train.png", "scaling.png"):
        assert chart in report["charts"] and (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "profile.md").read_text()
    assert "| byol+sdmp | torch | cpu |" in md and "| byol | cpu | 12 |" in md and "![loader](loader.png)" in md
    assert "| byol+sdmp | lightly | cpu | skipped: lightly has no intra-batch mixes |" in md
    assert "### Against the peers" in md and "### First batch and epoch boundaries (byol+sdmp" in md


def _report(cpu: str = "EPYC", tv_rate: float = 100.0, ffcv_rate: float = 600.0, steps: float = 5.0,
            ceiling: float = 700.0) -> dict:
    """A minimal valid report: two loader rows, one ceiling set, one method, scaling points."""
    def s(x: float) -> dict:
        return {"median": x, "min": 0.95 * x, "max": 1.05 * x, "runs": [0.95 * x, x, 1.05 * x]}

    def loader_row(be: str, rate: float) -> dict:
        return {"recipe": "relicv2", "backend": be, "device": "cpu", "status": "ok", "img_per_s": s(rate),
                "views_per_s": 6 * rate, "cpu_utilisation": 0.9, "vs_torchvision": rate / tv_rate,
                "vs_ceiling_decode": rate / ceiling, "vs_ceiling_decode_crops": ceiling / rate,
                "stages_ms": {"read": 0.1, "decode": 1.0, "crops_resize_rest": 0.3, "colour": 0.2, "blur": 0.1, "mix": None}}
    return {
        "schema_version": 1, "created": "2026-11-23T00:00:00+00:00",
        "machine": {"cpu": cpu, "cores": 2, "gpu": None, "platform": "Linux"},
        "versions": {"python": "3.11", "torch": "2.14.1"},
        "config": {"git": {"commit": "abc", "dirty": False}, "dataset": "imagenet-like", "recipes": ["relicv2"],
                   "backends": ["ffcv", "torchvision"], "methods": ["rsa"], "repeats": 3, "warmup_batches": 3,
                   "warmup_steps": 2, "batch_size": 32, "batches": 16, "train_steps": 10, "cores": 2, "device": "cpu",
                   "quick": False, "sizes_px": [224, 96], "train_overrides": [], "train_config": {}},
        "loader": {"rows": [loader_row("ffcv", ffcv_rate), loader_row("torchvision", tv_rate)],
                   "ceilings": [{"recipe": None, "kind": "decode", "decoder": "pil", "img_per_s": s(ceiling)},
                                {"recipe": "relicv2", "kind": "decode+crops", "decoder": "pil", "img_per_s": s(ceiling)}]},
        "train": {"rows": [{"method": "rsa", "device": "cpu", "status": "ok", "batch_size": 64,
                            "steps_per_s": s(steps), "on_device_steps_per_s": s(5.2), "img_per_s": 64 * steps,
                            "data_stall_fraction": 1 - steps / 5.2, "peak_mem_mb": 900.0,
                            "split_ms": {"data_wait": 1.0, "forward": 50.0, "backward": 90.0, "optimizer": 10.0, "ema": 0.0}}]},
        "scaling": {"loader": [{"recipe": "relicv2", "backend": "ffcv", "workers": 1, "img_per_s": s(320.0)}],
                    "batch": [{"method": "rsa", "batch_size": 32, "img_per_s": s(300.0)}]},
    }


def test_compare_flags_a_planted_slowdown_and_nothing_else(tmp_path, capsys) -> None:
    a, b = _report(), _report(ffcv_rate=420.0)          # ffcv 30 % slower in B, all else equal
    for name, rep in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "profile.json").write_text(json.dumps(rep))
    lines, changed = profile_report.compare(a, b)
    flagged = [line for line in lines if line.endswith(("slower", "faster"))]
    assert changed == 3 and all(line.endswith("slower") for line in flagged)
    assert {line.split("  ")[0].strip() for line in flagged} == {
        "loader relicv2 ffcv img/s", "loader relicv2 ffcv × torchvision", "loader relicv2 ffcv ÷ decode+crops ceiling"}
    assert profile.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on-slowdown"]) == 1
    assert profile.main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--fail-on-slowdown"]) == 0
    assert "0 figure(s) changed" in capsys.readouterr().out


def test_compare_across_machines_refuses_absolute_figures() -> None:
    lines, changed = profile_report.compare(_report(cpu="EPYC"), _report(cpu="Xeon", tv_rate=50.0, ffcv_rate=300.0,
                                                                           ceiling=350.0))
    assert lines[0].startswith("different machines") and "absolute rates are not compared" in lines[0]
    assert not any("img/s" in line or "steps/s" in line for line in lines[1:-1] if not line.startswith("figure"))
    # Both machines keep ffcv at 6× torchvision and at 0.86 of the ceiling: no relative figure changed.
    assert changed == 0 and any(line.startswith("loader relicv2 ffcv × torchvision") for line in lines)


def test_a_report_off_the_schema_is_a_one_line_error(tmp_path, capsys) -> None:
    bad = _report()
    del bad["train"]["rows"][0]["split_ms"]
    with pytest.raises(profile_report.ReportError, match=r"at train/rows/0: 'split_ms' is a required property"):
        profile_report.validate(bad)
    future = copy.deepcopy(_report())
    future["schema_version"] = 2
    (tmp_path / "profile.json").write_text(json.dumps(future))
    assert profile.main(["compare", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: profile schema version 2") and "\n" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--recipes", "relicv2+cutmix"], "unknown mix 'cutmix'"),
    (["--recipes", "nosuch"], "unknown recipe nosuch"),
    (["--methods", "rsa,nosuch"], "unknown method nosuch"),
    (["--batch-size", "7"], "--batch-size 7 must be even"),
])
def test_bad_profile_arguments_are_one_line_errors(argv, needle, tmp_path, capsys) -> None:
    assert profile.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not any(tmp_path.glob("profile-*"))
