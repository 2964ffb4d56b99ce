"""Shared GLM-5.3-Flash test fixtures: a tiny raw config, transformers' own modules on random weights, our layers
built from :mod:`megatron_glm5.glm5_next.spec`, and weight loading through the bridge table
(:mod:`bridge.glm5_next_mapping`), so parity tests exercise the mapping rows too.

Sizes: 8 indexer heads (ties in the ReLU zero plateau stay rare, see shared notes "testing"), ``index_topk`` 16 with
pools of 4 (width 19), ``v_head_dim`` (12) != ``qk_nope_head_dim`` (16) and ``kv_lora_rank`` 32, so a mixed-up head
or latent width fails loudly.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

HIDDEN = 64
# Gradients (names ending so) of the few-element mHC / KDA parameters: token sums that cancel, so two fp32 paths
# adding in different orders differ by more than their own small max suggests (torch 2.14.1: up to 2.2e-5 of it)
CANCELLING, CANCELLING_RTOL = ("hc.scale", "hc.base", "A_log", "dt_bias"), 1e-4
TINY: dict[str, Any] = dict(
    model_type="glm5_next_text", vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
    qk_rope_head_dim=0, v_head_dim=12, index_topk=16, index_head_dim=16, index_n_heads=8, index_kpool=4,
    linear_head_dim=8, linear_num_heads=4, swiglu_limit=10.0, pad_token_id=0,
    layer_types=["indexed_attention"] * 4, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    indexer_types=["full", "shared", "full", "shared"],
)


def tiny_raw(**overrides: Any) -> dict[str, Any]:
    raw = copy.deepcopy(TINY)
    raw.update(overrides)
    return raw


def hf_text_config(raw: Mapping[str, Any], attn_implementation: str = "eager"):
    from transformers import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg._attn_implementation = attn_implementation
    return cfg


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random at an O(1)-activation scale (norm weights around 1, the KPool gate/ape O(1): they
    start at zero in transformers, which would make pooling a plain mean)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1 or "compress" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim == 1 else 1.0)
                        + (1.0 if name.endswith("weight") and p.ndim == 1 else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def mcore_config(raw: Mapping[str, Any], **policy):
    from megatron_glm5.glm5_next.mcore_config import build_transformer_config
    from megatron_glm5.model import default_cpu_policy

    return build_transformer_config(raw, default_cpu_policy(**policy))


def build_layer(config, layer_idx: int, layer_types, indexer_types, mlp_type: str, backend: str):
    """One of our decoder layers (``GLM5NextTransformerLayer``) from the spec builder."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glm5.glm5_next.spec import build_glm5_next_layer_spec

    spec = build_glm5_next_layer_spec(config, layer_types[layer_idx], mlp_type, indexer_types[layer_idx], backend)
    return build_module(spec, config=config, layer_number=layer_idx + 1)


def load_from_hf(layer: torch.nn.Module, hf_layer_state: Mapping[str, torch.Tensor], arch, layer_idx: int,
                 only: str = "", expert_layout: str = "fused") -> list[str]:
    """Copy HF tensors (names relative to ``layers.{i}.``) into ``layer`` through the bridge table's rows for
    decoder layer ``layer_idx``; rows whose megatron name does not start with ``only`` are skipped. Returns the
    megatron names filled."""
    from bridge.glm5_next_mapping import expand_glm5_next

    exp = expand_glm5_next(arch, expert_layout=expert_layout, hf_prefix="", lm_head=False, layers=[layer_idx])
    prefix = f"decoder.layers.{layer_idx}."
    params = dict(layer.named_parameters())
    params.update(dict(layer.named_buffers()))
    filled = []
    hf_prefix = f"layers.{layer_idx}."
    for m in exp.maps:
        if not m.mcore.startswith(prefix + only):
            continue
        parts = []
        for r in m.hf:
            t = hf_layer_state[r.name[len(hf_prefix):]]
            parts.append(t[r.row] if r.row is not None else t)
        name = m.mcore[len(prefix):]
        with torch.no_grad():
            params[name].copy_(m.transform.to_mcore(parts))
        filled.append(name)
    return filled


def hf_layer_state(module: torch.nn.Module, rel_prefix: str) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers under ``rel_prefix`` (e.g. ``"self_attn."``), detached."""
    return {rel_prefix + n: t.detach() for n, t in module.state_dict().items()}


def hf_grads_as_mcore(hf_module: torch.nn.Module, rel_prefix: str, arch, layer_idx: int,
                      only: str = "") -> dict[str, torch.Tensor | None]:
    """``hf_module``'s parameter gradients (its names under ``rel_prefix``, e.g. ``"self_attn."``) as our logical
    parameters of decoder layer ``layer_idx`` (through the bridge rows, in-memory naming); rows outside
    ``hf_module`` or not starting with ``only`` are left out. None where transformers has no gradient."""
    from bridge.glm5_next_mapping import expand_glm5_next

    exp = expand_glm5_next(arch, expert_layout="fused", hf_prefix="", lm_head=False, layers=[layer_idx], mtp=False)
    grads = {rel_prefix + n: p.grad for n, p in hf_module.named_parameters()}
    head, out = f"layers.{layer_idx}.", {}
    for m in exp.maps:
        name = m.mcore[len(f"decoder.layers.{layer_idx}."):]
        rel = [r.name[len(head):] for r in m.hf]
        if not name.startswith(only) or not all(r in grads for r in rel):
            continue
        parts = [grads[n] if grads[n] is None or r.row is None else grads[n][r.row] for n, r in zip(rel, m.hf)]
        out[name] = None if any(p is None for p in parts) else m.transform.to_mcore(parts)
    return out


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|)."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()
