"""Timing of the loaders and of their ceilings, one way for every bench (`bench.data`, `make profile`,
the GPU check), and the rounds every bench times its cells in.

    timing = time_loader(lambda r: build(epoch=r), batches=16, warmup=3, repeats=3, device="cuda", workers=16)
    timing.median, timing.img_per_s, timing.first_batch_s, timing.thread_cpu_ms, timing.cpu_utilisation
    ceiling = time_ceiling(scan_shards(split), "pil", recipe, 32, 16, 3, repeats=3, cores=2)
    epochs = time_epochs(lambda e: build(epoch=e), epochs=3, device="cpu")   # first batch, epoch-boundary stall
    cells = in_rounds(3, {"torchvision": lambda rnd: {...}, ...})            # every cell once per round
    cell = ladder_cell(lambda rung, e: build(rung, epoch=e), {"full": r, "crops_only": crops_only(r)}, 16, 3, "cpu")

A loader run builds a fresh loader and reads it the way training does, epoch after epoch: the time from
building it to its first batch is reported apart (pipeline build, worker start-up, first decodes), then
it skips its warm-up batches and times the next ones between two device syncs: the steady-state rate.
While timed, the machine's CPU share is read from /proc/stat (every process counts) and the CPU time of
the thread that takes the batches (the training loop's, `time.thread_time` around each `next`). Steady
state needs enough batches: loaders whose `workers` processes each make whole batches (a DataLoader)
hand them out in bursts of one per worker, so warm-up and timed batches are whole rounds of the workers,
at least 2 and 4 (`steady_batches`); 2 warm-up and 8 timed batches of a 16-worker DataLoader had all
been made before the window opened (the decode ceiling's 4.7 M img/s on an H200). An epoch run builds
one loader and reads whole epochs of it: the time from building it to its first batch, and the gap at
each epoch boundary against the mean gap between batches. A ceiling reads the same shard records in
`cores` DataLoader workers with one of two libjpeg-turbo decoders (PIL, `torchvision.io.decode_image`):
the bytes alone (`read`), decode-only, or decode + the recipe's crops and resizes (one decode per
sample, every crop view resized to its size, no colour ops). The recipe variants here (`crops_only`,
`without_blur`) are the ablations that split a loader's time into stages (`stages_ms`).
"""

from __future__ import annotations

import gzip
import io
import json
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pipelines.processes import worker_context, worker_started
from pipelines.shards import ShardReader
from pipelines.spec import Loader
from pipelines.views import Recipe


def crops_only(recipe: Recipe) -> Recipe:
    """The recipe with every colour, grayscale, blur, solarize and saliency op switched off."""
    off = dict(jitter_p=0.0, gray_p=0.0, blur_p=0.0, solarize_p=0.0, saliency_p=0.0)
    return Recipe(name=f"{recipe.name}-crops", groups=tuple(replace(g, **off) for g in recipe.groups))


def without_blur(recipe: Recipe) -> Recipe:
    """The recipe with Gaussian blur switched off (everything else as it is)."""
    return Recipe(name=f"{recipe.name}-noblur", groups=tuple(replace(g, blur_p=0.0) for g in recipe.groups))


def stages_ms(rates: dict[str, float], decode: float, read: float | None = None) -> dict[str, float | None]:
    """The stage split, one for every bench: each stage's ms an image, from the img/s of a loader's
    ablation ladder and of the ceilings. A stage is the difference of two rungs, never negative (a
    loader faster than the ceiling's decoder gets 0 for its crops, not a negative time).

    Args:
        rates: img/s of the rungs: "full" and "crops_only" (`crops_only`), and where the recipe has them
            "no_mix" (the mixes off) and "no_blur" (`without_blur`, the mixes off too).
        decode: the decode ceiling's img/s (it reads the bytes too).
        read: the read ceiling's img/s, split off the decode's time; None: not measured (decode holds it).

    Returns:
        {"read", "decode", "crops_resize_rest", "colour", "blur", "mix"}: ms an image; "read" None without
        `read`, "blur" and "mix" None where the ladder has no such rung.
    """
    ms = {k: 1000.0 / v for k, v in rates.items() if v}
    nonneg = lambda x: max(0.0, x)   # noqa: E731
    read_ms = 1000.0 / read if read else None
    no_mix = ms.get("no_mix", ms["full"])
    no_blur = ms.get("no_blur", no_mix)
    return {"read": read_ms, "decode": nonneg(1000.0 / decode - (read_ms or 0.0)),
            "crops_resize_rest": nonneg(ms["crops_only"] - 1000.0 / decode),
            "colour": nonneg(no_blur - ms["crops_only"]),
            "blur": nonneg(no_mix - no_blur) if "no_blur" in ms else None,
            "mix": nonneg(ms["full"] - no_mix) if "no_mix" in ms else None}


def views_per_sample(recipe: Recipe) -> int:
    """Views a sample yields: every group's count (weak parents of staged groups included)."""
    return sum(g.count for g in recipe.groups)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work: the boundary of every timed window."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()  # sync: close the timed window on the device


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (None where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_utilisation(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """Share of the machine's cores busy between two `cpu_ticks()` readings (every process counts)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def steady_batches(batches: int, warmup: int, workers: int) -> tuple[int, int]:
    """(timed, warm-up) batches of a steady-state run: at least `batches` and `warmup`, and with
    `workers` > 0 processes that each make whole batches, whole rounds of them: at least 4 timed and 2
    warm-up rounds (a DataLoader has up to 2 batches per worker made ahead; module docstring)."""
    if workers <= 0:
        return batches, warmup
    rounds = lambda n, least: workers * max(least, -(-n // workers))   # noqa: E731
    return rounds(batches, 4), rounds(warmup, 2)


@dataclass(frozen=True)
class LoaderTiming:
    """Timed runs of one loader, each on a fresh loader: its first batch, then steady state."""
    img_per_s: tuple[float, ...]                 # steady-state source images per second, one per run
    cpu_utilisation: tuple[float | None, ...]    # share of the machine's cores busy in each run (None: unknown)
    first_batch_s: tuple[float, ...] = ()        # from the start of building the loader to its first batch
    thread_cpu_ms: tuple[float, ...] = ()        # CPU of the thread that takes the batches, median ms a timed batch
    batches: int = 0                             # timed batches per run (`steady_batches`)
    warmup: int = 0                              # warm-up batches per run, the first one included

    @property
    def median(self) -> float:
        """The median images/s over the runs."""
        return statistics.median(self.img_per_s)


def _endless(loader) -> Iterator:
    """The loader's batches epoch after epoch, as the training loop reads them (a loader whose epoch
    ends moves on to the next, or repeats its order)."""
    while True:
        n = 0
        for batch in loader:
            n += 1
            yield batch
        if not n:
            raise ValueError("the loader yields no batches; give it more records or a smaller batch")


def epoch_holds(per_epoch: int, needed: int, workers: int) -> None:
    """Check that one epoch of a loader whose `workers` processes each make whole batches holds the
    `needed` batches of a steady-state run. At an epoch's end such a loader drains: the next epoch's
    batches are asked for only once the last one is taken, so a run across epoch ends times them (on an
    H200, 16 DataLoader workers on an epoch of 2 batches: 2 workers busy, 14 idle).

    Raises:
        ValueError: the epoch is too short; the message names the fix.
    """
    if per_epoch < needed:
        raise ValueError(f"an epoch of this loader has {per_epoch} batches, fewer than the {needed} (warm-up and "
                         f"timed) of a steady-state run of its {workers} workers, which would time its epoch ends; "
                         "give the dataset more images (--n) or the loader smaller batches")


def time_loader(make: Callable[[int], Loader], batches: int, warmup: int, repeats: int,
                device: str | torch.device, workers: int = 0) -> LoaderTiming:
    """Time `repeats` runs of a loader: run r builds a fresh one (`make(r)`), takes its first batch
    (timed from the start of `make`), the rest of the warm-up batches untimed, then times the
    steady-state batches between two device syncs, reading across epochs as training does.

    Args:
        make: builds the loader of run r (and sets its epoch).
        batches: timed batches per run, >= 1 (more with `workers`: `steady_batches`).
        warmup: batches per run before them, the first included (worker start-up, graph build, first
            decodes).
        repeats: runs, >= 1.
        device: where the batches land; a CUDA device is synced around the timed window.
        workers: processes of the loader that each make whole batches (DataLoader workers), or 0.

    Returns:
        Per run: steady-state source images/s, the machine's CPU share, the first batch's time and the
        taking thread's CPU per batch.
    """
    batches, warmup = steady_batches(batches, max(1, warmup), workers)
    rates, utilisation, first, thread = [], [], [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        loader = make(r)
        if workers > 0:
            epoch_holds(len(loader), warmup + batches, workers)
        it = _endless(loader)
        next(it)
        sync(device)
        first.append(time.perf_counter() - t0)
        for _ in range(warmup - 1):
            next(it)
        sync(device)
        ticks, cpu_ms, n = cpu_ticks(), [], 0
        t0 = time.perf_counter()
        for _ in range(batches):
            c0 = time.thread_time()
            n += next(it).batch_size
            cpu_ms.append(1000 * (time.thread_time() - c0))
        sync(device)
        rates.append(n / (time.perf_counter() - t0))
        utilisation.append(cpu_utilisation(ticks, cpu_ticks()))
        thread.append(statistics.median(cpu_ms))
        it.close()
        del it, loader
    return LoaderTiming(tuple(rates), tuple(utilisation), tuple(first), tuple(thread), batches, warmup)


def device_work(events: list[dict], batches: int, top: int = 15) -> dict:
    """Per batch, from a Chrome trace's events (torch.profiler's `export_chrome_trace`): the device
    busy (`busy_ms`: the union of the kernels', copies' and memsets' intervals), their summed time
    (`kernel_ms`: more than busy where streams overlap), kernel launches (`kernels`), the host threads
    that launched them (`launching_threads`), and the `top` names by time ({name, ms, calls})."""
    work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in work):      # microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, list[float]] = {}
    for e in work:
        by_name.setdefault(e["name"], []).append(e["dur"])
    rows = sorted(((sum(d), len(d), n) for n, d in by_name.items()), reverse=True)
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e.get("name", "")]
    return {"busy_ms": busy / 1000 / batches, "kernel_ms": sum(e["dur"] for e in work) / 1000 / batches,
            "kernels": sum(e.get("cat") == "kernel" for e in work) / batches,
            "launching_threads": len({e.get("tid") for e in launches}),
            "top": [{"name": n[:160], "ms": t / 1000 / batches, "calls": c / batches} for t, c, n in rows[:top]],
            "busiest_stream": _stream_gaps(work, batches)}


def _stream_gaps(work: list[dict], batches: int) -> dict | None:
    """The stream with the most device work (a DALI graph's GPU operators share one) per batch: its
    work, and the idle time between two of its events split into waits of 1 ms or more (for an input:
    the decoder's output) and gaps under 1 ms (an operator's host set-up before its first copy or
    kernel: what a graph of many small operators pays)."""
    streams: dict[object, list[dict]] = {}
    for e in work:
        streams.setdefault(e.get("args", {}).get("stream"), []).append(e)
    if not streams:
        return None
    sid, on = max(streams.items(), key=lambda kv: sum(e["dur"] for e in kv[1]))
    on = sorted(on, key=lambda e: e["ts"])
    idle = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(on, on[1:])]
    return {"stream": sid, "work_ms": sum(e["dur"] for e in on) / 1000 / batches,
            "waits_ms": sum(g for g in idle if g >= 1000) / 1000 / batches,
            "gaps_ms": sum(g for g in idle if 0 < g < 1000) / 1000 / batches}


def profile_kernels(make: Callable[[], Loader], batches: int, warmup: int, device: str | torch.device,
                    trace: Path | None = None, top: int = 15) -> dict:
    """The device's work per steady-state batch of a loader: every kernel and copy that the process
    launched while `batches` batches were taken (torch.profiler's CUDA activity records them all, from
    every thread: DALI's included), after `warmup` untimed ones.

    Returns:
        wall_ms, the wall time per batch, and on a CUDA device `device_work`'s figures of the trace (on
        a CPU nothing else is recorded). `trace`: where the Chrome trace is also written, gzipped.
    """
    cuda = torch.device(device).type == "cuda"
    loader = make()
    it = _endless(loader)
    for _ in range(max(1, warmup)):
        next(it)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        sync(device)
        wall = time.perf_counter() - t0
    it.close()
    out: dict = {"batches": batches, "wall_ms": 1000 * wall / batches}
    if not cuda:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
        if trace is not None:
            trace.write_bytes(gzip.compress(path.read_bytes()))
    out.update(device_work(events, batches, top))
    return out


@dataclass
class Cell:
    """One cell of a bench timed in rounds (`in_rounds`): its figures over the rounds, or why it failed."""
    runs: dict[str, list] = field(default_factory=dict)    # figure name -> one or more values per round
    error: str | None = None                               # "Type: message" of the round that failed
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def ladder_cell(make: Callable[[Any, int], Loader], rungs: dict[str, Any], batches: int, warmup: int,
                device: str | torch.device, workers: int = 0) -> Callable[[int], dict[str, list]]:
    """The loader cell of every bench that times a loader's stages (an `in_rounds` cell): in round `rnd`,
    one steady-state run (`time_loader`) of each rung of an ablation ladder, in order.

    Args:
        make: builds the loader of a rung at an epoch: `make(rung, epoch)`, epoch `rnd` + the run's.
        rungs: {name: rung}, the full recipe first (e.g. {"full": recipe, "crops_only": crops_only(recipe)}).
        batches, warmup, device, workers: as `time_loader`'s.

    Returns:
        The cell: per round {rung name: [img/s]} and, of the first rung, "first_batch_s", "thread_cpu_ms"
        and "cpu_utilisation" (each a list of one run's value).
    """
    def cell(rnd: int) -> dict[str, list]:
        out: dict[str, list] = {}
        for i, (name, rung) in enumerate(rungs.items()):
            t = time_loader(lambda e, rung=rung: make(rung, rnd + e), batches, warmup, 1, device, workers)
            out[name] = list(t.img_per_s)
            if i == 0:
                out.update(first_batch_s=list(t.first_batch_s), thread_cpu_ms=list(t.thread_cpu_ms),
                           cpu_utilisation=list(t.cpu_utilisation))
        return out
    return cell


def in_rounds(repeats: int, cells: dict[Hashable, Callable[[int], dict[str, list]]],
              done: Callable[[int], None] | None = None) -> dict[Hashable, Cell]:
    """Time every cell once per round, `repeats` rounds, each round every cell back to back, so that a
    slow spell of a shared machine falls on all of them alike, not on one backend or ceiling: the one
    rounds loop of the benches.

    Args:
        cells: {key: run(round) -> {figure: values of this round}}, in the order they run in a round.
        done: called with the round's number after each round (progress lines).

    Returns:
        {key: Cell}: each figure's values over the rounds. A cell that raises is reported failed (its
        error and traceback) and left out of the later rounds, never skipped silently.
    """
    out = {key: Cell() for key in cells}
    for rnd in range(repeats):
        for key, run in cells.items():
            cell = out[key]
            if not cell.ok:
                continue
            try:
                for name, values in run(rnd).items():
                    cell.runs.setdefault(name, []).extend(values)
            except Exception as exc:   # a broken backend is reported, not silently skipped
                cell.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                cell.traceback = traceback.format_exc(limit=4)
        if done is not None:
            done(rnd)
    return out


@dataclass(frozen=True)
class EpochTiming:
    """One loader built and read for several epochs: when each batch arrived."""
    first_batch_s: float                         # from the start of building the loader to its first batch
    gaps_s: tuple[float, ...]                    # between consecutive batches within an epoch
    boundary_gaps_s: tuple[float, ...]           # from an epoch's last batch to the next epoch's first

    @property
    def median_gap_s(self) -> float:
        return statistics.median(self.gaps_s)

    @property
    def mean_gap_s(self) -> float:
        """The steady time per batch. Not the median: loaders whose workers each make a whole batch
        hand them out in bursts (2 workers: about 1,100 ms, then 15 ms), where the median gap says
        nothing of the rate."""
        return statistics.fmean(self.gaps_s)

    @property
    def boundary_stall(self) -> float:
        """The longest epoch-boundary gap in mean batch gaps (1: the boundary costs what a batch costs)."""
        return max(self.boundary_gaps_s) / self.mean_gap_s


def time_epochs(make: Callable[[int], Loader], epochs: int, device: str | torch.device, first_epoch: int = 0,
                clock: Callable[[], float] = time.perf_counter) -> EpochTiming:
    """Build a loader at `first_epoch` (`make(first_epoch)`, timed from its first line) and read
    `epochs` >= 2 whole epochs the way the training loop does (`set_epoch(e)` for the next epoch, then
    a new iteration), noting when each batch arrives (after a device sync) on `clock`. Gaps within
    epochs exclude each epoch's first batch."""
    t0 = clock()
    loader = make(first_epoch)
    arrivals: list[list[float]] = []
    for e in range(first_epoch, first_epoch + epochs):
        if e > first_epoch:
            loader.set_epoch(e)
        arrivals.append([])
        for _ in loader:
            sync(device)
            arrivals[-1].append(clock())
    del loader
    if any(len(a) < 2 for a in arrivals):
        raise ValueError("time_epochs needs at least 2 batches per epoch; raise the limit or lower the batch size")
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    boundaries = [nxt[0] - prev[-1] for prev, nxt in zip(arrivals, arrivals[1:])]
    return EpochTiming(arrivals[0][0] - t0, tuple(gaps), tuple(boundaries))


class _CeilingDataset(torch.utils.data.Dataset):
    """Reads one record's image bytes from its shard, decodes it and (optionally) crops the views."""

    def __init__(self, reader: ShardReader, decoder: str, crop_groups: list | None) -> None:
        self.reader, self.decoder, self.crop_groups = reader, decoder, crop_groups

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int):
        import torchvision.transforms as T
        data = self.reader.image(i)
        if self.decoder == "read":                    # the bytes alone: the read ceiling
            return len(data)
        if self.decoder == "pil":
            from PIL import Image
            img = Image.open(io.BytesIO(data)).convert("RGB")
            if self.crop_groups is None:
                return img.width
            out = []
            for g in self.crop_groups:
                interp = Image.BICUBIC if g.interpolation == "bicubic" else Image.BILINEAR
                for _ in range(g.count):
                    top, left, h, w = T.RandomResizedCrop.get_params(img, list(g.area), list(g.ratio))
                    v = img.resize((g.size_px, g.size_px), interp, box=(left, top, left + w, top + h))
                    out.append(torch.from_numpy(np.asarray(v).copy()))
            return out
        import torchvision.io as tvio
        import torchvision.transforms.v2.functional as F
        img = tvio.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tvio.ImageReadMode.RGB)
        if self.crop_groups is None:
            return int(img.shape[-1])
        out = []
        for g in self.crop_groups:
            interp = (T.InterpolationMode.BICUBIC if g.interpolation == "bicubic"
                      else T.InterpolationMode.BILINEAR)
            for _ in range(g.count):
                top, left, h, w = T.RandomResizedCrop.get_params(img, list(g.area), list(g.ratio))
                out.append(F.resized_crop(img, top, left, h, w, [g.size_px, g.size_px], interp, antialias=True))
        return out


def _collate_views(items):
    if isinstance(items[0], int):
        return len(items)
    return [torch.stack([it[k] for it in items]) for k in range(len(items[0]))]  # each (B, ...)


def time_ceiling(entries, decoder: str, recipe: Recipe | None, batch_size: int, batches: int,
                 warmup: int, repeats: int, cores: int, first_seed: int = 0, steady: bool = True) -> list[float]:
    """Steady-state images/s of decode-only (`recipe` None) or decode + crops of `recipe`, in `cores`
    DataLoader workers (warm-up and timed batches whole rounds of them, `steady_batches`, unless not
    `steady`: a smoke run); run r reads the records in the order seeded with `first_seed + r`.
    `decoder="read"` times reading the bytes alone."""
    batches, warmup = steady_batches(batches, warmup, cores if steady else 0)
    groups = None if recipe is None else list(recipe.crop_groups)
    ds = _CeilingDataset(ShardReader(entries), decoder, groups)
    need = (warmup + batches) * batch_size
    runs = []
    for r in range(repeats):
        g = torch.Generator().manual_seed(first_seed + r)
        order = torch.randperm(len(entries), generator=g).tolist()
        order = (order * (need // len(order) + 1))[:need]
        dl = torch.utils.data.DataLoader(
            torch.utils.data.Subset(ds, order), batch_size=batch_size, num_workers=cores,
            collate_fn=_collate_views, worker_init_fn=_seed_worker,
            multiprocessing_context=worker_context(__name__) if cores > 0 else None)
        it = iter(dl)
        for _ in range(warmup):
            next(it)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(it)
        runs.append(batches * batch_size / (time.perf_counter() - t0))
        del it, dl
    return runs


def _seed_worker(worker_id: int) -> None:
    worker_started(worker_id)
    torch.manual_seed(1000 + worker_id)
