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


def test_per_expert_weight_gradient_gemms_on_cuda():
    """``grouped_linear(accumulate=True, row_ends=RowEnds(offs))`` with device counts: no host sync in the forward
    (the row ends are copied without one), each expert's weight gradient is one GEMM adding its fp32 product into
    ``main_grad`` (bitwise ``wgrad_gemm_accum_fp32`` per expert, what megatron-core's linears do), an empty expert's
    ``main_grad`` untouched; against the fp64 product it is closer than the grouped GEMM's bf16 gradient."""
    from megatron_glm5.moe import grouped_experts as ge
    from megatron_glm5.optim_fusions import wgrad_gemm_accum_fp32

    counts = [300, 0, 517, 224]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(counts), 256, device="cuda", generator=g).bfloat16()
    dy = torch.randn(sum(counts), 512, device="cuda", generator=g).bfloat16()
    w = [torch.randn(512, 256, device="cuda", generator=g).bfloat16().requires_grad_(True) for _ in counts]
    base = [torch.full((512, 256), float(i), device="cuda") for i in range(len(counts))]
    for i, wi in enumerate(w):
        wi.main_grad = base[i].clone()
        wi.grad_added_to_main_grad = False
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ends = ge.RowEnds(offs)
        y = ge.grouped_linear(x, w, offs, offs.diff(prepend=offs.new_zeros(1)) == 0, accumulate=True, row_ends=ends)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    y.backward(dy)
    start = 0
    for i, (wi, c) in enumerate(zip(w, counts)):
        want = base[i].clone()
        if c:
            wgrad_gemm_accum_fp32(x[start:start + c], dy[start:start + c], want)
        assert wi.grad_added_to_main_grad and torch.equal(wi.main_grad, want), i
        exact = base[i].double() + dy[start:start + c].double().t() @ x[start:start + c].double()
        grouped = base[i] + (dy[start:start + c].t() @ x[start:start + c]).float()  # bf16 gradient, then the add
        assert (wi.main_grad.double() - exact).abs().max() <= (grouped.double() - exact).abs().max()
        start += c
    assert torch.equal(w[1].main_grad, base[1])
