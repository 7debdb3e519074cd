"""Command line: `python -m train method=rsa data=synthetic key=value ...` trains;
`python -m train eval ckpt=PATH` evaluates a checkpoint's backbone against a random-init one.

Under torchrun every rank runs the same command (`torchrun --standalone --nproc_per_node=N -m train ...`).
"""

from __future__ import annotations

import sys

import torch

from train.config import ConfigError, config_from_dict, load_config


def evaluate_checkpoint(args: list[str]) -> dict[str, dict[str, float]]:
    """kNN + linear probe of the checkpoint's backbone and of a random-init backbone of the same
    architecture; `args` are `ckpt=PATH` and optional `key=value` overrides of the saved config
    (e.g. `data.root=...`, `run.max_eval_samples=...`)."""
    from train import checkpoint
    from train.evaluate import evaluate_backbone
    from train.setup import build_online, resolve_backend, select_device

    ckpt = [a.split("=", 1)[1] for a in args if a.startswith("ckpt=")]
    if not ckpt:
        raise ConfigError("eval needs the checkpoint: python -m train eval ckpt=<run dir>/checkpoint.pt")
    state = checkpoint.load(ckpt[-1])
    cfg = config_from_dict(state["config"], overrides=[a for a in args if not a.startswith("ckpt=")])
    device = select_device(cfg.run.device)
    backend = resolve_backend(cfg.data.backend, device)
    trained = build_online(cfg, device)
    trained.load_state_dict(state["online"])
    torch.manual_seed(cfg.run.seed + 1)
    results = {"checkpoint": evaluate_backbone(cfg, trained.backbone, backend, device),
               "random_init": evaluate_backbone(cfg, build_online(cfg, device).backbone, backend, device)}
    print(f"step {state['step']} {cfg.method} {cfg.model.backbone} on {cfg.data.name}")
    for name, r in results.items():
        print(f"{name:>12}: kNN {100 * r['knn_top1']:.1f}% | linear {100 * r['linear_top1']:.1f}%")
    return results


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["eval"]:
            evaluate_checkpoint(argv[1:])
            return 0
        cfg = load_config(argv)
        from train.loop import train       # after the config check: errors come before heavy imports

        train(cfg)
        return 0
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        from train import dist

        dist.cleanup()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
