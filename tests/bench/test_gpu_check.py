"""The GPU report: each target of the GPU issue is marked met or missed from the numbers, and a hung
section is stopped at its limit."""

from __future__ import annotations

import pytest

from bench.gpu_check import targets


def _report(img_s: float, base_s: float, thread_ms: float, cost: float, stall: float, failed: int) -> dict:
    rows = [{"backend": "dali", "recipe": "relicv2", "status": "ok", "img_per_s": img_s, "thread_cpu_ms": thread_ms,
             "batch_size": 256},
            {"backend": "torchvision", "recipe": "relicv2", "status": "ok", "img_per_s": base_s, "workers": 16,
             "batch_size": 32}]
    count = {"passed": 42 - failed, "failure": failed, "error": 0, "skipped": 0}
    return {"loader": {"results": rows}, "views": {"cost_6_vs_1": cost}, "train": {"data_stall_fraction": stall},
            "tests": {"count": count}}


def verdicts(report: dict) -> list[str]:
    return [t.rsplit(": ", 1)[1] for t in targets(report)]


def test_targets_met_moonshot_and_missed() -> None:
    assert verdicts(_report(14_500, 4_000, 1.2, 1.3, 0.005, 0)) == ["moonshot met", "moonshot met", "met", "met",
                                                                    "met", "met"]
    assert verdicts(_report(12_500, 5_000, 2.9, 1.4, 0.01, 0)) == ["met", "met", "met", "met", "met", "met"]
    assert verdicts(_report(6_094, 4_196, 23.5, 2.01, 0.135, 7)) == ["missed"] * 6      # the first GPU runs
    assert verdicts(_report(9_700, 3_500, 1.0, 1.3, 0.02, 0)) == ["missed", "met", "met", "met", "missed", "met"]
    assert targets({}) == ["nothing measured"]


def test_plain_dali_and_pinned_core_targets() -> None:
    """The graph against a plain DALI pipeline of the same views (3x) and at 4 and 2 cores (12k, 9k)."""
    report = _report(12_000, 4_000, 1.0, 1.3, 0.0, 0)
    report["loader"]["results"].append({"backend": "dali-plain", "recipe": "relicv2", "status": "ok",
                                        "img_per_s": 4_100})
    report["cores"] = {"rows": [{"cores": 2, "img_per_s": 8_900}, {"cores": 4, "img_per_s": 12_100},
                                {"cores": 8, "img_per_s": None}]}
    lines = targets(report)
    plain = next(t for t in lines if "plain DALI" in t)
    assert plain.startswith("2.93× ") and plain.endswith(": missed")
    assert next(t for t in lines if "at 4 cores" in t).endswith(": met")
    assert next(t for t in lines if "at 2 cores" in t).endswith(": missed")
    assert not any("at 8 cores" in t for t in lines)
    assert "2.50× torchvision with 16 workers, batch 32 (target 2×" in targets(_report(10_000, 4_000, 1, 1, 0, 0))[1]


def test_a_hung_section_is_stopped_at_its_limit_with_the_stacks_of_where_it_hung(tmp_path) -> None:
    """A hang (a loader waiting for a batch that never comes) must not eat the GPU machine's slot: the
    section is stopped and the report says where it hung."""
    import threading

    from bench.gpu_check import SectionTimeout, time_limit

    def waits_for_a_batch_that_never_comes() -> None:
        threading.Event().wait(120)          # not stopped: returns after 120 s, and pytest.raises fails

    with pytest.raises(SectionTimeout, match="stopped after 1 s"):
        with time_limit(1, tmp_path / "loader-stacks.txt"):
            waits_for_a_batch_that_never_comes()
    assert "waits_for_a_batch_that_never_comes" in (tmp_path / "loader-stacks.txt").read_text()
    with time_limit(5, tmp_path / "views-stacks.txt"):           # a section within its limit: no file left
        pass
    assert not (tmp_path / "views-stacks.txt").exists()


def test_a_section_s_time_limit_is_not_taken_for_a_failed_cell(tmp_path) -> None:
    """The rounds of a bench report a cell that raises and go on with the others; a section's time limit
    must stop the whole section instead (on a GPU machine a hung cell would otherwise eat the slot)."""
    import threading

    from bench.gpu_check import SectionTimeout, time_limit
    from bench.timing import in_rounds

    ran = []

    def hangs(rnd: int) -> dict:
        threading.Event().wait(120)
        return {}

    with pytest.raises(SectionTimeout):
        with time_limit(1, tmp_path / "loader-stacks.txt"):
            in_rounds(2, {"torchvision": hangs, "dali": lambda rnd: ran.append(rnd) or {}})
    assert ran == []                       # stopped in the first cell of the first round


@pytest.mark.slow
def test_a_test_run_stopped_at_its_limit_still_reports_the_tests_that_finished(tmp_path, monkeypatch) -> None:
    """On the GPU machine the `gpu` tests ran past the slot's limit and were killed: the report said
    nothing of the 40 that had passed. Stopped as Ctrl-C stops it, pytest writes what finished, also
    when the check itself runs in the background (a CI job, `cmd &`), where SIGINT comes ignored and a
    child that kept it so could not be stopped (the first version of this test failed so in CI)."""
    import signal

    from bench.gpu_check import run_pytest

    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")      # a child that starts in 0.3 s
    (tmp_path / "test_slot.py").write_text(
        "import time\n\n"
        "def test_passes_one():\n    pass\n\n"
        "def test_passes_two():\n    pass\n\n"
        "def test_fails():\n    assert False, 'wrong pixels'\n\n"
        "def test_outlives_the_slot():\n    time.sleep(120)\n")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)       # as a background job inherits it
    try:
        ran = run_pytest([str(tmp_path / "test_slot.py")], tmp_path / "slot.xml", timeout_s=8)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ran["stopped_after_s"] == 8 and ran["seconds"] < 20
    assert ran["count"] == {"passed": 2, "failure": 1, "error": 0, "skipped": 0}
    assert [c["test"].rsplit("::", 1)[1] for c in ran["cases"] if c["outcome"] == "failure"] == ["test_fails"]
    report = {"tests": {"which": "gpu", **ran}}
    assert targets(report) == ["gpu tests 2 passed, 1 failed before the run was stopped: missed"]


@pytest.mark.slow
def test_the_training_section_times_the_high_priority_stream_beside_the_default_one(tmp_path, capsys) -> None:
    """`--sections train --train-stream both` (what the next GPU run asks for), tried on the CPU with
    tiny sizes: each round times the loader, the batch on the device and the loader with training on
    the high-priority stream (on a CPU, the same stream), and the report and the targets give both
    stalls."""
    import json

    from bench.gpu_check import main

    assert main(["--device", "cpu", "--quick", "--sections", "train", "--train-stream", "both", "--repeats", "2",
                 "--out", str(tmp_path / "report"), "--work", str(tmp_path / "work")]) == 0
    t = json.loads((tmp_path / "report" / "gpu_check.json").read_text())["train"]
    assert "error" not in t, t.get("traceback")
    assert [len(t[k]) for k in ("steps_per_s_runs", "cached_steps_per_s_runs", "high_stream_steps_per_s_runs")] == [2] * 3
    assert 0 <= t["high_stream_stall_fraction"] < 1 and t["config"]["run"]["train_stream"] == "default"
    printed = capsys.readouterr().out
    assert "training on a stream of the highest priority:" in printed and "training on a high-priority stream" in printed


@pytest.mark.slow
def test_the_later_sections_run_the_graph_options_the_views_section_found_faster(tmp_path) -> None:
    """`--gpu-contrast`, `--gpu-blur`, `--graph-batches` and `--gpu-tail` at "faster" (the defaults): the
    views section times the contrast offset made on the host, the blur in a conditional, 2 training
    batches a run of the graph and the torch tail beside the default graph, and the cores, training and
    loader sections then run, for each, the faster; a named one is taken as it is. Tried on the CPU with
    tiny sizes."""
    import json

    from bench.gpu_check import main

    def report(*extra: str) -> dict:
        out = tmp_path / f"report{len(extra)}"
        assert main(["--device", "cpu", "--quick", "--out", str(out), "--work", str(tmp_path / "work"), *extra]) == 0
        return json.loads((out / "gpu_check.json").read_text())

    r = report("--sections", "views,cores,train,loader")
    v = r["views"]
    assert "error" not in v, v.get("traceback")
    assert v["hostcontrast_vs_device"] == v["relicv2-hostcontrast"]["img_per_s"] / v["relicv2"]["img_per_s"]
    assert v["condblur_vs_every_sample"] == v["relicv2-condblur"]["img_per_s"] / v["relicv2"]["img_per_s"]
    assert v["graph2_vs_graph1"] == v["relicv2-graph2"]["img_per_s"] / v["relicv2"]["img_per_s"]
    assert v["torchtail_vs_graph"] == v["relicv2-torchtail"]["img_per_s"] / v["relicv2"]["img_per_s"]
    faster = {"gpu_contrast": "host" if v["hostcontrast_vs_device"] > 1 else "device",
              "gpu_blur": "conditional" if v["condblur_vs_every_sample"] > 1 else "gaussian",
              "graph_batches": 2 if v["graph2_vs_graph1"] > 1 else 1,
              "gpu_tail": "torch" if v["torchtail_vs_graph"] > 1 else "graph"}
    assert r["cores"]["graph"] == r["loader"]["graph"] == faster
    assert {k: r["train"]["config"]["data"][k] for k in faster} == faster
    assert r["loader"]["settings"]["graph"] == faster
    named = report("--sections", "cores", "--gpu-contrast", "host", "--gpu-blur", "filter", "--graph-batches", "3",
                   "--gpu-tail", "torch")
    assert named["cores"]["graph"] == {"gpu_contrast": "host", "gpu_blur": "filter", "graph_batches": 3,
                                       "gpu_tail": "torch"}
    assert named["cores"]["rows"][0]["img_per_s"] > 0


def test_an_alternative_that_fails_is_reported_and_never_taken(monkeypatch) -> None:
    """A graph option's alternative that fails on the GPU (its cell raises) costs the views section only
    that cell: the others are timed and reported, the failure is named in the report, and the later
    sections keep the option's default."""
    from types import SimpleNamespace

    from bench import gpu_check
    from bench.timing import Cell

    def rounds(repeats, cells):
        rate = {"relicv2": 1000.0, "relicv2-1view": 2000.0, "relicv2-crops": 1900.0, "relicv2-graph2": 1100.0}
        return {k: Cell(error="RuntimeError: no kernel image") if k == "relicv2-torchtail" else
                Cell(runs={"img_per_s": [rate.get(k, 900.0)] * repeats}) for k in cells}

    monkeypatch.setattr(gpu_check, "in_rounds", rounds)
    monkeypatch.setattr(gpu_check, "_gpu_cell", lambda *a, **k: None)
    monkeypatch.setattr(gpu_check, "_view_recipes", lambda a: _recipes())
    a = SimpleNamespace(repeats=2, batch_size=8, quick=True, gpu_contrast="faster", gpu_blur="faster",
                        graph_batches="faster", gpu_tail="faster")
    v = gpu_check.run_views(a)
    assert v["relicv2-torchtail"] == {"error": "RuntimeError: no kernel image"} and v["torchtail_vs_graph"] == 0.0
    assert v["graph2_vs_graph1"] == pytest.approx(1.1) and v["cost_6_vs_1"] == pytest.approx(2.0)
    assert gpu_check.faster_graph(a, {"views": v}) == {"gpu_contrast": "device", "gpu_blur": "gaussian",
                                                       "graph_batches": 2, "gpu_tail": "graph"}
    line = next(ln for ln in gpu_check.table({"views": v}).splitlines() if ln.startswith("GPU graph"))
    assert "the crops finished by batched torch ops failed (RuntimeError: no kernel image)" in line
    assert "2 training batches a run of the graph 1,100 img/s (1.10×)" in line


def _recipes():
    from pipelines.views import Recipe, load_recipe

    six = load_recipe("relicv2", 32, 16)
    return six, Recipe("relicv2-1view", (six.groups[0],))
