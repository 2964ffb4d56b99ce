"""GLM-5.x architecture -> megatron-core ``MLATransformerConfig`` kwargs (step 2 of the translation), and the
``GPTModel`` kwargs that come from the checkpoint.

:func:`architecture_kwargs` maps the architecture onto megatron-core field names: the MLA + DSA + MoE table every
family shares (:mod:`megatron_glm5.core.mcore_fields`), GLM-5.x's rows (RoPE base, indexer RoPE and k_norm eps,
SwiGLU), the IndexShare schedule and RoPE / YaRN. :func:`mcore_kwargs` merges them with the runtime policy's
(:func:`megatron_glm5.core.policy.runtime_kwargs`) and :func:`build_transformer_config` instantiates the
megatron-core dataclass. Pure: no I/O, no globals, no distributed state.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import mcore_fields
from ..core.hf_config import INDEXER_K_NORM_EPS
from ..core.patterns import indexshare_schedule
from ..core.policy import RuntimePolicy, merge_kwargs, runtime_kwargs
from .config import GLM5Architecture

# GLM-5.x's rows beyond the shared table: (GLM5Architecture field, megatron-core field)
_FIELDS: tuple[tuple[str, str], ...] = (("rope_theta", "rotary_base"),)

# GLM-5.x's fixed numerics beyond the shared ones
_CONSTANTS: dict[str, Any] = dict(
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    dsa_indexer_rope_interleaved=True,  # checked by parse_hf_config (absent or true)
    dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
    attention_dropout=0.0,
)

indexer_share_schedule = indexshare_schedule  # (freq, offset) for tools that read megatron-core's fields


def architecture_kwargs(arch: GLM5Architecture) -> dict[str, Any]:
    """megatron-core ``MLATransformerConfig`` kwargs that describe the checkpoint (no runtime policy)."""
    kw = mcore_fields.architecture_kwargs(arch, _FIELDS, _CONSTANTS)
    # megatron-core's freq/offset, kept on the config for tools that read it (FLOP counters); our spec always uses
    # the explicit per-layer pattern
    freq, offset = indexshare_schedule(arch.indexer_types) or (1, 0)
    kw["dsa_indexer_topk_freq"] = freq
    kw["dsa_indexer_skip_topk_offset"] = offset
    if arch.yarn is None:
        kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        y = arch.yarn
        kw.update(
            rope_type="yarn",
            rotary_scaling_factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            mscale=y.mscale,
            mscale_all_dim=y.mscale_all_dim,
        )
    return kw


def mcore_kwargs(arch: GLM5Architecture, policy: RuntimePolicy | None = None) -> dict[str, Any]:
    """All ``MLATransformerConfig`` kwargs: the architecture's, then the policy's (disjoint key sets)."""
    return merge_kwargs(architecture_kwargs(arch), runtime_kwargs(policy or RuntimePolicy()))


def build_transformer_config(arch: GLM5Architecture, policy: RuntimePolicy | None = None):
    """Instantiate megatron-core's ``MLATransformerConfig`` (its own validation runs in ``__post_init__``)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**mcore_kwargs(arch, policy))


def gpt_model_kwargs(arch: GLM5Architecture) -> dict[str, Any]:
    """Kwargs for megatron-core ``GPTModel`` that come from the checkpoint."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",  # MLA applies its own RoPE; GPTModel builds none for MLA
    )
