"""The megatron-core ``MLATransformerConfig`` fields every MLA + DSA + MoE family fills the same way: a 1:1 field
table, fixed numerics and the MoE / MTP fields derived from the architecture. Each family adds its own rows
(:func:`architecture_kwargs`' ``fields`` / ``constants``)."""

from __future__ import annotations

from typing import Any, Sequence

from .patterns import moe_layer_flags

# (architecture field, megatron-core field), shared by the families
MLA_DSA_FIELDS: tuple[tuple[str, str], ...] = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("intermediate_size", "ffn_hidden_size"),
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_head_dim"),  # naming trap: megatron's qk_head_dim is HF's nope part
    ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("rms_norm_eps", "layernorm_epsilon"),
    ("index_n_heads", "dsa_indexer_n_heads"),
    ("index_head_dim", "dsa_indexer_head_dim"),
    ("index_topk", "dsa_indexer_topk"),
    ("n_routed_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
)

# Fixed numerics of MLA + DSA + sigmoid-routed MoE that config.json does not store.
MLA_DSA_CONSTANTS: dict[str, Any] = dict(
    multi_latent_attention=True,
    normalization="RMSNorm",
    qk_layernorm=True,
    add_bias_linear=False,
    add_qkv_bias=False,
    apply_rope_fusion=False,  # megatron-core asserts this for DSA
    experimental_attention_variant="dsa",
    dsa_indexer_rotate_activation=False,  # no Hadamard
    dsa_indexer_scoring_relu=True,
    dsa_indexer_k_norm_fp32=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,  # e_score_correction_bias
    moe_router_pre_softmax=True,
    moe_router_dtype="fp32",
    hidden_dropout=0.0,
)


def check_unique_targets(fields: Sequence[tuple[str, str]]) -> None:
    """No megatron-core field may be written twice (the first-wins shadowing bug of generic tables)."""
    targets = [t for _, t in fields]
    dup = sorted({t for t in targets if targets.count(t) > 1})
    assert not dup, f"megatron-core field(s) {dup} written twice"


def architecture_kwargs(arch: Any, fields: Sequence[tuple[str, str]] = (),
                        constants: dict[str, Any] | None = None) -> dict[str, Any]:
    """megatron-core kwargs of an MLA + DSA + MoE architecture: the shared table, the family's ``fields`` and
    ``constants``, and the MoE layer pattern, shared-expert width, router groups and MTP depth."""
    table = MLA_DSA_FIELDS + tuple(fields)
    check_unique_targets(table)
    kw: dict[str, Any] = {mcore: getattr(arch, hf) for hf, mcore in table}
    kw.update(MLA_DSA_CONSTANTS)
    kw.update(constants or {})
    kw["moe_layer_freq"] = moe_layer_flags(arch.mlp_layer_types)
    kw["moe_shared_expert_intermediate_size"] = arch.moe_intermediate_size * arch.n_shared_experts or None
    if arch.n_group > 1:
        kw["moe_router_num_groups"] = arch.n_group
        kw["moe_router_group_topk"] = arch.topk_group
    kw["mtp_num_layers"] = arch.num_nextn_predict_layers or None
    return kw
