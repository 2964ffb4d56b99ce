"""Sparse-MLA ``dKV`` by key blocks: no float atomics, deterministic by construction.

The per-query backward (``sparse_mla_bwd``) adds each (query, slot) pair's ``d_qk``-wide fp32 ``dKV`` row into
global memory with atomics. At 16 heads it runs at that traffic's floor (2304 bytes per pair through the L2's
reduction units, about 2.3 TB/s on an H200: ``docs/design/kernels_round2.md``, sixth session). This pass turns the
problem around: one CTA owns a block of ``block_k`` keys and walks the queries that select any of them, ``block_r``
(query, head) rows at a time, so each key's gradient is summed in registers and written once:

    S^T  = K_blk Q_r^T               [block_k, block_r]   (K_blk: the block's latent rows, all d_qk channels)
    dP^T = V_blk dO_r^T              (V_blk = K_blk[:, :d_v])
    P^T  = mask * exp(scale S^T - lse),  dS^T = P^T * (dP^T - Delta) * scale
    dKV_blk += dS^T Q_r + P^T dO_r   (the second term on the first d_v channels)

``mask`` is the selection bitmap (``kernels.selection_bitmap``), so the math per selected pair is the per-query
kernel's (``P`` and ``dS`` rounded to bf16 before their GEMMs, as there); pairs a query did not select cost MMA work
but add exact zeros. The dense work is the price: every (key block, row tile) that the block's query range covers,
about ``T / (2 * mean selected keys per query)`` times the sparse pairs for causal random sets (2.3x at 8K tokens and
top-k 2048, 4.3x at 16K), against no reduction traffic at all. So it pays at short and middle context (H200, 16
heads, ``wsp``: 2.04x / 1.67x / 1.20x the atomic backward on 4K / 8K / 16K-token sequences, 0.97x on one of 24K).
Windowed sets cost the same as random ones: a few random keys per query reach every key block, so the query ranges
skip nothing (``scripts/bench/RESULTS_kernels.md``, round 2, eighth session).

Kernels: ``_jit_dkv_key_blocks_ws`` (schedule ``wsp``, the default: a score warpgroup and two dKV warpgroups over
mbarriers, the dKV warpgroups loading the row tiles) and ``_jit_dkv_key_blocks`` (``split`` / ``plain``, two
warpgroups in lockstep), every element formed the same way in all three (bitwise equal, GPU-tested).

Work split: the query axis is cut into ``n_chunks`` equal chunks; CTA ``(block, chunk)`` writes its block's partial
sum into ``Part[chunk]`` (zeros when the chunk holds none of the block's queries), and the chunks are summed in
index order afterwards (``torch.sum`` over a fixed shape: deterministic). The chunks balance the causal triangle
over the SMs.

Contract: indices distinct within each valid part of a row (the indexer's top-k: a repeated key would count once
here but twice in the forward; ``selection_bitmap`` counts repeats). Test oracle: autograd through
``megatron_glm5.dsa.reference.sparse_mla``; :func:`dkv_key_blocks_reference` is this algorithm in torch (chunks,
blocks, query ranges) for the CPU tests.

No ``from __future__ import annotations`` here: TileLang evaluates the nested prim_funcs' annotations.
"""

import functools

import torch

from megatron_glm5.kernels._common import LOG2E, cdiv, multiprocessor_count, tilelang_modules
from megatron_glm5.kernels.key_block_work import row_key_span, span_query_ranges
from megatron_glm5.kernels.selection_bitmap import bitmap_words, key_block_query_range, selection_bitmap

KEY_BLOCK = 64  # keys per CTA: the wgmma M of every GEMM here
ROW_TILE = 32  # (query, head) rows per step: two stages of Q / dO tiles fit next to the key block (216 KB)
MAX_CHUNKS = 32  # query chunks (32 vs 16: 0.57 vs 0.67 ms at 2K tokens, even at 8K)
SCHEDULES = ("wsp", "split", "plain")  # dkv_key_blocks(schedule=...): "wsp" is the default
PARTIAL_BYTES = 512 << 20  # the partial buffer, n_chunks x T_kv x d_qk fp32, stays below this


# Where the route measured faster (H200, random causal top-2048 sets, 16 heads, ``wsp`` with its two-loop score pass:
# 2.04x / 1.67x / 1.20x the atomic backward on 4K / 8K / 16K-token sequences, dense / sparse work 1.35 / 2.30 / 4.28;
# 64 heads 1.05x-0.42x in the eighth session: the dQ pass alone is half the atomic backward there).
KEY_BLOCKS_MAX_HEADS = 16
KEY_BLOCKS_MAX_TOKENS = 8192


# Past 8K tokens, the route is taken where the forward's bound of the dense work (``key_block_work``) is at most this
# many times the selected pairs, by latent (d_qk, d_v); H200, 16 heads, random causal top-2048 sets, "wsp" with its
# two-loop score pass (scripts/bench/RESULTS_kernels.md, round 2, eleventh session):
# * (576, 512), GLM-5's latent: single sequences ran 1.41x / 1.20x / 1.00x / 0.92x at ratios 3.29 / 4.28 / 5.28 /
#   6.28 (12K / 16K / 20K / 24K), two 16K ones 1.12x: 1.0 crosses near 5.3; 4.8 keeps a margin. Packed batches of
#   1K-8K sequences (ratios 1.03-2.87): 1.50-2.08x.
# * (512, 512), GLM-5.3-Flash's NoPE latent: 1.33x / 1.14x / 0.95x at 3.29 / 4.28 / 5.28, two 16K ones 1.07x: 1.0
#   crosses near 4.9; 4.5. Top-k stays 2048 keys there (KPool pools expand to tokens), so the causal bound of the
#   dense work is GLM-5's.
KEY_BLOCKS_MAX_DENSE_PER_SPARSE = {(576, 512): 4.8, (512, 512): 4.5}
KEY_BLOCKS_BITMAP_BYTES = 512 << 20  # the selection bitmap (T x T_kv / 8 bytes) stays below this: 64K x 64K


def key_blocks_fit(heads: int, tokens: int, t_kv: int, d_qk: int, d_v: int) -> bool:
    """Whether the key-block dKV may serve this call at all: per-rank heads where it was measured, a measured latent
    (:data:`KEY_BLOCKS_MAX_DENSE_PER_SPARSE`: GLM-5's and GLM-5.3-Flash's NoPE one), and a selection bitmap within
    :data:`KEY_BLOCKS_BITMAP_BYTES` (at any length: ``T x T_kv / 8`` bytes, so a short call over more than 512K keys
    keeps the atomic backward too)."""
    bitmap_bytes = tokens * bitmap_words(t_kv, KEY_BLOCK) * 4
    return (heads <= KEY_BLOCKS_MAX_HEADS and tokens > 0 and (d_qk, d_v) in KEY_BLOCKS_MAX_DENSE_PER_SPARSE
            and bitmap_bytes <= KEY_BLOCKS_BITMAP_BYTES)


def key_blocks_pay(heads: int, tokens: int, d_qk: int, d_v: int, *, t_kv: int | None = None,
                   dense_per_sparse: float | None = None) -> bool:
    """Whether the autograd backward takes the key-block dKV (``SparseMLAFunction``'s ``key_blocks=True``): where
    :func:`key_blocks_fit` holds and either the call has at most :data:`KEY_BLOCKS_MAX_TOKENS` tokens (measured
    faster on single causal sequences, whose dense work is the largest for their length) or the measured
    ``dense_per_sparse`` (``key_block_work.KeyBlockWorkProbe``) is at most the latent's
    :data:`KEY_BLOCKS_MAX_DENSE_PER_SPARSE`. ``t_kv``: the keys (default ``tokens``)."""
    if not key_blocks_fit(heads, tokens, tokens if t_kv is None else t_kv, d_qk, d_v):
        return False
    if tokens <= KEY_BLOCKS_MAX_TOKENS:
        return True
    return dense_per_sparse is not None and dense_per_sparse <= KEY_BLOCKS_MAX_DENSE_PER_SPARSE[d_qk, d_v]


def default_chunks(t_len: int, t_kv: int, device: torch.device, block_k: int = KEY_BLOCK, d_qk: int = 576) -> int:
    """Query chunks: about eight waves of CTAs over the causal triangle (``n_blocks * n_chunks / 2`` CTAs with work;
    16 chunks beat 9 by 9 % at 8K tokens), at most :data:`MAX_CHUNKS` and what :data:`PARTIAL_BYTES` holds."""
    n_blocks = max(1, cdiv(t_kv, block_k))
    want = cdiv(16 * multiprocessor_count(device), n_blocks)
    budget = PARTIAL_BYTES // max(1, t_kv * d_qk * 4)
    return max(1, min(MAX_CHUNKS, want, budget, max(t_len, 1)))


def _load_macros(T, *, rows_per_pass: int, dh: int, d_tail: int, d_v: int, block_r: int, words: int, heads: int):
    """``(load_cols, load_rows, load_meta)``, the cp.async loads both key-block kernels share (``T`` is
    ``tilelang.language``).

    * ``load_cols(src, r0, r_end, tx, n_rows, buf, col0, width)``: rows ``[r0, r0 + n_rows)`` of ``src``'s columns
      ``[col0, col0 + width)`` into ``buf``, 8 lanes x 16 bytes per row, ``rows_per_pass`` rows per pass (``tx`` in
      ``[0, 8 * rows_per_pass)``); rows at or past ``r_end`` are zero-filled and never read.
    * ``load_rows(src, r0, r_end, tx, n_rows, buf_l, buf_r, buf_t, tail0)``: the same rows into the halves of ``d_v``
      (and the tail from column ``tail0`` where ``buf_t`` is given).
    * ``load_meta(Lse, Delta, Bits, kb, r0, r_hi, tx, lse_t, dl_t, bits_t)``: a row tile's LSE, Delta and the mask
      words of key block ``kb``, one 4-byte cp.async per thread (zero past ``r_hi``: no mask bit, so no ``P``).

    Neither commits: the caller ends the tile with a commit group or an mbarrier arrival."""

    @T.macro
    def load_cols(src, r0, r_end, tx, n_rows, buf, col0, width):
        lane = tx % 8
        for p in T.unroll(n_rows // rows_per_pass):
            row = p * rows_per_pass + tx // 8
            g = r0 + row
            ok = g < r_end
            src_row = T.if_then_else(ok, g, 0)
            for c in T.unroll(width // 64):
                col = c * 64 + lane * 8
                T.ptx_cp_async(T.access_ptr(buf[row, col], "w", 8),
                               T.access_ptr(src[src_row, col0 + col], "r", 8), 8, predicate=ok)

    @T.macro
    def load_rows(src, r0, r_end, tx, n_rows, buf_l, buf_r, buf_t, tail0):
        load_cols(src, r0, r_end, tx, n_rows, buf_l, 0, dh)
        load_cols(src, r0, r_end, tx, n_rows, buf_r, dh, dh)
        if buf_t is not None:
            load_cols(src, r0, r_end, tx, n_rows, buf_t, tail0, d_tail)

    @T.macro
    def load_meta(Lse, Delta, Bits, kb, r0, r_hi, tx, lse_t, dl_t, bits_t):
        if tx < block_r:
            ok = r0 + tx < r_hi
            T.ptx_cp_async(T.access_ptr(lse_t[tx], "w", 1),
                           T.access_ptr(Lse[T.if_then_else(ok, r0 + tx, 0)], "r", 1), 1, predicate=ok)
        elif tx < 2 * block_r:
            i = tx - block_r
            ok = r0 + i < r_hi
            T.ptx_cp_async(T.access_ptr(dl_t[i], "w", 1),
                           T.access_ptr(Delta[T.if_then_else(ok, r0 + i, 0)], "r", 1), 1, predicate=ok)
        elif tx < 2 * block_r + block_r * words:
            i = (tx - 2 * block_r) // words
            w = (tx - 2 * block_r) % words
            ok = r0 + i < r_hi
            T.ptx_cp_async(T.access_ptr(bits_t[i, w], "w", 1),
                           T.access_ptr(Bits[T.if_then_else(ok, (r0 + i) // heads, 0), kb * words + w], "r", 1),
                           1, predicate=ok)

    return load_cols, load_rows, load_meta


@functools.cache
def _jit_dkv_key_blocks():
    tilelang, T = tilelang_modules()

    @tilelang.jit(
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        },
    )
    def sparse_mla_dkv_key_blocks(heads: int, d_qk: int, d_v: int, softmax_scale: float,
                                  block_k: int = KEY_BLOCK, block_r: int = ROW_TILE, threads: int = 256,
                                  schedule: str = "split"):
        """Grid ``(ceil(T_kv / block_k), n_chunks)``. Q / dO / Lse / Delta come flattened over (query, head): row
        ``r`` is head ``r % heads`` of query ``r // heads``. Tiles of ``block_r`` rows are loaded with ``cp.async``
        into two stages (the next tile loads while this one computes), rows past the chunk zero-filled.

        ``schedule``: ``"split"`` (default): warpgroup 0 forms ``S^T`` and ``P``, warpgroup 1 ``dP^T`` and then
        ``dS``, each GEMM over the whole row tile, so the key block (the A operand) is read once per GEMM instead of
        once per warpgroup; the tile's LSE, Delta and mask words arrive with its ``cp.async`` loads.
        ``"plain"``: both warpgroups split every GEMM by columns, LSE / Delta / mask read from global memory in the
        tile's step (the first version, kept as the bitwise reference of ``split``)."""
        if schedule not in ("split", "plain"):
            raise ValueError(f"schedule must be 'split' or 'plain', got {schedule!r}")
        split = schedule == "split"
        if split and (threads != 256 or 2 * block_r + block_r * (block_k // 32) > threads):
            raise ValueError(f"the split schedule runs two warpgroups (256 threads) and loads a tile's LSE, Delta and "
                             f"mask words with one cp.async per thread; got threads={threads}, block_r={block_r}")
        dh = d_v // 2
        d_tail = d_qk - d_v
        has_tail = d_tail > 0
        rows_per_pass = threads // 8  # 8 lanes x 16 bytes per row and pass
        if dh % 64 or d_tail % 64 or d_tail < 0 or block_k % 32 or block_k % rows_per_pass or block_r % rows_per_pass:
            raise ValueError(f"key-block dKV needs d_v/2 and d_qk-d_v >= 0 multiples of 64, block_k a multiple of 32, "
                             f"block_k and block_r multiples of threads/8; got d_v={d_v}, d_qk={d_qk}, "
                             f"block_k={block_k}, block_r={block_r}, threads={threads}")
        words = block_k // 32
        scale_log2 = softmax_scale * LOG2E
        n_flat = T.dynamic("n_flat")
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_words = T.dynamic("n_words")
        n_kb = T.dynamic("n_kb")
        n_chunk = T.dynamic("n_chunk")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32

        _, load_rows, load_meta = _load_macros(T, rows_per_pass=rows_per_pass, dh=dh, d_tail=d_tail, d_v=d_v,
                                            block_r=block_r, words=words, heads=heads)

        @T.macro
        def load_tile(Q, dO, r0, r_hi, tx, q_l, q_r, q_t, do_l, do_r):
            load_rows(Q, r0, r_hi, tx, block_r, q_l, q_r, q_t, d_v)
            load_rows(dO, r0, r_hi, tx, block_r, do_l, do_r, None, 0)
            T.ptx_commit_group()

        @T.macro
        def load_tile_split(Q, dO, Lse, Delta, Bits, kb, r0, r_hi, tx, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t, bits_t):
            # the tile's rows plus its LSE, Delta and mask words
            load_rows(Q, r0, r_hi, tx, block_r, q_l, q_r, q_t, d_v)
            load_rows(dO, r0, r_hi, tx, block_r, do_l, do_r, None, 0)
            load_meta(Lse, Delta, Bits, kb, r0, r_hi, tx, lse_t, dl_t, bits_t)
            T.ptx_commit_group()

        @T.macro
        def tile_step_split(tx, kl, kr, kt, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t, bits_t,
                            pf_s, p_s, ds_s, s_f, dp_f, acc_l, acc_r, acc_t):
            if tx < 128:  # warpgroup 0: S^T over the whole tile, then P (fp32 for dS, bf16 for the GEMM)
                T.wgmma_gemm(kl, q_l, s_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(kr, q_r, s_f, transpose_B=True)
                if has_tail:
                    T.wgmma_gemm(kt, q_t, s_f, transpose_B=True)
                T.wait_wgmma(0)
                for j, i in T.Parallel(block_k, block_r):
                    sel = ((bits_t[i, j // 32] >> (j % 32)) & 1) == 1
                    p = T.if_then_else(sel, T.exp2(s_f[j, i] * scale_log2 - lse_t[i] * LOG2E), 0)
                    pf_s[j, i] = p
                    p_s[j, i] = T.cast(p, bf16)
            else:  # warpgroup 1: dP^T over the whole tile
                T.wgmma_gemm(kl, do_l, dp_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(kr, do_r, dp_f, transpose_B=True)
                T.wait_wgmma(0)
            T.sync_threads()
            if tx >= 128:
                for j, i in T.Parallel(block_k, block_r):
                    ds_s[j, i] = T.cast(pf_s[j, i] * (dp_f[j, i] - dl_t[i]) * softmax_scale, bf16)
            T.sync_threads()
            T.fence_proxy_async()  # generic smem writes of P / dS, read next by the tensor cores
            T.wgmma_gemm(ds_s, q_l, acc_l, policy=T.GemmWarpPolicy.FullCol)
            T.wgmma_gemm(p_s, do_l, acc_l, policy=T.GemmWarpPolicy.FullCol)
            T.wgmma_gemm(ds_s, q_r, acc_r, policy=T.GemmWarpPolicy.FullCol)
            T.wgmma_gemm(p_s, do_r, acc_r, policy=T.GemmWarpPolicy.FullCol)
            if has_tail:
                T.wgmma_gemm(ds_s, q_t, acc_t, policy=T.GemmWarpPolicy.FullCol)
            T.wait_wgmma(0)

        @T.macro
        def tile_step(Lse, Delta, Bits, r0, r_hi, k0, kl, kr, kt, q_l, q_r, q_t, do_l, do_r,
                      lse_s, delta_s, p_s, ds_s, acc_s, acc_dp, acc_l, acc_r, acc_t):
            for i in T.Parallel(block_r):
                live = r0 + i < r_hi
                lse_s[i] = T.if_then_else(live, Lse[T.if_then_else(live, r0 + i, 0)] * LOG2E, T.infinity(f32))
                delta_s[i] = T.if_then_else(live, Delta[T.if_then_else(live, r0 + i, 0)], 0)
            T.gemm(kl, q_l, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(kr, q_r, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            if has_tail:
                T.gemm(kt, q_t, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(kl, do_l, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(kr, do_r, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            for j, i in T.Parallel(block_k, block_r):
                r = r0 + i
                key = k0 + j
                tq = T.if_then_else(r < r_hi, r // heads, 0)
                word = Bits[tq, T.min(key // 32, n_words - 1)]
                sel = (r < r_hi) and (key < t_kv) and ((word >> (key % 32)) & 1) == 1
                p = T.if_then_else(sel, T.exp2(acc_s[j, i] * scale_log2 - lse_s[i]), 0)
                acc_dp[j, i] = p * (acc_dp[j, i] - delta_s[i]) * softmax_scale
                acc_s[j, i] = p
            T.copy(acc_s, p_s)
            T.copy(acc_dp, ds_s)
            T.gemm(ds_s, q_l, acc_l, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(p_s, do_l, acc_l, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(ds_s, q_r, acc_r, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(p_s, do_r, acc_r, policy=T.GemmWarpPolicy.FullCol)
            if has_tail:
                T.gemm(ds_s, q_t, acc_t, policy=T.GemmWarpPolicy.FullCol)

        @T.macro
        def load_stage(Q, dO, Lse, Delta, Bits, kb, r0, r_hi, tx, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t, bits_t):
            if split:
                load_tile_split(Q, dO, Lse, Delta, Bits, kb, r0, r_hi, tx, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t,
                                bits_t)
            else:
                load_tile(Q, dO, r0, r_hi, tx, q_l, q_r, q_t, do_l, do_r)

        @T.macro
        def step_stage(Lse, Delta, Bits, tx, r0, r_hi, k0, kl, kr, kt, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t, bits_t,
                       lse_s, delta_s, pf_s, p_s, ds_s, acc_s, acc_dp, acc_l, acc_r, acc_t):
            if split:
                tile_step_split(tx, kl, kr, kt, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t, bits_t,
                                pf_s, p_s, ds_s, acc_s, acc_dp, acc_l, acc_r, acc_t)
            else:
                tile_step(Lse, Delta, Bits, r0, r_hi, k0, kl, kr, kt, q_l, q_r, q_t, do_l, do_r,
                          lse_s, delta_s, p_s, ds_s, acc_s, acc_dp, acc_l, acc_r, acc_t)

        @T.prim_func
        def main(
            Q: T.Tensor([n_flat, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            dO: T.Tensor([n_flat, d_v], bf16),
            Lse: T.Tensor([n_flat], f32),
            Delta: T.Tensor([n_flat], f32),
            Bits: T.Tensor([t_len, n_words], i32),
            QRange: T.Tensor([n_kb, 2], i32),
            Part: T.Tensor([n_chunk, t_kv, d_qk], f32),
        ):
            with T.Kernel(T.ceildiv(t_kv, block_k), n_chunk, threads=threads) as (kb, qc):
                kl = T.alloc_shared([block_k, dh], bf16)
                kr = T.alloc_shared([block_k, dh], bf16)
                kt = T.alloc_shared([block_k, d_tail], bf16) if has_tail else None
                q0_l = T.alloc_shared([block_r, dh], bf16)
                q0_r = T.alloc_shared([block_r, dh], bf16)
                q0_t = T.alloc_shared([block_r, d_tail], bf16) if has_tail else None
                do0_l = T.alloc_shared([block_r, dh], bf16)
                do0_r = T.alloc_shared([block_r, dh], bf16)
                q1_l = T.alloc_shared([block_r, dh], bf16)
                q1_r = T.alloc_shared([block_r, dh], bf16)
                q1_t = T.alloc_shared([block_r, d_tail], bf16) if has_tail else None
                do1_l = T.alloc_shared([block_r, dh], bf16)
                do1_r = T.alloc_shared([block_r, dh], bf16)
                p_s = T.alloc_shared([block_k, block_r], bf16)
                ds_s = T.alloc_shared([block_k, block_r], bf16)
                lse_s = T.alloc_shared([block_r], f32)
                delta_s = T.alloc_shared([block_r], f32)
                # split schedule: P in fp32 (warpgroup 0 -> 1) and each stage's LSE, Delta and mask words
                pf_s = T.alloc_shared([block_k, block_r], f32) if split else None
                lse0 = T.alloc_shared([block_r], f32) if split else None
                dl0 = T.alloc_shared([block_r], f32) if split else None
                bits0 = T.alloc_shared([block_r, words], i32) if split else None
                lse1 = T.alloc_shared([block_r], f32) if split else None
                dl1 = T.alloc_shared([block_r], f32) if split else None
                bits1 = T.alloc_shared([block_r, words], i32) if split else None

                acc_s = T.alloc_fragment([block_k, block_r], f32)
                acc_dp = T.alloc_fragment([block_k, block_r], f32)
                acc_l = T.alloc_fragment([block_k, dh], f32)
                acc_r = T.alloc_fragment([block_k, dh], f32)
                acc_t = T.alloc_fragment([block_k, d_tail], f32) if has_tail else None

                tx = T.get_thread_binding()
                k0 = kb * block_k
                qpc = T.ceildiv(t_len, n_chunk)
                q_lo = T.max(qc * qpc, QRange[kb, 0])
                q_hi = T.min(T.min((qc + 1) * qpc, QRange[kb, 1]), t_len)
                r_lo = q_lo * heads
                r_hi = q_hi * heads
                n_tiles = T.if_then_else(q_hi > q_lo, T.ceildiv(r_hi - r_lo, block_r), 0)
                T.clear(acc_l)
                T.clear(acc_r)
                if has_tail:
                    T.clear(acc_t)
                if n_tiles > 0:
                    load_rows(KV, k0, t_kv, tx, block_k, kl, kr, kt, d_v)
                    T.ptx_commit_group()
                    load_stage(Q, dO, Lse, Delta, Bits, kb, r_lo, r_hi, tx,
                               q0_l, q0_r, q0_t, do0_l, do0_r, lse0, dl0, bits0)
                for ip in T.serial(T.ceildiv(n_tiles, 2)):
                    if 2 * ip + 1 < n_tiles:
                        load_stage(Q, dO, Lse, Delta, Bits, kb, r_lo + (2 * ip + 1) * block_r, r_hi, tx,
                                   q1_l, q1_r, q1_t, do1_l, do1_r, lse1, dl1, bits1)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    T.fence_proxy_async()
                    step_stage(Lse, Delta, Bits, tx, r_lo + 2 * ip * block_r, r_hi, k0, kl, kr, kt,
                               q0_l, q0_r, q0_t, do0_l, do0_r, lse0, dl0, bits0, lse_s, delta_s, pf_s, p_s, ds_s,
                               acc_s, acc_dp, acc_l, acc_r, acc_t)
                    T.sync_threads()
                    if 2 * ip + 1 < n_tiles:
                        if 2 * ip + 2 < n_tiles:
                            load_stage(Q, dO, Lse, Delta, Bits, kb, r_lo + (2 * ip + 2) * block_r, r_hi, tx,
                                       q0_l, q0_r, q0_t, do0_l, do0_r, lse0, dl0, bits0)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()
                        T.fence_proxy_async()
                        step_stage(Lse, Delta, Bits, tx, r_lo + (2 * ip + 1) * block_r, r_hi, k0, kl, kr, kt,
                                   q1_l, q1_r, q1_t, do1_l, do1_r, lse1, dl1, bits1, lse_s, delta_s, pf_s, p_s,
                                   ds_s, acc_s, acc_dp, acc_l, acc_r, acc_t)
                        T.sync_threads()

                for j, d in T.Parallel(block_k, dh):
                    if k0 + j < t_kv:
                        Part[qc, k0 + j, d] = acc_l[j, d]
                        Part[qc, k0 + j, dh + d] = acc_r[j, d]
                if has_tail:
                    for j, d in T.Parallel(block_k, d_tail):
                        if k0 + j < t_kv:
                            Part[qc, k0 + j, d_v + d] = acc_t[j, d]

        return main

    return sparse_mla_dkv_key_blocks


# Registers per warpgroup of the warp-specialised build (sum 504 = 3 x 168): warpgroup 1 holds the [64, 256] left
# accumulator, warpgroup 2 the right one and the RoPE tail ([64, 320]), the score warpgroup [64, 32] x 2. ptxas,
# sm_90a, 16 heads: no spills; H200, 8K: 7.28-7.29 ms at (136, 168, 200), (120, 168, 216) and (104, 184, 216),
# 10.5 ms at (152, 168, 184) and (168, 168, 168), whose right warpgroup spills (scripts/bench/sweep_dkv_ws.py).
WS_NREG = (136, 168, 200)


def _check_ws_shape(d_qk: int, d_v: int, block_k: int, block_r: int) -> None:
    """The warp-specialised kernel's shape rules: 16-row cp.async passes of one warpgroup over the halves of ``d_v``
    and the tail, and one cp.async per thread of the left dKV warpgroup for a tile's LSE, Delta and mask words."""
    dh, d_tail, lanes = d_v // 2, d_qk - d_v, 128 // 8
    if dh % 64 or d_tail % 64 or d_tail < 0 or block_k % lanes or block_r % lanes or block_k % 32:
        raise ValueError(f"key-block dKV needs d_v/2 and d_qk-d_v >= 0 multiples of 64, block_k a multiple of 32 "
                         f"and of 16, block_r a multiple of 16; got d_v={d_v}, d_qk={d_qk}, block_k={block_k}, "
                         f"block_r={block_r}")
    if 2 * block_r + block_r * (block_k // 32) > 128:
        raise ValueError(f"a tile's LSE, Delta and mask words take one cp.async per thread of a warpgroup: "
                         f"2 * block_r + block_r * block_k / 32 <= 128, got block_r={block_r}, block_k={block_k}")


def _ws_macros(T, *, heads: int, d_v: int, d_tail: int, block_k: int, block_r: int, softmax_scale: float):
    """``(load_rows, load_left, load_right, scores, updates_left, updates_right, store_left, store_right)``, the steps
    of the warp-specialised key-block kernel (``_jit_dkv_key_blocks_ws``; ``T`` is ``tilelang.language``):

    * ``load_rows``: :func:`_load_macros`' row loader (the key block, by the score warpgroup);
    * ``load_left(...)`` / ``load_right(...)``: a dKV warpgroup's share of a row tile into one stage (cp.async, ``lt``
      its thread in ``[0, 128)``): the left halves of ``Q`` / ``dO`` and the tile's LSE, Delta and mask words, or the
      right halves and the RoPE tail; each warpgroup loads the columns it alone reads. Completion on ``bar[stage]``;
    * ``scores(...)``: the score warpgroup's step: wait for the stage, ``S^T`` and ``dP^T``, then ``P`` and ``dS``
      formed in place in registers and stored (bf16) into the tile's buffers; every element as in the ``split``
      schedule (bitwise, GPU-tested);
    * ``updates_left`` / ``updates_right(..., stage, parity)``: a dKV warpgroup's step: wait for ``P`` / ``dS`` on
      ``bar_full[stage]``, ``dKV += dS^T Q + P^T dO`` on its half (the right one with the RoPE tail), then arrive on
      ``bar_free[stage]`` (the stage and the ``P`` / ``dS`` buffer are read);
    * ``store_left`` / ``store_right``: a dKV warpgroup's accumulator into its columns of ``Part[qc]``."""
    dh = d_v // 2
    has_tail = d_tail > 0
    words = block_k // 32
    scale_log2 = softmax_scale * LOG2E
    bf16 = T.bfloat16
    load_cols, load_rows, load_meta = _load_macros(T, rows_per_pass=128 // 8, dh=dh, d_tail=d_tail, d_v=d_v,
                                                   block_r=block_r, words=words, heads=heads)

    @T.macro
    def load_left(Q, dO, Lse, Delta, Bits, kb, r0, r_hi, lt, q_l, do_l, lse_t, dl_t, bits_t, bar, stage):
        load_cols(Q, r0, r_hi, lt, block_r, q_l, 0, dh)
        load_cols(dO, r0, r_hi, lt, block_r, do_l, 0, dh)
        load_meta(Lse, Delta, Bits, kb, r0, r_hi, lt, lse_t, dl_t, bits_t)
        T.cp_async_barrier_noinc(bar[stage])

    @T.macro
    def load_right(Q, dO, r0, r_hi, lt, q_r, q_t, do_r, bar, stage):
        load_cols(Q, r0, r_hi, lt, block_r, q_r, dh, dh)
        if has_tail:
            load_cols(Q, r0, r_hi, lt, block_r, q_t, d_v, d_tail)
        load_cols(dO, r0, r_hi, lt, block_r, do_r, dh, dh)
        T.cp_async_barrier_noinc(bar[stage])

    @T.macro
    def scores(kl, kr, kt, q_l, q_r, q_t, do_l, do_r, lse_t, dl_t, bits_t, s_f, dp_f, p_s, ds_s, bar_ready,
               stage, parity):
        # score warpgroup, one tile: S^T and dP^T, then P and dS into this tile's buffers
        T.barrier_wait(bar_ready[stage], parity)
        T.fence_proxy_async()  # cp.async (generic proxy) data, read next by the tensor cores
        T.wgmma_gemm(kl, q_l, s_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(kr, q_r, s_f, transpose_B=True)
        if has_tail:
            T.wgmma_gemm(kt, q_t, s_f, transpose_B=True)
        T.wgmma_gemm(kl, do_l, dp_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(kr, do_r, dp_f, transpose_B=True)
        T.wait_wgmma(0)
        # P and dS in place of S^T / dP^T in registers first, then stored: one loop storing each element between the
        # per-element loads of LSE, Delta and the mask word kept nvcc from hoisting those loads (it cannot move a
        # shared load above a shared store that may alias it); 1.46x the kernel at 16 heads, 8K (H200)
        for j, i in T.Parallel(block_k, block_r):
            sel = ((bits_t[i, j // 32] >> (j % 32)) & 1) == 1
            p = T.if_then_else(sel, T.exp2(s_f[j, i] * scale_log2 - lse_t[i] * LOG2E), 0)
            s_f[j, i] = p
            dp_f[j, i] = p * (dp_f[j, i] - dl_t[i]) * softmax_scale
        for j, i in T.Parallel(block_k, block_r):
            p_s[j, i] = T.cast(s_f[j, i], bf16)
            ds_s[j, i] = T.cast(dp_f[j, i], bf16)
        T.fence_proxy_async()  # generic smem writes of P / dS, read next by the other warpgroups' MMAs

    @T.macro
    def updates_left(p_s, ds_s, q_l, do_l, acc_l, bar_full, bar_free, stage, parity):
        T.barrier_wait(bar_full[stage], parity)
        T.fence_proxy_async()
        T.wgmma_gemm(ds_s, q_l, acc_l)
        T.wgmma_gemm(p_s, do_l, acc_l)
        T.wait_wgmma(0)
        T.barrier_arrive(bar_free[stage])

    @T.macro
    def updates_right(p_s, ds_s, q_r, q_t, do_r, acc_r, acc_t, bar_full, bar_free, stage, parity):
        T.barrier_wait(bar_full[stage], parity)
        T.fence_proxy_async()
        T.wgmma_gemm(ds_s, q_r, acc_r)
        T.wgmma_gemm(p_s, do_r, acc_r)
        if has_tail:
            T.wgmma_gemm(ds_s, q_t, acc_t)
        T.wait_wgmma(0)
        T.barrier_arrive(bar_free[stage])

    @T.macro
    def store_left(Part, qc, k0, t_kv, acc_l):
        for j, d in T.Parallel(block_k, dh):
            if k0 + j < t_kv:
                Part[qc, k0 + j, d] = acc_l[j, d]

    @T.macro
    def store_right(Part, qc, k0, t_kv, acc_r, acc_t):
        for j, d in T.Parallel(block_k, dh):
            if k0 + j < t_kv:
                Part[qc, k0 + j, dh + d] = acc_r[j, d]
        if has_tail:
            for j, d in T.Parallel(block_k, d_tail):
                if k0 + j < t_kv:
                    Part[qc, k0 + j, d_v + d] = acc_t[j, d]

    return load_rows, load_left, load_right, scores, updates_left, updates_right, store_left, store_right


@functools.cache
def _jit_dkv_key_blocks_ws():
    tilelang, T = tilelang_modules()

    # No thread-storage syncs: the mbarriers order every shared-memory handover (docstring). TileLang's inserted
    # warpgroup syncs split a dKV warpgroup's ``if`` between its two GEMMs on the NoPE latent, and ptxas then
    # serialised every wgmma of the kernel (C7514): 10.1 ms instead of 6.9 at 16 heads, 8K tokens (H200).
    @tilelang.jit(
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
            tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
        },
    )
    def sparse_mla_dkv_key_blocks_ws(heads: int, d_qk: int, d_v: int, softmax_scale: float,
                                     block_k: int = KEY_BLOCK, block_r: int = ROW_TILE,
                                     nreg: tuple[int, int, int] = WS_NREG):
        """The key-block dKV kernel (same contract, grid and ``Part`` as ``_jit_dkv_key_blocks``), warp-specialised
        so that one tile's score GEMMs run under the previous tile's dKV GEMMs and the tile after next's loads
        (schedule ``"wsp"``). 384 threads:

        * warpgroup 0 (scores): loads the key block once; per row tile, waits for its stage, forms ``S^T`` and
          ``dP^T``, then ``P`` and ``dS`` in its registers, writes them (bf16) into the tile's ``P`` / ``dS`` buffer
          (two, by tile parity) and signals;
        * warpgroups 1 and 2 (dKV): ``dKV += dS^T Q + P^T dO``, warpgroup 1 for the left half of ``d_v``, warpgroup 2
          for the right half and the RoPE tail. Each also loads the columns of the row tiles it alone reads
          (warpgroup 1 the left halves of ``Q`` / ``dO`` and the tile's LSE, Delta and mask words, warpgroup 2 the
          right halves and the tail) into two stages: tile ``n + 2`` as soon as both have finished tile ``n``.

        The load of tile ``n + 2`` runs under the score warpgroup's tile ``n + 1``. (The first version, ``ws``, had
        the score warpgroup load each tile right before scoring it, so every tile's load latency was exposed: at 16
        heads, 8K tokens the score warpgroup was busy 80 % of the time and the dKV warpgroups waited for it 80 %;
        8.05 -> 7.20 ms on H200 with GLM-5's latent, 7.40 -> 6.91 on the NoPE one.) ``bar_ready`` of tile ``n + 2``
        completes only after tile ``n``'s dKV GEMMs, so it also frees the ``P`` / ``dS`` buffer. Every element is
        formed as in the ``split`` schedule (same GEMM k-order, same fp32 ``P`` into ``dS``): bitwise equal to it
        (GPU-tested)."""
        from megatron_glm5.kernels.sparse_mla_fwd import LAUNCH_REGS_384, check_register_split

        grow = tuple(int(n >= LAUNCH_REGS_384) for n in nreg)  # setmaxnreg.inc from the launch's share up, else .dec
        check_register_split(nreg, grow)
        _check_ws_shape(d_qk, d_v, block_k, block_r)
        dh = d_v // 2
        d_tail = d_qk - d_v
        has_tail = d_tail > 0
        words = block_k // 32
        n_flat = T.dynamic("n_flat")
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_words = T.dynamic("n_words")
        n_kb = T.dynamic("n_kb")
        n_chunk = T.dynamic("n_chunk")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32

        (load_rows, load_left, load_right, scores, updates_left, updates_right, store_left,
         store_right) = _ws_macros(T, heads=heads, d_v=d_v, d_tail=d_tail, block_k=block_k, block_r=block_r,
                                   softmax_scale=softmax_scale)

        @T.prim_func
        def main(
            Q: T.Tensor([n_flat, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            dO: T.Tensor([n_flat, d_v], bf16),
            Lse: T.Tensor([n_flat], f32),
            Delta: T.Tensor([n_flat], f32),
            Bits: T.Tensor([t_len, n_words], i32),
            QRange: T.Tensor([n_kb, 2], i32),
            Part: T.Tensor([n_chunk, t_kv, d_qk], f32),
        ):
            with T.Kernel(T.ceildiv(t_kv, block_k), n_chunk, threads=384) as (kb, qc):
                kl = T.alloc_shared([block_k, dh], bf16)
                kr = T.alloc_shared([block_k, dh], bf16)
                kt = T.alloc_shared([block_k, d_tail], bf16) if has_tail else None
                q0_l = T.alloc_shared([block_r, dh], bf16)
                q0_r = T.alloc_shared([block_r, dh], bf16)
                q0_t = T.alloc_shared([block_r, d_tail], bf16) if has_tail else None
                do0_l = T.alloc_shared([block_r, dh], bf16)
                do0_r = T.alloc_shared([block_r, dh], bf16)
                q1_l = T.alloc_shared([block_r, dh], bf16)
                q1_r = T.alloc_shared([block_r, dh], bf16)
                q1_t = T.alloc_shared([block_r, d_tail], bf16) if has_tail else None
                do1_l = T.alloc_shared([block_r, dh], bf16)
                do1_r = T.alloc_shared([block_r, dh], bf16)
                lse0 = T.alloc_shared([block_r], f32)
                dl0 = T.alloc_shared([block_r], f32)
                bits0 = T.alloc_shared([block_r, words], i32)
                lse1 = T.alloc_shared([block_r], f32)
                dl1 = T.alloc_shared([block_r], f32)
                bits1 = T.alloc_shared([block_r, words], i32)
                p0_s = T.alloc_shared([block_k, block_r], bf16)
                ds0_s = T.alloc_shared([block_k, block_r], bf16)
                p1_s = T.alloc_shared([block_k, block_r], bf16)
                ds1_s = T.alloc_shared([block_k, block_r], bf16)

                s_f = T.alloc_fragment([block_k, block_r], f32)
                dp_f = T.alloc_fragment([block_k, block_r], f32)
                acc_l = T.alloc_fragment([block_k, dh], f32)
                acc_r = T.alloc_fragment([block_k, dh], f32)
                acc_t = T.alloc_fragment([block_k, d_tail], f32) if has_tail else None

                bar_ready = T.alloc_barrier([256, 256])  # dKV warpgroups' cp.async -> score warpgroup, per stage
                bar_full = T.alloc_barrier([128, 128])  # score warpgroup -> dKV warpgroups: P / dS of a tile
                bar_free = T.alloc_barrier([256, 256])  # dKV warpgroups -> themselves: stage and P / dS read
                bar_key = T.alloc_barrier([128])  # the score warpgroup's cp.async of the key block

                tx = T.get_thread_binding()
                k0 = kb * block_k
                qpc = T.ceildiv(t_len, n_chunk)
                q_lo = T.max(qc * qpc, QRange[kb, 0])
                q_hi = T.min(T.min((qc + 1) * qpc, QRange[kb, 1]), t_len)
                r_lo = q_lo * heads
                r_hi = q_hi * heads
                n_tiles = T.if_then_else(q_hi > q_lo, T.ceildiv(r_hi - r_lo, block_r), 0)

                if tx < 128:
                    T.set_max_nreg(nreg[0], grow[0])
                    if n_tiles > 0:
                        load_rows(KV, k0, t_kv, tx, block_k, kl, kr, kt, d_v)
                        T.cp_async_barrier_noinc(bar_key[0])
                        T.barrier_wait(bar_key[0], 0)
                    for ip in T.serial(T.ceildiv(n_tiles, 2)):
                        scores(kl, kr, kt, q0_l, q0_r, q0_t, do0_l, do0_r, lse0, dl0, bits0, s_f, dp_f, p0_s,
                               ds0_s, bar_ready, 0, ip & 1)
                        T.barrier_arrive(bar_full[0])
                        if 2 * ip + 1 < n_tiles:
                            scores(kl, kr, kt, q1_l, q1_r, q1_t, do1_l, do1_r, lse1, dl1, bits1, s_f, dp_f, p1_s,
                                   ds1_s, bar_ready, 1, ip & 1)
                            T.barrier_arrive(bar_full[1])
                elif tx < 256:
                    T.set_max_nreg(nreg[1], grow[1])
                    lt = tx - 128
                    T.clear(acc_l)
                    if n_tiles > 0:
                        load_left(Q, dO, Lse, Delta, Bits, kb, r_lo, r_hi, lt, q0_l, do0_l, lse0, dl0, bits0,
                                  bar_ready, 0)
                    if n_tiles > 1:
                        load_left(Q, dO, Lse, Delta, Bits, kb, r_lo + block_r, r_hi, lt, q1_l, do1_l, lse1, dl1,
                                  bits1, bar_ready, 1)
                    for ip in T.serial(T.ceildiv(n_tiles, 2)):
                        updates_left(p0_s, ds0_s, q0_l, do0_l, acc_l, bar_full, bar_free, 0, ip & 1)
                        if 2 * ip + 2 < n_tiles:  # both dKV warpgroups are done with stage 0: tile 2 ip + 2
                            T.barrier_wait(bar_free[0], ip & 1)
                            load_left(Q, dO, Lse, Delta, Bits, kb, r_lo + (2 * ip + 2) * block_r, r_hi, lt,
                                      q0_l, do0_l, lse0, dl0, bits0, bar_ready, 0)
                        if 2 * ip + 1 < n_tiles:
                            updates_left(p1_s, ds1_s, q1_l, do1_l, acc_l, bar_full, bar_free, 1, ip & 1)
                            if 2 * ip + 3 < n_tiles:
                                T.barrier_wait(bar_free[1], ip & 1)
                                load_left(Q, dO, Lse, Delta, Bits, kb, r_lo + (2 * ip + 3) * block_r, r_hi, lt,
                                          q1_l, do1_l, lse1, dl1, bits1, bar_ready, 1)
                    store_left(Part, qc, k0, t_kv, acc_l)
                else:
                    T.set_max_nreg(nreg[2], grow[2])
                    lt = tx - 256
                    T.clear(acc_r)
                    if has_tail:
                        T.clear(acc_t)
                    if n_tiles > 0:
                        load_right(Q, dO, r_lo, r_hi, lt, q0_r, q0_t, do0_r, bar_ready, 0)
                    if n_tiles > 1:
                        load_right(Q, dO, r_lo + block_r, r_hi, lt, q1_r, q1_t, do1_r, bar_ready, 1)
                    for ip in T.serial(T.ceildiv(n_tiles, 2)):
                        updates_right(p0_s, ds0_s, q0_r, q0_t, do0_r, acc_r, acc_t, bar_full, bar_free, 0, ip & 1)
                        if 2 * ip + 2 < n_tiles:
                            T.barrier_wait(bar_free[0], ip & 1)
                            load_right(Q, dO, r_lo + (2 * ip + 2) * block_r, r_hi, lt, q0_r, q0_t, do0_r,
                                       bar_ready, 0)
                        if 2 * ip + 1 < n_tiles:
                            updates_right(p1_s, ds1_s, q1_r, q1_t, do1_r, acc_r, acc_t, bar_full, bar_free, 1,
                                          ip & 1)
                            if 2 * ip + 3 < n_tiles:
                                T.barrier_wait(bar_free[1], ip & 1)
                                load_right(Q, dO, r_lo + (2 * ip + 3) * block_r, r_hi, lt, q1_r, q1_t, do1_r,
                                           bar_ready, 1)
                    store_right(Part, qc, k0, t_kv, acc_r, acc_t)

        return main

    return sparse_mla_dkv_key_blocks_ws


def _check_inputs(q, kv, grad_out, lse, delta, d_v):
    t_len, heads, d_qk = q.shape
    for name, t, shape, dtype in (
        ("q", q, (t_len, heads, d_qk), torch.bfloat16),
        ("kv", kv, (kv.shape[0], d_qk), torch.bfloat16),
        ("grad_out", grad_out, (t_len, heads, d_v), torch.bfloat16),
        ("lse", lse, (t_len, heads), torch.float32),
        ("delta", delta, (t_len, heads), torch.float32),
    ):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape}, got {t.dtype} "
                             f"{tuple(t.shape)}")


def key_block_kernel(schedule: str, heads: int, d_qk: int, d_v: int, softmax_scale: float,
                     block_k: int = KEY_BLOCK):
    """The compiled key-block kernel of ``schedule`` (:data:`SCHEDULES`), built as :func:`dkv_key_blocks` builds it
    (TileLang's cache key includes how the arguments come: benchmarks and profiles take it from here)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    args = (heads, d_qk, d_v, float(softmax_scale), block_k)
    if schedule == "wsp":
        return _jit_dkv_key_blocks_ws()(*args)
    return _jit_dkv_key_blocks()(*args, **({} if schedule == "split" else {"schedule": schedule}))


def query_ranges(bits: torch.Tensor, indices: torch.Tensor, t_kv: int, block_k: int, ranges: str) -> torch.Tensor:
    """int32 ``[n_blocks, 2]`` query ranges per key block: exact from the bitmap, or a superset from the key spans."""
    if ranges == "span":
        return span_query_ranges(*row_key_span(indices, t_kv), t_kv, block_k)
    return key_block_query_range(bits, block_k)


def dkv_key_blocks(
    q: torch.Tensor,
    kv: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    n_chunks: int = 0,
    block_k: int = KEY_BLOCK,
    schedule: str = "wsp",
    ranges: str = "bitmap",
) -> torch.Tensor:
    """fp32 ``dKV [T_kv, d_qk]`` of sparse MLA from the saved ``lse`` and ``delta`` (``rowsum(O * dO) - dlse``, as
    the per-query backward's), by key blocks (module docstring). ``n_chunks`` 0: :func:`default_chunks`;
    ``schedule``: ``"wsp"`` (``_jit_dkv_key_blocks_ws``: warp-specialised, the dKV warpgroups loading the row tiles
    two ahead) or ``_jit_dkv_key_blocks``'s ``"split"`` / ``"plain"`` (all three bitwise equal).
    ``ranges``: each key block's query range from the bitmap (``"bitmap"``, exact) or from the rows' key spans
    (``"span"``, ``key_block_work.span_query_ranges``: a superset, equal on random causal sets, without the
    ``[T, n_blocks]`` passes; it costs 0.21-0.34 ms at 4K-16K tokens against 0.11-0.23 ms for the bitmap's ranges,
    H200: not the default; tiles start where the range does, so the sums may differ from ``"bitmap"``'s in order)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if ranges not in ("bitmap", "span"):
        raise ValueError(f"ranges must be 'bitmap' or 'span', got {ranges!r}")
    _check_inputs(q, kv, grad_out, lse, delta, d_v)
    t_len, heads, d_qk = q.shape
    t_kv = kv.shape[0]
    bits, _ = selection_bitmap(indices, t_kv, block_k=block_k)
    qrange = query_ranges(bits, indices, t_kv, block_k, ranges)
    n_chunks = n_chunks or default_chunks(t_len, t_kv, q.device, block_k, d_qk)
    part = torch.empty(n_chunks, t_kv, d_qk, dtype=torch.float32, device=q.device)
    if t_len == 0 or t_kv == 0:
        return part.zero_().sum(0)
    kernel = key_block_kernel(schedule, heads, d_qk, d_v, softmax_scale, block_k)
    kernel(q.view(t_len * heads, d_qk), kv, grad_out.view(t_len * heads, d_v), lse.view(-1), delta.view(-1), bits,
           qrange, part)
    return part.sum(0)


def dkv_key_blocks_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    n_chunks: int = 4,
    block_k: int = KEY_BLOCK,
    ranges: str = "bitmap",
) -> torch.Tensor:
    """The key-block algorithm in torch (fp32 math; ``P`` and ``dS`` rounded to ``q.dtype`` before their products,
    as the kernels do): same bitmap, query ranges and chunks as :func:`dkv_key_blocks`, dense per (block, chunk)."""
    t_len, heads, d_qk = q.shape
    t_kv = kv.shape[0]
    bits, _ = selection_bitmap(indices, t_kv, block_k=block_k)
    qrange = query_ranges(bits, indices, t_kv, block_k, ranges).tolist()
    part = torch.zeros(n_chunks, t_kv, d_qk, dtype=torch.float32, device=q.device)
    qpc = cdiv(t_len, n_chunks) if t_len else 0
    qf, kvf, dof = q.float(), kv.float(), grad_out.float()
    shift = torch.arange(32, device=q.device, dtype=torch.int32)
    for kb, (first, end) in enumerate(qrange):
        k0, k1 = kb * block_k, min(t_kv, (kb + 1) * block_k)
        for c in range(n_chunks):
            lo, hi = max(c * qpc, first), min((c + 1) * qpc, end, t_len)
            if hi <= lo:
                continue
            w = bits[lo:hi, k0 // 32 : cdiv(k1, 32)]  # [n, words]
            mask = ((w.unsqueeze(-1) >> shift) & 1).reshape(hi - lo, -1)[:, : k1 - k0].bool()  # [n, keys]
            s = torch.einsum("nhd,kd->nhk", qf[lo:hi], kvf[k0:k1]) * softmax_scale
            p = torch.where(mask[:, None, :], torch.exp(s - lse[lo:hi, :, None]), 0.0)
            dp = torch.einsum("nhd,kd->nhk", dof[lo:hi], kvf[k0:k1, :d_v])
            ds = p * (dp - delta[lo:hi, :, None]) * softmax_scale
            p, ds = p.to(q.dtype).float(), ds.to(q.dtype).float()
            g = torch.einsum("nhk,nhd->kd", ds, qf[lo:hi])
            g[:, :d_v] += torch.einsum("nhk,nhd->kd", p, dof[lo:hi])
            part[c, k0:k1] = g
    return part.sum(0)
