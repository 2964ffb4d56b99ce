"""Read ahead on a background thread, with bounded memory, so that reading the source overlaps writing the output.

A conversion is a loop of "read some tensors, write some tensors". Done in one thread the disk alternates between the
two and the run takes the *sum* of read and write time. :class:`Prefetcher` is told the reads in advance (the plan is
known from metadata) and performs them on one background thread, at most ``budget`` bytes ahead of the consumer;
file reads and writes release the GIL, so the run takes about the *larger* of the two. The consumer asks for reads
by key, in plan order; a read that is not where the plan said (or a failed background read) is simply done in the
caller's thread, so a wrong plan costs speed, never correctness.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Hashable, Sequence, TypeVar

import torch

K = TypeVar("K", bound=Hashable)

_WINDOW = 64  # how far past the current position a key is looked up in the plan


class Prefetcher(Generic[K]):
    def __init__(self, fetch: Callable[[K], torch.Tensor], plan: Sequence[tuple[K, int]], *, budget: int = 256 << 20):
        self._fetch = fetch
        self._plan = list(plan)  # (key, expected bytes)
        self._budget = budget
        self._ready: dict[int, torch.Tensor] = {}
        self._held = 0  # bytes in _ready
        self._pos = 0  # next plan index the consumer may ask for
        self._done_upto = 0  # the thread has fetched plan[:_done_upto]
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="bridge-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i, (key, nbytes) in enumerate(self._plan):
            with self._cond:
                while not self._stop and i >= self._pos and self._ready and self._held + nbytes > self._budget:
                    self._cond.wait()
                if self._stop:
                    return
                if i < self._pos:  # the consumer is already past this one
                    self._done_upto = i + 1
                    continue
            try:
                t = self._fetch(key)
            except BaseException as e:  # the consumer will redo this read itself and see the error there
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                if i >= self._pos:
                    self._ready[i] = t
                    self._held += nbytes
                self._done_upto = i + 1
                self._cond.notify_all()

    def get(self, key: K) -> torch.Tensor:
        with self._cond:
            end = min(len(self._plan), self._pos + _WINDOW)
            idx = next((i for i in range(self._pos, end) if self._plan[i][0] == key), None)
            if idx is not None:
                for j in [j for j in self._ready if j < idx]:  # planned reads the consumer skipped
                    self._held -= self._plan[j][1]
                    del self._ready[j]
                self._pos = idx  # frees the thread if it was waiting for budget held by skipped reads
                self._cond.notify_all()
                while idx >= self._done_upto and self._error is None and self._thread.is_alive():
                    self._cond.wait()
                t = self._ready.pop(idx, None)
                if t is not None:
                    self._held -= self._plan[idx][1]
                self._pos = idx + 1
                self._cond.notify_all()
                if t is not None:
                    return t
        return self._fetch(key)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._ready.clear()
            self._held = 0
            self._cond.notify_all()
        self._thread.join()
