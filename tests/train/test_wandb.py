"""`run.wandb=true`: W&B (offline mode) gets every TensorBoard scalar under the same name at the same step,
in a W&B run of the configured project named after the run folder, with the resolved config; without
the wandb package the run stops in one line naming the extra, before anything is written."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.test_train_cli import ROOT, fails_in_one_line

BLOCK = 32 * 1024                   # W&B's run file: LevelDB-log blocks of 32 KiB
HEADER = 7                          # `:W&B`, magic (2 bytes), version (1); each chunk: crc32, length, type


def wandb_records(path: Path) -> list:
    """The protobuf `Record`s of a W&B run file (`run-<id>.wandb`), in the order written. The file is a
    LevelDB-style log: a 7-byte file header, then chunks with a 7-byte header (crc32, length, type: 1 a whole
    record, 2/3/4 its first/middle/last part) that never cross a 32 KiB block (a shorter tail is padding)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, parts, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:                 # the block's padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        parts += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_history(records: list) -> dict[tuple[str, int], float]:
    """{(scalar name, step): value} of the history records (W&B's own `_step`, `_runtime`... left out)."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    out[key, r.history.step.num] = json.loads(item.value_json)
    return out


@pytest.mark.slow
def test_wandb_offline_gets_the_tensorboard_scalars(tiny_args, tmp_path, monkeypatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.launch import train
    from train.resolve import load_config

    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "config",
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(key, str(value))
    run = train(load_config(tiny_args("byol", tmp_path, "run.wandb=true", "run.wandb_project=ssl-tests")))
    [run_file] = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)

    [info] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (info.project, info.display_name) == ("ssl-tests", "run")
    config = {item.key: json.loads(item.value_json) for item in info.config.update}
    assert config["method"] == "byol" and config["run"]["wandb"] is True and config["optim"]["steps"] == 3

    events = EventAccumulator(str(run)).Reload()
    tensorboard = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert {("train/loss", 3), ("eval/knn_top1", 3), ("eval/random_init/rankme", 3)} <= set(tensorboard)
    history = wandb_history(records)
    assert history.keys() == tensorboard.keys()
    assert history == pytest.approx(tensorboard, rel=1e-6)      # TensorBoard keeps float32


def test_wandb_without_the_package_is_one_line_and_writes_nothing(tiny_args, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)                # not installed
    fails_in_one_line(capsys, tiny_args("byol", tmp_path / "runs", "run.wandb=true"),
                      "run.wandb=true needs the wandb package", "pip install 'viewmill[wandb]'")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_wandb_without_a_login_in_a_batch_job_is_one_line(tiny_args, tmp_path) -> None:
    """W&B online with no API key and no terminal to type one in (a batch job): one line naming the fixes,
    exit status 2, not W&B's traceback. A process of its own: W&B keeps its settings in the process once it
    has started (the offline test's mode would hold here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "home" / ".config"),
               PYTHONPATH=str(ROOT))                              # no ~/.netrc, no W&B settings
    done = subprocess.run([sys.executable, "-m", "train", *tiny_args("byol", tmp_path / "runs", "run.wandb=true")],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    for needle in ("error: run.wandb=true: W&B did not start", "wandb login", "WANDB_MODE=offline"):
        assert needle in err, err
