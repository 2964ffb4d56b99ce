"""``scripts/tl_cache.py``: a TileLang kernel cache packed on a machine without a GPU and loaded elsewhere. The round
trip is checked here on the CPU (sm_90a, as the compile tests build): the archive holds the kernel, and a process
that loads it with ``env``'s exports gets the kernel from the cache instead of compiling it (on the device machine
too: the script's docstring)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "tl_cache.py"
# a small kernel, built as tests/test_kernels_compile.py builds "delta_glm"
BUILD = ("import sys, time; sys.path.insert(0, {repo!r}); t = time.time(); "
         "from megatron_glm5.kernels.sparse_mla_bwd import _jit_delta; _jit_delta()(64, 512); "
         "print('seconds', time.time() - t)")

_NVCC = shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def _run(args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO)


def test_build_then_env_serves_the_kernel_from_the_archive(tmp_path):
    pytest.importorskip("tilelang")
    if not _NVCC:
        pytest.skip("nvcc not found: TileLang needs it to build kernels")
    archive = tmp_path / "k.tar.xz"
    code = BUILD.format(repo=str(REPO))
    res = _run(["build", str(archive), "--", sys.executable, "-c", code])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "1 kernels" in res.stdout
    with tarfile.open(archive, "r:xz") as tar:
        assert any(n.endswith("executable.so") for n in tar.getnames())

    exports = _run(["env", str(archive), "--dir", str(tmp_path / "x")])
    assert exports.returncode == 0, exports.stderr
    env = dict(os.environ)
    for word in shlex.split(exports.stdout.split("export ", 1)[1].splitlines()[0]):
        key, value = word.split("=", 1)
        env[key] = value
    assert env["TILELANG_CACHE_DIR"] == str(tmp_path / "x" / "cache")
    assert env["TILELANG_DEFAULT_TARGET"] == '{"kind": "cuda", "arch": "sm_90a"}'
    # a hit writes nothing new into the cache: the unpacked entry is the only one
    before = sorted(p.parent.name for p in (tmp_path / "x").rglob("executable.so"))
    hit = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert hit.returncode == 0, hit.stderr[-2000:]
    assert "begins to compile" not in hit.stdout + hit.stderr  # TileLang's log line of a cache miss
    assert sorted(p.parent.name for p in (tmp_path / "x").rglob("executable.so")) == before


def test_build_refuses_a_command_that_builds_nothing_and_keeps_the_old_archive(tmp_path):
    archive = tmp_path / "k.tar.xz"
    archive.write_bytes(b"older archive")
    res = _run(["build", str(archive), "--", sys.executable, "-c", "pass"])
    assert res.returncode != 0 and res.stderr.startswith("error: ") and "built no kernel" in res.stderr
    assert archive.read_bytes() == b"older archive"
    bare = _run(["build", str(archive)])  # no command
    assert bare.returncode == 2 and bare.stderr.startswith("error: ")


def test_env_without_an_archive_says_so_and_exports_nothing(tmp_path):
    res = _run(["env", str(tmp_path / "missing.tar.xz")])
    assert res.returncode == 0 and "export" not in res.stdout and "will be compiled" in res.stdout
