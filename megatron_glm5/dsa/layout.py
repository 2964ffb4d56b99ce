"""Flattened-token layout shared by the DSA paths: megatron's ``[s, b, ...]`` (bshd) or THD ``[t, ...]`` tensors
become rows, batch-major, and every top-k index is a global row of the *key* axis.

With THD the rows are already flat (``b == 1``); megatron-core uses ``cu_seqlens_*_padded`` when present (padding
between sequences) and so do we, so RoPE positions and causal ranges agree with AbsorbedMLA.

Queries and keys share one axis except under context parallelism (:meth:`TokenLayout.build_zigzag_cp`): a CP rank
holds the query rows of its two zigzag chunks of each sequence, while its keys are the whole sequence, all-gathered
and put back in sequence order (:meth:`TokenLayout.key_order`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device_check import check_on_device
from .masks import key_ranges
from .reference import causal_bounds, uniform_cu_seqlens


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """How ``batch * seqlen`` query rows map onto ``batch * key_seqlen`` key rows: each query row's causal key range
    ``[starts, ends)`` (global key rows) and its RoPE position."""

    seqlen: int  # query rows per batch entry (THD: total packed tokens)
    batch: int
    starts: torch.Tensor  # int32 [T_q]
    ends: torch.Tensor  # int32 [T_q]
    positions: torch.Tensor  # int64 [T_q]
    key_seqlen: int  # key rows per batch entry (== seqlen without CP)
    key_positions: torch.Tensor  # int64 [T_k]

    @property
    def num_rows(self) -> int:
        return self.seqlen * self.batch

    @property
    def num_key_rows(self) -> int:
        return self.key_seqlen * self.batch

    def row_starts(self) -> torch.Tensor:
        """int64 ``[T_q]``: the first row of each query row's batch entry (bshd; where a causal range starts)."""
        rows = torch.arange(self.num_rows, device=self.starts.device, dtype=torch.int64)
        return rows - rows % self.seqlen

    @classmethod
    def build(cls, seqlen: int, batch: int, device: torch.device, packed_seq_params=None,
              attention_mask: torch.Tensor | None = None) -> "TokenLayout":
        """Causal layout of a bshd batch, a THD packed batch (``packed_seq_params``), or a bshd batch with a dense
        ``attention_mask`` whose rows each allow one contiguous causal key range (:mod:`megatron_glm5.dsa.masks`);
        a row's RoPE position is its offset from its range's start."""
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if attention_mask is not None:
            if thd:
                raise ValueError("give document boundaries either as THD packing (packed_seq_params) or as a dense "
                                 "attention_mask, not both")
            starts, ends = key_ranges(attention_mask.to(device), seqlen, batch)
            positions = torch.arange(seqlen * batch, device=device, dtype=torch.int64) - starts.to(torch.int64)
            return cls(seqlen=seqlen, batch=batch, starts=starts, ends=ends, positions=positions,
                       key_seqlen=seqlen, key_positions=positions)
        if thd:
            if batch != 1:
                raise ValueError(f"THD packed input must have batch 1, got batch={batch}")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            cu = cu.to(device=device, dtype=torch.int32)
            # Checked on the device: a host sync here would stall every layer's launch queue.
            check_on_device(cu[-1] <= seqlen, f"packed_seq_params.cu_seqlens ends past the packed input's "
                                f"{seqlen} tokens")
        else:
            cu = uniform_cu_seqlens(batch, seqlen, device)
        starts, ends = causal_bounds(cu, total=seqlen * batch)
        # A row's position is its offset in its sequence (padding rows have starts == row: position 0).
        positions = torch.arange(seqlen * batch, device=device, dtype=torch.int64) - starts.to(torch.int64)
        return cls(seqlen=seqlen, batch=batch, starts=starts, ends=ends, positions=positions,
                   key_seqlen=seqlen, key_positions=positions)

    @classmethod
    def build_zigzag_cp(cls, local_len: int, batch: int, cp_rank: int, cp_size: int,
                        device: torch.device) -> "TokenLayout":
        """Megatron's load-balanced context parallelism for bshd: each sequence of ``S = local_len * cp_size``
        tokens is cut into ``2 * cp_size`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r``."""
        if local_len % 2:
            raise ValueError(f"zigzag context parallelism needs an even local sequence length, got {local_len}")
        full = local_len * cp_size
        pos = _zigzag_positions(torch.arange(local_len, device=device, dtype=torch.int64), cp_rank, local_len,
                                cp_size)
        base = torch.arange(batch, device=device, dtype=torch.int64)[:, None] * full
        starts = base.expand(batch, local_len).reshape(-1)
        ends = (base + pos[None] + 1).reshape(-1)
        return cls(seqlen=local_len, batch=batch, starts=starts.to(torch.int32), ends=ends.to(torch.int32), positions=pos.repeat(batch),
                   key_seqlen=full, key_positions=torch.arange(full, device=device).repeat(batch))

    @staticmethod
    def key_order(local_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
        """Index into the CP all-gather (rank-major concatenation of the ranks' local rows) that puts the rows back
        in sequence order."""
        gathered = torch.arange(local_len * cp_size, device=device, dtype=torch.int64)
        natural = _zigzag_positions(gathered % local_len, gathered // local_len, local_len, cp_size)
        order = torch.empty_like(gathered)
        order[natural] = gathered
        return order

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """Query-side ``[s, b, *rest]`` -> ``[b * s, *rest]`` (batch-major rows)."""
        return _flatten(x, self.seqlen, self.batch)

    def flatten_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Key-side ``[s_k, b, *rest]`` -> ``[b * s_k, *rest]``."""
        return _flatten(x, self.key_seqlen, self.batch)

    def unflatten(self, x: torch.Tensor) -> torch.Tensor:
        """``[b * s, *rest]`` -> ``[s, b, *rest]`` (query side)."""
        if self.batch == 1:
            return x.reshape(self.seqlen, 1, *x.shape[1:])
        return x.reshape(self.batch, self.seqlen, *x.shape[1:]).transpose(0, 1).contiguous()


def _zigzag_positions(j: torch.Tensor, cp_rank, local_len: int, cp_size: int) -> torch.Tensor:
    """Sequence position of local row ``j`` on CP rank ``cp_rank`` (chunks ``r`` and ``2 * cp_size - 1 - r``)."""
    chunk = local_len // 2
    return torch.where(j < chunk, cp_rank, 2 * cp_size - 1 - cp_rank) * chunk + j % chunk


def _flatten(x: torch.Tensor, seqlen: int, batch: int) -> torch.Tensor:
    if x.shape[:2] != (seqlen, batch):
        raise ValueError(f"expected [s={seqlen}, b={batch}, ...], got {tuple(x.shape)}")
    if batch == 1:
        return x.reshape(seqlen, *x.shape[2:])
    return x.transpose(0, 1).reshape(seqlen * batch, *x.shape[2:])
