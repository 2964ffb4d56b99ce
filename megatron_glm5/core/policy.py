"""How a model runs, for every family: :class:`RuntimePolicy` (parallelism, precision, recompute, kernels, offload),
the machine's :class:`RuntimeEnvironment`, the ``"auto"`` choices made for it (:func:`resolve_policy`) and the
megatron-core config fields they give (:func:`runtime_kwargs`). Never what the model is: a family's architecture
gives those fields, and :func:`merge_kwargs` keeps the two disjoint."""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass(frozen=True, slots=True)
class RuntimeEnvironment:
    """What the machine offers, as far as the runtime policy's ``"auto"`` choices are concerned."""

    cuda: bool
    mcore_tilelang_kernels: bool  # megatron-core's TileLang DSA kernels (lighting_indexer, SparseMLA) importable
    apex_gradient_accumulation_fusion: bool  # apex's fused_weight_gradient_mlp_cuda importable
    transformer_engine: bool = False  # Transformer Engine importable

    @classmethod
    @functools.cache
    def detect(cls) -> "RuntimeEnvironment":
        cuda = torch.cuda.is_available()
        kernels = False
        if cuda:
            from ..compat import missing_tilelang_dsa_kernel_dependencies

            kernels = not missing_tilelang_dsa_kernel_dependencies()
        try:
            import fused_weight_gradient_mlp_cuda  # noqa: F401  (apex)

            gaf = cuda
        except ImportError:
            gaf = False
        from megatron.core.extensions.transformer_engine import HAVE_TE

        return cls(cuda=cuda, mcore_tilelang_kernels=kernels, apex_gradient_accumulation_fusion=gaf,
                   transformer_engine=HAVE_TE)


@dataclass(kw_only=True, slots=True)
class RuntimePolicy:
    """How to run the model: parallelism, precision, recompute, kernels. Never changes what the model is.

    ``mcore_dsa_kernels="auto"``, ``fusions=None`` and ``moe_grouped_gemm="auto"`` are decided by
    :func:`resolve_policy` for the machine: on CUDA megatron-core's fused TileLang DSA kernels (when importable and the
    model is bf16), megatron-core's torch fusions (bias-SwiGLU, bias-dropout-add; apex's gradient-accumulation fusion
    when installed) and, for bf16 without Transformer Engine, grouped-GEMM routed experts
    (:class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP`, same parameters and checkpoint layout as
    ``SequentialMLP``); on CPU the torch paths and ``SequentialMLP``. The choice is logged. With Transformer Engine
    ``"auto"`` keeps ``SequentialMLP`` (LoRA adapts it); ``"on"`` then selects megatron-core's ``TEGroupedMLP``."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool | None = None  # None: on when TP > 1 (AbsorbedMLA requires it)
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    params_dtype: torch.dtype = torch.bfloat16
    # megatron-core's own DSA kernels inside the ``megatron`` attention backend (its config's ``dsa_kernel_backend``),
    # not the ``tilelang`` attention backend: "auto" (its TileLang kernels on CUDA + bf16), "none", "tilelang", "cudnn"
    mcore_dsa_kernels: Literal["auto", "none", "tilelang", "cudnn"] = "auto"
    fusions: bool | None = None  # megatron-core fusions that need no TE/apex; None: on with CUDA
    # Indexer training (megatron_glm5.dsa.indexer_training): coeff 0 leaves the indexer as loaded (RL / LoRA);
    # the sparse stage trains it over the selected keys; the warm-up (dense stage) trains only the indexers, with the
    # dense loss and dense main attention (coeff 0 there means 1.0).
    dsa_indexer_loss_coeff: float = 0.0
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_warmup: bool = False
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    # megatron-core's: the MLP in this many sequence chunks; under full recompute our layers recompute all but the
    # last chunk again in the backward, so the MLP's share of the peak falls ~1/n (megatron_glm5.core.mlp_chunks)
    mlp_chunks_for_training: int = 1
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    moe_grouped_gemm: Literal["auto", "on", "off"] = "auto"  # megatron-core's; "auto": CUDA + bf16, no TE
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "none"
    moe_router_bias_update_rate: float = 0.0  # RL keeps the expert bias frozen
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    init_model_with_meta_device: bool = False
    deterministic_mode: bool = False
    # Per-layer saved-tensor offload to pinned host memory (megatron_glm5.offload), applied by our layers and
    # translated by offload.activation_offload_for; never megatron-core's fine_grained_activation_offloading, whose
    # manager needs CUDA streams and Transformer Engine and never reaches DSA attention.
    activation_offload: bool = False
    activation_offload_min_numel: int = 1 << 20  # smaller storages stay on the device (elements)
    activation_offload_shard_topk: bool = True  # TP ranks keep 1/TP of the (replicated) DSA top-k on the host

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RuntimePolicy.{name}: expected >= 1, got {getattr(self, name)}")
        if self.params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"RuntimePolicy.params_dtype: expected float32/bfloat16/float16, got {self.params_dtype}")
        if self.sequence_parallel is False and self.tensor_model_parallel_size > 1:
            raise ValueError(
                "RuntimePolicy.sequence_parallel=False with tensor_model_parallel_size > 1: megatron-core's "
                "AbsorbedMLA requires sequence parallelism under TP; leave it None or True"
            )
        if self.dsa_indexer_loss_coeff < 0:
            raise ValueError(f"RuntimePolicy.dsa_indexer_loss_coeff: expected >= 0, got {self.dsa_indexer_loss_coeff}")
        if self.dsa_indexer_warmup and self.dsa_indexer_use_sparse_loss:
            raise ValueError("RuntimePolicy: the indexer warm-up (dsa_indexer_warmup=True) trains with the dense loss; "
                             "dsa_indexer_use_sparse_loss=True is the sparse stage that follows it")
        if self.moe_grouped_gemm not in ("auto", "on", "off"):
            raise ValueError(
                f"RuntimePolicy.moe_grouped_gemm: expected 'auto', 'on' or 'off', got {self.moe_grouped_gemm!r}"
            )
        if self.mlp_chunks_for_training < 1:
            raise ValueError(
                f"RuntimePolicy.mlp_chunks_for_training: expected >= 1, got {self.mlp_chunks_for_training}")
        if self.activation_offload_min_numel < 0:
            raise ValueError(
                f"RuntimePolicy.activation_offload_min_numel: expected >= 0, got {self.activation_offload_min_numel}")


_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()  # each distinct resolution is logged once per process


def resolve_policy(policy: RuntimePolicy, env: RuntimeEnvironment | None = None) -> RuntimePolicy:
    """``policy`` with its ``"auto"`` choices made for ``env`` (detected when None) and logged."""
    if policy.mcore_dsa_kernels != "auto" and policy.fusions is not None and policy.moe_grouped_gemm != "auto":
        return policy
    env = env or RuntimeEnvironment.detect()
    backend = policy.mcore_dsa_kernels
    if backend == "auto":
        backend = "tilelang" if (env.mcore_tilelang_kernels and policy.params_dtype == torch.bfloat16) else "none"
    fusions = env.cuda if policy.fusions is None else policy.fusions
    grouped = policy.moe_grouped_gemm
    if grouped == "auto":  # TorchGroupedMLP: torch's grouped_mm runs bf16 on CUDA (elsewhere it would loop anyway);
        # deterministic_mode keeps SequentialMLP, whose bitwise run-to-run equality is what was verified on the GPU
        grouped = ("on" if env.cuda and policy.params_dtype == torch.bfloat16 and not env.transformer_engine
                   and not policy.deterministic_mode else "off")
    resolved = dataclasses.replace(policy, mcore_dsa_kernels=backend, fusions=fusions, moe_grouped_gemm=grouped)
    why = ("CUDA, megatron-core TileLang DSA kernels importable, bf16" if backend == "tilelang"
           else "no CUDA" if not env.cuda else "no megatron-core TileLang DSA kernels" if not env.mcore_tilelang_kernels
           else f"params_dtype {policy.params_dtype} (the fused kernels are bf16-only)")
    message = (f"megatron-glm5 runtime: mcore_dsa_kernels (megatron-core dsa_kernel_backend={backend!r}; {why}), torch "
               f"fusions "
               f"{'on' if fusions else 'off'}, apex gradient-accumulation fusion "
               f"{'on' if fusions and env.apex_gradient_accumulation_fusion else 'off'}, grouped-GEMM experts "
               f"{grouped}")
    if message not in _logged:
        _logged.add(message)
        _log.info(message)
    return resolved


def runtime_kwargs(policy: RuntimePolicy, env: RuntimeEnvironment | None = None) -> dict[str, Any]:
    """megatron-core kwargs for how the model runs (``"auto"`` choices resolved by :func:`resolve_policy`)."""
    env = env or RuntimeEnvironment.detect()
    policy = resolve_policy(policy, env)
    gaf = bool(policy.fusions) and env.apex_gradient_accumulation_fusion
    tp = policy.tensor_model_parallel_size
    kw: dict[str, Any] = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=policy.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=policy.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=policy.expert_model_parallel_size,
        expert_tensor_parallel_size=policy.expert_tensor_parallel_size,
        context_parallel_size=policy.context_parallel_size,
        sequence_parallel=tp > 1 if policy.sequence_parallel is None else policy.sequence_parallel,
        num_layers_in_first_pipeline_stage=policy.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=policy.num_layers_in_last_pipeline_stage,
        params_dtype=policy.params_dtype,
        pipeline_dtype=policy.params_dtype,  # dtype of tensors sent between pipeline stages
        bf16=policy.params_dtype == torch.bfloat16,
        fp16=policy.params_dtype == torch.float16,
        dsa_kernel_backend=policy.mcore_dsa_kernels,
        dsa_indexer_loss_coeff=policy.dsa_indexer_loss_coeff or (1.0 if policy.dsa_indexer_warmup else None),
        dsa_indexer_use_sparse_loss=policy.dsa_indexer_use_sparse_loss,
        recompute_granularity=policy.recompute_granularity,
        recompute_method=policy.recompute_method,
        recompute_num_layers=policy.recompute_num_layers,
        mlp_chunks_for_training=policy.mlp_chunks_for_training,
        moe_token_dispatcher_type=policy.moe_token_dispatcher_type,
        moe_grouped_gemm=policy.moe_grouped_gemm == "on",
        moe_aux_loss_coeff=policy.moe_aux_loss_coeff,
        moe_router_load_balancing_type=policy.moe_router_load_balancing_type,
        moe_router_bias_update_rate=policy.moe_router_bias_update_rate,
        use_cpu_initialization=policy.use_cpu_initialization,
        perform_initialization=policy.perform_initialization,
        init_model_with_meta_device=policy.init_model_with_meta_device,
        deterministic_mode=policy.deterministic_mode,
        cp_comm_type="allgather" if policy.context_parallel_size > 1 else "p2p",
        transformer_impl="transformer_engine" if env.transformer_engine else "local",
        # megatron-core's own (torch / jit) fusions with CUDA; apex's only when installed; never TE-only ones.
        gradient_accumulation_fusion=gaf,
        masked_softmax_fusion=False,  # DSA has no dense softmax
        bias_activation_fusion=bool(policy.fusions),
        bias_dropout_fusion=bool(policy.fusions),
        persist_layer_norm=False,  # apex; our norms are torch modules
    )
    if policy.recompute_modules is not None:
        kw["recompute_modules"] = list(policy.recompute_modules)
    return kw


_dataclass_init = RuntimePolicy.__init__


def _init_accepting_old_spelling(self, *args, dsa_kernel_backend: str | None = None, **kwargs) -> None:
    if dsa_kernel_backend is not None:
        warnings.warn("RuntimePolicy(dsa_kernel_backend=...) is deprecated: it is megatron-core's kernel choice inside "
                      "the 'megatron' attention backend, now spelled mcore_dsa_kernels (the 'tilelang' attention "
                      "backend is another thing)", DeprecationWarning, stacklevel=2)
        if kwargs.setdefault("mcore_dsa_kernels", dsa_kernel_backend) != dsa_kernel_backend:
            raise ValueError("RuntimePolicy: mcore_dsa_kernels and its deprecated spelling dsa_kernel_backend disagree")
    _dataclass_init(self, *args, **kwargs)


def _old_spelling(self) -> str:
    warnings.warn("RuntimePolicy.dsa_kernel_backend is deprecated: read mcore_dsa_kernels", DeprecationWarning,
                  stacklevel=2)
    return self.mcore_dsa_kernels


RuntimePolicy.__init__ = functools.wraps(_dataclass_init)(_init_accepting_old_spelling)
RuntimePolicy.dsa_kernel_backend = property(_old_spelling)


def merge_kwargs(architecture: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """A family's architecture kwargs and the policy's runtime kwargs as one megatron-core config (disjoint keys)."""
    overlap = set(architecture) & set(runtime)
    assert not overlap, f"architecture and runtime kwargs overlap: {sorted(overlap)}"
    return {**architecture, **runtime}
