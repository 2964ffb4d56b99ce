"""Config translation against the released GLM-5 / 5.1 / 5.2 config.json values, and bad-config errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from megatron_glm5.config import (
    GLM5ConfigError,
    RuntimePolicy,
    architecture_kwargs,
    build_transformer_config,
    indexer_share_schedule,
    load_hf_config,
    mcore_kwargs,
    parse_hf_config,
)
from megatron_glm5.testing import tiny_glm52_config, tiny_glm5_config

DATA = Path(__file__).parent / "data"


def raw(name: str) -> dict:
    return load_hf_config(DATA / f"{name}_config.json")


@pytest.mark.parametrize("name", ["glm5", "glm5_1"])
def test_glm5_and_glm51_translate(name):
    arch = parse_hf_config(raw(name))
    assert arch.qk_rope_head_dim == 64 and arch.qk_head_dim == 256
    assert arch.rope_theta == 1e6 and arch.yarn is None
    assert arch.indexer_types == ("full",) * 78
    assert arch.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 75
    assert arch.softmax_scale == 1 / 16
    kw = architecture_kwargs(arch)
    expected = dict(
        num_layers=78, hidden_size=6144, num_attention_heads=64, ffn_hidden_size=12288,
        q_lora_rank=2048, kv_lora_rank=512, qk_head_dim=192, qk_pos_emb_head_dim=64, v_head_dim=256,
        rope_type="rope", rotary_base=1e6, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
        layernorm_epsilon=1e-5, normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        apply_rope_fusion=False, multi_latent_attention=True, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=32, dsa_indexer_head_dim=128, dsa_indexer_topk=2048,
        dsa_indexer_rope_interleaved=True, dsa_indexer_rotate_activation=False, dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=1e-6, dsa_indexer_k_norm_fp32=True,
        dsa_indexer_topk_freq=1, dsa_indexer_skip_topk_offset=0,
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_router_topk_scaling_factor=2.5,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        mtp_num_layers=1,
    )
    for key, value in expected.items():
        assert kw[key] == value, f"{key}: {kw[key]!r} != {value!r}"
    assert kw["moe_layer_freq"] == [0] * 3 + [1] * 75


def test_glm51_is_glm5():
    assert parse_hf_config(raw("glm5")) == parse_hf_config(raw("glm5_1"))


def test_glm52_traps():
    cfg = raw("glm5_2")
    assert cfg["head_dim"] == 192  # the trap is really in the file
    arch = parse_hf_config(cfg)
    assert arch.qk_rope_head_dim == 64, "rope width must be qk_head_dim - qk_nope_head_dim, not head_dim"
    assert arch.rope_theta == 8e6, "rope_theta comes from rope_parameters"
    full = arch.full_indexer_layers
    assert len(full) == 21 and arch.indexer_types.count("shared") == 57
    assert full[:5] == (0, 1, 2, 6, 10) and full[-1] == 74
    kw = architecture_kwargs(arch)
    assert kw["qk_pos_emb_head_dim"] == 64 and kw["rotary_base"] == 8e6
    assert kw["moe_router_dtype"] == "fp32"
    # The explicit list is the same schedule as megatron-core's freq/offset convention (1-indexed layers).
    assert indexer_share_schedule(arch.indexer_types) == (4, 3)
    assert (kw["dsa_indexer_topk_freq"], kw["dsa_indexer_skip_topk_offset"]) == (4, 3)


def test_glm52_builds_megatron_config():
    arch = parse_hf_config(raw("glm5_2"))
    cfg = build_transformer_config(arch, RuntimePolicy(params_dtype=torch.bfloat16, use_cpu_initialization=True))
    assert cfg.qk_pos_emb_head_dim == 64 and cfg.qk_head_dim == 192
    assert cfg.rotary_base == 8e6 and cfg.rope_type == "rope"
    assert cfg.dsa_indexer_rope_interleaved and not cfg.dsa_indexer_rotate_activation
    assert cfg.moe_router_dtype == "fp32" and cfg.moe_router_enable_expert_bias
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16
    assert cfg.mtp_num_layers == 1


def test_runtime_policy_is_separate():
    arch = parse_hf_config(tiny_glm5_config())
    kw = mcore_kwargs(arch, RuntimePolicy(tensor_model_parallel_size=2, expert_model_parallel_size=2))
    assert kw["sequence_parallel"] is True, "TP > 1 turns on sequence parallelism (AbsorbedMLA requires it)"
    assert kw["expert_model_parallel_size"] == 2
    with pytest.raises(ValueError, match="sequence_parallel=False"):
        RuntimePolicy(tensor_model_parallel_size=2, sequence_parallel=False)


def test_tiny_fixtures_parse():
    a5 = parse_hf_config(tiny_glm5_config())
    assert a5.indexer_types == ("full",) * 3 and a5.num_nextn_predict_layers == 1
    a52 = parse_hf_config(tiny_glm52_config())
    assert a52.indexer_types == ("full", "shared", "full", "shared")
    assert a52.qk_rope_head_dim == 16 and a52.rope_theta == 8e6
    assert a52.index_topk < 48, "fixtures must make DSA sparse at test sequence lengths"


def test_num_experts_does_not_shadow_n_routed_experts():
    cfg = raw("glm5")
    cfg["num_experts"] = 8  # written by transformers 5.11-5.12 as a default
    assert parse_hf_config(cfg).n_routed_experts == 256


def test_flat_rope_theta_fallback_and_yarn():
    cfg = raw("glm5")
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 5e5
    assert parse_hf_config(cfg).rope_theta == 5e5
    cfg = raw("glm5")
    cfg["rope_parameters"] = {"rope_theta": 1e4, "rope_type": "yarn", "factor": 40.0,
                              "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}
    arch = parse_hf_config(cfg)
    kw = architecture_kwargs(arch)
    assert kw["rope_type"] == "yarn" and kw["rotary_scaling_factor"] == 40.0 and kw["mscale_all_dim"] == 1.0
    assert arch.softmax_scale == pytest.approx(256**-0.5 * (0.1 * __import__("math").log(40.0) + 1) ** 2)


def test_index_topk_pattern_string():
    cfg = tiny_glm52_config()
    del cfg["indexer_types"]
    cfg["index_topk_pattern"] = "FSFF"
    assert parse_hf_config(cfg).indexer_types == ("full", "shared", "full", "full")
    assert indexer_share_schedule(("full", "shared", "full", "full")) is None  # irregular: explicit pattern only


def _mutated(base: dict, **changes) -> dict:
    cfg = copy.deepcopy(base)
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


_DELETE = object()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="deepseek_v3"), r"'model_type': expected one of \['glm_moe_dsa'\], found 'deepseek_v3'"),
        (dict(model_type=_DELETE), r"'model_type': expected one of .*found None"),
        (dict(kv_lora_rank=_DELETE), r"'kv_lora_rank' is required .* but is missing"),
        (dict(index_topk=_DELETE), r"'index_topk' is required"),
        (dict(hidden_size="6144"), r"'hidden_size': expected int, found str '6144'"),
        (dict(q_lora_rank=0), r"'q_lora_rank': expected a positive integer, found 0"),
        (dict(qk_rope_head_dim=192), r"'qk_rope_head_dim' \(192\) and 'qk_head_dim' - 'qk_nope_head_dim' \(256 - 192 = 64\) disagree"),
        (dict(rope_theta=8e6), r"'rope_parameters.rope_theta' \(1000000\) and 'rope_theta' \(8000000.0\) disagree"),
        (dict(rope_parameters={"rope_type": "default"}), r"'rope_parameters.rope_theta' \(or flat 'rope_theta'\) is required"),
        (dict(rope_parameters={"rope_theta": 1e6, "rope_type": "longrope"}), r"'rope_parameters.rope_type': expected 'default' or 'yarn', found 'longrope'"),
        (dict(rope_interleave=False), r"'rope_interleave': expected true"),
        (dict(indexer_rope_interleave=False), r"'indexer_rope_interleave': expected true or absent .*found false"),
        (dict(mlp_bias=True), r"'mlp_bias': expected false"),
        (dict(layer_types=["indexed_attention"] * 77), r"'layer_types': expected a list of 78 entries"),
        (dict(layer_types=["full_attention"] * 78), r"'layer_types': every GLM-5.x layer is DSA attention .*"
                                                    r"found \['full_attention'\]"),
        (dict(indexer_types=["full"] * 77), r"expected 78 entries \(num_hidden_layers\), found 77"),
        (dict(indexer_types=["shared"] + ["full"] * 77), r"layer 0 is 'shared'"),
        (dict(indexer_types=["full"] * 77 + ["half"]), r"entries must be 'full' or 'shared', found 'half'"),
        (dict(index_topk_pattern="FX"), r"'index_topk_pattern': expected only 'F'/'S' characters, found 'X'"),
        (dict(mlp_layer_types=["dense"] * 78), r"'mlp_layer_types' and 'first_k_dense_replace'/'moe_layer_freq' disagree"),
        (dict(num_experts_per_tok=300), r"'num_experts_per_tok': expected <= n_routed_experts \(256\), found 300"),
        (dict(scoring_func="softmax"), r"'scoring_func': expected 'sigmoid', found 'softmax'"),
        (dict(attention_bias=True), r"'attention_bias': expected false"),
        (dict(index_head_dim=64), r"'index_head_dim': expected > the RoPE width 64"),
        (dict(quantization_config={"quant_method": "awq"}), r"'quantization_config.quant_method': expected 'fp8'"),
        (dict(moe_router_dtype="bfloat16"), r"'moe_router_dtype': expected 'float32', found 'bfloat16'"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(GLM5ConfigError, match=message):
        parse_hf_config(_mutated(raw("glm5"), **changes))


def test_indexer_types_and_pattern_must_agree():
    cfg = tiny_glm52_config(index_topk_pattern="FFFF")
    with pytest.raises(GLM5ConfigError, match="'indexer_types' and 'index_topk_pattern' disagree"):
        parse_hf_config(cfg)


def test_load_hf_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="HF config not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(GLM5ConfigError, match="config.json: not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_glm5_config()))
    assert load_hf_config(tmp_path)["model_type"] == "glm_moe_dsa"


def _transformers_written(tmp_path, **kwargs) -> dict:
    """config.json exactly as the installed transformers writes it (``GlmMoeDsaConfig(...).save_pretrained``)."""
    from transformers import GlmMoeDsaConfig

    GlmMoeDsaConfig(**kwargs).save_pretrained(tmp_path)
    return load_hf_config(tmp_path)


def test_config_written_by_transformers_is_accepted(tmp_path):
    """transformers writes no rope_interleave / indexer_rope_interleave (its GLM code always interleaves) and adds
    layer_types, mlp_layer_types, head_dim and mlp_bias: such a file describes the same model as the release's."""
    released = raw("glm5_2")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "first_k_dense_replace", "routed_scaling_factor", "index_n_heads", "index_head_dim", "index_topk",
            "indexer_types", "rope_parameters", "max_position_embeddings", "rms_norm_eps", "num_nextn_predict_layers")
    written = _transformers_written(tmp_path, **{k: released[k] for k in keep if k in released})
    for absent in ("rope_interleave", "indexer_rope_interleave"):
        assert absent not in written
    for added in ("layer_types", "mlp_layer_types", "head_dim"):
        assert added in written
    ours, theirs = parse_hf_config(written), parse_hf_config(released)
    assert architecture_kwargs(ours) == architecture_kwargs(theirs)
    assert architecture_kwargs(ours)["dsa_indexer_rope_interleaved"] is True


def test_mlp_layer_types_must_agree_with_first_k_dense_replace(tmp_path):
    written = _transformers_written(tmp_path, num_hidden_layers=4, first_k_dense_replace=1)
    assert parse_hf_config(written).mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    written["mlp_layer_types"] = ["dense", "dense", "sparse", "sparse"]
    with pytest.raises(GLM5ConfigError, match="'mlp_layer_types' and 'first_k_dense_replace'"):
        parse_hf_config(written)


def test_runtime_policy_auto_choices_follow_the_machine(caplog):
    """GPU users get the fused DSA kernels and megatron-core's fusions by default (bf16), CPU users the torch paths;
    the choice is logged. Explicit values are never overridden."""
    import logging

    from megatron_glm5.config import RuntimeEnvironment, resolve_policy, runtime_kwargs

    gpu = RuntimeEnvironment(cuda=True, mcore_tilelang_kernels=True, apex_gradient_accumulation_fusion=False)
    gpu_apex = RuntimeEnvironment(cuda=True, mcore_tilelang_kernels=True, apex_gradient_accumulation_fusion=True)
    gpu_no_kernels = RuntimeEnvironment(cuda=True, mcore_tilelang_kernels=False, apex_gradient_accumulation_fusion=False)
    cpu = RuntimeEnvironment(cuda=False, mcore_tilelang_kernels=False, apex_gradient_accumulation_fusion=False)
    with caplog.at_level(logging.INFO, logger="megatron_glm5"):
        kw = runtime_kwargs(RuntimePolicy(), gpu)
    assert kw["dsa_kernel_backend"] == "tilelang" and kw["bias_activation_fusion"] and kw["bias_dropout_fusion"]
    assert not kw["gradient_accumulation_fusion"]
    assert "dsa_kernel_backend='tilelang'" in caplog.text
    assert runtime_kwargs(RuntimePolicy(), gpu_apex)["gradient_accumulation_fusion"]
    assert runtime_kwargs(RuntimePolicy(), gpu_no_kernels)["dsa_kernel_backend"] == "none"
    assert runtime_kwargs(RuntimePolicy(params_dtype=torch.float32), gpu)["dsa_kernel_backend"] == "none"
    kw = runtime_kwargs(RuntimePolicy(), cpu)
    assert kw["dsa_kernel_backend"] == "none" and not kw["bias_activation_fusion"]
    explicit = RuntimePolicy(dsa_kernel_backend="none", fusions=False, moe_grouped_gemm="off")
    assert resolve_policy(explicit, gpu) is explicit
