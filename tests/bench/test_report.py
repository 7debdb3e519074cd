"""The one report header (`bench.report`): what every bench writes first and prints above its tables."""

from __future__ import annotations

import re

from bench.report import commit_text, header, header_lines, versions_text


def test_the_header_names_the_machine_the_versions_and_the_commit() -> None:
    head = header()
    assert set(head) == {"machine", "versions", "git"}
    m, v, g = head["machine"], head["versions"], head["git"]
    assert m["cpu"] and m["cores"] >= 1 and m["platform"] and "gpu" in m
    assert v["python"] and v["torch"] and all(x is None or isinstance(x, str) for x in v.values())
    assert g["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", g["commit"])
    assert g["dirty"] in (True, False, None) and (g["commit"] is not None or g["dirty"] is None)
    lines = header_lines(head)
    assert [line.split(":")[0] for line in lines] == ["machine", "versions", "commit"]
    assert f"{m['cores']} cores" in lines[0] and f"torch {v['torch']}" in lines[1]


def test_absent_packages_and_a_missing_commit_read_plainly() -> None:
    assert versions_text({"python": "3.11.7", "ffcv": None, "torch": "2.14.1"}) == "python 3.11.7, torch 2.14.1"
    assert commit_text({"commit": None, "dirty": None}) == "unknown"
    assert commit_text({"commit": "0977dab" + "0" * 33, "dirty": True}) == "0977dab000 (uncommitted changes)"
    assert commit_text({"commit": "0977dab" + "0" * 33, "dirty": False}) == "0977dab000"
