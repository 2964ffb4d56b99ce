"""GLM-5.3-Flash config translation and layer / block spec builder.

* The released config translates to NoPE MLA settings (rope width 0, plain RoPE, scale 1/16, 512-wide latent), KPool
  (pool 4, top-k width 2051) and the clamped SwiGLU, whatever the runtime policy's fusions say.
* Bad configs are refused through our entry points, naming the field: a rope width > 0, ``index_topk`` not a
  multiple of the pool size, a shared DSA layer with no full DSA layer before it (also across KDA layers), biases.
* The clamp cannot be dropped: config flags that lose it are refused when the spec is built, and a fused MLP class
  smuggled into a spec is refused when the layer is built.
* IndexShare sources skip non-DSA layers; a pipeline stage whose first DSA layer is shared is refused, with a valid
  split (a KDA layer may start a stage); the mHC model's stages are built, and megatron-core's schedule sends the
  streams' width; virtual pipeline stages are refused by name.
* Clamped-SwiGLU MLPs built through the spec (dense MLP, MoE with shared and routed experts) equal transformers'
  ``Glm5NextTextMLP`` / ``Glm5NextTextMoE`` within 1e-6 on inputs where the clamp is active.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_glm5.config import GLM5ConfigError
from megatron_glm5.glm5_next.config import parse_glm5_next_config
from megatron_glm5.glm5_next.mcore_config import GLM5NextTransformerConfig, build_transformer_config, mcore_kwargs
from megatron_glm5.glm5_next.spec import (
    build_glm5_next_block_spec,
    build_glm5_next_layer_spec,
    topk_sources,
    validate_stage_layers,
)
from megatron_glm5.core.stages import valid_stage_starts
from megatron_glm5.glm5_next.swiglu import ClampedSwiGLUError, check_clamped_swiglu
from megatron_glm5.model import default_cpu_policy
from tests.glm5_next_fixtures import (
    HIDDEN,
    build_layer,
    hf_layer_state,
    hf_text_config,
    load_from_hf,
    mcore_config,
    randomize,
    tiny_raw,
)

RELEASED = json.loads((Path(__file__).parent / "data" / "glm5_3_flash_config.json").read_text())
MLP_TOL = 1e-6
DSA, KDA = "indexed_attention", "linear_attention"


# --------------------------------------------------------------------------------------------------------------------
# translation
# --------------------------------------------------------------------------------------------------------------------


def test_released_config_translates_to_nope_dsa():
    cfg = build_transformer_config(RELEASED, default_cpu_policy())
    assert isinstance(cfg, GLM5NextTransformerConfig)
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (256, 0, 256, 512)
    assert cfg.rope_type == "rope" and cfg.rotary_scaling_factor == 1.0 and cfg.mscale_all_dim == 0.0
    # megatron-core's AbsorbedMLA: softmax_scale = mscale**2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)
    assert (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5 == 1 / 16
    assert (cfg.dsa_indexer_topk, cfg.dsa_indexer_kpool, cfg.dsa_topk_width) == (2048, 4, 2051)
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_k_norm_epsilon) == (32, 128, 1e-6)
    assert not cfg.dsa_indexer_rotate_activation and cfg.dsa_indexer_scoring_relu
    assert cfg.layernorm_epsilon == 1e-5 and cfg.num_layers == 45
    assert cfg.moe_layer_freq == [0, 0, 0] + [1] * 42 and cfg.num_moe_experts == 288
    assert (cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size) == (8, 2048, 2048)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.activation_func is F.silu and cfg.activation_func_clamp_value == 10.0 and cfg.glu_linear_offset == 0
    check_clamped_swiglu(cfg, 10.0)


def test_policy_fusions_cannot_drop_the_clamp():
    """A CUDA-style policy turns megatron-core's torch fusions on; the fused bias-SwiGLU would drop the clamp."""
    kw = mcore_kwargs(tiny_raw(), default_cpu_policy(fusions=True))
    assert kw["bias_activation_fusion"] is False and kw["bias_dropout_fusion"] is True


def _config_with(**fields):
    """A GLM5NextTransformerConfig with fields changed after construction (as a hand-made config might be)."""
    cfg = mcore_config(tiny_raw())
    for k, v in fields.items():
        object.__setattr__(cfg, k, v)
    return cfg


def test_rope_width_is_refused():
    with pytest.raises(GLM5ConfigError, match=r"config field 'qk_rope_head_dim': expected 0 .* found 64"):
        build_transformer_config(tiny_raw(qk_rope_head_dim=64))
    arch = dataclasses.replace(parse_glm5_next_config(tiny_raw()), qk_rope_head_dim=64)
    with pytest.raises(GLM5ConfigError, match=r"'qk_rope_head_dim': expected 0"):
        mcore_kwargs(arch)
    with pytest.raises(GLM5ConfigError, match=r"qk_pos_emb_head_dim=64 \(expected 0: GLM-5.3-Flash attention is NoPE"):
        build_glm5_next_layer_spec(_config_with(qk_pos_emb_head_dim=64), DSA, "dense")


def test_topk_not_a_multiple_of_the_pool_is_refused():
    with pytest.raises(GLM5ConfigError, match=r"config field 'index_topk': expected a multiple of index_kpool \(4\), "
                                              r"found 18"):
        build_transformer_config(tiny_raw(index_topk=18))
    kw = mcore_kwargs(tiny_raw())
    with pytest.raises(GLM5ConfigError, match=r"dsa_indexer_topk: expected a multiple of dsa_indexer_kpool \(4\), "
                                              r"found 18"):
        GLM5NextTransformerConfig(**{**kw, "dsa_indexer_topk": 18})
    with pytest.raises(GLM5ConfigError, match=r"dsa_indexer_topk=18 \(expected a multiple of dsa_indexer_kpool=4"):
        build_glm5_next_layer_spec(_config_with(dsa_indexer_topk=18), DSA, "dense")


def test_shared_layer_without_full_source_is_refused():
    with pytest.raises(GLM5ConfigError, match=r"config field 'indexer_types\[0\]'.*expected 'full', found 'shared'"):
        build_transformer_config(tiny_raw(indexer_types=["shared", "full", "full", "shared"]))
    # through the block spec: the first DSA layer (after a KDA layer) is shared
    cfg = mcore_config(tiny_raw())
    with pytest.raises(GLM5ConfigError, match=r"indexer_types\[1\]: DSA layer 1 is 'shared' but no 'full' DSA layer "
                                              r"comes before it"):
        build_glm5_next_block_spec(cfg, layer_types=[KDA, DSA, DSA, DSA], indexer_types=["full", "shared", "full",
                                                                                          "full"], pp_rank=0)


def test_other_refusals_name_the_field():
    with pytest.raises(GLM5ConfigError, match=r"config field 'attention_bias': expected false"):
        build_transformer_config(tiny_raw(attention_bias=True))
    with pytest.raises(GLM5ConfigError, match="without dsa_indexer_kpool"):
        from megatron_glm5.config import build_transformer_config as glm5_config, parse_hf_config
        from megatron_glm5.testing import tiny_glm5_config

        build_glm5_next_layer_spec(glm5_config(parse_hf_config(tiny_glm5_config()), default_cpu_policy()), DSA,
                                   "dense")
    cfg = mcore_config(tiny_raw())
    with pytest.raises(ValueError, match=r"unknown GLM-5.3-Flash attention backend 'flash'; valid backends: "
                                         r"\['megatron', 'tilelang'\]"):
        build_glm5_next_layer_spec(cfg, DSA, "dense", backend="flash")
    with pytest.raises(ValueError, match=r"mlp_type: expected one of \['dense', 'sparse'\], got 'moe'"):
        build_glm5_next_layer_spec(cfg, DSA, "moe")
    from megatron_glm5.glm5_next.kda import KimiDeltaAttention

    assert build_glm5_next_layer_spec(cfg, KDA, "dense").submodules.self_attention.module is KimiDeltaAttention
    with pytest.raises(GLM5ConfigError, match="hyper_connections needs hc_mult >= 1"):
        build_glm5_next_layer_spec(dataclasses.replace(cfg, hc_mult=0), KDA, "dense", hyper_connections=True)


@pytest.mark.parametrize("flag", ["bias_activation_fusion", "use_te_activation_func", "moe_shared_expert_overlap",
                                  "use_transformer_engine_op_fuser", "use_grouped_gemm_for_shared_expert"])
def test_clamp_dropping_flags_are_refused_at_build(flag):
    with pytest.raises(GLM5ConfigError, match=rf"'{flag}': expected False, found True"):
        build_glm5_next_layer_spec(_config_with(**{flag: True}), DSA, "sparse")
    with pytest.raises(GLM5ConfigError, match=r"activation_func_clamp_value=None"):
        build_glm5_next_layer_spec(_config_with(activation_func_clamp_value=None), DSA, "dense")


def test_fused_mlp_class_in_a_spec_is_refused_when_built(model_parallel):
    """A spec whose MLP is a TE-fused class (e.g. from use_te_op_fuser=True) is invisible in the config."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    class TEFusedMLP(torch.nn.Module):  # the check goes by class name: no Transformer Engine needed
        def __init__(self, *args, **kwargs):
            super().__init__()

    cfg = mcore_config(tiny_raw())
    spec = build_glm5_next_layer_spec(cfg, DSA, "dense")
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=ModuleSpec(TEFusedMLP)))
    with pytest.raises(ClampedSwiGLUError, match=r"module '<root>' is a TEFusedMLP"):
        build_module(spec, config=cfg, layer_number=1)


# --------------------------------------------------------------------------------------------------------------------
# IndexShare across non-DSA layers, pipeline split
# --------------------------------------------------------------------------------------------------------------------


def test_topk_sources_skip_non_dsa_layers():
    layers = [DSA, KDA, KDA, DSA, KDA, DSA, DSA]
    idx = ["full", "full", "shared", "shared", "full", "full", "shared"]
    assert topk_sources(layers, idx) == (0, None, None, 0, None, 5, 5)
    # the released layout: DSA every 4th layer, all full
    arch = parse_glm5_next_config(RELEASED)
    sources = topk_sources(arch.layer_types, arch.indexer_types)
    assert [i for i, s in enumerate(sources) if s is not None] == list(arch.dsa_layers)
    assert all(sources[i] == arch.indexer_source(i) for i in arch.dsa_layers)


def test_stage_whose_first_dsa_layer_is_shared_is_refused():
    layers = [DSA, KDA, KDA, DSA, KDA, DSA]
    idx = ["full", "full", "full", "shared", "full", "full"]
    validate_stage_layers(layers, idx, [0, 1, 2])
    validate_stage_layers(layers, idx, [4, 5])  # starts on KDA, first DSA layer (5) is full
    with pytest.raises(GLM5ConfigError, match=r"the first DSA layer of a stage is decoder layer 3 \(0-indexed\), a "
                                              r"'shared' layer that reuses the top-k of layer 0 on an earlier stage"):
        validate_stage_layers(layers, idx, [1, 2, 3])
    # a KDA layer may start a stage when the next DSA layer is full (4); 1 and 2 may not (layer 3 is shared)
    assert valid_stage_starts(idx, [lt == DSA for lt in layers]) == (0, 4, 5)
    with pytest.raises(GLM5ConfigError, match=r"A valid split: stage sizes \[4, 2\]"):
        validate_stage_layers(layers, idx, [3, 4, 5], stages=2)


def test_block_spec_pipeline_split(model_parallel):
    """Pipeline stages of the mHC model: an even split builds both stages, the 1F1B schedule is told the streams'
    width; a stage whose first DSA layer is shared is refused with a valid split; virtual stages are refused."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_glm5 import compat

    raw = tiny_raw()  # full, shared, full, shared
    arch = parse_glm5_next_config(raw)
    even = mcore_config(raw, pipeline_model_parallel_size=2)
    assert even.hc_mult == 4 and even.pipeline_hidden_size == 4 * HIDDEN
    for rank in (0, 1):
        block = build_glm5_next_block_spec(even, layer_types=arch.layer_types, indexer_types=arch.indexer_types,
                                           pp_rank=rank)
        kinds = [s.submodules.self_attention.submodules.core_attention.params["indexer_type"] for s in
                 block.layer_specs]
        assert kinds == ["full", "shared"]
        assert [s.params["expand_streams"] for s in block.layer_specs] == [rank == 0, False]
    assert compat.is_patched(schedules, "get_tensor_shapes")
    one = type("G", (), {"size": staticmethod(lambda: 1)})
    shapes = schedules.get_tensor_shapes(seq_length=48, micro_batch_size=2, decoder_seq_length=None, config=even,
                                         tp_group=one, cp_group=one)
    assert [tuple(s) for s in shapes] == [(48, 2, 4 * HIDDEN)]
    first1 = mcore_config(raw, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    with pytest.raises(GLM5ConfigError, match=r"a stage starts on decoder layer 1 .* A valid split: stage sizes "
                                              r"\[2, 2\]"):  # stage 1 = layers 1..3, layer 1 is shared
        build_glm5_next_block_spec(first1, layer_types=arch.layer_types, indexer_types=arch.indexer_types, pp_rank=1)
    vpp = dataclasses.replace(even, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(GLM5ConfigError, match=r"virtual_pipeline_model_parallel_size=2: virtual pipeline stages are "
                                              r"not supported for GLM-5.3-Flash yet: .* \[s, b, 256\]"):
        build_glm5_next_block_spec(vpp, layer_types=arch.layer_types, indexer_types=arch.indexer_types, pp_rank=0,
                                   vp_stage=0)


# --------------------------------------------------------------------------------------------------------------------
# clamped-SwiGLU MLPs through the spec
# --------------------------------------------------------------------------------------------------------------------


def big_inputs(n: int, seed: int, scale: float = 12.0) -> torch.Tensor:
    """Inputs whose projections mostly exceed +-swiglu_limit."""
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_dense_mlp_through_spec_matches_transformers(model_parallel, backend):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP

    raw = tiny_raw()
    arch = parse_glm5_next_config(raw)
    ref = Glm5NextTextMLP(hf_text_config(raw)).eval()
    randomize(ref, seed=0)
    layer = build_layer(mcore_config(raw), 0, arch.layer_types, arch.indexer_types, "dense", backend)
    assert type(layer.mlp).__name__ == "MLP"
    filled = load_from_hf(layer, hf_layer_state(ref, "mlp."), arch, 0, only="mlp.")
    assert sorted(filled) == ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    x = big_inputs(64, seed=1)
    with torch.no_grad():
        want = ref(x)
        got, bias = layer.mlp(x[:, None, :])
        gate = ref.gate_proj(x)
    assert bias is None and (gate > 10).float().mean() > 0.2  # the clamp is active
    diff = (got[:, 0] - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert diff <= MLP_TOL, f"dense MLP: {diff:.2e}"


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_moe_through_spec_matches_transformers(model_parallel, backend):
    """Router (sigmoid + expert bias, scale 2.5) + routed experts + shared expert, built by our spec."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    raw = tiny_raw()
    arch = parse_glm5_next_config(raw)
    ref = Glm5NextTextMoE(hf_text_config(raw)).eval()
    randomize(ref, seed=3)
    with torch.no_grad():
        ref.gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(4)) * 0.1)
    layer = build_layer(mcore_config(raw), 1, arch.layer_types, arch.indexer_types, "sparse", backend)
    assert type(layer.mlp).__name__ == "MoELayer"
    filled = load_from_hf(layer, hf_layer_state(ref, "mlp."), arch, 1, only="mlp.")
    assert "mlp.router.expert_bias" in filled and len(filled) == 2 + 2 + 2 * 8
    x = big_inputs(48, seed=5)
    with torch.no_grad():
        want = ref(x[None])[0]
        got, bias = layer.mlp(x[:, None, :])
        shared_want = ref.shared_experts(x)
        shared_got = layer.mlp.shared_experts(x[:, None, :])[:, 0]
        expert_gate = x @ ref.experts.gate_up_proj[:, :32].reshape(-1, HIDDEN).T
    assert bias is None and (expert_gate > 10).float().mean() > 0.1  # the clamp is active in the experts
    scale = max(1.0, want.abs().max().item())
    shared = (shared_got - shared_want).abs().max().item() / scale
    routed = (got[:, 0] - want).abs().max().item() / scale
    assert shared <= MLP_TOL and routed <= MLP_TOL, f"shared {shared:.2e}, MoE {routed:.2e}"


def test_topk_crosses_a_non_dsa_layer_in_megatron_core_block(model_parallel):
    """In megatron-core's own TransformerBlock, a layer without DSA that returns the context it received (the
    contract for the KDA layers to come) carries the full layer's top-k to the next shared DSA layer."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from megatron_glm5.cpu import cpu_mode
    from megatron_glm5.providers import default_provider

    class PassThroughLayer(MegatronModule):  # stands in for a KDA layer: no attention top-k of its own
        def __init__(self, config, layer_number=1, pg_collection=None, vp_stage=None):
            super().__init__(config)
            self.layer_number = layer_number

        def forward(self, hidden_states, context=None, **kwargs):
            return hidden_states * 0.5, context

    raw = tiny_raw(num_hidden_layers=3, layer_types=[DSA, KDA, DSA], mlp_layer_types=["dense"] * 3,
                   indexer_types=["full", "full", "shared"])
    arch = parse_glm5_next_config(raw)
    assert topk_sources(arch.layer_types, arch.indexer_types) == (0, None, 0)
    cfg = mcore_config(raw)
    specs = [build_glm5_next_layer_spec(cfg, DSA, "dense", "full"), ModuleSpec(PassThroughLayer),
             build_glm5_next_layer_spec(cfg, DSA, "dense", "shared")]
    with cpu_mode():
        block = TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=specs,
                                                                 layer_norm=default_provider().layer_norm()))
    seen = {}
    for i in (0, 2):
        block.layers[i].self_attention.register_forward_hook(lambda m, a, kw, out, i=i: seen.__setitem__(i, out[2]),
                                                             with_kwargs=True)
    x = torch.randn(40, 2, HIDDEN, generator=torch.Generator().manual_seed(0))
    out = block(x, attention_mask=None)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert seen[0].shape == (80, arch.topk_width) and seen[2] is seen[0]
