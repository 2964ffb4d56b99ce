"""Interleaved (GPT-J pair) RoPE computed in fp32 and cast once, as the rollout engines (sglang/vLLM) apply it.

Pairs ``(x[2i], x[2i+1])`` rotate by ``theta ** (-2i / d)``. The result is returned de-interleaved
(``[rotated evens | rotated odds]``), the layout HF transformers and megatron-core's ``mla_rotary_interleaved`` use;
queries and keys are permuted alike, so their dot products equal those of the in-place rotation.
"""

from __future__ import annotations

import torch

from ..kernels.rope_cat import apply_interleaved_rope  # the torch expressions (the fused kernel's oracle)

__all__ = ["apply_interleaved_rope", "rope_cos_sin"]


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[*positions.shape, dim // 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()
