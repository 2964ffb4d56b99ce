"""A TileLang kernel cache built on this machine (no GPU) for the device machine, so that a fresh device call need not
spend its first minutes in the JIT (a cold ``precompile`` took 95-134 s of a 30-minute budget per fresh machine).

Why it works: TileLang 0.1.15 keys a compiled kernel on disk by the kernel's TIR, the target, the pass configs, the
execution backend and its own version, not by the factory's arguments, the machine or the install path
(``KernelCache._generate_key``; ``tilelang.jit`` passes no arguments to it), and a cached kernel is a self-contained
``executable.so`` (it needs only libc) with its parameters. Built here with the explicit sm_90a target the CPU tools
use and loaded there with the same ``TILELANG_DEFAULT_TARGET``, the keys agree: on the H200 a fresh call's
precompile took 17-27 s instead of 95-134 s (issue 22, twelfth session). A stale archive only misses (that kernel
compiles as before).

    # here: build what a command builds (the same precompile the device call runs builds the same kernels)
    python scripts/tl_cache.py build .tlcache/dkv.tar.xz -- \\
        python scripts/bench/bench_dkv_key_blocks.py --precompile-only --workers 2
    # there (carry .tlcache; .git/info/exclude ignores it), before anything that builds kernels:
    eval "$(python3 scripts/tl_cache.py env .tlcache/dkv.tar.xz)"
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SM90 = '{"kind": "cuda", "arch": "sm_90a"}'  # as tests/test_kernels_compile.py and scripts/ptxas_regs.py build
DEFAULT_DIR = "/tmp/tlcache"


def _kernels(root: Path) -> int:
    return sum(1 for p in root.rglob("executable.so"))


def build(archive: str, command: list[str]) -> int:
    """Run ``command`` with a fresh TileLang cache and the sm_90a target, then pack that cache into ``archive``
    (xz tar; written beside it first and moved into place, so a failed run leaves any older archive as it was)."""
    if not command:
        print("error: tl_cache build: no command after --", file=sys.stderr)
        return 2
    out = Path(archive)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp, "cache")
        env = dict(os.environ, TILELANG_CACHE_DIR=str(cache), TILELANG_DEFAULT_TARGET=SM90)
        rc = subprocess.run(command, env=env).returncode
        n = _kernels(cache) if cache.exists() else 0
        if n == 0:
            print(f"error: tl_cache build: the command ({shlex.join(command)}) built no kernel (exit {rc}); {out} "
                  "left as it was", file=sys.stderr)
            return rc or 1
        part = out.with_name(out.name + ".part")
        with tarfile.open(part, "w:xz") as tar:
            tar.add(cache, arcname="cache")
        part.replace(out)
    print(f"tl_cache build: {n} kernels, {out.stat().st_size / 2**20:.1f} MiB in {out} (command exit {rc})")
    return rc


def env_lines(archive: str, directory: str = DEFAULT_DIR) -> int:
    """Unpack ``archive`` into ``directory`` and print the shell exports that make TileLang use it."""
    if not Path(archive).is_file():
        print(f"echo 'tl_cache: no archive {archive}: kernels will be compiled' >&2")
        return 0
    Path(directory).mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(directory, filter="data")
    cache = Path(directory, "cache")
    print(f"export TILELANG_CACHE_DIR={shlex.quote(str(cache))} TILELANG_DEFAULT_TARGET={shlex.quote(SM90)}")
    print(f"echo 'tl_cache: {_kernels(cache)} kernels from {archive}' >&2")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="run a command (after --) with a fresh cache and pack the cache")
    b.add_argument("archive")
    e = sub.add_parser("env", help="unpack an archive and print the exports that use it")
    e.add_argument("archive")
    e.add_argument("--dir", default=DEFAULT_DIR)
    a = ap.parse_args(argv)
    if a.what == "build":
        return build(a.archive, command)
    return env_lines(a.archive, a.dir)


if __name__ == "__main__":
    sys.exit(main())
