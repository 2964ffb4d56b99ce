"""The fused Triton RMSNorm (:mod:`megatron_glm5.kernels.rms_norm`) against its torch oracle, forward and backward,
on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set in a subprocess so no other test sees it). The
interpreter rounds fp32 -> bf16 differently from the GPU (not to nearest even; measured: one or two ulps off), so the
bounds here are a few bf16 ulps of each tensor's scale: they catch a wrong formula or a wrong row / stride, not
rounding. The GPU check of the same kernels is bitwise up to rare one-ulp flips (tests/gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import torch
    from megatron_glm5.kernels.rms_norm import rms_norm, rms_norm_reference, rms_norm_supported

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    torch.manual_seed(0)
    for shape, n, view in [((5, 3), 96, False), ((7,), 40, False), ((4, 2), 24, True), ((0, 3), 32, False)]:
        base = torch.randn(*shape, n + (8 if view else 0)) * 3
        x = (base[..., :n] if view else base).bfloat16()  # a strided view: rows of n + 8, last dim contiguous
        w = (1 + 0.2 * torch.randn(n)).bfloat16()
        dy = torch.randn(*shape, n).bfloat16()
        assert rms_norm_supported(x, w)
        xs = [x.detach().clone().requires_grad_() for _ in range(2)]
        ws = [w.detach().clone().requires_grad_() for _ in range(2)]
        y = rms_norm(xs[0], ws[0], 1e-5)
        ref = rms_norm_reference(xs[1], ws[1], 1e-5)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        y.backward(dy)
        ref.backward(dy)
        if x.numel() == 0:
            assert xs[0].grad.shape == x.shape and ws[0].grad.abs().sum() == 0
            continue
        errs = (rel(y, ref), rel(xs[0].grad, xs[1].grad), rel(ws[0].grad, ws[1].grad))
        print("shape", tuple(x.shape), "view" if view else "", "y %.1e dx %.1e dw %.1e" % errs)
        assert max(errs) < 0.03, errs  # a few bf16 ulps of the scale (the interpreter's rounding)
    # a wrong eps is seen: the comparison is not vacuous
    x = torch.full((2, 16), 1e-3).bfloat16()
    w = torch.ones(16).bfloat16()
    assert rel(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)) < 0.03
    assert rel(rms_norm(x, w, 1e-1), rms_norm_reference(x, w, 1e-5)) > 0.5
    print("OK")
''')


def test_fused_rms_norm_matches_torch_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0 and r.stdout.strip().endswith("OK")


def test_torch_norm_takes_the_kernel_by_default_and_the_reference_on_cpu(monkeypatch):
    """TorchNorm's RMSNorm is fused unless MEGATRON_GLM5_FUSED_RMSNORM=0; on a CPU tensor (no interpreter) the kernel
    does not apply and the oracle expression runs."""
    from types import SimpleNamespace

    from megatron_glm5.kernels.rms_norm import rms_norm_reference
    from megatron_glm5.providers import FUSED_RMSNORM_ENV, TorchNorm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = SimpleNamespace(normalization="RMSNorm", params_dtype=torch.bfloat16, sequence_parallel=False)
    x = torch.randn(3, 5, 64).bfloat16()
    monkeypatch.setenv(FUSED_RMSNORM_ENV, "0")
    norm = TorchNorm(cfg, 64, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    assert not norm.fused
    assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, 1e-6))
    monkeypatch.delenv(FUSED_RMSNORM_ENV)
    assert TorchNorm(cfg, 64).fused
    fused = TorchNorm(cfg, 64, eps=1e-6)
    fused.load_state_dict(norm.state_dict())
    assert torch.equal(fused(x), norm(x))  # on CPU (no interpreter) the kernel does not apply: same torch path
