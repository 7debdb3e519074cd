"""viewmill installs as a package. The wheel: ranges that hold the lock's exact versions, FFCV and DALI
as extras, the `viewmill` console script, the presets as package data. Installed without dependencies
into a fresh environment that already has torch and the rest but neither FFCV nor DALI (their files
left out, as where they were never installed), `viewmill` preprocesses and trains with what is there,
and the ffcv and dali backends each say in one line how to install them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# Not part of a source distribution: the checkout's own outputs and environment.
OUTSIDE_SOURCE = {".git", ".venv", "build", "data", "runs", "reports", ".hypothesis", ".pytest_cache", "tests", "docs"}
# Left out of the fresh environment's view of this one: the accelerators and this project's own install.
ABSENT = ("ffcv", "nvidia_dali", "__editable__", "viewmill")


def lock() -> dict[str, str]:
    """{canonical name: exact version} of requirements.lock."""
    pins = (line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
            if line and not line.startswith("#"))
    return {canonicalize_name(name): version for name, version in pins}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the working tree (the build writes next to its source)."""
    src = tmp_path_factory.mktemp("source")

    def skip(folder: str, names: list[str]) -> list[str]:
        top = OUTSIDE_SOURCE if Path(folder) == ROOT else set()
        return [n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")]

    shutil.copytree(ROOT, src, ignore=skip, dirs_exist_ok=True)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("viewmill-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_declares_ranges_holding_the_lock_extras_and_the_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    requirements = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    pins = lock()
    for r in requirements:                  # requirements.lock is the exact set: every range holds its pin
        name = canonicalize_name(r.name)
        assert name in pins and r.specifier.contains(pins[name]), f"{r} does not hold the lock's {pins.get(name)}"
    core = {canonicalize_name(r.name) for r in requirements if r.marker is None}
    assert {"torch", "torchvision", "timm", "numpy", "opencv-python"} <= core
    assert not core & {"ffcv", "numba", "nvidia-dali-cuda130", "ray"}
    extras = {e: {canonicalize_name(r.name) for r in requirements if r.marker and r.marker.evaluate({"extra": e})}
              for e in meta.get_all("Provides-Extra")}
    assert extras["ffcv"] == {"ffcv", "numba"} and extras["dali"] == {"nvidia-dali-cuda130"}
    assert extras["ray"] == {"ray"} and extras["slurm"] == {"submitit"} and extras["wandb"] == {"wandb"}
    assert extras["peers"] == {"lightly", "spdl"}
    assert extras["docs"] == {"mkdocs", "mkdocs-material", "mkdocstrings"} and extras["crf"] == {"pydensecrf2"}
    assert {"test", "profile"} <= set(extras)
    assert "viewmill = viewmill.cli:main" in entry_points
    data = {p.relative_to(ROOT).as_posix() for pattern in ("train/configs/**/*.yaml", "pipelines/recipes/*.yaml")
            for p in ROOT.glob(pattern)} | {"bench/profile_schema.json"}
    assert data <= names and not any(n.startswith("tests/") for n in names)
    makefile = (ROOT / "Makefile").read_text()             # make install: both accelerators; make test: every extra
    assert ".[test,profile,ffcv,dali]" in makefile and ".[test,profile,ffcv,dali,ray,slurm,wandb,peers,docs,crf]" in makefile


def environment_with_torch(venv: Path) -> None:
    """A fresh environment at `venv` that already has this one's packages (torch, timm, ...) except those
    of `ABSENT`: a .pth file points at a folder of links to each of them."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    deps = venv.parent / "deps"
    deps.mkdir()
    for site in {Path(sysconfig.get_path("purelib")), Path(sysconfig.get_path("platlib"))}:
        for entry in site.iterdir():
            if entry.name.startswith(ABSENT) or entry.suffix == ".pth" or (deps / entry.name).exists():
                continue
            if entry.name == "nvidia":      # CUDA libraries torch loads stay; DALI goes
                (deps / "nvidia").mkdir()
                for child in entry.iterdir():
                    if child.name != "dali":
                        (deps / "nvidia" / child.name).symlink_to(child)
                continue
            (deps / entry.name).symlink_to(entry)
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    (site_packages / "deps.pth").write_text(f"{deps}\n")


@pytest.mark.slow
def test_viewmill_installed_without_ffcv_or_dali_preprocesses_and_trains(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "env"
    environment_with_torch(venv)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def viewmill(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "viewmill"), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u, train; "
                            "print(train.__file__, u.find_spec('ffcv'), u.find_spec('nvidia.dali'))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(venv)) and where[1:] == ["None", "None"]     # the wheel's code, no accelerator
    assert viewmill("--version").stdout.strip() == "viewmill 0.1.0"
    helped = viewmill("train", "--help")
    assert helped.returncode == 0 and "usage: viewmill train" in helped.stdout

    made = viewmill("preprocess", "--dataset", "synthetic", "--out", "data", "--train-size", "64", "--val-size", "32",
                    "--image-px", "32", "--workers", "1")
    assert made.returncode == 0, made.stderr
    assert "ffcv is not installed: writing the DALI shards only" in made.stderr and "viewmill[ffcv]" in made.stderr
    words = ["method=simclr", "data=synthetic", "data.batch_size=16", "data.num_workers=1", "views.global_px=32",
             "views.local_px=16", "model.backbone=test_resnet", "model.proj_hidden=32", "model.proj_out=16",
             "optim.steps=2", "optim.warmup_steps=1", "run.log_every=1", "run.max_eval_samples=16", "run.name=run"]
    trained = viewmill("train", *words)
    assert trained.returncode == 0, trained.stderr
    assert "(torch backend," in trained.stdout                             # what auto reads with, without ffcv
    versions = json.loads((tmp_path / "runs" / "run" / "versions.json").read_text())
    assert versions["viewmill"] == "0.1.0" and versions["ffcv"] is None and versions["dali"] is None
    for backend in ("ffcv", "dali"):
        refused = viewmill("train", *words, f"data.backend={backend}", "run.name=refused")
        err = refused.stderr.strip()
        assert refused.returncode == 2 and len(err.splitlines()) == 1, err
        assert f"pip install 'viewmill[{backend}]'" in err, err
    assert not (tmp_path / "runs" / "refused").exists()
