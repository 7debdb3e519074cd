"""`python -m train` on bad input: one line `error: ...` naming the fix, exit status 2, nothing
written; with gpus=2 the same from inside the launched processes, without a launcher traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import yaml

from train import checkpoint
from train.__main__ import main
from train.config import to_dict
from train.resolve import load_config

ROOT = Path(__file__).resolve().parents[2]


def fails_in_one_line(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def saved_checkpoint(path: Path, words: list[str]) -> Path:
    """A file with what the checks read from a checkpoint: the config of `words`."""
    return checkpoint.save(path, {"config": to_dict(load_config(words)), "step": 1})


def test_bad_input_ends_in_one_line_before_any_write(tiny_args, capsys, tmp_path) -> None:
    out = tmp_path / "runs"
    words = tiny_args("rsa", out)
    fails_in_one_line(capsys, [*words, "data=nope"], "no dataset 'nope'", "make preprocess")
    fails_in_one_line(capsys, [*words, "gpus=999"], "GPUS=999", "use GPUS between 1 and")
    fails_in_one_line(capsys, [*words, "gpus=two"], "whole number")
    fails_in_one_line(capsys, [*words, "data.batch_size=5"], "data.batch_size=5", "use a multiple of 2")
    byol = saved_checkpoint(tmp_path / "byol.pt", tiny_args("byol", out))
    fails_in_one_line(capsys, [*words, f"run.resume={byol}"], "method=byol (asked for rsa)", "same method")
    wide = saved_checkpoint(tmp_path / "wide.pt", [*words, "model.backbone=resnet34"])
    fails_in_one_line(capsys, [*words, f"run.resume={wide}"], "model.backbone=resnet34 (asked for test_resnet)")
    fails_in_one_line(capsys, [*words, f"run.resume={tmp_path / 'gone.pt'}"], "not found")
    bare = checkpoint.save(tmp_path / "bare.pt", {"conv1.weight": torch.zeros(1)})    # an exported backbone
    fails_in_one_line(capsys, [*words, f"run.resume={bare}"], "not a training checkpoint")
    fails_in_one_line(capsys, ["eval", f"ckpt={bare}"], "not a training checkpoint")
    for word in ("optim.lr=-1", "optim.lr=nan", "optim.steps=-1", "optim.warmup_steps=-1", "views.global_px=0",
                 "run.log_every=0", "run.ckpt_every=0"):
        fails_in_one_line(capsys, [*words, word], f"{word.split('=')[0]}=", "is out of range; give a value of at least")
    fails_in_one_line(capsys, [*words, "model.backbone=resnet5O"], "model.backbone=resnet5O: unknown backbone")
    (tmp_path / "afile").write_text("")
    for where in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        fails_in_one_line(capsys, [*words, f"run.out_dir={where}"], "cannot be written", "give run.out_dir a folder")
    assert not out.exists()
    rsa = saved_checkpoint(tmp_path / "rsa.pt", words)
    fails_in_one_line(capsys, ["eval", f"ckpt={rsa}", "model.backbone=resnet50"],
                      "model.backbone=test_resnet (asked for resnet50)", "drop the override")
    fails_in_one_line(capsys, ["eval"], "make eval CKPT=")


def test_a_checkpoint_that_is_not_one_is_named_with_the_word_that_passed_it(tiny_args, capsys, tmp_path) -> None:
    """`ckpt=` and `run.resume=` errors name their own word, a run folder given for its checkpoint names the
    file, and a file that is not a checkpoint is not answered with torch's advice to unpickle it."""
    run = tmp_path / "runs" / "run"
    saved_checkpoint(run / "checkpoint.pt", tiny_args("rsa", tmp_path / "runs"))
    fails_in_one_line(capsys, ["eval", f"ckpt={tmp_path / 'gone.pt'}"], "gone.pt not found; pass ckpt=")
    fails_in_one_line(capsys, ["eval", f"ckpt={run}"],
                      f"is a folder, not a checkpoint; pass ckpt={run / 'checkpoint.pt'}")
    fails_in_one_line(capsys, ["linear", f"ckpt={tmp_path}"], "is a folder that holds no checkpoint.pt; pass ckpt=")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    cut = tmp_path / "cut.pt"
    cut.write_bytes((run / "checkpoint.pt").read_bytes()[:-100])         # a copy that stopped short
    for bad in (tmp_path / "notes.txt", cut):
        err = fails_in_one_line(capsys, ["eval", f"ckpt={bad}"], f"cannot read checkpoint {bad}", "pass ckpt=")
        assert "weights_only" not in err
    fails_in_one_line(capsys, [*tiny_args("rsa", tmp_path / "other"), f"run.resume={cut}"], "pass run.resume=")


def test_a_fresh_start_in_a_folder_that_holds_a_run_ends_in_one_line_and_changes_nothing(tiny_args, capsys,
                                                                                         tmp_path) -> None:
    """Without run.resume a start would train from step 0 over the checkpoints, config and metrics of the run
    in its folder: another method under the same run.name, the same command again, a run's config.yaml re-run
    without a new name, a run stopped before its first checkpoint. Each is refused; the folder is unchanged."""
    out = tmp_path / "runs"
    run = out / "run"
    saved_checkpoint(run / "checkpoint.pt", tiny_args("rsa", out))
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(tiny_args("rsa", out)))))
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for words in (tiny_args("simclr", out), tiny_args("rsa", out), [f"config={run / 'config.yaml'}"]):
        fails_in_one_line(capsys, words, f"{run} holds a run already (checkpoint.pt at step 1)", "run.resume=auto",
                          "another run.name")
    (run / "checkpoint.pt").unlink()
    del before["checkpoint.pt"]
    fails_in_one_line(capsys, tiny_args("rsa", out), "holds a run already (no checkpoint yet)")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_auto_resume_of_another_network_ends_in_one_line_and_writes_nothing(tiny_args, capsys, tmp_path) -> None:
    """`run.resume=auto` on a run folder of another method (by its checkpoint, or by its config.yaml when
    it stopped before one), without a run name or with keep_last 0 stops before any write."""
    out = tmp_path / "runs"
    words = tiny_args("rsa", out, "run.resume=auto")
    byol = saved_checkpoint(out / "run" / "checkpoint.pt", tiny_args("byol", out))
    before = byol.read_bytes()
    fails_in_one_line(capsys, words, "method=byol (asked for rsa)", "run.resume=auto continues the run in")
    assert [p.name for p in (out / "run").iterdir()] == ["checkpoint.pt"] and byol.read_bytes() == before
    byol.unlink()
    (out / "run" / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(tiny_args("byol", out)))))
    fails_in_one_line(capsys, words, "config.yaml was trained with method=byol (asked for rsa)")
    assert [p.name for p in (out / "run").iterdir()] == ["config.yaml"]
    fails_in_one_line(capsys, [*words, "run.name="], "run.resume=auto needs", "set run.name=")
    fails_in_one_line(capsys, [*words, "run.keep_last=0"], "run.keep_last=0", "use run.keep_last=1")


def test_model_init_of_another_network_ends_in_one_line_and_writes_nothing(tiny_args, capsys, tmp_path) -> None:
    """`model.init` weights of another timm model, of timm's stem where the small-image stem is built, or
    no file at all stop before any write."""
    from models.backbone import build_backbone, save_backbone

    words = tiny_args("rsa", tmp_path / "runs")
    resnet18 = save_backbone(build_backbone("resnet18", 32)[0], tmp_path / "r18.safetensors", "resnet18", 32)
    fails_in_one_line(capsys, [*words, f"model.init={resnet18}"], "model.init:", "holds a resnet18 backbone",
                      "set model.backbone=resnet18")
    imagenet_stem = tmp_path / "test_resnet.pth"                   # timm's stem: the small stem's conv1 differs
    torch.save({"state_dict": timm.create_model("test_resnet", num_classes=10).state_dict()}, imagenet_stem)
    fails_in_one_line(capsys, [*words, f"model.init={imagenet_stem}"], "does not fit a test_resnet backbone",
                      "conv1", "views.global_px above 64")
    fails_in_one_line(capsys, [*words, f"model.init={tmp_path / 'gone.safetensors'}"], "no file")
    assert not (tmp_path / "runs").exists()


def test_the_launcher_checks_model_init_once_and_builds_no_network_without_it(tiny_args, tmp_path,
                                                                          monkeypatch) -> None:
    """The process that launches gpus=2 refuses `model.init` weights of another network in one line before
    any process starts; without `model.init` it builds no network (importing timm, and torchvision's
    compiler with it, took 4-9 CPU-seconds of its start before the ranks started)."""
    import models.backbone
    from train.config import ConfigError
    from train.launch import preflight

    words = tiny_args("rsa", tmp_path / "runs")
    resnet18 = models.backbone.save_backbone(models.backbone.build_backbone("resnet18", 32)[0],
                                             tmp_path / "r18.safetensors", "resnet18", 32)
    with pytest.raises(ConfigError, match="holds a resnet18 backbone"):
        preflight(load_config([*words, f"model.init={resnet18}"], world_size=2), 2, here=False)
    built = []
    monkeypatch.setattr(models.backbone, "build_backbone", lambda *a: built.append(a))
    preflight(load_config(words, world_size=2), 2, here=False)
    assert built == [] and not (tmp_path / "runs").exists()


@pytest.mark.ddp
def test_an_error_inside_the_launched_processes_is_one_line(tiny_args, tmp_path) -> None:
    """gpus=2 passes the launcher's checks; both processes then refuse views that cannot feed RSA."""
    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "train", "gpus=2", *tiny_args("rsa", out), "views.recipe=byol"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "staged weak views" in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert not out.exists()


def test_ctrl_c_before_the_training_loop_is_one_line_too(tiny_args, capsys, tmp_path, monkeypatch) -> None:
    """Ctrl-C while a run starts (before its loop, where no checkpoint is named): one line, status 130."""
    from train import launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "select_device", interrupted)
    assert main(tiny_args("rsa", tmp_path / "runs")) == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"
