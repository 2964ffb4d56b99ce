"""GLM-5.3-Flash's mHC kernels against their fp32 torch oracles, on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, set in a subprocess so no other test sees it):

* the stream mix (:mod:`megatron_glm5.kernels.stream_mix`): GLM-5.3-Flash's two mixes (``u``: one output row from 4
  streams with fp32 weights; the merge: 4 x 4 with the sublayer output), a stream count that is not a power of two,
  widths that are not a multiple of the kernel's column block, two leading dims; fp32 agrees to rounding (summation
  orders differ), bf16 within two ulps of the result's scale (the interpreter rounds fp32 -> bf16 by truncation, the
  GPU to nearest);
* the coefficients (:mod:`megatron_glm5.kernels.mhc_coefficients`): ``pre`` / ``post`` / Sinkhorn ``comb`` and the
  gradients to the projection, ``base`` and ``scale``, at 1, 3 and 20 Sinkhorn iterations, a token count that is
  not a multiple of the block, 3 streams, and with only ``comb`` used downstream;
* both inside :class:`~megatron_glm5.glm5_next.mhc.HyperConnection` (``MEGATRON_GLM5_MHC_KERNEL`` = ``auto`` and
  ``fused``) against its torch expressions (``torch``): outputs and every gradient.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import os
    import torch
    from megatron_glm5.kernels.stream_mix import stream_mix, stream_mix_reference, stream_mix_supported

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()

    torch.manual_seed(0)
    cases = [((3, 2), 4, 4, 300, True, torch.float32, torch.float32),
             ((5,), 4, 1, 257, False, torch.float32, torch.float32),  # u: fp32 weights, no y
             ((7,), 3, 3, 64, True, torch.float32, torch.float32),    # N not a power of two
             ((2, 3), 4, 4, 520, True, torch.bfloat16, torch.bfloat16),
             ((6,), 4, 1, 256, False, torch.bfloat16, torch.float32)]
    for lead, n, o, h, has_y, dt, a_dt in cases:
        x = torch.randn(*lead, n * h, dtype=dt, requires_grad=True)
        a = torch.randn(*lead, o, n, dtype=a_dt, requires_grad=True)
        b = torch.randn(*lead, o, dtype=dt, requires_grad=True) if has_y else None
        y = torch.randn(*lead, h, dtype=dt, requires_grad=True) if has_y else None
        assert stream_mix_supported(x)
        inputs = [t for t in (x, a, b, y) if t is not None]
        out = stream_mix(x, a, b, y)
        ref = stream_mix_reference(x, a, b, y)
        assert out.shape == ref.shape == (*lead, o * h) and out.dtype == dt
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, g)
        want = torch.autograd.grad(ref, inputs, g)
        tol = 2e-6 if dt == torch.float32 else 2 * 2 ** -7
        errs = [rel(out, ref)] + [rel(p, q) for p, q in zip(got, want)]
        assert all(p.dtype == q.dtype and p.shape == q.shape for p, q in zip(got, inputs))
        assert max(errs) <= tol, (lead, n, o, h, dt, errs)
        print("case", lead, n, o, h, has_y, dt, ["%.1e" % e for e in errs])
    # deterministic: the weight gradients are fixed-order sums
    x = torch.randn(64, 4 * 300, requires_grad=True)
    a = torch.randn(64, 4, 4, requires_grad=True)
    g1 = torch.autograd.grad(stream_mix(x, a), [x, a], torch.ones(64, 4 * 300))
    g2 = torch.autograd.grad(stream_mix(x, a), [x, a], torch.ones(64, 4 * 300))
    assert all(torch.equal(p, q) for p, q in zip(g1, g2))
    try:
        stream_mix(x, a, torch.ones(64, 4))
        raise AssertionError("b without y accepted")
    except ValueError:
        pass
    try:
        stream_mix(torch.ones(64, 1201), a)
        raise AssertionError("x of a width that is not N * h accepted")
    except ValueError:
        pass

    from megatron_glm5.kernels.mhc_coefficients import (mhc_coefficients, mhc_coefficients_reference,
                                                        mhc_coefficients_supported)

    for t_len, n, iters in ((37, 4, 20), (5, 3, 3), (33, 4, 1)):
        rows = (2 + n) * n
        z = (torch.randn(t_len, rows) * 2).requires_grad_()
        base = torch.randn(rows).requires_grad_()
        scale = (torch.rand(3) + 0.5).requires_grad_()
        assert mhc_coefficients_supported(z)
        got = mhc_coefficients(z, base, scale, n, iters, 1e-6)
        ref = mhc_coefficients_reference(z, base, scale, n, iters, 1e-6)
        assert [tuple(g.shape) for g in got] == [(t_len, n), (t_len, n), (t_len, n, n)]
        ups = [torch.randn_like(r) for r in ref]
        errs = [rel(a, b) for a, b in zip(got, ref)]
        errs += [rel(a, b) for a, b in zip(torch.autograd.grad(got, [z, base, scale], ups),
                                           torch.autograd.grad(ref, [z, base, scale], ups))]
        w = torch.randn(t_len, n, n)  # comb only (pre / post get no gradient)
        errs += [rel(a, b) for a, b in zip(
            torch.autograd.grad((mhc_coefficients(z, base, scale, n, iters, 1e-6)[2] * w).sum(), [z, base, scale]),
            torch.autograd.grad((mhc_coefficients_reference(z, base, scale, n, iters, 1e-6)[2] * w).sum(),
                                [z, base, scale]))]
        assert max(errs) <= 1e-5, (t_len, n, iters, errs)
        print("coefficients", t_len, n, iters, ["%.1e" % e for e in errs])

    # inside HyperConnection: the kernels (auto: stream mix; fused: also the coefficients) against the torch path
    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.glm5_next.config import parse_glm5_next_config
    from megatron_glm5.glm5_next.mcore_config import build_transformer_config
    from megatron_glm5.glm5_next.mhc import MHC_KERNEL_ENV, HyperConnection
    from megatron_glm5.glm5_next.testing import small_flash_config

    arch = parse_glm5_next_config({"model_type": "glm5_next", **small_flash_config()})
    for dt, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        cfg = build_transformer_config(arch, RuntimePolicy(params_dtype=dt, use_cpu_initialization=True))
        torch.manual_seed(1)
        hc = HyperConnection(cfg)
        with torch.no_grad():
            hc.base.normal_(0, 0.5)  # non-uniform coefficients
        h = arch.hidden_size
        streams = torch.randn(5, 2, 4 * h, dtype=dt)
        y = torch.randn(5, 2, h, dtype=dt)
        runs = {}
        for choice in ("torch", "auto", "fused"):
            os.environ[MHC_KERNEL_ENV] = choice
            hc.zero_grad(set_to_none=True)
            s, yy = streams.clone().requires_grad_(), y.clone().requires_grad_()
            post, comb, u = hc(s)
            out = hc.merge(yy, post, comb, s)
            ((out.float() * torch.linspace(-1, 1, out.shape[-1])).sum() + (u.float() ** 2).sum()).backward()
            runs[choice] = {"u": u, "out": out, "ds": s.grad, "dy": yy.grad,
                            **{n: p.grad for n, p in hc.named_parameters()}}
        for choice in ("auto", "fused"):
            errs = {k: rel(runs[choice][k], v) for k, v in runs["torch"].items()}
            assert set(errs) == {"u", "out", "ds", "dy", "fn", "base", "scale"}, errs
            assert max(errs.values()) <= tol, (dt, choice, errs)
            print("HyperConnection", choice, dt, {k: "%.1e" % v for k, v in errs.items()})
    os.environ[MHC_KERNEL_ENV] = "triton"
    try:
        hc(streams)
        raise AssertionError("a bad MEGATRON_GLM5_MHC_KERNEL accepted")
    except ValueError as e:
        assert MHC_KERNEL_ENV in str(e)
    print("OK")
''')


def test_mhc_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("MEGATRON_GLM5_MHC_KERNEL", None)
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-3000:] + r.stderr[-3000:]


def test_cpu_runs_the_torch_expressions(monkeypatch):
    """Without the interpreter a CPU tensor takes the torch path (no Triton launch on CPU)."""
    import torch

    from megatron_glm5.kernels.mhc_coefficients import mhc_coefficients_supported
    from megatron_glm5.kernels.stream_mix import stream_mix_supported

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not stream_mix_supported(torch.ones(2, 8)) and not mhc_coefficients_supported(torch.ones(2, 24))


@pytest.mark.parametrize("case", ["stream_mix_merge", "stream_mix_u", "coefficients"])
def test_mhc_kernels_compile_for_sm90(case):
    """Both directions of each mHC kernel compile to an sm_90 cubin on this CPU machine (Triton's own ptxas; no GPU):
    catches what the interpreter lets through (types that differ between branches, unsupported ops)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from megatron_glm5.kernels import mhc_coefficients, stream_mix

    if case == "coefficients":
        kernels = mhc_coefficients._kernels()
        const = {"N": 4, "NP": 4, "BT": mhc_coefficients.BLOCK_T}
        scalars = {"T": "i32", "iters": "i32", "eps": "fp32"}
        ptr = "*fp32"
    else:
        kernels = stream_mix._kernels()
        has_y, o = (True, 4) if case == "stream_mix_merge" else (False, 1)
        const = {"N": 4, "O": o, "NP": 4, "OP": o, "HAS_Y": has_y, "BLOCK": stream_mix.BLOCK_H}
        scalars = {"H": "i32"}
        ptr = "*bf16"
    for kernel in kernels:
        names = kernel.arg_names
        sig = {n: "constexpr" if n in const else scalars.get(n, ptr) for n in names}
        if case != "coefficients":  # the u mix's weights and every weight gradient are fp32 buffers
            sig.update({n: "*fp32" for n in ("DA", "DB") if n in sig})
            if case == "stream_mix_u":
                sig["A"] = "*fp32"
        compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=const),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm.get("cubin"), f"{kernel.fn.__name__}: no cubin"
