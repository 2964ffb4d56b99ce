"""Module providers for the GLM-5.x block spec: Transformer Engine when installed, else a local (torch) one.

megatron-core's ``LocalSpecProvider`` cannot build its own DSA spec (no ``linear()`` for the indexer's duplicated
projections, and ``WrappedTorchNorm`` refuses sequence parallelism, which AbsorbedMLA requires under TP). The local
provider here fills those gaps from public constructors, without patching megatron-core:

* ``linear()`` -> megatron-core's modelopt ``Linear`` (a ``torch.nn.Linear`` accepting ``parallel_mode="duplicated"``).
* ``down_projection()`` -> the same duplicated linear (replicated over TP, like TE's duplicated ``TELinear``). Without
  TE megatron-core's AbsorbedMLA only accepts ``ColumnParallelLinear`` there, whose TP + SP path gets the
  ``kv_down`` gradient wrong; :class:`~megatron_glm5.dsa.attention.GLMAbsorbedMLASelfAttention` explains and builds
  it.
* ``layer_norm()`` -> :class:`TorchNorm`: RMSNorm/LayerNorm computed in fp32 (HF's order: normalise in fp32, cast,
  scale), whose parameters are tagged ``sequence_parallel`` so ``finalize_model_grads`` sums their gradients over TP
  when their input is sequence-sharded (as ``TENorm`` does). On CUDA bf16 / fp16 tensors its RMSNorm runs as one
  Triton kernel forward and one backward (:mod:`megatron_glm5.kernels.rms_norm`, same numerics; 3 % of the GLM-5
  slice's step); ``MEGATRON_GLM5_FUSED_RMSNORM=0`` keeps the torch path (:mod:`megatron_glm5.fusions`).
* ``replicated_norm()`` -> the same norm without that tag, for the indexer ``k_norm``, which runs on the all-gathered
  sequence on every TP rank.
* ``grouped_mlp_modules(True)`` (``moe_grouped_gemm``) -> :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP`
  over the same per-expert linears ``SequentialMLP`` gets (``grouped_mlp_modules(False)``, unchanged), where
  megatron-core's local provider silently ignores the flag. With Transformer Engine the TE provider keeps
  megatron-core's ``TEGroupedMLP`` (TE's grouped GEMM, fp8; parameters ``linear_fc1.weight{e}``, dist-checkpoint keys
  as ``SequentialMLP``'s). The choice is logged once.

Neither provider fuses a norm into the next linear, so parameter names are identical with and without TE.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from .compat import modelopt_linear
from .fusions import FUSED_RMSNORM_ENV, enabled
from .kernels.rms_norm import rms_norm, rms_norm_reference, rms_norm_supported

_ModeloptLinear = modelopt_linear()


class DuplicatedLinear(_ModeloptLinear):
    """megatron-core's modelopt ``Linear`` (a ``torch.nn.Linear`` taking ``parallel_mode="duplicated"``) whose
    checkpoint entries mark the TP ranks as replicas of one tensor. The parent leaves the TP group unset, so every
    TP rank claims to be the main replica and ``dist_checkpointing.save`` rejects the access pattern at TP > 1."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state as ps

        dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            sharded_offsets=sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=dp_cp,
        )


class TorchNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (per ``config.normalization``) computed in fp32, output in the input dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool | None = None, **_):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"TorchNorm supports RMSNorm and LayerNorm, got normalization={config.normalization!r}")
        self.eps = eps
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
        for p in self.parameters():
            p.sequence_parallel = sp
        # the fused Triton RMSNorm where it runs (megatron_glm5.fusions): same numerics up to rare one-ulp flips
        self.fused = enabled(FUSED_RMSNORM_ENV)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            if self.fused and rms_norm_supported(x, self.weight):
                return rms_norm(x, self.weight, self.eps)
            return rms_norm_reference(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = F.layer_norm(h, h.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return h.to(dtype)

    def extra_repr(self) -> str:
        return f"{'RMSNorm' if self.rms else 'LayerNorm'}({self.weight.numel()}, eps={self.eps})"


class ReplicatedTorchNorm(TorchNorm):
    """A :class:`TorchNorm` over a full (TP-replicated) sequence: gradients are not summed over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kw):
        super().__init__(config, hidden_size, eps, sequence_parallel=False)


_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()


def grouped_experts(sequential: partial, moe_use_grouped_gemm: bool) -> partial:
    """The routed-experts builder: ``sequential`` (a provider's ``SequentialMLP`` partial) as is, or
    ``TorchGroupedMLP`` over the same submodules (same parameters and checkpoint layout) for ``moe_grouped_gemm``."""
    from .moe.grouped_experts import TorchGroupedMLP

    if sequential.func is not SequentialMLP:
        raise TypeError(f"expected megatron-core's SequentialMLP experts builder, got {sequential.func!r}")
    chosen = partial(TorchGroupedMLP, *sequential.args, **sequential.keywords) if moe_use_grouped_gemm else sequential
    message = f"megatron-glm5 MoE experts: {chosen.func.__name__} (moe_grouped_gemm={bool(moe_use_grouped_gemm)})"
    if message not in _logged:
        _logged.add(message)
        _log.info(message)
    return chosen


class GLMLocalSpecProvider(LocalSpecProvider):
    """megatron-core's local provider plus what the GLM-5.x DSA spec needs (see module docstring)."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        return grouped_experts(super().grouped_mlp_modules(False), moe_use_grouped_gemm)

    def linear(self) -> type:
        return DuplicatedLinear

    def down_projection(self) -> type:
        return DuplicatedLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return TorchNorm

    def replicated_norm(self):
        return ReplicatedTorchNorm


if HAVE_TE:
    from megatron.core.extensions.transformer_engine import TELinear, TENorm
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    class GLMTESpecProvider(TESpecProvider):
        """Transformer Engine modules, with norms kept separate from the linears (stable parameter names)."""

        def fuse_layernorm_and_linear(self) -> bool:
            return False

        def down_projection(self) -> type:
            return TELinear

        def replicated_norm(self):
            return TENorm

else:  # pragma: no cover - exercised only where TE is installed
    GLMTESpecProvider = None  # type: ignore[assignment,misc]


def default_provider():
    """TE modules when Transformer Engine is importable, else the local provider."""
    return GLMTESpecProvider() if GLMTESpecProvider is not None else GLMLocalSpecProvider()
