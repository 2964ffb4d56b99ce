"""``scripts/gpu_checks.sh``, the batched GPU session, checked on CPU: a typo there costs a device call. Every step
parses, and every test file, script and bench module it names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_checks.sh"


def test_gpu_checks_parses_and_names_existing_files():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    paths = set(re.findall(r"\b((?:tests|scripts|examples)/[\w/.-]+\.(?:py|sh))\b", text))
    assert len(paths) > 20, paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"gpu_checks.sh names files that do not exist: {missing}"


def test_every_step_in_the_case_is_documented_in_the_header():
    text = SCRIPT.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    steps = re.findall(r"^    ([a-z0-9_]+)\)", text, flags=re.M)
    assert "profile_dkv" in steps and "bench_dkv_packed" in steps
    undocumented = [s for s in steps if not re.search(rf"\b{s}\b", header)]
    assert not undocumented, f"steps without a line in gpu_checks.sh's header: {undocumented}"
