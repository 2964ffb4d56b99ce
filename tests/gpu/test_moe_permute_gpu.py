"""MoE token permutation with gather sums (``megatron_glm5.kernels.moe_permute``) on the GPU, at the GLM-5 slice's
shape (8192 tokens, 16 experts, top-8, hidden 6144, bf16): the gather-sum kernel against its fp32 oracle (bitwise
but for the summation order's rare one-ulp flips), the routed ``permute`` / ``unpermute`` against megatron-core's
(identical permuted rows and indices; sums within a few bf16 ulps, which megatron-core rounds at every atomic add),
bitwise reproducible, and its time against megatron-core's un-fused path (printed)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import fusions
from megatron_glm5.kernels.moe_permute import expert_rows, gather_sum, gather_sum_reference

pytestmark = pytest.mark.gpu

TOKENS, EXPERTS, TOPK, HIDDEN = 8192, 16, 8, 6144


def _case(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(TOKENS, EXPERTS, device="cuda", generator=g)
    m = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool, device="cuda").scatter_(1, scores.topk(TOPK, 1).indices, True)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=g).bfloat16()
    return m, x


def test_gather_sum_matches_oracle():
    m, _ = _case()
    rows = expert_rows(m)
    src = torch.randn(TOKENS * TOPK, HIDDEN, device="cuda").bfloat16()
    out, ref = gather_sum(src, rows), gather_sum_reference(src, rows)
    flips = int((out != ref).sum())
    worst = int((out.view(torch.int16).int() - ref.view(torch.int16).int()).abs().max())
    print(f"\ngather_sum [{TOKENS}x{TOPK} -> {TOKENS}, {HIDDEN}] bf16: {flips} of {out.numel()} differ "
          f"(max {worst} ulp)")
    assert worst <= 1 and flips <= out.numel() // 10000
    assert torch.equal(gather_sum(src, rows), out)  # no atomics: the same bits every run


def _round_trip(permute, unpermute, m, x, w):
    xi = x.clone().requires_grad_()
    n = TOKENS * TOPK
    permuted, _, sorted_indices, _, _ = permute(xi, m, num_out_tokens=n, fused=False)
    out = unpermute(permuted * w, sorted_indices, restore_shape=x.shape, routing_map=m, fused=False)
    out.backward(torch.ones_like(out))
    return permuted, sorted_indices, out, xi.grad


def test_routed_permutation_against_megatron_and_speed():
    from megatron.core.transformer.moe import moe_utils
    from triton.testing import do_bench

    m, x = _case(1)
    w = (1 + 0.1 * torch.randn(TOKENS * TOPK, 1, device="cuda")).bfloat16()
    ours = _round_trip(fusions.permute, fusions.unpermute, m, x, w)
    mcore = _round_trip(moe_utils.permute, moe_utils.unpermute, m, x, w)
    assert torch.equal(ours[0], mcore[0]) and torch.equal(ours[1], mcore[1])
    errs = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(ours[2:], mcore[2:])]
    print(f"\nvs megatron-core: unpermuted {errs[0]:.1e}, dx {errs[1]:.1e} of scale")
    assert max(errs) < 2e-2  # megatron-core rounds each of the 8 atomic bf16 adds
    again = _round_trip(fusions.permute, fusions.unpermute, m, x, w)
    assert torch.equal(again[2], ours[2]) and torch.equal(again[3], ours[3])

    fused = do_bench(lambda: _round_trip(fusions.permute, fusions.unpermute, m, x, w))
    eager = do_bench(lambda: _round_trip(moe_utils.permute, moe_utils.unpermute, m, x, w))
    print(f"permute + unpermute fwd+bwd [{TOKENS} tokens, top-{TOPK} of {EXPERTS}, {HIDDEN}] bf16: gather sums "
          f"{fused:.3f} ms, megatron-core {eager:.3f} ms ({eager / fused:.1f}x)")
    assert fused < eager
