"""Weight-gradient accumulation and the Adam step, fused without apex or Transformer Engine.

megatron-core's fast paths for both need CUDA extensions we cannot require: apex's ``fused_weight_gradient_mlp_cuda``
(``gradient_accumulation_fusion``: the weight-gradient GEMM adds its fp32 result straight into ``main_grad``) and TE's
or apex's ``FusedAdam``. Without them a GLM-5 step writes every weight gradient in bf16 and adds it to ``main_grad`` in
a second kernel (292 adds, 18.8 ms per step of the one-GPU slice), and runs torch's foreach Adam (about ten
multi-tensor passes over the fp32 state). torch has both pieces itself:

* :data:`WGRAD_ACCUMULATION`: apex's two functions (same contract: ``d_weight += d_output^T @ input``, both operands
  2-D) as one cuBLAS GEMM whose epilogue adds into ``main_grad`` (``torch.addmm`` with ``out_dtype=float32``, the
  product accumulated and added in fp32 with no bf16 rounding in between, as apex's kernel does). Elsewhere (CPU, old
  torch) the same sum in fp32 torch ops.
* :func:`use_fused_adam`: torch's ``Adam``/``AdamW`` with ``fused=True`` (one kernel per dtype group instead of the
  foreach passes; same update rule), kept on across ``load_state_dict``.
* :func:`grad_norm_on_device`: megatron-core's gradient norm without its host read, for the device clip
  (:mod:`megatron_glm5.kernels.grad_clip` scales the gradients only when the norm is above the clip). The route also
  changes megatron-core's layer-wise optimizer (``LayerWiseDistributedOptimizer``), though not through this function:
  its ``get_grad_norm`` calls megatron-core's own ``get_grad_norm_fp32``, bound by name in ``layer_wise_optimizer.py``
  and not patched, which on seeing the route's ``multi_tensor_scale_tensor_impl`` returns its tensor branch (an fp32
  square root on the device, not the host path's double root); the inherited ``ChainedOptimizer.step`` then clips
  through the route's scale. Only that wiring is tested (``tests/test_optimizer_phase.py``), not its numbers.

They reach megatron-core through :mod:`megatron_glm5.compat` (``route_wgrad_accumulation``, ``route_fused_adam``,
``route_device_grad_clip``); the switches are in :mod:`megatron_glm5.fusions`. CPU oracles:
``tests/test_optim_fusions.py``, ``tests/test_optimizer_phase.py``; GPU: ``tests/gpu/test_optim_fusions_gpu.py``,
``tests/gpu/test_optimizer_phase_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch


def _check(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
    if input.dim() != 2 or d_output.dim() != 2 or input.shape[0] != d_output.shape[0] or tuple(d_weight.shape) != (
            d_output.shape[1], input.shape[1]):
        raise ValueError(f"weight-gradient accumulation: input {tuple(input.shape)}, d_output "
                         f"{tuple(d_output.shape)} and main_grad {tuple(d_weight.shape)} do not fit "
                         "(expected [tokens, in], [tokens, out], [out, in])")


def _cublas_out_dtype(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def wgrad_gemm_accum_fp32(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
    """``d_weight += d_output^T @ input`` in place, ``d_weight`` fp32 and the operands bf16 / fp16 (apex's
    ``wgrad_gemm_accum_fp32``): the fp32 GEMM result added in cuBLAS's epilogue, never rounded to the operands'
    dtype."""
    _check(input, d_output, d_weight)
    if _cublas_out_dtype(input) and d_output.dtype == input.dtype:
        torch.addmm(d_weight, d_output.t(), input, out_dtype=torch.float32, out=d_weight)
    else:
        d_weight.add_(d_output.t().float() @ input.float())


def wgrad_gemm_accum_fp16(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
    """``d_weight += d_output^T @ input`` in place with ``d_weight`` in the operands' 16-bit dtype (apex's
    ``wgrad_gemm_accum_fp16``; megatron-core calls it for bf16 / fp16 ``main_grad``)."""
    _check(input, d_output, d_weight)
    torch.addmm(d_weight, d_output.t(), input.to(d_output.dtype), out=d_weight)


WGRAD_ACCUMULATION = SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32,
                                     wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)
"""Stands where megatron-core's linear layers look for apex's ``fused_weight_gradient_mlp_cuda`` (the two functions
it calls)."""

_FUSED_ADAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a torch ``Adam`` / ``AdamW`` (exactly those classes) whose parameters are all CUDA floating tensors to
    ``fused=True`` (``foreach`` off), now and after every ``load_state_dict`` (a checkpoint's param groups carry the
    ``fused`` they were saved with). Anything else is left alone. Returns whether the optimizer is now fused."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or not all(p.is_cuda and p.dtype in _FUSED_ADAM_DTYPES for p in params):
        return False
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return False
    _set_fused(optimizer)
    if not getattr(optimizer, "_megatron_glm5_fused_adam", False):
        optimizer.register_load_state_dict_post_hook(_set_fused)
        optimizer._megatron_glm5_fused_adam = True
    return True


def _set_fused(optimizer: torch.optim.Optimizer) -> None:
    """``fused=True`` on every group; a loaded ``step`` (kept on the host by the unfused path) moves to the device as
    the fused kernel needs it."""
    optimizer.defaults.update(fused=True, foreach=False)
    optimizer._step_supports_amp_scaling = True
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state and state["step"].device != p.device:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def grad_norm_on_device(original: Callable, grads_for_norm, norm_type: float = 2,
                        grad_stats_parallel_group=None):
    """megatron-core's ``get_grad_norm_fp32`` (``original``) with the 2-norm left on the device: no ``.item()``, so
    the host goes on to queue the clip and the optimizer step while the GPU computes the norm.

    The same fp32 squared norm as megatron-core's (its multi-tensor L2 norm squared, summed over the data-parallel
    group of DTensor gradients and over ``grad_stats_parallel_group``), and its square root taken in double, as
    megatron-core without apex / TE does on the host (``total.item() ** 0.5``: C's ``pow``, within one ulp of this
    correctly rounded root; the same clip coefficient and fp32 norm, ``tests/test_optimizer_phase.py``, which compares
    the coefficient and the clipped gradients at ``max_norm=1.0`` only). Returned as
    a one-element fp64 tensor on the gradients' device, the shape of megatron-core's own tensor branch (taken with
    TE: an fp32 square root). Megatron-LM's ``train_step`` reduces it to a Python float for the log, after the step
    is queued. Other norm types go to ``original``."""
    if float(norm_type) != 2.0:
        return original(grads_for_norm, norm_type, grad_stats_parallel_group)
    from megatron.core.optimizer import clip_grads

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    data_parallel_group = None
    for grad in grads_for_norm:
        data_parallel_group = clip_grads.get_data_parallel_group_if_dtensor(grad, data_parallel_group)
    grads_for_norm = [clip_grads.to_local_if_dtensor(grad) for grad in grads_for_norm]
    device = grads_for_norm[0].device if grads_for_norm else "cuda"  # megatron-core: "cuda", the gradients' device
    total = torch.zeros(1, dtype=torch.float, device=device)
    if grads_for_norm:
        overflow = torch.zeros(1, dtype=torch.int, device=device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads_for_norm], False)
        total = norm ** float(norm_type)
    if data_parallel_group:
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=data_parallel_group)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return total.double().sqrt()
