"""Interleaved (GPT-J pair) RoPE computed in fp32 and cast once, as the rollout engines (sglang/vLLM) apply it.

Pairs ``(x[2i], x[2i+1])`` rotate by ``theta ** (-2i / d)``. The result is returned de-interleaved
(``[rotated evens | rotated odds]``), the layout HF transformers and megatron-core's ``mla_rotary_interleaved`` use;
queries and keys are permuted alike, so their dot products equal those of the in-place rotation.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[*positions.shape, dim // 2]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` (``[T, ..., d]``) with per-row ``cos/sin`` ``[T, d/2]``; fp32 math, one cast."""
    while cos.ndim < x.ndim:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).to(x.dtype)
