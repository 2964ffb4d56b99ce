"""The fused SwiGLU and the gather-sum MoE permutation inside a whole GLM-5.2 model (tiny, fp32, CPU, Triton's
interpreter in a subprocess): logits, loss and every parameter gradient equal the model with megatron-core's own
functions within 1e-5 of their scale, with ``SequentialMLP`` experts (``moe_grouped_gemm="off"``: megatron-core's
``MLP`` reaches the kernels through the routed functions) and with ``TorchGroupedMLP`` (``"on"``: it calls them
itself), and the kernels ran."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_checks import passed, run_in_interpreter


_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    from megatron_glm5.cpu import enable_cpu_mode
    enable_cpu_mode()
    from megatron_glm5.parallel import ensure_process_group, initialize_model_parallel
    ensure_process_group()
    initialize_model_parallel()
    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.kernels import moe_permute, swiglu
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.testing import tiny_glm52_config

    grouped = sys.argv[1]
    calls = {"swiglu": 0, "permute": 0}
    def counted(real, key):
        def call(*a):
            calls[key] += 1
            return real(*a)
        return call

    for mod, name, key in ((swiglu, "_forward", "swiglu"), (moe_permute, "gather_sum", "permute")):
        setattr(mod, name, counted(getattr(mod, name), key))

    def run():
        torch.manual_seed(0)
        model = build_model(parse_hf_config(tiny_glm52_config()),
                            default_cpu_policy(fusions=True, moe_grouped_gemm=grouped))
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(24)[None].expand(2, 24)
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        with torch.no_grad():
            logits = model(ids, pos, None)
        return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    os.environ.update(MEGATRON_GLM5_FUSED_SWIGLU="0", MEGATRON_GLM5_FUSED_MOE_PERMUTE="0")
    ref = run()
    assert calls == {"swiglu": 0, "permute": 0}, calls
    os.environ.update(MEGATRON_GLM5_FUSED_SWIGLU="1", MEGATRON_GLM5_FUSED_MOE_PERMUTE="1")
    out = run()
    print(grouped, calls)
    assert calls["swiglu"] > 0 and calls["permute"] > 0, calls
    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    assert rel(out[0], ref[0]) < 1e-5 and rel(out[1], ref[1]) < 1e-5, (rel(out[0], ref[0]), rel(out[1], ref[1]))
    assert out[2].keys() == ref[2].keys() and len(ref[2]) > 20
    worst = max((rel(out[2][n], ref[2][n]), n) for n in ref[2])
    print("logits", rel(out[0], ref[0]), "worst gradient", worst)
    assert worst[0] < 1e-5, worst
    print("OK")
''')


@pytest.mark.parametrize("grouped", ["off", "on"])
def test_fusions_inside_the_model_match_megatron_core(grouped):
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_SCRIPT, grouped))


def test_grad_norm_fallback_is_routed_and_equals_megatron_cores_expression(monkeypatch):
    """megatron-core's no-apex gradient norm (one ``float()`` per tensor) replaced by torch's foreach norm on the
    device: the same total (fp32 rounding), through megatron-core's own ``multi_tensor_applier`` call."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megatron_glm5 import compat, fusions

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (37, 50.0), (1, 0.01), (4096, 1e-3))]
    megatron_expression = torch.norm(torch.tensor([float(torch.norm(t)) for t in grads]))
    total, per_tensor = fusions.multi_tensor_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [grads], False)
    assert per_tensor is None and total.shape == (1,) and total.dtype == torch.float32
    assert torch.allclose(total[0], megatron_expression, rtol=1e-6, atol=0)
    empty, _ = fusions.multi_tensor_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [[]], False)
    assert empty.tolist() == [0.0]

    monkeypatch.delenv(fusions.FUSED_GRAD_NORM_ENV, raising=False)
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm or compat.grad_norm_routed()
    try:
        assert fusions.install_fusions()["grad_norm"]
        assert clip_grads.l2_norm_impl is fusions.multi_tensor_l2_norm
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int),
                                                  [grads], False)
        assert torch.equal(norm, total)
    finally:
        compat.remove_patches(((clip_grads, "l2_norm_impl", None),))
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm


def test_multi_tensor_scale_is_bitwise_megatron_fallback_and_routed(monkeypatch):
    """``fusions.multi_tensor_scale`` (foreach) against megatron-core's ``local_multi_tensor_scale`` bit for bit: the
    clip (in place), the main -> model copy (fp32 -> bf16 at scale 1, through megatron-core's own
    ``_multi_tensor_copy_this_to_that`` once routed) and a scaled copy; an empty list is a no-op."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from megatron_glm5 import compat, fusions

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (37, 50.0), (1, 3e4), (4096, 1e-3))]
    src[0][:3] = torch.tensor([float("inf"), -0.0, 1e-40])  # non-finite, signed zero, subnormal
    flag = torch.zeros(1, dtype=torch.int)

    def both(make_dst, scale, in_place=False):
        outs = []
        for fn in (utils.local_multi_tensor_scale, fusions.multi_tensor_scale):
            a = [t.clone() for t in src]
            b = a if in_place else make_dst()
            fn(2048 * 32, flag, [a, b], scale)
            outs.append(b)
        return outs

    for ref, got in (both(None, 0.37, in_place=True),
                     both(lambda: [torch.empty_like(t, dtype=torch.bfloat16) for t in src], 1.0),
                     both(lambda: [torch.empty_like(t) for t in src], 0.25)):
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(got, ref))
    fusions.multi_tensor_scale(2048 * 32, flag, [[], []], 0.5)
    # lists aliasing each other in part: the per-pair order, as megatron-core's loop
    x, y, z = (torch.full((3,), v) for v in (1.0, 2.0, 3.0))
    ref = [t.clone() for t in (x, y, z)]
    utils.local_multi_tensor_scale(0, flag, [[ref[0], ref[1]], [ref[1], ref[2]]], 0.25)
    fusions.multi_tensor_scale(0, flag, [[x, y], [y, z]], 0.25)
    assert all(torch.equal(a, b) for a, b in zip((x, y, z), ref))

    monkeypatch.delenv(fusions.FUSED_MULTI_TENSOR_SCALE_ENV, raising=False)
    try:
        assert fusions.install_fusions()["multi_tensor_scale"]
        assert optimizer.multi_tensor_scale_impl is clip_grads.multi_tensor_scale_impl is fusions.multi_tensor_scale
        model = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        optimizer._multi_tensor_copy_this_to_that(this=src, that=model, overflow_buf=flag)
        assert all(torch.equal(m, t.to(torch.bfloat16)) for m, t in zip(model, src))
    finally:
        compat.remove_patches(((optimizer, "multi_tensor_scale_impl", None),
                               (clip_grads, "multi_tensor_scale_impl", None)))
    assert optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
