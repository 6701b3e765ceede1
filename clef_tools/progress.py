"""Progress on stderr: a tqdm bar (rate, ETA) on a terminal, plain `N/M` lines otherwise.

A bar redraws its line in place, which a log file or a CI console turns into one long line of
carriage returns; those get a whole line every `interval` seconds instead, which reads well in
a log and can be followed with `tail -f`. tqdm comes with the `plot` extra; without it a
terminal gets the plain lines too.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Counts finished items out of `total`, starting from `initial` (resumed work)."""

    def __init__(self, label: str, total: int, *, initial: int = 0, unit: str = "req",
                 interval: float = 10.0, stream: TextIO | None = None,
                 bar: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._label = label
        self.total = total
        self.count = initial
        # The rate counts from the first item: start-up (a worker's load and warm-up, the first
        # connection) is not throughput.
        self._first: tuple[float, int] | None = None
        self._interval = interval
        self._last_line = time.monotonic()
        use_bar = self._stream.isatty() if bar is None else bar
        self._bar: Any = None
        if use_bar:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, initial=initial, desc=label, unit=unit,
                             file=self._stream, dynamic_ncols=True, smoothing=0.1)

    def update(self, n: int = 1) -> None:
        if self._first is None:
            self._first = (time.monotonic(), self.count + n)
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_line >= self._interval:
            self._last_line = now
            self._line(now)

    def write(self, message: str) -> None:
        """A message that does not break the bar."""
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        else:
            print(message, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        since, base = self._first or (now, self.count)
        rate = (self.count - base) / max(now - since, 1e-9)
        print(f"{self._label}: {self.count}/{self.total} ({rate:.1f}/s)", file=self._stream,
              flush=True)
