"""The fused-Adam gradient clip (``megatron_glm5.optim_fusions.clip_in_fused_adam``) with torch's CUDA fused AdamW:
the CPU test's checks (bit for bit below the clip, one fp32 rounding above it, the scale gone after the step) on the
GPU kernel, which divides by ``grad_scale`` as the CPU kernel does."""

from __future__ import annotations

import pytest

from tests.test_optimizer_phase import test_clip_in_fused_adam_matches_megatron_cores_clip_then_step as _check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scale", [0.05, 1.0, 40.0])
def test_clip_in_cuda_fused_adam(scale):
    _check(scale, device="cuda")
