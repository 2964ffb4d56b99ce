"""The zero-groups kernel (``megatron_glm5.kernels.zero_groups``) on the GPU at the GLM-5 slice's expert weight
gradients (16 experts of [4096, 6144] and [6144, 2048], bf16): equal to ``masked_fill_`` with none, some and all
experts empty, the others untouched, and its time against the masked pass (printed; with no expert empty it must be
far cheaper, which is the point)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.kernels.zero_groups import zero_empty_groups, zero_empty_groups_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(16, 4096, 6144), (16, 6144, 2048)])
def test_zero_groups_against_masked_fill_and_speed(shape):
    from triton.testing import do_bench

    dw = torch.randn(shape, device="cuda").bfloat16()
    for flags in ([0] * 16, [i % 3 == 0 for i in range(16)], [1] * 16):
        empty = torch.tensor(flags, dtype=torch.bool, device="cuda")
        ours = zero_empty_groups(dw.clone(), empty)
        assert torch.equal(ours, zero_empty_groups_reference(dw.clone(), empty))
        assert torch.equal(ours[~empty], dw[~empty])
    none = torch.zeros(16, dtype=torch.bool, device="cuda")
    buf = dw.clone()
    t_kernel = do_bench(lambda: zero_empty_groups(buf, none))
    t_masked = do_bench(lambda: zero_empty_groups_reference(buf, none))
    print(f"\nzero groups {shape}, none empty: kernel {t_kernel * 1e3:.1f} us, masked_fill {t_masked * 1e3:.1f} us")
    assert t_kernel < 0.25 * t_masked
