"""`python -m bench.saliency_check [dataset=synthetic] [steps=150] [seeds=2] [key=value ...]`
(`make saliency-check`): the check RELICv2 ends its saliency study with (App. D.2, Tables 13 and 14),
on one machine.

The same `relicv2` run, `steps` steps each and `seeds` seeds each, three ways:
- `p_m = 0`: background removal off (the relicv2 recipe with every `saliency_p` set to 0);
- `p_m = 0.1, saliency`: the recipe as it is, on DATASET with the masks `make saliency` wrote;
- `p_m = 0.1, centred control`: the recipe on DATASET-centre, whose masks are centred rectangles of
  each saliency mask's coverage (`python -m preprocess.saliency.control`, run first by the make
  target).
kNN and linear-probe top-1 on the val split after each run (the trainer's final evaluation), the runs
one after the other in this process (each seeds itself from its config). Writes `check.json` (machine, versions, commit, configs, numbers) and `check.md` into
`reports/saliency-check-<dataset>/` and prints the table.
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
from pipelines.views import RECIPE_DIR
from train.config import ConfigError
from train.resolve import CONFIG_DIR, load_config

ARMS = ("p_m = 0", "p_m = 0.1, saliency", "p_m = 0.1, centred control")


def recipe_without_saliency(out: Path) -> Path:
    """The relicv2 recipe with every group's saliency_p set to 0, written to `out`."""
    recipe = yaml.safe_load((RECIPE_DIR / "relicv2.yaml").read_text())
    recipe["name"] = "relicv2-no-saliency"
    for group in recipe["groups"]:
        if "saliency_p" in group:
            group["saliency_p"] = 0.0
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return out


def arm_args(arm: str, dataset: str, no_saliency: Path) -> list[str]:
    """The config words of one arm. The control copy is read with DATASET's data preset when there is
    one: without it, DATASET-centre would get the values derived from its manifest (another batch
    size, backbone and image size) and the arms would differ in more than their masks."""
    preset = [f"preset={dataset}"] if (CONFIG_DIR / "data" / f"{dataset}.yaml").is_file() else []
    if arm == ARMS[0]:
        return [f"data={dataset}", *preset, f"views.recipe={no_saliency}"]
    if arm == ARMS[1]:
        return [f"data={dataset}", *preset]
    return [f"data={dataset}-centre", *preset]


def run_arm(words: list[str]) -> dict:
    """Train one arm (in the calling process) and return its final evaluation."""
    return accuracy_after(load_config(words))


def main(argv: list[str]) -> int:
    opts = dict(w.split("=", 1) for w in argv if w.split("=", 1)[0] in ("dataset", "steps", "seeds", "report"))
    rest = [w for w in argv if w.split("=", 1)[0] not in opts]
    dataset, steps, seeds = opts.get("dataset", "synthetic"), int(opts.get("steps", 150)), int(opts.get("seeds", 2))
    report = Path(opts.get("report", f"reports/saliency-check-{dataset}"))
    report.mkdir(parents=True, exist_ok=True)
    no_saliency = recipe_without_saliency(report / "relicv2-no-saliency.yaml")
    results: dict[str, list[dict]] = {}
    try:
        for seed in range(seeds):
            for arm in ARMS:
                words = ["method=relicv2", *arm_args(arm, dataset, no_saliency), f"optim.steps={steps}",
                         f"optim.warmup_steps={steps // 10}", f"run.seed={seed}",
                         *rest, f"run.name=saliency-check-{ARMS.index(arm)}-seed{seed}"]   # the bench's own folder
                done = finished_eval(words)              # a bad word fails here, before any training
                print(f"{arm}, seed {seed}: " + ("done by an earlier run" if done else f"training {steps} steps"),
                      flush=True)
                results.setdefault(arm, []).append({"seed": seed, "words": words,
                                                    **(done or run_arm(words))})
    except ConfigError as e:
        return bad_input(e)
    (report / "check.json").write_text(json.dumps({**header(), "steps": steps, "seeds": seeds, "results": results},
                                                  indent=1))
    md = table(results, steps)
    (report / "check.md").write_text(md + "\n")
    print(md)
    print(f"wrote {report}/check.json and check.md")
    return 0


def table(results: dict[str, list[dict]], steps: int) -> str:
    """Mean top-1 per arm, with the per-seed values."""
    first = next(iter(results.values()))[0]
    lines = [f"relicv2, {steps} steps per run; random init: kNN {100 * first['random_init/knn_top1']:.1f} %, "
             f"linear {100 * first['random_init/linear_top1']:.1f} %", "",
             "| run | kNN top-1 | linear top-1 | per seed (kNN / linear) |", "| --- | ---: | ---: | --- |"]
    for arm, runs in results.items():
        knn = [100 * r["knn_top1"] for r in runs]
        lin = [100 * r["linear_top1"] for r in runs]
        lines.append(f"| {arm} | {statistics.mean(knn):.1f} % | {statistics.mean(lin):.1f} % | "
                     + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(knn, lin)) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
