"""Comparison metrics shared by the parity checks (``verify``)."""

from __future__ import annotations

import math

import torch


def logit_cosine(a: torch.Tensor, b: torch.Tensor, *, rows: int = 1024) -> float:
    """Cosine similarity of two logit tensors of the same shape, flattened, accumulated in float64 a block of rows
    at a time (no fp64 copy of a whole ``[tokens, vocab]`` tensor) and clamped to [-1, 1]: in fp32 the norms of
    millions of logits round so that two nearly equal tensors reported 1.0000019."""
    if a.shape != b.shape:
        raise ValueError(f"logit_cosine: shapes differ, {list(a.shape)} vs {list(b.shape)}")
    a2, b2 = a.reshape(-1, a.shape[-1] if a.dim() else 1), b.reshape(-1, b.shape[-1] if b.dim() else 1)
    dot = na = nb = 0.0
    for x, y in zip(a2.split(rows), b2.split(rows)):
        x, y = x.double(), y.double()
        dot += float((x * y).sum())
        na += float((x * x).sum())
        nb += float((y * y).sum())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return max(-1.0, min(1.0, dot / math.sqrt(na * nb)))
