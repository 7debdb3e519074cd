"""The `viewmill` command dispatches to each package's own entry point: `viewmill --help` lists the
commands, `viewmill COMMAND --help` is that command's own help, and errors stay one line, exit status 2."""

from __future__ import annotations

import pytest

from train.objectives import OBJECTIVES
from viewmill.cli import COMMANDS, main


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:                      # argparse's --help and errors
        return int(e.code or 0)


def test_help_lists_every_command(capsys) -> None:
    assert exit_status(["--help"]) == 0
    out = capsys.readouterr().out
    assert set(COMMANDS) == {"preprocess", "train", "eval", "linear", "finetune", "saliency", "profile"}
    assert all(name in out for name in COMMANDS)


@pytest.mark.parametrize("command, needles", [
    ("preprocess", ("usage: viewmill preprocess", "--dataset", "--src", "--out")),
    ("train", ("usage: viewmill train", "method=METHOD", "config=FILE.yaml", "optim.lr=0.3", "run.resume=",
               *sorted(OBJECTIVES), "cifar10, cifar100, imagenet, synthetic")),
    ("eval", ("usage: viewmill eval ckpt=CHECKPOINT", "random initialisation", "run.max_eval_samples=")),
    ("linear", ("usage: viewmill linear [gpus=N] ckpt=CHECKPOINT", "compare=random_init", "small, small-finetune",
                "epochs=100.0", "nesterov=False")),
    ("finetune", ("usage: viewmill finetune [gpus=N] ckpt=CHECKPOINT labels=1%|10%|FILE", "backbone_lr_scale=1.0")),
    pytest.param("saliency", ("usage: viewmill saliency", "--root", "--init"), marks=pytest.mark.slow),  # imports skimage: 5 s
    ("profile", ("usage: viewmill profile", "--backends", "--quick")),
])
def test_each_command_help_is_that_commands_own(command: str, needles: tuple[str, ...], capsys) -> None:
    assert exit_status([command, "--help"]) == 0
    out = capsys.readouterr().out
    for needle in needles:
        assert needle in out, out
    if command in ("eval", "linear", "finetune"):       # not the whole of `viewmill train --help`
        assert "viewmill train" not in out and "method=METHOD" not in out and "optim.lr=" not in out, out


@pytest.mark.parametrize("argv, needle", [
    ([], "required: COMMAND"),
    (["fit"], "invalid choice: 'fit'"),
    (["train", "data=nope", "data.root=/nonexistent"], "no dataset 'nope'"),
    (["eval"], "make eval CKPT="),
    (["linear"], "make linear CKPT="),
    (["finetune", "preset=small"], "make finetune CKPT="),
    (["preprocess", "--dataset", "nope"], "unknown dataset 'nope'"),
    (["profile", "--backends", "nope"], "unknown backend nope"),
])
def test_bad_input_is_the_commands_one_line_and_exit_status_2(argv: list[str], needle: str, capsys) -> None:
    assert exit_status(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
