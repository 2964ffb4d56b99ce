"""The fused RoPE + concatenation (:mod:`megatron_glm5.kernels.rope_cat`) against its torch oracle, forward and
backward, on CPU in Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``): the four shapes the ``tilelang``
attention uses (query ``[T, H, 512 | 64]`` from a strided split, latent keys ``[T, 512 | 64]``, the indexer's
``[T, Hi, 64 | 64]`` with the RoPE part first, its fp32 keys cast to bf16), fp32 within 1e-6 of the scale and bf16
within a few ulps (the interpreter's rounding); a mutation (the backward's sign) is caught; the kernels compile to
sm_90 cubins (each product rounded on its own: ``mul.rn``, no FMA); and inside a tiny ``tilelang`` GLM-5.2 model the logits and gradients do not move."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_checks import compile_sm90, mutant_env, passed, run_in_interpreter


_SCRIPT = textwrap.dedent('''
    import torch
    from tests.triton_checks import kernel_module

    k = kernel_module("rope_cat")  # or the mutation check's changed copy
    from megatron_glm5.dsa.rope import rope_cos_sin

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    torch.manual_seed(0)
    T = 19
    cos, sin = rope_cos_sin(torch.arange(T) * 37, 64, 8e6)
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 0.03)):
        q = torch.randn(T, 4, 256) * 3
        kv = torch.randn(T, 576)
        iq = torch.randn(T, 8, 128)
        ik = torch.randn(T, 128)  # fp32 keys (the indexer's LayerNorm output), cast to dtype
        cases = [  # (x, rest, rope_first, out_dtype)
            (q[..., 192:].to(dtype), torch.randn(T, 4, 512).to(dtype), False, None),  # the query: x is a strided view
            (kv[:, 512:].to(dtype), kv[:, :512].to(dtype), False, None),             # the latent keys
            (iq[..., :64].to(dtype), iq[..., 64:].to(dtype), True, None),             # the indexer query
            (ik[:, :64], ik[:, 64:], True, dtype),                                    # the indexer key
        ]
        for x, rest, first, out_dtype in cases:
            assert k.rope_cat_supported(x, rest, cos), (x.shape, rest.shape)
            xs = [x.detach().clone().requires_grad_() for _ in range(2)]
            rs = [rest.detach().clone().requires_grad_() for _ in range(2)]
            out = k.rope_cat(xs[0], rs[0], cos, sin, rope_first=first, out_dtype=out_dtype)
            ref = k.rope_cat_reference(xs[1], rs[1], cos, sin, rope_first=first, out_dtype=out_dtype)
            assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
            g = torch.randn(out.shape).to(out.dtype)
            out.backward(g)
            ref.backward(g)
            assert xs[0].grad.dtype == x.dtype and rs[0].grad.dtype == rest.dtype
            errs = [rel(out, ref), rel(xs[0].grad, xs[1].grad), rel(rs[0].grad, rs[1].grad)]
            print(dtype, tuple(x.shape), tuple(rest.shape), "rope first" if first else "rope last", errs)
            assert max(errs) < bound, errs
    print("OK")
''')

_MODEL = textwrap.dedent('''
    import os
    import torch
    from megatron_glm5.cpu import enable_cpu_mode
    enable_cpu_mode()
    from megatron_glm5.parallel import ensure_process_group, initialize_model_parallel
    ensure_process_group()
    initialize_model_parallel()
    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.kernels import rope_cat
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.testing import tiny_glm52_config

    calls = []
    real = rope_cat._RopeCat.apply
    rope_cat._RopeCat.apply = lambda *a: (calls.append(1), real(*a))[1]

    def run(flag):
        os.environ["MEGATRON_GLM5_FUSED_ROPE"] = flag
        torch.manual_seed(0)
        model = build_model(parse_hf_config(tiny_glm52_config()), default_cpu_policy(), backend="tilelang")
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(24)[None].expand(2, 24)
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = run("0")
    assert not calls
    out = run("1")
    assert len(calls) >= 8, len(calls)  # query and latent keys per layer, indexer query and key per full layer
    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    worst = max((rel(out[1][n], ref[1][n]), n) for n in ref[1])
    print("loss", rel(out[0], ref[0]), "worst gradient", worst, "calls", len(calls))
    assert rel(out[0], ref[0]) < 1e-6 and worst[0] < 1e-5, worst
    print("OK")
''')


def test_rope_cat_matches_the_oracle_in_triton_interpreter():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_SCRIPT))


def test_a_wrong_backward_sign_is_caught(tmp_path):
    pytest.importorskip("triton")
    r = run_in_interpreter(_SCRIPT, **mutant_env(tmp_path, "rope_cat", "mul_rn(g2, c, EXACT) - mul_rn(g1, s, EXACT)",
                                                   "mul_rn(g2, c, EXACT) + mul_rn(g1, s, EXACT)"))
    assert r.returncode != 0 and "AssertionError" in r.stderr


def test_fused_rope_inside_the_tilelang_model():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_MODEL))


def test_rope_cat_compiles_for_sm90():
    pytest.importorskip("triton")
    from megatron_glm5.kernels import rope_cat

    for kernel in rope_cat._triton():
        sig = {n: "*bf16" if n.isupper() else "i32" for n in kernel.arg_names}
        sig.update(COS="*fp32", SIN="*fp32")
        ptx = compile_sm90(kernel, sig, {"BH": 32, "BA": 512, "BLOCK_ROWS": rope_cat.BLOCK_ROWS, "EXACT": True})
        # each product rounded on its own, as torch's kernels round it: no fused multiply-add in the rotation
        assert "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx, kernel.fn.__name__
