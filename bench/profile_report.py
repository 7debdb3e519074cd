"""The `make profile` report on disk: its schema check, Markdown, charts, and the comparison of two
reports (`python -m bench.profile compare A B`, `make profile-compare A=... B=...`).

A figure in a report is a Stat (`median`, `min`, `max`, `runs`). Two reports are compared figure by
figure: the ratio B / A of the medians, flagged as a change when the two min–max spreads do not
overlap (a single run has no spread, so every difference of single runs is flagged: use repeats).
Absolute figures (images/s, steps/s) are compared only between reports from the same machine (CPU
model, cores, GPU); otherwise only the figures measured as ratios inside each report are compared
(a backend against the torchvision baseline and the decode + crops ceiling, the data-stall fraction).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.data import operator_lines
from bench.report import commit_text, machine_text, versions_text

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("profile_schema.json")
STAGES = ("read", "decode", "crops_resize_rest", "colour", "blur", "mix")


class ReportError(ValueError):
    """A report that cannot be read or does not follow the schema, with the fix."""


def validate(report: dict) -> None:
    """Check `report` against `profile_schema.json`.

    Raises:
        ReportError: naming the first violation and where it is.
    """
    import jsonschema

    version = report.get("schema_version") if isinstance(report, dict) else None
    if version != SCHEMA_VERSION:
        raise ReportError(f"profile schema version {version!r}, this checkout reads {SCHEMA_VERSION}; "
                          "re-run make profile with this checkout")
    try:
        jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise ReportError(f"profile report does not follow the schema at {where}: {exc.message}") from None


def load(path: str | Path) -> dict:
    """Read and validate a report: its folder or its `profile.json`."""
    p = Path(path)
    p = p / "profile.json" if p.is_dir() else p
    if not p.is_file():
        raise ReportError(f"no profile report at {path}; give a reports/profile-<time> folder or its profile.json")
    try:
        report = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{p} is not JSON ({exc.msg} at line {exc.lineno}); re-run make profile") from None
    validate(report)
    return report


def write(report: dict, out: Path) -> None:
    """Validate, draw the charts, then write `profile.md` and (atomically, last) `profile.json`."""
    report["charts"] = charts(report, out)
    validate(report)
    (out / "profile.md").write_text(markdown(report))
    tmp = out / ".profile.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / "profile.json")


# ----------------------------------------------------------------------------- Markdown


def _spread(s: dict, fmt: str = ".0f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def header(report: dict) -> list[str]:
    c = report["config"]
    return [f"Machine: {machine_text(report['machine'])}; device {c['device']}, "
            f"{c['cores']} loader workers. Commit {commit_text(c['git'])}, {report['created']}.",
            f"Versions: {versions_text(report['versions'])}.",
            f"Loader: `{c['dataset']}` at {c['sizes_px'][0]}/{c['sizes_px'][1]} px, batch {c['batch_size']}, "
            f"{c['batches']} timed batches after {c['warmup_batches']}; trainer: {c['train_steps']} timed steps "
            f"after {c['warmup_steps']}. Every figure: median (min–max) of {c['repeats']} runs, timed in rounds."
            + (" QUICK run: tiny data, not a measurement." if c["quick"] else "")]


def markdown(report: dict, charts: bool = True) -> str:
    """The report as Markdown (also printed, without the chart links)."""
    lines = ["# viewmill throughput profile", "", *header(report), "", "## Loader alone", "",
             "| recipe | backend | device | img/s | views/s | CPU busy | × torchvision | × decode ceiling "
             "| crops ceiling ÷ this | " + " | ".join(f"{s} ms" for s in STAGES) + " |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in STAGES) + " |"]
    for r in report["loader"]["rows"]:
        if r["status"] != "ok":
            why = f"failed: {r['error'][:100]}" if r["status"] == "failed" else f"skipped: {r['note']}"
            lines.append(f"| {r['recipe']} | {r['backend']} | {r['device']} | {why} |")
            continue
        util = "–" if r["cpu_utilisation"] is None else f"{100 * r['cpu_utilisation']:.0f} %"
        st = " | ".join("–" if r["stages_ms"][s] is None else f"{r['stages_ms'][s]:.2f}" for s in STAGES)
        lines.append(f"| {r['recipe']} | {r['backend']} | {r['device']} | {_spread(r['img_per_s'])} | "
                     f"{r['views_per_s']:.0f} | {util} | {_x(r.get('vs_torchvision'))} | {_x(r['vs_ceiling_decode'])} | "
                     f"{_x(r['vs_ceiling_decode_crops'])} | {st} |")
    lines += ["", "| ceiling | recipe | decoder | img/s |", "| --- | --- | --- | ---: |"]
    lines += [f"| {c['kind']} | {c['recipe'] or 'any'} | {c['decoder']} | {_spread(c['img_per_s'])} |"
              for c in report["loader"]["ceilings"]]
    lines += operator_lines(report["loader"]["rows"])
    lines += peer_lines(report)
    lines += epoch_lines(report)
    lines += ["", "## Training steps", "",
              "| method | device | batch | steps/s (real loader) | steps/s (batch on device) | img/s | data stall "
              "| data wait ms | forward ms | backward ms | optimiser ms | EMA ms | peak MiB |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["train"]["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['device']} | failed: {r['error'][:100]} |")
            continue
        sp = r["split_ms"]
        lines.append(f"| {r['method']} | {r['device']} | {r['batch_size']} | {_spread(r['steps_per_s'], '.2f')} | "
                     f"{_spread(r['on_device_steps_per_s'], '.2f')} | {r['img_per_s']:.0f} | "
                     f"{100 * r['data_stall_fraction']:.1f} % | {sp['data_wait']:.1f} | {sp['forward']:.1f} | "
                     f"{sp['backward']:.1f} | {sp['optimizer']:.1f} | {sp['ema']:.1f} | {r['peak_mem_mb']:.0f} |")
    sc = report["scaling"]
    if sc["loader"] or sc["batch"]:
        lines += ["", "## Scaling", ""]
        lines += [f"- loader `{s['backend']}` ({s['recipe']}), {s['workers']} workers: {_spread(s['img_per_s'])} img/s"
                  for s in sc["loader"]]
        lines += [f"- trainer `{s['method']}` (batch on device), batch {s['batch_size']}: "
                  f"{_spread(s['img_per_s'])} img/s" for s in sc["batch"]]
    if charts and report.get("charts"):
        lines += ["", "## Charts", ""] + [f"![{Path(c).stem}]({c})" for c in report["charts"]]
    return "\n".join(lines) + "\n"


def peer_lines(report: dict) -> list[str]:
    """Every row's ratio to each peer on the same recipe, and the peers' versions and settings."""
    rows = [r for r in report["loader"]["rows"] if r["status"] == "ok" and r.get("vs_peers")]
    names = sorted({p for r in rows for p in r["vs_peers"]})
    if not names:
        return []
    lines = ["", "### Against the peers (the same files, the same rounds)", "",
             "| recipe | backend | img/s | " + " | ".join(f"× {p}" for p in names) + " |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
    lines += [f"| {r['recipe']} | {r['backend']} | {r['img_per_s']['median']:.0f} | "
              + " | ".join(_x(r["vs_peers"].get(p)) for p in names) + " |" for r in rows]
    lines += [""] + [f"- {r['backend']} on {r['recipe']}: {r['settings']}" for r in report["loader"]["rows"]
                     if r.get("settings")]
    return lines


def epoch_lines(report: dict) -> list[str]:
    """First batch and epoch-boundary stall of every backend and peer (the first recipe)."""
    rows = [r for r in report["loader"]["rows"] if r.get("epoch_boundary")]
    if not rows:
        return []
    c = report["config"]
    return ["", f"### First batch and epoch boundaries ({rows[0]['recipe']}, {c['epochs']} epochs of "
            f"{c['epoch_batches']} batches from one loader)", "",
            "| backend | first batch s | median gap ms | mean gap ms | longest epoch-boundary gap ms | ÷ mean gap |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"] + [
        f"| {r['backend']} | {_spread(r['first_batch_s'], '.2f')} | {_spread(r['epoch_boundary']['median_gap_ms'])} | "
        f"{_spread(r['epoch_boundary']['mean_gap_ms'])} | {_spread(r['epoch_boundary']['longest_boundary_gap_ms'])} | "
        f"{_spread(r['epoch_boundary']['stall'], '.1f')} |" for r in rows]


# ----------------------------------------------------------------------------- charts


def charts(report: dict, out: Path) -> list[str]:
    """Draw the PNG charts into `out`; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    rows = [r for r in report["loader"]["rows"] if r["status"] == "ok"]
    if rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 2.5))
        labels = [f"{r['recipe']} · {r['backend']}" for r in rows]
        med = [r["img_per_s"]["median"] for r in rows]
        err = [[m - r["img_per_s"]["min"] for m, r in zip(med, rows)], [r["img_per_s"]["max"] - m for m, r in zip(med, rows)]]
        ax1.barh(labels, med, xerr=err, color="tab:blue")
        for c in report["loader"]["ceilings"]:
            if c["kind"] == "decode":
                ax1.axvline(c["img_per_s"]["median"], ls="--", color="k", label=f"decode ceiling ({c['decoder']})")
        ax1.set_xlabel("source images/s (median, min–max)")
        ax1.legend(loc="lower right", fontsize=8)
        ax1.invert_yaxis()
        left = [0.0] * len(rows)
        for stage in STAGES:
            vals = [r["stages_ms"][stage] or 0.0 for r in rows]
            ax2.barh(labels, vals, left=left, label=stage)
            left = [a + b for a, b in zip(left, vals)]
        ax2.set_xlabel("ms per source image, by stage")
        ax2.legend(fontsize=8)
        ax2.invert_yaxis()
        ax2.set_yticklabels([])
        fig.suptitle(f"loader on {report['config']['dataset']} ({report['machine']['cpu']}, {report['config']['device']})")
        fig.tight_layout()
        fig.savefig(out / "loader.png", dpi=90)
        plt.close(fig)
        made.append("loader.png")
    trows = [r for r in report["train"]["rows"] if r["status"] == "ok"]
    if trows:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(trows) + 2))
        left = [0.0] * len(trows)
        for name in ("data_wait", "forward", "backward", "optimizer", "ema"):
            vals = [r["split_ms"][name] for r in trows]
            ax.barh([r["method"] for r in trows], vals, left=left, label=name)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("ms per training step (torch.profiler round)")
        ax.legend(fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"training step split ({trows[0]['device']})")
        fig.tight_layout()
        fig.savefig(out / "train.png", dpi=90)
        plt.close(fig)
        made.append("train.png")
    sc = report["scaling"]
    if sc["loader"] or sc["batch"]:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for be in sorted({s["backend"] for s in sc["loader"]}):
            pts = [s for s in sc["loader"] if s["backend"] == be]
            ax1.errorbar([s["workers"] for s in pts], [s["img_per_s"]["median"] for s in pts],
                         yerr=[[s["img_per_s"]["median"] - s["img_per_s"]["min"] for s in pts],
                               [s["img_per_s"]["max"] - s["img_per_s"]["median"] for s in pts]], marker="o", label=be)
        ax1.set_xticks(sorted({s["workers"] for s in sc["loader"]}) or [1])
        ax1.set_xlabel("loader workers")
        ax1.set_ylabel("source images/s")
        if sc["loader"]:
            ax1.legend(fontsize=8)
            ax1.set_title(f"loader scaling ({sc['loader'][0]['recipe']})")
        pts = sc["batch"]
        ax2.errorbar([s["batch_size"] for s in pts], [s["img_per_s"]["median"] for s in pts], marker="o")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("batch size")
        ax2.set_ylabel("images/s, batch on the device")
        if pts:
            ax2.set_title(f"trainer scaling ({pts[0]['method']})")
        fig.tight_layout()
        fig.savefig(out / "scaling.png", dpi=90)
        plt.close(fig)
        made.append("scaling.png")
    return made


# ----------------------------------------------------------------------------- compare


def same_machine(a: dict, b: dict) -> bool:
    keys = ("cpu", "cores", "gpu")
    return all(a["machine"][k] == b["machine"][k] for k in keys) and a["config"]["device"] == b["config"]["device"]


def _interval(s: dict) -> tuple[float, float, float]:
    return s["median"], s["min"], s["max"]


def _quotient(n: dict, d: dict) -> tuple[float, float, float]:
    """n / d as (median, lowest, highest) from the two spreads."""
    return n["median"] / d["median"], n["min"] / d["max"], n["max"] / d["min"]


def figures(report: dict, absolute: bool) -> dict[str, tuple[float, float, float]]:
    """Every comparable figure of a report as name → (median, min, max). Higher is better for all."""
    out: dict[str, tuple[float, float, float]] = {}
    rows = {(r["recipe"], r["backend"]): r for r in report["loader"]["rows"] if r["status"] == "ok"}
    crops = {c["recipe"]: c for c in report["loader"]["ceilings"] if c["kind"] == "decode+crops"}
    for (rc, be), r in rows.items():
        if absolute:
            out[f"loader {rc} {be} img/s"] = _interval(r["img_per_s"])
        tv = rows.get((rc, "torchvision"))
        if tv and be != "torchvision":
            out[f"loader {rc} {be} × torchvision"] = _quotient(r["img_per_s"], tv["img_per_s"])
        for peer in r.get("vs_peers") or {}:
            if peer != be and (rc, peer) in rows:
                out[f"loader {rc} {be} × {peer}"] = _quotient(r["img_per_s"], rows[(rc, peer)]["img_per_s"])
        if rc in crops:
            out[f"loader {rc} {be} ÷ decode+crops ceiling"] = _quotient(r["img_per_s"], crops[rc]["img_per_s"])
    if absolute:
        for c in report["loader"]["ceilings"]:
            out[f"ceiling {c['kind']} {c['recipe'] or ''} img/s".replace("  ", " ")] = _interval(c["img_per_s"])
    for r in report["train"]["rows"]:
        if r["status"] != "ok":
            continue
        if absolute:
            out[f"train {r['method']} steps/s"] = _interval(r["steps_per_s"])
            out[f"train {r['method']} steps/s on device"] = _interval(r["on_device_steps_per_s"])
        # 1 - stall: the share of the on-device rate the real loader keeps (higher is better).
        out[f"train {r['method']} real ÷ on-device"] = _quotient(r["steps_per_s"], r["on_device_steps_per_s"])
    if absolute:
        for s in report["scaling"]["loader"]:
            out[f"scaling loader {s['backend']} {s['workers']} workers img/s"] = _interval(s["img_per_s"])
        for s in report["scaling"]["batch"]:
            out[f"scaling trainer {s['method']} batch {s['batch_size']} img/s"] = _interval(s["img_per_s"])
    return out


def compare(a: dict, b: dict) -> tuple[list[str], int]:
    """Lines of the comparison B / A and how many figures changed beyond their spreads."""
    absolute = same_machine(a, b)
    lines = []
    if not absolute:
        lines.append(f"different machines (A: {a['machine']['cpu']}, {a['machine']['cores']} cores, GPU "
                     f"{a['machine']['gpu']}, {a['config']['device']}; B: {b['machine']['cpu']}, "
                     f"{b['machine']['cores']} cores, GPU {b['machine']['gpu']}, {b['config']['device']}): "
                     "absolute rates are not compared, only the ratios measured inside each report")
    fa, fb = figures(a, absolute), figures(b, absolute)
    changed = 0
    lines.append(f"{'figure':<58} {'A':>10} {'B':>10} {'B/A':>7}  change")
    for name in sorted(fa.keys() & fb.keys()):
        (ma, la, ha), (mb, lb, hb) = fa[name], fb[name]
        flag = "slower" if hb < la else "faster" if lb > ha else ""
        changed += bool(flag)
        lines.append(f"{name:<58} {ma:>10.3f} {mb:>10.3f} {mb / ma if ma else float('nan'):>7.3f}  {flag}")
    only = sorted(fa.keys() ^ fb.keys())
    if only:
        lines.append(f"in one report only (not compared): {', '.join(only)}")
    lines.append(f"{changed} figure(s) changed beyond their min–max spread")
    return lines, changed


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile compare",
                                description="ratios B / A between two make profile reports")
    p.add_argument("a", help="the reference report (folder or profile.json)")
    p.add_argument("b", help="the report to compare with it")
    p.add_argument("--fail-on-slowdown", action="store_true", help="exit 1 when a figure got slower")
    args = p.parse_args(argv)
    lines, _ = compare(load(args.a), load(args.b))
    print("\n".join(lines))
    slower = any(line.endswith("slower") for line in lines)
    return 1 if args.fail_on_slowdown and slower else 0
