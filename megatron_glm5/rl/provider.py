"""A model provider in the shape RL launchers call: ``model_provider(pre_process, post_process, vp_stage)``.

slime and miles load it with ``--custom-model-provider-path megatron_glm5.rl.provider.model_provider`` and call it with
Megatron-LM's parsed arguments set globally (``megatron.training.get_args()``); :func:`get_model_provider` binds an
explicit ``argparse.Namespace`` instead (verl, NeMo-RL, scripts). The architecture comes from the HF checkpoint
(``--hf-checkpoint``, as those launchers already pass it for sglang), not from architecture flags; the runtime
(parallel sizes, dtype, recompute, dispatcher, determinism) from Megatron-LM's usual arguments. The block spec is ours
(the family's, :mod:`megatron_glm5.families`), so IndexShare, MTP and the PP-split checks come with it.

Arguments read (Megatron-LM / slime / miles names; all optional except ``hf_checkpoint``):

* ``--hf-checkpoint DIR`` - a checkpoint of any registered family (GLM-5.x or GLM-5.3-Flash; its ``config.json``)
  defining the architecture.
* ``--dsa-attention-backend {megatron,tilelang}`` (miles' name; default ``megatron``).
* ``--use-rollout-routing-replay`` (R3) or ``--moe-enable-routing-replay`` - sets megatron-core's
  ``moe_enable_routing_replay`` (its ``RouterReplay`` instances exist; :mod:`megatron_glm5.rl.replay` takes their
  slots, so megatron-core's ``RouterReplay`` API keeps working).
* ``--use-rollout-indexer-replay`` - informational for the launcher (replay data is passed per micro-batch to
  :func:`~megatron_glm5.rl.compute_logprobs` / :func:`~megatron_glm5.rl.logprobs_forward_step`; no model change).
* parallelism: ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
  ``virtual_pipeline_model_parallel_size``, ``expert_model_parallel_size``, ``expert_tensor_parallel_size``,
  ``context_parallel_size``, ``sequence_parallel``, ``decoder_first_pipeline_num_layers``,
  ``decoder_last_pipeline_num_layers``; precision: ``params_dtype`` or ``bf16`` / ``fp16``; ``recompute_granularity``,
  ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``; ``moe_token_dispatcher_type``,
  ``moe_grouped_gemm`` (Megatron-LM's ``--moe-grouped-gemm``: grouped-GEMM routed experts when given, else
  ``SequentialMLP``, as in Megatron-LM); ``deterministic_mode``.

megatron-core's parallel state must be initialised (the launchers do it before building models).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from ..core.hf_config import GLM5ConfigError, load_hf_config
from ..core.policy import RuntimePolicy
from ..families import family_of_architecture, parse_architecture
from ..glm5.spec import BACKENDS

_FLAGS = (
    ("--hf-checkpoint", dict(type=str, default=None,
                             help="GLM-5.x or GLM-5.3-Flash HF checkpoint directory (defines the architecture)")),
    ("--dsa-attention-backend", dict(choices=sorted(BACKENDS), default="megatron",
                                     help="DSA attention backend: megatron-core modules ('megatron') or the fused "
                                          "TileLang attention ('tilelang')")),
    ("--use-rollout-routing-replay", dict(action="store_true",
                                          help="replay the rollout engine's MoE expert choices (R3)")),
    ("--use-rollout-indexer-replay", dict(action="store_true",
                                          help="replay the rollout engine's DSA indexer top-k")),
)


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags above to ``parser`` (those it already has, e.g. slime's own ``--hf-checkpoint``, are left)."""
    group = parser.add_argument_group("megatron-glm5 RL")
    for flag, kwargs in _FLAGS:
        if flag not in parser._option_string_actions:  # argparse has no public "has option" query
            group.add_argument(flag, **kwargs)
    return parser


def policy_from_args(args) -> RuntimePolicy:
    """The :class:`~megatron_glm5.config.RuntimePolicy` Megatron-LM-style ``args`` describe."""

    def get(name: str, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    dtype = get("params_dtype")
    if dtype is None:
        dtype = torch.bfloat16 if get("bf16", False) else torch.float16 if get("fp16", False) else torch.float32
    return RuntimePolicy(
        tensor_model_parallel_size=get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=get("pipeline_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=get("virtual_pipeline_model_parallel_size"),
        expert_model_parallel_size=get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=get("expert_tensor_parallel_size"),
        context_parallel_size=get("context_parallel_size", 1),
        sequence_parallel=None,  # on exactly when TP > 1 (megatron-core's AbsorbedMLA requires it)
        num_layers_in_first_pipeline_stage=get("decoder_first_pipeline_num_layers"),
        num_layers_in_last_pipeline_stage=get("decoder_last_pipeline_num_layers"),
        params_dtype=dtype,
        recompute_granularity=get("recompute_granularity"),
        recompute_method=get("recompute_method"),
        recompute_num_layers=get("recompute_num_layers"),
        recompute_modules=get("recompute_modules"),
        moe_token_dispatcher_type=get("moe_token_dispatcher_type", "allgather"),
        moe_grouped_gemm="on" if get("moe_grouped_gemm", False) else "off",
        deterministic_mode=bool(get("deterministic_mode", False)),
        use_cpu_initialization=bool(get("use_cpu_initialization", not torch.cuda.is_available())),
    )


def build_rl_model(args, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    """The GPTModel ``args`` describe, for this rank's pipeline stage (see module docstring)."""
    from ..model import build_model

    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise GLM5ConfigError("megatron_glm5.rl.provider needs --hf-checkpoint (the HF checkpoint directory "
                              "whose config.json defines the architecture)")
    arch = parse_architecture(load_hf_config(path))
    policy = policy_from_args(args)
    config = family_of_architecture(arch).transformer_config(arch, policy)
    config.moe_enable_routing_replay = bool(getattr(args, "use_rollout_routing_replay", False)
                                            or getattr(args, "moe_enable_routing_replay", False))
    backend = getattr(args, "dsa_attention_backend", None) or "megatron"
    return build_model(arch, policy, backend=backend, config=config, vp_stage=vp_stage, pre_process=pre_process,
                       post_process=post_process)


def get_model_provider(args) -> Callable[..., Any]:
    """``model_provider(pre_process=True, post_process=True, vp_stage=None)`` bound to ``args``."""

    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        return build_rl_model(args, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    return model_provider


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    """slime / miles ``--custom-model-provider-path megatron_glm5.rl.provider.model_provider``: reads Megatron-LM's
    global arguments (``megatron.training.get_args()``)."""
    from megatron.training import get_args

    return build_rl_model(get_args(), pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
