"""The AdamW kernel that writes the 16-bit model copies (``megatron_glm5/kernels/fused_adamw.py``) on the CPU: in
Triton's interpreter against its oracle (within a few ulps: the interpreter's ``fma`` rounds twice and it has no
libdevice ``pow``), the oracle against torch's AdamW, the compiled sm_90 code's rounding (every ``fma``, division
and square root rounded once, as torch's fused kernel does them), and what the kernel refuses. The bitwise check
against torch's fused AdamW is ``tests/gpu/test_fused_adamw_gpu.py``."""

from __future__ import annotations

import collections
import re

import pytest
import torch

from megatron_glm5.kernels import fused_adamw
from tests.triton_checks import compile_sm90, passed, run_in_interpreter

INTERPRETED = r"""
import torch
from megatron_glm5.kernels import fused_adamw as fa

def make(sizes, seed, model_dtype):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=g) for n in sizes]
    gr = [torch.randn(n, generator=g) * 1e-2 for n in sizes]
    m = [torch.randn(n, generator=g) * 1e-3 for n in sizes]
    v = [torch.rand(n, generator=g) * 1e-5 for n in sizes]
    s = [torch.tensor(float(k)) for k in range(3, 3 + len(sizes))]
    mo = [torch.full((n,), 7.0, dtype=model_dtype) for n in sizes]
    mo[1] = None
    p[2] = torch.cat([torch.zeros(1), p[2]])[1:]  # 4 bytes off 16-byte alignment: the masked scalar path
    return p, gr, m, v, s, mo

def ulp(x):
    return (torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs())

for wd, dtype in ((0.1, torch.bfloat16), (0.0, torch.float16)):
    sizes = [fa.BLOCK * 2 + 5, 17, fa.BLOCK, 1]
    ours, ref = make(sizes, 0, dtype), make(sizes, 0, dtype)
    grads_before = [g.clone() for g in ours[1]]
    params_before = [p.clone() for p in ours[0]]
    h = fa.AdamWHyper(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
    assert fa.adamw_step_supported(*ours)
    for step in range(2):
        fa.adamw_step(*ours, h)
        fa.adamw_step_reference(*ref, h)
    p, g, m, v, s, mo = ours
    rp, rg, rm, rv, rs, rmo = ref
    for i in range(len(sizes)):
        assert torch.equal(g[i], grads_before[i])  # gradients untouched
        assert float(s[i]) == float(rs[i]) == 5.0 + i
        # interpreter: each fma rounded twice: a few ulps of the terms' scale
        assert ((m[i] - rm[i]).abs() <= 8 * ulp(torch.maximum(rm[i].abs(), g[i].abs()))).all(), i
        assert ((v[i] - rv[i]).abs() <= 8 * ulp(torch.maximum(rv[i].abs(), g[i] * g[i]))).all(), i
        scale = torch.maximum(rp[i].abs(), params_before[i].abs())  # the update may cancel the parameter
        assert ((p[i] - rp[i]).abs() <= 8 * ulp(scale)).all(), (i, (p[i] - rp[i]).abs().max())
        assert not torch.equal(p[i], make(sizes, 0, dtype)[0][i])  # it moved
        if mo[i] is None:
            continue
        assert mo[i].dtype == dtype and torch.equal(mo[i], p[i].to(dtype))  # the copy of what it computed
print("OK")
"""


def test_kernel_in_the_interpreter_follows_its_oracle():
    assert passed(run_in_interpreter(INTERPRETED))


def test_oracle_is_torchs_adamw():
    """The oracle's update rule is torch's AdamW (decoupled decay, bias corrections, step count): three steps with a
    changing learning rate against ``torch.optim.AdamW`` (CPU, for-loop), equal to fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g) for n in (300, 7)]
    twins = [torch.nn.Parameter(p.clone()) for p in params]
    adam = torch.optim.AdamW(twins, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    s = [torch.tensor(0.0) for _ in params]
    models = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g) * 0.1 for p in params]
        lr = 1e-3 * (1 - step / 5)
        adam.param_groups[0]["lr"] = lr
        for t, gr in zip(twins, grads):
            t.grad = gr.clone()
        adam.step()
        fused_adamw.adamw_step_reference(params, grads, m, v, s, models,
                                         fused_adamw.AdamWHyper(lr, 0.9, 0.95, 1e-8, 0.1))
    for p, t, mi, vi, si, model in zip(params, twins, m, v, s, models):
        st = adam.state[t]
        torch.testing.assert_close(p, t.detach(), rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(mi, st["exp_avg"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(vi, st["exp_avg_sq"], rtol=1e-5, atol=1e-12)
        assert float(si) == float(st["step"]) == 3.0
        assert torch.equal(model, p.to(torch.bfloat16))


SIGNATURE = {"TENSORS": "*i64", "CHUNKS": "*i32", "POWERS": "*fp32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32",
             "eps": "fp32", "lr_wd": "fp32"}


@pytest.mark.parametrize("half", [False, True])
def test_compiled_code_rounds_each_fma_division_and_square_root_once(half):
    """sm_90 PTX of the kernel (4 warps, BLOCK elements: BLOCK / 128 per thread; the update compiled for the full
    chunks and the last, with or without a model copy): per element exactly five ``fma.rn`` (weight decay, two per
    moment),
    two ``div.rn`` (the square root over its bias correction, the step over the denominator) and one ``sqrt.rn``,
    plus one division and one square root per program (step size, bias correction); no approximate or flush-to-zero
    arithmetic anywhere (the powers come from torch); the copy converted round-to-nearest-even; 16-byte vector loads
    in the full chunks of tensors the host found aligned."""
    ptx = compile_sm90(fused_adamw._triton(), SIGNATURE,
                       {"WEIGHT_DECAY": True, "HALF": half, "INTERPRETED": False, "BLOCK": fused_adamw.BLOCK},
                       num_warps=4)
    ops = collections.Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", ptx, re.M))
    per_thread = fused_adamw.BLOCK // 128
    updates = ops["fma.rn.f32"] // 5  # element updates compiled (the compiler may merge the copies)
    assert ops["fma.rn.f32"] == 5 * updates and updates % per_thread == 0 and updates >= 2 * per_thread, ops
    assert ops["div.rn.f32"] == 2 * updates + 1, ops
    assert ops["sqrt.rn.f32"] == updates + 1, ops
    assert not [op for op in ops if ".approx" in op or ".ftz" in op or op.startswith(("div.full", "rsqrt", "ex2"))]
    cvt = "cvt.rn.f16.f32" if half else "cvt.rn.bf16.f32"
    assert ops[cvt] >= per_thread and ops[cvt] % per_thread == 0, ops
    assert ops["ld.global.v4.b32"] == 4 * per_thread // 4, ops  # the aligned full chunks' four fp32 arrays


def test_refuses_what_it_cannot_take(monkeypatch):
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    s, model = torch.tensor(1.0), torch.zeros(8, dtype=torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_adamw.adamw_step_supported([p], [g], [m], [v], [s], [model])  # CPU tensors, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError):  # the lists must pair up
        fused_adamw.adamw_step_supported([p, p], [g], [m], [v], [s], [model])


@pytest.mark.parametrize("change", ["grad_shape", "grad_dtype", "model_shape", "model_dtype", "step", "strided",
                                    "mixed_models"])
def test_supported_checks_each_tensor(change, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton_runs_on reads it at the call
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    s, model = torch.tensor(1.0), torch.zeros(8, dtype=torch.bfloat16)
    lists = dict(params=[p], grads=[g], exp_avgs=[m], exp_avg_sqs=[v], steps=[s], models=[model])
    assert fused_adamw.adamw_step_supported(**lists)
    if change == "grad_shape":
        lists["grads"] = [torch.zeros(9)]
    elif change == "grad_dtype":
        lists["grads"] = [torch.zeros(8, dtype=torch.bfloat16)]
    elif change == "model_shape":
        lists["models"] = [torch.zeros(4, dtype=torch.bfloat16)]
    elif change == "model_dtype":
        lists["models"] = [torch.zeros(8, dtype=torch.float32)]
    elif change == "step":
        lists["steps"] = [torch.tensor(1.0, dtype=torch.float64)]
    elif change == "strided":
        lists["exp_avgs"] = [torch.zeros(16)[::2]]
    else:
        lists = {k: v * 2 for k, v in lists.items()}
        lists["models"] = [model, torch.zeros(8, dtype=torch.float16)]
    assert not fused_adamw.adamw_step_supported(**lists)
