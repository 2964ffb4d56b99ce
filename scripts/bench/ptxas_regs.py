"""Registers and spills of a TileLang kernel, per ``ptxas -v``, on a machine without a GPU.

Builds one factory's kernel for sm_90a (TileLang and nvcc only), writes its CUDA source and compiles that to a cubin
with ``-Xptxas -v``: register counts, spill stores / loads and wgmma serialisation warnings come back before any
device time is spent (how the forward's register splits were screened: ``docs/design/kernels_round2.md``).

    python scripts/bench/ptxas_regs.py megatron_glm5.kernels.sparse_mla_fwd _jit_fwd_pp 64 576 512 0.0625
    python scripts/bench/ptxas_regs.py megatron_glm5.kernels.sparse_mla_fwd _jit_fwd_pp 64 576 512 0.0625 \\
        --kw 'nreg=(208, 216, 80)'
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import subprocess
import sys
import tempfile


def tilelang_includes() -> list[str]:
    import tilelang

    root = os.path.dirname(tilelang.__file__)
    return [os.path.join(root, "src"), os.path.join(root, "src", "tl_templates"),
            os.path.join(root, "3rdparty", "cutlass", "include")]


def ptxas_report(module: str, getter: str, args: list, kwargs: dict, keep: str | None = None) -> str:
    """The ``ptxas -v`` lines (and warnings) of the kernel ``getattr(module, getter)()(*args, **kwargs)``."""
    os.environ.setdefault("TILELANG_DEFAULT_TARGET", '{"kind": "cuda", "arch": "sm_90a"}')
    kernel = getattr(importlib.import_module(module), getter)()(*args, **kwargs)
    src = kernel.get_kernel_source()
    with tempfile.TemporaryDirectory() as tmp:
        if keep:
            os.makedirs(keep, exist_ok=True)
        path = os.path.join(keep or tmp, "kernel.cu")
        with open(path, "w") as f:
            f.write(src)
        cmd = ["nvcc", "-cubin", "-arch=sm_90a", "-std=c++20", "-O3", "-Xptxas", "-v", "-w",
               "--expt-relaxed-constexpr", "-DNDEBUG", "-o", os.path.join(tmp, "k.cubin"), path]
        cmd += [f"-I{p}" for p in tilelang_includes()]
        res = subprocess.run(cmd, capture_output=True, text=True)
    out = res.stdout + res.stderr
    lines = [ln for ln in out.splitlines() if ln.strip() and "Compile time" not in ln]
    return "\n".join(lines) + ("" if res.returncode == 0 else f"\nnvcc exit {res.returncode}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module")
    ap.add_argument("getter")
    ap.add_argument("args", nargs="*", help="positional factory arguments (Python literals)")
    ap.add_argument("--kw", action="append", default=[], help="name=literal keyword argument (repeatable)")
    ap.add_argument("--keep", default=None, help="write kernel.cu into this folder")
    a = ap.parse_args()
    args = [ast.literal_eval(x) for x in a.args]
    kwargs = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in a.kw)}
    print(ptxas_report(a.module, a.getter, args, kwargs, a.keep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
