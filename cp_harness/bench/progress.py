"""Progress lines on stderr while the benchmark runs; the tables and the report go to the report stream."""

from __future__ import annotations

import sys
import time


def log(message: str) -> None:
    """A timestamped progress line on stderr."""
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()
