"""The streamed image-folder writer: one decode per image, resume after kills, changed sources, a full
disk, skips across shards, the Ray engine with a killed worker, two runs at once, progress lines."""

from __future__ import annotations

import errno
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import schema
from pipelines.schema import DatasetError, read_manifest
from pipelines.shards import ShardReader, scan_shards
from preprocess import imagefolder, stream
from preprocess.prepare import prepare_dataset
from preprocess.sources import PreprocessError
from preprocess.write_dali import ShardWriter
from tests.readers import _Beton, assert_table_is_the_scan

SHARD = 6                        # files per unit and shard: train (26 files) has 5 units, val (8) has 2
CAP = 40                         # max side: the 48-px images are re-encoded, the 32-px ones kept


def _folder(root: Path, seed: int = 0) -> Path:
    """26 train and 8 val JPEGs in 2 classes; every third one larger than CAP."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", 26), ("val", 8)):
        for i in range(n):
            d = root / split / f"c{i % 2}"
            d.mkdir(parents=True, exist_ok=True)
            side = 48 if i % 3 == 0 else 32
            Image.fromarray(rng.integers(0, 255, (side, side + 4, 3), np.uint8)).save(d / f"{i:03d}.jpg", quality=85)
    return root


def _contents(ds: Path) -> dict[str, list[tuple[int, int, bytes]]]:
    """(label, index, image bytes) of every record in both formats, checked to agree; the DALI view."""
    m = read_manifest(ds, verify="full")
    out = {}
    for split, n in m.counts.items():
        entries = scan_shards(ds / split, n)                # indices exactly 0..n-1, no duplicate
        reader = ShardReader(entries)
        dali = [(e.label, e.index, reader.image(e.index)) for e in entries]
        beton = _Beton(ds / f"{split}.beton")
        ffcv = [(int(beton.meta[schema.LABEL][i]), int(beton.meta[schema.INDEX][i]),
                 beton.bytes_at(beton.meta[schema.IMAGE][i]["data_ptr"]).tobytes()) for i in range(beton.num_samples)]
        assert ffcv == dali, f"{split}: the .beton does not hold the shards' records"
        assert_table_is_the_scan(ds / split, n)                 # the loaders' record table agrees
        out[split] = dali
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, dict]:
    """An uninterrupted run (2 workers) and its contents: what every resumed run must equal."""
    root = tmp_path_factory.mktemp("clean")
    src = _folder(root / "src")
    ds = prepare_dataset("imagefolder", root / "out", src=src, workers=2, shard_size=SHARD, max_side=CAP)
    return src, _contents(ds)


def _interrupt_at(monkeypatch, n: int, exc: BaseException, *, kill: bool = True) -> list[tuple[str, int]]:
    """Make the n-th record added to any shard raise `exc` (`kill`: leaving the partial shard behind
    as a kill does); returns the list of units that ran (appended to as they start)."""
    started: list[tuple[str, int]] = []
    real_run, real_add = stream.run_unit, ShardWriter.add
    count = [0]

    def run_unit(unit, policy):
        started.append((unit.split, unit.number))
        return real_run(unit, policy)

    def add(self, key, members):
        count[0] += 1
        if count[0] == n:
            raise exc
        real_add(self, key, members)

    monkeypatch.setattr(stream, "run_unit", run_unit)
    monkeypatch.setattr(ShardWriter, "add", add)
    if kill:
        monkeypatch.setattr(ShardWriter, "abort", lambda self: None)    # a kill runs no cleanup
    return started


def test_each_image_is_decoded_once_and_both_formats_hold_the_same_bytes(tmp_path: Path, clean, monkeypatch) -> None:
    src, expect = clean
    calls = []
    real = imagefolder.read_image
    monkeypatch.setattr(imagefolder, "read_image", lambda *a: calls.append(a[0]) or real(*a))
    ds = prepare_dataset("imagefolder", tmp_path, src=src, workers=1, shard_size=SHARD, max_side=CAP)
    assert sorted(calls) == sorted(str(p) for p in src.rglob("*.jpg"))       # every file once, no more
    assert _contents(ds) == expect                                             # 1 worker == 2 workers
    m = read_manifest(ds)
    kept = sum(v["as_is"] for v in m.build["images"].values())
    assert kept == sum(1 for p in src.rglob("*.jpg") if max(Image.open(p).size) <= CAP) == 22
    first = expect["train"][0][2]                                 # file 000 is 48 px: re-encoded to 40
    assert Image.open(io.BytesIO(first)).size == (40, 37)


def test_an_interrupted_run_resumed_twice_equals_a_clean_run(tmp_path: Path, clean, monkeypatch) -> None:
    src, expect = clean
    out = tmp_path / "out"
    run = lambda: prepare_dataset("imagefolder", out, src=src, workers=1, shard_size=SHARD, max_side=CAP)  # noqa: E731
    first = _interrupt_at(monkeypatch, 10, KeyboardInterrupt())           # in the 2nd unit
    with pytest.raises(KeyboardInterrupt):
        run()
    for folder in (out / "imagefolder", out / ".imagefolder.staging"):    # nothing a reader accepts
        with pytest.raises(DatasetError):
            read_manifest(folder)
    monkeypatch.undo()
    second = _interrupt_at(monkeypatch, 15, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()
    third = _interrupt_at(monkeypatch, 10 ** 9, KeyboardInterrupt())       # never: runs to the end
    ds = run()
    assert len(first) == 2 and first[0] not in second + third              # the finished unit was kept
    assert not set(second[:-1]) & set(third)                               # ... and so were the next ones
    assert len(set(first[:1] + second[:-1] + third)) == 7                  # every unit finished once
    assert _contents(ds) == expect
    assert read_manifest(ds).build["resumed_units"] == len(first) - 1 + len(second) - 1
    assert not (ds / stream.PARTS).exists() and not (ds / stream.PLAN_NAME).exists()


def test_a_source_file_changed_before_the_resume_is_read_again(tmp_path: Path, monkeypatch) -> None:
    src = _folder(tmp_path / "src")
    out = tmp_path / "out"
    run = lambda: prepare_dataset("imagefolder", out, src=src, workers=1, shard_size=SHARD, max_side=CAP)  # noqa: E731
    _interrupt_at(monkeypatch, 20, KeyboardInterrupt())                   # units 0-2 of one split finished
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()
    changed = sorted((src / "train").rglob("*.jpg"))[1]                    # in train unit 0 (c0/002.jpg)
    new = np.full((30, 30, 3), 200, np.uint8)
    Image.fromarray(new).save(changed, quality=95)
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10 ** 9))      # mtime moves even within a tick
    again = _interrupt_at(monkeypatch, 10 ** 9, KeyboardInterrupt())
    ds = run()
    assert ("train", 0) in again
    records = _contents(ds)["train"]
    assert changed.read_bytes() in [b for _, _, b in records]              # the new file, byte for byte


def test_a_full_disk_during_a_shard_keeps_no_partial_shard_and_the_rerun_finishes(tmp_path: Path, clean,
                                                                                   monkeypatch) -> None:
    src, expect = clean
    out = tmp_path / "out"
    run = lambda: prepare_dataset("imagefolder", out, src=src, workers=1, shard_size=SHARD, max_side=CAP)  # noqa: E731
    started = _interrupt_at(monkeypatch, 9, OSError(errno.ENOSPC, "No space left on device"), kill=False)
    with pytest.raises(PreprocessError) as e:
        run()
    msg = str(e.value)
    assert "\n" not in msg and "disk is full" in msg and "re-run the same command to resume" in msg
    parts = out / ".imagefolder.staging" / stream.PARTS / started[-1][0]
    failed = schema.SHARD_PATTERN.format(started[-1][1])
    assert not (parts / failed).exists() and not list(parts.glob(".*"))   # no partial shard, no temporary
    assert len(list(parts.glob("*.json"))) == len(started) - 1             # the finished ones are kept
    monkeypatch.undo()
    assert _contents(run()) == expect


@pytest.mark.slow
def test_workers_forked_after_opencv_started_its_threads_do_not_hang(tmp_path: Path, clean) -> None:
    """A forked child that changes OpenCV's thread count while the parent's pool exists deadlocks; the
    engine sets it in the parent before forking (this hung the test suite once)."""
    src, expect = clean
    script = (
        "import sys, cv2, numpy as np\n"
        "from preprocess.prepare import prepare_dataset\n"
        "a = np.random.rand(1500, 1500).astype(np.float32)\n"
        "[cv2.GaussianBlur(a, (31, 31), 5) for _ in range(3)]   # OpenCV's thread pool, in the parent\n"
        f"prepare_dataset('imagefolder', sys.argv[1], src='{src}', workers=2, shard_size={SHARD}, max_side={CAP})\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _contents(tmp_path / "imagefolder") == expect


_run_unit = stream.run_unit


def _dies_in_train_unit_1(unit, policy):
    """A unit function whose worker process is killed (as by the out-of-memory killer) on train unit 1."""
    if (unit.split, unit.number) == ("train", 1):
        os.kill(os.getpid(), signal.SIGKILL)
    return _run_unit(unit, policy)


def test_a_local_worker_that_dies_stops_the_run_in_one_line_and_the_rerun_resumes(tmp_path: Path, clean,
                                                                                   monkeypatch) -> None:
    src, expect = clean
    run = lambda: prepare_dataset("imagefolder", tmp_path, src=src, workers=2, shard_size=SHARD, max_side=CAP)  # noqa: E731
    monkeypatch.setattr(stream, "run_unit", _dies_in_train_unit_1)
    with pytest.raises(PreprocessError) as e:
        run()
    assert "\n" not in str(e.value) and "a worker process died" in str(e.value) and "resume" in str(e.value)
    monkeypatch.undo()
    assert _contents(run()) == expect


def test_skipped_files_renumber_the_later_shards(tmp_path: Path, clean) -> None:
    src, _ = clean
    bad = tmp_path / "src"
    shutil.copytree(src, bad)
    train = sorted((bad / "train").rglob("*.jpg"))
    train[0].write_bytes(b"")                                              # unit 0
    for f in train[6:12]:
        f.write_bytes(b"not a jpeg")                                       # all of unit 1: no shard
    ds = prepare_dataset("imagefolder", tmp_path / "out", src=bad, workers=2, shard_size=SHARD, max_side=CAP)
    m = read_manifest(ds)
    assert m.counts["train"] == 26 - 7 and len(m.skipped) == 7
    assert len(m.formats["dali"]["train"]) == 4                            # 5 units, one all skipped
    records = _contents(ds)["train"]                                       # indices 0..18, both formats agree
    good = [f for k, f in enumerate(train) if k != 0 and not 6 <= k < 12]
    assert [lab for lab, _, _ in records] == [int(f.parent.name[1]) for f in good]
    for (_, _, data), f in zip(records, good):
        if max(Image.open(f).size) <= CAP:
            assert data == f.read_bytes()                                  # each file at its new index
    names = (ds / "train" / "names.txt").read_text().splitlines()        # each record's source, skips left out
    assert names == [f.relative_to(bad).as_posix() for f in good]


def test_another_plan_or_force_starts_over(tmp_path: Path, clean, monkeypatch, capsys) -> None:
    src, _ = clean
    out = tmp_path / "out"
    _interrupt_at(monkeypatch, 10, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("imagefolder", out, src=src, workers=1, shard_size=SHARD, max_side=CAP)
    monkeypatch.undo()
    started = _interrupt_at(monkeypatch, 10 ** 9, KeyboardInterrupt())
    prepare_dataset("imagefolder", out, src=src, workers=1, shard_size=SHARD, max_side=CAP, force=True)
    assert len(started) == 7 and "left by an interrupted run" in capsys.readouterr().err


def test_progress_says_one_line_per_split_without_a_terminal(tmp_path: Path, clean, capfd) -> None:
    src, _ = clean
    prepare_dataset("imagefolder", tmp_path, src=src, workers=1, shard_size=SHARD, max_side=CAP, progress=True)
    err = capfd.readouterr().err.splitlines()
    assert [ln.split(":")[0] for ln in err if ln.startswith(("train:", "val:"))] in (["train", "val"], ["val", "train"])
    assert any(ln.startswith("train: 26 images, 26 stored (") and "0 skipped" in ln for ln in err)


@pytest.mark.slow
def test_two_runs_at_once_the_second_refuses_in_one_line(tmp_path: Path, clean) -> None:
    src, expect = clean
    cmd = [sys.executable, "-m", "preprocess", "--dataset", "imagefolder", "--src", str(src), "--out",
           str(tmp_path), "--workers", "1", "--shard-size", str(SHARD), "--max-side", str(CAP)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".imagefolder.lock"
    try:
        deadline = time.time() + 60
        while not (lock.exists() and lock.read_text().split()[:1] == [str(first.pid)]) and time.time() < deadline:
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGSTOP)                                 # hold it mid-run
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2
    assert second.stderr.strip().count("\n") == 0
    assert f"another run (pid {first.pid}: {sys.executable} -m preprocess --dataset imagefolder" in second.stderr
    assert f"is writing imagefolder into {tmp_path}; wait for it to finish or stop it with `kill {first.pid}`" in second.stderr
    assert first.wait(timeout=120) == 0, first.stderr
    assert _contents(tmp_path / "imagefolder") == expect


@pytest.mark.slow
def test_the_ray_engine_writes_the_same_dataset_and_redoes_a_killed_worker_s_shard(tmp_path: Path, clean) -> None:
    pytest.importorskip("ray")
    from preprocess.ray_engine import RayEngine

    src, expect = clean
    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def dies_once(unit, policy):
        """Unit train/2 writes half a shard, then its worker is killed; the retry runs normally."""
        if (unit.split, unit.number) == ("train", 2):
            (attempts / f"{os.getpid()}").touch()
            if len(list(attempts.iterdir())) == 1:
                tmp = Path(policy.parts) / "train" / f".{schema.SHARD_PATTERN.format(2)}.tmp"
                tmp.write_bytes(b"\0" * 4096)
                os.kill(os.getpid(), signal.SIGKILL)
        return stream.run_unit(unit, policy)

    try:
        ds = prepare_dataset("imagefolder", tmp_path / "out", src=src, shard_size=SHARD, max_side=CAP,
                             engine=RayEngine(2, unit_fn=dies_once))
    finally:
        import ray
        ray.shutdown()
    assert len(list(attempts.iterdir())) == 2                              # killed once, redone once
    assert _contents(ds) == expect                                         # no duplicate, no missing index
    assert read_manifest(ds).build["engine"] == "ray"


@pytest.mark.parametrize("root", ["/data/imagenet", "/data/imagenet/", "data/imagenet", "."])
def test_record_names_are_the_paths_relative_to_the_source_as_relpath_gives_them(root: str) -> None:
    paths = ["/data/imagenet/train/n01/a.JPEG", "data/imagenet/val/n02/b.JPEG", "/elsewhere/c.png",
             "/data/imagenet-2/train/d.jpg", "data/imagenet/train/n01/ä é.jpg"]
    assert stream.relative(paths, Path(root)) == [os.path.relpath(p, root) for p in paths]
