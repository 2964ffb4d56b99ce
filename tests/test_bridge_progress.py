"""Progress where stderr goes: a bar from the very start on a terminal, timed lines in a batch log."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.progress import Progress
from tests.bridge_workers import make_fixture

REPO = Path(__file__).resolve().parent.parent


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_in_a_log_every_5_percent_and_every_interval():
    """Was: without a terminal the Progress was silent until the end. Now: nothing for a quick run, then a line per
    5 % of the tensors and at least one per interval, and a closing line."""
    clock, log = _Clock(), io.StringIO()
    bar = Progress(desc="import", stream=log, interval=30, quiet=5, clock=clock)
    assert bar.mode == "lines"
    bar.start(200, 200 << 20)
    for _ in range(4):  # 2 % within the quiet start: nothing
        clock.now += 1
        bar.update(1 << 20)
    assert log.getvalue() == ""
    for _ in range(196):
        clock.now += 1
        bar.update(1 << 20)
    lines = log.getvalue().splitlines()
    assert lines[0] == "import: 2% (5/200 tensors, 0.01/0.21 GB, 0.00 GB/s, 5 s, ~195 s left)", lines  # quiet over
    assert [int(line.split("%")[0].split()[-1]) for line in lines] == [2, *range(5, 101, 5)]
    bar.close()
    assert log.getvalue().splitlines()[-1] == "import: done, 200 tensors, 0.21 GB in 200 s (0.00 GB/s)"

    # a stall: one line per interval even without a new 5 % step
    clock, log = _Clock(), io.StringIO()
    bar = Progress(desc="export", stream=log, interval=30, quiet=5, clock=clock)
    bar.start(1000, 1000)
    for _ in range(10):
        clock.now += 10
        bar.update(1)  # 1 % in 100 s
    assert len(log.getvalue().splitlines()) == 4  # at 10 s (first line), 40 s, 70 s, 100 s


def test_quick_runs_and_disabled_progress_stay_silent():
    clock, log = _Clock(), io.StringIO()
    bar = Progress(desc="import", stream=log, clock=clock)
    bar.start(3, 3)
    for _ in range(3):
        clock.now += 0.1
        bar.update(1)
    bar.close()
    off = Progress(desc="import", stream=log, enabled=False, clock=clock)
    off.start(3, 3)
    clock.now += 100
    off.update(3)
    off.close()
    assert log.getvalue() == ""


def _pty_run(argv: list[str]) -> list[tuple[float, str]]:
    """Run ``argv`` on a pseudo-terminal (120 columns); every piece of output between carriage returns / newlines
    with the time it arrived."""
    import fcntl
    import struct
    import termios

    t0 = time.monotonic()
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.environ["PYTHONPATH"] = str(REPO)
        os.execv(sys.executable, [sys.executable, *argv])
    pieces = []
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        for chunk in data.replace(b"\r", b"\n").split(b"\n"):
            if chunk.strip():
                pieces.append((time.monotonic() - t0, chunk.decode(errors="replace")))
    os.waitpid(pid, 0)
    return pieces


def test_the_bar_is_on_screen_from_the_start(tmp_path):
    """Was: on a terminal nothing for the first seconds (torch and megatron-core imports, reading the headers and
    planning the boxes: ~12 s on a real model), then the bar. Now a status line comes before any heavy import, and the
    bar says "preparing" before it counts."""
    src = make_fixture(tmp_path, "glm52")
    pieces = _pty_run(["-m", "bridge.cli", "convert", "import", "--hf-path", str(src), "--megatron-path",
                       str(tmp_path / "out")])
    texts = [t for _, t in pieces]
    first = lambda fragment: next(i for i, t in enumerate(texts) if fragment in t)  # noqa: E731
    assert texts[0] == "convert import: starting", texts[:3]
    assert first("convert import: starting") < first("import: preparing") < first("%|") < first("imported 186")
    assert pieces[0][0] < pieces[first("import: preparing")][0]


def test_a_batch_log_shows_a_long_conversion_moving(tmp_path):
    """Without a terminal (a log file), lines appear while the conversion runs; here the boxes are slowed down and
    the quiet start and the interval shortened so that the test runs in seconds."""
    src = make_fixture(tmp_path, "glm5")
    script = """
import sys, time
import bridge.progress as progress
import bridge.megatron_io as mio
progress.LINE_QUIET_S, progress.LINE_INTERVAL_S = 0.5, 1.0
resolve = mio._BoxPlanner.resolve_data
def slow(self, item):
    time.sleep(0.02)
    return resolve(self, item)
mio._BoxPlanner.resolve_data = slow
from bridge.cli import main
sys.exit(main(sys.argv[1:]))
"""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", script, "convert", "import", "--hf-path", str(src),
                               "--megatron-path", str(tmp_path / "out")], stdout=f, stderr=subprocess.STDOUT,
                              timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = log.read_text().splitlines()
    assert proc.returncode == 0, lines
    progress_lines = [line for line in lines if line.startswith("import: ") and "% (" in line]
    assert len(progress_lines) >= 5, lines
    assert re.fullmatch(r"import: done, \d+ tensors, 0\.01 GB in \d+ s \(.* GB/s\)", lines[-2]), lines[-2]
    assert lines[-1].startswith("imported 153 HF tensors")
