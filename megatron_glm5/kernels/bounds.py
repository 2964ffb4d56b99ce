"""Causal key ranges of packed sequences: the row bounds every DSA kernel and its torch oracle take (the kernels'
own helper, so that they import no model code; :mod:`megatron_glm5.dsa.reference` re-exports it)."""

from __future__ import annotations

import torch


def causal_bounds(cu_seqlens: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row candidate key range for packed causal attention: row ``t`` of sequence ``i`` may attend to
    ``[cu_seqlens[i], t + 1)``. Returns ``(starts, ends)`` int32 ``[T]``. Rows past ``cu_seqlens[-1]`` (padding)
    get an empty range."""
    cu = cu_seqlens.to(torch.int64)
    t_total = int(cu[-1]) if total is None else total
    rows = torch.arange(t_total, device=cu.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.numel() - 2)
    starts = cu[seq]
    ends = rows + 1
    pad = rows >= cu[-1]
    starts = torch.where(pad, rows, starts)
    ends = torch.where(pad, rows, ends)
    return starts.to(torch.int32), ends.to(torch.int32)
