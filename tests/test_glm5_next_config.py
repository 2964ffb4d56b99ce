"""GLM-5.3-Flash config parsing: the released values (rebuilt, tests/data), configs written by transformers 5.24
itself (nested VL and flat text), hand-written dicts with legacy fields, and bad configs (errors name the field,
the expected and the found value)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from megatron_glm5.config import GLM5ConfigError, load_hf_config
from megatron_glm5.glm5_next.config import GLM5NextArchitecture, parse_glm5_next_config

DATA = Path(__file__).parent / "data"
N = 45
DSA = tuple(range(3, 45, 4))


def released() -> dict:
    return load_hf_config(DATA / "glm5_3_flash_config.json")


def tiny_text(**overrides) -> dict:
    """A small flat text config (as a hand-written config.json would be)."""
    raw = dict(
        model_type="glm5_next_text", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=0,
        v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4, linear_head_dim=8,
        linear_num_heads=4, hc_mult=4, pad_token_id=0,
    )
    raw.update(overrides)
    return raw


def _hf_text_config(**kwargs):
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(**kwargs)


def assert_matches_hf(arch: GLM5NextArchitecture, hf_text) -> None:
    """Every architecture field transformers also has must hold transformers' value."""
    compared = 0
    for f in dataclasses.fields(arch):
        if f.name in ("model_type", "vision_config", "quantization", "torch_dtype") or not hasattr(hf_text, f.name):
            continue
        ours, theirs = getattr(arch, f.name), getattr(hf_text, f.name)
        if isinstance(theirs, list):
            theirs = tuple(theirs)
        assert ours == theirs, f"{f.name}: ours {ours!r} != transformers {theirs!r}"
        compared += 1
    assert compared >= 40, f"only {compared} fields compared with transformers"
    assert arch.qk_head_dim == hf_text.qk_head_dim


# --------------------------------------------------------------------------------------------------------------------
# the released values
# --------------------------------------------------------------------------------------------------------------------


def test_released_config():
    arch = parse_glm5_next_config(released())
    assert arch.model_type == "glm5_next"
    assert arch.num_hidden_layers == N and arch.hidden_size == 4096 and arch.vocab_size == 154880
    assert arch.dsa_layers == DSA and len(arch.kda_layers) == 34 and 44 in arch.kda_layers
    assert arch.dense_mlp_layers == (0, 1, 2) and arch.moe_layers == tuple(range(3, N))
    assert arch.indexer_types == ("full",) * N and arch.full_indexer_layers == DSA
    # NoPE MLA
    assert (arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim) == (256, 0, 256)
    assert arch.qk_head_dim == 256 and arch.softmax_scale == 1 / 16
    assert arch.absorbed_qk_dim == 512 and arch.absorbed_v_dim == 512
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.num_attention_heads) == (1536, 512, 64)
    # KPool indexer: the released pool size, not transformers' default 16
    assert (arch.index_topk, arch.index_kpool, arch.index_n_heads, arch.index_head_dim) == (2048, 4, 32, 128)
    assert arch.index_kpool_always_select_tail and arch.pool_topk == 512 and arch.topk_width == 2051
    # KDA, mHC, FFN
    assert (arch.linear_num_heads, arch.linear_head_dim, arch.linear_conv_kernel_dim) == (64, 128, 4)
    assert arch.linear_lower_bound == -5.0 and arch.kda_dim == 8192
    assert (arch.hc_mult, arch.hc_eps, arch.hc_sinkhorn_iters, arch.mhc_fn_rows) == (4, 1e-6, 20, 24)
    assert arch.swiglu_limit == 10.0 and arch.hidden_act == "silu"
    assert (arch.n_routed_experts, arch.num_experts_per_tok, arch.n_shared_experts) == (288, 8, 1)
    assert arch.shared_expert_intermediate_size == 2048 and arch.routed_scaling_factor == 2.5
    assert arch.num_nextn_predict_layers == 1 and not arch.tie_word_embeddings
    # eps: three hard-coded, the rest rms_norm_eps
    assert (arch.indexer_k_norm_eps, arch.kda_qk_l2norm_eps, arch.router_norm_eps) == (1e-6, 1e-6, 1e-20)
    assert arch.rms_norm_eps == arch.mla_norm_eps == arch.mhc_norm_eps == arch.kda_o_norm_eps == 1e-5
    # vision: carried opaquely, read-only
    assert arch.vision_config["out_hidden_size"] == 4096
    with pytest.raises(TypeError):
        arch.vision_config["depth"] = 1  # type: ignore[index]


def test_architecture_is_frozen_and_slotted():
    arch = parse_glm5_next_config(released())
    with pytest.raises(dataclasses.FrozenInstanceError):
        arch.index_kpool = 16  # type: ignore[misc]
    assert not hasattr(arch, "__dict__")


def test_released_config_derived_lists_match_explicit():
    """Dropping layer_types / mlp_layer_types / indexer_types gives the same architecture (transformers' rules)."""
    raw = released()
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        del raw["text_config"][key]
    assert parse_glm5_next_config(raw) == parse_glm5_next_config(released())


def test_released_config_agrees_with_transformers():
    from transformers import Glm5NextConfig

    raw = released()
    hf = Glm5NextConfig(**copy.deepcopy(raw))
    assert_matches_hf(parse_glm5_next_config(raw), hf.text_config)


# --------------------------------------------------------------------------------------------------------------------
# configs written by transformers
# --------------------------------------------------------------------------------------------------------------------


def _saved(config, tmp_path) -> dict:
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_transformers_nested_vl_config(tmp_path):
    from transformers import Glm5NextConfig

    hf = Glm5NextConfig(text_config=dict(index_kpool=4, num_hidden_layers=12, swiglu_limit=7.0))
    raw = _saved(hf, tmp_path)
    assert "text_config" in raw and raw["text_config"]["head_dim"] == 0  # what transformers writes
    arch = parse_glm5_next_config(raw)
    assert_matches_hf(arch, hf.text_config)
    assert arch.model_type == "glm5_next" and arch.dsa_layers == (3, 7, 11)
    assert arch.swiglu_limit == 7.0 and arch.index_kpool == 4 and arch.topk_width == 2051
    assert arch.vision_config["model_type"] == "glm5_next_vision"


def test_transformers_flat_text_config(tmp_path):
    hf = _hf_text_config(**{k: v for k, v in tiny_text().items() if k != "model_type"})
    raw = _saved(hf, tmp_path)
    assert raw["model_type"] == "glm5_next_text" and "text_config" not in raw
    arch = parse_glm5_next_config(raw)
    assert_matches_hf(arch, hf)
    assert arch.dsa_layers == (3, 7) and arch.vision_config is None
    assert arch.topk_width == 8 + 3


def test_transformers_default_kpool_is_read_not_assumed(tmp_path):
    """A config transformers wrote with its default pool size parses as 16 (the file says so)."""
    raw = _saved(_hf_text_config(), tmp_path)
    assert raw["index_kpool"] == 16
    arch = parse_glm5_next_config(raw)
    assert arch.index_kpool == 16 and arch.topk_width == 2063


def test_flat_glm5_next_config_forwarded_like_transformers():
    """model_type glm5_next with the text fields at the top level: transformers forwards them to text_config."""
    from transformers import Glm5NextConfig

    raw = tiny_text(model_type="glm5_next")
    hf = Glm5NextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    arch = parse_glm5_next_config(raw)
    assert arch.model_type == "glm5_next"
    assert_matches_hf(arch, hf.text_config)


# --------------------------------------------------------------------------------------------------------------------
# hand-written dicts: legacy fields and derived lists, each compared with what transformers makes of the same dict
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"index_topk_pattern": "FFFFFFFS"},  # layer 7 (DSA) shares layer 3's top-k
        {"index_topk_freq": 2, "index_skip_topk_offset": 0},
        {"linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 3,
                                "gate_lower_bound": None, "safe_gate": True}},
        {"linear_attn_config": {"gate_lower_bound": None, "safe_gate": False}},
        {"linear_lower_bound": None},
        {"layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]},
        {"mlp_layer_types": ["dense"] + ["sparse"] * 7},
        {"num_hidden_layers": 2},
    ],
    ids=["defaults", "pattern", "freq-offset", "legacy-kda", "legacy-no-safe-gate", "softplus-gate", "full_attention",
         "one-dense", "two-layers"],
)
def test_hand_written_matches_transformers(overrides):
    raw = tiny_text(**overrides)
    hf = _hf_text_config(**{k: v for k, v in raw.items() if k != "model_type"})
    arch = parse_glm5_next_config(raw)
    assert_matches_hf(arch, hf)


def test_shared_layer_source_skips_kda_layers():
    arch = parse_glm5_next_config(tiny_text(index_topk_pattern="FFFFFFFS"))
    assert arch.indexer_types[7] == "shared" and arch.full_indexer_layers == (3,)
    assert arch.indexer_source(7) == 3 and arch.indexer_source(3) == 3
    with pytest.raises(ValueError, match="layer 2 is a 'linear_attention' layer"):
        arch.indexer_source(2)


def test_shared_entries_on_kda_layers_are_ignored():
    """Entries for KDA layers are never read: a 'shared' there needs no source."""
    arch = parse_glm5_next_config(tiny_text(indexer_types=["shared"] * 3 + ["full"] + ["shared"] * 4))
    assert arch.full_indexer_layers == (3,) and arch.indexer_source(7) == 3


# --------------------------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------------------------


def _set(path: str, value):
    def apply(raw):
        node = raw
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value

    apply.label = path  # the test id
    return apply


_DELETE = object()


@pytest.mark.parametrize(
    "mutate, fragments",
    [
        (_set("text_config.qk_rope_head_dim", 64), ["'qk_rope_head_dim'", "expected 0", "found 64"]),
        (_set("text_config.index_topk", 2050), ["'index_topk'", "multiple of index_kpool (4)", "found 2050"]),
        (_set("text_config.index_kpool", 0), ["'index_kpool'", "positive", "found 0"]),
        (_set("text_config.index_kpool", _DELETE), ["'index_kpool'", "required", "16", "4"]),
        (_set("text_config.indexer_types", ["full"] * 3 + ["shared"] + ["full"] * 41),
         ["'indexer_types[3]'", "expected 'full'", "found 'shared'"]),
        (_set("text_config.layer_types", ["linear_attention"] * 44), ["'layer_types'", "expected 45", "found 44"]),
        (_set("text_config.mlp_layer_types", ["dense"] * 46), ["'mlp_layer_types'", "expected 45", "found 46"]),
        (_set("text_config.indexer_types", ["full"] * 11), ["'indexer_types'", "expected 45", "found 11"]),
        (_set("text_config.layer_types", ["linear_attention"] * 44 + ["mamba"]),
         ["'layer_types[44]'", "'indexed_attention'", "found 'mamba'"]),
        (_set("text_config.mlp_layer_types", ["dense"] * 44 + ["moe"]), ["'mlp_layer_types[44]'", "found 'moe'"]),
        (_set("text_config.num_key_value_heads", 8), ["'num_key_value_heads'", "expected num_attention_heads (64)",
                                                      "found 8"]),
        (_set("text_config.qk_head_dim", 320), ["'qk_head_dim'", "= 256", "found 320"]),
        (_set("text_config.hidden_act", "gelu"), ["'hidden_act'", "expected 'silu'", "found 'gelu'"]),
        (_set("text_config.swiglu_limit", 0.0), ["'swiglu_limit'", "positive", "found 0.0"]),
        (_set("text_config.swiglu_limit", "10"), ["'swiglu_limit'", "expected float", "found str"]),
        (_set("text_config.num_experts_per_tok", 300), ["'num_experts_per_tok'", "<= n_routed_experts (288)",
                                                        "found 300"]),
        (_set("text_config.n_group", 5), ["'n_group'", "found n_group=5"]),
        (_set("text_config.num_local_experts", 256), ["'n_routed_experts' (288)", "'num_local_experts' (256)"]),
        (_set("text_config.q_lora_rank", None), ["'q_lora_rank'", "required"]),
        (_set("text_config.linear_lower_bound", 5.0), ["'linear_lower_bound'", "negative", "found 5.0"]),
        (_set("text_config.hc_eps", 0.0), ["'hc_eps'", "positive", "found 0.0"]),
        (_set("text_config.hc_sinkhorn_iters", 0), ["'hc_sinkhorn_iters'", "positive", "found 0"]),
        (_set("text_config.model_type", "glm_moe_dsa"), ["'text_config.model_type'", "'glm5_next_text'",
                                                         "found 'glm_moe_dsa'"]),
        (_set("model_type", "glm_moe_dsa"), ["'model_type'", "'glm5_next'", "found 'glm_moe_dsa'"]),
        (_set("tie_word_embeddings", True), ["'tie_word_embeddings' (True)", "'text_config.tie_word_embeddings'"]),
        (_set("text_config.num_nextn_predict_layers", -1), ["'num_nextn_predict_layers'", "found -1"]),
        (_set("text_config", "oops"), ["'text_config'", "expected a JSON object", "found str"]),
    ],
    ids=lambda v: getattr(v, "label", None),
)
def test_bad_config_names_field(mutate, fragments):
    raw = released()
    mutate(raw)
    with pytest.raises(GLM5ConfigError) as err:
        parse_glm5_next_config(raw)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_bad_index_topk_pattern_names_field():
    with pytest.raises(GLM5ConfigError, match=r"'index_topk_pattern'.*'F'/'S'.*found 'X'"):
        parse_glm5_next_config(tiny_text(index_topk_pattern="FFFXFFFF"))


def test_transformers_rejects_what_we_reject():
    """The two architecture rules we share with transformers' own validation."""
    with pytest.raises(Exception, match="NoPE"):  # huggingface_hub wraps the ValueError
        _hf_text_config(qk_rope_head_dim=64)
    with pytest.raises(Exception, match="divisible"):
        _hf_text_config(index_topk=2050, index_kpool=4)
