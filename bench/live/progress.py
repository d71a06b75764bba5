"""A one-line progress bar on stderr while a run goes: only on a terminal (logs and pipes get none)."""

from __future__ import annotations

import sys
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.on = self.stream.isatty()
        self(0)

    def __call__(self, done: int) -> None:
        if not self.on:
            return
        filled = WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (WIDTH - filled)
        self.stream.write(f"\r  {self.label:<18} [{bar}] {done}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        if self.on:  # the bar's line is cleared: the run's summary line takes its place
            self.stream.write("\r" + " " * (WIDTH + 30 + len(self.label)) + "\r")
            self.stream.flush()
