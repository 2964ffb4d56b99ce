"""megatron-core's mixed-precision step with the model copies written by the AdamW kernel
(``megatron_glm5/adam_model_copy.py``) on the CPU: which steps it takes (:func:`plan`), that torch's step hooks run
around it, that the model parameters are the main parameters rounded, that a main parameter without a gradient is
still copied, and the route's install. The kernel runs in Triton's interpreter; megatron-core's own
``Float16OptimizerWithFloat16Params`` (CUDA-typed) is exercised in ``tests/gpu/test_fused_adamw_gpu.py``, its
internals by the compat probe."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import adam_model_copy, compat
from tests.triton_checks import passed, run_in_interpreter

# A stand-in for megatron-core's Float16OptimizerWithFloat16Params: the attributes the route reads (the GPU test uses
# the real class).
HELPERS = r"""
import types
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from megatron_glm5 import adam_model_copy

def megatron_like(sizes=(300, 5000, 7), fused=True, seed=0, **adam):
    g = torch.Generator().manual_seed(seed)
    models = [torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).bfloat16()) for n in sizes]
    mains = [torch.nn.Parameter(m.detach().float()) for m in models]
    inner = torch.optim.AdamW([{"params": mains[:2], "weight_decay": 0.1}, {"params": mains[2:], "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=fused, **adam)
    opt = types.SimpleNamespace(optimizer=inner, is_stub_optimizer=False, float16_groups=[models[:2], models[2:]],
                                fp32_from_float16_groups=[mains[:2], mains[2:]],
                                config=types.SimpleNamespace(timers=None, barrier_with_L1_time=False,
                                                             reuse_grad_buf_for_mxfp8_param_ag=False))
    return opt, models, mains

def original(opt):  # megatron-core's step_with_ready_grads, reduced to what it does here
    opt.optimizer.step()
    for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for model, main in zip(models, mains):
            model.data.copy_(main.data)
    return True

def grads(mains, step, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(mains):
        p.grad = None if i in skip else torch.randn(p.shape, generator=g) * 1e-2
"""

ROUTE = HELPERS + r"""
hooks = []
handle = register_optimizer_step_pre_hook(lambda o, a, k: hooks.append("pre"))
post = register_optimizer_step_post_hook(lambda o, a, k: hooks.append("post"))
ours, models, mains = megatron_like()
twin, twin_models, twin_mains = megatron_like()
taken = []
for step in range(4):
    skip = (1,) if step == 3 else ()
    grads(mains, step, skip), grads(twin_mains, step, skip)
    if step == 3:
        mains[1].data.add_(0.5)  # a main parameter the step leaves alone: megatron-core still copies it
        twin_mains[1].data.add_(0.5)
    taken.append(adam_model_copy.plan(ours) is not None)
    hooks.clear()
    assert adam_model_copy.step_with_model_copies(original, ours)
    assert hooks == ["pre", "post"], hooks  # torch's step hooks ran once around the step
    original(twin)
    for model, main, tm, tmain in zip(models, mains, twin_models, twin_mains):
        assert torch.equal(model.data, main.data.bfloat16())  # the model copy is the main parameter, rounded
        # the twin ran torch's fused CPU AdamW: the same rule, another rounding order
        torch.testing.assert_close(main.data, tmain.data, rtol=1e-5, atol=1e-7)
    for p, t in zip(mains, twin_mains):
        assert float(ours.optimizer.state[p]["step"]) == float(twin.optimizer.state[t]["step"])
assert taken == [False, True, True, True], taken  # the first step is torch's (it creates the state)
assert torch.equal(models[1].data, mains[1].data.bfloat16())
handle.remove(), post.remove()
print("OK")
"""


def test_route_steps_copies_and_runs_the_hooks_in_the_interpreter():
    assert passed(run_in_interpreter(ROUTE))


IN_HOOKS = HELPERS + r"""
# The plan is made again inside torch's step hooks: a pre-hook's change of the learning rate is seen, and a change
# that the kernel cannot take sends the step to torch's own AdamW (and megatron-core's copy of every pair).
ours, models, mains = megatron_like()
twin, twin_models, twin_mains = megatron_like()
for opt, ms in ((ours, mains), (twin, twin_mains)):
    grads(ms, 0)
    original(opt)
grads(mains, 1)
before = [m.detach().clone() for m in mains]
exp_avg_before = ours.optimizer.state[mains[0]]["exp_avg"].clone()
def zero_lr(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        group["lr"] = 0.0
h = ours.optimizer.register_step_pre_hook(zero_lr)
assert adam_model_copy.step_with_model_copies(original, ours)
h.remove()
assert all(torch.equal(m, b) for m, b in zip(mains, before))  # lr 0 (and so lr * wd 0): no parameter moved
assert not torch.equal(ours.optimizer.state[mains[0]]["exp_avg"], exp_avg_before)  # the moments did
def tensor_lr(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(1e-3)
for opt, ms in ((ours, mains), (twin, twin_mains)):
    grads(ms, 2)
    for group in opt.optimizer.param_groups:
        group["lr"] = 1e-3
ours.optimizer.register_step_pre_hook(tensor_lr)
twin.optimizer.register_step_pre_hook(tensor_lr)
for m, t in zip(mains, twin_mains):  # the same starting point for both
    t.data.copy_(m.data)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        twin.optimizer.state[t][key].copy_(ours.optimizer.state[m][key])
assert adam_model_copy.step_with_model_copies(original, ours)
original(twin)
for model, main, tm, tmain in zip(models, mains, twin_models, twin_mains):
    assert torch.equal(main, tmain) and torch.equal(model, tm)  # torch's own step ran, and every copy
print("OK")
"""


def test_plan_is_made_inside_the_step_hooks():
    assert passed(run_in_interpreter(IN_HOOKS))


REFUSED = HELPERS + r"""
def stepped(**changes):
    opt, models, mains = megatron_like(**{k: v for k, v in changes.items() if k in ("fused", "amsgrad", "maximize")})
    grads(mains, 0)
    original(opt)  # the state exists
    grads(mains, 1)
    for k, v in changes.items():
        if k in ("lr", "betas"):
            opt.optimizer.param_groups[0][k] = v
        elif k == "stub":
            opt.is_stub_optimizer = True
        elif k == "mxfp8":
            opt.config.reuse_grad_buf_for_mxfp8_param_ag = True
        elif k == "new_param":
            p = torch.nn.Parameter(torch.zeros(3))
            p.grad = torch.ones(3)
            opt.optimizer.param_groups[1]["params"].append(p)
        elif k == "strided_grad":
            mains[0].grad = torch.zeros(2 * mains[0].numel())[::2]
        elif k == "grad_scale":
            opt.optimizer.grad_scale = torch.ones(())
    return adam_model_copy.plan(opt)

assert stepped() is not None
for change in ({"fused": False}, {"amsgrad": True}, {"maximize": True}, {"lr": torch.tensor(1e-3)},
               {"betas": (torch.tensor(0.9), 0.95)}, {"stub": True}, {"mxfp8": True}, {"new_param": True},
               {"strided_grad": True}, {"grad_scale": True}):
    assert stepped(**change) is None, change
print("OK")
"""


def test_plan_refuses_what_is_not_torchs_plain_fused_adamw():
    assert passed(run_in_interpreter(REFUSED))


def test_plan_refuses_tensors_the_kernel_does_not_run_on(monkeypatch):
    """Outside the interpreter CPU tensors are not the kernel's: megatron-core's own step runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    namespace: dict = {}
    exec(HELPERS, namespace)
    opt, models, mains = namespace["megatron_like"]()
    namespace["grads"](mains, 0)
    namespace["original"](opt)
    namespace["grads"](mains, 1)
    assert adam_model_copy.plan(opt) is None
    calls = []
    assert adam_model_copy.step_with_model_copies(lambda o: calls.append(o) or True, opt)
    assert calls == [opt]


def test_route_installs_and_removes():
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as owner

    route = ((owner, "step_with_ready_grads", None),)
    compat.remove_patches(route)
    original = owner.step_with_ready_grads
    seen = []
    try:
        assert compat.route_adam_model_copy(lambda orig, self: seen.append((orig, self)) or True)
        assert compat.adam_model_copy_routed() and compat.route_adam_model_copy(None)  # idempotent
        marker = object()
        assert owner.step_with_ready_grads(marker) and seen == [(original, marker)]
    finally:
        compat.remove_patches(route)
    assert owner.step_with_ready_grads is original and not compat.adam_model_copy_routed()


@pytest.mark.parametrize("version,known", [("2.7.1", False), ("2.8.0", True), ("2.14.1+cu130", True)])
def test_torch_versions_with_the_reproduced_arithmetic(version, known, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    assert compat.fused_adamw_arithmetic_known() is known
