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
    architecture; `args` are `ckpt=PATH` and optional `key=value` config overrides of data/run."""
    from models.multicrop import build_model
    from train import checkpoint
    from train.config import _dotted_to_nested, _merge, Config
    from train.loop import evaluate_backbone, select_device

    opts = dict(a.split("=", 1) for a in args if "=" in a)
    if "ckpt" not in opts:
        raise ConfigError("eval needs the checkpoint: python -m train eval ckpt=<run dir>/checkpoint.pt")
    state = checkpoint.load(opts.pop("ckpt"))
    tree = state["config"]
    for key, value in opts.items():
        check: dict = {}
        _merge(check, _dotted_to_nested(key, value), Config)
        section, _, field = key.rpartition(".")
        node = tree
        for part in section.split(".") if section else []:
            node = node[part]
        node[field] = value
    cfg = config_from_dict(tree)
    device = select_device(cfg.run.device)
    backend = cfg.data.backend if cfg.data.backend != "auto" else ("dali" if device.type == "cuda" else "torch")

    def model():
        return build_model(cfg.model.backbone, cfg.views.global_px, cfg.model.proj_hidden, cfg.model.proj_out,
                           cfg.model.pred_hidden, cfg.model.proj_layers).to(device)

    trained = model()
    trained.load_state_dict(state["online"])
    torch.manual_seed(cfg.run.seed + 1)
    results = {"checkpoint": evaluate_backbone(cfg, trained.backbone, backend, device),
               "random_init": evaluate_backbone(cfg, model().backbone, backend, device)}
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
