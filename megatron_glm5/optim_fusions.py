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

Both reach megatron-core through :mod:`megatron_glm5.compat` (``route_wgrad_accumulation``, ``route_fused_adam``); the
switches are in :mod:`megatron_glm5.fusions`. CPU oracle: ``tests/test_optim_fusions.py``; GPU:
``tests/gpu/test_optim_fusions_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

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
