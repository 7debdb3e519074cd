"""The papers' protocols (`train/protocol.py`): linear evaluation leaves the backbone as it was to the
bit and separates what is separable; fine-tuning trains the whole network on a class-balanced, seeded
share of the labels or on the images a file lists by name; two gloo ranks take the one-process steps; a killed evaluation resumes to the
uninterrupted result, one warned by SLURM's signal saves the step it reached first (standalone and
after pretraining, `run.eval=linear`), and one whose loader worker died on a rank saves the steps it reached;
bad input is one line and writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.rehearse import write_folder
from train import checkpoint, protocol
from train.config import ConfigError, to_dict
from train.protocol import Protocol, labelled_share, listed_records, load_protocol, lr_at
from train.resolve import load_config
from train.setup import build_online

ROOT = Path(__file__).resolve().parents[2]


def pretrained(tiny_args, tmp_path: Path, *extra: str) -> Path:
    """A training checkpoint (config and online weights) of the tiny run's network, as `make train` saves."""
    cfg = load_config(tiny_args("byol", tmp_path / "runs", *extra))
    torch.manual_seed(1)
    online = build_online(cfg, torch.device("cpu"))
    return checkpoint.save(tmp_path / "runs" / "run" / "checkpoint.pt",
                           {"config": to_dict(cfg), "online": online.state_dict(), "step": 3})


@pytest.fixture
def built_specs(monkeypatch) -> list:
    """The `LoaderSpec` of every loader the protocol builds, in order: the train loader (through
    `train.setup`'s shared-memory check), then the val loader."""
    from train import setup

    seen, real = [], protocol.build_loader
    for module in (setup, protocol):
        monkeypatch.setattr(module, "build_loader", lambda backend, spec: seen.append(spec) or real(backend, spec))
    return seen


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    """A data root holding `colours/`: 10 classes of 24 x 18 images, each class its own colour and pixel
    noise around it (the rehearsal's generator without its per-image shift), 40 train and 8 val a class."""
    from preprocess.__main__ import main as preprocess_main

    work = tmp_path_factory.mktemp("colours")
    write_folder(work / "src", 10, 400, 80, (24, 18), workers=1, shift_sd=0.0)
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(work / "src"), "--out", str(work / "data"),
                            "--name", "colours", "--workers", "1"]) == 0
    return work / "data"


def run_cli(*words: str, timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *words], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **popen)


def test_presets_resolve_by_method_and_size_and_bad_keys_are_one_line() -> None:
    assert load_protocol("linear", "auto", "relicv2", 1_281_167, [])[0] == "relicv2"
    assert load_protocol("linear", "auto", "uota:mocov2star", 1_281_167, [])[0] == "mocov2star"
    assert load_protocol("linear", "auto", "uota:byol", 1_281_167, [])[0] == "byol-uota"
    assert load_protocol("linear", "auto", "relicv2", 10_000, [])[0] == "small"
    name, p = load_protocol("finetune", "auto", "sdmp", 1_281_167, [("labels", "1%")])
    assert name == "simclr-1pct" and p.labels == "1%" and p.epochs == 60
    name, p = load_protocol("linear", "meanshift", "rsa", 10, [("epochs", "3"), ("lr", "0.5")])
    assert (p.epochs, p.lr, p.schedule, p.milestones, p.weight_decay) == (3.0, 0.5, "step", (15.0, 30.0), 1e-4)
    with pytest.raises(ConfigError, match=r"unknown linear key 'epoch'; valid keys: .*epochs"):
        load_protocol("linear", "small", "byol", 10, [("epoch", "3")])
    with pytest.raises(ConfigError, match=r"no linear preset 'nope'; choose one of .*byol"):
        load_protocol("linear", "nope", "byol", 10, [])
    with pytest.raises(ConfigError, match=r"'relicv2-1pct' is a fine-tuning preset; use it with python -m train finetune"):
        load_protocol("linear", "relicv2-1pct", "byol", 10, [])
    with pytest.raises(ConfigError, match=r"finetune needs labels=1%, labels=10% .* or labels=FILE"):
        load_protocol("finetune", "small-finetune", "byol", 10, [("labels", "5%")])


def test_schedules_follow_their_presets() -> None:
    _, step = load_protocol("linear", "mocov2", "rsa", 10, [])                 # lr 30, x0.1 at 60 and 80
    assert [lr_at(step, e * 10, 10) for e in (0, 59, 60, 79, 80, 99)] == pytest.approx([30, 30, 3, 3, 0.3, 0.3])
    _, cos = load_protocol("linear", "byol", "byol", 10, [("warmup_epochs", "1")])
    lrs = [lr_at(cos, s, 10) for s in range(800)]
    assert lrs[0] == pytest.approx(cos.lr / 10) and lrs[9] == pytest.approx(cos.lr) and lrs[-1] < 1e-6
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_the_labelled_share_is_class_balanced_seeded_and_refuses_an_empty_class() -> None:
    labels = torch.arange(10).repeat_interleave(torch.tensor([100, 120, 90, 100, 100, 100, 100, 100, 130, 60]))
    share = labelled_share(labels, "10%", 10, seed=0)
    counts = torch.bincount(labels[list(share)], minlength=10).tolist()
    assert counts == [10, 12, 9, 10, 10, 10, 10, 10, 13, 6] and list(share) == sorted(set(share))
    assert share == labelled_share(labels, "10%", 10, seed=0) != labelled_share(labels, "10%", 10, seed=1)
    with pytest.raises(ConfigError, match=r"labels=1% leaves class 9 without a labelled image \(it has 40"):
        labelled_share(torch.cat([labels[labels < 9], torch.full((40,), 9)]), "1%", 10, seed=0)


def test_linear_evaluation_leaves_the_backbone_bit_identical(tiny_args, tmp_path) -> None:
    ckpt = pretrained(tiny_args, tmp_path)
    state = checkpoint.load(ckpt)
    from train.resolve import config_from_dict

    cfg = config_from_dict(state["config"])
    _, p = load_protocol("linear", "small", cfg.method, 64, [("epochs", "2"), ("batch_size", "16"), ("bn", "true")])
    folder = tmp_path / "linear"
    result = Protocol("linear", "small", p, cfg, folder, state["online"]).run("torch", torch.device("cpu"))
    saved = checkpoint.load(folder / "checkpoint.pt")["model"]
    backbone = {k.removeprefix("backbone."): v for k, v in saved.items() if k.startswith("backbone.")}
    before = {k.removeprefix("backbone."): v for k, v in state["online"].items() if k.startswith("backbone.")}
    assert backbone.keys() == before.keys() and any("running_mean" in k for k in before)
    assert all(torch.equal(backbone[k], before[k]) for k in before)            # weights and BN statistics
    head = saved["head.1.weight"]
    assert not torch.equal(head, torch.zeros_like(head)) and 0 <= result["top1"] <= result["top5"] <= 1
    assert result["val_samples"] == 32


@pytest.mark.slow
def test_the_head_separates_classes_the_features_separate(colours, tmp_path) -> None:
    """Ten colours, the network at its initialisation: a linear head on its frozen features classifies
    the val images."""
    from train.resolve import load_config

    cfg = load_config(["method=simclr", "data=colours", f"data.root={colours}", "data.backend=torch",
                       "data.num_workers=1", "views.global_px=16", "views.local_px=8", "model.backbone=test_resnet",
                       f"run.out_dir={tmp_path}"])
    _, p = load_protocol("linear", "small", cfg.method, 400, [("epochs", "15"), ("batch_size", "64"), ("lr", "1.0")])
    result = Protocol("linear", "small", p, cfg, tmp_path / "linear", None).run("torch", torch.device("cpu"))
    assert result["top1"] >= 0.95 and result["val_samples"] == 80, result


def test_fine_tuning_trains_the_whole_network_on_its_labelled_share(tiny_args, tmp_path, built_specs) -> None:
    ckpt = pretrained(tiny_args, tmp_path)
    state = checkpoint.load(ckpt)
    from train.resolve import config_from_dict

    cfg = config_from_dict(state["config"])
    _, p = load_protocol("finetune", "small-finetune", cfg.method, 64, [("labels", "10%"), ("epochs", "2"),
                                                                         ("batch_size", "4")])
    Protocol("finetune", "small-finetune", p, cfg, tmp_path / "ft", state["online"]).run("torch", torch.device("cpu"))
    seen = built_specs
    from pipelines.spec import DatasetInfo

    labels = torch.from_numpy(DatasetInfo.read(cfg.data.root, cfg.data.name, "train").labels())
    assert seen[0].subset == labelled_share(labels, "10%", cfg.data.num_classes, 0) and seen[1].subset is None
    saved = checkpoint.load(tmp_path / "ft" / "checkpoint.pt")["model"]
    changed = [k for k, v in state["online"].items() if k.startswith("backbone.") and v.is_floating_point()
               and not torch.equal(saved[k], v)]
    assert any(k.endswith("weight") for k in changed)


@pytest.mark.ddp
def test_two_launched_ranks_read_and_score_every_record_once(tiny_args, tmp_path) -> None:
    """`gpus=2 linear`: the elastic launch of the protocol; each rank scores its shard of the val split and
    the counts are summed (every val record once). The steps themselves equal one process's on the
    whole batch: tests/train/test_ddp.py."""
    ckpt = pretrained(tiny_args, tmp_path)
    two = run_cli("gpus=2", "linear", f"ckpt={ckpt}", "preset=small", "epochs=1", "batch_size=16", "run.device=cpu")
    assert two.returncode == 0, two.stderr[-2000:]
    result = json.loads((ckpt.parent / "linear_eval.json").read_text())
    assert result["val_samples"] == 32 and 0 <= result["top1"] <= result["top5"] <= 1
    assert two.stdout.count("linear evaluation (small)") == 1             # rank 0 alone prints


@pytest.mark.slow
def test_a_killed_evaluation_resumes_to_the_uninterrupted_result(tiny_args, tmp_path) -> None:
    ckpt = pretrained(tiny_args, tmp_path)
    words = ["linear", f"ckpt={ckpt}", "preset=small", "epochs=6", "batch_size=16", "ckpt_every=3", "log_every=1",
             "run.device=cpu"]
    whole = run_cli(*words)
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = json.loads((ckpt.parent / "linear_eval.json").read_text())
    folder = ckpt.parent / "linear-small"
    reference = checkpoint.load(folder / "checkpoint.pt")["model"]
    for f in folder.iterdir():
        f.unlink()
    (ckpt.parent / "linear_eval.json").unlink()
    proc = subprocess.Popen([sys.executable, "-m", "train", *words], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (folder / "checkpoint.pt").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = checkpoint.load(folder / "checkpoint.pt")["step"]
    assert killed_at < 24 and not (ckpt.parent / "linear_eval.json").exists()
    again = run_cli(*words)
    assert again.returncode == 0 and f"resuming {folder} from step {killed_at}" in again.stdout, again.stdout[-2000:]
    got = json.loads((ckpt.parent / "linear_eval.json").read_text())
    assert (got["top1"], got["top5"]) == (expected["top1"], expected["top5"])
    assert all(torch.equal(v, reference[k]) for k, v in checkpoint.load(folder / "checkpoint.pt")["model"].items())
    third = run_cli(*words)                                                # finished: printed again, nothing trained
    assert third.returncode == 0 and "step " not in third.stdout and "top-1" in third.stdout


@pytest.mark.ddp
@pytest.mark.slow
def test_a_loader_worker_killed_on_one_of_two_ranks_saves_the_steps_and_one_process_continues(tiny_args,
                                                                                               tmp_path) -> None:
    """`gpus=2 linear`, rank 1's loader worker taken by the OOM killer, no checkpoint due (`ckpt_every=1000`):
    rank 1 saves the protocol's checkpoint of the steps reached by itself (before, nothing: the protocol
    went back to its last checkpoint); the same command on one process continues at that step (the
    epoch's rest in its one share, as the line says) to the end and the result."""
    from tests.processes import left_after, none_left_on_failure, start
    from tests.train.two_ranks import kill_workers_of_rank, logged_steps

    ckpt = pretrained(tiny_args, tmp_path)
    folder = ckpt.parent / "linear-small"
    words = ["linear", f"ckpt={ckpt}", "preset=small", "batch_size=16", "log_every=1", "ckpt_every=1000",
             "run.device=cpu"]
    run = start(["-m", "train", "gpus=2", *words, "epochs=100"])
    with none_left_on_failure(run.mark):             # a rank waiting for good would outlive a failure
        kill_workers_of_rank(run, 1, folder)
        assert run.wait(timeout=60) == 1
    assert run.stderr.read().startswith("error: DataLoader worker (pid")
    assert left_after(run.mark, 3.0) == []
    state = checkpoint.load(folder / checkpoint.LATEST)
    saved, logged = state["step"], max(logged_steps(folder))
    assert state["alone"] == 1 and 2 <= logged <= saved <= logged + 1           # rank 0 logs a step just after it
    assert f"a loader worker died: rank 1 saved the checkpoint of step {saved}\n" in run.stdout.read()

    epochs = saved // 4 + 2            # 4 steps of 16 on 64 records an epoch; the kill lands when the machine lets it
    again = run_cli(*words, f"epochs={epochs}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert (f"resuming {folder} from step {saved}; resuming step {saved} (saved by rank 1 alone, its loader worker "
            "dead; trained by 2 process(es), now 1; the same global batch 16): the rest of epoch") in again.stdout
    assert logged_steps(folder)[-(4 * epochs - saved):] == list(range(saved + 1, 4 * epochs + 1))
    assert json.loads((ckpt.parent / "linear_eval.json").read_text())["val_samples"] == 32


def signal_during_step(step: int, monkeypatch) -> None:
    """SIGUSR2 to this process during the protocol's step `step` (1-based), as SLURM warns a job."""
    real, calls = protocol.train_step, [0]

    def step_then_signal(*args):
        calls[0] += 1
        if calls[0] == step:
            os.kill(os.getpid(), signal.SIGUSR2)
        return real(*args)

    monkeypatch.setattr(protocol, "train_step", step_then_signal)


@pytest.fixture
def former_handler():
    """A recorder in the place of submitit's USR2 handler (which requeues the job and exits): "requeue"
    for each call; the handler before it is put back afterwards."""
    calls: list[str] = []
    previous = signal.signal(signal.SIGUSR2, lambda *_: calls.append("requeue"))
    yield calls
    signal.signal(signal.SIGUSR2, previous)


@pytest.mark.slow
def test_an_exception_in_a_protocol_step_ends_its_loader_workers_with_it(tiny_args, tmp_path, monkeypatch) -> None:
    """An exception out of a step (submitit's requeue raises one from the warning's handler) leaves no
    loader worker behind while it is still held, not until a garbage collection finds its traceback."""
    from tests.processes import pids_under, workers_of

    class Requeued(Exception):
        pass

    def step_fails(*args):
        raise Requeued()

    ckpt = pretrained(tiny_args, tmp_path)
    monkeypatch.setattr(protocol, "train_step", step_fails)
    before = pids_under(os.getpid())
    with pytest.raises(Requeued) as held:        # kept, with its traceback, to the end
        protocol.main("linear", [f"ckpt={ckpt}", "preset=small", "epochs=6", "batch_size=16", "run.device=cpu"])
    assert workers_of(os.getpid(), before) == [] and held.type is Requeued


@pytest.mark.slow
def test_a_held_signal_stops_the_evaluation_at_the_next_log_step_s_checkpoint(tiny_args, tmp_path, monkeypatch,
                                                                              former_handler, capsys) -> None:
    """`run.checkpoint_on_signal=USR2` (what launcher=slurm sets) caught during step 4 of 24: the steps go
    on to the next log step (6), save it and stop without a result; then the former handler runs, once;
    the same command continues at step 7 and ends with the uninterrupted evaluation's result."""
    ckpt = pretrained(tiny_args, tmp_path)
    other = checkpoint.save(tmp_path / "other" / "checkpoint.pt", checkpoint.load(ckpt))
    words = ["preset=small", "epochs=6", "batch_size=16", "ckpt_every=100", "log_every=3", "run.device=cpu",
             "run.checkpoint_on_signal=USR2"]
    expected = protocol.main("linear", [f"ckpt={other}", *words])
    signal_during_step(4, monkeypatch)
    assert protocol.main("linear", [f"ckpt={ckpt}", *words]) is None and former_handler == ["requeue"]
    folder = ckpt.parent / "linear-small"
    assert checkpoint.load(folder / "checkpoint.pt")["step"] == 6 and not (ckpt.parent / "linear_eval.json").exists()
    assert f"caught SIGUSR2: saved the checkpoint of step 6 in {folder} and stopped" in capsys.readouterr().out
    monkeypatch.undo()
    got = protocol.main("linear", [f"ckpt={ckpt}", *words])
    assert f"resuming {folder} from step 6" in capsys.readouterr().out
    assert (got["top1"], got["top5"]) == (expected["top1"], expected["top5"]) and former_handler == ["requeue"]


@pytest.mark.slow
def test_a_run_warned_in_its_linear_evaluation_continues_there_when_requeued(tiny_args, tmp_path, monkeypatch,
                                                                             former_handler, capsys) -> None:
    """`run.eval=linear` under SLURM (`run.resume=auto`, USR2): the warning during the linear protocol that
    follows pretraining saves the protocol's step and requeues; the requeued job's start finds the run
    trained but not evaluated, so it goes straight to the protocol's checkpoint (no pretraining step again)
    and writes the uninterrupted run's result; a third start has nothing to do."""
    from train.launch import train

    words = ["run.eval=linear", "run.resume=auto", "run.checkpoint_on_signal=USR2"]
    whole = json.loads((train(load_config(tiny_args("simclr", tmp_path / "a", *words))) / "linear_eval.json").read_text())
    cfg = load_config(tiny_args("simclr", tmp_path / "b", *words))
    signal_during_step(2, monkeypatch)
    run_dir = train(cfg)
    assert former_handler == ["requeue"] and not (run_dir / "linear_eval.json").exists()
    assert "caught SIGUSR2: saved the checkpoint of step 10" in capsys.readouterr().out     # its one log step
    monkeypatch.undo()
    train(cfg)
    out = capsys.readouterr().out
    assert "training simclr" not in out and f"resuming {run_dir / 'linear-small'} from step 10" in out
    got = json.loads((run_dir / "linear_eval.json").read_text())
    assert (got["top1"], got["top5"]) == (whole["top1"], whole["top5"])
    train(cfg)
    assert "nothing to do" in capsys.readouterr().out and former_handler == ["requeue"]


def test_a_dataset_written_from_an_image_folder_names_each_record_by_its_source_file(colours) -> None:
    """Record i's name is the file it was written from: the shard holds that file's JPEG bytes as they are
    (images under the size cap are not re-encoded) and the record's label is its class folder's."""
    from pipelines.schema import read_manifest
    from pipelines.shards import ShardReader
    from pipelines.spec import DatasetInfo

    src = colours.parent / "src"
    classes = read_manifest(colours / "colours").class_names
    for split, count in (("train", 400), ("val", 80)):
        info = DatasetInfo.read(colours, "colours", split)
        names, reader = info.names(), ShardReader.open(info.dir / split, info.count)
        assert len(names) == count == len(set(names))
        for i in range(0, count, 7):
            assert reader.image(i) == (src / names[i]).read_bytes(), (split, i, names[i])
            assert classes[int(reader.labels[i])] == Path(names[i]).parent.name


def test_a_list_of_file_names_picks_the_records_it_names_for_fine_tuning(colours, tmp_path, built_specs) -> None:
    """SimCLR's published lists name images by their base name (`n01440764_10026.JPEG`); a path as the
    dataset stored it works too; the fine-tuning loader reads exactly the listed records."""
    from pipelines.spec import DatasetInfo

    names = DatasetInfo.read(colours, "colours", "train").names()
    chosen = [3, 41, 42, 250, 399]
    listing = tmp_path / "subset.txt"
    listing.write_text("# a published subset\n" + "".join(f"{Path(names[i]).name}\n" for i in chosen[:3])
                       + f"\n{names[250]}\n  {Path(names[399]).name}  \n")
    assert listed_records(str(listing), names) == tuple(chosen)
    missing = tmp_path / "missing.txt"
    missing.write_text(f"{Path(names[0]).name}\nn01440764_10026.JPEG\n")
    with pytest.raises(ConfigError, match=r"1 of its 2 names are no train image .*'n01440764_10026.JPEG'"):
        listed_records(str(missing), names)
    dup = tmp_path / "dup.txt"
    dup.write_text("x.jpg\n")
    with pytest.raises(ConfigError, match=r"'x.jpg' is the name of 2 train images .*give its path"):
        listed_records(str(dup), ["a/x.jpg", "b/x.jpg"])

    cfg = load_config(["method=simclr", "data=colours", f"data.root={colours}", "data.backend=torch",
                       "data.num_workers=1", "views.global_px=16", "views.local_px=8", "model.backbone=test_resnet",
                       f"run.out_dir={tmp_path}"])
    name, p = load_protocol("finetune", "auto", cfg.method, 400, [("labels", str(listing)), ("epochs", "1"),
                                                                  ("batch_size", "4")])
    assert name == "small-finetune" and protocol.labels_tag(p.labels) == "list-subset"
    assert protocol.share_of(str(listing), 1_281_167) == "1pct" and protocol.share_of(str(listing), 100) == "10pct"
    Protocol("finetune", name, p, cfg, tmp_path / "ft", None).run("torch", torch.device("cpu"))
    assert built_specs[0].subset == tuple(chosen) and built_specs[1].subset is None


def test_bad_input_is_one_line_and_writes_nothing(tiny_args, tmp_path, capsys, monkeypatch) -> None:
    import shutil

    from pipelines import processes
    from train.__main__ import main

    ckpt = pretrained(tiny_args, tmp_path)
    before = sorted(p.name for p in ckpt.parent.iterdir())

    def fails(words: list[str], *needles: str) -> None:
        assert main(words) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert all(n in err for n in needles), err

    fails(["linear"], "linear needs the pretraining checkpoint: make linear CKPT=")
    fails(["linear", f"ckpt={ckpt}", "model.backbone=resnet50"], "trained with model.backbone=test_resnet")
    exported = checkpoint.save(tmp_path / "backbone.pt", {"conv1.weight": torch.zeros(1)})
    fails(["linear", f"ckpt={exported}"], "not a training checkpoint")
    fails(["finetune", f"ckpt={ckpt}", "labels=1%"], "labels=1% leaves class", "use a larger share")
    fails(["finetune", f"ckpt={ckpt}", f"labels={tmp_path / 'nope.txt'}"], "labels=FILE", "no such file")
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg\n")
    fails(["finetune", f"ckpt={ckpt}", f"labels={listing}"], "records no file names", "ARGS=--force")
    fails(["linear", f"ckpt={ckpt}", "epoch=3"], "unknown linear key 'epoch'")
    fails(["linear", f"ckpt={ckpt}", "compare=best"], "compare=random_init")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")                 # a small /dev/shm for 4 processes' loaders
    monkeypatch.setattr(processes.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 2**20))
    fails(["linear", f"ckpt={ckpt}", "preset=small", "batch_size=16", "data.num_workers=2", "run.device=cpu"],
          "the torch loaders of 4 process(es) (batch_size=16, 2 workers each) need about", "in /dev/shm, which has 1 MiB",
          "--shm-size=", "lower batch_size or data.num_workers")
    assert sorted(p.name for p in ckpt.parent.iterdir()) == before


def test_an_unlabelled_dataset_is_refused_in_one_line(tmp_path, capsys) -> None:
    import numpy as np
    from PIL import Image

    from preprocess.__main__ import main as preprocess_main
    from train.__main__ import main

    for i in range(60):
        d = tmp_path / "photos" / f"trip{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((20, 20, 3), i * 4, np.uint8)).save(d / f"{i}.jpg")
    assert preprocess_main(["--dataset", "imagefolder", "--src", str(tmp_path / "photos"), "--out", str(tmp_path / "data"),
                            "--name", "photos", "--workers", "1"]) == 0
    cfg = load_config(["method=simclr", "data=photos", f"data.root={tmp_path / 'data'}", "model.backbone=test_resnet",
                       f"run.out_dir={tmp_path / 'runs'}", "run.name=run"])
    ckpt = checkpoint.save(tmp_path / "runs" / "run" / "checkpoint.pt",
                           {"config": to_dict(cfg), "online": build_online(cfg, torch.device("cpu")).state_dict()})
    capsys.readouterr()
    assert main(["linear", f"ckpt={ckpt}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no labels, so there is nothing to classify" in err, err
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["checkpoint.pt"]


@pytest.mark.slow
def test_run_eval_linear_ends_pretraining_with_the_linear_evaluation(tiny_args, tmp_path, capsys) -> None:
    """`run.eval=linear`: the run, then the linear protocol on its last checkpoint (the short preset on
    small data, its batch cut to the 64 train records with a note)."""
    from train.launch import train

    cfg = load_config(tiny_args("simclr", tmp_path, "run.eval=linear"))
    run_dir = train(cfg)
    result = json.loads((run_dir / "linear_eval.json").read_text())
    assert result["preset"] == "small" and result["batch_size"] == 64 and result["val_samples"] == 32
    assert result["checkpoint"] == str(run_dir / "checkpoint.pt") and result["checkpoint_step"] == 3
    assert "note: batch_size 256 is more than the 64 labelled train records; 64" in capsys.readouterr().out
