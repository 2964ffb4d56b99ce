"""A tqdm progress bar counting tensors with throughput in GB/s; silent when not on a TTY or when disabled."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, *, total: int, total_bytes: int, desc: str, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total_bytes = total_bytes
        self.bytes = 0
        self.count = 0
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="tensor", dynamic_ncols=True, file=sys.stderr)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def update(self, nbytes: int, n: int = 1) -> None:
        self.bytes += nbytes
        self.count += n
        if self._bar is None:
            return
        self._bar.update(n)
        now = time.perf_counter()
        if now - self._last > 0.5:
            self._last = now
            gbps = self.bytes / max(self.elapsed, 1e-9) / 1e9
            self._bar.set_postfix_str(f"{self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, {gbps:.2f} GB/s")

    def close(self) -> None:
        if self._bar is not None:
            gbps = self.bytes / max(self.elapsed, 1e-9) / 1e9
            self._bar.set_postfix_str(f"{self.bytes / 1e9:.2f} GB, {gbps:.2f} GB/s")
            self._bar.close()
            self._bar = None
