"""Progress of long preprocessing stages: a bar on a terminal, lines in a log, nothing when asked."""

from __future__ import annotations

import io
import re

from tqdm import tqdm

from preprocess import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_interval_with_count_share_rate_and_time_left() -> None:
    out = io.StringIO()
    lines = progress.LogLines(10, "train masks", every=0.0, file=out)
    for _ in range(10):
        lines.update(1)
    lines.write("a note")
    printed = out.getvalue().splitlines()
    # One line per update but the last (the stage's own summary follows it), then the note.
    assert len(printed) == 10 and printed[-1] == "a note"
    assert re.fullmatch(r"train masks: 3/10 img \(30 %\), [\d,]+ img/s, \d+ s left", printed[2]), printed[2]


def test_lines_wait_for_their_interval() -> None:
    out = io.StringIO()
    lines = progress.LogLines(1_000, "copy", every=3600.0, file=out)
    for _ in range(999):
        lines.update(1)
    assert out.getvalue() == ""


def test_a_terminal_gets_tqdms_bar_and_progress_off_prints_only_notes() -> None:
    assert isinstance(progress.bar(5, "x", file=Terminal()), tqdm)
    out = io.StringIO()
    quiet = progress.bar(5, "x", progress=False, file=out)
    assert isinstance(quiet, progress.LogLines)
    for _ in range(5):
        quiet.update(1)
    quiet.write("note")
    assert out.getvalue() == "note\n"


def test_preprocessing_into_a_log_shows_every_writer_progressing(tmp_path, capsys, monkeypatch) -> None:
    """A run whose output is a file, as in a batch job: the render, the DALI shards and the `.beton`'s
    copy each print progress lines (here every update), where before a log showed nothing until a
    split was done. (96-px images: the `.beton` takes 3 pages, which the copy writes in 3 runs.)"""
    from preprocess.prepare import prepare_dataset

    monkeypatch.setattr(progress, "EVERY", 0.0)
    prepare_dataset("synthetic", tmp_path / "data", workers=1, train_size=600, val_size=40, image_px=96, seed=1,
                    shard_size=100, progress=True)
    err = capsys.readouterr().err
    for desc in ("dali train", "train.beton"):
        assert re.search(rf"^{re.escape(desc)}: [\d,]+/600 img \(\d+ %\)", err, re.M), (desc, err[-2000:])
    prepare_dataset("synthetic", tmp_path / "quiet", workers=1, train_size=600, val_size=40, image_px=16, seed=1,
                    shard_size=100, progress=False)
    assert " img (" not in capsys.readouterr().err
