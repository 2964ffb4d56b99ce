"""Weight-gradient accumulation and fused Adam without apex (``megatron_glm5.optim_fusions``) on CPU: apex's contract
against an fp64 oracle, through megatron-core's own linear layers with ``gradient_accumulation_fusion=True`` (the
route in ``compat``), the spec's refusal when neither apex nor the route serves the fusion, and the Adam switch (what
it changes, what it leaves alone, ``load_state_dict``, and the route around megatron-core's optimizer builder). The GPU
side (cuBLAS's fp32 epilogue, torch's fused kernel): ``tests/gpu/test_optim_fusions_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import compat
from megatron_glm5.optim_fusions import (
    WGRAD_ACCUMULATION,
    use_fused_adam,
    wgrad_gemm_accum_fp16,
    wgrad_gemm_accum_fp32,
)


def _operands(tokens=37, n_in=24, n_out=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    dy = torch.randn(tokens, n_out, generator=g).to(dtype)
    return x, dy, torch.randn(n_out, n_in, generator=g)


def test_wgrad_accumulation_adds_the_fp32_product_in_place():
    x, dy, main = _operands()
    want = main.double() + dy.double().t() @ x.double()
    buf = main.clone()
    ptr = buf.data_ptr()
    wgrad_gemm_accum_fp32(x, dy, buf)
    wgrad_gemm_accum_fp32(x, dy, buf)  # accumulates, as over micro-batches
    assert buf.data_ptr() == ptr and buf.dtype == torch.float32
    want2 = want + dy.double().t() @ x.double()
    assert float((buf.double() - want2).abs().max() / want2.abs().max()) < 1e-6

    half = main.bfloat16()
    wgrad_gemm_accum_fp16(x, dy, half)
    assert half.dtype == torch.bfloat16
    assert float((half.double() - want).abs().max() / want.abs().max()) < 2e-2


def test_wgrad_accumulation_names_the_shapes_it_cannot_take():
    x, dy, main = _operands()
    with pytest.raises(ValueError, match=r"input \(37, 24\), d_output \(37, 16\) and main_grad \(24, 16\)"):
        wgrad_gemm_accum_fp32(x, dy, main.t().contiguous())
    with pytest.raises(ValueError, match="do not fit"):
        wgrad_gemm_accum_fp32(x[:, None], dy, main)


def _wgrad_route() -> tuple:
    from megatron.core.tensor_parallel import layers

    return ((layers, "fused_weight_gradient_mlp_cuda", None), (layers, "_grad_accum_fusion_available", None))


_WGRAD_ROUTE = _wgrad_route()


def _linear(model_parallel, gaf: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=4, params_dtype=torch.float32,
                            use_cpu_initialization=True, add_bias_linear=False, gradient_accumulation_fusion=gaf)
    return ColumnParallelLinear(24, 16, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                gather_output=False)


def test_megatron_core_linear_accumulates_through_the_route(model_parallel):
    """With the route installed, megatron-core's own ``ColumnParallelLinear`` (``gradient_accumulation_fusion=True``,
    refused without apex before) adds each micro-batch's weight gradient into ``main_grad`` and marks it added, and
    the sum equals the unfused layer's gradients."""
    from megatron.core.tensor_parallel import layers

    compat.remove_patches(_WGRAD_ROUTE)  # from the pristine module (an earlier spec build may have routed it)
    was = layers._grad_accum_fusion_available
    assert compat.route_wgrad_accumulation(WGRAD_ACCUMULATION)
    try:
        assert layers._grad_accum_fusion_available
        if not was:
            assert compat.wgrad_accumulation_routed() and layers.fused_weight_gradient_mlp_cuda is WGRAD_ACCUMULATION
        fused, plain = _linear(model_parallel, True), _linear(model_parallel, False)
        with torch.no_grad():
            plain.weight.copy_(fused.weight)
        fused.weight.main_grad = torch.zeros_like(fused.weight)
        fused.weight.grad_added_to_main_grad = False
        g = torch.Generator().manual_seed(3)
        for _ in range(2):  # two micro-batches
            x = torch.randn(5, 2, 24, generator=g)
            dy = torch.randn(5, 2, 16, generator=g)
            for layer in (fused, plain):
                out, _ = layer(x.clone().requires_grad_())
                out.backward(dy)
        assert fused.weight.grad_added_to_main_grad
        assert torch.allclose(fused.weight.main_grad, plain.weight.grad, rtol=1e-5, atol=1e-5)
    finally:
        compat.remove_patches(_WGRAD_ROUTE)
    assert layers._grad_accum_fusion_available is was
    assert was or not hasattr(layers, "fused_weight_gradient_mlp_cuda")  # the added attribute is gone again


def test_spec_refuses_the_fusion_only_when_nothing_serves_it(model_parallel, monkeypatch):
    from megatron_glm5.config import GLM5ConfigError, build_transformer_config, parse_hf_config
    from megatron_glm5.core.mla_spec import apex_gradient_accumulation_fusion
    from megatron_glm5.fusions import FUSED_WGRAD_ENV
    from megatron_glm5.model import default_cpu_policy
    from megatron_glm5.spec import get_glm5_spec
    from megatron_glm5.testing import tiny_glm52_config

    if apex_gradient_accumulation_fusion():
        pytest.skip("checks the refusal on a machine without apex")
    route = _WGRAD_ROUTE
    config = build_transformer_config(parse_hf_config(tiny_glm52_config()), default_cpu_policy())
    config.gradient_accumulation_fusion = True
    try:
        compat.remove_patches(route)
        monkeypatch.setenv(FUSED_WGRAD_ENV, "0")
        with pytest.raises(GLM5ConfigError, match="add --no-gradient-accumulation-fusion, or set "
                                                  "MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION=1"):
            get_glm5_spec(config)
        monkeypatch.delenv(FUSED_WGRAD_ENV)  # the default: megatron-glm5's accumulation serves it
        assert get_glm5_spec(config) is not None and compat.wgrad_accumulation_routed()
        config.defer_embedding_wgrad_compute = True
        with pytest.raises(GLM5ConfigError, match="defer_embedding_wgrad_compute=True needs apex"):
            get_glm5_spec(config)
    finally:
        compat.remove_patches(route)


def test_fused_adam_switch_leaves_what_it_cannot_fuse_alone():
    p = torch.nn.Parameter(torch.randn(4, 3))
    adam = torch.optim.AdamW([p], lr=1e-3)
    assert not use_fused_adam(adam)  # CPU parameters: torch's fused kernel is CUDA-only here
    assert adam.param_groups[0]["fused"] in (None, False)
    assert not use_fused_adam(torch.optim.SGD([p], lr=1e-3))

    class MyAdam(torch.optim.AdamW):  # a subclass may rely on the step it overrides
        pass

    assert not use_fused_adam(MyAdam([p], lr=1e-3))


def test_fused_adam_switch_sets_and_keeps_fused_across_load_state_dict(monkeypatch):
    """The parameter check is the only CUDA-dependent part: with it answered as on the GPU, the switch sets ``fused``
    on every group and keeps it after loading an unfused optimizer's state (whose groups say ``fused=None``)."""
    from megatron_glm5 import optim_fusions

    p = torch.nn.Parameter(torch.randn(4, 3))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    adam = torch.optim.AdamW([p], lr=1e-3)
    saved = torch.optim.AdamW([p], lr=1e-3).state_dict()
    assert optim_fusions.use_fused_adam(adam) and optim_fusions.use_fused_adam(adam)  # idempotent
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[0]["foreach"] is False
    assert adam.defaults["fused"] is True
    adam.load_state_dict(saved)
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[0]["foreach"] is False
    assert len(adam._optimizer_load_state_dict_post_hooks) == 1  # registered once


def test_fused_adam_route_adjusts_every_optimizer_megatron_core_builds(monkeypatch):
    from megatron.core import optimizer as mcore_optimizer

    adjusted = []
    inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)

    class Wrapped:
        optimizer = inner

    results = iter([Wrapped(), (inner, None), Wrapped()])
    route = ((mcore_optimizer, "_get_megatron_optimizer_based_on_param_groups", None),)
    compat.remove_patches(route)  # from the pristine module (an earlier spec build may have routed it)
    monkeypatch.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", True)
    monkeypatch.setattr(mcore_optimizer, "_get_megatron_optimizer_based_on_param_groups",
                        lambda *a, **k: next(results))
    try:
        assert compat.route_fused_adam(adjusted.append) and compat.fused_adam_routed()
        build = mcore_optimizer._get_megatron_optimizer_based_on_param_groups
        assert isinstance(build(), Wrapped)
        assert build(skip_megatron_wrapping=True)[0] is inner
        assert adjusted == [inner, inner]
    finally:
        compat.remove_patches(route)
    monkeypatch.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False)  # TE's / apex's FusedAdam: left alone
    assert not compat.route_fused_adam(adjusted.append) and not compat.fused_adam_routed()
