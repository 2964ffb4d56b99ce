"""Sparse absorbed-MLA forward (DSA attention) in TileLang, flattened-token layout.

``out[t, h] = softmax_j(scale * q[t, h] . kv[idx[t, j]]) @ kv[idx[t, j], :d_v]`` over the valid (>= 0) slots of
``indices[t]``, plus the natural-log LSE the backward needs. Test oracle: ``megatron_glm5.dsa.reference.sparse_mla``.

Four kernels, one contract (``pick_fwd_variant`` picks ``pp`` at 64 MMA rows per CTA, ``ws`` below):

* ``pp`` (ping-pong; the default with more than 32 heads, or grouped): two math warpgroups own alternate 64-slot
  blocks and each half of ``d_v``, a producer warpgroup gathers; one warpgroup's softmax runs under the other's
  GEMMs (FlashMLA's SM90 schedule; details in ``_jit_fwd_pp``). About 1.22x ``ws`` at 16K tokens (64 heads, GLM-5
  and NoPE latents), 1.3x grouped at 16 heads.
* ``ws`` (the default below 33 heads): warp-specialised, one CTA per (token, 64-head block). A producer
  warpgroup gathers the selected KV rows with ``cp.async`` into two shared-memory stages; consumer warpgroup 0 computes ``Q K^T`` over all ``d_qk``
  channels, the online softmax and ``P V`` for the left half of ``d_v``; consumer warpgroup 1 does ``P V`` for the
  right half. Provenance: the schedule is FlashMLA's sparse prefill (SM90) as re-expressed in tile-ai/tilelang
  ``examples/deepseek_v32/sparse_mla_fwd_pipelined.py``. Differences: -1 slots never touch memory (the gather is
  guarded and the stage row zero-filled, pitfall P1; upstream masks by position and gathers anyway); a per-row
  block count skips tail padding; any head count (padded inside, loads and stores bounded, P6); a token count that
  need not divide anything; LSE is natural-log and written (upstream allocates it but never stores it);
  one-directional mbarriers between the two consumer warpgroups.
* ``sv`` (opt-in, ``variant="sv"``; 64-row tiles): the scores / values split of the same work. Warpgroup 0 masks,
  computes ``Q K^T`` and the online softmax and publishes ``P`` (over the block's RoPE-tail tile) and the rescale
  factor; warpgroups 1 and 2 rescale and add ``P V`` for their halves of ``d_v`` and then gather their halves of the
  next rows (no producer warpgroup). Bitwise equal to ``ws``; measured within about 1 % of it (the profile behind
  it and what it showed: ``scripts/bench/RESULTS_kernels.md``, round 2, third session).
* ``simple`` (opt-in, ``variant="simple"``): one pipelined loop per CTA (token, head block); synchronous guarded
  16-byte gathers (TileLang does not turn a data-dependent, predicated gather into ``cp.async``), so gather and MMA
  do not overlap and it is the slowest at long sequences (measurements: ``scripts/bench/RESULTS_kernels.md``).

Masking: a slot is valid iff ``0 <= idx < T_kv``. A row without a valid slot gives ``out = 0`` and ``lse = +inf``.
The index width ``K`` is dynamic and need not be a multiple of the block (GLM-5.3-Flash's KPool gives 2051).

Head dims: ``d_qk = d_v + d_tail``, ``d_v % 128 == 0`` and ``d_tail % 64 == 0``. GLM-5's latent is 512 + 64 RoPE
channels; the NoPE GLM-5.3-Flash has none (``d_qk = d_v = 512``): the tail buffers, loads and GEMMs are then left
out at trace time, the rest of the kernel is the same.

No ``from __future__ import annotations`` here: TileLang evaluates the ``T.Tensor`` annotations of the nested
prim_funcs, which refer to closure variables.
"""


import functools
import inspect
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Literal

import torch

from megatron_glm5.kernels._common import (
    LOG2E,
    NAMED_BARRIER_SRC,
    cdiv,
    check_tensor,
    multiprocessor_count,
    next_power_of_2,
    row_valid_len,
    tilelang_modules,
)
from megatron_glm5.kernels.gather import latent_gather_macro, slot_load_macro
from megatron_glm5.kernels.index_groups import KEY_LIMIT, MEMBER_SHIFT, RowMap, grouped_rows, grouped_tile_rows

Variant = Literal["auto", "ws", "sv", "pp", "simple"]

# The ping-pong forward's opt-in builds the interface runs (``_jit_fwd_pp``'s ``named_exchange`` and ``ctas``):
# ``MEGATRON_GLM5_PP_OPTIONS``, a comma list of ``named_exchange`` / ``persistent`` (read at each call, so a benchmark
# variant can set it), else ``PP_OPTIONS``. Empty until the sweep measures them on the GPU
# (``docs/design/kernels_round2.md``, next list, item 1).
PP_OPTIONS_ENV = "MEGATRON_GLM5_PP_OPTIONS"
PP_OPTION_NAMES = ("named_exchange", "persistent")
PP_OPTIONS: tuple[str, ...] = ()


def head_block(heads: int) -> tuple[int, int]:
    """``(block_h, n_blocks)``: heads per CTA (16, 32 or 64; the GEMM M dimension) and CTAs per token."""
    if heads <= 64:
        block = max(16, next_power_of_2(heads))
        return block, 1
    return 64, cdiv(heads, 64)


# --------------------------------------------------------------------------------------------------------------------
# TileLang factories (static shapes and tile parameters are arguments; token counts are dynamic)
# --------------------------------------------------------------------------------------------------------------------


# Registers per thread at launch of a 384-thread CTA (65536 / 384, rounded down to ptxas's 8): a warpgroup's
# ``setmaxnreg`` can only move registers within the CTA's own allocation, so a split must sum to at most 3x this
# (more and the increasing warpgroup waits forever: a GPU hang, not an error), an increase may not go below it and a
# decrease not above it (ptxas refuses the latter; the PTX ISA leaves the former undefined).
LAUNCH_REGS_384 = 65536 // 384 // 8 * 8


def check_register_split(nreg: tuple[int, ...], directions: tuple[int, ...]) -> None:
    """Refuse a ``setmaxnreg`` split (registers per warpgroup, ``directions`` 1 = increase, 0 = decrease) that a
    384-thread CTA cannot honour."""
    nreg = tuple(nreg)
    if len(nreg) != 3 or len(directions) != 3 or not all(n % 8 == 0 and 24 <= n <= 256 for n in nreg):
        raise ValueError(f"nreg must be 3 multiples of 8 in [24, 256], got {nreg}")
    if sum(nreg) > 3 * LAUNCH_REGS_384:
        raise ValueError(f"nreg must sum to <= {3 * LAUNCH_REGS_384} (the CTA's registers), got {nreg}")
    for wg, (n, inc) in enumerate(zip(nreg, directions)):
        if inc and n < LAUNCH_REGS_384:
            raise ValueError(f"nreg[{wg}] increases, so it must be >= {LAUNCH_REGS_384}, got {nreg}")
        if not inc and n > LAUNCH_REGS_384:
            raise ValueError(f"nreg[{wg}] decreases, so it must be <= {LAUNCH_REGS_384}, got {nreg}")


@dataclass(frozen=True)
class _FwdTile:
    """Trace-time constants of one warp-specialised forward build (every schedule)."""

    block_h: int  # MMA rows per CTA
    bi: int  # index slots per block
    threads: int  # the threads that load Q (the whole CTA in ws / sv, the two math warpgroups in pp)
    rows: RowMap
    has_tail: bool
    wgmma: bool  # async wgmma (64 rows) or mma.sync


def _fwd_macros(T, tile: _FwdTile, topk, t_len, scale_log2: float):
    """``(scores, online_softmax, load_q_tile, store_half, rescale_pv, mask)``: the macros the forward schedules
    share.

    * ``mask(Idx, t, t_kv, blk, acc_s)``: the block's initial scores, 0 on a valid slot and -inf elsewhere (validity
      re-read from the L1-resident index row).
    * ``scores(Idx, t, t_kv, blk, q_l, q_r, q_t, kv_l, kv_r, kt, acc_s, bar_ready, stage, parity)``: the block's
      mask (validity re-read from the L1-resident index row, so no ordering of generic shared-memory stores across
      warpgroups is needed; -1 slots get -inf), overlapping the wait for the gathered rows, then ``Q K^T`` into it.
    * ``online_softmax(acc_s, m_i, m_prev, alpha, l_i, l_blk)``: running max, rescale factor, ``P = exp2(..)`` in
      ``acc_s`` and the running row sum.
    * ``load_q_tile(...)``: 16 B vector loads of ``Q`` over ``tile.threads`` threads; padded heads (or queries past
      the last) load as zeros and are never stored (P6).
    * ``store_half(...)``: a warpgroup's half of the normalised output.
    * ``rescale_pv(p_s, v_s, alpha_s, acc_o)``: a warpgroup's half of ``O`` rescaled, then plus ``P V``.
    """
    block_h, bi, rows, f32 = tile.block_h, tile.bi, tile.rows, T.float32

    @T.macro
    def mask(Idx, t, t_kv, blk, acc_s):
        for h, j in T.Parallel(block_h, bi):
            slot = blk * bi + j
            idx = T.if_then_else(slot < topk, Idx[t, T.min(slot, topk - 1)], -1)
            if rows.group == 1:
                acc_s[h, j] = T.if_then_else((idx >= 0) and (idx < t_kv), 0, -T.infinity(f32))
            else:  # a union entry: key below the member bits, row h's query decides by its bit
                valid = (idx >= 0) and ((idx & (KEY_LIMIT - 1)) < t_kv) and rows.member(idx, h)
                acc_s[h, j] = T.if_then_else(valid, 0, -T.infinity(f32))

    @T.macro
    def scores(Idx, t, t_kv, blk, q_l, q_r, q_t, kv_l, kv_r, kt, acc_s, bar_ready, stage, parity):
        mask(Idx, t, t_kv, blk, acc_s)
        T.barrier_wait(bar_ready[stage], parity)  # the mask above overlaps the wait for the gathered rows
        T.fence_proxy_async()  # cp.async (generic proxy) data, read next by the tensor cores (async proxy)
        if tile.wgmma:
            T.wgmma_gemm(q_l, kv_l, acc_s, transpose_B=True)
            T.wgmma_gemm(q_r, kv_r, acc_s, transpose_B=True)
            if tile.has_tail:
                T.wgmma_gemm(q_t, kt, acc_s, transpose_B=True)
            T.wait_wgmma(0)
        else:
            T.gemm(q_l, kv_l, acc_s, transpose_B=True)
            T.gemm(q_r, kv_r, acc_s, transpose_B=True)
            if tile.has_tail:
                T.gemm(q_t, kt, acc_s, transpose_B=True)

    @T.macro
    def online_softmax(acc_s, m_i, m_prev, alpha, l_i, l_blk):
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for h in T.Parallel(block_h):
            alpha[h] = T.exp2((m_prev[h] - m_i[h]) * scale_log2)
        for h, j in T.Parallel(block_h, bi):
            acc_s[h, j] = T.exp2(acc_s[h, j] * scale_log2 - m_i[h] * scale_log2)
        T.reduce_sum(acc_s, l_blk, dim=1)
        for h in T.Parallel(block_h):
            l_i[h] = l_i[h] * alpha[h] + l_blk[h]

    @T.macro
    def load_q(Q, t, h0, tx, buf, col0, width):
        n_vec = block_h * (width // 8)
        for it in T.unroll(cdiv(n_vec, tile.threads)):
            ch = it * tile.threads + tx
            if ch < n_vec:
                h = ch // (width // 8)
                c = (ch % (width // 8)) * 8
                for v in T.vectorized(8):
                    buf[h, c + v] = T.if_then_else(
                        rows.live(t, h0, h, t_len),
                        Q[rows.load_query(T, t, h, t_len), rows.head(h0, h), col0 + c + v],
                        0,
                    )

    @T.macro
    def load_q_tile(Q, t, h0, tx, q_l, q_r, q_t, dh, d_v, d_tail, bar_q):
        # every thread's share of the CTA's Q (left / right halves, tail), then its arrival on bar_q
        load_q(Q, t, h0, tx, q_l, 0, dh)
        load_q(Q, t, h0, tx, q_r, dh, dh)
        if tile.has_tail:
            load_q(Q, t, h0, tx, q_t, d_v, d_tail)
        T.fence_proxy_async()
        T.barrier_arrive(bar_q)

    @T.macro
    def store_half(Out, t, h0, acc_o, l_s, col0, width):
        # one warpgroup's columns [col0, col0 + width) of O, normalised by the row sums in l_s
        for h, d in T.Parallel(block_h, width):
            if rows.live(t, h0, h, t_len):
                Out[rows.query(t, h), rows.head(h0, h), col0 + d] = T.cast(
                    T.if_then_else(l_s[h] > 0, acc_o[h, d] / l_s[h], 0), T.bfloat16
                )

    @T.macro
    def rescale_pv(p_s, v_s, alpha_s, acc_o):
        # a warpgroup's output half: rescaled by the factor the softmax published, then plus P V
        for h, d in T.Parallel(block_h, v_s.shape[1]):
            acc_o[h, d] *= alpha_s[h]
        T.gemm(p_s, v_s, acc_o)

    return scores, online_softmax, load_q_tile, store_half, rescale_pv, mask


def _alloc_q_and_stages(T, tile: _FwdTile, dh: int, d_tail: int):
    """Shared buffers every warp-specialised forward holds: ``Q``'s left / right halves and RoPE tail, and two stages
    of gathered KV rows, each ``(left, right, tail)``; the tails are None for a NoPE latent (every tail step is then
    skipped at trace time). Called inside the kernel body (allocations in trace order, as if written there)."""
    bf16 = T.bfloat16
    block_h, bi = tile.block_h, tile.bi
    q_l = T.alloc_shared([block_h, dh], bf16)
    q_r = T.alloc_shared([block_h, dh], bf16)
    q_t = T.alloc_shared([block_h, d_tail], bf16) if tile.has_tail else None
    stages = []
    for _ in range(2):
        kv_l = T.alloc_shared([bi, dh], bf16)
        kv_r = T.alloc_shared([bi, dh], bf16)
        kt = T.alloc_shared([bi, d_tail], bf16) if tile.has_tail else None
        stages.append((kv_l, kv_r, kt))
    return q_l, q_r, q_t, stages[0], stages[1]


@functools.cache
def _jit_fwd_ws():
    tilelang, T = tilelang_modules()

    @tilelang.jit(
        out_idx=[4, 5],  # non-negative: see _common.OUT_IDX_NOTE
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        },
    )
    def sparse_mla_fwd_ws(heads: int, d_qk: int, d_v: int, softmax_scale: float, block_i: int = 64, group: int = 1,
                          nreg: tuple[int, int, int] | None = None):
        """``group`` > 1: one CTA per ``group`` consecutive queries over the union of their index sets
        (``kernels.index_groups``: ``Idx`` row g = union of queries g*group.., each entry key | member bits << 24;
        ``VLen`` = union lengths), the MMA rows being (query, head) pairs: needs ``group * heads == 64``.
        ``nreg``: registers of consumer 0 / consumer 1 / producer; default (256, 168, 80) at 64 rows (consumer 0
        spills 88 instead of 144 bytes; 0.7-3 % faster, bitwise equal, ``sweep_sparse_fwd.py``), else
        (240, 168, 80)."""
        block_h, n_hblk = (grouped_tile_rows(heads, group), 1) if group > 1 else head_block(heads)
        if nreg is None:
            nreg = (256, 168, 80) if block_h >= 64 else (240, 168, 80)
        check_register_split(nreg, (1, 1, 0))  # consumers 0 and 1 increase, the producer decreases
        dh = d_v // 2
        d_tail = d_qk - d_v
        has_tail = d_tail > 0  # GLM-5: the 64 RoPE channels; none for a NoPE latent (GLM-5.3-Flash, d_qk == d_v)
        if dh % 64 or d_tail % 64 or d_tail < 0 or block_i % 16:
            raise ValueError(f"ws kernel needs d_v/2 and d_qk-d_v >= 0 multiples of 64, block_i % 16 == 0; got "
                             f"{d_v}, {d_qk}, {block_i}")
        scale_log2 = softmax_scale * LOG2E
        bi = block_i
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")  # index width: one kernel serves every K
        n_idx = t_len if group == 1 else T.dynamic("n_grp")  # index rows: one per query, or one union per group
        rows = RowMap(heads, group)
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        wgmma = block_h >= 64  # below 64 rows TileLang emits mma.sync; the async-wait form needs wgmma

        # Macros live at factory scope (TileLang does not see functions defined inside the prim_func body).
        tile = _FwdTile(block_h, bi, 384, rows, has_tail, wgmma)
        scores, online_softmax, load_q_tile, store_half, rescale_pv, _ = _fwd_macros(T, tile, topk, t_len, scale_log2)

        @T.macro
        def softmax_and_pv_left(kv_l, acc_s, acc_ol, m_i, m_prev, alpha, l_i, l_blk, alpha_s, p_s, bar_p_ready):
            online_softmax(acc_s, m_i, m_prev, alpha, l_i, l_blk)
            for h, d in T.Parallel(block_h, dh):
                acc_ol[h, d] *= alpha[h]
            T.copy(alpha, alpha_s)
            T.copy(acc_s, p_s)
            T.fence_proxy_async()  # generic smem writes of P, read next by the other warpgroup's MMA
            T.barrier_arrive(bar_p_ready)
            T.gemm(p_s, kv_l, acc_ol)

        # 8 lanes per KV row, 16 B per cp.async; an invalid slot becomes a zero-fill cp.async (source size 0,
        # nothing read), so stale or uninitialised shared memory never reaches the MMA (P1). Completion is signalled
        # by the producer with cp_async_barrier_noinc, not a commit group.
        gather = latent_gather_macro(T, rows=bi, rows_per_pass=16, dh=dh, d_tail=d_tail, tail0=d_v,
                                     record_index=False, commit=False, key_bits=MEMBER_SHIFT if group > 1 else 0)

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            Idx: T.Tensor([n_idx, topk], i32),
            VLen: T.Tensor([n_idx], i32),
            Out: T.Tensor([t_len, heads, d_v], bf16),
            Lse: T.Tensor([t_len, heads], f32),
        ):
            with T.Kernel(n_idx, n_hblk, threads=384) as (t, hb):
                q_l, q_r, q_t, (kv0_l, kv0_r, kt0), (kv1_l, kv1_r, kt1) = _alloc_q_and_stages(T, tile, dh, d_tail)
                p_s = T.alloc_shared([block_h, bi], bf16)
                alpha_s = T.alloc_shared([block_h], f32)
                l_s = T.alloc_shared([block_h], f32)

                acc_s = T.alloc_fragment([block_h, bi], f32)
                acc_ol = T.alloc_fragment([block_h, dh], f32)
                acc_or = T.alloc_fragment([block_h, dh], f32)
                m_i = T.alloc_fragment([block_h], f32)
                m_prev = T.alloc_fragment([block_h], f32)
                alpha = T.alloc_fragment([block_h], f32)
                l_i = T.alloc_fragment([block_h], f32)
                l_blk = T.alloc_fragment([block_h], f32)

                bar_q = T.alloc_barrier(384)
                bar_ready = T.alloc_barrier([128, 128])  # producer -> consumers, per stage (cp.async noinc arrivals)
                bar_free = T.alloc_barrier([256, 256])  # both consumer warpgroups -> producer, per stage
                bar_p_ready = T.alloc_barrier(128)  # warpgroup 0 -> 1: P and alpha of this block are in smem
                bar_p_free = T.alloc_barrier(128)  # warpgroup 1 -> 0: P and alpha may be overwritten
                bar_fin = T.alloc_barrier(128)  # warpgroup 0 -> 1: final row sums are in smem

                h0 = hb * block_h
                tx = T.get_thread_binding()
                n_pair = T.ceildiv(VLen[t], 2 * bi)

                load_q_tile(Q, t, h0, tx, q_l, q_r, q_t, dh, d_v, d_tail, bar_q)

                if tx < 128:
                    # Consumer 0: scores, online softmax, P V (left half of d_v).
                    T.set_max_nreg(nreg[0], 1)
                    T.fill(acc_ol, 0)
                    T.fill(l_i, 0)
                    T.fill(m_i, -(2.0**30))  # finite start: a fully masked block gives exp2(-inf) = 0, never NaN
                    T.barrier_wait(bar_q, 0)
                    for jp in T.serial(n_pair):
                        scores(Idx, t, t_kv, 2 * jp, q_l, q_r, q_t, kv0_l, kv0_r, kt0, acc_s, bar_ready, 0, jp & 1)
                        if jp > 0:
                            T.barrier_wait(bar_p_free, 1)  # completion 2*jp - 1: consumer 1 is done with P
                        softmax_and_pv_left(kv0_l, acc_s, acc_ol, m_i, m_prev, alpha, l_i, l_blk, alpha_s, p_s, bar_p_ready)
                        T.barrier_arrive(bar_free[0])

                        scores(Idx, t, t_kv, 2 * jp + 1, q_l, q_r, q_t, kv1_l, kv1_r, kt1, acc_s, bar_ready, 1, jp & 1)
                        T.barrier_wait(bar_p_free, 0)  # completion 2*jp
                        softmax_and_pv_left(kv1_l, acc_s, acc_ol, m_i, m_prev, alpha, l_i, l_blk, alpha_s, p_s, bar_p_ready)
                        T.barrier_arrive(bar_free[1])
                    T.copy(l_i, l_s)
                    T.barrier_arrive(bar_fin)
                    for h, d in T.Parallel(block_h, dh):
                        if rows.live(t, h0, h, t_len):
                            Out[rows.query(t, h), rows.head(h0, h), d] = T.cast(
                                T.if_then_else(l_i[h] > 0, acc_ol[h, d] / l_i[h], 0), bf16
                            )
                    for h in T.Parallel(block_h):
                        if rows.live(t, h0, h, t_len):
                            Lse[rows.query(t, h), rows.head(h0, h)] = T.if_then_else(
                                l_i[h] > 0, T.log(l_i[h]) + m_i[h] * softmax_scale, T.infinity(f32)
                            )
                elif tx < 256:
                    # Consumer 1: P V (right half of d_v), rescaled by the alpha consumer 0 published.
                    T.set_max_nreg(nreg[1], 1)
                    T.fill(acc_or, 0)
                    for jp in T.serial(n_pair):
                        T.barrier_wait(bar_p_ready, 0)  # completion 2*jp
                        T.fence_proxy_async()
                        rescale_pv(p_s, kv0_r, alpha_s, acc_or)
                        T.barrier_arrive(bar_p_free)
                        T.barrier_arrive(bar_free[0])
                        T.barrier_wait(bar_p_ready, 1)  # completion 2*jp + 1
                        T.fence_proxy_async()
                        rescale_pv(p_s, kv1_r, alpha_s, acc_or)
                        T.barrier_arrive(bar_p_free)
                        T.barrier_arrive(bar_free[1])
                    T.barrier_wait(bar_fin, 0)
                    store_half(Out, t, h0, acc_or, l_s, dh, dh)
                else:
                    # Producer: guarded cp.async gather of the selected KV rows, two stages deep.
                    T.set_max_nreg(nreg[2], 0)
                    for jp in T.serial(n_pair):
                        T.barrier_wait(bar_free[0], (jp & 1) ^ 1)
                        gather(KV, Idx, t, t_kv, topk, tx - 256, kv0_l, kv0_r, kt0, None, 2 * jp)
                        T.cp_async_barrier_noinc(bar_ready[0])
                        T.barrier_wait(bar_free[1], (jp & 1) ^ 1)
                        gather(KV, Idx, t, t_kv, topk, tx - 256, kv1_l, kv1_r, kt1, None, 2 * jp + 1)
                        T.cp_async_barrier_noinc(bar_ready[1])

        return main

    return sparse_mla_fwd_ws


def _split_dims(name: str, heads: int, d_qk: int, d_v: int, group: int) -> tuple[int, int, int, bool, bool]:
    """``(n_hblk, dh, d_tail, has_tail, p_in_tail)`` of a 64-row schedule that splits ``d_v`` between two warpgroups
    (``sv``, ``pp``), after checking it applies: 64 MMA rows per CTA, ``d_v / 2`` and the tail multiples of 64.
    ``p_in_tail``: a [64 heads, 64 slots] ``P`` tile fits a stage's RoPE-tail tile [64 slots, 64 channels] exactly."""
    block_h, n_hblk = (grouped_tile_rows(heads, group), 1) if group > 1 else head_block(heads)
    if block_h != 64:
        raise ValueError(f"the {name} forward needs 64 MMA rows (heads > 32 or grouped), got {heads} heads")
    dh, d_tail = d_v // 2, d_qk - d_v
    if dh % 64 or d_tail % 64 or d_tail < 0:
        raise ValueError(f"{name} kernel needs d_v/2 and d_qk-d_v >= 0 multiples of 64; got {d_v}, {d_qk}")
    return n_hblk, dh, d_tail, d_tail > 0, d_tail == 64


@functools.cache
def _jit_fwd_sv():
    tilelang, T = tilelang_modules()

    @tilelang.jit(
        out_idx=[4, 5],  # non-negative: see _common.OUT_IDX_NOTE
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        },
    )
    def sparse_mla_fwd_sv(heads: int, d_qk: int, d_v: int, softmax_scale: float, group: int = 1,
                           nreg: tuple[int, int, int] = (144, 176, 176)):
        """Scores / values split, 384 threads, no producer warpgroup: WG0 masks, computes ``Q K^T`` and the online
        softmax and publishes ``P`` and the rescale factor per block; WG1 / WG2 each rescale their half of the output
        accumulator, add ``P V`` for their half of ``d_v``, then gather their half of the stage's next rows (WG2 also
        the RoPE tail). Why (ncu, 64 heads, 16K): in ``ws`` consumer warpgroup 0 issued the whole serial chain (mask,
        scores, softmax, rescale and half the ``P V``) while consumer 1 and the producer spent 62-82 % of their own
        samples in mbarrier waits. Measured: WG0's instructions fall by a third, the time within a few per cent of
        ``ws`` (``scripts/bench/RESULTS_kernels.md``): the mask -> scores -> softmax chain of one block in one
        warpgroup remains. (Four warpgroups with a producer do not compile: 512 threads leave 128 registers per
        thread, and a [64, 256] fp32 accumulator's wgmma needs about 154.)

        ``P`` of a block is written over the block's RoPE-tail tile once its scores are done (the same [64, 64] bf16
        tile; a NoPE latent gets two tiles of its own), so shared memory stays at ``ws``'s. Which warpgroup may
        overwrite what: WG1 refills a stage's left halves after its own ``P V`` on them, WG2 the right halves and,
        after ``bar_p_free`` (WG1 done reading ``P``), the tail; WG0 rewrites a stage's ``P`` and rescale factor only
        after the stage's next ``bar_ready`` phase, whose arrivals are WG1 / WG2's refill ``cp.async``, issued after
        their ``P V`` (``wgmma`` waited) and rescale reads retired. 64 MMA rows only (64 heads per CTA, or
        ``group * heads == 64``); ``nreg``: registers of WG0 / WG1 / WG2 (:func:`check_register_split`); 144 is the
        split the GPU tests ran (152 / 176 / 176 measured 1 % faster once, at 64 heads only).
        """
        n_hblk, dh, d_tail, has_tail, p_in_tail = _split_dims("sv", heads, d_qk, d_v, group)
        block_h = 64
        check_register_split(nreg, (0, 1, 1))  # WG0 decreases, WG1 and WG2 increase
        scale_log2 = softmax_scale * LOG2E
        bi = 64
        threads = 384
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")
        n_idx = t_len if group == 1 else T.dynamic("n_grp")
        rows = RowMap(heads, group)
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32

        tile = _FwdTile(block_h, bi, threads, rows, has_tail, True)
        scores, online_softmax, load_q_tile, store_half, rescale_pv, _ = _fwd_macros(T, tile, topk, t_len, scale_log2)

        @T.macro
        def softmax_publish(acc_s, m_i, m_prev, alpha, l_i, l_blk, alpha_s, p_s, bar_p_ready, stage):
            online_softmax(acc_s, m_i, m_prev, alpha, l_i, l_blk)
            T.copy(alpha, alpha_s)
            T.copy(acc_s, p_s)  # over the tail rows this block's scores no longer read (wait_wgmma above)
            T.fence_proxy_async()  # generic smem writes, read next by the other warpgroups' MMAs
            T.barrier_arrive(bar_p_ready[stage])

        @T.macro
        def pv_half(p_s, v_s, alpha_s, acc_o, bar_p_ready, stage, parity):
            T.barrier_wait(bar_p_ready[stage], parity)
            T.fence_proxy_async()
            rescale_pv(p_s, v_s, alpha_s, acc_o)

        # WG1 gathers the left halves of a block's rows, WG2 the right halves and the tail (8 lanes per row, 16 rows
        # per pass of 128 threads); -1 slots are zero-filled without a read (P1), completion is signalled by
        # cp_async_barrier_noinc on the stage's ready barrier (256 arrivals).
        gather_l = latent_gather_macro(T, rows=bi, rows_per_pass=16, dh=dh, d_tail=0, tail0=d_v, record_index=False,
                                       commit=False, key_bits=MEMBER_SHIFT if group > 1 else 0, halves=(True, False))
        gather_r = latent_gather_macro(T, rows=bi, rows_per_pass=16, dh=dh, d_tail=d_tail, tail0=d_v,
                                       record_index=False, commit=False, key_bits=MEMBER_SHIFT if group > 1 else 0,
                                       halves=(False, True))

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            Idx: T.Tensor([n_idx, topk], i32),
            VLen: T.Tensor([n_idx], i32),
            Out: T.Tensor([t_len, heads, d_v], bf16),
            Lse: T.Tensor([t_len, heads], f32),
        ):
            with T.Kernel(n_idx, n_hblk, threads=threads) as (t, hb):
                q_l, q_r, q_t, (kv0_l, kv0_r, kt0), (kv1_l, kv1_r, kt1) = _alloc_q_and_stages(T, tile, dh, d_tail)
                p0_s = kt0 if p_in_tail else T.alloc_shared([block_h, bi], bf16)
                p1_s = kt1 if p_in_tail else T.alloc_shared([block_h, bi], bf16)
                alpha0_s = T.alloc_shared([block_h], f32)
                alpha1_s = T.alloc_shared([block_h], f32)
                l_s = T.alloc_shared([block_h], f32)

                acc_s = T.alloc_fragment([block_h, bi], f32)
                acc_ol = T.alloc_fragment([block_h, dh], f32)
                acc_or = T.alloc_fragment([block_h, dh], f32)
                m_i = T.alloc_fragment([block_h], f32)
                m_prev = T.alloc_fragment([block_h], f32)
                alpha = T.alloc_fragment([block_h], f32)
                l_i = T.alloc_fragment([block_h], f32)
                l_blk = T.alloc_fragment([block_h], f32)

                bar_q = T.alloc_barrier(threads)
                bar_ready = T.alloc_barrier([256, 256])  # WG1 + WG2 gathers -> WG0 (cp.async noinc arrivals)
                bar_p_ready = T.alloc_barrier([128, 128])  # WG0 -> WG1, WG2: P and alpha of the stage's block
                bar_p_free = T.alloc_barrier([128, 128])  # WG1 -> WG2: done reading P, the tail may be refilled
                bar_fin = T.alloc_barrier(128)  # WG0 -> WG1, WG2: the final row sums are in smem

                h0 = hb * block_h
                tx = T.get_thread_binding()
                n_pair = T.ceildiv(VLen[t], 2 * bi)

                load_q_tile(Q, t, h0, tx, q_l, q_r, q_t, dh, d_v, d_tail, bar_q)

                if tx < 128:
                    # WG0: mask, scores, online softmax; P over the stage's tail rows, alpha to smem.
                    T.set_max_nreg(nreg[0], 0)
                    T.fill(l_i, 0)
                    T.fill(m_i, -(2.0**30))  # finite start: a fully masked block gives exp2(-inf) = 0, never NaN
                    T.barrier_wait(bar_q, 0)
                    for jp in T.serial(n_pair):
                        scores(Idx, t, t_kv, 2 * jp, q_l, q_r, q_t, kv0_l, kv0_r, kt0, acc_s, bar_ready, 0, jp & 1)
                        softmax_publish(acc_s, m_i, m_prev, alpha, l_i, l_blk, alpha0_s, p0_s, bar_p_ready, 0)
                        scores(Idx, t, t_kv, 2 * jp + 1, q_l, q_r, q_t, kv1_l, kv1_r, kt1, acc_s, bar_ready, 1, jp & 1)
                        softmax_publish(acc_s, m_i, m_prev, alpha, l_i, l_blk, alpha1_s, p1_s, bar_p_ready, 1)
                    T.copy(l_i, l_s)
                    T.barrier_arrive(bar_fin)
                    for h in T.Parallel(block_h):
                        if rows.live(t, h0, h, t_len):
                            Lse[rows.query(t, h), rows.head(h0, h)] = T.if_then_else(
                                l_i[h] > 0, T.log(l_i[h]) + m_i[h] * softmax_scale, T.infinity(f32)
                            )
                elif tx < 256:
                    # WG1: left half of d_v; then refills the stage's left halves with the block two ahead.
                    T.set_max_nreg(nreg[1], 1)
                    T.fill(acc_ol, 0)
                    if n_pair > 0:
                        gather_l(KV, Idx, t, t_kv, topk, tx - 128, kv0_l, kv0_l, kt0, None, 0)
                        T.cp_async_barrier_noinc(bar_ready[0])
                        gather_l(KV, Idx, t, t_kv, topk, tx - 128, kv1_l, kv1_l, kt1, None, 1)
                        T.cp_async_barrier_noinc(bar_ready[1])
                    for jp in T.serial(n_pair):
                        pv_half(p0_s, kv0_l, alpha0_s, acc_ol, bar_p_ready, 0, jp & 1)
                        if p_in_tail:  # only a P tile that is also the tail is refilled by WG2
                            T.barrier_arrive(bar_p_free[0])
                        if jp + 1 < n_pair:
                            gather_l(KV, Idx, t, t_kv, topk, tx - 128, kv0_l, kv0_l, kt0, None, 2 * jp + 2)
                            T.cp_async_barrier_noinc(bar_ready[0])
                        pv_half(p1_s, kv1_l, alpha1_s, acc_ol, bar_p_ready, 1, jp & 1)
                        if p_in_tail:
                            T.barrier_arrive(bar_p_free[1])
                        if jp + 1 < n_pair:
                            gather_l(KV, Idx, t, t_kv, topk, tx - 128, kv1_l, kv1_l, kt1, None, 2 * jp + 3)
                            T.cp_async_barrier_noinc(bar_ready[1])
                    T.barrier_wait(bar_fin, 0)
                    store_half(Out, t, h0, acc_ol, l_s, 0, dh)
                else:
                    # WG2: right half of d_v; then refills the right halves and, once WG1 is done with P, the tail.
                    T.set_max_nreg(nreg[2], 1)
                    T.fill(acc_or, 0)
                    if n_pair > 0:
                        gather_r(KV, Idx, t, t_kv, topk, tx - 256, kv0_r, kv0_r, kt0, None, 0)
                        T.cp_async_barrier_noinc(bar_ready[0])
                        gather_r(KV, Idx, t, t_kv, topk, tx - 256, kv1_r, kv1_r, kt1, None, 1)
                        T.cp_async_barrier_noinc(bar_ready[1])
                    for jp in T.serial(n_pair):
                        pv_half(p0_s, kv0_r, alpha0_s, acc_or, bar_p_ready, 0, jp & 1)
                        if jp + 1 < n_pair:
                            if p_in_tail:
                                T.barrier_wait(bar_p_free[0], jp & 1)
                            gather_r(KV, Idx, t, t_kv, topk, tx - 256, kv0_r, kv0_r, kt0, None, 2 * jp + 2)
                            T.cp_async_barrier_noinc(bar_ready[0])
                        pv_half(p1_s, kv1_r, alpha1_s, acc_or, bar_p_ready, 1, jp & 1)
                        if jp + 1 < n_pair:
                            if p_in_tail:
                                T.barrier_wait(bar_p_free[1], jp & 1)
                            gather_r(KV, Idx, t, t_kv, topk, tx - 256, kv1_r, kv1_r, kt1, None, 2 * jp + 3)
                            T.cp_async_barrier_noinc(bar_ready[1])
                    T.barrier_wait(bar_fin, 0)
                    store_half(Out, t, h0, acc_or, l_s, dh, dh)

        return main

    return sparse_mla_fwd_sv


@functools.cache
def _jit_fwd_pp():
    tilelang, T = tilelang_modules()

    def sparse_mla_fwd_pp(heads: int, d_qk: int, d_v: int, softmax_scale: float, group: int = 1,
                          nreg: tuple[int, int, int] = (216, 216, 72), smem_mask: bool = True,
                          p1_copy_first: bool = True, slot_prefetch: bool = True, storage_sync: bool = False,
                          named_exchange: bool = False, ctas: int = 0):
        """Ping-pong: two math warpgroups own alternate 64-slot blocks (WG0 the even ones in stage 0, WG1 the odd ones
        in stage 1) and each keeps half of ``d_v``; a producer warpgroup gathers. Per pair of blocks each math
        warpgroup computes ``Q K^T`` of its own block over all ``d_qk`` channels, and ``P V`` for its half of ``d_v``
        over both blocks: its own ``P`` from registers (``wgmma`` with A in registers), the other's from shared
        memory. Why: in ``ws`` and ``sv`` one warpgroup ran every block's mask -> ``Q K^T`` -> softmax chain, so the
        tensor cores idled during each softmax; here one warpgroup's softmax runs under the other's GEMMs, and the
        tensor work per pair is split evenly (FlashMLA's SM90 sparse prefill schedule, re-expressed).

        Row maxima per pair: WG0 publishes ``max(m, rowmax S0)`` (``sm0``), WG1 folds in ``rowmax S1`` and publishes
        the pair's final max (``sm1``); WG1's ``P`` is final at once, WG0 rescales its accumulator, row sum and the
        ``P`` it hands to WG1 by ``exp2(m0 - m)`` afterwards. Each warpgroup keeps the row sum of its own blocks;
        the two are added at the end. Each stage's halves have their own ready / free barriers, so the producer
        refills a half as soon as its last reader is done: left halves are read by WG0's ``P V``, right halves and
        the RoPE tail by WG1's (the tail also by the stage owner's ``Q K^T``, which precedes). ``P`` of WG0's block
        goes over stage 0's tail tile once its scores are done (a NoPE latent gets a tile of its own); WG1's ``P``
        has a tile of its own: stage 1's right half is freed by WG1 before WG0 is done reading it. WG1 loads its
        block right half first (the producer's order: stage 0 left, stage 1 right, stage 0 right, stage 1 left).

        Not bitwise equal to ``ws``: WG0's ``P`` is rounded to bf16 before the pair's final max is known. 64 MMA rows
        only (heads > 32 per CTA, or ``group * heads == 64``); ``nreg``: registers of WG0 / WG1 / producer
        (:func:`check_register_split`). The math warpgroups alone load ``Q``, so the producer starts gathering at
        once (measured at parity with all 384 threads loading ``Q`` first, as ``ws`` does: 9.52 vs 9.54 ms).

        ``smem_mask`` (default): the producer records each slot's entry (or -1) in shared memory while it gathers the
        block's first half and signals it on a barrier of its own (plain arrivals: ``cp.async`` completion does not
        order its generic stores), and the math warpgroups build their masks from there instead of 32 index loads
        per thread per block (FlashMLA's producer publishes validity the same way). The stage's index row is
        rewritten only after that stage half's ``free``, which its masking warpgroup arrives after its mask.
        ``p1_copy_first`` (default): WG1 stores its ``P`` to shared memory and signals WG0 before its own ``P V``
        wgmma reads those registers (FlashMLA's order copies while that wgmma is in flight, which the PTX ISA leaves
        undefined). Both are bitwise equal to the kernel without them; together 1.09x at 64 heads, 1.14-1.16x grouped
        at 16 heads (16K tokens, H200: ``scripts/bench/RESULTS_kernels.md``, fifth session).

        ``slot_prefetch`` (default): the producer loads both blocks' index entries into registers at the top of each
        pair, before it waits for a free stage; without it each gather loaded its entries after the wait, and the
        first gather of each stage (which records the entries for ``smem_mask``) waited for each of its four rows'
        entries in turn. ``storage_sync=False`` (default): built without TileLang's thread-storage syncs (the
        mbarriers order every shared-memory handover, as the ``smem_mask`` / ``p1_copy_first`` notes say); they put a
        warpgroup barrier between each recorded entry and its copies, and four into each math warpgroup's pair.
        Both leave the results bitwise unchanged; together 1.01-1.03x at 64 heads and grouped at 16 heads (16K
        tokens, H200: ``scripts/bench/RESULTS_kernels.md``, twelfth session, where an output staged through shared
        memory for 16-byte stores measured no faster and was left out).

        ``named_exchange`` (opt-in, not yet measured): the four per-pair handovers between the math warpgroups (the
        row maxima ``sm0`` / ``sm1`` and ``P`` of each block) go through named hardware barriers (``bar.arrive`` on
        the publishing side, ``bar.sync`` on the waiting one, ids 8-11 over 256 threads) instead of mbarriers, as
        FlashMLA's schedule has them: no try-wait loop. Each handover happens once per pair in strict alternation (a
        side publishes the next pair's value only after waiting for the other side's handover that follows the
        read), so a named barrier never sees one side arrive twice; needs ``storage_sync=False`` (TileLang's
        inserted syncs take ids from 3 up, its cross-warp reductions 1 and 2: ids 8-11 stay clear of both).
        Results are the same bitwise.

        ``ctas`` (opt-in, not yet measured; 0: one CTA per query and head block): a persistent grid of ``ctas`` CTAs
        (the SM count: one CTA fits an SM), CTA ``b`` serving the (query, head block) items ``b, b + ctas, ...`` in
        the one-query grid's order. Each warpgroup runs the same per-query code; every per-pair barrier's parity
        continues from the pairs of the CTA's earlier items, and ``Q``'s and the row sums' barriers change phase once
        per item. ``Q`` of the next item is loaded after the row-sum exchange (by when both math warpgroups' GEMMs of
        the item are done) and this item's store: loaded before the store, to hide its latency, it spilled 108-132
        bytes per thread (ptxas; register loads of ``Q`` with ``O`` still live), so that needs ``Q`` by ``cp.async``
        (not built). What it should buy: the producer gathers the next item's first blocks while the
        math warpgroups finish this item's last ``P V`` and store it, and no CTA launch and prologue per query
        (about 4-5 % of a CTA's time at 16K tokens, by arithmetic). Results are the same bitwise (the same per-query
        schedule); the default build's generated source is byte-identical to the kernel before this option.
        """
        from tvm.script.ir_builder import IRBuilder

        n_hblk, dh, d_tail, has_tail, p_in_tail = _split_dims("pp", heads, d_qk, d_v, group)
        if named_exchange and storage_sync:
            raise ValueError("named_exchange needs storage_sync=False: TileLang's syncs would share barrier ids")
        block_h = 64
        check_register_split(nreg, (1, 1, 0))
        scale_log2 = softmax_scale * LOG2E
        bi = 64
        threads = 384
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")
        n_idx = t_len if group == 1 else T.dynamic("n_grp")
        rows = RowMap(heads, group)
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        key_bits = MEMBER_SHIFT if group > 1 else 0

        tile = _FwdTile(block_h, bi, 256, rows, has_tail, True)  # Q is loaded by the math warpgroups' 256 threads
        _, _, load_q_tile, store_half, _, mask = _fwd_macros(T, tile, topk, t_len, scale_log2)

        @T.macro
        def qk_left(q_l, kv_l, acc_s, bar_ready, half, parity):
            T.barrier_wait(bar_ready[half], parity)
            T.fence_proxy_async()  # cp.async (generic proxy) data, read next by the tensor cores (async proxy)
            T.wgmma_gemm(q_l, kv_l, acc_s, transpose_B=True)

        @T.macro
        def qk_right(q_r, q_t, kv_r, kt, acc_s, bar_ready, half, parity):
            T.barrier_wait(bar_ready[half], parity)
            T.fence_proxy_async()
            T.wgmma_gemm(q_r, kv_r, acc_s, transpose_B=True)
            if has_tail:
                T.wgmma_gemm(q_t, kt, acc_s, transpose_B=True)

        @T.macro
        def exp_scores(acc_s, m_new, l_i, alpha, l_blk, acc_o, p_r):
            # P = exp2(scale * (S - m_new)) in acc_s, its bf16 copy in p_r; the accumulator and row sum rescaled
            for h, j in T.Parallel(block_h, bi):
                acc_s[h, j] = T.exp2(acc_s[h, j] * scale_log2 - m_new[h] * scale_log2)
            T.reduce_sum(acc_s, l_blk, dim=1)
            for h in T.Parallel(block_h):
                l_i[h] = l_i[h] * alpha[h] + l_blk[h]
            for h, d in T.Parallel(block_h, dh):
                acc_o[h, d] *= alpha[h]
            T.copy(acc_s, p_r)

        # Each gather call copies one half of a block's rows (the right one with the RoPE tail): 8 lanes per row,
        # 16 rows per pass of the producer's 128 threads, -1 slots zero-filled without a read (P1), completion
        # signalled by cp_async_barrier_noinc on the half's ready barrier (128 arrivals).
        def half_gather(left: bool, record: bool):
            return latent_gather_macro(T, rows=bi, rows_per_pass=16, dh=dh, d_tail=0 if left else d_tail, tail0=d_v,
                                       record_index=record, commit=False, key_bits=key_bits,
                                       halves=(left, not left), prefetched=slot_prefetch)

        load_slots = slot_load_macro(T, rows=bi, rows_per_pass=16)

        gather_l, gather_r = half_gather(True, False), half_gather(False, False)
        # the first half gathered of each stage's block (stage 0: left, stage 1: right); with smem_mask it also
        # records the slots' entries (its index buffer is None otherwise)
        first_gather = (half_gather(True, smem_mask), half_gather(False, smem_mask))

        exchange_ids = {"m0": 8, "m1": 9, "p0": 10, "p1": 11}  # named_exchange: the barrier id of each handover

        @T.macro
        def hand_over(bar, name):
            # the publishing side of a handover between the math warpgroups
            if named_exchange:
                T.call_extern("handle", "glm5_bar_arrive", exchange_ids[name], 256)
            else:
                T.barrier_arrive(bar)

        @T.macro
        def take_over(bar, name, parity):
            # the waiting side: the other warpgroup's value is in shared memory
            if named_exchange:
                T.call_extern("handle", "glm5_bar_sync", exchange_ids[name], 256)
            else:
                T.barrier_wait(bar, parity)

        @T.macro
        def publish_p1(p1_r, p1_s, bar_p1):
            # WG1's P (bf16 registers) to shared memory for WG0's MMA, then WG0 told
            T.copy(p1_r, p1_s)
            T.fence_proxy_async()  # generic smem writes, read next by the tensor cores (async proxy)
            hand_over(bar_p1, "p1")

        @T.macro
        def block_mask(Idx, t, t_kv, blk, idx_s, bar_mask, stage, parity, acc_s):
            # the block's initial scores: from the index row in L1, or (smem_mask) from the entries the producer
            # recorded for this stage (-1: invalid slot)
            if smem_mask:
                T.barrier_wait(bar_mask[stage], parity)
                for h, j in T.Parallel(block_h, bi):
                    e = idx_s[j]
                    if rows.group == 1:
                        acc_s[h, j] = T.if_then_else(e >= 0, 0, -T.infinity(f32))
                    else:
                        acc_s[h, j] = T.if_then_else((e >= 0) and rows.member(e, h), 0, -T.infinity(f32))
            else:
                mask(Idx, t, t_kv, blk, acc_s)

        def alloc():
            """Every buffer, fragment and barrier of the kernel, allocated (inside its body) and named in the order
            the one-query kernel's body did, so its generated source is unchanged."""
            buffers = {}

            def put(name, buf):
                if buf is not None:
                    IRBuilder.name(name, buf)  # what TVMScript does for an assignment in the kernel body
                buffers[name] = buf

            q_l, q_r, q_t, (kv0_l, kv0_r, kt0), (kv1_l, kv1_r, kt1) = _alloc_q_and_stages(T, tile, dh, d_tail)
            for name, buf in (("q_l", q_l), ("q_r", q_r), ("q_t", q_t), ("kv0_l", kv0_l), ("kv0_r", kv0_r),
                              ("kt0", kt0), ("kv1_l", kv1_l), ("kv1_r", kv1_r), ("kt1", kt1)):
                put(name, buf)
            put("p0_s", kt0 if p_in_tail else T.alloc_shared([block_h, bi], bf16))  # P0 over stage 0's tail
            put("p1_s", T.alloc_shared([block_h, bi], bf16))
            put("sm0", T.alloc_shared([block_h], f32))  # WG0 -> WG1: max(m, rowmax S0)
            put("sm1", T.alloc_shared([block_h], f32))  # WG1 -> WG0: the pair's final max
            put("sl0", T.alloc_shared([block_h], f32))  # final row sums of each warpgroup's blocks
            put("sl1", T.alloc_shared([block_h], f32))
            put("idx0_s", T.alloc_shared([bi], i32) if smem_mask else None)  # stage 0's slot entries (smem_mask)
            put("idx1_s", T.alloc_shared([bi], i32) if smem_mask else None)
            for name in ("s0", "s1"):
                put(name, T.alloc_fragment([block_h, bi], f32))
            for name in ("p0_r", "p1_r"):
                put(name, T.alloc_fragment([block_h, bi], bf16))
            for name in ("o0", "o1"):
                put(name, T.alloc_fragment([block_h, dh], f32))
            for name in ("m0", "m0_new", "alpha0", "l0", "l0_blk", "m1", "m1_new", "alpha1", "l1", "l1_blk"):
                put(name, T.alloc_fragment([block_h], f32))
            put("bar_q", T.alloc_barrier(256))
            # producer -> consumers: stage 0 left / right, stage 1 left / right (cp.async noinc arrivals)
            put("bar_ready", T.alloc_barrier([128, 128, 128, 128]))
            # consumers -> producer, same order: left halves by WG0's P V, right halves (and tails) by WG1's
            put("bar_free", T.alloc_barrier([128, 128, 128, 128]))
            put("bar_m0", T.alloc_barrier(128))
            put("bar_m1", T.alloc_barrier(128))
            put("bar_p0", T.alloc_barrier(128))  # WG0 -> WG1: P of the even block (rescaled) in p0_s
            put("bar_p1", T.alloc_barrier(128))  # WG1 -> WG0: P of the odd block in p1_s
            put("bar_l", T.alloc_barrier([128, 128]))  # each warpgroup's final row sums are in smem
            # producer -> WG0 / WG1: idx0_s / idx1_s (smem_mask)
            put("bar_mask", T.alloc_barrier([128, 128]) if smem_mask else None)
            # the producer's index entries of the pair's two blocks (slot_prefetch)
            put("slots0", T.alloc_local([bi // 16], i32) if slot_prefetch else None)
            put("slots1", T.alloc_local([bi // 16], i32) if slot_prefetch else None)
            return SimpleNamespace(**buffers)

        def pair(base, jp):
            # a pair's running number, whose low bit is each per-pair barrier's parity: ``jp`` in a CTA of one query
            # (``base`` None), ``base + jp`` in a persistent CTA (``base``: the pairs of the queries it did before)
            return jp if base is None else base + jp

        @T.macro
        def wg0_query(S, Q, Idx, Out, t, t_kv, h0, tx, n_pair, base, q_parity):
            # WG0: even blocks' scores (stage 0), left half of d_v over both blocks.
            load_q_tile(Q, t, h0, tx, S.q_l, S.q_r, S.q_t, dh, d_v, d_tail, S.bar_q)
            T.fill(S.o0, 0)
            T.fill(S.l0, 0)
            T.fill(S.m0, -(2.0**30))  # finite start: a fully masked block gives exp2(-inf) = 0, never NaN
            T.barrier_wait(S.bar_q, q_parity)
            if n_pair > 0:
                block_mask(Idx, t, t_kv, 0, S.idx0_s, S.bar_mask, 0, pair(base, 0) & 1, S.s0)
                qk_left(S.q_l, S.kv0_l, S.s0, S.bar_ready, 0, pair(base, 0) & 1)
                qk_right(S.q_r, S.q_t, S.kv0_r, S.kt0, S.s0, S.bar_ready, 1, pair(base, 0) & 1)
                T.wait_wgmma(0)
            for jp in T.serial(n_pair):
                T.copy(S.m0, S.m0_new)
                T.reduce_max(S.s0, S.m0_new, dim=1, clear=False)
                T.copy(S.m0_new, S.sm0)
                hand_over(S.bar_m0, "m0")
                for h in T.Parallel(block_h):
                    S.alpha0[h] = T.exp2((S.m0[h] - S.m0_new[h]) * scale_log2)
                exp_scores(S.s0, S.m0_new, S.l0, S.alpha0, S.l0_blk, S.o0, S.p0_r)
                T.wgmma_gemm(S.p0_r, S.kv0_l, S.o0)  # own P from registers
                # the pair's final max from WG1: rescale what was computed against m0_new
                take_over(S.bar_m1, "m1", pair(base, jp) & 1)
                for h in T.Parallel(block_h):
                    S.m0[h] = S.sm1[h]
                    S.alpha0[h] = T.exp2((S.m0_new[h] - S.m0[h]) * scale_log2)
                T.wait_wgmma(0)
                T.barrier_arrive(S.bar_free[0])  # stage 0 left half: read
                for h, j in T.Parallel(block_h, bi):
                    S.p0_s[h, j] = T.cast(S.s0[h, j] * S.alpha0[h], bf16)
                T.fence_proxy_async()  # generic smem writes of P, read next by WG1's MMA
                hand_over(S.bar_p0, "p0")
                for h in T.Parallel(block_h):
                    S.l0[h] *= S.alpha0[h]
                for h, d in T.Parallel(block_h, dh):
                    S.o0[h, d] *= S.alpha0[h]
                take_over(S.bar_p1, "p1", pair(base, jp) & 1)
                T.fence_proxy_async()
                T.wgmma_gemm(S.p1_s, S.kv1_l, S.o0)  # WG1's P from smem
                if jp + 1 < n_pair:  # the next even block's scores, issued under this P V
                    block_mask(Idx, t, t_kv, 2 * jp + 2, S.idx0_s, S.bar_mask, 0, (pair(base, jp) + 1) & 1, S.s0)
                    qk_left(S.q_l, S.kv0_l, S.s0, S.bar_ready, 0, (pair(base, jp) + 1) & 1)
                    T.wait_wgmma(1)
                    T.barrier_arrive(S.bar_free[2])  # stage 1 left half: read
                    qk_right(S.q_r, S.q_t, S.kv0_r, S.kt0, S.s0, S.bar_ready, 1, (pair(base, jp) + 1) & 1)
                    T.wait_wgmma(0)
                else:
                    T.wait_wgmma(0)
                    T.barrier_arrive(S.bar_free[2])
            T.copy(S.l0, S.sl0)
            T.barrier_arrive(S.bar_l[0])
            T.barrier_wait(S.bar_l[1], q_parity)
            for h in T.Parallel(block_h):
                S.l0[h] += S.sl1[h]
            store_half(Out, t, h0, S.o0, S.l0, 0, dh)

        @T.macro
        def wg1_query(S, Q, Idx, Out, Lse, t, t_kv, h0, tx, n_pair, base, q_parity):
            # WG1: odd blocks' scores (stage 1), right half of d_v over both blocks; writes the LSE.
            load_q_tile(Q, t, h0, tx, S.q_l, S.q_r, S.q_t, dh, d_v, d_tail, S.bar_q)
            T.fill(S.o1, 0)
            T.fill(S.l1, 0)
            T.fill(S.m1, -(2.0**30))
            T.barrier_wait(S.bar_q, q_parity)
            for jp in T.serial(n_pair):
                block_mask(Idx, t, t_kv, 2 * jp + 1, S.idx1_s, S.bar_mask, 1, pair(base, jp) & 1, S.s1)
                qk_right(S.q_r, S.q_t, S.kv1_r, S.kt1, S.s1, S.bar_ready, 3, pair(base, jp) & 1)
                qk_left(S.q_l, S.kv1_l, S.s1, S.bar_ready, 2, pair(base, jp) & 1)
                T.wait_wgmma(0)
                take_over(S.bar_m0, "m0", pair(base, jp) & 1)
                for h in T.Parallel(block_h):
                    S.m1_new[h] = S.sm0[h]
                T.reduce_max(S.s1, S.m1_new, dim=1, clear=False)
                T.copy(S.m1_new, S.sm1)
                hand_over(S.bar_m1, "m1")
                for h in T.Parallel(block_h):
                    S.alpha1[h] = T.exp2((S.m1[h] - S.m1_new[h]) * scale_log2)
                T.copy(S.m1_new, S.m1)
                exp_scores(S.s1, S.m1, S.l1, S.alpha1, S.l1_blk, S.o1, S.p1_r)
                if p1_copy_first:  # P1 to smem (and WG0 told) before the GEMM reads its registers
                    publish_p1(S.p1_r, S.p1_s, S.bar_p1)
                T.wgmma_gemm(S.p1_r, S.kv1_r, S.o1)  # own P from registers
                if not p1_copy_first:
                    # P1's registers are read (stmatrix) while that wgmma reads them too: FlashMLA's order;
                    # the PTX ISA calls touching wgmma A registers before its wait undefined
                    publish_p1(S.p1_r, S.p1_s, S.bar_p1)
                take_over(S.bar_p0, "p0", pair(base, jp) & 1)
                T.fence_proxy_async()
                T.wgmma_gemm(S.p0_s, S.kv0_r, S.o1)  # WG0's P from smem
                T.wait_wgmma(1)
                T.barrier_arrive(S.bar_free[3])  # stage 1 right half: read
                T.wait_wgmma(0)
                T.barrier_arrive(S.bar_free[1])  # stage 0 right half (and P0 over its tail): read
            T.copy(S.l1, S.sl1)
            T.barrier_arrive(S.bar_l[1])
            T.barrier_wait(S.bar_l[0], q_parity)
            for h in T.Parallel(block_h):
                S.l1[h] += S.sl0[h]
            store_half(Out, t, h0, S.o1, S.l1, dh, dh)
            for h in T.Parallel(block_h):
                if rows.live(t, h0, h, t_len):
                    Lse[rows.query(t, h), rows.head(h0, h)] = T.if_then_else(
                        S.l1[h] > 0, T.log(S.l1[h]) + S.m1[h] * softmax_scale, T.infinity(f32)
                    )

        @T.macro
        def producer_query(S, KV, Idx, t, t_kv, lane, n_pair, base):
            # Producer: the halves in the order the math warpgroups read them.
            for jp in T.serial(n_pair):
                free = (pair(base, jp) & 1) ^ 1
                if slot_prefetch:  # both blocks' entries, in flight during the wait below
                    load_slots(Idx, t, topk, lane, S.slots0, 2 * jp)
                    load_slots(Idx, t, topk, lane, S.slots1, 2 * jp + 1)
                T.barrier_wait(S.bar_free[0], free)
                first_gather[0](KV, S.slots0 if slot_prefetch else Idx, t, t_kv, topk, lane, S.kv0_l, S.kv0_l, S.kt0,
                                S.idx0_s, 2 * jp)
                if smem_mask:
                    T.barrier_arrive(S.bar_mask[0])
                T.cp_async_barrier_noinc(S.bar_ready[0])
                T.barrier_wait(S.bar_free[3], free)
                first_gather[1](KV, S.slots1 if slot_prefetch else Idx, t, t_kv, topk, lane, S.kv1_r, S.kv1_r, S.kt1,
                                S.idx1_s, 2 * jp + 1)
                if smem_mask:
                    T.barrier_arrive(S.bar_mask[1])
                T.cp_async_barrier_noinc(S.bar_ready[3])
                T.barrier_wait(S.bar_free[1], free)
                gather_r(KV, S.slots0 if slot_prefetch else Idx, t, t_kv, topk, lane, S.kv0_r, S.kv0_r, S.kt0, None,
                         2 * jp)
                T.cp_async_barrier_noinc(S.bar_ready[1])
                T.barrier_wait(S.bar_free[2], free)
                gather_l(KV, S.slots1 if slot_prefetch else Idx, t, t_kv, topk, lane, S.kv1_l, S.kv1_l, S.kt1, None,
                         2 * jp + 1)
                T.cp_async_barrier_noinc(S.bar_ready[2])

        @T.macro
        def take_item(item, VLen, bx, k, head: bool):
            # a persistent CTA's k-th item: its query (row of Idx), first head (the math warpgroups') and pairs
            item[0] = (bx + k * ctas) % n_idx
            if head:
                item[1] = (bx + k * ctas) // n_idx * block_h
            item[2] = T.ceildiv(VLen[item[0]], 2 * bi)

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            Idx: T.Tensor([n_idx, topk], i32),
            VLen: T.Tensor([n_idx], i32),
            Out: T.Tensor([t_len, heads, d_v], bf16),
            Lse: T.Tensor([t_len, heads], f32),
        ):
            if not ctas:  # one CTA per (query, head block)
                with T.Kernel(n_idx, n_hblk, threads=threads) as (t, hb):
                    S = alloc()
                    if named_exchange:
                        T.import_source(NAMED_BARRIER_SRC)
                    h0 = hb * block_h
                    tx = T.get_thread_binding()
                    n_pair = T.ceildiv(VLen[t], 2 * bi)
                    if tx < 128:
                        T.set_max_nreg(nreg[0], 1)
                        wg0_query(S, Q, Idx, Out, t, t_kv, h0, tx, n_pair, None, 0)
                    elif tx < 256:
                        T.set_max_nreg(nreg[1], 1)
                        wg1_query(S, Q, Idx, Out, Lse, t, t_kv, h0, tx, n_pair, None, 0)
                    else:
                        T.set_max_nreg(nreg[2], 0)
                        lane = tx - 256
                        producer_query(S, KV, Idx, t, t_kv, lane, n_pair, None)
            else:
                # persistent: CTA b serves (query, head block) items b, b + ctas, ... (queries fastest, the order
                # of the one-query grid), so the producer gathers the next item's first blocks while the math
                # warpgroups finish this one's last P V and store it
                with T.Kernel(ctas, threads=threads) as bx:
                    S = alloc()
                    if named_exchange:
                        T.import_source(NAMED_BARRIER_SRC)
                    tx = T.get_thread_binding()
                    n_mine = (n_idx * n_hblk - bx + ctas - 1) // ctas
                    done = T.alloc_local([1], i32)  # pairs of this CTA's earlier items: the parity base
                    item = T.alloc_local([3], i32)  # this item's query (row of Idx), first head, pairs
                    done[0] = 0
                    if tx < 128:
                        T.set_max_nreg(nreg[0], 1)
                        for k in T.serial(n_mine):
                            take_item(item, VLen, bx, k, True)
                            wg0_query(S, Q, Idx, Out, item[0], t_kv, item[1], tx, item[2], done[0], k & 1)
                            done[0] = done[0] + item[2]
                    elif tx < 256:
                        T.set_max_nreg(nreg[1], 1)
                        for k in T.serial(n_mine):
                            take_item(item, VLen, bx, k, True)
                            wg1_query(S, Q, Idx, Out, Lse, item[0], t_kv, item[1], tx, item[2], done[0], k & 1)
                            done[0] = done[0] + item[2]
                    else:
                        T.set_max_nreg(nreg[2], 0)
                        lane = tx - 256
                        for k in T.serial(n_mine):
                            take_item(item, VLen, bx, k, False)
                            producer_query(S, KV, Idx, item[0], t_kv, lane, item[2], done[0])
                            done[0] = done[0] + item[2]

        return main

    configs = {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
               tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    # out_idx non-negative: see _common.OUT_IDX_NOTE
    synced = tilelang.jit(out_idx=[4, 5], pass_configs=configs)(sparse_mla_fwd_pp)
    lean = tilelang.jit(out_idx=[4, 5], pass_configs={
        **configs, tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})(sparse_mla_fwd_pp)

    signature = inspect.signature(sparse_mla_fwd_pp)

    @functools.wraps(sparse_mla_fwd_pp)
    def build(*args, **kwargs):  # the arguments go on as passed (TileLang's in-process kernel cache keys on them)
        synced_build = signature.bind(*args, **kwargs).arguments.get("storage_sync", False)
        return (synced if synced_build else lean)(*args, **kwargs)

    return build


@functools.cache
def _jit_fwd_simple():
    tilelang, T = tilelang_modules()

    @tilelang.jit(
        out_idx=[4, 5],  # non-negative: see _common.OUT_IDX_NOTE
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        },
    )
    def sparse_mla_fwd_simple(
        heads: int,
        d_qk: int,
        d_v: int,
        softmax_scale: float,
        block_i: int = 64,
        num_stages: int = 2,
        threads: int = 256,
    ):
        block_h, n_hblk = head_block(heads)
        d_tail = d_qk - d_v
        has_tail = d_tail > 0  # see the ws kernel
        if d_tail < 0:
            raise ValueError(f"simple kernel needs d_qk >= d_v; got {d_qk}, {d_v}")
        scale_log2 = softmax_scale * LOG2E
        bi = block_i
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")  # index width: one kernel serves every K
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            Idx: T.Tensor([t_len, topk], i32),
            VLen: T.Tensor([t_len], i32),
            Out: T.Tensor([t_len, heads, d_v], bf16),
            Lse: T.Tensor([t_len, heads], f32),
        ):
            with T.Kernel(t_len, n_hblk, threads=threads) as (t, hb):
                q_s = T.alloc_shared([block_h, d_v], bf16)
                qt_s = T.alloc_shared([block_h, d_tail], bf16) if has_tail else None
                kv_s = T.alloc_shared([bi, d_v], bf16)
                kt_s = T.alloc_shared([bi, d_tail], bf16) if has_tail else None
                p_s = T.alloc_shared([block_h, bi], bf16)
                acc_s = T.alloc_fragment([block_h, bi], f32)
                acc_o = T.alloc_fragment([block_h, d_v], f32)
                m_i = T.alloc_fragment([block_h], f32)
                m_prev = T.alloc_fragment([block_h], f32)
                alpha = T.alloc_fragment([block_h], f32)
                l_i = T.alloc_fragment([block_h], f32)
                l_blk = T.alloc_fragment([block_h], f32)

                h0 = hb * block_h
                for h, d in T.Parallel(block_h, d_v):
                    q_s[h, d] = T.if_then_else(h0 + h < heads, Q[t, h0 + h, d], 0)
                if has_tail:
                    for h, d in T.Parallel(block_h, d_tail):
                        qt_s[h, d] = T.if_then_else(h0 + h < heads, Q[t, h0 + h, d_v + d], 0)
                T.fill(acc_o, 0)
                T.fill(l_i, 0)
                T.fill(m_i, -(2.0**30))

                for i in T.Pipelined(T.ceildiv(VLen[t], bi), num_stages=num_stages):
                    # Indices are re-read from global (L1-resident) in each loop so every loop partitions over
                    # all threads; a guarded load of a -1 slot never reaches memory (P1).
                    for j, d in T.Parallel(bi, d_v):
                        raw = T.if_then_else(i * bi + j < topk, Idx[t, T.min(i * bi + j, topk - 1)], -1)
                        kv_s[j, d] = T.if_then_else((raw >= 0) and (raw < t_kv), KV[T.max(raw, 0), d], 0)
                    if has_tail:
                        for j, d in T.Parallel(bi, d_tail):
                            raw = T.if_then_else(i * bi + j < topk, Idx[t, T.min(i * bi + j, topk - 1)], -1)
                            kt_s[j, d] = T.if_then_else((raw >= 0) and (raw < t_kv), KV[T.max(raw, 0), d_v + d], 0)
                    for h, j in T.Parallel(block_h, bi):
                        raw = T.if_then_else(i * bi + j < topk, Idx[t, T.min(i * bi + j, topk - 1)], -1)
                        acc_s[h, j] = T.if_then_else((raw >= 0) and (raw < t_kv), 0, -T.infinity(f32))
                    T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if has_tail:
                        T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(m_i, m_prev)
                    T.reduce_max(acc_s, m_i, dim=1, clear=False)
                    for h in T.Parallel(block_h):
                        alpha[h] = T.exp2((m_prev[h] - m_i[h]) * scale_log2)
                    for h, j in T.Parallel(block_h, bi):
                        acc_s[h, j] = T.exp2(acc_s[h, j] * scale_log2 - m_i[h] * scale_log2)
                    T.reduce_sum(acc_s, l_blk, dim=1)
                    for h in T.Parallel(block_h):
                        l_i[h] = l_i[h] * alpha[h] + l_blk[h]
                    for h, d in T.Parallel(block_h, d_v):
                        acc_o[h, d] *= alpha[h]
                    T.copy(acc_s, p_s)
                    T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

                for h, d in T.Parallel(block_h, d_v):
                    if h0 + h < heads:
                        Out[t, h0 + h, d] = T.cast(T.if_then_else(l_i[h] > 0, acc_o[h, d] / l_i[h], 0), bf16)
                for h in T.Parallel(block_h):
                    if h0 + h < heads:
                        Lse[t, h0 + h] = T.if_then_else(
                            l_i[h] > 0, T.log(l_i[h]) + m_i[h] * softmax_scale, T.infinity(f32)
                        )

        return main

    return sparse_mla_fwd_simple


# --------------------------------------------------------------------------------------------------------------------
# Checked interface
# --------------------------------------------------------------------------------------------------------------------


def check_sparse_mla_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> None:
    """Validate dtypes, ranks, contiguity and shapes of the sparse-MLA inputs (shared by forward and backward)."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=2, device=q.device)
    check_tensor("indices", indices, dtype=torch.int32, ndim=2, device=q.device)
    t_len, heads, d_qk = q.shape
    if kv.shape[1] != d_qk:
        raise ValueError(f"kv must be [T_kv, {d_qk}] like q's last dim, got {tuple(kv.shape)}")
    if indices.shape[0] != t_len:
        raise ValueError(f"indices must be [T={t_len}, K], got {tuple(indices.shape)}")
    if not 1 <= heads <= 128:
        raise ValueError(f"heads per rank must be in [1, 128], got {heads}")
    if not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be in (0, d_qk={d_qk}], got {d_v}")
    if d_v % 128 or (d_qk - d_v) % 64:
        raise ValueError(
            f"kernels support d_v % 128 == 0 and (d_qk - d_v) % 64 == 0 (GLM-5: 512 + 64 RoPE; GLM-5.3-Flash: "
            f"512 + 0), got d_v={d_v}, d_qk={d_qk}"
        )
    if indices.shape[1] == 0:
        raise ValueError("indices must have at least one slot (K >= 1)")


def pick_fwd_variant(heads: int, d_qk: int, d_v: int, variant: Variant = "auto") -> str:
    """``auto`` picks ``pp``, the ping-pong forward, where a CTA has 64 MMA rows (more than 32 heads): 1.11-1.14x
    ``ws`` at 64 heads and 16K tokens (NoPE and GLM-5 latents); ``ws`` below that (``pp`` needs two 64-row
    warpgroups). Measurements: ``scripts/bench/RESULTS_kernels.md``; ``tests/gpu/test_kernels_gpu.py`` covers all
    four variants."""
    if variant != "auto":
        return variant
    return "pp" if head_block(heads)[0] == 64 else "ws"


def pp_options() -> tuple[str, ...]:
    """The ``pp`` options in force: ``MEGATRON_GLM5_PP_OPTIONS`` (a comma list of :data:`PP_OPTION_NAMES`, or
    ``none``) when set and not empty, else ``PP_OPTIONS``."""
    raw = os.environ.get(PP_OPTIONS_ENV, "").strip()
    if not raw:
        return PP_OPTIONS
    if raw == "none":
        return ()
    names = tuple(n.strip() for n in raw.split(","))
    unknown = [n for n in names if n not in PP_OPTION_NAMES]
    if unknown:
        raise ValueError(f"{PP_OPTIONS_ENV}={raw!r}: unknown option(s) {unknown}; known: {', '.join(PP_OPTION_NAMES)}"
                         " (or none)")
    return names


def pp_kernel(heads: int, d_qk: int, d_v: int, softmax_scale: float, group: int, device: torch.device) -> Callable:
    """The ``pp`` forward with :func:`pp_options` (``persistent``: one CTA per SM of ``device``). Without options
    the call is the one the precompiled kernels were built by (``group`` passed only when grouped), so their cache
    entries still hit."""
    options = pp_options()
    extra = {}
    if "named_exchange" in options:
        extra["named_exchange"] = True
    if "persistent" in options:
        extra["ctas"] = multiprocessor_count(device)
    if group != 1 or extra:
        return _jit_fwd_pp()(heads, d_qk, d_v, float(softmax_scale), group, **extra)
    return _jit_fwd_pp()(heads, d_qk, d_v, float(softmax_scale))


def sparse_mla_fwd_interface(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    valid_len: torch.Tensor | None = None,
    variant: Variant = "auto",
    group: int = 1,
    union: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel call: ``(out [T, H, d_v] bf16, lse [T, H] fp32 natural log)``.

    ``valid_len`` (``row_valid_len(indices)``) may be passed in when the caller already has it. ``group`` != 1
    (``pp`` by default, ``ws`` or ``sv``; 0: ``64 // H``): one CTA serves ``group`` consecutive queries over the union
    of their index sets (``kernels.index_groups``; ``union``: a prebuilt ``group_union_indices(indices, group)``),
    same contract. The ``pp`` kernel runs with :func:`pp_options`.
    The autograd path runs it with ``grouped=True`` (``MEGATRON_GLM5_GROUPED_SPARSE_MLA``, on by default); measured
    against the per-query kernel by ``scripts/bench/sweep_dsa_round2.py`` (sections ``grouped``, ``route``) and the
    schedules by ``scripts/bench/sweep_sparse_fwd.py``.
    """
    check_sparse_mla_args(q, kv, indices, d_v)
    t_len, heads, d_qk = q.shape
    if t_len == 0:
        return q.new_zeros(0, heads, d_v), q.new_zeros(0, heads, dtype=torch.float32)
    if group != 1:
        if variant not in ("auto", "ws", "sv", "pp"):
            raise ValueError(f"the grouped forward is a 'ws', 'sv' or 'pp' kernel, got variant={variant!r}")
        group, rows, lengths = grouped_rows(indices, heads, group, union, kv.shape[0])
        if variant == "sv":
            kernel = _jit_fwd_sv()(heads, d_qk, d_v, float(softmax_scale), group)
        elif variant in ("auto", "pp"):
            kernel = pp_kernel(heads, d_qk, d_v, softmax_scale, group, q.device)
        else:
            kernel = _jit_fwd_ws()(heads, d_qk, d_v, float(softmax_scale), 64, group)
        return kernel(q, kv, rows, lengths)
    if valid_len is None:
        valid_len = row_valid_len(indices)
    kind = pick_fwd_variant(heads, d_qk, d_v, variant)
    if kind == "ws":
        kernel = _jit_fwd_ws()(heads, d_qk, d_v, float(softmax_scale))
    elif kind in ("sv", "pp"):
        if head_block(heads)[0] != 64:
            raise ValueError(f"variant {kind!r} needs 64 MMA rows per CTA (more than 32 heads), got {heads} heads")
        if kind == "sv":
            kernel = _jit_fwd_sv()(heads, d_qk, d_v, float(softmax_scale))
        else:
            kernel = pp_kernel(heads, d_qk, d_v, softmax_scale, 1, q.device)
    elif kind == "simple":
        kernel = _jit_fwd_simple()(heads, d_qk, d_v, float(softmax_scale))
    else:
        raise ValueError(f"variant must be 'auto', 'ws', 'sv', 'pp' or 'simple', got {variant!r}")
    out, lse = kernel(q, kv, indices, valid_len)
    return out, lse
