"""Import rules (STYLE §1), checked by parsing every module's imports. `TABLE` is STYLE's import table,
row for row: what each library package may import of the project and what it must not import, `bench`
(measurement) on top: it imports every package, nothing imports it. Beside the table, STYLE's bullets
that concern imports: pipelines never call `torch.distributed`; every backend yields the same `Batch`
and no backend imports another (inside `pipelines`, the backends take their contract from
`pipelines.spec` and only `pipelines.loader` builds a backend, by name, so the dispatcher and its
backends form no cycle). And across the whole project no module imports one that (through others)
imports it back: no import cycle, so every package stands on floors. `viewmill`, the command (no row in
STYLE's table), imports each package's entry module (`ENTRY_MODULES`) and `pipelines.errors` (the one way
every command reports bad input) and nothing else of the project,
and nothing imports it. `train.config`, the schema and the batch rule, imports nothing else of train
(`LOWEST_FLOOR`).

One cell of STYLE's table is narrower than the code: `preprocess` may import `pipelines.schema`, and
its writers and saliency stages also use `pipelines.shards`, `pipelines.processes` and `pipelines.jit`
(`PREPROCESS_BEYOND_STYLE`, each with its reason); until that cell names them, they are the one
difference, stated here rather than hidden in a rule."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipelines", "models", "train", "preprocess", "bench", "viewmill")
# What the `viewmill` command dispatches to: the module behind each `python -m` entry point.
ENTRY_MODULES = ("preprocess.__main__", "train.__main__", "preprocess.saliency.__main__", "bench.profile")
VIEWMILL_MAY = (*ENTRY_MODULES, "pipelines.errors")     # and the bad-input exit every command shares
ACCEL = ("ffcv", "nvidia.dali")


@dataclass(frozen=True)
class Row:
    """One row of STYLE's import table: the project modules a package may import (besides its own), and
    what it must not import (project packages and accelerator libraries)."""

    may: tuple[str, ...]
    must_not: tuple[str, ...]


TABLE = {
    "pipelines": Row(may=(), must_not=("models", "train", "preprocess")),      # torch, numpy; ffcv / nvidia.dali
    "models": Row(may=(), must_not=("pipelines", "train", "preprocess")),      # only in their own backend modules
    "train": Row(may=("pipelines", "models"), must_not=("preprocess", *ACCEL)),
    "preprocess": Row(may=("pipelines.schema", "models"), must_not=("train",)),
    "bench": Row(may=("pipelines", "models", "train", "preprocess"), must_not=()),
}
# pipelines.shards: the one reader of the shard format (no torch, no backend), for the stream writer and
# the saliency stage, which read a written dataset back; pipelines.processes: the rules of the processes
# every package starts (forked children leave what they inherit alone and end with their parent);
# pipelines.jit: numba as FFCV's import uses it, for the FFCV writer; pipelines.errors: the one bad-input exit
# of every command.
PREPROCESS_BEYOND_STYLE = ("pipelines.shards", "pipelines.processes", "pipelines.jit", "pipelines.errors")
# Modules on their package's lowest floor: they import nothing else of it (at the top or in a function).
# train.config: every module of train reads a Config, so the schema and the batch rule stand below all of
# them; resolving a config from its words (train.resolve, which needs the objectives) stands above.
LOWEST_FLOOR = {"train.config": "the config's schema and batch rule are train's lowest floor; resolution is "
                                "train.resolve's"}
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
    for name, line, _ in imports_of(path):
        why = None
        project = name.split(".")[0] in PACKAGES
        if package == "viewmill":
            if project and not under(name, ("viewmill",)) and name not in VIEWMILL_MAY:
                why = "viewmill only dispatches: it imports each package's entry module (" + ", ".join(ENTRY_MODULES) + ")"
        elif under(name, ("viewmill",)):
            why = "nothing imports viewmill (the command sits on top of every package)"
        elif under(name, ("bench",)) and package != "bench":
            why = "nothing imports bench (measurement sits on top of every package)"
        elif package in TABLE:
            row = TABLE[package]
            may = (package, *row.may, *(PREPROCESS_BEYOND_STYLE if package == "preprocess" else ()))
            me = ".".join(rel.with_suffix("").parts)
            if under(name, row.must_not):
                why = f"{package} must not import {', '.join(row.must_not)}"
            elif me in LOWEST_FLOOR and under(name, (package,)):
                why = LOWEST_FLOOR[me]
            elif project and not under(name, may):
                why = f"{package} may import only {', '.join(may[1:]) or 'nothing'} of the project"
            elif package == "pipelines":
                why = pipelines_rule(rel, name)
        if why:
            out.append(f"{rel}:{line} imports {name} ({why})")
    return out


def pipelines_rule(rel: Path, name: str) -> str | None:
    """The rule a `pipelines` module's import of `name` breaks beside the table, or None."""
    mine = family_of(".".join(rel.with_suffix("").parts))
    theirs = family_of(name)
    allowed = BACKEND_FAMILIES[mine][1] if mine else None
    if under(name, ("torch.distributed",)):
        return "pipelines never call torch.distributed: rank and world size are arguments"
    if under(name, ACCEL) and not (allowed and under(name, (allowed,))):
        return "ffcv only in pipelines/ffcv_*.py, nvidia.dali only in pipelines/dali_*.py"
    if theirs and mine and theirs != mine:
        return "no backend imports another backend"
    if theirs and not mine:
        return "only pipelines/loader.py imports a backend, lazily by name (build_loader)"
    if mine and name == "pipelines.loader":
        return "a backend imports its contract from pipelines.spec, never pipelines.loader (which imports the backends)"
    return None


def module_name(path: Path, root: Path) -> str:
    """`train/launch.py` -> "train.launch"; a package's `__init__.py` -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cycles(paths: list[Path], root: Path) -> list[list[str]]:
    """The import cycles among the modules `paths` (every import, at the top or in a function): each as
    the modules of one strongly connected set of two or more, or of one that imports itself."""
    names = {module_name(p, root): p for p in paths}

    def target(name: str) -> str | None:        # the module of `names` an import refers to
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: {t for n, _, _ in imports_of(p) if (t := target(n)) and (t != m or n == m)} for m, p in names.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:                  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in sorted(edges[m]):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            part = []
            while (t := stack.pop()) != m:
                part.append(t)
            part.append(m)
            if len(part) > 1 or m in edges[m]:
                found.append(sorted(part))

    for m in sorted(names):
        if m not in index:
            visit(m)
    return found


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
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(modules(), ROOT)]
    print("\n".join(found))
    return 1 if found else 0


@pytest.mark.parametrize("package, source, fragment", [
    ("pipelines", "import train.loop\n", "pipelines must not import models, train, preprocess"),
    ("pipelines", "import torch.distributed as dist\n", "pipelines never call torch.distributed"),
    ("pipelines", "def f():\n    import ffcv\n", "ffcv only in pipelines/ffcv_*.py"),
    ("pipelines", "from pipelines import torch_backend\n", "only pipelines/loader.py imports a backend"),
    ("pipelines", "from pipelines.dali_graph import graph\n", "only pipelines/loader.py imports a backend"),
    ("models", "from pipelines.batch import Batch\n", "models must not import pipelines"),
    ("train", "from preprocess.prepare import prepare_dataset\n", "must not import preprocess"),
    ("train", "def f():\n    from nvidia.dali import fn\n", "nvidia.dali"),
    ("preprocess", "from pipelines.views import Recipe\n", "preprocess may import only pipelines.schema, models"),
    ("preprocess", "from ..train import loop\n", "must not import train"),
    ("preprocess", "from pipelines import views\n", "preprocess may import only pipelines.schema"),
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


def test_the_config_schema_imports_nothing_else_of_train(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    path = tmp_path / "train" / "config.py"
    path.parent.mkdir()
    path.write_text("from pipelines.mixing import MixSpec\nimport yaml\n")
    assert violations(path) == []
    path.write_text("def f():\n    from train.objectives import OBJECTIVES\n")
    assert any("train's lowest floor" in v for v in violations(path))


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


def test_an_import_cycle_is_found_through_lazy_imports_too(tmp_path) -> None:
    """slurm -> launch at the top and launch -> slurm inside a function (the shape of the cycle that
    train/__main__.py and train/slurm.py once made) is a cycle; a chain that goes one way is none."""
    (tmp_path / "train").mkdir()
    for name, source in (("slurm", "from train.launch import start\n"),
                         ("launch", "def f():\n    from train import slurm\n"),
                         ("loop", "from train.run import Run\n"), ("run", "import torch\n")):
        (tmp_path / "train" / f"{name}.py").write_text(source)
    assert cycles(sorted((tmp_path / "train").glob("*.py")), tmp_path) == [["train.launch", "train.slurm"]]
    (tmp_path / "train" / "launch.py").write_text("from train import loop\n")
    assert cycles(sorted((tmp_path / "train").glob("*.py")), tmp_path) == []


if __name__ == "__main__":
    sys.exit(main())
