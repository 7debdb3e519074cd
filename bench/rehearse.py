"""`python -m bench.rehearse` (`make rehearse`): ImageNet's shape rehearsed on one machine, with tiny
pixels. What is counted per record or per shard is at full size; only the images are small.

1. `folder`: an image folder of ImageNet's shape, `train/n<class>/*.JPEG` and `val/n<class>/*.JPEG`:
   1,000 classes, 1,281,167 train and 50,000 val images (per class 1,281 or 1,282 and 50), each a JPEG
   of `--image-px` (24 x 18 by default) coloured by its class and shifted per image, so that 1,000
   classes are separable but not trivially; written once and reused (a stamp file).
2. `preprocess`: `python -m preprocess --dataset imagefolder` on it at the default shard size (1,282
   train shards), timed, every process watched.
3. `train`: `python -m train gpus=<ranks> run.device=cpu` on the `imagenet` preset with a tiny network
   and 8-px views past one epoch (its boundary crossed), the DALI graph on the CPU: after `--kill-rank-at`
   steps one rank is killed with SIGKILL, the same command resumes (`run.resume=auto`); halfway to the
   next kill every rank and its loader workers get SLURM's preemption (SIGUSR2 and SIGTERM at once, held
   by `run.checkpoint_on_signal=USR2+TERM`, as `launcher=slurm` sets, until the ranks save the step they
   reached), and the same command
   resumes; past the boundary the whole process group is killed, and the same command runs to the end
   and evaluates with 1,000 classes. For each start: the time to its first step, the
   random-init evaluation; for each process: its peak open files, RSS and PSS, rank by rank and for each
   loader worker; the ranks' PSS over the steps (memory that grows with the epoch would show).
4. `protocols`: the papers' protocols (`python -m train gpus=<ranks> linear|finetune`) on the training
   stage's checkpoint, the DALI graph on the CPU: the linear evaluation with the method's preset for
   a share of an epoch, warned by SLURM's signal midway (every rank and its workers; the protocol must
   hold the checkpoint of the step it reached) and resumed by the same command, then scored on the
   50,000 val records; fine-tuning on 1 % of the labels drawn per class, and on a file listing 1 % of
   the train images by name (as SimCLR's `1percent.txt`), each to its end.
5. `backends`: 20 steps on every backend (ffcv, dali, torch, torchvision) on the same 1,282 shards.
6. `saliency`: `python -m preprocess.saliency` on a slice of the folder (its first 10 classes, 10
   records a shard: 1,282 shards of the slice's 12,810 train records).

Every command runs under `ulimit -n 1024` (soft and hard, Ubuntu's default and many clusters'), as a
user's would. Results: `<work>/rehearsal.json` and `reports/rehearsal/report.md`, with the figures
scaled to full-size images for a stated 8-GPU node (`full_size`: computed, not measured). `--scale`
shrinks every count (a quick run, the test), `--stages` picks stages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from bench.report import header, header_lines
from pipelines import schema
from pipelines.errors import bad_input
from pipelines.processes import descendants, fork_context

IMAGENET = {"classes": 1000, "train": 1_281_167, "val": 50_000}
IMAGENET_RECORDS = IMAGENET["train"] + IMAGENET["val"]
STAGES = ("folder", "preprocess", "train", "protocols", "backends", "saliency")
NOFILE = 1024                   # the open-file limit every command runs under (soft and hard)
NAME = "imagenet-rehearsal"
SLICE_CLASSES, SLICE_SHARD = 10, 10


class RehearsalError(RuntimeError):
    """A stage that did not end as it should; the message names the stage and its output."""


# ----------------------------------------------------------------------------- the folder


def class_counts(total: int, classes: int) -> list[int]:
    """Images per class: `total` spread as evenly as whole numbers allow, the remainder to the first."""
    return [total // classes + (c < total % classes) for c in range(classes)]


def _write_class(job: tuple) -> None:
    root, split, c, count, (w, h), seed, shift_sd = job
    folder = root / split / f"n{c:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, c, split == "val"])
    colour = np.random.default_rng([seed, c]).uniform(40, 215, 3)       # the class's colour
    for i in range(count):
        shift = rng.normal(0, shift_sd, 3)                                # per image: classes overlap
        pixels = np.clip(colour + shift + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"n{c:08d}_{i}.JPEG", quality=schema.JPEG_QUALITY)


def write_folder(src: Path, classes: int, train: int, val: int, image_px: tuple[int, int], workers: int,
                 seed: int = 0, shift_sd: float = 25.0) -> float:
    """The image folder of stage 1 under `src` (skipped when its stamp says it is there); returns the
    seconds it took (0 when skipped). `shift_sd`: the std of each image's colour shift off its class's
    colour, in levels (0: classes apart by their colours alone)."""
    stamp = src / ".complete"
    key = f"{classes} {train} {val} {tuple(image_px)} {seed}" + (f" shift {shift_sd}" if shift_sd != 25.0 else "")
    if stamp.is_file() and stamp.read_text() == key:
        return 0.0
    began = time.perf_counter()
    jobs = [(src, split, c, n, tuple(image_px), seed, shift_sd) for split, total in (("train", train), ("val", val))
            for c, n in enumerate(class_counts(total, classes))]
    with ProcessPoolExecutor(workers, mp_context=fork_context()) as pool:
        list(pool.map(_write_class, jobs, chunksize=8))
    stamp.write_text(key)
    return time.perf_counter() - began


# ----------------------------------------------------------------------------- watching a command


@dataclass
class Peak:
    role: str
    fds: int = 0
    rss_mib: float = 0.0
    pss_mib: float = 0.0


@dataclass
class Watched:
    """What a watched command did: exit status, seconds, its lines (with the second each arrived), the
    peak of every process it started, and the ranks' PSS over the steps."""

    returncode: int | None = None
    seconds: float = 0.0
    lines: list[tuple[float, str]] = field(default_factory=list)
    peaks: dict[int, Peak] = field(default_factory=dict)
    rank_pss: list[tuple[int, float]] = field(default_factory=list)    # (last step logged, sum of the ranks' PSS MiB)
    step: int = 0                       # the last step logged
    total: int = 0                      # of how many

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _sample(pid: int) -> tuple[int, float, float] | None:
    """(open files, RSS MiB, PSS MiB) of a process, None once it is gone."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        kb = {line.split(":")[0]: int(line.split()[1]) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
              if len(line.split()) > 1 and line.split()[1].isdigit()}
        return fds, kb.get("Rss", 0) / 1024, kb.get("Pss", 0) / 1024
    except (OSError, ValueError):
        return None


def _role(pid: int, root: int, ranks: dict[int, str]) -> str:
    """"main" (the command's process), "rank k" (a process with LOCAL_RANK k), or "<parent role> worker"."""
    if pid == root:
        return "main"
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "gone"
    local = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LOCAL_RANK=")), None)
    if local is not None and parent == root:
        return f"rank {local}"
    above = ranks.get(parent) or _role(parent, root, ranks)
    return above if above.endswith("worker") else f"{above} worker"


def watch(cmd: list[str], *, stop_when=None, kill=None, timeout_s: float = 7200, cwd: Path | None = None) -> Watched:
    """Run `cmd` in a process group of its own under `ulimit -n NOFILE`, reading its output line by line
    and sampling every process it starts twice a second. `stop_when(watched)`, once true, calls
    `kill(proc, watched)` (a rank or the whole group killed) once."""
    w = Watched()
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            preexec_fn=_limits, start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            w.lines.append((time.perf_counter() - began, line))
            if m := re.match(r"step (\d+)/(\d+) \|", line):
                w.step, w.total = int(m.group(1)), int(m.group(2))
            print(f"  | {line}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    roles: dict[int, str] = {}
    killed = False
    while proc.poll() is None:
        if time.perf_counter() - began > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RehearsalError(f"{' '.join(cmd[:4])} ran past {timeout_s:.0f} s; its output is above")
        ranks_pss = 0.0
        for pid, _ in [(proc.pid, "")] + sorted(descendants(proc.pid)):
            if pid not in roles:
                roles[pid] = _role(pid, proc.pid, roles)
            got = _sample(pid)
            if got is None:
                continue
            p = w.peaks.setdefault(pid, Peak(roles[pid]))
            p.fds, p.rss_mib, p.pss_mib = max(p.fds, got[0]), max(p.rss_mib, got[1]), max(p.pss_mib, got[2])
            if roles[pid].startswith("rank") and not roles[pid].endswith("worker"):
                ranks_pss += got[2]
        if ranks_pss and w.step:
            w.rank_pss.append((w.step, ranks_pss))
        if not killed and stop_when is not None and stop_when(w):
            killed = True
            kill(proc, w)
        time.sleep(0.5)
    reader.join(timeout=10)
    w.returncode, w.seconds = proc.returncode, time.perf_counter() - began
    return w


def by_role(peaks: dict[int, Peak]) -> dict[str, dict]:
    """The peaks folded by role: "main", "rank" (every rank), "rank worker" (every loader worker)."""
    out: dict[str, dict] = {}
    for p in peaks.values():
        kind = "main" if p.role == "main" else re.sub(r" \d+", "", p.role)
        r = out.setdefault(kind, {"processes": 0, "fds": 0, "rss_mib": 0.0, "pss_mib": 0.0, "pss_mib_sum": 0.0})
        r["processes"] += 1
        r["fds"], r["rss_mib"], r["pss_mib"] = max(r["fds"], p.fds), max(r["rss_mib"], p.rss_mib), max(r["pss_mib"], p.pss_mib)
        r["pss_mib_sum"] += p.pss_mib
    return {k: {**v, **{m: round(v[m], 1) for m in ("rss_mib", "pss_mib", "pss_mib_sum")}} for k, v in out.items()}


def ranks_of(proc_pid: int) -> dict[int, int]:
    """{local rank: pid} of the ranks a launcher started."""
    out = {}
    for pid, _ in descendants(proc_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        local = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"LOCAL_RANK=")), None)
        if local is not None and parent == proc_pid:
            out[int(local)] = pid
    return out


def warn_ranks(proc: subprocess.Popen, w: Watched) -> None:
    """SLURM's preemption as a site with `PreemptParameters=send_user_signal` sends it: the warning
    (SIGUSR2) and SIGTERM at once, to every process of every rank (here not the launcher); a rank leads
    its process group (torch's launcher), its loader workers in it."""
    for rank in ranks_of(proc.pid).values():
        os.killpg(rank, signal.SIGUSR2)
        os.killpg(rank, signal.SIGTERM)


# ----------------------------------------------------------------------------- stages


def python(*words: str) -> list[str]:
    return [sys.executable, *words]


def run_stage(name: str, w: Watched) -> dict:
    """A command's figures; a failed command stops the rehearsal with its last lines."""
    if w.returncode != 0:
        tail = "\n".join(line for _, line in w.lines[-15:])
        raise RehearsalError(f"stage {name} ended with exit status {w.returncode}:\n{tail}")
    return {"seconds": round(w.seconds, 1), "processes": by_role(w.peaks)}


def dataset_facts(root: Path) -> dict:
    m = schema.read_manifest(root / NAME, verify="size")
    shards = {s: len(list((root / NAME / s).glob("shard-*.tar"))) for s in m.counts}
    tiny = float(np.load(root / NAME / "train" / schema.RECORDS_NAME, mmap_mode="r")[:, 2].mean())
    sizes = {}
    for f in (root / NAME).rglob("*"):
        if f.is_file():
            kind = "dali" if f.parent.name in m.counts else "ffcv" if f.suffix == ".beton" else "other"
            sizes[kind] = sizes.get(kind, 0) + f.stat().st_size
    return {"records": dict(m.counts), "classes": m.num_classes, "shards": shards, "bytes": sizes,
            "tiny_jpeg_bytes": round(tiny, 1)}


@dataclass(frozen=True)
class KillPlan:
    """The training stage's steps: where a rank dies (after the first checkpoint, so that the next start
    resumes), where the whole run dies (past the epoch boundary), and the checkpoint and log intervals
    that make both happen on a run of any length."""

    steps: int
    ckpt_every: int
    log_every: int
    kill_rank_at: int
    warn_at: int                # every rank gets SLURM's warning
    kill_run_at: int


def kill_plan(per_epoch: int, past_epoch: int, ckpt_every: int, log_every: int, kill_share: float) -> KillPlan:
    """The `KillPlan` of a run of `per_epoch` steps an epoch and `past_epoch` more: `ckpt_every` and
    `log_every` as asked where the run is long enough, shorter where it is not (a `--scale 0.01`
    rehearsal has 12 steps an epoch: a checkpoint every 50 steps would come after the run's end and
    neither kill would happen)."""
    steps = per_epoch + past_epoch
    ckpt = max(1, min(ckpt_every, per_epoch // 3))
    log = max(1, min(log_every, ckpt // 2))
    kill_run_at = per_epoch + past_epoch // 2
    kill_rank_at = min(max(ckpt + log, int(kill_share * per_epoch)), kill_run_at - ckpt - log)
    return KillPlan(steps, ckpt, log, kill_rank_at, (kill_rank_at + kill_run_at) // 2, kill_run_at)


def train_words(a: argparse.Namespace, root: Path, runs: Path, steps: int, backend: str, name: str,
                ranks: int, *extra: str) -> list[str]:
    return python("-m", "train", f"gpus={ranks}", "run.device=cpu", "method=simclr", f"data={NAME}", "preset=imagenet",
                  f"data.root={root}", f"data.backend={backend}", f"data.batch_size={a.batch}/gpu",
                  "model.backbone=test_resnet", "model.proj_hidden=64", "model.proj_out=32", "model.pred_hidden=0",
                  f"views.global_px={a.view_px}", f"views.local_px={a.view_px}", f"optim.steps={steps}",
                  "optim.warmup_steps=10", f"run.ckpt_every={a.ckpt_every}", f"run.log_every={a.log_every}",
                  f"run.out_dir={runs}", f"run.name={name}", "run.resume=auto", *extra)


def checkpoint_step(run: Path) -> int | None:
    """The step of the run folder's newest checkpoint, or None."""
    import torch

    path = run / "checkpoint.pt"
    return int(torch.load(path, map_location="cpu", weights_only=True)["step"]) if path.is_file() else None


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def train_stage(a: argparse.Namespace, root: Path, runs: Path, train_records: int) -> dict:
    """Stage 3: three starts of the same command (module docstring)."""
    per_epoch = train_records // (a.ranks * a.batch)
    plan = kill_plan(per_epoch, a.past_epoch, a.ckpt_every, a.log_every, a.kill_rank_at)
    steps, kill_rank_at, kill_run_at = plan.steps, plan.kill_rank_at, plan.kill_run_at
    words = train_words(argparse.Namespace(**{**vars(a), "ckpt_every": plan.ckpt_every, "log_every": plan.log_every}),
                        root, runs, steps, "dali", "rehearsal", a.ranks, "run.checkpoint_on_signal=USR2+TERM")
    run = runs / "rehearsal"
    starts = []

    def kill_rank(proc, w: Watched) -> None:
        victim = ranks_of(proc.pid).get(a.ranks - 1)
        if victim is not None:
            os.kill(victim, signal.SIGKILL)

    def kill_group(proc, w: Watched) -> None:
        os.killpg(proc.pid, signal.SIGKILL)

    for label, at, kill in (("start", kill_rank_at, kill_rank), ("after a rank was killed", plan.warn_at, warn_ranks),
                            ("after SLURM's warning", kill_run_at, kill_group),
                            ("after the whole run was killed", None, None)):
        stop = None if at is None else (lambda w, at=at: w.step >= at)
        before = len(metrics(run))
        print(f"train: {label}: {' '.join(words[1:])}", flush=True)
        w = watch(words, stop_when=stop, kill=kill)
        left = descendants(os.getpid())
        new = metrics(run)[before:]
        saved = checkpoint_step(run)
        first = next((r["first_step_s"] for r in new if r.get("kind") == "start" and "first_step_s" in r), None)
        steps_run = [r["step"] for r in new if r.get("kind") == "train"]
        starts.append({"label": label, "returncode": w.returncode, "seconds": round(w.seconds, 1),
                       "first_step_s": first and round(first, 1), "steps": [min(steps_run, default=None),
                                                                            max(steps_run, default=None)],
                       "random_init_eval_s": next((round(r["random_init_eval_s"], 1) for r in new
                                                   if "random_init_eval_s" in r), None),
                       "checkpoint_step": saved,
                       "last_line": next((line for _, line in reversed(w.lines) if line.strip()), ""),
                       "processes_left": len(left), "processes": by_role(w.peaks),
                       "rank_pss_mib": [(s, round(p, 1)) for s, p in w.rank_pss[:: max(1, len(w.rank_pss) // 40)]]})
        if stop is None and w.returncode != 0:
            raise RehearsalError(f"the last start ended with exit status {w.returncode}: {starts[-1]['last_line']}")
        if stop is not None and w.returncode == 0:
            raise RehearsalError(f"the {label!r} start ended on its own before its kill at step {at}: "
                                 f"{starts[-1]['last_line']}")
    evals = [r for r in metrics(run) if r.get("kind") == "eval"]
    warned = starts[1]
    if warned["checkpoint_step"] != warned["steps"][1]:
        raise RehearsalError(f"after SLURM's warning the checkpoint is of step {warned['checkpoint_step']}, the last "
                             f"step trained {warned['steps'][1]}: {warned['last_line']}")
    return {"steps": steps, "steps_per_epoch": per_epoch, "kill_rank_at": kill_rank_at, "warn_at": plan.warn_at,
            "kill_run_at": kill_run_at,
            "ckpt_every": plan.ckpt_every, "log_every": plan.log_every,
            "starts": starts, "final_eval": evals[-1] if evals else None, "command": " ".join(words[1:])}


def protocols_stage(a: argparse.Namespace, runs: Path, work: Path) -> dict:
    """Stage 4 (module docstring): three protocol commands on the training stage's checkpoint, each from
    scratch (what an earlier rehearsal's protocols wrote beside it is removed first)."""
    run = runs / "rehearsal"
    ckpt = run / "checkpoint.pt"
    if not ckpt.is_file():
        raise RehearsalError(f"stage protocols needs the training stage's checkpoint {ckpt}; run --stages train first")
    for old in [*run.glob("linear-*"), *run.glob("finetune-*"), *run.glob("*_eval.json")]:
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    per_epoch = a.train_n / (a.ranks * a.batch)
    # about 62 steps at full size; at least 40, so that steps of 70 ms (0.01 scale) leave the warning, sent
    # halfway, a second and more of steps to be agreed on (with 10 it came after the last step: acted at once)
    epochs = round(max(40.0, 0.2 * per_epoch) / per_epoch, 4)
    # a log step (where the warning is agreed on) every 5 steps, or more often in a short run: the warning,
    # sent halfway, must find log steps before the last one
    log_every = max(1, min(5, round(epochs * per_epoch) // 10))
    names = work / "1percent.txt"                                           # 1 % of each class, by file name
    names.write_text("".join(f"n{c:08d}_{i}.JPEG\n" for c, n in enumerate(class_counts(a.train_n, a.classes))
                             for i in range(max(1, round(n / 100)))))
    # 1 % at ImageNet's counts; 10 % where 1 % would leave a class without an image (refused)
    share = "1%" if min(class_counts(a.train_n, a.classes)) >= 50 else "10%"
    common = [f"ckpt={ckpt}", "data.backend=dali", "run.device=cpu", f"batch_size={a.ranks * a.batch}"]
    commands = {"linear": ["linear", "preset=auto", f"epochs={epochs}", f"log_every={log_every}", *common],
                f"finetune {share}": ["finetune", f"labels={share}", "epochs=2", "log_every=1", *common],
                "finetune list": ["finetune", f"labels={names}", "epochs=2", "log_every=1", *common]}

    out = {}
    for label, words in commands.items():
        cmd = python("-m", "train", f"gpus={a.ranks}", *words)
        starts = []
        for start in ("warned", "resumed") if label == "linear" else ("start",):
            print(f"protocols: {label}, {start}: {' '.join(cmd[1:])}", flush=True)
            stop = (lambda w: w.step >= max(5, w.total // 2)) if start == "warned" else None
            w = watch(cmd, stop_when=stop, kill=warn_ranks)
            text = w.text()
            steps = [int(m.group(1)) for m in re.finditer(r"^step (\d+)/\d+ \|", text, re.M)]
            resumed = re.search(r"resuming \S+ from step (\d+)", text)
            starts.append({"start": start, "returncode": w.returncode, "seconds": round(w.seconds, 1),
                           "first_step_s": next((round(t, 1) for t, line in w.lines if line.startswith("step ")), None),
                           "steps": [min(steps, default=None), max(steps, default=None)],
                           "resumed_from": int(resumed.group(1)) if resumed else None,
                           "last_line": next((line for _, line in reversed(w.lines) if line.strip()), ""),
                           "processes_left": len(descendants(os.getpid())), "processes": by_role(w.peaks)})
            if start == "warned" and not re.search(r"caught SIG\w+( and SIG\w+)?: saved the checkpoint of step", text):
                raise RehearsalError(f"protocols: the warned {label} did not save the step it reached: "
                                     f"{starts[-1]['last_line']}")
            if start != "warned" and w.returncode != 0:
                raise RehearsalError(f"protocols: {label} ended with exit status {w.returncode}: "
                                     f"{starts[-1]['last_line']}")
        if label == "linear" and starts[1]["resumed_from"] != starts[0]["steps"][1]:
            raise RehearsalError(f"protocols: the warned linear evaluation trained to step {starts[0]['steps'][1]} "
                                 f"but the next start resumed from {starts[1]['resumed_from']}")
        written = re.search(r"; (\S+_eval\.json)$", starts[-1]["last_line"])
        facts = json.loads(Path(written.group(1)).read_text()) if written else {}
        out[label] = {"command": " ".join(cmd[1:]), "starts": starts,
                      "result": {k: facts.get(k) for k in ("preset", "epochs", "batch_size", "top1", "top5",
                                                          "val_samples", "seconds")}}
    return out


def backends_stage(a: argparse.Namespace, root: Path, runs: Path) -> dict:
    """Stage 5: 20 steps on each backend, one process, on the same shards."""
    out = {}
    for backend in ("ffcv", "dali", "torch", "torchvision"):
        words = train_words(a, root, runs, 20, backend, f"backend-{backend}", 1, "run.max_eval_samples=2000",
                            "run.resume=")
        print(f"backends: {backend}", flush=True)
        out[backend] = run_stage(f"backends ({backend})", watch(words))
    return out


def saliency_stage(a: argparse.Namespace, src: Path, root: Path, work: Path) -> dict:
    """Stage 6: the slice written at `SLICE_SHARD` records a shard, then the saliency stage on it."""
    classes = work / "slice-classes.txt"
    classes.write_text("".join(f"n{c:08d}\n" for c in range(min(SLICE_CLASSES, a.classes))))
    name = f"{NAME}-slice"
    pre = run_stage("saliency (the slice)", watch(python(
        "-m", "preprocess", "--dataset", "imagefolder", "--src", str(src), "--out", str(root), "--name", name,
        "--class-list", str(classes), "--shard-size", str(SLICE_SHARD))))
    sal = run_stage("saliency", watch(python(
        "-m", "preprocess.saliency", "--dataset", name, "--root", str(root), "--rounds", "1", "--epochs", "3",
        "--final-epochs", "3", "--report", str(work / "reports"))))
    m = schema.read_manifest(root / name, verify="size")
    return {"slice": {"records": dict(m.counts), "shards": {s: len(list((root / name / s).glob("shard-*.tar")))
                                                            for s in m.counts}, **pre},
            "saliency": {**sal, "stage": (m.saliency or {}).get("stage")}}


# ----------------------------------------------------------------------------- report

# The node the figures are scaled to (stated, not measured): an 8-GPU node of 8 H100 80 GB and 96 cores
# (12 a GPU), ranks on the DALI GPU graph at the `imagenet` preset's batch of 256 a GPU.
NODE = {"gpus": 8, "cores": 96, "batch": 256}
# Measured on an H100 (docs/benchmarks.md, GPU check of 27 Nov 2026): the DALI GPU graph's relicv2 views
# at batch 256, and ResNet-50 relicv2 training fed by it (bf16, batch 128).
GPU_LOADER_IMG_S, GPU_TRAIN_IMG_S = 9_730, 549


def full_size_jpeg_bytes(n: int = 200) -> float:
    """Mean bytes of `n` generated ImageNet-like JPEGs (`bench.datasets.scene` at about 445 x 334 px,
    quality 90: the image-folder bench's files, within the 512-px cap), measured here."""
    import io

    from bench.datasets import scene

    rng, sizes = np.random.default_rng(0), []
    for _ in range(n):
        w, h = int(445 * rng.uniform(0.85, 1.15)), int(334 * rng.uniform(0.85, 1.15))
        buf = io.BytesIO()
        Image.fromarray(scene(rng, w, h)).save(buf, format="JPEG", quality=schema.JPEG_QUALITY)
        sizes.append(buf.tell())
    return float(np.mean(sizes))


def full_size(report: dict) -> dict:
    """The rehearsal's figures scaled to full-size images on `NODE`: computed from what it measured and
    the constants above, each entry saying which."""
    out: dict = {"node": NODE}
    d = report.get("preprocess", {}).get("dataset")
    if d:
        records = sum(d["records"].values())
        jpeg = report.setdefault("full_size_jpeg_bytes", full_size_jpeg_bytes())
        # every format holds each image's bytes once plus its own per-record overhead, measured here
        overhead = {k: v / records - (d["tiny_jpeg_bytes"] if k in ("dali", "ffcv") else 0) for k, v in d["bytes"].items()}
        out["overhead_bytes_per_record"] = {k: round(v) for k, v in overhead.items()}
        out["dataset_gb"] = round(sum(IMAGENET_RECORDS * (v + (jpeg if k in ("dali", "ffcv") else 0))
                                      for k, v in overhead.items()) / 1e9, 1)
        out["source_folder_gb"] = round(IMAGENET_RECORDS * jpeg / 1e9, 1)
    starts = report.get("train", {}).get("starts", [])
    if starts:
        ranks = report["settings"]["ranks"]
        rank = max(s["processes"].get("rank", {}).get("pss_mib", 0) for s in starts)
        workers = max(s["processes"].get("rank worker", {}).get("pss_mib_sum", 0) for s in starts) / ranks
        # DALI's shared-memory chunks at full size (`dali_backend.shared_memory_bytes`: 4 chunks with 4
        # workers, each up to twice a batch of the largest file, taken as 4x the mean JPEG)
        shm = 4 * 2 * NODE["batch"] * (4 * (report.get("full_size_jpeg_bytes") or 0) + 4096) / 2**20
        out["host_mib_per_gpu"] = {"rank_pss (measured)": round(rank), "loader_workers_pss (measured)": round(workers),
                                   "dali_shm_chunks (computed)": round(shm),
                                   "total": round(rank + workers + shm)}
        out["dev_shm_gib_per_node (computed)"] = round(NODE["gpus"] * 2 * shm / 1024, 1)
        out["epoch_s (computed)"] = {"training, ResNet-50 relicv2": round(IMAGENET["train"] / (NODE["gpus"] * GPU_TRAIN_IMG_S)),
                                     "loader alone": round(IMAGENET["train"] / (NODE["gpus"] * GPU_LOADER_IMG_S))}
    return out


def markdown(report: dict) -> str:
    """The report's tables."""
    st = report["settings"]
    lines = [f"# ImageNet's shape rehearsed: {st['classes']:,} classes, {st['train']:,} train and {st['val']:,} val "
             f"records, {st['ranks']} gloo ranks, `ulimit -n {st['nofile']}`", "", *header_lines(report), ""]

    def procs(title: str, p: dict) -> list[str]:
        return [f"{title}: " + "; ".join(f"{k} x{v['processes']}: at most {v['fds']} open files, RSS {v['rss_mib']:.0f} MiB, "
                                          f"PSS {v['pss_mib']:.0f} MiB" for k, v in p.items())]

    if "folder" in report:
        lines += [f"- image folder written in {report['folder']['seconds']:.0f} s (0: already there)"]
    if "preprocess" in report:
        p = report["preprocess"]
        d = p["dataset"]
        lines += [f"- preprocessing: {p['seconds']:.0f} s, {sum(d['records'].values()):,} records, shards "
                  + ", ".join(f"{k} {v:,}" for k, v in d["shards"].items()) + ", " +
                  ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in d["bytes"].items()), *procs("  - processes", p["processes"])]
    if "train" in report:
        t = report["train"]
        lines += [f"- training: {t['steps']} steps, {t['steps_per_epoch']} an epoch; `{t['command']}`"]
        for s in t["starts"]:
            lines += [f"  - {s['label']}: exit {s['returncode']} after {s['seconds']:.0f} s, steps {s['steps']}, "
                      f"newest checkpoint then of step {s.get('checkpoint_step')}, first step "
                      f"{s['first_step_s']} s after its start (random-init evaluation {s['random_init_eval_s']} s); "
                      f"processes left after it: {s['processes_left']}; last line: {s['last_line'][:160]}",
                      *procs("    - processes", s["processes"])]
            if s["rank_pss_mib"]:
                first, last = s["rank_pss_mib"][0], s["rank_pss_mib"][-1]
                lines += [f"    - the ranks' PSS, summed: {first[1]:.0f} MiB at step {first[0]}, {last[1]:.0f} MiB at step {last[0]}"]
        e = t.get("final_eval") or {}
        if e:
            lines += [f"- final evaluation ({st['classes']:,} classes, {e.get('eval_train_samples', 0):,.0f} train and "
                      f"{e.get('eval_val_samples', 0):,.0f} val records): {e.get('eval_s', 0):.0f} s; kNN "
                      f"{e.get('knn_top1', 0):.1%} (random init {e.get('random_init/knn_top1', 0):.1%}), linear "
                      f"{e.get('linear_top1', 0):.1%} (random init {e.get('random_init/linear_top1', 0):.1%})"]
    for label, r in report.get("protocols", {}).items():
        res = r["result"]
        lines += [f"- {label} (`{r['command']}`): preset {res['preset']}, {res['epochs']} epochs at batch "
                  f"{res['batch_size']}, top-1 {res['top1'] or 0:.1%} / top-5 {res['top5'] or 0:.1%} on "
                  f"{res['val_samples'] or 0:,.0f} val records"]
        for s in r["starts"]:
            lines += [f"  - {s['start']}: exit {s['returncode']} after {s['seconds']:.0f} s, steps {s['steps']}"
                      + (f" (resumed from step {s['resumed_from']})" if s["resumed_from"] is not None else "")
                      + f", first step {s['first_step_s']} s after its start; processes left after it: "
                      f"{s['processes_left']}; last line: {s['last_line'][:160]}",
                      *procs("    - processes", s["processes"])]
    for backend, b in report.get("backends", {}).items():
        lines += [f"- {backend}: 20 steps and an evaluation in {b['seconds']:.0f} s", *procs("  - processes", b["processes"])]
    if "saliency" in report:
        sl, sa = report["slice"], report["saliency"]
        lines += [f"- saliency slice: {sum(sl['records'].values()):,} records in "
                  + ", ".join(f"{k} {v:,}" for k, v in sl["shards"].items()) + f" shards, written in {sl['seconds']:.0f} s; "
                  f"saliency {sa['seconds']:.0f} s (stage used: {sa['stage']})", *procs("  - processes", sa["processes"])]
    lines += ["", "## At full size (computed)", "", "```", json.dumps(full_size(report), indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rehearse", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("rehearsal"), help="folder of the image folder, data and runs")
    p.add_argument("--report", type=Path, default=Path("reports/rehearsal"), help="report folder")
    p.add_argument("--scale", type=float, default=1.0, help="share of ImageNet's record counts (classes stay 1,000)")
    p.add_argument("--classes", type=int, default=IMAGENET["classes"])
    p.add_argument("--image-px", type=int, nargs=2, default=(24, 18), metavar=("W", "H"))
    p.add_argument("--ranks", type=int, default=8, help="gloo ranks of the training run")
    p.add_argument("--batch", type=int, default=512, help="per rank")
    p.add_argument("--view-px", type=int, default=8)
    p.add_argument("--past-epoch", type=int, default=24, help="steps trained past the first epoch")
    p.add_argument("--kill-rank-at", type=float, default=0.4, help="a rank is killed at this share of the epoch")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    a = p.parse_args(argv)
    stages = [s for s in a.stages.split(",") if s]
    if bad := sorted(set(stages) - set(STAGES)):
        return bad_input(f"unknown stage {', '.join(bad)}; choose from {', '.join(STAGES)}")
    work = a.work.resolve()
    src, root, runs = work / "imagenet-shaped", work / "data", work / "runs"
    # every class keeps an image in each split (a class folder without images is refused)
    train_n, val_n = (max(a.classes, round(IMAGENET[s] * a.scale)) for s in ("train", "val"))
    head = header()
    print("\n".join(header_lines(head)), flush=True)
    out_json = work / "rehearsal.json"
    report = json.loads(out_json.read_text()) if out_json.is_file() else {}
    report.update({**head, "settings": {**vars(a), "work": str(work), "report": str(a.report),
                                        "train": train_n, "val": val_n, "nofile": NOFILE}})
    work.mkdir(parents=True, exist_ok=True)
    try:
        if "folder" in stages:
            print(f"folder: {a.classes} classes, {train_n:,} train and {val_n:,} val images", flush=True)
            report["folder"] = {"seconds": round(write_folder(src, a.classes, train_n, val_n, tuple(a.image_px),
                                                              os.cpu_count() or 1), 1)}
        if "preprocess" in stages:
            print("preprocess", flush=True)
            w = watch(python("-m", "preprocess", "--dataset", "imagefolder", "--src", str(src), "--out", str(root),
                             "--name", NAME))
            report["preprocess"] = {**run_stage("preprocess", w), "dataset": dataset_facts(root)}
        if "train" in stages:
            report["train"] = train_stage(a, root, runs, schema.read_manifest(root / NAME, verify="size").counts["train"])
        if "protocols" in stages:
            report["protocols"] = protocols_stage(argparse.Namespace(**vars(a), train_n=train_n), runs, work)
        if "backends" in stages:
            report["backends"] = backends_stage(a, root, runs)
        if "saliency" in stages:
            report.update(saliency_stage(a, src, root, work))
    except RehearsalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        out_json.write_text(json.dumps(report, indent=1, default=str))
    report["full_size"] = full_size(report)
    out_json.write_text(json.dumps(report, indent=1, default=str))
    a.report.mkdir(parents=True, exist_ok=True)
    (a.report / "rehearsal.json").write_text(json.dumps(report, indent=1, default=str))
    (a.report / "report.md").write_text(markdown(report))
    print(f"report: {a.report / 'report.md'} ({a.report / 'rehearsal.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
