"""Build a megatron-core ``GPTModel`` for any registered family (the model provider of our entry points): the family
(:mod:`megatron_glm5.families`) gives the config, the block and MTP specs and the ``GPTModel`` kwargs; everything
else (CPU mode, activation offload, the indexer warm-up's freeze, the position-id check) is the same for all."""

from __future__ import annotations

from typing import Any, Sequence

import torch

# imported with this module, before any caller opens a meta-device scope around build_model: megatron-core creates
# MTPLossAutoScaler's class-level loss scale at import, which would otherwise be a meta tensor for good
from megatron.core.models.gpt.gpt_model import GPTModel

from .core.policy import RuntimePolicy
from .cpu import attach_cpu_mode, cpu_mode
from .device_check import check_on_device
from .dsa.indexer_training import freeze_all_but_indexers
from .dsa.layout import TokenLayout
from .families import family_of_architecture
from .offload import activation_offload_for, attach


def build_model(
    arch,
    policy: RuntimePolicy | None = None,
    *,
    backend: str = "megatron",
    config=None,
    vp_stage: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    indexer_types: Sequence[str] | None = None,
    indexer_warmup: bool | None = None,
    **options: Any,
):
    """A GPTModel for this rank's pipeline stage (megatron-core parallel state must be initialised), for an
    architecture of any registered family (``parse_architecture``'s result).

    ``config`` overrides the megatron-core config built from ``arch`` and ``policy`` (Megatron-LM builds its own
    from flags); ``indexer_types`` defaults to the architecture's IndexShare pattern; ``options`` are the family's
    own build options (GLM-5.3-Flash: ``kda_kernel``). Activation offload (:mod:`megatron_glm5.offload`) is on
    when ``policy.activation_offload`` is, or megatron-core's ``fine_grained_activation_offloading`` names an
    attention module in ``offload_modules``. On a machine without CUDA the model is built in
    :func:`~megatron_glm5.cpu.cpu_mode` and runs its forward with TorchDynamo off
    (:func:`~megatron_glm5.cpu.attach_cpu_mode`); nothing else of the process changes.

    ``indexer_warmup`` (default ``policy.dsa_indexer_warmup``) builds the indexer warm-up stage and freezes every
    parameter but the indexers' (:func:`~megatron_glm5.dsa.indexer_training.freeze_all_but_indexers`). A
    combination the family does not support (GLM-5.3-Flash with context parallelism or the indexer loss) raises
    :class:`~megatron_glm5.families.UnsupportedFeatureError` naming it, before anything is built.
    """
    from megatron.core import parallel_state as ps

    family = family_of_architecture(arch)
    warmup = bool(policy.dsa_indexer_warmup if policy is not None else False) if indexer_warmup is None \
        else indexer_warmup
    given = config if config is not None else policy or RuntimePolicy()  # named in the error: what the caller gave
    config = config if config is not None else family.transformer_config(arch, policy, **options)
    family.refuse_config(config, indexer_warmup=warmup)  # what the family cannot do at all comes first
    check_parallel_state(given)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    types = tuple(indexer_types) if indexer_types is not None else arch.indexer_types
    offload = activation_offload_for(config, policy)
    block = family.block_spec(config, arch, backend=backend, vp_stage=vp_stage, indexer_types=types,
                              activation_offload=offload, indexer_warmup=warmup)
    mtp = family.mtp_spec(config, arch, backend=backend, activation_offload=offload, indexer_types=types,
                          indexer_warmup=warmup)
    with cpu_mode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            mtp_block_spec=mtp,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            **family.gpt_model_kwargs(arch),
        )
    if config.context_parallel_size == 1:  # under CP, position ids are each rank's zigzag shard
        model.register_forward_pre_hook(check_position_ids, with_kwargs=True)
    if offload is not None:  # block scopes: prefetch order, and the checkpoint inputs under full recompute
        attach(model)
    if warmup:
        freeze_all_but_indexers(model)
    return attach_cpu_mode(model)


_PARALLEL_SIZES = (  # (policy / TransformerConfig field, megatron-core parallel_state getter)
    ("tensor_model_parallel_size", "get_tensor_model_parallel_world_size"),
    ("pipeline_model_parallel_size", "get_pipeline_model_parallel_world_size"),
    ("expert_model_parallel_size", "get_expert_model_parallel_world_size"),
    ("expert_tensor_parallel_size", "get_expert_tensor_parallel_world_size"),
    ("context_parallel_size", "get_context_parallel_world_size"),
)


def check_parallel_state(sizes) -> None:
    """``sizes`` (a :class:`~megatron_glm5.config.RuntimePolicy` or a ``TransformerConfig``) must describe the
    initialised megatron-core parallel state. megatron-core shards every layer by the parallel state, not by the
    config, so a mismatch silently built a model whose config says TP=4 in a TP=1 world (unsharded weights, wrong
    checkpoints and collectives). ``expert_tensor_parallel_size`` None means "= TP", as in megatron-core."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return  # megatron-core itself refuses to build without it
    kind = type(sizes).__name__
    bad = []
    for field_name, getter in _PARALLEL_SIZES:
        want = getattr(sizes, field_name, None)
        if want is None and field_name == "expert_tensor_parallel_size":
            want = getattr(sizes, "tensor_model_parallel_size", 1)
        if want is None:
            continue
        have = getattr(ps, getter)()
        if int(want) != int(have):
            bad.append(f"{field_name}={want} but the initialised parallel state has {have}")
    if bad:
        raise ValueError(f"{kind}: {'; '.join(bad)}; initialise megatron-core with these sizes first "
                         "(megatron_glm5.parallel.initialize_model_parallel, or torchrun + Megatron-LM) or build with "
                         "a policy that matches the parallel state")


def check_position_ids(model, args: tuple, kwargs: dict) -> None:
    """``GPTModel.forward`` pre-hook: ``position_ids`` must be the positions DSA attention uses.

    megatron-core's GPTModel never passes ``position_ids`` to MLA, whose RoPE positions come from the sequence, the
    THD packing or (``tilelang`` backend) the attention mask: shifted or reset position ids would otherwise be
    dropped without a word. Rows that attend to nothing (padding) are not compared. A device-side check: no sync."""
    position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
    if position_ids is None:
        return
    mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
    packed = kwargs.get("packed_seq_params")
    b, s = position_ids.shape
    layout = TokenLayout.build(s, b, position_ids.device, packed, mask)
    pos = position_ids.reshape(-1).to(torch.int64)
    check_on_device(
        ((pos == layout.positions) | (layout.ends <= layout.starts)).all(),
        "position_ids differ from the positions GLM-5.x attention uses (offset in the sequence, THD document or "
        "mask range; MLA never reads position_ids): pass documents as THD packing or an attention_mask",
    )


def default_cpu_policy(**overrides) -> RuntimePolicy:
    """Policy for fp32 CPU runs (tests, the demo): deterministic CPU initialisation, torch paths everywhere."""
    kw = dict(params_dtype=torch.float32, use_cpu_initialization=True, mcore_dsa_kernels="none")
    kw.update(overrides)
    return RuntimePolicy(**kw)
