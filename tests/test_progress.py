"""The progress display: one redrawn line on a terminal, a line per trial in a log."""

from __future__ import annotations

import io

from autotune.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_trial_with_the_counts_and_the_best() -> None:
    out = io.StringIO()
    bar = Progress(60.0, stream=out)
    bar.update(label="bs=32 w=0", state="complete", samples_per_s=1200.0, best=1200.0, phase="baseline")
    bar.update(label="bs=32 w=4", state="failed", samples_per_s=None, best=1200.0)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "1 tried, 0 failed, best 1,200/s" in lines[0] and "baseline bs=32 w=0 -> 1,200/s" in lines[0]
    assert "2 tried, 1 failed" in lines[1] and "-> failed" in lines[1]
    assert all(len(line) <= 100 for line in lines)


def test_a_long_label_is_shortened_to_fit_the_line() -> None:
    out = io.StringIO()
    bar = Progress(600.0, stream=out)
    bar.update(label="bs=256 w=32 thr pf=8 unordered pin ram t=16 " * 3, state="complete",
               samples_per_s=123456.0, best=123456.0, phase="final")
    (line,) = out.getvalue().splitlines()
    assert len(line) <= 100 and line.endswith("~ -> 123,456/s")


def test_a_terminal_gets_one_line_redrawn_and_ended() -> None:
    out = Terminal()
    bar = Progress(10.0, stream=out)
    for k in range(3):
        bar.update(label=f"w={k}", state="complete", samples_per_s=100.0 * k, best=100.0 * k)
    bar.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 3 and text.endswith("\n") and text.count("\n") == 1


def test_a_disabled_display_writes_nothing_but_still_counts() -> None:
    out = io.StringIO()
    bar = Progress(5.0, enabled=False, stream=out)
    bar.update(label="x", state="pruned", samples_per_s=None, best=None)
    bar.close()
    assert out.getvalue() == "" and (bar.trials, bar.not_complete) == (1, 1)
