"""`python -m preprocess`: one-line errors with exit code 2, and a summary on success."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.schema import read_manifest
from preprocess.__main__ import main, parse_args
from preprocess.sources import SOURCES, PreprocessError


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preprocess", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,expect", [
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'; choose one of synthetic, cifar10, cifar100, imagefolder"),
    (["--dataset", "cifar10", "--src", "no/such/folder"], "source path no/such/folder does not exist"),
    (["--dataset", "imagefolder"], "--src is required for imagefolder"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--side", "diagonal"], "invalid choice"),
])
def test_errors_are_one_line_exit_2_no_traceback(tmp_path: Path, args: list[str], expect: str) -> None:
    r = _run(*args, "--out", str(tmp_path / "out"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_cifar_with_missing_batch_exits_2(tmp_path: Path) -> None:
    (tmp_path / "cifar").mkdir()
    r = _run("--dataset", "cifar10", "--src", str(tmp_path / "cifar"), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "batches.meta is missing" in r.stderr and "Traceback" not in r.stderr


def test_synthetic_run_prints_summary_then_rerun_does_nothing(tmp_path: Path, capsys) -> None:
    args = ["--dataset", "synthetic", "--out", str(tmp_path), "--train-size", "20", "--val-size", "10",
            "--image-px", "24", "--seed", "3", "--workers", "1", "--shard-size", "8", "--gt-masks-as-mask"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train 20, val 10 images" in out and "images/s" in out and "MiB" in out
    m = read_manifest(tmp_path / "synthetic")
    assert m.params["seed"] == 3 and m.has_masks and m.image_px == 24
    assert len([f for f in m.files if f.startswith("train/") and f.endswith(".tar")]) == 3
    assert main(args) == 0
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.slow
def test_every_second_of_an_image_folder_run_is_named(tmp_path: Path) -> None:
    """The summary's stages add up to its total (what no stage timed is `other`); the FFCV import and
    copy that run beside them in their own process are listed apart; the command's own line adds
    start-up and imports, and the manifest, swap and lock after the stages, up to its wall time."""
    from bench.datasets import write_images

    src = write_images(tmp_path / "src", train=24, val=12, size_px=(64, 48))
    args = ["--dataset", "imagefolder", "--src", str(src), "--out", str(tmp_path / "out"), "--workers", "2"]
    r = _run(*args)
    assert r.returncode == 0, r.stderr
    secs = read_manifest(tmp_path / "out" / "imagefolder").build["seconds"]
    stages = {k: v for k, v in secs.items() if k != "total" and not k.endswith("_background")}
    assert {"list", "units", "checksum", "other"} <= set(stages)
    assert sum(stages.values()) == pytest.approx(secs["total"], abs=0.002 * len(stages))
    assert secs["ffcv_import_background"] > 0 and secs["ffcv_write_background"] > 0
    assert "; beside them ffcv_import" in r.stdout
    line = re.search(r"([\d.]+)s in this command: start-up and imports ([\d.]+)s, the stages above ([\d.]+)s, "
                     r"manifest, swap and lock ([\d.]+)s", r.stdout)
    assert line, r.stdout
    whole, *parts = map(float, line.groups())
    # the line rounds to 0.1 s and the manifest to 0.001 s: up to 0.0505 apart (1.9 against 1.95 failed 0.05)
    assert parts[0] > 0 and parts[1] == pytest.approx(secs["total"], abs=0.051)
    assert sum(parts) == pytest.approx(whole, abs=0.15)             # three numbers rounded to 0.1 s
    again = _run(*args)
    assert "nothing to do" in again.stdout and "in this command" not in again.stdout


def test_source_options_come_from_the_registry() -> None:
    a = parse_args([])
    for source in SOURCES.values():
        for param in source.params:
            assert getattr(a, param.name) == param.default, param.flag
    assert parse_args(["--max-side", "64", "--gt-masks-as-mask"]).max_side == 64
    with pytest.raises(PreprocessError, match="unknown option[(]s[)] seed for cifar10; valid: none"):
        SOURCES["cifar10"].resolve({"seed": 1})
    with pytest.raises(PreprocessError, match="unknown option[(]s[)] size for synthetic; valid: gt_masks_as_mask,"):
        SOURCES["synthetic"].resolve({"size": 1})
