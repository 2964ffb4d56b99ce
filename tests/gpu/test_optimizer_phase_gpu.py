"""The device gradient clip (``optim_fusions.grad_norm_on_device``, ``fusions.clip_scale_tensor``,
``kernels.grad_clip``) through megatron-core's own ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32`` on
CUDA: the clipped gradients bit for bit megatron-core's host path at norms below and above the clip, the norm its
Python float (within one double ulp, equal in fp32), no host sync on the way (torch's sync debug mode), and the
scale kernel's time below and above the clip against megatron-core's tensor branch (one multiply of every
gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_glm5 import compat, fusions, optim_fusions

pytestmark = pytest.mark.gpu


def _route():
    from megatron.core.optimizer import clip_grads, optimizer

    return ((clip_grads, "multi_tensor_scale_tensor_impl", None), (clip_grads, "get_grad_norm_fp32", None),
            (optimizer, "get_grad_norm_fp32", None))


def _params(scale: float, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sizes, scales = (3_000_000, 37, 1, 70_000, 4096 * 3), (1.0, 50.0, 0.01, 1e-3, 0.3)
    params = []
    for n, s in zip(sizes, scales):
        p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
        p.grad = torch.randn(n, device="cuda", generator=g) * s * scale
        params.append(p)
    return params


@pytest.mark.parametrize("scale", [1e-4, 0.05, 1.0, 40.0])
def test_device_clip_is_megatron_cores_host_clip(scale, parallel):
    from megatron.core.optimizer import clip_grads

    assert compat.route_grad_norm(fusions.multi_tensor_l2_norm)
    compat.remove_patches(_route())  # megatron-core's host path
    twins = _params(scale)
    host = clip_grads.get_grad_norm_fp32([p.grad for p in twins])
    assert isinstance(host, float) and (host > 1.0) == (scale > 1e-4)
    clip_grads.clip_grad_by_total_norm_fp32(twins, 1.0, host)
    params = _params(scale)
    try:
        assert compat.route_device_grad_clip(optim_fusions.grad_norm_on_device, fusions.clip_scale_tensor)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
            clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        compat.remove_patches(_route())
    assert norm.dtype == torch.float64 and norm.shape == (1,) and norm.is_cuda
    assert abs(float(norm) - host) <= math.ulp(host) and float(norm.float()) == float(torch.tensor(host).float())
    for p, q in zip(params, twins):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(params[0].grad, _params(scale)[0].grad) == (host <= 1.0)


def test_scale_below_one_speed():
    """One program per 16384 gradients: with the coefficient at one it reads nothing but the coefficient."""
    from triton.testing import do_bench

    from megatron_glm5.kernels.grad_clip import scale_below_one

    grads = [torch.randn(n, device="cuda") for n in (400_000_000, 100_000_000, 37, 4096 * 6144)]
    gb = sum(g.numel() for g in grads) * 8 / 1e9
    one, half = torch.ones(1, device="cuda", dtype=torch.float64), torch.full((1,), 0.999, device="cuda")
    t_one = do_bench(lambda: scale_below_one(grads, one))
    t_half = do_bench(lambda: scale_below_one(grads, half))
    t_mcore = do_bench(lambda: fusions.multi_tensor_scale(0, None, [grads, grads], one))
    print(f"\nclip scale over {gb / 8:.2f} G fp32 gradients: at 1 {t_one * 1e3:.1f} us, below 1 {t_half * 1e3:.1f} us "
          f"({gb / t_half:.2f} TB/s); megatron-core's tensor branch (foreach multiply) {t_mcore * 1e3:.1f} us")
    assert t_one * 20 < t_mcore and t_half < 1.1 * t_mcore
