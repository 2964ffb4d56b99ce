"""The fused Triton SwiGLU (``megatron_glm5.kernels.swiglu``) on the GPU, at the GLM-5 slice's shapes (routed experts:
65536 rows x 2 x 2048, weighted by the routing probabilities; dense FFN: 8192 x 2 x 12288): against its fp32 oracle
(bitwise in bf16 but for rare one-ulp flips of fp32 ``exp``), against megatron-core's eager functions (which round
``silu(a)`` before the product: a few ulps), and its time against megatron-core's eager path (printed)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.kernels.swiglu import (
    swiglu,
    swiglu_reference,
    swiglu_supported,
    weighted_swiglu,
    weighted_swiglu_reference,
)

pytestmark = pytest.mark.gpu


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.contiguous().view(torch.int16).int() - b.contiguous().view(torch.int16).int()).abs()


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _inputs(rows: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = (torch.randn(rows, 2 * n, device="cuda", generator=g) * 2).bfloat16()
    w = torch.rand(rows, 1, device="cuda", generator=g)
    dout = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    return y, w, dout


@pytest.mark.parametrize("rows,n,weighted", [(65536, 2048, True), (8192, 12288, False), (65536, 2048, False)])
def test_fused_swiglu_matches_oracle(rows, n, weighted):
    y, w, dout = _inputs(rows, n, n + weighted)
    assert swiglu_supported(y, w if weighted else None)
    ys = [y.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    out = weighted_swiglu(ys[0], ws[0]) if weighted else swiglu(ys[0])
    ref = weighted_swiglu_reference(ys[1], ws[1]) if weighted else swiglu_reference(ys[1])
    out.backward(dout)
    ref.backward(dout)
    fwd_flips, fwd_worst = int((_ulps(out, ref) > 0).sum()), int(_ulps(out, ref).max())
    bwd_flips, bwd_worst = int((_ulps(ys[0].grad, ys[1].grad) > 0).sum()), int(_ulps(ys[0].grad, ys[1].grad).max())
    edw = _scaled(ws[0].grad, ws[1].grad) if weighted else 0.0
    print(f"\nSwiGLU {'weighted ' if weighted else ''}[{rows}, 2x{n}]: forward {fwd_flips} of {out.numel()} differ "
          f"(max {fwd_worst} ulp), dy {bwd_flips} of {y.numel()} (max {bwd_worst} ulp), dw {edw:.1e} of scale")
    assert fwd_worst <= 1 and bwd_worst <= 1
    assert fwd_flips <= out.numel() // 10000 and bwd_flips <= y.numel() // 10000
    assert edw <= 1e-5


def _mcore(weighted: bool):
    from megatron.core.fusions import fused_bias_swiglu as f

    if weighted:
        return lambda y, w: f.weighted_bias_swiglu_impl(y, None, w)
    return lambda y, w: f.bias_swiglu_impl(y, None)


@pytest.mark.parametrize("weighted", [True, False])
def test_fused_swiglu_against_megatron_eager_and_speed(weighted):
    from triton.testing import do_bench

    rows, n = (65536, 2048) if weighted else (8192, 12288)
    y, w, dout = _inputs(rows, n, 7)
    ys = [y.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    ours = (lambda a, b: weighted_swiglu(a, b)) if weighted else (lambda a, b: swiglu(a))
    mcore = _mcore(weighted)
    o1, o2 = ours(ys[0], ws[0]), mcore(ys[1], ws[1])
    o1.backward(dout)
    o2.backward(dout)
    e = (_scaled(o1, o2), _scaled(ys[0].grad, ys[1].grad), _scaled(ws[0].grad, ws[1].grad) if weighted else 0.0)
    print(f"\nvs megatron-core eager: out {e[0]:.1e}, dy {e[1]:.1e}, dw {e[2]:.1e} of scale")
    assert max(e) < 2e-2  # megatron-core's eager path rounds silu(a) to bf16 first: a few ulps

    def step(fn):
        a, b = y.clone().requires_grad_(), w.clone().requires_grad_()
        return lambda: fn(a, b).backward(dout)

    fused, eager = do_bench(step(ours)), do_bench(step(mcore))
    print(f"SwiGLU {'weighted ' if weighted else ''}fwd+bwd [{rows}, 2x{n}] bf16: fused {fused:.3f} ms, megatron-core "
          f"eager {eager:.3f} ms ({eager / fused:.1f}x)")
    assert fused < eager
