"""GLM-5.3-Flash architecture -> megatron-core ``MLATransformerConfig`` kwargs (+ our KPool, KDA and mHC fields).

The glm5_next counterpart of :mod:`megatron_glm5.glm5.mcore_config`, on the same shared MLA + DSA + MoE table
(:mod:`megatron_glm5.core.mcore_fields`). megatron-core has no field for KPool, KDA or
mHC: :class:`GLM5NextTransformerConfig` adds them (``dsa_indexer_kpool*``, ``kda_*``, ``hc_*``). Same three visible
sections:

1. ``_FIELDS``: 1:1 ``(GLM5NextArchitecture field, megatron-core field)`` rows beyond the shared table, checked for duplicate
   targets at import.
2. Fixed numerics (``_CONSTANTS``) and derived fields (:func:`architecture_kwargs`): MoE layer pattern, shared-expert
   width, clamped SwiGLU (:func:`megatron_glm5.glm5_next.swiglu.clamped_swiglu_kwargs`).
3. Pitfalls, each with its cause:

   * NoPE. megatron-core's MLA has no NoPE switch: it always builds a rotary embedding, defaulting to YaRN with
     ``qk_pos_emb_head_dim = 64`` and ``rotary_scaling_factor = 40``. Set ``qk_pos_emb_head_dim = 0`` and plain
     ``rope_type = "rope"`` with ``rotary_scaling_factor = 1``, ``mscale_all_dim = 0`` (its ``RotaryEmbedding(0)`` on a
     width-0 slice is a no-op; a width-0 ``YarnRotaryEmbedding`` is avoided). The softmax scale is then
     ``1 / sqrt(qk_head_dim + 0) = 1/16``, as in transformers (``qk_head_dim ** -0.5``); the absorbed latent is
     ``kv_lora_rank = 512`` wide for q/k and v, and anything that derives the scale from that width (``512 ** -0.5``)
     is wrong.
   * megatron-core's naming trap, as for GLM-5: its ``qk_head_dim`` is HF's ``qk_nope_head_dim``.
   * The clamped SwiGLU must run megatron-core's unfused GLU: ``bias_activation_fusion`` (which a CUDA runtime policy
     turns on with the other torch fusions) silently drops the clamp, so the architecture's ``False`` wins over the
     policy here (and :func:`~megatron_glm5.glm5_next.swiglu.check_clamped_swiglu` refuses it at spec build).
   * KPool has no megatron-core field: :class:`GLM5NextTransformerConfig` adds ``dsa_indexer_kpool`` /
     ``dsa_indexer_kpool_select_tail`` to ``MLATransformerConfig`` (validated in ``__post_init__``).
   * ``attention_bias``: megatron-core's AbsorbedMLA asserts ``add_bias_linear=False``; a config with biases is
     refused here, naming the field.
   * ``weights_proj`` runs in the model dtype in glm5_next (GLM-5 kept it fp32): our KPool indexer follows
     transformers; ``dsa_indexer_k_norm_fp32`` only matters to megatron-core's own indexer forward, which KPool
     layers never call.

Pure: no I/O, no globals, no distributed state. The IndexShare pattern and the per-layer attention types are not
config fields: the block spec takes them explicitly (``megatron_glm5.glm5_next.spec``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from megatron.core.transformer.transformer_config import MLATransformerConfig

from ..core import mcore_fields
from ..core.hf_config import GLM5ConfigError
from ..core.policy import RuntimePolicy, merge_kwargs, runtime_kwargs

from .config import GLM5NextArchitecture, parse_glm5_next_config
from .swiglu import clamped_swiglu_kwargs


KDA_KERNELS = ("auto", "torch", "fla")


@dataclass
class GLM5NextTransformerConfig(MLATransformerConfig):
    """megatron-core's ``MLATransformerConfig`` plus the KPool indexer's pool settings (no megatron-core field)."""

    dsa_indexer_kpool: int = 1
    """Pool size ``P`` of the KPool indexer (HF ``index_kpool``): pools of ``P`` consecutive tokens are scored."""

    dsa_indexer_kpool_select_tail: bool = True
    """Append the query's incomplete tail pool (HF ``index_kpool_always_select_tail``): top-k width
    ``dsa_indexer_topk + dsa_indexer_kpool - 1``."""

    kda_num_heads: int = 0
    """KDA (linear-attention) heads (HF ``linear_num_heads``); q, k and v all have ``kda_num_heads`` heads."""

    kda_head_dim: int = 0
    """KDA head width for q, k and v (HF ``linear_head_dim``)."""

    kda_conv_kernel_dim: int = 4
    """Width of KDA's causal depthwise short convolution (HF ``linear_conv_kernel_dim``)."""

    kda_lower_bound: float | None = -5.0
    """KDA "safe gate" lower bound of the per-channel log-decay (HF ``linear_lower_bound``); None: softplus gate."""

    kda_qk_l2norm_eps: float = 1e-6
    """eps of KDA's per-head q/k L2 norm (``x / sqrt(|x|^2 + eps)``; hard-coded in transformers and fla)."""

    kda_kernel: str = "auto"
    """KDA recurrence kernel (runtime policy): ``"torch"`` (:mod:`~megatron_glm5.glm5_next.kda_reference`), ``"fla"``
    (flash-linear-attention's ``chunk_kda``, CUDA) or ``"auto"`` (fla for CUDA tensors when it is installed)."""

    hc_mult: int = 0
    """mHC residual streams per token (HF ``hc_mult``); 0 builds plain pre-norm residual layers."""

    hc_eps: float = 1e-6
    """mHC floor added to the pre weights, the mixing matrix and every Sinkhorn denominator (HF ``hc_eps``)."""

    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations of the mHC mixing matrix (HF ``hc_sinkhorn_iters``)."""

    def __post_init__(self):
        super().__post_init__()
        if self.kda_kernel not in KDA_KERNELS:
            raise GLM5ConfigError(f"kda_kernel: expected one of {list(KDA_KERNELS)}, found {self.kda_kernel!r}")
        if self.hc_mult < 0 or self.hc_sinkhorn_iters < 1:
            raise GLM5ConfigError(f"hc_mult / hc_sinkhorn_iters: expected >= 0 / >= 1, found {self.hc_mult} / "
                                  f"{self.hc_sinkhorn_iters}")
        if self.dsa_indexer_kpool < 1:
            raise GLM5ConfigError(f"dsa_indexer_kpool: expected a positive pool size, found {self.dsa_indexer_kpool}")
        if self.dsa_indexer_topk is not None and self.dsa_indexer_topk % self.dsa_indexer_kpool:
            raise GLM5ConfigError(
                f"dsa_indexer_topk: expected a multiple of dsa_indexer_kpool ({self.dsa_indexer_kpool}), found "
                f"{self.dsa_indexer_topk} (HF index_topk must be a multiple of index_kpool)"
            )

    @property
    def dsa_topk_width(self) -> int:
        """Width of the KPool top-k rows: ``dsa_indexer_topk`` plus ``P - 1`` tail slots when the tail is on."""
        tail = self.dsa_indexer_kpool - 1 if self.dsa_indexer_kpool_select_tail else 0
        return self.dsa_indexer_topk + tail

    @property
    def pipeline_hidden_size(self) -> int:
        """Last dim of the hidden states between decoder layers, hence between pipeline stages: the ``hc_mult`` mHC
        streams side by side (``[s, b, hc_mult * hidden_size]``), or ``hidden_size`` without mHC
        (:func:`megatron_glm5.compat.send_pipeline_hidden_size` makes megatron-core's schedule send that width)."""
        return self.hidden_size * max(1, self.hc_mult)


# GLM-5.3-Flash's rows beyond the shared table: (GLM5NextArchitecture field, megatron-core field)
_FIELDS: tuple[tuple[str, str], ...] = (
    ("indexer_k_norm_eps", "dsa_indexer_k_norm_epsilon"),  # hard-coded 1e-6 LayerNorm in transformers
    ("index_kpool", "dsa_indexer_kpool"),
    ("index_kpool_always_select_tail", "dsa_indexer_kpool_select_tail"),
    ("attention_dropout", "attention_dropout"),
    ("linear_num_heads", "kda_num_heads"),
    ("linear_head_dim", "kda_head_dim"),
    ("linear_conv_kernel_dim", "kda_conv_kernel_dim"),
    ("linear_lower_bound", "kda_lower_bound"),
    ("kda_qk_l2norm_eps", "kda_qk_l2norm_eps"),
    ("hc_mult", "hc_mult"),
    ("hc_eps", "hc_eps"),
    ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
)

# GLM-5.3-Flash's fixed numerics beyond the shared ones
_CONSTANTS: dict[str, Any] = dict(
    # NoPE on megatron-core (pitfalls): a width-0 plain RoPE, scale 1/sqrt(qk_head_dim)
    rope_type="rope",
    rotary_scaling_factor=1.0,
    mscale=1.0,
    mscale_all_dim=0.0,
    dsa_indexer_topk_freq=1,  # IndexShare is passed per layer to the block spec, never as freq/offset
    dsa_indexer_skip_topk_offset=0,
)


def architecture_kwargs(arch: GLM5NextArchitecture) -> dict[str, Any]:
    """megatron-core kwargs that describe the checkpoint's NoPE DSA and MLP/MoE layers (no runtime policy)."""
    if arch.attention_bias:
        raise GLM5ConfigError(
            "config field 'attention_bias': expected false (megatron-core's AbsorbedMLA has no q_a / kv_a / o_proj "
            "bias), found true"
        )
    if arch.qk_rope_head_dim != 0:  # parse_glm5_next_config refuses it too; an architecture may be built by hand
        raise GLM5ConfigError(
            f"config field 'qk_rope_head_dim': expected 0 (GLM-5.3-Flash attention has no RoPE), found "
            f"{arch.qk_rope_head_dim}"
        )
    return mcore_fields.architecture_kwargs(arch, _FIELDS, {**_CONSTANTS, **clamped_swiglu_kwargs(arch.swiglu_limit)})


def mcore_kwargs(
    arch: GLM5NextArchitecture | Mapping[str, Any], policy: RuntimePolicy | None = None, *, kda_kernel: str = "auto"
) -> dict[str, Any]:
    """All :class:`GLM5NextTransformerConfig` kwargs: the architecture's (a raw ``config.json`` dict is parsed first),
    then the policy's. The clamped SwiGLU's ``bias_activation_fusion=False`` overrides the policy's fusions.
    ``kda_kernel`` picks the KDA recurrence kernel (``GLM5NextTransformerConfig.kda_kernel``)."""
    if not isinstance(arch, GLM5NextArchitecture):
        arch = parse_glm5_next_config(arch)
    a = architecture_kwargs(arch)
    r = runtime_kwargs(policy or RuntimePolicy())
    r.pop("bias_activation_fusion")  # the fused bias-SwiGLU takes no clamp (pitfalls)
    r["kda_kernel"] = kda_kernel
    return merge_kwargs(a, r)


def build_transformer_config(
    arch: GLM5NextArchitecture | Mapping[str, Any], policy: RuntimePolicy | None = None, *, kda_kernel: str = "auto"
) -> GLM5NextTransformerConfig:
    """Instantiate :class:`GLM5NextTransformerConfig` (megatron-core's own validation runs in ``__post_init__``)."""
    return GLM5NextTransformerConfig(**mcore_kwargs(arch, policy, kda_kernel=kda_kernel))


def config_only_fields() -> frozenset[str]:
    """KPool, KDA and mHC fields: Megatron-LM has no arguments for them (they reach the config in its model
    provider, :func:`config_from_megatron_lm`)."""
    base = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    return frozenset(f.name for f in dataclasses.fields(GLM5NextTransformerConfig)) - base


def config_from_megatron_lm(
    config, arch: GLM5NextArchitecture, *, kda_kernel: str = "auto"
) -> GLM5NextTransformerConfig:
    """Megatron-LM's ``MLATransformerConfig`` (parallelism, precision, recompute, ...) as a
    ``GLM5NextTransformerConfig`` with the whole GLM-5.3-Flash architecture (KPool, KDA, mHC included) and the
    build option ``kda_kernel`` (``--kda-kernel``), as :func:`build_transformer_config` takes it."""
    kw = {f.name: getattr(config, f.name) for f in dataclasses.fields(MLATransformerConfig) if f.init}
    kw.update(architecture_kwargs(arch))
    return GLM5NextTransformerConfig(**kw, kda_kernel=kda_kernel)


def gpt_model_kwargs(arch: GLM5NextArchitecture) -> dict[str, Any]:
    """Kwargs for megatron-core ``GPTModel`` that come from the checkpoint: no position embedding (NoPE; megatron-core's
    MLA builds a width-0 rotary embedding of its own, a no-op)."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="none",
    )
