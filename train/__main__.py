"""Command line (also `viewmill train` / `viewmill eval`; `--help` lists methods, presets and keys):
`python -m train [gpus=N] method=rsa data=synthetic [config=FILE.yaml] key=value ...` trains;
`python -m train eval ckpt=PATH [key=value ...]` evaluates a checkpoint's backbone against a
random-init one (kNN and the probe where the data has labels, the health metrics everywhere).

`gpus=N` with N > 1 starts N processes with torch's elastic launcher (the launcher behind torchrun,
`--standalone`), after the checks below passed here, once; `torchrun ... -m train ...` still works.
`nodes=M rdzv=HOST:PORT`, the same command on each of M machines, starts `gpus` processes on each and
joins them over torchrun's c10d rendezvous at HOST:PORT; `launcher=slurm` submits the run as a SLURM
job instead (`train/slurm.py`). Launcher words: `train.launch.ClusterConfig`; the protocols
(`linear`, `finetune`) take them too, `eval` none. This module only reads the words and dispatches: to
`train.evaluate.evaluate_checkpoint`, `train.protocol.main` (or `train.slurm.submit_protocol`),
`train.slurm.submit_run` or `train.launch.start` (the launch, a rank's life).

Bad input ends in one line `error: ...` on stderr and exit status 2, before any file is written and
without a launcher traceback: the config (method, dataset, preset, key, value), the dataset's
manifest, `run.resume`'s or `ckpt=`'s checkpoint (missing, unreadable, another method or network;
under `run.resume=auto` a run folder of another method or network), a `config=` file (missing,
unreadable, an unknown key or a bad value), `model.init`'s weights (missing,
unreadable, another network), `gpus=N` beyond this machine's devices (or cores), a batch that does not
split over N processes, `nodes=M` without a rendezvous address or a launcher word that would be ignored,
`run.wandb=true` without wandb, a SLURM launch that cannot work (`train/slurm.py`).
"""

from __future__ import annotations

import functools
import sys


def usage(prog: str = "python -m train") -> str:
    """`--help`: the two command lines, the methods, the data presets and every key with its default."""
    import dataclasses
    import textwrap

    from train.config import BATCH_RULE, Config, to_dict
    from train.objectives import OBJECTIVES
    from train.resolve import CONFIG_DIR

    def written(v) -> str:                  # as a key=value word reads it back
        return f"[{','.join(map(str, v))}]" if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)

    def flat(tree: dict, prefix: str = "") -> list[str]:
        return [w for k, v in tree.items() if k not in ("method", "layers", "objective")
                for w in (flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={written(v)}"])]

    presets = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "data").glob("*.yaml")))
    defaults = flat(to_dict(dataclasses.replace(Config(), objective=None)))
    wrap = functools.partial(textwrap.fill, width=110, initial_indent="  ", subsequent_indent="  ")
    return "\n".join([
        f"usage: {prog} [gpus=N] [method=METHOD] [data=DATASET] [preset=PRESET] [config=FILE.yaml] [key=value ...]",
        f"       {prog} eval ckpt=CHECKPOINT [key=value ...]",
        f"       {prog} [gpus=N] linear ckpt=CHECKPOINT [preset=NAME] [compare=random_init] [key=value ...]",
        f"       {prog} [gpus=N] finetune ckpt=CHECKPOINT labels=1%|10%|FILE [preset=NAME] [key=value ...]",
        "",
        "Pretrain METHOD on DATASET, then evaluate its backbone (kNN, linear probe) against a random-init one;",
        "eval does the evaluation for a checkpoint; linear and finetune run the papers' protocols on it",
        f"(train/protocol.py; presets: {', '.join(sorted(p.stem for p in (CONFIG_DIR / 'protocol').glob('*.yaml')))}).",
        "Errors are one line on stderr, exit status 2, nothing written.",
        "",
        "  gpus=N            processes (DDP) on each machine, 1 by default",
        "  nodes=M rdzv=HOST:PORT  M machines joined at HOST:PORT: the same command on each (docs/scale.md)",
        "  launcher=slurm    submit a SLURM job instead (a run, linear, finetune): nodes=M gpus=N partition=P "
        "[time_min=, account=, ...]",
        f"  method=METHOD     {', '.join(sorted(OBJECTIVES))} (default {Config.method})",
        "  data=DATASET      a dataset folder under data.root that preprocess wrote (its manifest sets the",
        f"                    classes, view sizes, batch and length), or a data preset: {presets}",
        "  preset=PRESET     the data preset for a dataset folder of another name",
        "  config=FILE.yaml  a config file, after the presets and before key=value (a run's config.yaml re-runs it)",
        "  key=value         override one key (dotted; objective.<key> for the method's own); the keys, with",
        "                    their defaults before any preset:",
        wrap("  ".join(defaults)),
        "",
        wrap(f"The batch: {BATCH_RULE}."),
    ])


def command_usage(prog: str, command: str) -> str:
    """`eval --help`, `linear --help`, `finetune --help`: that command's line, its words and, for the
    protocols, their presets and keys; `prog` is how the command is called (`python -m train eval`)."""
    import dataclasses
    import textwrap

    if command == "eval":
        return "\n".join([
            f"usage: {prog} ckpt=CHECKPOINT [key=value ...]",
            "",
            "Evaluate a checkpoint's backbone against the same network at its random initialisation: kNN and the",
            "linear probe where the data has labels, the health metrics (rankme, std, alignment) everywhere.",
            "",
            "  ckpt=CHECKPOINT   a training checkpoint, <run dir>/checkpoint.pt",
            "  key=value         a dotted override of the config the checkpoint saved (data.root=, run.device=,",
            "                    run.max_eval_samples=); keys that build another network are refused",
            "Errors are one line on stderr, exit status 2, nothing written.",
        ])
    from train.protocol import ProtocolConfig, preset_names

    keys = [f"{f.name}={getattr(ProtocolConfig(), f.name)}" for f in dataclasses.fields(ProtocolConfig)
            if f.name != "source"]
    labels = " labels=1%|10%|FILE" if command == "finetune" else ""
    what = ("The papers' linear evaluation: the backbone frozen, a linear classifier trained on the labelled train "
            "split" if command == "linear" else
            "Semi-supervised fine-tuning: the whole network trained on a share of the labels (1 % or 10 %, or the "
            "images a file lists by name)")
    return "\n".join([
        f"usage: {prog} [gpus=N] ckpt=CHECKPOINT{labels} [preset=NAME] "
        f"{'[compare=random_init] ' if command == 'linear' else ''}[key=value ...]",
        "",
        textwrap.fill(f"{what}, scored by top-1 and top-5 on the val split; resumable, DDP with gpus=N "
                      "(train/protocol.py, docs/evaluation.md).", width=110),
        "",
        "  ckpt=CHECKPOINT      a training checkpoint, <run dir>/checkpoint.pt; the result goes beside it",
        *(["  labels=1%|10%|FILE   the labelled share, or a file of train image names, one a line"]
          if command == "finetune" else []),
        textwrap.fill(f"  preset=NAME          {', '.join(preset_names())}; auto (default): the method's paper's on "
                      "ImageNet-scale data, the short small presets otherwise", width=110, subsequent_indent=" " * 23),
        *(["  compare=random_init  the same protocol on the network at its random initialisation too"]
          if command == "linear" else []),
        "  key=value            a protocol key, or a dotted data.* / run.* override of the saved config; the",
        "                       keys, with their defaults before the preset:",
        textwrap.fill("  ".join(keys), width=110, initial_indent="    ", subsequent_indent="    "),
        "Errors are one line on stderr, exit status 2, nothing written.",
    ])


def dispatch(argv: list[str]) -> int:
    """The command of `argv` after the launcher words: eval, a protocol, a SLURM job, or a run on this
    machine."""
    from train.config import ConfigError
    from train.launch import ClusterConfig, start, take_cluster, take_processes

    processes, argv = take_processes(argv)
    cluster, argv = take_cluster(argv)
    if argv[:1] == ["eval"]:
        if processes > 1 or cluster != ClusterConfig():
            raise ConfigError("eval runs in this one process: drop gpus=, nodes= and launcher= (linear and finetune "
                              "take them)")
        from train.evaluate import evaluate_checkpoint

        evaluate_checkpoint(argv[1:])
        return 0
    from train import protocol

    if protocol.is_protocol(argv):
        import os

        from train.launch import elastic

        if cluster.launcher == "slurm":
            from train.slurm import submit_protocol

            return submit_protocol(argv[0], argv[1:], processes, cluster)
        if processes > 1 and "LOCAL_RANK" not in os.environ:     # the launching process: start the ranks
            plan = protocol.preflight(argv[0], argv[1:], processes, cluster.nodes)
            return elastic(processes, argv, cluster, plan.cfg.run.checkpoint_on_signal)
        protocol.main(argv[0], argv[1:])
        return 0
    if cluster.launcher == "slurm":
        from train.slurm import submit_run

        return submit_run(argv, processes, cluster)
    return start(argv, processes, cluster)


def main(argv: list[str], prog: str = "python -m train") -> int:
    if {"-h", "--help"} & set(argv):
        command = next((w for w in argv if w in ("eval", "linear", "finetune")), None)
        print(usage(prog) if command is None else command_usage(f"{prog} {command}", command))
        return 0
    from train.launch import exit_status

    return exit_status(lambda: dispatch(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
