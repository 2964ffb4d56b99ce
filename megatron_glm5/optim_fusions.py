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
* :func:`clip_in_fused_adam`: megatron-core's gradient clip handed to that fused Adam as its ``grad_scale`` (the
  kernel divides each gradient by it as it reads it), so the norm never goes to the host before the step and no
  separate pass scales the gradients.

Both reach megatron-core through :mod:`megatron_glm5.compat` (``route_wgrad_accumulation``, ``route_fused_adam``); the
switches are in :mod:`megatron_glm5.fusions`. CPU oracle: ``tests/test_optim_fusions.py``; GPU:
``tests/gpu/test_optim_fusions_gpu.py``.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, Callable

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


def use_fused_adam_taking_the_clip(optimizer: torch.optim.Optimizer) -> bool:
    """:func:`use_fused_adam`, and where it fuses, :func:`take_clip` (the experimental device clip's route)."""
    fused = use_fused_adam(optimizer)
    if fused:
        take_clip(optimizer)
    return fused


_CLIP_TAKERS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_SCALES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.Tensor]" = weakref.WeakKeyDictionary()


def take_clip(optimizer: torch.optim.Optimizer) -> None:
    """Let :func:`clip_in_fused_adam` hand ``optimizer`` (a fused torch ``Adam`` / ``AdamW``) the clip of its
    parameters' gradients. The scale is set for one step: a step post-hook removes it (only a scale set here: torch's
    ``GradScaler`` sets and deletes its own)."""
    if optimizer not in _CLIP_TAKERS:
        optimizer.register_step_post_hook(_drop_grad_scale)
        _CLIP_TAKERS.add(optimizer)


def _drop_grad_scale(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    ours = _SCALES.pop(optimizer, None)
    if ours is not None and optimizer.__dict__.get("grad_scale") is ours:
        del optimizer.__dict__["grad_scale"]


def _params(optimizer: torch.optim.Optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _fused_owner(parameters: list) -> torch.optim.Optimizer | None:
    """The registered fused Adam whose parameters are exactly ``parameters``, in order (what megatron-core clips when
    no parameter has a separate gradient-norm group)."""
    for optimizer in list(_CLIP_TAKERS):
        params = _params(optimizer)
        if (len(params) == len(parameters) and all(a is b for a, b in zip(params, parameters))
                and all(g.get("fused") for g in optimizer.param_groups)):
            return optimizer
    return None


def clip_in_fused_adam(original: Callable, parameters: list, max_norm: float, total_norm: Any,
                       use_decoupled_grad: bool = False) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` (``original``) for ``parameters`` of one fused torch Adam,
    given the norm as a device tensor: sets the Adam's ``grad_scale`` to ``max(1, (total_norm + 1e-6) / max_norm)``
    and scales nothing here. The fused kernel divides each gradient by it as it reads it.

    Compared with megatron-core without apex / TE (the norm's square root taken in double on the host, the gradients
    multiplied by ``max_norm / (norm + 1e-6)`` when that is below 1):

    * Below the clip the gradients and the step are bit for bit the same (the kernel divides by exactly 1), except
      within about one fp32 ulp of the clip, where the two roundings can disagree on whether to clip.
    * A clipped gradient differs by a few fp32 ulps (up to 3 measured: an fp32 square root and a quotient instead
      of megatron-core's double square root and product).

    A NaN norm scales nothing, as in megatron-core. Anything else goes to ``original`` with the norm as a Python
    number, as megatron-core does without apex / TE (and any scale still pending from a step that was skipped is
    dropped): decoupled gradients, a subset of an optimizer's parameters (a separate gradient-norm group), an
    optimizer not registered by :func:`take_clip`."""
    owner = None
    if isinstance(total_norm, torch.Tensor) and not use_decoupled_grad and parameters:
        owner = _fused_owner(list(parameters))
    if owner is None:
        first = parameters[0] if len(parameters) else None
        for optimizer in list(_SCALES.keys()):
            if any(p is first for p in _params(optimizer)):
                _drop_grad_scale(optimizer)
        if isinstance(total_norm, torch.Tensor):
            total_norm = float(total_norm)
        return original(parameters, max_norm, total_norm, use_decoupled_grad)
    scale = (total_norm.detach().float().reshape(1) + 1.0e-6) / max_norm
    owner.grad_scale = _SCALES[owner] = torch.nan_to_num(scale, nan=1.0, posinf=float("inf")).clamp_min_(1.0)
    return None
