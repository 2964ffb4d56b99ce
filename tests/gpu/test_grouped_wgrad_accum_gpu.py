"""The grouped weight-gradient accumulation (``megatron_glm5.kernels.grouped_wgrad_accum``) on the GPU at the GLM-5
slice's expert weight gradients (16 experts of [4096, 6144] and [6144, 2048], bf16, into fp32 ``main_grad`` laid out
in reverse order in one buffer, as megatron-core's DDP lays out parameters): bitwise equal to DDP's per-expert
``add_`` with none, some and all experts empty, and its time against that path (the zero-groups pass plus one add
per expert, printed; it must not be slower)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.kernels.grouped_wgrad_accum import (accumulate_groups, accumulate_groups_reference,
                                                       accumulate_groups_supported)
from megatron_glm5.kernels.zero_groups import zero_empty_groups

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(16, 4096, 6144), (16, 6144, 2048)])
def test_accumulate_groups_bitwise_and_speed(shape):
    from triton.testing import do_bench

    e, n, k = shape
    dw = torch.randn(shape, device="cuda").bfloat16()
    buffer = torch.randn(e * n * k + 64 * e, device="cuda")  # one buffer, experts in reverse order, padded apart
    mains = [buffer[(e - 1 - i) * (n * k + 64):][: n * k].view(n, k) for i in range(e)]
    for flags in ([0] * e, [i % 3 == 0 for i in range(e)], [1] * e):
        empty = torch.tensor(flags, dtype=torch.bool, device="cuda")
        assert accumulate_groups_supported(dw, mains, empty)
        start = buffer.clone()
        accumulate_groups(dw, mains, empty)
        ours = buffer.clone()
        buffer.copy_(start)
        accumulate_groups_reference(dw, mains, empty)
        assert torch.equal(ours, buffer), f"flags {flags}"
        buffer.copy_(start)
    none = torch.zeros(e, dtype=torch.bool, device="cuda")

    def ddp_path():
        zero_empty_groups(dw, none)
        for i, m in enumerate(mains):
            m.add_(dw[i])

    t_kernel = do_bench(lambda: accumulate_groups(dw, mains, none))
    t_ddp = do_bench(ddp_path)
    gb = dw.numel() * (2 + 4 + 4) / 1e9
    print(f"\naccumulate groups {shape}: kernel {t_kernel * 1e3:.1f} us ({gb / t_kernel:.2f} TB/s), zero pass + "
          f"{e} adds {t_ddp * 1e3:.1f} us ({gb / t_ddp:.2f} TB/s)")
    assert t_kernel <= 1.02 * t_ddp


def test_grouped_linear_accumulates_on_cuda():
    """``grouped_linear(accumulate=True)`` on CUDA bf16 takes the kernel, with host indices (copied through pinned
    memory) and a device mask of the empty experts, and leaves in ``main_grad`` what DDP's adds of the returned
    gradients leave."""
    from megatron_glm5.moe import grouped_experts as ge

    counts = [300, 0, 500, 224]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(counts), 256, device="cuda", generator=g).bfloat16()
    for empty in ((1,), torch.tensor([c == 0 for c in counts], device="cuda")):
        w = [torch.randn(512, 256, device="cuda", generator=g).bfloat16().requires_grad_(True) for _ in counts]
        want = torch.autograd.grad(ge.grouped_linear(x, w, offs, empty).float().square().sum(), w)
        for i, wi in enumerate(w):
            wi.main_grad = torch.full((512, 256), float(i), device="cuda")
            wi.grad_added_to_main_grad = False
        mains = [wi.main_grad for wi in w]
        assert accumulate_groups_supported(torch.empty(4, 512, 256, device="cuda").bfloat16(), mains,
                                           torch.zeros(4, dtype=torch.bool, device="cuda"))
        ge.grouped_linear(x, w, offs, empty, accumulate=True).float().square().sum().backward()
        for i, wi in enumerate(w):
            assert wi.grad_added_to_main_grad
            assert torch.equal(wi.main_grad, torch.full_like(wi.main_grad, float(i)).add_(want[i])), i
