"""A run under a user's limits: more shards than it may open files (every backend that reads shards
trains on them), a soft limit below what it needs (raised for it and its children), a hard limit below
that or too little /dev/shm (one line naming what to set, nothing written), a disk that fills up (one
line, the last checkpoint whole), and the workers each process gets by default."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines import loader, processes
from pipelines.processes import LimitError, check_shared_memory, descriptors_needed

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 336          # train records, one per shard: more than the 256 open files the runs below may hold


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> Path:
    """A data root holding `synthetic/` of 16 px with SHARDS train and 32 val shards of one record each."""
    from preprocess.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("shards")
    prepare_dataset("synthetic", root, workers=1, train_size=SHARDS, val_size=32, image_px=16, seed=0, shard_size=1)
    return root


def nofile(soft: int, hard: int):
    """A `preexec_fn` that starts the child under these open-file limits (`ulimit -n soft`, `-Hn hard`)."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def train_words(root: Path, out: Path, backend: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "method=simclr", "data=synthetic", f"data.root={root}",
            f"data.backend={backend}", "data.batch_size=16", "data.num_workers=1", "views.global_px=16",
            "views.local_px=8", "model.backbone=test_resnet", "model.proj_hidden=32", "model.proj_out=16",
            "model.pred_hidden=0", f"optim.steps={SHARDS // 16}", "optim.warmup_steps=1", "run.log_every=7",
            "run.max_eval_samples=0", f"run.out_dir={out}", "run.name=run", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "torchvision", "dali"])
def test_a_run_over_more_shards_than_its_open_files_trains_and_evaluates(backend, many_shards, tmp_path) -> None:
    """An epoch (every train shard read in a shuffled order) and the evaluations (every train and val
    record in index order) under `ulimit -n 256`, soft and hard: each shard reader holds a bounded number
    of descriptors, where one per shard ran out of files."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    done = subprocess.run(train_words(many_shards, tmp_path, backend), cwd=ROOT, capture_output=True, text=True,
                          timeout=600, preexec_fn=nofile(256, 256))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {SHARDS // 16}/{SHARDS // 16}" in done.stdout
    assert (tmp_path / "run" / "backbone.safetensors").is_file()


def test_a_soft_limit_below_the_need_is_raised_to_the_hard_limit_for_the_process_and_its_children() -> None:
    probe = ("import resource, subprocess; from pipelines.processes import ensure_open_files; "
             "print(ensure_open_files(300, 'this test')); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0]); "
             "print(subprocess.run(['sh', '-c', 'ulimit -n'], capture_output=True, text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         preexec_fn=nofile(64, 4096), check=True).stdout.split()
    assert out == ["4096", "4096", "4096"]
    unchanged = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                               preexec_fn=nofile(512, 4096), check=True).stdout.split()
    assert unchanged == ["512", "512", "512"]                            # enough already: left as it was


def test_a_hard_limit_below_the_need_stops_the_run_in_one_line_before_anything_is_written(tiny_data_root,
                                                                                        tmp_path) -> None:
    need = descriptors_needed(workers=2, readers=2)                      # one worker a loader, one process
    words = train_words(tiny_data_root, tmp_path / "runs", "torch")
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=nofile(need - 20, need - 20))
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"this run needs {need} open files per process" in err and f"ulimit -n {need}" in err
    assert not (tmp_path / "runs").exists()
    pre = subprocess.run([sys.executable, "-m", "preprocess", "--dataset", "synthetic", "--out", str(tmp_path / "d"),
                          "--train-size", "8", "--val-size", "2", "--workers", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, preexec_fn=nofile(64, 64))
    err = pre.stderr.strip()
    assert pre.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: preprocessing needs {descriptors_needed(workers=2)} open files"), err
    assert not (tmp_path / "d").exists()


def test_too_little_shared_memory_stops_the_run_in_one_line_naming_the_size(tiny_args, tmp_path, monkeypatch) -> None:
    """The check itself, then a run's: every process of the run on this machine counts twice its training
    loader's need (an evaluation loader beside it), against what /dev/shm has free."""
    free = shutil.disk_usage(tmp_path).free
    check_shared_memory(free // 2, "a test", "need less", path=str(tmp_path))
    with pytest.raises(LimitError, match=r"^a test need about .* of shared memory in .*, which has .* free; give the "
                                         r"container more \(docker run --shm-size=\d+g.* or need less$"):
        check_shared_memory(free + 2**30, "a test", "need less", path=str(tmp_path))

    from pipelines.spec import LoaderSpec
    from pipelines.views import load_recipe
    from train.resolve import load_config
    from train.setup import build_train_loader

    cfg = load_config(tiny_args("simclr", tmp_path, "data.num_workers=2"))
    recipe = load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px)
    spec = LoaderSpec(root=cfg.data.root, dataset=cfg.data.name, split="train", recipe=recipe, batch_size=16,
                      num_workers=2)
    need = loader.shared_memory_bytes("torch", spec)
    assert need == 2 * 2 * 16 * 2 * 3 * 32 * 32 * 4                      # 2 workers x 2 ahead x 16 x 2 float views
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    seen = []
    monkeypatch.setattr(processes.shutil, "disk_usage", lambda path: seen.append(path) or
                        shutil._ntuple_diskusage(2**30, 2**30 - 4 * 2 * need + 1, 4 * 2 * need - 1))
    with pytest.raises(LimitError, match=r"the torch loaders of 4 process\(es\) .* lower data.batch_size or "
                                         r"data.num_workers"):
        build_train_loader(cfg, recipe, "torch", torch.device("cpu"))
    assert seen == [processes.SHM]
    # a DALI graph run of several training batches holds them all: the line names that setting too
    monkeypatch.setattr(processes.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 0))
    runs = load_config(tiny_args("simclr", tmp_path, "data.num_workers=2", "data.graph_batches=2"))
    with pytest.raises(LimitError, match=r"lower data.batch_size, data.num_workers or data.graph_batches$"):
        build_train_loader(runs, recipe, "dali", torch.device("cpu"))


def in_own_mounts(script: str, folder: Path, words: list[str]) -> subprocess.CompletedProcess:
    """`sh -c script folder python -m train words...` in a mount namespace of its own (skipped where this
    user cannot have one: unshare --mount needs root, or user namespaces), one thread per process."""
    unshare = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    if shutil.which("unshare") is None or subprocess.run([*unshare, "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace of its own (unshare --mount: root, or user namespaces)")
    return subprocess.run([*unshare, "sh", "-c", script, str(folder), sys.executable, "-m", "train", *words],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)


# In a mount namespace of its own: an 8 MiB filesystem at $0, then the command, its status, what is left in
# its run folder and whether the checkpoint there is whole (a zip file: every CRC), before the filesystem
# ends with the namespace.
FULL_DISK = ('mount -t tmpfs -o size=8m tmpfs "$0" || exit 99; "$@"; echo "status $?"; ls -A "$0/run"; "$1" -c '
             '"import sys, zipfile; print(\'whole\', zipfile.ZipFile(sys.argv[1]).testzip() is None)" '
             '"$0/run/checkpoint.pt"')


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_last_checkpoint_whole(tiny_args, tmp_path) -> None:
    """The run folder's disk fills up: a checkpoint of the test network takes 6 MiB, so on 8 MiB the one
    of step 2 is written and the one of step 4 does not fit beside it. The run ends with status 1 and one
    line naming the error, the folder and what to do (it was torch's traceback "unexpected pos ...",
    which did not say that the disk was full); the checkpoint of step 2 is whole and no temp file is left.
    The first step already warned that the disk would not hold two checkpoints, and the save of step 2
    that the next one would not fit."""
    out = tmp_path / "small"
    out.mkdir()
    done = in_own_mounts(FULL_DISK, out, tiny_args("byol", out, "optim.steps=6", "run.ckpt_every=2", "run.eval=none"))
    lines = done.stdout.splitlines()
    assert "status 1" in lines, done.stdout + done.stderr
    left = lines[lines.index("status 1") + 1:]
    assert left[-1] == "whole True" and "checkpoint.pt" in left and not any(".tmp" in name for name in left)
    assert "step 4/6" in done.stdout and "step 5/6" not in done.stdout     # the checkpoint of step 2 fitted
    # ... and not the next one beside it: said after the first step, from the size of the state in memory,
    # before any checkpoint, and again at the checkpoint of step 2, from its file
    first, again = [ln for ln in lines if ln.startswith("warning: ")]
    assert lines.index(first) < lines.index(next(ln for ln in lines if ln.startswith("step 1/6")))
    assert lines.index(again) < lines.index(next(ln for ln in lines if ln.startswith("step 3/6")))
    said = [re.search(rf"MiB free on the disk of {out / 'run'}, and the checkpoints to come need ([0-9]+) MiB more "
                      r"\(([0-9]+) MiB each: run.keep_last=1 ", line) for line in (first, again)]
    (need_first, each_first), (need_again, each_again) = [(int(m[1]), int(m[2])) for m in said]
    assert each_again == need_again == 6                      # the checkpoint of step 2 on disk, the next beside it
    assert abs(each_first - 6) <= 1 and abs(need_first - 12) <= 1   # from the state in memory, in whole MiB
    assert "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: No space left on device in {out / 'run'}: what was written before is whole")
    assert "run.out_dir on another disk" in line and "run.resume=auto continues" in line


# In a mount namespace of its own: $0 read-only (a bind mount of itself), then the command and its status.
READ_ONLY = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" || exit 99; "$@"; echo "status $?"'


@pytest.mark.slow
def test_a_run_folder_on_a_read_only_disk_is_one_line_naming_it(tiny_args, tmp_path) -> None:
    """`run.out_dir` on a read-only disk (or another user's folder): one line naming the folder and what
    to give instead, status 2 (it was an `OSError` traceback from the folder's creation)."""
    out = tmp_path / "shared"
    out.mkdir()
    done = in_own_mounts(READ_ONLY, out, tiny_args("byol", out, "run.eval=none"))
    assert "status 2" in done.stdout.splitlines(), done.stdout + done.stderr
    assert done.stderr.strip() == (f"error: {out / 'run'} cannot be written (Read-only file system: {out}/.run.lock); "
                                   "give run.out_dir a folder this user can write")


@pytest.mark.parametrize("loop", ["pretraining", "linear"])
def test_a_disk_too_small_for_the_checkpoints_is_told_after_the_first_step(loop, tiny_args, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    """Both training loops, on a disk with 1 MiB free: a line after the first step, before any checkpoint,
    says so, with each checkpoint's size taken from the state in memory (the saved file's to the MiB).
    Before, the first word came at the first checkpoint: `run.ckpt_every_min` (30) minutes in."""
    from train import checkpoint
    from train.launch import train
    from train.protocol import Protocol, load_protocol
    from train.resolve import config_from_dict, load_config

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=2**20)
                        if str(path).startswith(str(tmp_path)) else real(path))
    words = tiny_args("byol", tmp_path, "optim.steps=2", "run.ckpt_every=2", "run.eval=none")
    folder = train(load_config(words))
    if loop == "linear":
        state = checkpoint.load(folder / checkpoint.LATEST)
        cfg = config_from_dict(state["config"])
        _, p = load_protocol("linear", "small", cfg.method, 64, [("epochs", "1"), ("batch_size", "16"),
                                                                     ("log_every", "1")])
        folder = tmp_path / "linear"
        capsys.readouterr()
        Protocol("linear", "small", p, cfg, folder, state["online"]).run("torch", torch.device("cpu"))
    lines = capsys.readouterr().out.splitlines()
    short = next(ln for ln in lines if ln.startswith("warning: ") and "checkpoints to come" in ln)
    assert lines.index(short) < lines.index(next(ln for ln in lines if ln.startswith("step 1/")))
    each = int(re.search(r"MiB more \(([0-9]+) MiB each", short)[1])
    assert short.startswith(f"warning: 1 MiB free on the disk of {folder}") and each > 0
    assert each == round((folder / checkpoint.LATEST).stat().st_size / 2**20)


def test_the_workers_default_to_each_process_s_share_of_the_cores_at_most_the_measured_best(monkeypatch) -> None:
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert loader.default_workers("ffcv", "cpu") == 16
    assert loader.default_workers("torch", "cuda", 8) == 2                # an 8-GPU node of 16 cores
    assert loader.default_workers("dali", "cuda", 1) == 4                 # DALI on a GPU: best at 4
    assert loader.default_workers("dali", "cuda", 8) == 2
    assert loader.default_workers("dali", "cpu", 2) == 8                  # the CPU graph uses every core it gets
    assert loader.default_workers("torch", "cuda", 32) == 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")                         # SLURM gave each task its cores
    assert loader.default_workers("torch", "cuda", 8) == 6 and loader.default_workers("dali", "cuda", 8) == 4

    from train.config import ConfigError
    from train.resolve import load_config
    from train.setup import loader_workers

    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = load_config(["method=simclr", "data=imagenet"])
    assert cfg.data.num_workers == "auto"
    assert loader_workers(cfg, "dali", torch.device("cuda")) == 4 and loader_workers(cfg, "torch", torch.device("cpu")) == 4
    assert loader_workers(load_config(["method=simclr", "data=imagenet", "data.num_workers=3"]), "dali",
                          torch.device("cuda")) == 3
    for bad in ("-1", "some", "1.5"):
        with pytest.raises(ConfigError, match=r"data.num_workers=.*: give a number of workers .* or auto"):
            load_config(["method=simclr", "data=imagenet", f"data.num_workers={bad}"])
