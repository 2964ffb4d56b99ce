"""megatron-core's mixed-precision optimizer step with the 16-bit model parameters written by the Adam kernel itself.

Why: ``Float16OptimizerWithFloat16Params.step_with_ready_grads`` steps torch's fused AdamW on the fp32 main
parameters, then ``_copy_main_params_to_model_params`` copies each main parameter into its bf16 model parameter
(without apex: one ``copy_`` per tensor). That copy reads every main parameter again right after Adam wrote it: 3.6 ms
and 161 launches per step of the one-GPU GLM-5 slice (issue 23, round 9's profile). :func:`step_with_model_copies`
runs :func:`megatron_glm5.kernels.fused_adamw.adamw_step` instead, one launch per parameter group, which writes the
model copy from the value it just computed: the same numbers as torch's fused AdamW and ``copy_`` (the kernel's
contract; ``tests/gpu/test_fused_adamw_gpu.py`` compares them bit for bit), without the second read.

Taken for a step only where that is what megatron-core would have run (:func:`plan`, else megatron-core's own
``step_with_ready_grads`` runs): the inner optimizer is torch's ``AdamW`` (or ``Adam`` with decoupled weight decay)
in its fused mode (:func:`megatron_glm5.optim_fusions.use_fused_adam`), without AMSGrad, ``maximize``,
``capturable``, ``differentiable`` or a grad scaler's ``grad_scale`` / ``found_inf``, with Python-float
hyper-parameters, on CUDA (not ROCm) with torch >= 2.8; every parameter with a gradient already has its state (the
first step is torch's, which creates it); the kernel takes every group's tensors; not a stub optimizer, not the MXFP8
parameter-buffer path, not under CUDA graph capture. And the kernel must have matched torch's ``_fused_adamw_`` bit
for bit on probe tensors for the group's betas, eps and weight decay on this device
(:func:`~megatron_glm5.kernels.fused_adamw.matches_torch`, once per configuration and process: one host sync;
a mismatch is logged and the route steps aside). torch's optimizer step hooks run around the step as around
``step()`` (``Optimizer.profile_hook_step``: the global pre-hook of :mod:`megatron_glm5.deferred_grad_checks` decides
its checks there), and the plan is made again inside them, since a pre-hook may change the learning rate or the
gradients; refused there, torch's own ``step`` runs (without its hooks a second time) and every pair is copied.
Model parameters whose main parameter had no gradient are copied as megatron-core copies them. megatron-core's two
timers keep their names. A wrapper set on the instance's ``step`` (torch's ``LRScheduler`` puts one there) is not
called: megatron-core's own scheduler sets ``lr`` in the groups.

Not covered: megatron-core's ``DistributedOptimizer`` (it copies into its parameter buffer; a second route), apex's /
TE's ``FusedAdam`` (their own kernels). Switch: ``MEGATRON_GLM5_ADAM_MODEL_COPY`` (on; :mod:`megatron_glm5.fusions`),
routed by :func:`megatron_glm5.compat.route_adam_model_copy`. Tests: ``tests/test_adam_model_copy.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_glm5.kernels import fused_adamw
from megatron_glm5.kernels._common import triton_runs_on


@dataclass
class GroupStep:
    """One parameter group's tensors for :func:`~megatron_glm5.kernels.fused_adamw.adamw_step`."""

    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list
    steps: list
    models: list
    hyper: fused_adamw.AdamWHyper


@dataclass
class Plan:
    groups: list[GroupStep]
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (model, main) pairs whose main parameter is not stepped


def _adamw(inner: Any) -> bool:
    if type(inner) is torch.optim.AdamW:
        return True
    return type(inner) is torch.optim.Adam and all(g.get("decoupled_weight_decay") for g in inner.param_groups)


def _plain_group(group: dict) -> bool:
    if not group.get("fused") or group.get("amsgrad") or group.get("maximize") or group.get("capturable"):
        return False
    if group.get("differentiable"):
        return False
    scalars = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    return all(isinstance(s, (float, int)) and not isinstance(s, bool) for s in scalars)


_VERIFIED: dict[tuple, bool] = {}  # (device, fp32 betas and eps, weight decay != 0, model dtype) -> matched torch
_log = logging.getLogger("megatron_glm5")


def _verified(step: GroupStep) -> bool:
    """Whether the kernel matched torch's fused AdamW bit for bit on probe tensors for this group's configuration
    (:func:`~megatron_glm5.kernels.fused_adamw.matches_torch`, once per configuration and process, on CUDA: one host
    sync the first time). A mismatch (another torch, another GPU) is logged once and the route steps aside for it."""
    device = step.params[0].device
    if device.type != "cuda":
        return True  # Triton's interpreter (the CPU tests): torch's fused kernel is not the one reproduced there
    h = step.hyper.fp32()
    model_dtype = next((m.dtype for m in step.models if m is not None), torch.bfloat16)
    key = (str(device), h["beta1"], h["beta2"], h["eps"], h["wd"] != 0.0, model_dtype)
    if key not in _VERIFIED:
        _VERIFIED[key] = fused_adamw.matches_torch(device, step.hyper, model_dtype)
        if not _VERIFIED[key]:
            _log.warning("megatron-glm5: the AdamW kernel that writes the model copies does not match torch %s's "
                         "fused AdamW bit for bit here (betas %s, %s, eps %s); megatron-core's step runs instead",
                         torch.__version__, h["beta1"], h["beta2"], h["eps"])
    return _VERIFIED[key]


def eligible(optimizer: Any) -> bool:
    """The optimizer-wide half of :func:`plan` (no walk over the parameters): what decides, before torch's step hooks,
    whether to enter them with the kernel's step."""
    inner = getattr(optimizer, "optimizer", None)
    if getattr(optimizer, "is_stub_optimizer", False) or not isinstance(inner, torch.optim.Optimizer):
        return False
    if getattr(optimizer.config, "reuse_grad_buf_for_mxfp8_param_ag", False) or not _adamw(inner):
        return False
    from megatron_glm5.compat import fused_adamw_arithmetic_known

    if not fused_adamw_arithmetic_known():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    if getattr(inner, "grad_scale", None) is not None or getattr(inner, "found_inf", None) is not None:
        return False  # set by torch's GradScaler: torch's kernel unscales and skips; this one does not
    first = next((p for g in inner.param_groups for p in g["params"]), None)
    if first is None or not triton_runs_on(first):
        return False
    return all(_plain_group(group) for group in inner.param_groups)


def plan(optimizer: Any) -> Plan | None:
    """What :func:`step_with_model_copies` would run for this megatron-core optimizer's step, or None where
    megatron-core's own step must run (module docstring)."""
    if not eligible(optimizer):
        return None
    inner = optimizer.optimizer
    model_of = {id(main): model for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
                for model, main in zip(models, mains)}
    stepped: set[int] = set()
    groups = []
    for group in inner.param_groups:
        step = GroupStep([], [], [], [], [], [], fused_adamw.AdamWHyper(
            lr=float(group["lr"]), beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"])))
        for p in group["params"]:
            if p.grad is None:
                continue
            state = inner.state.get(p)
            if not state or not {"step", "exp_avg", "exp_avg_sq"} <= state.keys():
                return None  # torch's step creates the state
            model = model_of.get(id(p))
            step.params.append(p)
            step.grads.append(p.grad)
            step.exp_avgs.append(state["exp_avg"])
            step.exp_avg_sqs.append(state["exp_avg_sq"])
            step.steps.append(state["step"])
            step.models.append(None if model is None else model.data)
            stepped.add(id(p))
        if step.params and not fused_adamw.adamw_step_supported(step.params, step.grads, step.exp_avgs,
                                                                step.exp_avg_sqs, step.steps, step.models):
            return None
        if step.params and not _verified(step):
            return None
        groups.append(step)
    copies = [(model, main) for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
              for model, main in zip(models, mains) if id(main) not in stepped]
    return Plan(groups, copies)


def step_with_model_copies(original: Callable[[Any], bool], optimizer: Any) -> bool:
    """megatron-core's ``step_with_ready_grads`` (``original``) with the model copies written by the Adam kernel where
    :func:`plan` allows, else ``original``. The plan is made again inside torch's step hooks (a pre-hook may change
    the learning rate or the gradients); where it is refused there, torch's own step runs and every model parameter
    is copied, as megatron-core does."""
    if not eligible(optimizer):
        return original(optimizer)
    timers = optimizer.config.timers
    if timers is not None:
        timers("optimizer-inner-step", log_level=1).start(barrier=optimizer.config.barrier_with_L1_time)
    from megatron_glm5.compat import run_optimizer_step, unhooked_step

    taken: list[Plan] = []

    def step(inner: torch.optim.Optimizer) -> None:  # what torch's step hooks wrap
        chosen = plan(optimizer)
        if chosen is None:
            unhooked_step(inner)
            return
        taken.append(chosen)
        for g in chosen.groups:
            if g.params:
                fused_adamw.adamw_step(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.steps, g.models, g.hyper,
                                       checked=True)

    with torch.no_grad():
        run_optimizer_step(optimizer.optimizer, step)
    if timers is not None:
        timers("optimizer-inner-step").stop()
        timers("optimizer-copy-main-to-model-params", log_level=1).start(barrier=optimizer.config.barrier_with_L1_time)
    copies = taken[0].copies if taken else [
        pair for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
        for pair in zip(models, mains)]
    with torch.no_grad():
        for model, main in copies:
            model.data.copy_(main.data)
    if timers is not None:
        timers("optimizer-copy-main-to-model-params").stop()
    return True


__all__ = ["GroupStep", "Plan", "eligible", "plan", "step_with_model_copies"]
