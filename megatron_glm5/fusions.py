"""Which fused kernels replace torch / megatron-core elementwise code in the model, and their switches, in one place.

Both are on by default where Triton runs (CUDA); each falls back to the torch path it replaces on any input it does
not take (CPU tensors, other dtypes, megatron-core's bias / FP8-store / CPU-offload variants), so turning one on never
changes what runs on the CPU. Each switch is read when a module is built (``"0"`` turns it off):

* ``MEGATRON_GLM5_FUSED_RMSNORM`` - :class:`megatron_glm5.providers.TorchNorm`'s RMSNorm as one Triton kernel each way
  (:mod:`megatron_glm5.kernels.rms_norm`; same numerics up to rare one-ulp flips).
* ``MEGATRON_GLM5_FUSED_SWIGLU`` - megatron-core ``MLP``'s fused SwiGLU (dense MLP, shared and routed experts, the
  routing-probability-weighted form) and :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP`'s, as one Triton
  kernel each way (:mod:`megatron_glm5.kernels.swiglu`): the numerics of megatron-core's compiled ``jit_fuser`` path,
  without needing ``torch.compile``. Routed into megatron-core through :func:`megatron_glm5.compat.route_mlp_swiglu`.

Measured on the GLM-5 slice (issue 23, ``scripts/bench/RESULTS_step.md``).
"""

from __future__ import annotations

import os

import torch

from megatron_glm5 import compat
from megatron_glm5.kernels.swiglu import swiglu, swiglu_supported, weighted_swiglu

FUSED_RMSNORM_ENV = "MEGATRON_GLM5_FUSED_RMSNORM"
FUSED_SWIGLU_ENV = "MEGATRON_GLM5_FUSED_SWIGLU"


def enabled(env: str) -> bool:
    """A fusion's switch: on unless the variable is ``"0"``."""
    value = os.environ.get(env, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{env}={value!r}: expected 0 (torch path) or 1 (fused kernel, the default)")
    return value == "1"


def _rows(input: torch.Tensor) -> torch.Tensor | None:
    if input.dim() not in (2, 3):
        return None
    return input.reshape(-1, input.shape[-1])


def bias_swiglu_impl(input: torch.Tensor, bias, fp8_input_store: bool = False, cpu_offload_input: bool = False):
    """megatron-core's ``bias_swiglu_impl`` (same signature and result): the fused kernel where it applies."""
    if bias is None and not fp8_input_store and not cpu_offload_input:
        y = _rows(input)
        if y is not None and swiglu_supported(y):
            out = swiglu(y)
            return out if input.dim() == 2 else out.view(input.shape[0], input.shape[1], -1)
    from megatron.core.fusions import fused_bias_swiglu

    return fused_bias_swiglu.bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)


def weighted_bias_swiglu_impl(input: torch.Tensor, bias, weights: torch.Tensor, fp8_input_store: bool = False):
    """megatron-core's ``weighted_bias_swiglu_impl`` (``weights [rows, 1]``, the routing probabilities): the fused
    kernel where it applies."""
    if bias is None and not fp8_input_store:
        y = _rows(input)
        w = weights.reshape(-1, 1) if weights.numel() == (y.shape[0] if y is not None else -1) else None
        if y is not None and w is not None and swiglu_supported(y, w):
            out = weighted_swiglu(y, w)
            return out if input.dim() == 2 else out.view(input.shape[0], input.shape[1], -1)
    from megatron.core.fusions import fused_bias_swiglu

    return fused_bias_swiglu.weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store)


def install_fused_swiglu() -> bool:
    """Route megatron-core ``MLP``'s SwiGLU through :func:`bias_swiglu_impl` / :func:`weighted_bias_swiglu_impl`
    unless ``MEGATRON_GLM5_FUSED_SWIGLU=0`` (called when a GLM block spec is built); returns whether it is routed."""
    if enabled(FUSED_SWIGLU_ENV):
        compat.route_mlp_swiglu(bias_swiglu_impl, weighted_bias_swiglu_impl)
    return compat.mlp_swiglu_routed()
