"""Command line (also `viewmill train` / `viewmill eval`; `--help` lists methods, presets and keys):
`python -m train [gpus=N] method=rsa data=synthetic [config=FILE.yaml] key=value ...` trains;
`python -m train eval ckpt=PATH [key=value ...]` evaluates a checkpoint's backbone against a
random-init one (kNN and the probe where the data has labels, the health metrics everywhere).

`gpus=N` with N > 1 starts N processes with torch's elastic launcher (the launcher behind torchrun,
`--standalone`), after the checks below passed here, once; `torchrun ... -m train ...` still works.
`nodes=M rdzv=HOST:PORT`, the same command on each of M machines, starts `gpus` processes on each and
joins them over torchrun's c10d rendezvous at HOST:PORT; `launcher=slurm` submits the run as a SLURM
job instead (`train/slurm.py`). Launcher words: `train.config.ClusterConfig`.

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
import logging
import os
import signal
import sys
import uuid

import torch

from pipelines.processes import end_with_parent
from pipelines.schema import DatasetError, read_manifest
from pipelines.spec import LoaderError
from train.config import ClusterConfig, Config, ConfigError, config_from_dict, load_config, take_cluster

EXIT_BAD_INPUT = 2
LAUNCHER_PID = "VIEWMILL_LAUNCHER_PID"   # set by `launch` for the processes it starts


def evaluate_checkpoint(args: list[str]) -> dict[str, dict[str, float]]:
    """kNN + linear probe of the checkpoint's backbone and of a random-init backbone of the same
    architecture; `args` are `ckpt=PATH` and optional `key=value` overrides of the saved config
    (e.g. `data.root=...`, `run.max_eval_samples=...`)."""
    from train import checkpoint
    from train.evaluate import EvalLoaders, evaluate_backbone
    from train.log import eval_line
    from train.setup import build_online, check_same_network, resolve_backend, select_device

    ckpt = [a.split("=", 1)[1] for a in args if a.startswith("ckpt=")]
    if not ckpt:
        raise ConfigError("eval needs the checkpoint: make eval CKPT=<run dir>/checkpoint.pt")
    state = checkpoint.load_training(ckpt[-1])
    cfg = config_from_dict(state["config"], overrides=[a for a in args if not a.startswith("ckpt=")])
    check_same_network(cfg, state["config"], ckpt[-1], "eval rebuilds that network: drop the override")
    check_dataset(cfg)
    device = select_device(cfg.run.device, cfg.run.dist_timeout_min)
    backend = resolve_backend(cfg, device)
    trained = build_online(cfg, device)
    trained.load_state_dict(state["online"])
    torch.manual_seed(cfg.run.seed + 1)
    loaders = EvalLoaders()
    results = {"checkpoint": evaluate_backbone(cfg, trained.backbone, backend, device, loaders),
               "random_init": evaluate_backbone(cfg, build_online(cfg, device).backbone, backend, device, loaders)}
    print(f"step {state['step']} {cfg.method} {cfg.model.backbone} on {cfg.data.name}")
    for name, r in results.items():
        print(f"{name:>12}: {eval_line(r)}")
    return results


def check_dataset(cfg: Config) -> None:
    """The dataset folder has a complete manifest (file sizes checked; the loader verifies the rest).

    Raises:
        DatasetError: a missing, incomplete or damaged dataset, naming `make preprocess`.
    """
    read_manifest(os.path.join(cfg.data.root, cfg.data.name), verify="size")


def preflight(cfg: Config, processes: int, nodes: int = 1, here: bool = True) -> None:
    """Everything that can be checked before a process is launched or a file written (`here`: the
    processes start on this machine, so its devices are counted).

    Raises:
        ConfigError, DatasetError, CheckpointError: one line each (see the module docstring).
    """
    from models.backbone import build_backbone
    from train.log import check_wandb
    from train.setup import check_batch_split, check_processes, init_backbone, resume_state

    check_wandb(cfg)
    if here:
        check_processes(processes, cfg.run.device)
    check_batch_split(cfg.data.batch_size, processes * nodes)
    check_dataset(cfg)
    if processes * nodes > 1:               # one process checks them in the loop, before any write
        if resume_state(cfg).state is None:
            init_backbone(cfg, build_backbone(cfg.model.backbone, cfg.views.global_px)[0])


def launch(processes: int, argv: list[str], cluster: ClusterConfig = ClusterConfig()) -> int:
    """Run `python -m train argv` in `processes` local processes (torchrun --standalone), or, with
    `cluster.nodes` > 1, in `processes` processes on each node, joined at `cluster.rdzv` (torchrun
    --nnodes --rdzv-backend=c10d); the exit status is the first failed process's, and each process
    prints its own error line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not torch.cuda.is_available():       # torchrun's rule: one thread per process unless told
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)   # no launcher tracebacks
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the processes' parent, whose death ends them
    many = cluster.nodes > 1                # every node's launcher must name the same rendezvous
    config = LaunchConfig(min_nodes=cluster.nodes, max_nodes=cluster.nodes, nproc_per_node=processes,
                          run_id=f"viewmill-{cluster.rdzv}" if many else uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint=cluster.rdzv if many else "localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "train", *argv)
    except ChildFailedError as e:
        first = min(e.failures.values(), key=lambda f: f.timestamp)
        if first.exitcode < 0:              # a signal: the OOM killer, kill -9, a node's shutdown
            print(f"error: process {first.local_rank} was killed by signal {-first.exitcode} "
                  f"({signal.strsignal(-first.exitcode)}) and the others stopped; the same command with "
                  "run.resume=auto continues from the last checkpoint", file=sys.stderr)
        elif first.exitcode != EXIT_BAD_INPUT:
            print(f"error: process {first.local_rank} failed with exit status {first.exitcode}; "
                  "its output is above", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    return 0


def usage(prog: str = "python -m train") -> str:
    """`--help`: the two command lines, the methods, the data presets and every key with its default."""
    import dataclasses
    import textwrap

    from train.config import CONFIG_DIR, to_dict
    from train.objectives import OBJECTIVES

    def written(v) -> str:                  # as a key=value word reads it back
        return f"[{','.join(map(str, v))}]" if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)

    def flat(tree: dict, prefix: str = "") -> list[str]:
        return [w for k, v in tree.items() if k not in ("method", "objective")
                for w in (flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={written(v)}"])]

    presets = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "data").glob("*.yaml")))
    defaults = flat(to_dict(dataclasses.replace(Config(), objective=None)))
    wrap = functools.partial(textwrap.fill, width=110, initial_indent="  ", subsequent_indent="  ")
    return "\n".join([
        f"usage: {prog} [gpus=N] [method=METHOD] [data=DATASET] [preset=PRESET] [config=FILE.yaml] [key=value ...]",
        f"       {prog} eval ckpt=CHECKPOINT [key=value ...]",
        "",
        "Pretrain METHOD on DATASET, then evaluate its backbone (kNN, linear probe) against a random-init one;",
        "eval does the evaluation for a checkpoint. Errors are one line on stderr, exit status 2, nothing written.",
        "",
        "  gpus=N            processes (DDP) on each machine, 1 by default",
        "  nodes=M rdzv=HOST:PORT  M machines joined at HOST:PORT: the same command on each (README, Clusters)",
        "  launcher=slurm    submit a SLURM job instead: nodes=M gpus=N partition=P [time_min=, account=, ...]",
        f"  method=METHOD     {', '.join(sorted(OBJECTIVES))} (default {Config.method})",
        "  data=DATASET      a dataset folder under data.root that preprocess wrote (its manifest sets the",
        f"                    classes, view sizes, batch and length), or a data preset: {presets}",
        "  preset=PRESET     the data preset for a dataset folder of another name",
        "  config=FILE.yaml  a config file, after the presets and before key=value (a run's config.yaml re-runs it)",
        "  key=value         override one key (dotted; objective.<key> for the method's own); the keys, with",
        "                    their defaults before any preset:",
        wrap("  ".join(defaults)),
    ])


def take_processes(argv: list[str]) -> tuple[int, list[str]]:
    """(N of a `gpus=N` word, default 1; the other words)."""
    words = [a for a in argv if a.startswith(("gpus=", "gpus_per_node="))]      # per node
    rest = [a for a in argv if not a.startswith(("gpus=", "gpus_per_node="))]
    if not words:
        return 1, rest
    try:
        return int(words[-1].split("=", 1)[1]), rest
    except ValueError:
        raise ConfigError(f"{words[-1]!r}: GPUS must be a whole number of processes, e.g. GPUS=2") from None


def main(argv: list[str], prog: str = "python -m train") -> int:
    if {"-h", "--help"} & set(argv):
        print(usage(prog))
        return 0
    from train.loop import NonFiniteLossError

    try:
        processes, argv = take_processes(argv)
        cluster, argv = take_cluster(argv)
        if argv[:1] == ["eval"]:
            evaluate_checkpoint(argv[1:])
            return 0
        if "TORCHELASTIC_RUN_ID" in os.environ:     # a rank of the elastic launcher (ours, torchrun): it and
            # its loader workers end when the launcher dies, even one that dies while this process starts
            end_with_parent(int(os.environ.pop(LAUNCHER_PID, os.getppid())))
        cfg = load_config(argv, world_size=int(os.environ.get("WORLD_SIZE", processes * cluster.nodes)))
        if "LOCAL_RANK" not in os.environ:  # checked once by the launching process (of each node)
            if cluster.launcher == "slurm":
                from train import slurm

                cfg, argv = slurm.requeueable(cfg, argv)    # run.resume=auto in a run folder named now
                preflight(cfg, processes, cluster.nodes, here=False)
                return slurm.submit(cfg, argv, processes, cluster)
            preflight(cfg, processes, cluster.nodes)
            if processes > 1 or cluster.nodes > 1:
                return launch(processes, argv, cluster)
        from train.loop import train

        train(cfg)
        return 0
    except (ConfigError, DatasetError, LoaderError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        from train import dist

        dist.cleanup()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
