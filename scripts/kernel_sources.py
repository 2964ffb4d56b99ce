"""Dump the generated CUDA of every TileLang kernel variant that ``tests/test_kernels_compile.py`` builds (sm_90a, no
GPU needed), or compare two dumps: a refactor of kernel code that leaves every file identical cannot change what runs.

    python scripts/kernel_sources.py dump OUT_DIR [--workers 2]
    python scripts/kernel_sources.py compare BEFORE_DIR AFTER_DIR

``compare`` treats files that differ only in the numbering of TileLang's reduction workspaces (``workspace``,
``workspace_1``, ...) as identical up to those names and says so; it exits 1 on any other difference.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import multiprocessing as mp
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SM90 = '{"kind": "cuda", "arch": "sm_90a"}'


def _dump_one(job: tuple[str, str, str, tuple, str]) -> str:
    case, module, getter, args, out = job
    os.environ["TILELANG_DEFAULT_TARGET"] = SM90
    sys.path.insert(0, str(REPO))
    kernel = getattr(importlib.import_module(module), getter)()(*args)
    Path(out, f"{case}.cu").write_text(kernel.get_kernel_source())
    return case


def dump(out: str, workers: int) -> int:
    sys.path.insert(0, str(REPO))
    from tests.test_kernels_compile import COMPILE_CASES

    Path(out).mkdir(parents=True, exist_ok=True)
    jobs = [(case, module, getter, args, out) for case, (module, getter, args) in COMPILE_CASES.items()]
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for case in pool.map(_dump_one, jobs):
            print(f"dumped {case}", flush=True)
    return 0


def compare(before: str, after: str) -> int:
    names = sorted({p.name for p in Path(before).glob("*.cu")} | {p.name for p in Path(after).glob("*.cu")})
    bad = 0
    for name in names:
        a, b = Path(before, name), Path(after, name)
        if not (a.exists() and b.exists()):
            print(f"MISSING {name} in {'after' if a.exists() else 'before'}")
            bad += 1
            continue
        ta, tb = a.read_text(), b.read_text()
        if ta == tb:
            print(f"same     {name}")
        elif re.sub(r"workspace(_\d+)?", "workspace", ta) == re.sub(r"workspace(_\d+)?", "workspace", tb):
            print(f"same up to workspace names  {name}")
        else:
            print(f"DIFFERENT {name}")
            bad += 1
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--workers", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args()
    return dump(args.out, args.workers) if args.cmd == "dump" else compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
