"""The header every bench report starts with (STYLE §5): the machine, the versions of the packages
that decide the numbers, and the commit measured.

    head = header()                       # {"machine": {...}, "versions": {...}, "git": {...}}
    report = {**head, "settings": ..., "results": ...}
    print("\n".join(header_lines(head)))

Versions are read from package metadata, so a package that is not installed (FFCV or DALI on a
machine without them) is `None` and nothing is imported to find out.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from bench import peers
from train.checkpoint import git_commit as commit_sha, library_versions


def machine() -> dict:
    """CPU model, cores, GPU (None without CUDA) and platform of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "gpu": gpu, "platform": platform.platform()}


def versions() -> dict[str, str | None]:
    """Python, the packages of `train.checkpoint.LIBRARIES` (None where absent), and the CUDA and cuDNN
    torch uses: what a run folder's versions.json holds; then the peers' (`bench.peers.PEERS`)."""
    return {**library_versions(), **{p: peers.version(p) for p in peers.PEERS}}


def git_commit() -> dict:
    """The checkout's commit and whether it has uncommitted changes (both None outside git)."""
    sha = commit_sha()
    if sha == "unknown":
        return {"commit": None, "dirty": None}
    try:
        status = subprocess.run(["git", "status", "--porcelain"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": sha, "dirty": None}
    return {"commit": sha, "dirty": bool(status.strip())}


def header() -> dict:
    """`machine`, `versions` and `git` of this run: the first keys of every bench report."""
    return {"machine": machine(), "versions": versions(), "git": git_commit()}


def machine_text(m: dict) -> str:
    """"AMD EPYC 7B13, 2 cores, GPU none"."""
    return f"{m['cpu']}, {m['cores']} cores, GPU {m['gpu'] or 'none'}"


def versions_text(v: dict) -> str:
    """"python 3.11.7, torch 2.14.1, ..." without the packages that are absent."""
    return ", ".join(f"{k} {val}" for k, val in v.items() if val)


def commit_text(g: dict) -> str:
    """The commit's first 10 hex digits, "(uncommitted changes)" when dirty; "unknown" outside git."""
    return (g["commit"] or "unknown")[:10] + (" (uncommitted changes)" if g["dirty"] else "")


def header_lines(head: dict) -> list[str]:
    """The header as the three lines every bench prints above its tables."""
    return [f"machine: {machine_text(head['machine'])}", f"versions: {versions_text(head['versions'])}",
            f"commit: {commit_text(head['git'])}"]
