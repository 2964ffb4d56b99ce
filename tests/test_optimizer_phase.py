"""The optimizer phase's routes (issue 23): megatron-core's gradient norm kept on the device and the clip that reads
its coefficient there (:func:`megatron_glm5.optim_fusions.grad_norm_on_device`,
:func:`megatron_glm5.fusions.clip_scale_tensor`, experimental), and megatron-core's per-step router walks over the
routers only (:mod:`megatron_glm5.finalize_walks`)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from megatron_glm5 import compat, finalize_walks, fusions, optim_fusions

MAX_NORM = 1.0


def _grads(scale: float, seed: int = 0, sizes=(1000, 37, 1, 4096)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * s * scale for n, s in zip(sizes, (1.0, 50.0, 0.01, 1e-3))]


def _host_norm(grads: list) -> float:
    """megatron-core's no-apex 2-norm: the multi-tensor L2 norm (the routed one), squared in fp32, the square root
    of that on the host in double."""
    norm = fusions.multi_tensor_l2_norm(0, torch.zeros(1, dtype=torch.int), [grads])[0]
    return (norm ** 2.0).item() ** (1.0 / 2.0)


def _host_clip(grads: list, total_norm: float, max_norm: float = MAX_NORM) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` given a Python norm, written out (its CUDA-type assertion and
    CUDA buffer keep the function itself off the CPU; the GPU test runs it): the gradients times the coefficient
    where it is below one."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        fusions.multi_tensor_scale(0, None, [grads, grads], coeff)


def _device_clip(grads: list, total_norm: torch.Tensor, max_norm: float = MAX_NORM) -> None:
    """The same function given a tensor norm (its tensor branch, written out): the coefficient clamped to one, then
    ``multi_tensor_scale_tensor_impl``, here the route's."""
    coeff = max_norm / (total_norm + 1.0e-6)
    coeff.clamp_max_(1.0)
    fusions.clip_scale_tensor(0, None, [grads, grads], coeff)


@pytest.fixture
def routed_norm(gloo_world):
    """megatron-core's multi-tensor L2 norm as the routed foreach norm (the device clip's precondition; without it
    megatron-core's no-apex norm builds a CUDA tensor), as ``install_fusions`` leaves it for the process."""
    assert compat.route_grad_norm(fusions.multi_tensor_l2_norm)


def _original_norm(*args):
    raise AssertionError("the 2-norm is computed on the device: megatron-core's function must not run")


@pytest.mark.parametrize("scale", [1e-3, 0.05, 1.0, 40.0])
def test_device_norm_and_clip_are_megatron_cores_host_path_bit_for_bit(scale, routed_norm):
    """Below the clip (scale 1e-3: a norm of about 0.25) and above it (norms of about 13, 250 and 10000): the
    device norm is megatron-core's Python float (double square root of the same fp32 square), as a one-element fp64
    tensor, and the clipped gradients are bit for bit megatron-core's."""
    grads, twins = _grads(scale), _grads(scale)
    total = optim_fusions.grad_norm_on_device(_original_norm, grads)
    assert isinstance(total, torch.Tensor) and total.dtype == torch.float64 and total.shape == (1,)
    host = _host_norm(twins)
    assert abs(float(total) - host) <= math.ulp(host) and float(total.float()) == float(torch.tensor(host).float())
    assert (host > MAX_NORM) == (scale > 1e-3)
    _device_clip(grads, total)
    _host_clip(twins, host)
    assert all(torch.equal(a, b) for a, b in zip(grads, twins))
    assert torch.equal(grads[0], _grads(scale)[0]) == (host <= MAX_NORM)  # clipped, or untouched


def test_device_norm_square_root_is_the_hosts():
    """The square root in double on the device (correctly rounded) and Python's ``x ** 0.5`` (C's ``pow``, within an
    ulp of it: they differ in about 1.3 % of values) for 200000 random fp32 squares across 80 binades: within one
    double ulp, and equal once rounded to fp32, for the norm (Megatron-LM's log) and for the clip coefficient (what
    multiplies the gradients)."""
    g = torch.Generator().manual_seed(3)
    exponents = torch.randint(-40, 40, (200000,), generator=g)
    squares = (torch.rand(200000, generator=g, dtype=torch.float64) * 2.0 ** exponents).float()
    ours = squares.double().sqrt()
    host = torch.tensor([x ** 0.5 for x in squares.tolist()], dtype=torch.float64)
    assert all(abs(a - b) <= math.ulp(b) for a, b in zip(ours.tolist(), host.tolist()))
    assert 0 < int((ours != host).sum()) < 10000  # the sample does reach the values where pow is not sqrt
    assert torch.equal(ours.float(), host.float())
    coeff_ours = (MAX_NORM / (ours + 1.0e-6)).float()
    coeff_host = torch.tensor([MAX_NORM / (h + 1.0e-6) for h in host.tolist()], dtype=torch.float64).float()
    assert torch.equal(coeff_ours, coeff_host)


def test_device_norm_nan_inf_and_other_norms(routed_norm):
    """A NaN norm scales nothing (megatron-core's host path: the coefficient is not below one), an inf norm zeroes
    the gradients (a coefficient of 0), the inf-norm goes to megatron-core's function, and zero gradients give a
    norm of 0 on their device."""
    for bad, want in ((float("nan"), None), (float("inf"), 0.0)):
        grads = _grads(1.0)
        grads[1][3] = bad
        before = [x.clone() for x in grads]
        total = optim_fusions.grad_norm_on_device(_original_norm, grads)
        assert float(total) != float(total) if bad != bad else float(total) == float("inf")
        _device_clip(grads, total)
        if want is None:
            assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(grads, before))
        else:
            assert not grads[0].any()
    seen = []
    assert optim_fusions.grad_norm_on_device(lambda *a: seen.append(a) or 3.0, ["g"], float("inf"), None) == 3.0
    assert seen == [(["g"], float("inf"), None)]
    zero = optim_fusions.grad_norm_on_device(_original_norm, [torch.zeros(7), torch.zeros(3, 2)], 2, None)
    assert zero.device.type == "cpu" and zero.dtype == torch.float64 and float(zero) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no gradients: megatron-core's norm is on 'cuda'")
def test_device_norm_of_no_gradients_is_zero_on_cuda(routed_norm):
    total = optim_fusions.grad_norm_on_device(_original_norm, [], 2, None)
    assert total.is_cuda and total.dtype == torch.float64 and float(total) == 0.0


def test_device_grad_clip_route_installs_and_removes(monkeypatch):
    """Installed, megatron-core's optimizers compute the norm with the route's function (by their module global)
    and its tensor clip scales with the route's; removed, both are megatron-core's again."""
    from megatron.core.optimizer import clip_grads, optimizer

    route = ((clip_grads, "multi_tensor_scale_tensor_impl", None), (clip_grads, "get_grad_norm_fp32", None),
             (optimizer, "get_grad_norm_fp32", None))
    compat.remove_patches(route)
    original = clip_grads.get_grad_norm_fp32
    seen = []
    try:
        assert compat.route_device_grad_clip(lambda *a: seen.append(a) or "norm", fusions.clip_scale_tensor)
        assert compat.route_device_grad_clip(_original_norm, fusions.multi_tensor_scale)  # idempotent
        assert clip_grads.multi_tensor_scale_tensor_impl is fusions.clip_scale_tensor
        assert optimizer.get_grad_norm_fp32(["g"], grad_stats_parallel_group="group") == "norm"
        assert clip_grads.get_grad_norm_fp32(["h"]) == "norm"
        assert seen == [(original, ["g"], 2, "group"), (original, ["h"], 2, None)]
        # the clip's scale: in place below one, nothing at one; other lists copy as multi_tensor_scale does
        xs = [torch.randn(5), torch.randn(3)]
        want = [x * 0.5 for x in xs]
        fusions.clip_scale_tensor(0, None, [xs, xs], torch.tensor([0.5], dtype=torch.float64))
        assert all(torch.equal(a, b) for a, b in zip(xs, want))
        fusions.clip_scale_tensor(0, None, [xs, xs], torch.tensor([1.0]))
        assert all(torch.equal(a, b) for a, b in zip(xs, want))
        out = [torch.empty(5), torch.empty(3)]
        fusions.clip_scale_tensor(0, None, [xs, out], torch.tensor([2.0]))
        assert all(torch.equal(o, x * 2) for o, x in zip(out, xs))
    finally:
        compat.remove_patches(route)
    assert clip_grads.multi_tensor_scale_tensor_impl is None and optimizer.get_grad_norm_fp32 is original


def test_device_grad_clip_route_reaches_the_layer_wise_optimizer():
    """megatron-core's ``LayerWiseDistributedOptimizer`` binds ``get_grad_norm_fp32`` by name in its own module, which
    the route does not patch: its norm stays megatron-core's function, and that function reads the module global the
    route sets (``multi_tensor_scale_tensor_impl``), so it returns its tensor branch (an fp32 root on the device, not
    the host path's double root) and the inherited ``ChainedOptimizer.step`` clips through the route's scale
    (``optim_fusions`` and ``compat.route_device_grad_clip`` say so)."""
    import inspect

    from megatron.core.optimizer import clip_grads, layer_wise_optimizer, optimizer

    route = ((clip_grads, "multi_tensor_scale_tensor_impl", None), (clip_grads, "get_grad_norm_fp32", None),
             (optimizer, "get_grad_norm_fp32", None))
    compat.remove_patches(route)
    original = clip_grads.get_grad_norm_fp32
    try:
        assert compat.route_device_grad_clip(optim_fusions.grad_norm_on_device, fusions.clip_scale_tensor)
        assert layer_wise_optimizer.get_grad_norm_fp32 is original
        assert "multi_tensor_scale_tensor_impl" in original.__code__.co_names
        assert clip_grads.multi_tensor_scale_tensor_impl is fusions.clip_scale_tensor
        lwo = layer_wise_optimizer.LayerWiseDistributedOptimizer
        assert "get_grad_norm_fp32" in inspect.unwrap(lwo.get_grad_norm).__code__.co_names
        assert lwo.step is optimizer.ChainedOptimizer.step
        assert "clip_grad_by_total_norm_fp32" in inspect.unwrap(optimizer.ChainedOptimizer.step).__code__.co_names
    finally:
        compat.remove_patches(route)


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
