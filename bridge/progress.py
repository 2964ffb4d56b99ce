"""Progress of a conversion, counted in tensors with throughput in GB/s, in the form that fits where stderr goes.

* On a terminal: a tqdm bar, shown from the moment the conversion starts (``preparing`` while the checkpoint headers
  are read and the write plan is made, which takes seconds on a real model) and counting once :meth:`start` knows
  the totals.
* Anywhere else (a batch log, ``nohup``, a pipe): one line per 5 % of the tensors, and at least one every
  ``interval`` seconds while it runs, so a log shows a long conversion moving; nothing for runs shorter than
  ``quiet`` seconds (a quick conversion stays silent, as before) and a closing line if anything was printed.
* ``enabled=False`` (``--no-progress``): nothing.

``enabled=True`` forces the bar, ``None`` (the default) chooses by ``stream.isatty()``.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Callable, TextIO

LINE_INTERVAL_S = 30.0  # at most this long between two lines in a log
LINE_QUIET_S = 5.0  # no lines for runs shorter than this
LINE_STEP = 0.05  # one line per 5 % of the tensors

_open_bars: "weakref.WeakSet[Progress]" = weakref.WeakSet()


def end_bars() -> None:
    """End every bar still on screen (a run that failed): the CLI's one ``error:`` line then starts a line of its
    own instead of continuing the bar's."""
    for progress in list(_open_bars):
        progress.abort()


class Progress:
    def __init__(self, *, desc: str, total: int | None = None, total_bytes: int = 0, enabled: bool | None = None,
                 stream: TextIO | None = None, interval: float | None = None, quiet: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.stream = stream if stream is not None else sys.stderr
        tty = _isatty(self.stream)
        self.mode = "off" if enabled is False else "bar" if (enabled or tty) else "lines"
        self.enabled = self.mode != "off"
        self.desc, self.total, self.total_bytes = desc, total, total_bytes
        self.bytes = 0
        self.count = 0
        self.interval = LINE_INTERVAL_S if interval is None else interval
        self.quiet = LINE_QUIET_S if quiet is None else quiet
        self._clock = clock
        self._t0 = clock()
        self._last = 0.0  # last postfix refresh (bar) / last line (lines)
        self._step = -1  # last 5 % step printed
        self._printed = False
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc if total is not None else f"{desc}: preparing", unit="tensor",
                             dynamic_ncols=True, file=self.stream)
            _open_bars.add(self)

    @property
    def elapsed(self) -> float:
        return self._clock() - self._t0

    def start(self, total: int, total_bytes: int) -> None:
        """The totals, once the plan is known (the bar stops saying "preparing")."""
        self.total, self.total_bytes = total, total_bytes
        if self._bar is not None:
            self._bar.set_description_str(self.desc, refresh=False)
            self._bar.reset(total=total)

    def update(self, nbytes: int, n: int = 1) -> None:
        self.bytes += nbytes
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            now = self._clock()
            if now - self._last > 0.5:
                self._last = now
                self._bar.set_postfix_str(f"{self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, "
                                          f"{self._gbps():.2f} GB/s")
        elif self.mode == "lines":
            self._maybe_line()

    def _gbps(self) -> float:
        return self.bytes / max(self.elapsed, 1e-9) / 1e9

    def _maybe_line(self) -> None:
        now = self._clock()
        elapsed = now - self._t0
        if elapsed < self.quiet:
            return
        done = self.count / self.total if self.total else 0.0
        step = int(done / LINE_STEP + 1e-9)
        if step <= self._step and now - self._last < self.interval:
            return
        self._step, self._last = step, now
        left = f", ~{elapsed * (1 - done) / done:.0f} s left" if 0 < done < 1 else ""
        self._line(f"{self.desc}: {done:.0%} ({self.count}/{self.total} tensors, {self.bytes / 1e9:.2f}/"
                   f"{self.total_bytes / 1e9:.2f} GB, {self._gbps():.2f} GB/s, {elapsed:.0f} s{left})")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self._printed = True

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.bytes / 1e9:.2f} GB, {self._gbps():.2f} GB/s")
            self._bar.close()
            self._bar = None
        elif self.mode == "lines" and self._printed:
            self._line(f"{self.desc}: done, {self.count} tensors, {self.bytes / 1e9:.2f} GB in {self.elapsed:.0f} s "
                       f"({self._gbps():.2f} GB/s)")
            self._printed = False


    def abort(self) -> None:
        """The run failed: end the bar's line (the error goes on its own line); no closing line in a log."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._printed = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
