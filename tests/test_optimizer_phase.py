"""The optimizer phase's routes (issue 23): the clip applied by torch's fused Adam with the norm kept on the device
(:func:`megatron_glm5.optim_fusions.clip_in_fused_adam`, experimental) and megatron-core's per-step router walks over
the routers only (:mod:`megatron_glm5.finalize_walks`)."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_glm5 import compat, finalize_walks, fusions, optim_fusions

MAX_NORM = 1.0


def _adam_pair(seed: int = 0, sizes=(1000, 37, 1, 4096), device: str = "cpu"):
    """Two identical fused AdamWs (on the CPU torch's fused CPU kernel, with the GPU kernel's ``grad_scale``
    contract; ``tests/gpu/test_optimizer_phase_gpu.py`` runs the same checks on CUDA)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in sizes]
    grads = [(torch.randn(n, generator=g) * s).to(device) for n, s in zip(sizes, (1.0, 50.0, 0.01, 1e-3))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for ps in (params, twins):
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=True)  # noqa: E731
    return params, make(params), twins, make(twins)


def _megatron_clip(params: list, norm: torch.Tensor) -> None:
    """megatron-core's no-apex gradient clip, written out (its CUDA-type assertion keeps the function itself off the
    CPU): ``get_grad_norm_fp32`` squares the norm in fp32, takes the square root of that on the host in double, and
    the clip multiplies by ``max_norm / (norm + 1e-6)`` when that is below 1."""
    coeff = MAX_NORM / ((norm ** 2).item() ** 0.5 + 1.0e-6)
    if coeff < 1.0:
        for p in params:
            p.grad.copy_(p.grad * coeff)


def _norm(params: list) -> torch.Tensor:
    return fusions.multi_tensor_l2_norm(0, torch.zeros(1, dtype=torch.int), [[p.grad for p in params]])[0]


def _never(*args):
    raise AssertionError("the fused Adam takes this clip: megatron-core's function must not run")


@pytest.mark.parametrize("scale", [1e-3, 0.05, 1.0, 40.0])
def test_clip_in_fused_adam_matches_megatron_cores_clip_then_step(scale, device="cpu"):
    """Below the clip (scale 1e-3: a norm of about 0.25) the step is bit for bit megatron-core's; above it (norms of
    about 13, 250 and 10000) within a few fp32 ulps of the clipped gradient; the scale lasts one step."""
    params, adam, twins, ref = _adam_pair(device=device)
    for ps in (params, twins):
        for p in ps:
            p.grad.mul_(scale)
    optim_fusions.take_clip(adam)
    total = _norm(params)
    clipped = float(total) > MAX_NORM
    assert clipped == (scale > 1e-3)
    assert optim_fusions.clip_in_fused_adam(_never, params, MAX_NORM, total) is None
    assert adam.grad_scale.shape == (1,) and adam.grad_scale.dtype == torch.float32
    assert (adam.grad_scale.item() == 1.0) == (not clipped)
    adam.step()
    assert "grad_scale" not in adam.__dict__  # removed by the step post-hook
    _megatron_clip(twins, total)
    ref.step()

    def same() -> None:
        for p, q in zip(params, twins):
            if clipped:
                torch.testing.assert_close(p.grad, q.grad, rtol=5e-7, atol=0)
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
            else:
                assert torch.equal(p.grad, q.grad) and torch.equal(p, q)

    same()
    for p, q in zip(params, twins):  # a second step with no clip call uses no scale
        p.grad, q.grad = torch.ones_like(p) * 7, torch.ones_like(q) * 7
    adam.step()
    ref.step()
    same()


def test_clip_in_fused_adam_nan_and_inf_norms_as_megatron_core():
    params, adam, _, _ = _adam_pair()
    optim_fusions.take_clip(adam)
    optim_fusions.clip_in_fused_adam(_never, params, MAX_NORM, torch.tensor([float("nan")]))
    assert adam.grad_scale.item() == 1.0  # megatron-core: max_norm / nan is not below 1, nothing scaled
    optim_fusions.clip_in_fused_adam(_never, params, MAX_NORM, torch.tensor([float("inf")]))
    assert adam.grad_scale.item() == float("inf")  # megatron-core: a coefficient of 0


def test_clip_in_fused_adam_hands_what_it_cannot_take_to_megatron_core():
    """A subset of the parameters (a separate gradient-norm group), decoupled gradients, an unregistered or unfused
    optimizer, a norm already on the host: megatron-core's function, with the norm as a Python number."""
    params, adam, _, _ = _adam_pair()
    calls = []

    def original(parameters, max_norm, total_norm, use_decoupled_grad):
        calls.append((len(parameters), type(total_norm), use_decoupled_grad))

    total = _norm(params)
    optim_fusions.clip_in_fused_adam(original, params, MAX_NORM, total)  # adam not registered yet
    optim_fusions.take_clip(adam)
    optim_fusions.clip_in_fused_adam(original, params[:2], MAX_NORM, total)
    optim_fusions.clip_in_fused_adam(original, params, MAX_NORM, total, True)
    optim_fusions.clip_in_fused_adam(original, params, MAX_NORM, float(total))
    plain = torch.optim.AdamW(params, lr=1e-2)  # foreach, not fused: registered, still not taken
    optim_fusions.take_clip(plain)
    adam.param_groups[0]["fused"] = False
    optim_fusions.clip_in_fused_adam(original, params, MAX_NORM, total)
    assert calls == [(4, float, False), (2, float, False), (4, float, True), (4, float, False), (4, float, False)]
    assert "grad_scale" not in adam.__dict__ and "grad_scale" not in plain.__dict__


def test_only_the_clip_route_registers_the_fused_adam(monkeypatch):
    p = torch.nn.Parameter(torch.randn(4, 3))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    plain = torch.optim.AdamW([p], lr=1e-3)
    assert optim_fusions.use_fused_adam(plain)  # the default: fused, torch's step left as it is
    assert optim_fusions._fused_owner([p]) is None and not plain._optimizer_step_post_hooks
    q = torch.nn.Parameter(torch.randn(4, 3))
    adam = torch.optim.AdamW([q], lr=1e-3)
    assert optim_fusions.use_fused_adam_taking_the_clip(adam)
    assert optim_fusions._fused_owner([q]) is adam and len(adam._optimizer_step_post_hooks) == 1
    optim_fusions.use_fused_adam_taking_the_clip(adam)
    assert len(adam._optimizer_step_post_hooks) == 1  # registered once


def test_a_grad_scale_set_elsewhere_is_left_alone():
    """torch's ``GradScaler`` sets ``grad_scale`` itself and deletes it after the step: the post-hook drops only a
    scale the clip set."""
    params, adam, _, _ = _adam_pair()
    optim_fusions.take_clip(adam)
    theirs = torch.tensor([1.0])
    adam.grad_scale = theirs
    adam.step()
    assert adam.grad_scale is theirs
    del adam.grad_scale


def test_a_scale_left_by_a_skipped_step_is_dropped_by_the_next_fallback():
    """megatron-core skips the step when the norm passes ``grad_norm_skip_threshold``: the scale then stays, and a
    clip that falls back to megatron-core's function for the same optimizer's parameters drops it."""
    params, adam, _, _ = _adam_pair()
    optim_fusions.take_clip(adam)
    optim_fusions.clip_in_fused_adam(_never, params, MAX_NORM, _norm(params))
    assert "grad_scale" in adam.__dict__
    optim_fusions.clip_in_fused_adam(lambda *a: None, params[:2], MAX_NORM, _norm(params))
    assert "grad_scale" not in adam.__dict__


def test_device_grad_clip_route_keeps_megatron_cores_norm_on_the_device(monkeypatch):
    """Installed, megatron-core's ``get_grad_norm_fp32`` takes its tensor branch (no ``.item()``) and its optimizers'
    ``clip_grad_by_total_norm_fp32`` is the fused-Adam clip; removed, both are megatron-core's again."""
    from megatron.core.optimizer import clip_grads, optimizer

    route = ((clip_grads, "multi_tensor_scale_tensor_impl", None), (optimizer, "clip_grad_by_total_norm_fp32", None))
    compat.remove_patches(route)
    original = optimizer.clip_grad_by_total_norm_fp32
    seen = []
    try:
        assert compat.route_device_grad_clip(fusions.multi_tensor_scale, lambda *a: seen.append(a))
        assert compat.route_device_grad_clip(fusions.multi_tensor_scale, _never)  # idempotent
        assert clip_grads.multi_tensor_scale_tensor_impl is fusions.multi_tensor_scale
        optimizer.clip_grad_by_total_norm_fp32(["p"], 1.0, "norm")
        assert seen == [(original, ["p"], 1.0, "norm", False)]
        # the tensor scale megatron-core would call for a tensor coefficient: in place, never read on the host
        xs = [torch.randn(5), torch.randn(3)]
        want = [x * 0.5 for x in xs]
        fusions.multi_tensor_scale(0, None, [xs, xs], torch.tensor([0.5]))
        assert all(torch.equal(a, b) for a, b in zip(xs, want))
    finally:
        compat.remove_patches(route)
    assert clip_grads.multi_tensor_scale_tensor_impl is None and optimizer.clip_grad_by_total_norm_fp32 is original


# ---- megatron-core's router walks ----------------------------------------------------------------------------------


def _routers_model(model_parallel):
    """Two identical models (real megatron-core routers among other modules) and a factory for one more router."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                               moe_router_topk=2, moe_router_enable_expert_bias=True,
                               moe_router_score_function="sigmoid", moe_router_bias_update_rate=1e-2,
                               moe_router_load_balancing_type="none", add_bias_linear=False,
                               use_cpu_initialization=True)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    router = lambda: TopKRouter(config=config, pg_collection=groups)  # noqa: E731

    def build():
        layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), router())
                                     for _ in range(2))
        return torch.nn.Sequential(torch.nn.Linear(8, 8), layers)

    return build(), build(), config, router


def _set_counts(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "expert_bias"):
            m.local_tokens_per_expert.copy_(torch.randint(0, 50, m.local_tokens_per_expert.shape, generator=g))


def _biases(model) -> list[torch.Tensor]:
    return [m.expert_bias.clone() for m in model.modules() if hasattr(m, "expert_bias")]


class _Wrapper(torch.nn.Module):
    """Stands for DDP / Float16Module: megatron-core walks the wrapper's ``modules()``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def test_router_walks_route_updates_and_resets_as_megatron_core(model_parallel):
    """Several chunks (virtual pipeline), wrapped or not, one without routers: megatron-core's own two functions on
    the cached routers give the same biases and resets as its walks over every module; per-call conditions (an
    eval-mode router) still apply."""
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    route = ((fmg, "_update_router_expert_bias", None), (fmg, "reset_model_temporary_tensors", None))
    compat.remove_patches(route)
    update, reset = fmg._update_router_expert_bias, fmg.reset_model_temporary_tensors
    model, twin, config, router = _routers_model(model_parallel)
    chunks = [_Wrapper(model), torch.nn.Linear(3, 3)]
    twin_chunks = [_Wrapper(twin), torch.nn.Linear(3, 3)]
    try:
        assert compat.route_finalize_walks(finalize_walks.update_router_expert_bias,
                                           finalize_walks.reset_model_temporary_tensors, finalize_walks.model_changed)
        for step, frozen in enumerate((False, True, False)):
            if frozen:  # a per-call condition megatron-core reads: an eval-mode router keeps its bias
                for m in (model[1][0][2], twin[1][0][2]):
                    m.eval()
            for mdl in (model, twin):
                _set_counts(mdl, step)
            fmg._update_router_expert_bias(chunks, config)
            fmg.reset_model_temporary_tensors(config, chunks)
            update(twin_chunks, config)
            reset(config, twin_chunks)
            assert all(torch.equal(a, b) for a, b in zip(_biases(model), _biases(twin)))
            assert not any(bool(m.local_tokens_per_expert.any()) for m in model.modules()
                           if hasattr(m, "expert_bias"))
        assert not torch.equal(_biases(model)[1], torch.zeros(4))  # the update did something
        assert finalize_walks.router_modules(chunks[1]) == []
    finally:
        compat.remove_patches(route)
    assert fmg._update_router_expert_bias is update and fmg.reset_model_temporary_tensors is reset


def test_router_list_is_kept_until_the_routers_change(model_parallel):
    """One walk per chunk, kept through what megatron-core's router does at every forward (a buffer assigned again)
    and other buffers' and parameters' registrations; walked again when a module is registered (a router comes in
    or goes out) or one of the walks' attributes is, and when a listed router was freed."""
    import gc

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    route = ((fmg, "_update_router_expert_bias", None), (fmg, "reset_model_temporary_tensors", None))
    assert compat.route_finalize_walks(finalize_walks.update_router_expert_bias,  # installs the registration hooks
                                       finalize_walks.reset_model_temporary_tensors, finalize_walks.model_changed)
    compat.remove_patches(route)
    model, _, _, router = _routers_model(model_parallel)
    walks = []
    walk = model.modules
    model.modules = lambda *a, **k: (walks.append(1), walk(*a, **k))[1]

    def routers() -> list:
        return finalize_walks.router_modules(model)

    found = routers()
    assert len(found) == 2 and routers() == found and len(walks) == 1
    found[0].local_tokens_per_expert = torch.zeros_like(found[0].local_tokens_per_expert)
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
    model[1][0][1].register_buffer("scratch", torch.zeros(2))
    assert routers() == found and len(walks) == 1
    found[0].expert_bias = found[0].expert_bias.clone()  # one of the walks' attributes
    assert routers() == found and len(walks) == 2
    model[1][0][0] = torch.nn.Linear(8, 8)  # any module registered: walked again
    assert routers() == found and len(walks) == 3
    model[1].append(router())  # a router comes in
    assert len(routers()) == 3 and len(walks) == 4
    model[1][2] = torch.nn.Linear(8, 8)  # and goes out, replaced by a module without one
    assert len(routers()) == 2 and len(walks) == 5
    del found
    # a listed router freed without a registration (a write to ``_modules``, which no hook sees): walked again
    model[1][1]._modules.pop("2")
    gc.collect()
    assert len(routers()) == 1 and len(walks) == 6


def test_router_list_does_not_keep_the_chunk_alive():
    """A wrapper's hooks on every module (megatron DDP's forward pre-hooks) point back to the wrapper, the cache's
    key: the cached list holds its routers weakly, so the chunk is freed with the model."""
    import gc
    import weakref

    router = torch.nn.Module()
    router.register_buffer("expert_bias", torch.zeros(4))
    chunk = _Wrapper(torch.nn.Sequential(torch.nn.Linear(2, 2), router))
    router.register_forward_pre_hook(lambda module, args, chunk=chunk: None)
    assert finalize_walks.router_modules(chunk) == [router]
    alive = weakref.ref(chunk)
    del chunk, router
    gc.collect()
    assert alive() is None
