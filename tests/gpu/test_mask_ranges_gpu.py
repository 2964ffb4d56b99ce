"""The mask-ranges kernel (``megatron_glm5.kernels.mask_ranges``) on the GPU at the GLM-5 slice's mask (Megatron-LM's
causal ``[1, 1, 8192, 8192]`` bool mask) and at 16K with documents and padding, bool and additive bf16: equal to the
torch passes element for element, refused patterns flagged alike, and its time against them (printed; the kernel
must be cheaper, which is the point)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.kernels.mask_ranges import mask_ranges, mask_ranges_reference

pytestmark = pytest.mark.gpu


def _masks(s: int) -> dict[str, torch.Tensor]:
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)
    docs = causal.expand(2, s, s).clone()
    docs[0, s // 3:, :s // 3] = True
    docs[1, :, :100] = True  # left padding
    gap = causal[None].clone()
    gap[0, s - 1, 5] = True
    return {"causal": causal[None, None][:, 0], "docs": docs,
            "additive": torch.where(docs, float("-inf"), 0.0).to(torch.bfloat16), "gap": gap}


@pytest.mark.parametrize("s", [8192, 16384])
def test_mask_ranges_against_the_torch_passes_and_speed(s):
    from triton.testing import do_bench

    for name, mask in _masks(s).items():
        got, want = mask_ranges(mask), mask_ranges_reference(mask)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
        assert bool(want[2]) == (name != "gap"), name
    causal = _masks(s)["causal"]
    t_kernel = do_bench(lambda: mask_ranges(causal))
    t_torch = do_bench(lambda: mask_ranges_reference(causal))
    print(f"\nmask ranges [1, {s}, {s}] bool: kernel {t_kernel * 1e3:.1f} us, torch passes {t_torch * 1e3:.1f} us")
    assert t_kernel < 0.5 * t_torch
