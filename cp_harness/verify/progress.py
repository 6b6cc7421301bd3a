"""The progress bar ``verify`` draws on stderr while it works."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (plain lines, every tenth of the way, when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self._last_plain = -1

    def note(self, text: str) -> None:
        """A message of its own line (the bar is redrawn by the next step)."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        self.done += 1
        frac = min(self.done / max(self.total, 1), 1.0)
        elapsed = time.perf_counter() - self.started
        if self.tty:
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label[:50]:<50}")
            self.stream.flush()
        elif int(frac * 10) != self._last_plain:
            self._last_plain = int(frac * 10)
            self.stream.write(f"progress: {self.done}/{self.total} cases, {elapsed:.1f}s ({label})\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
