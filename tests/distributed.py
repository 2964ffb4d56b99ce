"""Run a test body under ``torchrun --nproc-per-node N`` (gloo on CPU) and collect each rank's result.

A body is a module-level function ``fn(rank: int, world_size: int, **kwargs) -> dict`` (JSON-serialisable). The
entry point (``tests/_torchrun_entry.py``) initialises gloo, turns on the library's CPU mode, calls the function and
writes ``rank{r}.json``; this helper fails the test with the ranks' stderr when any rank fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_glm5.parallel import free_port

REPO = Path(__file__).resolve().parent.parent


def run_torchrun(target: str, tmp_path: Path, *, nproc: int = 2, timeout: int = 600, **kwargs) -> list[dict]:
    """``target`` is ``"tests.module:function"``. Returns the per-rank result dicts, rank order."""
    out_dir = Path(tmp_path) / f"torchrun_{target.replace(':', '_').replace('.', '_')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
               GLM5_TORCHRUN_DUMP_AFTER=str(max(1, timeout - 20)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(REPO / "tests" / "_torchrun_entry.py"), target, str(out_dir), json.dumps(kwargs),
    ]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a collective that one rank never joined: show where they were
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"torchrun {target} ran past {timeout} s\n--- stdout ---\n{out[-4000:]}\n"
                             f"--- stderr ---\n{err[-8000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {target} failed (rc={proc.returncode})\n--- stdout ---\n{proc.stdout[-6000:]}\n"
            f"--- stderr ---\n{proc.stderr[-12000:]}"
        )
    results = []
    for r in range(nproc):
        f = out_dir / f"rank{r}.json"
        assert f.is_file(), f"rank {r} wrote no result ({f})\n{proc.stderr[-4000:]}"
        results.append(json.loads(f.read_text()))
    return results
