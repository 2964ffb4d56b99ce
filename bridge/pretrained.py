"""``from_hf_pretrained``: a megatron-core GPTModel with GLM-5.x weights from an HF checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch


def from_hf_pretrained(
    hf_path: str | Path,
    *,
    backend: str = "megatron",
    params_dtype: torch.dtype | None = None,
    policy=None,
    progress: bool | None = False,
    num_layers: int | None = None,
):
    """Build the model described by ``hf_path/config.json`` for this rank and load the HF weights into it.
    ``hf_path`` is a local checkpoint directory (a Hub id is not downloaded).

    If megatron-core's parallel state is not initialised, a single-process one is created (TP=PP=EP=1; gloo on
    CPU, NCCL with a GPU); otherwise the model is built for the existing layout and this rank loads only its
    shards. ``params_dtype`` defaults to bf16 on CUDA (the fused kernels' dtype) and fp32 on CPU. On CUDA the fused
    DSA kernels and megatron-core's fusions are chosen when available (logged; see
    :func:`megatron_glm5.config.resolve_policy`); on a machine without CUDA the model runs megatron-core's torch
    paths (see :mod:`megatron_glm5.cpu` for the little that changes in the process). ``policy`` (a
    :class:`~megatron_glm5.config.RuntimePolicy`) overrides the default one; its parallel sizes must match the
    parallel state. Returns the ``GPTModel`` in eval mode; ``model(input_ids, position_ids)``
    gives logits ``[b, s, vocab]``. The HF config is kept as ``model.glm5_hf_config`` for ``bridge.export_hf``.

    ``num_layers``: build only the first N decoder layers with the final norm and LM head, no MTP, and read only
    their tensors (``verify --num-layers``: a parity check of a 744B model on one node). The checkpoint is still
    validated whole; see :func:`bridge.source.open_hf_source`.
    """
    from megatron.core import parallel_state as ps

    from .errors import CheckpointFormatError
    from .inmemory import load_hf_weights
    from .preflight import parse_config
    from .source import truncate_hf_config

    from megatron_glm5.architectures import parse_architecture
    from megatron_glm5.config import RuntimePolicy, load_hf_config
    from megatron_glm5.model import build_model
    from megatron_glm5.parallel import initialize_model_parallel

    cuda = torch.cuda.is_available()
    if params_dtype is None:
        params_dtype = torch.bfloat16 if cuda else torch.float32
    if not Path(hf_path).is_dir():
        raise CheckpointFormatError(
            f"from_hf_pretrained: {hf_path} is not a local directory; it takes an HF checkpoint directory on disk "
            "(config.json + safetensors), not a Hub id: download it first (e.g. `huggingface-cli download "
            "zai-org/GLM-5 --local-dir GLM-5`)")
    raw = load_hf_config(hf_path)
    parse_config(raw, hf_path)  # a field error names the file
    if num_layers is not None:
        raw = truncate_hf_config(raw, num_layers, source=f"{hf_path}/config.json")
    arch = parse_architecture(raw)
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel()
    if policy is None:
        policy = RuntimePolicy(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            params_dtype=params_dtype,
            use_cpu_initialization=not cuda,
            perform_initialization=False,  # every weight is overwritten from the checkpoint
        )
    model = build_model(arch, policy, backend=backend)
    if cuda:
        model = model.cuda()
    load_hf_weights(model, hf_path, progress=progress, num_layers=num_layers)
    model.eval()
    return model
