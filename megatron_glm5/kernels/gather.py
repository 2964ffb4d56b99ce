"""The guarded ``cp.async`` gather of selected key rows into shared memory, shared by the DSA kernels (one copy of the
pitfall-P1 logic: an invalid slot, -1 or out of ``[0, t_kv)``, becomes a zero-fill ``cp.async`` with source size 0,
so nothing is read and stale shared memory never reaches an MMA).

Each factory returns a TileLang macro for the kernel that builds it (``T`` is ``tilelang.language``). Which kernel
gathers what:

* :func:`latent_gather_macro`: ``[rows, d_qk]`` latent KV rows split into a left half ``[:dh]``, a right half
  ``[dh:2 dh]`` and, with a RoPE tail (GLM-5's 64 channels; none for the NoPE GLM-5.3-Flash latent), ``[tail0:]``:
  sparse-MLA forward (producer warpgroup), backward, and the indexer loss's attention target.
* :func:`index_gather_macro`: ``[rows, Di]`` indexer key rows, plus each slot's score gradient: the indexer loss's
  score and backward kernels.

No ``from __future__ import annotations`` here: TileLang evaluates the macros' annotations.
"""


def slot_load_macro(T, *, rows: int, rows_per_pass: int):
    """``load(Idx, t, topk, lane_id, regs, blk)``: the index entries (or -1 past ``topk``) that
    :func:`latent_gather_macro` with ``prefetched=True`` copies for block ``blk``, into the thread's ``regs``
    (``T.alloc_local([rows // rows_per_pass], int32)``). Issued before the wait for a free stage, the loads' latency
    hides under the wait instead of sitting between the wait and the copies."""

    @T.macro
    def load(Idx, t, topk, lane_id, regs, blk):
        for r in T.unroll(rows // rows_per_pass):
            slot = blk * rows + r * rows_per_pass + lane_id // 8
            regs[r] = T.if_then_else(slot < topk, Idx[t, T.min(slot, topk - 1)], -1)

    return load


def latent_gather_macro(T, *, rows: int, rows_per_pass: int, dh: int, d_tail: int, tail0: int, record_index: bool,
                        commit: bool, key_bits: int = 0, halves: tuple[bool, bool] = (True, True),
                        prefetched: bool = False):
    """``gather(KV, Idx, t, t_kv, topk, lane_id, kv_l, kv_r, kt, idx_s, blk)``: 8 lanes per KV row, 16 B (8 bf16) per
    ``cp.async``, ``rows_per_pass`` rows per pass of the calling threads (``lane_id`` counts them from 0); slot
    ``blk * rows + row`` of query row ``t``. ``record_index``: lane 0 of each row writes the slot's key (or -1) into
    ``idx_s``; ``commit``: ends with one ``cp.async`` commit group (else the caller signals completion itself);
    ``key_bits`` > 0: a non-negative index entry carries other bits above its low ``key_bits`` (the grouped forward's
    member bits, ``kernels.index_groups``), which are masked off to get the key. ``halves``: which of the left and
    right halves this macro copies (a kernel whose two warpgroups each refill the half they read). ``prefetched``:
    ``Idx`` is the thread's registers filled by :func:`slot_load_macro` for this block (``t``, ``topk`` and ``blk``
    are then unused)."""
    has_tail = d_tail > 0

    @T.macro
    def gather(KV, Idx, t, t_kv, topk, lane_id, kv_l, kv_r, kt, idx_s, blk):
        lane = lane_id % 8
        for r in T.unroll(rows // rows_per_pass):
            row = r * rows_per_pass + lane_id // 8
            if prefetched:
                raw = Idx[r]
            else:
                slot = blk * rows + row
                raw = T.if_then_else(slot < topk, Idx[t, T.min(slot, topk - 1)], -1)
            idx = T.if_then_else(raw >= 0, raw & ((1 << key_bits) - 1), -1) if key_bits else raw
            valid = (idx >= 0) and (idx < t_kv)
            src = T.if_then_else(valid, idx, 0)
            if record_index:
                if lane == 0:
                    idx_s[row] = T.if_then_else(valid, raw, -1)  # with key_bits: the entry, member bits included
            for c in T.unroll(dh // 64):
                col = c * 64 + lane * 8
                if halves[0]:
                    T.ptx_cp_async(
                        T.access_ptr(kv_l[row, col], "w", 8), T.access_ptr(KV[src, col], "r", 8), 8, predicate=valid
                    )
                if halves[1]:
                    T.ptx_cp_async(
                        T.access_ptr(kv_r[row, col], "w", 8),
                        T.access_ptr(KV[src, dh + col], "r", 8),
                        8,
                        predicate=valid,
                    )
            if has_tail:
                for c in T.unroll(d_tail // 64):
                    col = c * 64 + lane * 8
                    T.ptx_cp_async(
                        T.access_ptr(kt[row, col], "w", 8),
                        T.access_ptr(KV[src, tail0 + col], "r", 8),
                        8,
                        predicate=valid,
                    )
        if commit:
            T.ptx_commit_group()

    return gather


def index_gather_macro(T, dim: int, block_s: int, threads: int, with_grad: bool):
    """``gather(KI, Idx, DS, gs, t, t_kv, topk, tx, k_s, idx_s, ds_s, blk)``: cp.async the block's key rows into
    ``k_s`` (zero-fill for invalid slots, no read), the slot's key (or -1) into ``idx_s`` and, with ``with_grad``,
    its score gradient times ``gs`` (0 on invalid slots) into ``ds_s``; commits one cp.async group."""
    lanes = dim // 8  # 16 bytes (8 bf16) per cp.async
    rows_per_pass = threads // lanes

    @T.macro
    def gather(KI, Idx, DS, gs, t, t_kv, topk, tx, k_s, idx_s, ds_s, blk):
        lane = tx % lanes
        for r in T.unroll(block_s // rows_per_pass):
            row = r * rows_per_pass + tx // lanes
            slot = blk * block_s + row
            idx = T.if_then_else(slot < topk, Idx[t, T.min(slot, topk - 1)], -1)
            valid = (idx >= 0) and (idx < t_kv)
            if lane == 0:
                idx_s[row] = T.if_then_else(valid, idx, -1)
                if with_grad:
                    ds_s[row] = T.if_then_else(valid, DS[t, T.min(slot, topk - 1)] * gs, 0)
            T.ptx_cp_async(
                T.access_ptr(k_s[row, lane * 8], "w", 8),
                T.access_ptr(KI[T.if_then_else(valid, idx, 0), lane * 8], "r", 8),
                8,
                predicate=valid,
            )
        T.ptx_commit_group()

    return gather
