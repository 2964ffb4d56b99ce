"""The key-block dKV pass's dense work, bounded in the forward from each row's key span: no bitmap, no host sync.

``kernels.sparse_mla_dkv`` visits, for each block of ``block_k`` keys, every query between the first and the last
one selecting a key of the block, so its cost against the atomic backward follows the ratio of that dense work to the
selected pairs (H200, 16 heads, random causal top-2048 sets: ratio 1.03 / 1.35 / 2.30 / 4.28 at 2K / 4K / 8K / 16K
tokens, speed-up 1.69x / 1.62x / 1.19x / 0.81x; ``scripts/bench/RESULTS_kernels.md``, round 2, eighth session). One
sequence's ratio grows with its length; a packed (THD) batch's key blocks see only their own sequence's queries, so
there the ratio follows the sequences, not the call's tokens, and the route can pay at any total length.

The bound. With each row's smallest and largest valid key ``lo_t`` / ``hi_t`` (:func:`row_key_span`), a query that
selects a key of block ``[b0, b1]`` has ``hi_t >= b0`` and ``lo_t <= b1``. So the block's first query is at or after
the first ``t`` whose running maximum of ``hi`` reaches ``b0``, and its last at or before the last ``t`` whose suffix
minimum of ``lo`` is at most ``b1``. Both sequences are sorted, so each block's bound is a ``searchsorted``: a few
small device ops after one pass over the indices (``[T]`` outputs). The bound is never below the exact ranges
(``selection_bitmap.key_block_query_range``). It is exact where the first row reaching into a block selects a key of
it (causal sets that select their own position) and the last row whose smallest key lies at or before the block
does too (a sequence's last row, for sets that reach back to their sequence's start, selecting a key of every block
of its sequence: random top-k sets nearly always do). It equalled the exact ranges on every random causal set in the
tests.

Test oracle: :func:`row_key_span_reference` for the Triton pass; the exact ranges for the bound.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import (
    HostValues,
    cdiv,
    check_index_rows,
    next_power_of_2,
    triton_kernels,
    triton_runs_on,
)


def row_key_span(indices: torch.Tensor, t_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` int32 ``[T]``: each row's smallest and largest valid key (``0 <= key < t_kv``); ``t_kv`` and -1
    for a row without one. One Triton program per row on the GPU; :func:`row_key_span_reference` elsewhere."""
    check_index_rows(indices, t_kv)
    t_len, k = indices.shape
    if not triton_runs_on(indices) or _triton() is None:
        return row_key_span_reference(indices, t_kv)
    lo = torch.full((t_len,), t_kv, dtype=torch.int32, device=indices.device)
    hi = torch.full((t_len,), -1, dtype=torch.int32, device=indices.device)
    if t_len == 0 or k == 0:
        return lo, hi
    indices = indices.contiguous()
    _triton()[(t_len,)](indices, lo, hi, k, t_kv, KP=next_power_of_2(k), num_warps=4)
    return lo, hi


def row_key_span_reference(indices: torch.Tensor, t_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of :func:`row_key_span` (two masked reductions over ``[T, K]`` temporaries)."""
    check_index_rows(indices, t_kv)
    valid = (indices >= 0) & (indices < t_kv)
    if indices.shape[1] == 0:
        n = indices.shape[0]
        return (torch.full((n,), t_kv, dtype=torch.int32, device=indices.device),
                torch.full((n,), -1, dtype=torch.int32, device=indices.device))
    lo = torch.where(valid, indices, t_kv).amin(1).to(torch.int32)
    hi = torch.where(valid, indices, -1).amax(1).to(torch.int32)
    return lo, hi


def span_query_ranges(lo: torch.Tensor, hi: torch.Tensor, t_kv: int, block_k: int = 64) -> torch.Tensor:
    """int32 ``[n_blocks, 2]`` on the spans' device: for each key block a query range ``[first, end)`` that holds
    every query selecting one of its keys (module docstring; ``[0, 0)`` where none can), the layout of
    ``selection_bitmap.key_block_query_range``'s exact ranges, which it contains."""
    if block_k <= 0 or block_k % 32:
        raise ValueError(f"block_k must be a positive multiple of 32, got {block_k}")
    n_blocks = cdiv(max(t_kv, 0), block_k)
    out = torch.zeros(n_blocks, 2, dtype=torch.int32, device=lo.device)
    if lo.numel() == 0 or n_blocks == 0:
        return out
    b0 = torch.arange(n_blocks, dtype=torch.int64, device=lo.device) * block_k
    hi_run = torch.cummax(hi.to(torch.int64), 0).values  # nondecreasing
    lo_suffix = torch.cummin(lo.to(torch.int64).flip(0), 0).values.flip(0)  # nondecreasing
    first = torch.searchsorted(hi_run, b0, side="left")  # first t whose running max reaches b0
    b1 = (b0 + block_k - 1).clamp_max(t_kv - 1)  # a partial last block: rows without keys (lo = t_kv) stay out
    end = torch.searchsorted(lo_suffix, b1, side="right")  # one past the last t with lo_t <= b1
    some = end > first
    out[:, 0] = torch.where(some, first, 0).to(torch.int32)
    out[:, 1] = torch.where(some, end, 0).to(torch.int32)
    return out


def dense_pairs_bound(lo: torch.Tensor, hi: torch.Tensor, t_kv: int, block_k: int = 64) -> torch.Tensor:
    """int64 scalar on the spans' device: an upper bound of the (query, key) pairs the key-block pass computes,
    ``block_k`` times the sum over key blocks of the queries in each block's range (:func:`span_query_ranges`)."""
    rng = span_query_ranges(lo, hi, t_kv, block_k).to(torch.int64)
    return (rng[:, 1] - rng[:, 0]).sum() * block_k


class KeyBlockWorkProbe:
    """The dense work bound (:func:`dense_pairs_bound`) and the selected pairs of one call, measured in the forward
    and read by the backward without a host sync (:class:`HostValues`). Under an activation recompute that re-runs
    the forward inside the backward, the read waits until the GPU has reached the recomputed probe (as the grouped
    route's ``SharingProbe`` does): one drain of the queue per such call, past 8K tokens only."""

    def __init__(self, indices: torch.Tensor, valid_len: torch.Tensor, t_kv: int, block_k: int = 64):
        lo, hi = row_key_span(indices, t_kv)
        dense = dense_pairs_bound(lo, hi, t_kv, block_k)
        self.values = HostValues(torch.stack([dense, valid_len.sum(dtype=torch.int64)]))

    def dense_per_sparse(self) -> float:
        """Dense pairs over selected pairs (0.0 for a call without a selected pair: nothing to compute)."""
        dense, pairs = self.values.get()
        return dense / pairs if pairs else 0.0


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def row_key_span_kernel(IDX, LO, HI, k, t_kv, KP: tl.constexpr):
        # One program per row: the masked min and max of the row's valid keys.
        t = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, KP)
        key = tl.load(IDX + t * k + s, mask=s < k, other=-1)
        ok = (key >= 0) & (key < t_kv)
        tl.store(LO + t, tl.min(tl.where(ok, key, t_kv), axis=0))
        tl.store(HI + t, tl.max(tl.where(ok, key, -1), axis=0))

    return row_key_span_kernel
