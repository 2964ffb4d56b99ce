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
``capturable`` or ``differentiable``, with Python-float hyper-parameters; every parameter with a gradient already
has its state (the first step is torch's, which creates it); the kernel takes every group's tensors; not a stub
optimizer, not the MXFP8 parameter-buffer path, not under CUDA graph capture. torch's optimizer step hooks run around
it as around ``step()`` (``Optimizer.profile_hook_step``: the global pre-hook of
:mod:`megatron_glm5.deferred_grad_checks` decides its checks there). Model parameters whose main parameter had no
gradient are copied as megatron-core copies them. megatron-core's two timers keep their names.

Not covered: megatron-core's ``DistributedOptimizer`` (it copies into its parameter buffer; a second route), apex's /
TE's ``FusedAdam`` (their own kernels). Switch: ``MEGATRON_GLM5_ADAM_MODEL_COPY`` (:mod:`megatron_glm5.fusions`),
routed by :func:`megatron_glm5.compat.route_adam_model_copy`. Tests: ``tests/test_adam_model_copy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_glm5.kernels import fused_adamw


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


def plan(optimizer: Any) -> Plan | None:
    """What :func:`step_with_model_copies` would run for this megatron-core optimizer's step, or None where
    megatron-core's own step must run (module docstring)."""
    inner = getattr(optimizer, "optimizer", None)
    if getattr(optimizer, "is_stub_optimizer", False) or not isinstance(inner, torch.optim.Optimizer):
        return None
    if getattr(optimizer.config, "reuse_grad_buf_for_mxfp8_param_ag", False) or not _adamw(inner):
        return None
    from megatron_glm5.compat import fused_adamw_arithmetic_known

    if not fused_adamw_arithmetic_known():
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    model_of = {id(main): model for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
                for model, main in zip(models, mains)}
    stepped: set[int] = set()
    groups = []
    for group in inner.param_groups:
        if not _plain_group(group):
            return None
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
        groups.append(step)
    copies = [(model, main) for models, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
              for model, main in zip(models, mains) if id(main) not in stepped]
    return Plan(groups, copies)


def _run(plan_: Plan) -> Callable[[torch.optim.Optimizer], None]:
    def step(inner: torch.optim.Optimizer) -> None:  # what torch's step hooks wrap
        for g in plan_.groups:
            if g.params:
                fused_adamw.adamw_step(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.steps, g.models, g.hyper,
                                       checked=True)

    return step


def step_with_model_copies(original: Callable[[Any], bool], optimizer: Any) -> bool:
    """megatron-core's ``step_with_ready_grads`` (``original``) with the model copies written by the Adam kernel where
    :func:`plan` allows, else ``original``."""
    chosen = plan(optimizer)
    if chosen is None:
        return original(optimizer)
    timers = optimizer.config.timers
    if timers is not None:
        timers("optimizer-inner-step", log_level=1).start(barrier=optimizer.config.barrier_with_L1_time)
    from megatron_glm5.compat import run_optimizer_step

    with torch.no_grad():
        run_optimizer_step(optimizer.optimizer, _run(chosen))
    if timers is not None:
        timers("optimizer-inner-step").stop()
        timers("optimizer-copy-main-to-model-params", log_level=1).start(barrier=optimizer.config.barrier_with_L1_time)
    with torch.no_grad():
        for model, main in chosen.copies:
            model.data.copy_(main.data)
    if timers is not None:
        timers("optimizer-copy-main-to-model-params").stop()
    return True


__all__ = ["GroupStep", "Plan", "plan", "step_with_model_copies"]
