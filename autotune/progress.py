"""The progress display on stderr while tuning: trials done, best so far, time left."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 10
"""Characters of the bar."""

LINE_WIDTH = 100
"""The line fits this many columns: the current trial's label is shortened to fit."""


class Progress:
    """One status line, redrawn in place on a terminal, one line per trial elsewhere (logs, CI)."""

    def __init__(self, budget_s: float, *, enabled: bool = True, stream: TextIO | None = None):
        self.budget_s = budget_s
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.trials = 0
        self.not_complete = 0
        self._drawn = False

    def update(self, *, label: str, state: str, samples_per_s: float | None, best: float | None,
               phase: str = "search") -> None:
        self.trials += 1
        if state != "complete":
            self.not_complete += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        frac = min(1.0, elapsed / self.budget_s) if self.budget_s > 0 else 1.0
        filled = int(round(frac * BAR_WIDTH))
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        left = max(0.0, self.budget_s - elapsed)
        best_txt = f"{best:,.0f}/s" if best else "-"
        this = f"{samples_per_s:,.0f}/s" if samples_per_s is not None else state
        head = (f"autotune [{bar}] {self.trials} tried, {self.not_complete} failed, best {best_txt},"
                f" {left:.0f}s left | {phase} ")
        room = max(12, LINE_WIDTH - len(head) - len(this) - 4)
        if len(label) > room:
            label = label[: room - 1] + "~"
        line = f"{head}{label} -> {this}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the status line, so what is printed next starts on a line of its own."""
        if not self.enabled:
            return
        if self._drawn:
            self.stream.write("\n")
        self.stream.flush()
