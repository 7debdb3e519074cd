"""Progress of the long preprocessing stages, on a terminal and in a log.

On a terminal: tqdm's live bar. Anywhere else (a batch job's output file, `make preprocess > log`) a
bar's carriage returns would pile up in one line, or with progress off in tqdm nothing would show for
hours, so a line is printed at most every `EVERY` seconds instead:
`train masks: 120,000/1,281,167 img (9 %), 420 img/s, 46 min left`. Every stage, writer and copy in
`preprocess` takes its bar from here.
"""

from __future__ import annotations

import math
import sys
import time

from tqdm import tqdm

EVERY = 60.0            # seconds between two lines in a log


class LogLines:
    """A bar's interface (`update`, `write`, `close`, a context) that prints a line every `every` s."""

    def __init__(self, total: int, desc: str, unit: str = "img", every: float = EVERY, file=None) -> None:
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.file = file or sys.stderr
        self.n = 0
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every and self.n < self.total:
            self.last = now
            print(self.line(now), file=self.file, flush=True)

    def line(self, now: float) -> str:
        rate = self.n / max(now - self.start, 1e-9)
        left = (self.total - self.n) / rate if rate > 0 else math.inf
        return (f"{self.desc}: {self.n:,}/{self.total:,} {self.unit} ({100 * self.n / max(self.total, 1):.0f} %), "
                f"{rate:,.0f} {self.unit}/s, {_duration(left)} left")

    def write(self, s: str, file=None) -> None:
        print(s, file=file or self.file, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> "LogLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "unknown time"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def bar(total: int, desc: str, progress: bool = True, unit: str = "img", file=None, **tqdm_options):
    """A progress bar for `total` items: tqdm's on a terminal (given `tqdm_options`), `LogLines`
    elsewhere (silent with `progress` off, its `write` lines still printed)."""
    file = file or sys.stderr
    if progress and file.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=file, **tqdm_options)
    return LogLines(total, desc, unit, EVERY if progress else math.inf, file)
