"""`python -m bench.compare method=rsa [data=synthetic] [seeds=3] [steps=N] [against=B] [key=value ...]`
(`make compare`): a method beside the baseline its paper compares it with, everything else equal, over seeds.

Each paper's claim is its method against a baseline with the rest of the setting held fixed. The method
row is `method=... data=... key=value ...` as `make train` resolves it; the baseline row is that same
resolved config (backbone, heads, optimiser, batch, length, views, evaluation: written to a config
file and read back with `config=`) with only what makes the baseline changed (`baseline`: its method,
its objective's own settings, no intra-batch mixes, and where the method's views are part of the method,
the baseline's own views). Both rows train `seeds` times (`run.seed` 0, 1, ...) one after the other in
this process; the report gives kNN and linear-probe top-1 of each row (mean, min–max over the seeds),
the difference of the means and its seed-by-seed spread, next to the random-init network. An
interrupted comparison reuses its finished runs. Writes `compare.json` and `compare.md` into
`reports/compare-<method>-<data>/` and prints the table.

The rows (`baseline`, docs/evaluation.md's table):
- sdmp: MoCo v3 (SDMP Table 1's and Table 5's MoCo v3 rows): SDMP's views and heads, no mixes.
- rsa: BYOL (RSA Tables 1-3): BYOL's two views; on CIFAR the same plain-momentum SGD, heads and length.
- uota: its base without the reweighting (Table M.1): BYOL for BYOL+UOTA; MoCo-v2* (the same run with
  `objective.warmup=1`: the reweighting never starts) for MoCo-v2*+UOTA.
- relicv2: BYOL (RELICv2 Table 1): BYOL's two views and predictor (as wide as the projector).
- dacl: SimCLR beside SimCLR + DACL (DACL Table 3): the method row is `objective.with_simclr=true` on
  BYOL's views. `against=gaussian`: DACL's domain-agnostic baseline (Tables 1-3, "Gaussian-noise"):
  the same DACL run with Gaussian-noise positives instead of Mixup-noise ones
  (`data.mix.dacl_noises=[gaussian]`, `mixing.dacl_gaussian`). The random-init network of every run is
  the paper's "no pre-training" row.
- byol, simclr, mocov3: the baselines themselves; a comparison of one is refused.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

from bench.report import header
from bench.train import accuracy_after, finished_eval
from pipelines.errors import bad_input
from train.config import Config, ConfigError, to_dict
from train.resolve import load_config

FIGURES = ("knn_top1", "linear_top1")


AGAINST = {"dacl": ("simclr", "gaussian")}       # methods with more than one baseline: the first is the default


def baseline(cfg: Config, against: str = "") -> tuple[str, list[str], list[str], str]:
    """(baseline method, the method row's extra words, the baseline's words, the paper's row) of `cfg`'s
    method (module docstring); `against` picks one of `AGAINST`'s baselines.

    Raises:
        ConfigError: a method that is itself a baseline, a baseline the method has not.
    """
    m = cfg.method
    if against and against not in AGAINST.get(m, ()):
        choices = ", ".join(AGAINST.get(m, ())) or "none: it has one baseline"
        raise ConfigError(f"against={against}: method {m} is compared with {choices}; drop against= or pick one")
    if m == "dacl" and against == "gaussian":
        return "dacl", [], ["data.mix.dacl_noises=[gaussian]"], \
            "DACL Tables 1-3: Gaussian-noise beside DACL"
    if m == "sdmp":
        return "mocov3", [], [], "SDMP Tables 1 and 5: MoCo v3 beside SDMP on MoCo v3"
    if m == "rsa":
        return "byol", [], ["views.recipe=byol"], "RSA Tables 1-3: BYOL beside RSA on BYOL"
    if m == "uota" and cfg.objective.base == "mocov2star":
        return "uota", [], ["objective.warmup=1.0"], "UOTA Table M.1: MoCo-v2* beside MoCo-v2*+UOTA"
    if m == "uota":
        return "byol", [], [], "UOTA Table M.1: BYOL beside BYOL+UOTA"
    if m == "relicv2":
        return "byol", [], ["views.recipe=byol", f"model.pred_hidden={cfg.model.proj_hidden}"], \
            "RELICv2 Table 1: BYOL beside RELICv2"
    if m == "dacl":
        return "simclr", ["objective.with_simclr=true", "views.recipe=byol"], [], \
            "DACL Table 3: SimCLR beside SimCLR + DACL"
    raise ConfigError(f"method={m} is a baseline the papers compare against; compare one of sdmp, rsa, uota, relicv2, "
                      "dacl")


def rows(words: list[str], folder: Path, against: str = "") -> dict[str, tuple[str, list[str]]]:
    """{"method": (label, words), "baseline": (label, words)}: the baseline's words name a config file in
    `folder` holding the method row's resolved config without what the baseline changes."""
    cfg = load_config(words)
    base, extra, base_words, paper = baseline(cfg, against)
    cfg = load_config([*words, *extra])
    tree = to_dict(cfg)
    tree.pop("method")
    if base != cfg.method:                   # the baseline's own objective and no mixes; the same method keeps both
        tree.pop("objective")
        tree["data"].pop("mix")
    tree["run"].pop("name")
    path = folder / f"{cfg.method}-row{'-' + against if against else ''}.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    method_label = cfg.method + (" (" + ", ".join(extra) + ")" if extra else "")
    return {"method": (method_label, [*words, *extra]),
            "baseline": (f"{base} ({paper})", [f"config={path}", f"method={base}", *base_words]),
            "paper": paper}


def summary(runs: list[dict], key: str) -> dict:
    values = [100 * r[key] for r in runs]
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "runs": values}


def table(report: dict) -> str:
    """The two rows, their difference and the random-init network, top-1 in %."""
    r = report["rows"]
    lines = [f"{report['paper']}; {report['data']}, {report['steps']} steps, {report['seeds']} seeds "
             "(mean, min–max over the seeds)", "",
             "| row | kNN top-1 | linear top-1 |", "| --- | ---: | ---: |"]
    for name in ("method", "baseline"):
        cells = [f"{r[name][k]['mean']:.1f} % ({r[name][k]['min']:.1f}–{r[name][k]['max']:.1f})" for k in FIGURES]
        lines.append(f"| {r[name]['label']} | " + " | ".join(cells) + " |")
    d = report["difference"]
    lines.append("| difference (method − baseline) | " + " | ".join(
        f"{d[k]['mean']:+.1f} points (seeds {d[k]['min']:+.1f} to {d[k]['max']:+.1f})" for k in FIGURES) + " |")
    ri = report["random_init"]
    lines.append("| random init (no pre-training) | " + " | ".join(f"{ri[k]:.1f} %" for k in FIGURES) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts = {k: v for k, v in (w.split("=", 1) for w in argv if "=" in w) if k in ("seeds", "steps", "report", "against")}
    words = [w for w in argv if w.split("=", 1)[0] not in opts]
    seeds = int(opts.get("seeds", 3))
    steps = [f"optim.steps={opts['steps']}", f"optim.warmup_steps={int(opts['steps']) // 10}"] if "steps" in opts else []
    try:
        method = load_config([*words, *steps])
        against = opts.get("against", "")
        out = Path(opts.get("report", f"reports/compare-{method.method}-{method.data.name}"
                                      + (f"-{against}" if against else "")))
        plan = rows([*words, *steps], out, against)          # an unknown baseline stops here, before any write
        results: dict[str, list[dict]] = {"method": [], "baseline": []}
        for seed in range(seeds):
            for name in ("method", "baseline"):
                label, row_words = plan[name]
                run = [*row_words, f"run.seed={seed}", f"run.name=compare-{method.method}-{name}-seed{seed}",
                       f"run.out_dir={out / 'runs'}"]
                done = finished_eval(run)            # a bad word fails here, before any training
                print(f"{label}, seed {seed}: " + ("done by an earlier run" if done else "training"), flush=True)
                results[name].append({"seed": seed, **(done or accuracy_after(load_config(run)))})
    except ConfigError as e:
        return bad_input(e)
    report = {**header(), "paper": plan["paper"], "data": method.data.name, "steps": method.optim.steps,
              "seeds": seeds, "rows": {}, "results": results}
    for name in ("method", "baseline"):
        report["rows"][name] = {"label": plan[name][0], "words": plan[name][1],
                                **{k: summary(results[name], k) for k in FIGURES}}
    report["difference"] = {}
    for k in FIGURES:
        diffs = [100 * (a[k] - b[k]) for a, b in zip(results["method"], results["baseline"])]
        report["difference"][k] = {"mean": statistics.mean(diffs), "min": min(diffs), "max": max(diffs), "runs": diffs}
    report["random_init"] = {k: 100 * statistics.mean(r[f"random_init/{k}"] for r in results["method"]) for k in FIGURES}
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    md = table(report)
    (out / "compare.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out}/compare.json and compare.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
