"""`viewmill COMMAND [ARGS]`: the installed command for what the Makefile targets do.

    viewmill preprocess --dataset synthetic --out data        # python -m preprocess
    viewmill train method=dacl data=synthetic optim.lr=0.6    # python -m train
    viewmill eval ckpt=runs/<run>/checkpoint.pt               # python -m train eval
    viewmill linear ckpt=runs/<run>/checkpoint.pt             # python -m train linear
    viewmill finetune ckpt=runs/<run>/checkpoint.pt labels=1% # python -m train finetune
    viewmill saliency --dataset synthetic --root data         # python -m preprocess.saliency
    viewmill profile --quick                                  # python -m bench.profile

It only dispatches: the arguments after COMMAND go to that package's own entry point unchanged, so
`viewmill COMMAND --help` is the command's own help, and its checks and one-line errors are the
command's. A command's package is imported only when that command runs (`viewmill --help` is quick).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from typing import Callable

from pipelines.errors import bad_input


def run_preprocess(argv: list[str]) -> int:
    from preprocess.__main__ import main

    return main(argv, prog="viewmill preprocess")


def run_train(argv: list[str]) -> int:
    from train.__main__ import main

    return main(argv, prog="viewmill train")


def run_eval(argv: list[str]) -> int:
    from train.__main__ import main

    return main(["eval", *argv], prog="viewmill")


def run_linear(argv: list[str]) -> int:
    from train.__main__ import main

    return main(["linear", *argv], prog="viewmill")


def run_finetune(argv: list[str]) -> int:
    from train.__main__ import main

    return main(["finetune", *argv], prog="viewmill")


def run_saliency(argv: list[str]) -> int:
    from preprocess.saliency.__main__ import main

    return main(argv, prog="viewmill saliency")


def run_profile(argv: list[str]) -> int:
    from bench.profile import main

    return main(argv, prog="viewmill profile")


# Command -> (its entry point, one line of help); the order of `viewmill --help`.
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "preprocess": (run_preprocess, "write a dataset (synthetic, CIFAR, an image folder) as FFCV + DALI files"),
    "train": (run_train, "pretrain METHOD on DATASET (key=value overrides, config=FILE), then evaluate"),
    "eval": (run_eval, "kNN + linear probe of a checkpoint's backbone against a random-init one"),
    "linear": (run_linear, "the papers' linear evaluation of a checkpoint (top-1 / top-5, resumable, DDP)"),
    "finetune": (run_finetune, "semi-supervised fine-tuning of a checkpoint on 1 or 10 per cent of the labels"),
    "saliency": (run_saliency, "saliency masks for a written dataset, with a quality report"),
    "profile": (run_profile, "throughput report: loaders, their stages, training steps, scaling"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:          # one line and exit status 2, as every command errs
        sys.exit(bad_input(f"{message}; see viewmill --help"))


def version() -> str:
    try:
        return importlib.metadata.version("viewmill")
    except importlib.metadata.PackageNotFoundError:     # run from a checkout that is not installed
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    """`viewmill [--version] COMMAND ...`: the command names and their one-line help."""
    p = _Parser(prog="viewmill", description="Fast input pipelines and a lean DDP trainer for self-supervised "
                "visual pretraining. `viewmill COMMAND --help` shows a command's own options.")
    p.add_argument("--version", action="version", version=f"viewmill {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)    # --help belongs to the command
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `viewmill argv`; returns the command's exit status (2: bad input, in one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = parser().parse_args(argv[:1]).command       # --help, --version and a bad command end here
    return COMMANDS[command][0](argv[1:])
