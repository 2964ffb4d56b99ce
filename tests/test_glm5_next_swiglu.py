"""Clamped SwiGLU on megatron-core 0.19.2 (CPU, fp32) against transformers 5.24's GLM-5.3-Flash modules.

* With :func:`clamped_swiglu_kwargs`, megatron-core's dense ``MLP`` equals ``Glm5NextTextMLP`` within 1e-6, and a
  whole ``MoELayer`` (sigmoid router with expert bias, ``SequentialMLP`` routed experts, ``SharedExpertMLP``) equals
  ``Glm5NextTextMoE``; inputs are scaled so that most gate/up values lie outside +-limit (the clamp matters).
* ``bias_activation_fusion=True`` (accepted by ``TransformerConfig`` without complaint) silently drops the clamp, for
  the dense MLP and the experts; :func:`check_clamped_swiglu` and :func:`check_clamped_swiglu_modules` refuse it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_glm5.glm5_next.swiglu import (
    ClampedSwiGLUError,
    check_clamped_swiglu,
    check_clamped_swiglu_modules,
    clamped_swiglu_kwargs,
)

LIMIT = 10.0
HIDDEN, FFN, MOE_FFN, EXPERTS, TOPK = 64, 96, 32, 8, 2
TOL = 1e-6


def hf_text_config(**overrides):
    from transformers import Glm5NextTextConfig

    kw = dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
        n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=0, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4,
        linear_head_dim=8, linear_num_heads=4, swiglu_limit=LIMIT, pad_token_id=0,
    )
    kw.update(overrides)
    return Glm5NextTextConfig(**kw)


def mcore_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, add_bias_linear=False,
        params_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
        moe_shared_expert_intermediate_size=MOE_FFN, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_bias_update_rate=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
    )
    kw.update(clamped_swiglu_kwargs(LIMIT))
    kw.update(overrides)
    return TransformerConfig(**kw)


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def big_inputs(n: int, seed: int, scale: float = 12.0) -> torch.Tensor:
    """Inputs whose projections mostly exceed +-LIMIT (std of a projection ~= scale)."""
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * scale


def dense_pair(**mcore_overrides):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP

    ref = Glm5NextTextMLP(hf_text_config()).eval()
    randomize(ref, seed=0)
    cfg = mcore_config(**mcore_overrides)
    mlp = MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)).eval()
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))  # [gate | up]
        mlp.linear_fc2.weight.copy_(ref.down_proj.weight)
    return ref, mlp


def run_mcore_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    out, bias = mlp(x[:, None, :])  # megatron-core takes [s, b, h]
    assert bias is None
    return out[:, 0, :]


def test_dense_mlp_matches_transformers(model_parallel):
    ref, mlp = dense_pair()
    x = big_inputs(64, seed=1)
    with torch.no_grad():
        want = ref(x)
        got = run_mcore_mlp(mlp, x)
        gate, up = ref.gate_proj(x), ref.up_proj(x)
        unclamped = ref.down_proj(F.silu(gate) * up)
    assert (gate > LIMIT).float().mean() > 0.2 and (up.abs() > LIMIT).float().mean() > 0.2  # the clamp is active
    assert (unclamped - want).abs().max() > 1.0
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"megatron-core MLP vs transformers: max |diff| {diff:.3g}"


def test_fused_bias_swiglu_drops_the_clamp(model_parallel):
    """megatron-core accepts bias_activation_fusion=True with a clamp value and silently computes plain SwiGLU."""
    ref, mlp = dense_pair(bias_activation_fusion=True)
    x = big_inputs(64, seed=2)
    with torch.no_grad():
        got = run_mcore_mlp(mlp, x)
        unclamped = ref.down_proj(F.silu(ref.gate_proj(x)) * ref.up_proj(x))
        want = ref(x)
    assert (got - unclamped).abs().max() < 1e-4 and (got - want).abs().max() > 1.0
    with pytest.raises(ClampedSwiGLUError, match=r"'bias_activation_fusion': expected False, found True"):
        check_clamped_swiglu(mlp.config, LIMIT)
    with pytest.raises(ClampedSwiGLUError, match=r"module '<root>' \(MLP\).*bias_activation_fusion"):
        check_clamped_swiglu_modules(mlp, LIMIT)


def moe_pair(**mcore_overrides):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.process_groups_config import ProcessGroupCollection
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    from megatron_glm5.providers import default_provider

    ref = Glm5NextTextMoE(hf_text_config()).eval()
    randomize(ref, seed=3)
    with torch.no_grad():
        ref.gate.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=torch.Generator().manual_seed(4)) * 0.1)
    cfg = mcore_config(**mcore_overrides)
    build = get_moe_module_spec_for_backend(backend=default_provider(), num_experts=EXPERTS, moe_grouped_gemm=False)
    moe = build(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
    with torch.no_grad():
        moe.router.weight.copy_(ref.gate.weight)
        moe.router.expert_bias.copy_(ref.gate.e_score_correction_bias)
        for e, expert in enumerate(moe.experts.local_experts):
            expert.linear_fc1.weight.copy_(ref.experts.gate_up_proj[e])  # HF packs [gate; up] like megatron
            expert.linear_fc2.weight.copy_(ref.experts.down_proj[e])
        shared = moe.shared_experts
        shared.linear_fc1.weight.copy_(torch.cat([ref.shared_experts.gate_proj.weight,
                                                  ref.shared_experts.up_proj.weight]))
        shared.linear_fc2.weight.copy_(ref.shared_experts.down_proj.weight)
    return ref, moe


def test_moe_layer_matches_transformers(model_parallel):
    """Router + SequentialMLP routed experts + SharedExpertMLP, all through megatron-core's MoELayer."""
    ref, moe = moe_pair()
    assert type(moe.experts).__name__ == "SequentialMLP" and type(moe.shared_experts).__name__ == "SharedExpertMLP"
    check_clamped_swiglu_modules(moe, LIMIT)
    x = big_inputs(48, seed=5)
    with torch.no_grad():
        want = ref(x[None])[0]
        got, bias = moe(x[:, None, :])
        shared_want = ref.shared_experts(x)
        shared_got = moe.shared_experts(x[:, None, :])[:, 0, :]
    assert bias is None
    gate = x @ ref.experts.gate_up_proj[:, :MOE_FFN].reshape(-1, HIDDEN).T
    assert (gate > LIMIT).float().mean() > 0.1  # the clamp is active in the experts too
    scale = max(1.0, want.abs().max().item())
    assert (shared_got - shared_want).abs().max().item() <= TOL * scale
    diff = (got[:, 0, :] - want).abs().max().item()
    assert diff <= TOL * scale, f"megatron-core MoELayer vs transformers: max |diff| {diff:.3g} (scale {scale:.3g})"


def test_fused_expert_swiglu_drops_the_clamp(model_parallel):
    ref, moe = moe_pair(bias_activation_fusion=True)
    x = big_inputs(48, seed=6)
    with torch.no_grad():
        got = moe(x[:, None, :])[0][:, 0, :]
        want = ref(x[None])[0]
    assert (got - want).abs().max() > 1e-2
    with pytest.raises(ClampedSwiGLUError, match=r"bias_activation_fusion"):
        check_clamped_swiglu_modules(moe, LIMIT)


# --------------------------------------------------------------------------------------------------------------------
# the config check on its own: a real TransformerConfig, one flag flipped after construction
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("activation_func_clamp_value", None, "10.0"),
        ("activation_func_clamp_value", 7.0, "10.0"),
        ("glu_linear_offset", 1.0, "0.0"),
        ("activation_func", F.gelu, "silu"),
        ("gated_linear_unit", False, "True"),
        ("bias_activation_fusion", True, "False"),
        ("use_te_activation_func", True, "False"),
        ("use_transformer_engine_op_fuser", True, "False"),
        ("moe_shared_expert_overlap", True, "False"),
        ("use_grouped_gemm_for_shared_expert", True, "False"),
    ],
)
def test_check_names_the_flag(flag, value, expected):
    cfg = mcore_config()
    check_clamped_swiglu(cfg, LIMIT)
    object.__setattr__(cfg, flag, value)  # bypass TransformerConfig's own cross-checks: only ours is under test
    with pytest.raises(ClampedSwiGLUError) as err:
        check_clamped_swiglu(cfg, LIMIT)
    msg = str(err.value)
    head, _, found = msg.partition(", found ")
    assert head.startswith(f"megatron-core config '{flag}': expected ") and expected in head, msg
    assert found.startswith(repr(value)) and f"set {flag}=" in msg, msg


def test_kwargs_are_what_the_check_wants():
    kw = clamped_swiglu_kwargs(LIMIT)
    assert kw["activation_func"] is F.silu and kw["activation_func_clamp_value"] == LIMIT
    assert kw["glu_linear_offset"] == 0.0 and kw["gated_linear_unit"] is True
    with pytest.raises(ClampedSwiGLUError, match="positive"):
        clamped_swiglu_kwargs(0.0)


def test_module_check_flags_fused_classes():
    """Classes chosen by the block spec (invisible in the config) are refused by name."""

    class TEFusedMLP(torch.nn.Module):
        pass

    outer = torch.nn.Module()
    outer.add_module("mlp", TEFusedMLP())
    with pytest.raises(ClampedSwiGLUError, match=r"module 'mlp' is a TEFusedMLP.*use_te_op_fuser=True"):
        check_clamped_swiglu_modules(outer, LIMIT)
    fused = torch.nn.Module()
    fused._with_fused_impl = True
    outer2 = torch.nn.Module()
    outer2.add_module("experts", fused)
    with pytest.raises(ClampedSwiGLUError, match="use_transformer_engine_op_fuser=False"):
        check_clamped_swiglu_modules(outer2, LIMIT)
