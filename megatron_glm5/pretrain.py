"""``python -m megatron_glm5.pretrain``: Megatron-LM's training loop (``megatron.training.pretrain``) on GLM-5.x.

Every Megatron-LM flag works as with ``pretrain_gpt.py`` (parallelism, batch sizes, optimizer, checkpointing,
``--mock-data`` or ``--data-path``, recompute, ...). The architecture comes from ``--hf-config`` (a GLM-5.x
``config.json`` or the checkpoint directory holding it) through :mod:`megatron_glm5.config`: its values are written
into Megatron-LM's arguments before validation, so its bookkeeping (layer split, FLOP counts, vocab) agrees with the
model. Passing an architecture flag that contradicts the HF config is an error. ``--glm5-backend`` picks the DSA
attention backend (``megatron`` or ``tilelang``). A GLM-5.3-Flash config (``glm5_next``) trains the same way; its KPool,
KDA and mHC fields, which Megatron-LM has no flags for, go straight into the model config (the family's
``config_from_megatron_lm``, :mod:`megatron_glm5.families`).
With ``--pipeline-model-parallel-size`` its stages exchange the mHC streams (``hc_mult`` times ``--hidden-size``
wide; Megatron-LM's 1F1B schedule is told so when the model is built); virtual pipeline stages are refused.

LoRA (:mod:`megatron_glm5.lora`): ``--lora-rank R`` adds adapters in the model provider, after the model is built
and before Megatron-LM loads a checkpoint, and freezes the base (``--lora-alpha``, ``--lora-dropout``,
``--lora-target-modules``, ``--lora-exclude-modules``; :func:`apply_lora_args`). Two checkpoint modes:

* ``--lora-base-checkpoint DIR``: the frozen base is read from DIR (a ``torch_dist`` checkpoint without adapters,
  e.g. from ``megatron-glm5 convert import``) on every start, and ``--save`` / ``--load`` hold the adapters (and
  their optimizer state) only - small, resumable checkpoints;
* without it: ``--save`` writes full checkpoints (base + adapters, unchanged base keys) and ``--load`` reads them.
  A ``--load`` / ``--pretrained-checkpoint`` without adapters is refused with a pointer to
  ``--lora-base-checkpoint``, the only way adapters may be missing.

Megatron-LM's training loop needs CUDA (it allocates on ``device="cuda"``); on CPU use ``megatron-glm5 demo``.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch

from .core.hf_config import load_hf_config
from .families import family_of_architecture, parse_architecture
from .glm5.spec import BACKENDS

Architecture = Any  # an architecture of any registered family (megatron_glm5.families)

# megatron-core config field -> Megatron-LM argument name, where they differ.
_ARG_NAMES = {"num_moe_experts": "num_experts"}
# Architecture facts that Megatron-LM expresses through other flags.
_DERIVED_ARGS = ("gated_linear_unit", "activation_func")


def add_glm5_args(parser):
    group = parser.add_argument_group("megatron-glm5")
    group.add_argument("--hf-config", required=True,
                       help="GLM-5.x config.json (or the HF checkpoint directory holding it); defines the architecture")
    group.add_argument("--glm5-backend", choices=sorted(BACKENDS), default="megatron",
                       help="DSA attention backend: 'megatron' (megatron-core modules and kernels) or 'tilelang' "
                            "(fused TileLangMLASelfAttention)")
    group.add_argument("--kda-kernel", choices=("auto", "fla", "torch"), default="auto",
                       help="GLM-5.3-Flash's KDA recurrence: 'fla' (flash-linear-attention's chunk_kda), 'torch' (the "
                            "reference; no fla needed) or 'auto' (fla when it imports)")
    group.add_argument("--dsa-indexer-warmup", action="store_true",
                       help="indexer warm-up stage (DeepSeek-V3.2's dense stage): dense main attention, the indexers "
                            "train alone with the dense KL loss (--dsa-indexer-loss-coeff, default 1.0 here), every "
                            "other parameter frozen; the per-layer recall of the attention mass is logged")
    lora = parser.add_argument_group("megatron-glm5 LoRA")
    lora.add_argument("--lora-rank", type=int, default=None,
                      help="add LoRA adapters of this rank (linear_fc1 gets 2x) and freeze the base weights")
    lora.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x --lora-rank)")
    lora.add_argument("--lora-dropout", type=float, default=0.0)
    lora.add_argument("--lora-target-modules", nargs="+", default=None,
                      help="HF or megatron-core names (default: q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj "
                           "gate_proj up_proj down_proj)")
    lora.add_argument("--lora-exclude-modules", nargs="+", default=[],
                      help="target names, groups (attention, indexer, dense_mlp, shared_experts, routed_experts, mtp) "
                           "or regular expressions on module names")
    lora.add_argument("--lora-base-checkpoint", default=None,
                      help="torch_dist checkpoint of the frozen base (adapters missing is allowed here only); "
                           "--save/--load then hold the adapters only")
    return parser


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def architecture_args(arch: Architecture, args=None) -> dict[str, Any]:
    """Megatron-LM argument values that describe ``arch``. For a family whose model provider writes the whole
    architecture into the config (GLM-5.3-Flash: KPool, KDA, mHC), fields Megatron-LM has no argument for (``args``
    given: any it lacks) are left to :func:`model_provider`."""
    family = family_of_architecture(arch)
    kwargs, model = family.architecture_kwargs(arch), family.gpt_model_kwargs(arch)
    values = {_ARG_NAMES.get(k, k): v for k, v in kwargs.items() if k not in _DERIVED_ARGS}
    if family.provider_sets_architecture:
        skip = family.config_only_fields()
        values = {k: v for k, v in values.items() if k not in skip and (args is None or hasattr(args, k))}
    values.update(
        swiglu=True,
        untie_embeddings_and_output_weights=not model["share_embeddings_and_output_weights"],
        position_embedding_type=model["position_embedding_type"],
        max_position_embeddings=model["max_sequence_length"],
        vocab_size=model["vocab_size"],
        make_vocab_size_divisible_by=1,  # the embedding must keep the checkpoint's vocab size
    )
    return values


def apply_architecture(args, arch: Architecture, argv: list[str]) -> list[str]:
    """Write ``arch`` into Megatron-LM's parsed ``args``; refuse explicit flags that disagree. Returns the names of
    the arguments that were changed (for the start-up log)."""
    changed, conflicts = [], []
    lenient = family_of_architecture(arch).provider_sets_architecture
    for name, value in architecture_args(arch, args if lenient else None).items():
        if not hasattr(args, name):
            raise RuntimeError(f"Megatron-LM has no argument '{name}' (megatron-core version mismatch?)")
        current = getattr(args, name)
        if current == value:
            continue
        if _flag(name) in argv:
            conflicts.append(f"{_flag(name)} {current!r} (the HF config says {value!r})")
        setattr(args, name, value)
        changed.append(name)
    if conflicts:
        raise SystemExit("megatron-glm5: flags contradict --hf-config: " + "; ".join(conflicts)
                         + ". Drop them: the architecture comes from the HF config.")
    return changed


def disable_unavailable_fusions(args) -> list[str]:
    """Turn off what Megatron-LM enables by default but needs Transformer Engine or apex CUDA extensions (neither is
    required by megatron-glm5). The gradient-accumulation fusion stays on without apex on CUDA, where megatron-glm5's
    own serves it (``MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION``, :mod:`megatron_glm5.fusions`). Returns the names of the
    settings changed."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    from .core.mla_spec import apex_gradient_accumulation_fusion
    from .fusions import FUSED_WGRAD_ENV, enabled

    changed = []
    if not HAVE_TE and args.transformer_impl == "transformer_engine":
        args.transformer_impl = "local"
        changed.append("transformer_impl=local")
    ours = torch.cuda.is_available() and enabled(FUSED_WGRAD_ENV)
    if args.gradient_accumulation_fusion and not apex_gradient_accumulation_fusion() and not ours:
        args.gradient_accumulation_fusion = False
        changed.append("gradient_accumulation_fusion=False")
    return changed


def choose_dsa_kernels(args, argv: list[str]) -> str | None:
    """Without an explicit ``--dsa-kernel-backend``, use megatron-core's fused TileLang DSA kernels (the ``megatron``
    backend's hooks) when they are importable and the run is bf16, as the Python API's ``RuntimePolicy`` does.
    Returns the choice made, or None when the flag was given."""
    if "--dsa-kernel-backend" in argv:
        return None
    from .core.policy import RuntimeEnvironment

    env = RuntimeEnvironment.detect()
    args.dsa_kernel_backend = "tilelang" if (env.mcore_tilelang_kernels and args.bf16) else "none"
    print(f"megatron-glm5: dsa_kernel_backend={args.dsa_kernel_backend!r} (auto; pass --dsa-kernel-backend to choose)",
          flush=True)
    return args.dsa_kernel_backend


def check_indexer_flags(args, argv: list[str]) -> None:
    """The indexer-training flags (megatron-core's ``--dsa-indexer-loss-coeff`` / ``--dsa-indexer-use-sparse-loss``
    plus our ``--dsa-indexer-warmup``): the warm-up needs a loss coefficient (1.0 unless given) and the dense loss."""
    if not getattr(args, "dsa_indexer_warmup", False):
        return
    if getattr(args, "dsa_indexer_use_sparse_loss", False):
        raise SystemExit("megatron-glm5: --dsa-indexer-warmup trains with the dense loss; drop "
                         "--dsa-indexer-use-sparse-loss (it selects the sparse stage that follows the warm-up)")
    if "--dsa-indexer-loss-coeff" not in argv or not args.dsa_indexer_loss_coeff:
        if "--dsa-indexer-loss-coeff" in argv:
            raise SystemExit("megatron-glm5: --dsa-indexer-warmup needs --dsa-indexer-loss-coeff > 0")
        args.dsa_indexer_loss_coeff = 1.0
    if getattr(args, "lora_rank", None) is not None:
        raise SystemExit("megatron-glm5: --dsa-indexer-warmup trains the indexers alone; drop --lora-rank")


def check_data_flags(args) -> None:
    """Document boundaries must reach DSA attention (:func:`megatron_glm5.spec.check_document_masking`). This
    entry point reads plain ``[b, s]`` micro-batches, so THD packing (``--dataloader-inter-document-masking``) is
    Megatron-LM's ``pretrain_gpt.py --spec megatron_glm5.spec get_glm5_spec``'s job."""
    from .core.hf_config import GLM5ConfigError
    from .glm5.spec import check_document_masking

    try:
        if getattr(args, "dataloader_inter_document_masking", False):
            raise GLM5ConfigError(
                "--dataloader-inter-document-masking: python -m megatron_glm5.pretrain reads plain [b, s] micro-batches; "
                "train packed documents with Megatron-LM's pretrain_gpt.py --spec megatron_glm5.spec get_glm5_spec"
            )
        check_document_masking(args)
    except GLM5ConfigError as e:
        raise SystemExit(f"megatron-glm5: {e}") from None


def model_provider(arch: Architecture, backend: str, pre_process=True, post_process=True, vp_stage=None,
                   config=None, pg_collection=None):
    """Megatron-LM model provider: megatron-core GPTModel with the GLM-5.x block spec."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    from .model import build_model

    args = get_args()
    kda_kernel = getattr(args, "kda_kernel", "auto")
    options = {} if kda_kernel == "auto" else {"kda_kernel": kda_kernel}  # the family's build option, when chosen
    if config is None:
        config = core_transformer_config_from_args(get_args(), MLATransformerConfig)
        try:
            config = family_of_architecture(arch).config_from_megatron_lm(config, arch, **options)
        except TypeError as e:
            if options and "kda_kernel" in str(e):
                raise SystemExit(f"megatron-glm5: --kda-kernel {kda_kernel}: this model has no KDA layers "
                                 "(GLM-5.3-Flash only)") from None
            raise
    elif options:
        raise SystemExit("megatron-glm5: --kda-kernel applies when the model provider builds the config; this caller "
                         "passed its own")
    model = build_model(arch, config=config, backend=backend, vp_stage=vp_stage, pre_process=pre_process,
                        post_process=post_process, indexer_warmup=bool(getattr(args, "dsa_indexer_warmup", False)))
    return apply_lora_args(model, args)


def lora_config_from_args(args):
    """The :class:`~megatron_glm5.lora.LoraConfig` the ``--lora-*`` flags describe, or None without ``--lora-rank``."""
    from .lora import DEFAULT_TARGET_MODULES, LoraConfig

    if getattr(args, "lora_rank", None) is None:
        stray = [f for f in ("lora_alpha", "lora_target_modules", "lora_base_checkpoint")
                 if getattr(args, f, None) is not None]
        if stray:
            raise SystemExit(f"megatron-glm5: {', '.join(_flag(f) for f in stray)} without --lora-rank")
        return None
    try:
        return LoraConfig(args.lora_rank, args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank,
                          dropout=args.lora_dropout, target_modules=args.lora_target_modules or DEFAULT_TARGET_MODULES,
                          exclude_modules=args.lora_exclude_modules or ())
    except ValueError as e:
        raise SystemExit(f"megatron-glm5: {e}") from None


def apply_lora_args(model, args):
    """The model provider's LoRA hook (a no-op without ``--lora-rank``): load ``--lora-base-checkpoint`` into the
    freshly built model, add the adapters, and make checkpoints adapter-only when the base has its own checkpoint.
    Without a base checkpoint, a ``--load`` / ``--pretrained-checkpoint`` that holds no adapters is refused."""
    from .lora import add_lora
    from .lora_checkpoint import checkpoint_has_adapters, load_base_checkpoint, use_adapter_only_checkpoints

    config = lora_config_from_args(args)
    if config is None:
        return model
    base = getattr(args, "lora_base_checkpoint", None)
    if base is not None:
        load_base_checkpoint(model, base)
    add_lora(model, config)
    if base is not None:
        return use_adapter_only_checkpoints(model)
    for flag in ("load", "pretrained_checkpoint"):
        path = getattr(args, flag, None)
        if path and _has_checkpoint(path) and not checkpoint_has_adapters(path):
            raise SystemExit(
                f"megatron-glm5: {_flag(flag)} {path} holds no LoRA adapters: pass it as --lora-base-checkpoint to "
                "load it as the frozen base (then --save/--load hold the adapters only)")
    return model


def _has_checkpoint(path) -> bool:
    from pathlib import Path

    p = Path(path)
    return (p / "latest_checkpointed_iteration.txt").is_file() or (p / ".metadata").is_file()


_BATCH_KEYS = (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
               ("position_ids", torch.int64))


def _get_batch(data_iterator, vp_stage=None):
    """TP rank 0 reads the micro-batch and broadcasts it over its TP group (first and last pipeline stages only:
    the middle ones get activations). DSA attention is causal by construction, so no attention mask is built."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    device = torch.cuda.current_device()
    if ps.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        tensors = [data[k].to(device=device, dtype=dt, non_blocking=True) for k, dt in _BATCH_KEYS]
    else:
        shape = (args.micro_batch_size, args.seq_length)
        tensors = [torch.empty(shape, dtype=dt, device=device) for _, dt in _BATCH_KEYS]
    if ps.get_tensor_model_parallel_world_size() > 1:
        for t in tensors:
            dist.broadcast(t, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    tokens, labels, loss_mask, position_ids = tensors
    return tokens, labels, loss_mask, None, position_ids


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    report.update(_recall_report(loss.device))
    return loss, num_tokens, report


def _recall_report(device) -> dict[str, torch.Tensor]:
    """The warm-up's recall diagnostic (:mod:`megatron_glm5.dsa.indexer_training`) for Megatron-LM's log line: mean
    over this rank's loss-computing layers of the attention mass the indexer's top-k captures, and the best any as many
    keys could capture (averaged over micro-batches and data-parallel ranks like the LM loss). Empty when not warming
    up. Under activation recompute the loss, and so the recall, of a micro-batch is computed in its backward: the
    line then shows the previous micro-batch's."""
    from megatron.training import get_args

    from .dsa.indexer_training import RECALL, mean_recall

    if not getattr(get_args(), "dsa_indexer_warmup", False):
        return {}
    mean = mean_recall(RECALL.take())
    # (value, count) pairs, summed over micro-batches and ranks by Megatron-LM; count 0 when this micro-batch has none
    captured, best, count = (mean[0], mean[1], 1.0) if mean is not None else (0.0, 0.0, 0.0)
    return {"indexer recall": torch.tensor([captured * count, count], device=device),
            "indexer recall best": torch.tensor([best * count, count], device=device)}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch: tokens -> per-token LM loss (MTP loss is attached inside the model)."""
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = _get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """megatron-core GPT datasets: ``--mock-data`` (random tokens) or ``--data-path`` blends."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # DSA attention is causal by construction and ignores masks
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    def built_on_rank():
        return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_on_rank, config).build()


def use_prebuilt_dataset_helpers() -> bool:
    """megatron.training runs ``make`` in ``megatron/core/datasets`` at start-up and exits when it fails, but the
    megatron-core wheel ships the compiled ``helpers_cpp`` extension and no Makefile, so ``make`` always fails there.
    When the prebuilt extension imports and there is nothing to build, the compile step becomes a check of that
    import instead. Returns True if it did so."""
    from pathlib import Path

    import megatron.core.datasets.utils as dataset_utils

    if (Path(dataset_utils.__file__).parent / "Makefile").exists():
        return False
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    dataset_utils.compile_helpers = _check_prebuilt_helpers
    return True


def _check_prebuilt_helpers() -> None:
    from megatron.core.datasets import helpers_cpp  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    argv = sys.argv[1:]
    if not torch.cuda.is_available():
        raise SystemExit("megatron-glm5 pretrain runs Megatron-LM's training loop, which needs CUDA; "
                         "on CPU try `megatron-glm5 demo`")
    args = parse_args(extra_args_provider=add_glm5_args)
    arch = parse_architecture(load_hf_config(args.hf_config))
    if args.tokenizer_type is None and args.mock_data:
        args.tokenizer_type = "NullTokenizer"
    apply_architecture(args, arch, argv)
    check_indexer_flags(args, argv)
    check_data_flags(args)
    disable_unavailable_fusions(args)
    choose_dsa_kernels(args, argv)
    validate_args(args, {})
    set_global_variables(args)
    train_valid_test_datasets_provider.is_distributed = True
    use_prebuilt_dataset_helpers()
    pretrain(
        pretrain_cfg_container_from_args(args, model_cfg=None),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=partial(model_provider, arch, args.glm5_backend),
    )


if __name__ == "__main__":
    main()
