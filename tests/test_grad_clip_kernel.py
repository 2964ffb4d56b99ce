"""The gradient clip's scale (:mod:`megatron_glm5.kernels.grad_clip`) against its oracle and against megatron-core's
no-apex clip (the gradients times the coefficient as a Python float where it is below one), on CPU in Triton's
interpreter: coefficients below, at and above one, NaN, 0, fp64 coefficients just below one that round to 1.0 in
fp32; tensors longer than a block and not a multiple of it, inf / NaN / -0.0 entries; a mutation (the test inverted)
is caught; what the kernel does not take falls back to the oracle; the kernel compiles to an sm_90 cubin."""

from __future__ import annotations

import textwrap

import pytest
import torch

from megatron_glm5.kernels.grad_clip import scale_below_one, scale_below_one_reference, scale_below_one_supported
from tests.triton_checks import compile_sm90, mutant_env, passed, run_in_interpreter

_SCRIPT = textwrap.dedent('''
    import torch
    from tests.triton_checks import kernel_module

    k = kernel_module("grad_clip")  # or the mutation check's changed copy

    def same(a, b):
        return (torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.signbit(), b.signbit()))

    g = torch.Generator().manual_seed(0)
    coefs = [(torch.tensor([0.5]), True), (torch.tensor([0.3], dtype=torch.float64), True),
             (torch.tensor([1.0]), False), (torch.tensor([1.5], dtype=torch.float64), False),
             (torch.tensor([float("nan")]), False), (torch.tensor([0.0]), True),
             (torch.tensor(1.0 - 1e-9, dtype=torch.float64), False)]  # below 1 in double, 1.0 in fp32
    for coef, scales in coefs:
        ts = [torch.randn(n, generator=g) for n in (5, k.BLOCK + 3, 2 * k.BLOCK, 1)] + [torch.randn(3, 7, generator=g)]
        ts[0][0], ts[1][5], ts[2][7] = float("inf"), float("nan"), -0.0
        before = [t.clone() for t in ts]
        assert k.scale_below_one_supported(ts, coef)
        ref = [t.clone() for t in ts]
        k.scale_below_one(ts, coef)
        k.scale_below_one_reference(ref, coef)
        # megatron-core without apex: the gradients times the coefficient (a Python float) where it is below one
        c = float(coef)
        mc = [t * c if c < 1.0 else t for t in before]
        for a, b, m, t0 in zip(ts, ref, mc, before):
            assert same(a, b) and same(a, m), coef
            assert same(a, t0) != scales, coef  # scaled, or untouched
        print(coef.dtype, float(coef), "ok")
    # what it does not take falls back to the oracle: a bf16 gradient, a coefficient on another device type
    ts = [torch.randn(4, generator=g).bfloat16()]
    assert not k.scale_below_one_supported(ts, torch.tensor([0.5]))
    ref = [t.clone() for t in ts]
    k.scale_below_one(ts, torch.tensor([0.5]))
    k.scale_below_one_reference(ref, torch.tensor([0.5]))
    assert torch.equal(ts[0], ref[0]) and not torch.equal(ts[0], ref[0] * 2)
    print("OK")
''')


def test_scale_below_one_matches_the_oracle_and_megatron_core_in_triton_interpreter():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_SCRIPT))


def test_an_inverted_test_is_caught(tmp_path):
    pytest.importorskip("triton")
    r = run_in_interpreter(_SCRIPT, **mutant_env(tmp_path, "grad_clip", "if c < 1.0:", "if c >= 1.0:"))
    assert r.returncode != 0 and "AssertionError" in r.stderr


def test_reference_on_cpu_without_the_interpreter():
    """Outside the interpreter a CPU tensor takes the oracle (no host sync there either): scaled below one only."""
    xs = [torch.randn(7), torch.randn(2, 3)]
    assert not scale_below_one_supported(xs, torch.tensor([0.5])) or torch.cuda.is_available()
    want = [x * 0.25 for x in xs]
    scale_below_one(xs, torch.tensor([0.25], dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(xs, want))
    keep = [x.clone() for x in xs]
    for coef in (1.0, 3.0, float("nan")):
        scale_below_one_reference(xs, torch.tensor(coef))
        assert all(torch.equal(a, b) for a, b in zip(xs, keep))
    scale_below_one([], torch.tensor([0.5]))  # nothing to scale


def test_grad_clip_compiles_for_sm90():
    pytest.importorskip("triton")
    from megatron_glm5.kernels import grad_clip

    compile_sm90(grad_clip._triton(), {"TABLE": "*i64", "COEF": "*fp64"}, {"BLOCK": grad_clip.BLOCK}, num_warps=8)
