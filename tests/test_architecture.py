"""Import rules between packages (STYLE §1), checked by parsing every module's imports: the library
packages by their table, `bench` (measurement) on top: it imports anything, nothing imports it; and
`viewmill`, the command: it imports each package's entry module (`ENTRY_MODULES`) and nothing else of the
project, and nothing imports it. Inside `pipelines`, the backends take their contract from
`pipelines.spec` and only `pipelines.loader` imports a backend, so the dispatcher and its backends
form no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipelines", "models", "train", "preprocess", "bench", "viewmill")
# What the `viewmill` command dispatches to: the module behind each `python -m` entry point.
ENTRY_MODULES = ("preprocess.__main__", "train.__main__", "preprocess.saliency.__main__", "bench.profile")
ACCEL = ("ffcv", "nvidia.dali")
PREPROCESS_MAY_IMPORT = ("pipelines.schema", "pipelines.shards", "pipelines.processes", "pipelines.jit")
# The backends of `pipelines`, each a family of modules: `<name>_backend.py` plus its helpers
# `<prefix>*.py`, and the accelerator package only that family may import.
BACKEND_FAMILIES = {"torch": ("torch_backend", None), "torchvision": ("torchvision_backend", None),
                    "ffcv": ("ffcv_", "ffcv"), "dali": ("dali_", "nvidia.dali")}


def family_of(module: str) -> str | None:
    """The backend family of a `pipelines` module name (e.g. "pipelines.ffcv_ops" -> "ffcv"), or None."""
    if not module.startswith("pipelines."):
        return None
    leaf = module.split(".")[1]
    for name, (prefix, _) in BACKEND_FAMILIES.items():
        if leaf == prefix or (prefix.endswith("_") and leaf.startswith(prefix)):
            return name
    return None


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, top_level) of every import in `path`; relative imports resolved to the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    for node in tree.body:        # imports inside `if TYPE_CHECKING:` / try at module level count as top level
        if isinstance(node, (ast.If, ast.Try)):
            top_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:                  # relative: level 1 is this module's package, 2 its parent
                parts = list(path.relative_to(ROOT).parts[:-1])
                base = parts[:len(parts) - (node.level - 1)]
                name = ".".join(base + ([name] if name else []))
            if name in PACKAGES:            # `from pipelines import schema` imports pipelines.schema
                found += [(f"{name}.{a.name}", node.lineno, id(node) in top_level) for a in node.names]
            else:
                found += [(name, node.lineno, id(node) in top_level)]
    return found


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(path: Path) -> list[str]:
    """Forbidden edges of one module, as `file:line imports X (rule)`."""
    rel = path.relative_to(ROOT)
    package = rel.parts[0]
    out = []
    for name, line, top in imports_of(path):
        why = None
        if package == "viewmill":
            if under(name, PACKAGES[:-1]) and name not in ENTRY_MODULES:
                why = "viewmill only dispatches: it imports each package's entry module (" + ", ".join(ENTRY_MODULES) + ")"
        elif under(name, ("viewmill",)):
            why = "nothing imports viewmill (the command sits on top of every package)"
        elif under(name, ("bench",)) and package != "bench":
            why = "nothing imports bench (measurement sits on top of every package)"
        elif package == "bench":
            pass                            # measurement may import every package
        elif package == "pipelines":
            mine = family_of(".".join(rel.with_suffix("").parts))
            theirs = family_of(name)
            allowed = BACKEND_FAMILIES[mine][1] if mine else None
            if under(name, ("models", "train", "preprocess")):
                why = "pipelines must not import models/train/preprocess"
            elif under(name, ACCEL) and not (allowed and under(name, (allowed,))):
                why = "ffcv only in pipelines/ffcv_*.py, nvidia.dali only in pipelines/dali_*.py"
            elif theirs and mine and theirs != mine:
                why = "no backend imports another backend"
            elif theirs and not mine:
                why = "only pipelines/loader.py imports a backend, lazily by name (build_loader)"
            elif mine and name == "pipelines.loader":
                why = "a backend imports its contract from pipelines.spec, never pipelines.loader (which imports the backends)"
        elif package == "models" and under(name, ("pipelines", "train", "preprocess")):
            why = "models may import only torch and timm"
        elif package == "train" and under(name, ("preprocess",) + ACCEL):
            why = "train must not import preprocess, ffcv or nvidia.dali"
        elif package == "preprocess":
            if under(name, ("train",)):
                why = "preprocess must not import train"
            # pipelines.shards: the one reader of the shard format (no torch, no backend), for the
            # saliency stage, which reads a written dataset back to add its masks; pipelines.processes:
            # the rules of the processes every package starts (forked children leave what they inherit
            # alone and end with their parent); pipelines.jit: numba as FFCV's import uses it, for the FFCV writer.
            elif under(name, ("pipelines",)) and not under(name, PREPROCESS_MAY_IMPORT):
                why = "preprocess may import only " + ", ".join(PREPROCESS_MAY_IMPORT) + " from pipelines"
        if why:
            out.append(f"{rel}:{line} imports {name} ({why})")
    return out


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def test_no_forbidden_import_edges() -> None:
    # The scan runs in a fresh interpreter: CPython 3.11's ast.parse can fail with "AST constructor
    # recursion depth mismatch" while another thread of this process (an FFCV loader thread left by
    # an earlier test) builds an AST at the same time.
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, "forbidden imports:\n" + result.stdout + result.stderr


def main() -> int:
    found = [v for p in modules() for v in violations(p)]
    print("\n".join(found))
    return 1 if found else 0


@pytest.mark.parametrize("package, source, fragment", [
    ("pipelines", "import train.loop\n", "must not import models/train"),
    ("pipelines", "def f():\n    import ffcv\n", "ffcv only in pipelines/ffcv_*.py"),
    ("pipelines", "from pipelines import torch_backend\n", "only pipelines/loader.py imports a backend"),
    ("pipelines", "from pipelines.dali_graph import graph\n", "only pipelines/loader.py imports a backend"),
    ("models", "from pipelines.batch import Batch\n", "only torch and timm"),
    ("train", "from preprocess.prepare import prepare_dataset\n", "must not import preprocess"),
    ("train", "def f():\n    from nvidia.dali import fn\n", "nvidia.dali"),
    ("preprocess", "from pipelines.views import Recipe\n", "only pipelines.schema"),
    ("preprocess", "from ..train import loop\n", "must not import train"),
    ("preprocess", "from pipelines import views\n", "only pipelines.schema"),
    ("train", "from bench.evaluation import main\n", "nothing imports bench"),
    ("pipelines", "def f():\n    import bench\n", "nothing imports bench"),
    ("models", "import bench.report\n", "nothing imports bench"),
    ("preprocess", "from bench.datasets import write_images\n", "nothing imports bench"),
    ("viewmill", "def f():\n    from train.loop import train\n", "viewmill only dispatches"),
    ("viewmill", "from bench.report import header\n", "viewmill only dispatches"),
    ("train", "def f():\n    from viewmill.cli import main\n", "nothing imports viewmill"),
    ("bench", "import viewmill\n", "nothing imports viewmill"),
])

def test_each_rule_catches_its_edge(tmp_path, monkeypatch, package, source, fragment) -> None:
    fake_root = tmp_path
    path = fake_root / package / "probe.py"
    path.parent.mkdir()
    path.write_text(source)
    monkeypatch.setattr(__import__(__name__), "ROOT", fake_root)
    assert any(fragment in v for v in violations(path))


def test_viewmill_may_import_each_entry_module(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    path = tmp_path / "viewmill" / "cli.py"
    path.parent.mkdir()
    path.write_text("".join(f"def f{i}():\n    from {m} import main\n" for i, m in enumerate(ENTRY_MODULES))
                    + "import argparse\nfrom viewmill import cli\n")
    assert violations(path) == []


def test_backend_families_import_their_accelerator_and_not_each_other(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "pipelines").mkdir()

    def found(name: str, source: str) -> list[str]:
        path = tmp_path / "pipelines" / name
        path.write_text(source)
        return violations(path)

    assert found("dali_graph.py", "from nvidia.dali import fn\nfrom pipelines.dali_backend import x\n") == []
    assert found("ffcv_decode.py", "import ffcv\nfrom pipelines import ffcv_ops\n") == []
    assert any("ffcv only in" in v for v in found("dali_graph.py", "import ffcv\n"))
    assert any("no backend imports another" in v for v in found("ffcv_backend.py", "from pipelines import torch_backend\n"))
    assert any("no backend imports another" in v for v in found("torchvision_backend.py", "import pipelines.dali_graph\n"))
    assert found("torch_backend.py", "from pipelines.augment import render_views\nfrom pipelines.spec import EpochOrder\n") == []
    assert any("never pipelines.loader" in v for v in found("dali_graph.py", "from pipelines.loader import build_loader\n"))


if __name__ == "__main__":
    sys.exit(main())
