"""Build a megatron-core ``GPTModel`` for GLM-5.3-Flash's text model (what :func:`megatron_glm5.model.build_model`
dispatches to for a :class:`~.config.GLM5NextArchitecture`).

The model is megatron-core's GPTModel with our block spec (KDA / NoPE-DSA mixers and dense / MoE MLPs, all in mHC
streams, final norm over the streams' mean) and our MTP spec (plain NoPE-DSA + MoE layers). Position embeddings: none
(NoPE everywhere; megatron-core's MLA builds a width-0 rotary embedding of its own, which is a no-op).
"""

from __future__ import annotations

from typing import Sequence

from megatron_glm5.config import RuntimePolicy
from megatron_glm5.cpu import attach_cpu_mode, cpu_mode
from megatron_glm5.offload import activation_offload_for

from .config import GLM5NextArchitecture
from .mcore_config import build_transformer_config
from .spec import build_glm5_next_block_spec, build_glm5_next_mtp_spec


def gpt_model_kwargs(arch: GLM5NextArchitecture) -> dict:
    """Kwargs for megatron-core ``GPTModel`` that come from the checkpoint."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="none",
    )


def build_model(
    arch: GLM5NextArchitecture,
    policy: RuntimePolicy | None = None,
    *,
    backend: str = "megatron",
    config=None,
    vp_stage: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    indexer_types: Sequence[str] | None = None,
    kda_kernel: str = "auto",
):
    """A GPTModel for this rank (megatron-core parallel state must be initialised). ``config`` overrides the
    ``GLM5NextTransformerConfig`` built from ``arch`` and ``policy``; ``indexer_types`` the architecture's IndexShare
    pattern; ``kda_kernel`` picks the KDA recurrence kernel (``"auto"``, ``"torch"``, ``"fla"``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config if config is not None else build_transformer_config(arch, policy, kda_kernel=kda_kernel)
    if activation_offload_for(config, policy) is not None:
        raise NotImplementedError(
            "activation offload (RuntimePolicy.activation_offload, or --fine-grained-activation-offloading with an "
            "attention module in --offload-modules) is implemented for GLM-5.x layers, not GLM-5.3-Flash yet")
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    types = tuple(indexer_types) if indexer_types is not None else arch.indexer_types
    block = build_glm5_next_block_spec(config, layer_types=arch.layer_types, indexer_types=types, backend=backend,
                                       vp_stage=vp_stage)
    mtp = build_glm5_next_mtp_spec(config, backend=backend)
    with cpu_mode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            mtp_block_spec=mtp,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            **gpt_model_kwargs(arch),
        )
    return attach_cpu_mode(model)
