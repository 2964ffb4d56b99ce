"""Flattened-token layout shared by the DSA paths: megatron's ``[s, b, ...]`` (bshd) or THD ``[t, ...]`` tensors
become ``T`` rows, batch-major, and every top-k index is a global row in that axis.

With THD the rows are already flat (``b == 1``); megatron-core uses ``cu_seqlens_*_padded`` when present (padding
between sequences) and so do we, so RoPE positions and causal ranges agree with AbsorbedMLA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import causal_bounds, uniform_cu_seqlens


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """How ``T = batch * seqlen`` rows map to sequences, and each row's causal key range ``[starts, ends)``."""

    seqlen: int  # rows per batch entry (THD: total packed tokens)
    batch: int
    cu_seqlens: torch.Tensor  # int32 [n_seq + 1], in flattened rows
    starts: torch.Tensor  # int32 [T]
    ends: torch.Tensor  # int32 [T]

    @property
    def num_rows(self) -> int:
        return self.seqlen * self.batch

    @property
    def positions(self) -> torch.Tensor:
        """RoPE position of every row: its offset in its sequence (packed sequences restart at 0)."""
        rows = torch.arange(self.num_rows, device=self.starts.device, dtype=torch.int64)
        return rows - self.starts.to(torch.int64)

    @classmethod
    def build(cls, seqlen: int, batch: int, device: torch.device, packed_seq_params=None) -> "TokenLayout":
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd":
            if batch != 1:
                raise ValueError(f"THD packed input must have batch 1, got batch={batch}")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            cu = cu.to(device=device, dtype=torch.int32)
            if int(cu[-1]) > seqlen:
                raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed input has {seqlen} tokens")
        else:
            cu = uniform_cu_seqlens(batch, seqlen, device)
        starts, ends = causal_bounds(cu, total=seqlen * batch)
        return cls(seqlen=seqlen, batch=batch, cu_seqlens=cu, starts=starts, ends=ends)

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, *rest]`` -> ``[b * s, *rest]`` (batch-major rows)."""
        if x.shape[:2] != (self.seqlen, self.batch):
            raise ValueError(f"expected [s={self.seqlen}, b={self.batch}, ...], got {tuple(x.shape)}")
        if self.batch == 1:
            return x.reshape(self.seqlen, *x.shape[2:])
        return x.transpose(0, 1).reshape(self.num_rows, *x.shape[2:])

    def unflatten(self, x: torch.Tensor) -> torch.Tensor:
        """``[b * s, *rest]`` -> ``[s, b, *rest]``."""
        if self.batch == 1:
            return x.reshape(self.seqlen, 1, *x.shape[1:])
        return x.reshape(self.batch, self.seqlen, *x.shape[1:]).transpose(0, 1).contiguous()
