"""The fused Triton SwiGLU (:mod:`megatron_glm5.kernels.swiglu`) and its routing into megatron-core's ``MLP``
(:mod:`megatron_glm5.fusions`), on CPU.

* Both kernels, forward and backward, against the torch oracle (megatron-core's expressions in fp32, one rounding) in
  Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``): fp32 within 1e-5 of the scale; bf16 within a few
  ulps of it (the interpreter rounds fp32 -> bf16 differently from the GPU). A wrong derivative, a missing weight or
  a wrong row / column offset is far outside either bound (the mutation case checks one).
* Routed: the two functions megatron-core's ``MLP`` looks up (plain and weighted by the routing probabilities) give
  megatron-core's outputs and gradients in fp32, and the kernels ran; bias variants stay megatron-core's. (Inside a
  whole model: ``tests/test_fusions_model.py``.)
* Both kernels compile to sm_90 cubins here (Triton's ptxas, no GPU).
* Without the interpreter a CPU tensor takes megatron-core's path; ``MEGATRON_GLM5_FUSED_SWIGLU=0`` routes nothing.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.triton_checks import compile_sm90, mutant_env, passed, run_in_interpreter


_KERNELS = textwrap.dedent('''
    import torch
    from tests.triton_checks import kernel_module

    k = kernel_module("swiglu")  # or the mutation check's changed copy

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    torch.manual_seed(0)
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 0.03)):
        for rows, n, view in ((37, 40, False), (5, 3000, False), (6, 24, True), (0, 8, False)):
            base = torch.randn(rows, 2 * n + (16 if view else 0)) * 3
            y = (base[:, : 2 * n] if view else base).to(dtype)  # a strided view: rows of 2n + 16
            w = torch.rand(rows, 1)
            g = torch.randn(rows, n).to(dtype)
            for weighted in (False, True):
                assert k.swiglu_supported(y, w if weighted else None)
                ys = [y.detach().clone().requires_grad_() for _ in range(2)]
                ws = [w.detach().clone().requires_grad_() for _ in range(2)]
                out = k.weighted_swiglu(ys[0], ws[0]) if weighted else k.swiglu(ys[0])
                ref = k.weighted_swiglu_reference(ys[1], ws[1]) if weighted else k.swiglu_reference(ys[1])
                assert out.shape == ref.shape == (rows, n) and out.dtype == ref.dtype == dtype
                out.backward(g)
                ref.backward(g)
                if rows == 0:
                    continue
                errs = [rel(out, ref), rel(ys[0].grad, ys[1].grad)]
                if weighted:
                    assert ws[0].grad.dtype == w.dtype and ws[0].grad.shape == w.shape
                    errs.append(rel(ws[0].grad, ws[1].grad))
                print(dtype, rows, n, "view" if view else "", "weighted" if weighted else "plain", errs)
                assert max(errs) < bound, (dtype, rows, n, weighted, errs)
    # not vacuous: the weight and each half of the gradient are seen
    y = torch.randn(4, 16).requires_grad_()
    w = torch.full((4, 1), 2.0)
    assert rel(k.weighted_swiglu(y, w), k.swiglu_reference(y)) > 0.5
    print("OK")
''')

_ROUTED = textwrap.dedent('''
    import os
    import torch
    import torch.nn.functional as F
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp as mcore_mlp
    from megatron_glm5 import fusions
    from megatron_glm5.kernels import swiglu as k

    calls = {"plain": 0, "weighted": 0}
    plain, weighted = k._SwiGLU.apply, k._WeightedSwiGLU.apply
    k._SwiGLU.apply = lambda *a: (calls.__setitem__("plain", calls["plain"] + 1), plain(*a))[1]
    k._WeightedSwiGLU.apply = lambda *a: (calls.__setitem__("weighted", calls["weighted"] + 1), weighted(*a))[1]

    torch.manual_seed(0)
    x = torch.randn(6, 3, 32) * 2                                  # [s, b, h]
    fc1 = torch.randn(6, 3, 2 * 48) * 2                            # what linear_fc1 would give
    probs = torch.rand(18, 1)
    def run(fn_plain, fn_weighted):
        y1 = fc1.clone().requires_grad_()
        y2 = fc1.reshape(18, -1).clone().requires_grad_()
        p = probs.clone().requires_grad_()
        out1 = fn_plain(y1, None)
        out2 = fn_weighted(y2, None, p)
        (out1.square().sum() + (out2 * out2.flip(0)).sum()).backward()
        return out1, out2, y1.grad, y2.grad, p.grad

    assert fusions.install_fusions()["swiglu"]
    assert mcore_mlp.bias_swiglu_impl is fusions.bias_swiglu_impl
    assert mcore_mlp.weighted_bias_swiglu_impl is fusions.weighted_bias_swiglu_impl
    ours = run(mcore_mlp.bias_swiglu_impl, mcore_mlp.weighted_bias_swiglu_impl)
    assert calls == {"plain": 1, "weighted": 1}, calls
    mcore = run(fused_bias_swiglu.bias_swiglu_impl, fused_bias_swiglu.weighted_bias_swiglu_impl)
    for name, a, b in zip(("out", "weighted out", "dy", "weighted dy", "dprobs"), ours, mcore):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = float((a - b).abs().max() / b.abs().max())
        print(name, err)
        assert err < 1e-5, (name, err)
    # megatron-core's variants the kernel does not take go to megatron-core's functions
    bias = torch.randn(96)
    assert torch.equal(mcore_mlp.bias_swiglu_impl(fc1, bias), fused_bias_swiglu.bias_swiglu_impl(fc1, bias))
    assert calls == {"plain": 1, "weighted": 1}, calls
    print("OK")
''')


def _run(script: str, **env: str) -> None:
    assert passed(run_in_interpreter(script, MEGATRON_GLM5_FUSED_SWIGLU="1", **env))


def test_swiglu_kernels_match_the_oracle_in_triton_interpreter():
    pytest.importorskip("triton")
    _run(_KERNELS)


def test_megatron_mlp_swiglu_routed_to_the_kernels():
    pytest.importorskip("triton")
    _run(_ROUTED)


def test_a_wrong_derivative_is_caught(tmp_path):
    """Mutation check: the backward with ``sig * (1 + a (1 - sig))`` replaced by ``sig`` fails the oracle bound."""
    pytest.importorskip("triton")
    env = mutant_env(tmp_path, "swiglu", "da = gs * sig * (1.0 + a * (1.0 - sig)) * b", "da = gs * sig * b")
    r = run_in_interpreter(_KERNELS, **env)
    assert r.returncode != 0 and "AssertionError" in r.stderr


def test_cpu_tensors_take_megatron_cores_path(monkeypatch):
    pytest.importorskip("triton")
    from megatron.core.fusions import fused_bias_swiglu

    from megatron_glm5 import fusions
    from megatron_glm5.kernels.swiglu import swiglu_supported

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    y = torch.randn(4, 16, dtype=torch.float64)  # not a dtype megatron-core's CPU path would reject
    assert not swiglu_supported(y.float())
    assert torch.equal(fusions.bias_swiglu_impl(y, None), fused_bias_swiglu.bias_swiglu_impl(y, None))


def test_switches(monkeypatch):
    from megatron_glm5 import fusions

    monkeypatch.setenv(fusions.FUSED_SWIGLU_ENV, "0")
    assert not fusions.enabled(fusions.FUSED_SWIGLU_ENV)
    monkeypatch.setenv(fusions.FUSED_SWIGLU_ENV, "yes")
    with pytest.raises(ValueError, match="MEGATRON_GLM5_FUSED_SWIGLU='yes'"):
        fusions.enabled(fusions.FUSED_SWIGLU_ENV)
    monkeypatch.delenv(fusions.FUSED_SWIGLU_ENV)
    assert fusions.enabled(fusions.FUSED_SWIGLU_ENV) and fusions.enabled(fusions.FUSED_RMSNORM_ENV)


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_kernels_compile_for_sm90(weighted):
    """Both directions compile to sm_90 cubins on this CPU machine (catches what the interpreter lets through)."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import swiglu

    for kernel in swiglu._triton():
        sig = {n: "i32" if n.startswith("stride") or n == "n" else "*bf16" for n in kernel.arg_names}
        sig.update(Wt="*fp32", DW="*fp32")
        compile_sm90(kernel, sig, {"HAS_W": weighted, "BLOCK": 1024})
