"""Shared pieces of the Triton kernel tests (CPU): run a script in Triton's interpreter in a subprocess (so no other
test sees ``TRITON_INTERPRET``), load a mutated copy of a kernel module there (mutation checks), compile a kernel to
an sm_90 cubin with Triton's own ptxas (no GPU needed)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
MUTANT_ENV = "MEGATRON_GLM5_TEST_MUTANT_MODULE"


def run_in_interpreter(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c script args`` with ``TRITON_INTERPRET=1``, the repo on the path and ``env`` added; output printed
    (pytest shows it on failure)."""
    full = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **env)
    r = subprocess.run([sys.executable, "-c", script, *args], env=full, capture_output=True, text=True, timeout=900)
    print(r.stdout[-3000:], r.stderr[-3000:])
    return r


def passed(r: subprocess.CompletedProcess) -> bool:
    """The script ran to its final ``OK``."""
    return r.returncode == 0 and r.stdout.rstrip().endswith("OK")


def mutant_env(tmp_path: Path, module: str, needle: str, replacement: str) -> dict[str, str]:
    """The environment that makes :func:`kernel_module` load ``megatron_glm5/kernels/<module>.py`` with ``needle``
    (which must occur) replaced."""
    source = (REPO / "megatron_glm5" / "kernels" / f"{module}.py").read_text()
    assert needle in source, f"{needle!r} not in kernels/{module}.py: update the mutation check"
    path = tmp_path / f"mutant_{module}.py"
    path.write_text(source.replace(needle, replacement))
    return {MUTANT_ENV: str(path)}


def kernel_module(name: str) -> ModuleType:
    """``megatron_glm5.kernels.<name>``, or the mutated copy :func:`mutant_env` named (inside the subprocess)."""
    path = os.environ.get(MUTANT_ENV)
    if not path:
        return importlib.import_module(f"megatron_glm5.kernels.{name}")
    spec = importlib.util.spec_from_file_location(f"mutant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object], num_warps: int = 4) -> str:
    """Compile one ``@triton.jit`` kernel for sm_90 on this CPU machine (catches what the interpreter lets through:
    types that differ between branches, unsupported ops); constexprs the kernel does not take are dropped. Returns
    the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    const = {n: v for n, v in constexprs.items() if n in kernel.arg_names}
    sig = {n: ("constexpr" if n in const else signature[n]) for n in kernel.arg_names}
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=const),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm.get("cubin"), f"{kernel.fn.__name__}: no cubin"
    return compiled.asm["ptx"]
