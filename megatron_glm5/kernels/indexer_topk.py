"""Lightning indexer + exact, deterministic top-k in TileLang, streamed over query chunks.

``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` (fp32) for ``starts[t] <= s < ends[t]``; the output is the
``topk`` best keys per row, sorted by score (descending), equal scores ordered by the lower key index, -1 tail when a
row has fewer candidates. Test oracle: ``megatron_glm5.dsa.reference.indexer_topk`` (same ordering rule).

Two kernels per query chunk of ``C`` rows; the only large temporary is the chunk's fp32 logits ``[C, T_kv]`` (no
``[T, T]`` tensor; ``C`` keeps it near ``LOGITS_CHUNK_BYTES``):

1. ``indexer_logits``: one CTA per ``128 // Hi`` queries. Each key tile ``[block_n, Di]`` meets all the CTA's
   (query, head) rows in one GEMM (keys as the M dimension), then ReLU, the per-head weights and the head sum run on
   the accumulator. Only key tiles inside the union of the CTA's row ranges are computed (causal rows skip the
   future); entries outside a row's own range are never read. Each head's ``relu(q.k) * w`` is rounded on its own
   (``__fmul_rn``) before the sum: left to itself the compiler fused some of the products into the sum's FMAs and
   not others, depending on the accumulator register, so identical keys scored differently in the last bits and
   did not tie (626 of 3000 rows); now identical keys give bitwise identical scores, at no measured cost.
2. ``topk_select``: one CTA per row, exact radix select over a 64-bit key ``(order-preserving score bits, ~index)``
   so every key is distinct and ties resolve to the lower index with no special case. 8-bit digits, a
   warp-aggregated shared-memory histogram (``match.any``) in the first round, early exit once the remaining bucket
   is taken whole (usually after 2-3 of the 4 score digits; index digits only run when equal scores straddle the
   boundary), the histogram's suffix sums by a warp-shuffle scan. The selected keys are collected with
   ballot-compacted writes and bitonic-sorted in shared memory. -0.0 and +0.0 get one key so that equal scores
   compare equal, as in the reference's ``torch.sort``. It is sized for residency: 256 threads, registers capped for 8 CTAs
   per SM (measured on H200: a row kept in shared memory, or a two-pass select with a candidate list, each left
   fewer CTAs per SM and ran 1.2-1.9x slower), and each thread loads 4 scores before binning them (one load at a
   time made every pass a chain of dependent loads: 8.89 -> 8.05 ms at 32K). With that it is issue-bound (ncu:
   SM 80.7 % at 95 % occupancy), so the instructions per score and pass are what counts: whole iterations run
   without clamps, tests or TileLang's access guards, the key map is three integer ops, TileLang's own barriers
   are left out (``lean``: about 15 instead of 30 SASS instructions per score and pass), and one pass both collects
   and shortlists once two rounds have fixed the k-th key's 16-bit prefix (``shortlist``): 8.03 -> 5.31 ms at 32K,
   24.10 -> 14.32 at 64K (``scripts/bench/RESULTS_kernels.md``, round 2, first, sixth and seventh sessions).

Provenance: the logits kernel's shape (keys as M, ``block_q = 128 // heads``, reshape + head reduction on the
fragment) follows megatron-core 0.19.2 ``ops/tilelang_indexer_fwd.py`` / tile-ai/tilelang
``examples/deepseek_v32/fp8_lighting_indexer.py``, but writes the tile with one coalesced parallel store instead of a
serial per-element loop, and bf16 instead of fp8. The radix select follows the idea of tile-ai/tilelang
``examples/deepseek_v32/topk_selector.py`` (8-bit histogram rounds) but is exact (no 4096-entry candidate buffer to
overflow, pitfall P9), deterministic (index bits in the key, no atomics deciding membership or order), sorted, and
pads with -1 instead of 0 (P2).

No ``from __future__ import annotations`` here: TileLang evaluates the nested prim_funcs' annotations.
"""

import functools
import logging
import os

import torch

from megatron_glm5.kernels._common import cdiv, check_tensor, env_switch, next_power_of_2, tilelang_modules

LOGITS_CHUNK_BYTES = 1 << 30
# The logits kernel with tile n + 1's GEMM under tile n's epilogue (``_jit_logits_overlap``): its key stages (3 or 4);
# 0 runs the plain kernel. ``MEGATRON_GLM5_LOGITS_OVERLAP`` overrides it per run. Off until measured on a GPU.
LOGITS_OVERLAP_ENV = "MEGATRON_GLM5_LOGITS_OVERLAP"
LOGITS_OVERLAP_STAGES = 0
# Indexer (heads, dim) the overlapped kernel and the counted first round were screened at (ptxas, no spills): GLM-5's.
# Other shapes keep the plain kernel (a review's ptxas runs: the overlapped kernel spills 300-1160 bytes at 8 or 16
# heads and at dim 256).
LOGITS_OPTION_SHAPES = frozenset({(32, 128)})
# The select's first radix round counted by the logits kernel as it stores the logits (``hist=True`` /
# ``topk_select(pre_hist=True)``): one pass over each row fewer. ``MEGATRON_GLM5_INDEXER_FUSED_HIST`` (1 / 0)
# overrides it per run. Off until measured on a GPU.
INDEXER_FUSED_HIST_ENV = "MEGATRON_GLM5_INDEXER_FUSED_HIST"
INDEXER_FUSED_HIST = False
# Shortlist entries of the select's third pass (``topk_select(shortlist=...)``): a few dozen keys share the k-th
# key's 16-bit prefix on indexer scores; 256 leaves room for ties and costs 2 KB of shared memory per CTA.
SHORTLIST = 256
# Bins of the select's first radix round: the top byte of its 32-bit score key (``first_round_histogram``).
FIRST_ROUND_BINS = 256


# --------------------------------------------------------------------------------------------------------------------
# TileLang factories
# --------------------------------------------------------------------------------------------------------------------


def _logits_macros(T, heads: int, dim: int, block_n: int, block_q: int, exact_products: bool,
                   explicit_sync: bool = False):
    """The logits kernels' shared pieces (TileLang macros): the CTA's query rows and head weights into shared
    memory / registers, one key tile's scores (GEMM, then ``finish_tile``), and ``finish_tile`` alone (ReLU, weights,
    head sum and store of a tile's GEMM result). ``explicit_sync``: for a kernel built without TileLang's
    thread-storage syncs, the barrier between the head sum's ``l_s`` and the store."""
    f32 = T.float32

    @T.macro
    def load_query_rows(Q, W, q_s, w_f, r_base, t_base, n_rows, t_len):
        for i, h, d in T.Parallel(block_q, heads, dim):
            q_s[i * heads + h, d] = T.if_then_else(
                r_base + i < n_rows, Q[T.min(t_base + i, t_len - 1), h, d], 0
            )
        for i, h in T.Parallel(block_q, heads):
            w_f[i, h] = T.if_then_else(r_base + i < n_rows, W[T.min(t_base + i, t_len - 1), h], 0)

    @T.macro
    def finish_tile(s_f, s_r, w_f, l_s, Logits, r_base, k0, n_rows, hi):
        for n, i, h in T.Parallel(block_n, block_q, heads):
            if exact_products:
                s_r[n, i, h] = T.call_extern(f32, "__fmul_rn", T.max(s_r[n, i, h], 0), w_f[i, h])
            else:
                s_r[n, i, h] = T.max(s_r[n, i, h], 0) * w_f[i, h]
        T.reduce_sum(s_r, l_s, dim=-1, clear=True)
        if explicit_sync:  # (trace time) a kernel built without TileLang's storage syncs: l_s written, then read
            T.sync_threads()
        for i, n in T.Parallel(block_q, block_n):
            if r_base + i < n_rows and k0 + n < hi:
                Logits[r_base + i, k0 + n] = l_s[n, i]

    @T.macro
    def score_tile(k_s, q_s, s_f, s_r, w_f, l_s, Logits, r_base, k0, n_rows, hi):
        T.gemm(k_s, q_s, s_f, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
        finish_tile(s_f, s_r, w_f, l_s, Logits, r_base, k0, n_rows, hi)

    return load_query_rows, score_tile, finish_tile


def _logits_entry(T, kernel, hist: bool, heads: int, dim: int, t_len, t_kv, n_rows):
    """The prim_func of a logits kernel whose body is the macro ``kernel(Q, K, W, Starts, Ends, RowOffset, Logits,
    Hist)``: with ``hist`` its ``Hist [n_rows, 256]`` argument, else the signature (and kernel) of the builds before
    the option, ``kernel`` getting ``Hist=None``."""
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    if hist:
        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, dim], bf16),
            K: T.Tensor([t_kv, dim], bf16),
            W: T.Tensor([t_len, heads], f32),
            Starts: T.Tensor([t_len], i32),
            Ends: T.Tensor([t_len], i32),
            RowOffset: T.Tensor([1], i32),
            Logits: T.Tensor([n_rows, t_kv], f32),
            Hist: T.Tensor([n_rows, FIRST_ROUND_BINS], i32),
        ):
            kernel(Q, K, W, Starts, Ends, RowOffset, Logits, Hist)
    else:
        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, dim], bf16),
            K: T.Tensor([t_kv, dim], bf16),
            W: T.Tensor([t_len, heads], f32),
            Starts: T.Tensor([t_len], i32),
            Ends: T.Tensor([t_len], i32),
            RowOffset: T.Tensor([1], i32),
            Logits: T.Tensor([n_rows, t_kv], f32),
        ):
            kernel(Q, K, W, Starts, Ends, RowOffset, Logits, None)
    return main


def _hist_macros(T, block_n: int, block_q: int, threads: int):
    """The logits kernels' optional first radix round of the select (``hist=True``): per chunk row, how many of its
    keys have each top byte of the select's order-preserving score key (:func:`first_round_histogram`). The CTA
    counts its ``block_q`` rows in shared memory as it stores each tile (one shared atomic per distinct (row, byte)
    per warp, as the select's first round aggregates them) and writes ``Hist[r, 256]`` at the end, so the select
    starts at its second round (``topk_select(pre_hist=True)``): one pass over each row fewer."""
    i32, u32 = T.int32, T.uint32
    bins = block_q * FIRST_ROUND_BINS
    per_thread_bins = bins // threads
    per_thread_scores = block_q * block_n // threads
    if bins % threads or (block_q * block_n) % threads:
        raise ValueError(f"the histogram needs block_q * 256 and block_q * block_n multiples of threads; got "
                         f"block_q={block_q}, block_n={block_n}, threads={threads}")

    @T.macro
    def hist_start(Starts, Ends, rs_s, re_s, h_s, t_base, r_base, n_rows, t_kv, tx):
        # each row's own key range, clamped as the select clamps it (empty past n_rows), and zero counts
        if tx < block_q:
            live = r_base + tx < n_rows
            s = T.max(T.min(Starts[t_base + T.if_then_else(live, tx, 0)], t_kv), 0)
            e = T.max(T.min(Ends[t_base + T.if_then_else(live, tx, 0)], t_kv), s)
            rs_s[tx] = T.if_then_else(live, s, 0)
            re_s[tx] = T.if_then_else(live, e, 0)
        for v in T.unroll(per_thread_bins):
            h_s[v * threads + tx] = 0
        T.sync_threads()

    @T.macro
    def hist_tile(l_s, h_s, rs_s, re_s, k0, tx):
        # after the tile's store: its scores are still in l_s [block_n, block_q]
        lane = tx % 32
        below = (T.uint32(1) << T.cast(lane, u32)) - T.uint32(1)
        for v in T.unroll(per_thread_scores):
            idx = v * threads + tx
            i = idx // block_n
            key = k0 + idx % block_n
            bits = T.reinterpret(l_s[idx % block_n, i], u32)
            sg = T.cast(T.shift_right(T.cast(bits, i32), 31), u32)
            top = (((bits & T.uint32(0x7FFFFFFF)) ^ sg) - sg + T.uint32(0x80000000)) >> T.uint32(24)
            dg = T.if_then_else(key >= rs_s[i] and key < re_s[i], i * FIRST_ROUND_BINS + T.cast(top, i32), bins)
            peers = T.match_any_sync(dg)  # every lane of the warp, every iteration: no guard around it
            if dg < bins and (peers & below) == T.uint32(0):
                # a shared-memory atomic as an extern call (TileLang's atomic_add made its barrier planner put two
                # block barriers into every iteration; counts need none until the store)
                T.call_extern(i32, "atomicAdd", T.address_of(h_s[dg]), T.cast(T.popcount(peers), i32))

    @T.macro
    def hist_store(h_s, Hist, r_base, n_rows, tx):
        T.sync_threads()
        for v in T.unroll(per_thread_bins):
            idx = v * threads + tx
            if r_base + idx // FIRST_ROUND_BINS < n_rows:
                Hist[r_base + idx // FIRST_ROUND_BINS, idx % FIRST_ROUND_BINS] = h_s[idx]

    return hist_start, hist_tile, hist_store


@functools.cache
def _jit_logits():
    tilelang, T = tilelang_modules()

    @tilelang.jit
    def indexer_logits(heads: int, dim: int, block_n: int = 128, num_stages: int = 2, threads: int = 256,
                       block_q: int = 0, exact_products: bool = True):
        """fp32 ``Logits[r, s]`` for chunk rows ``r`` (token ``RowOffset + r``) and keys in the CTA's row ranges.

        ``block_q``: queries per CTA (0: ``128 // heads``, one 128-column GEMM). ``exact_products``: each
        ``relu(q.k) * w`` is rounded on its own (``__fmul_rn``) before the head sum, so the compiler cannot fuse
        some of them into the sum's FMAs and not others: identical keys then give bitwise identical scores."""
        block_q = block_q or max(1, 128 // heads)
        n_cols = block_q * heads
        if n_cols % 16 or dim % 16:
            raise ValueError(f"indexer kernel needs (128 // heads) * heads and dim multiples of 16; got {heads}, {dim}")
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_rows = T.dynamic("n_rows")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        load_query_rows, score_tile, _ = _logits_macros(T, heads, dim, block_n, block_q, exact_products)

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, dim], bf16),
            K: T.Tensor([t_kv, dim], bf16),
            W: T.Tensor([t_len, heads], f32),
            Starts: T.Tensor([t_len], i32),
            Ends: T.Tensor([t_len], i32),
            RowOffset: T.Tensor([1], i32),
            Logits: T.Tensor([n_rows, t_kv], f32),
        ):
            with T.Kernel(T.ceildiv(n_rows, block_q), threads=threads) as bx:
                q_s = T.alloc_shared([n_cols, dim], bf16)
                k_s = T.alloc_shared([block_n, dim], bf16)
                s_f = T.alloc_fragment([block_n, n_cols], f32)
                s_r = T.reshape(s_f, [block_n, block_q, heads])
                w_f = T.alloc_fragment([block_q, heads], f32)
                l_s = T.alloc_shared([block_n, block_q], f32)
                lo = T.alloc_var(i32)
                hi = T.alloc_var(i32)

                r_base = bx * block_q
                t_base = RowOffset[0] + r_base
                lo = t_kv
                hi = 0
                for i in T.serial(block_q):
                    if r_base + i < n_rows:
                        s = T.max(T.min(Starts[t_base + i], t_kv), 0)
                        e = T.max(T.min(Ends[t_base + i], t_kv), 0)
                        if e > s:
                            lo = T.min(lo, s)
                            hi = T.max(hi, e)
                load_query_rows(Q, W, q_s, w_f, r_base, t_base, n_rows, t_len)

                for kb in T.Pipelined(T.ceildiv(T.max(hi - lo, 0), block_n), num_stages=num_stages):
                    k0 = lo + kb * block_n
                    T.copy(K[k0 : k0 + block_n, :], k_s)
                    score_tile(k_s, q_s, s_f, s_r, w_f, l_s, Logits, r_base, k0, n_rows, hi)

        return main

    return indexer_logits


@functools.cache
def _jit_logits_plain():
    tilelang, T = tilelang_modules()

    @tilelang.jit(
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        },
    )
    def indexer_logits_plain(heads: int, dim: int, block_n: int = 128, threads: int = 128, min_blocks: int = 2,
                             block_q: int = 0, hist: bool = False):
        """The logits kernel's contract (``indexer_logits``, exact products) without warp specialisation: every
        thread loads key tiles with predicated ``cp.async`` (zero-fill past ``T_kv``) into two stages by hand, and
        registers are capped for ``min_blocks`` CTAs per SM, so one CTA's epilogue (ReLU, weights, head sum, store)
        runs while another's GEMM holds the tensor cores; the specialised kernel is one CTA per SM whose epilogue
        does not overlap its next GEMM. The interface's kernel where the shape allows (:func:`logits_kernel`).
        ``block_q``: queries per CTA (0: ``128 // heads``); each key tile is read from L2 once per CTA, so more
        queries per CTA read fewer key bytes (8 at 32 heads: a ``[block_n, 256]`` accumulator). ``hist``: also the
        select's first radix round, ``Hist [n_rows, 256]`` int32 (:func:`_hist_macros`; experimental), an extra last
        argument; without it the kernel is the one before this option (same generated source)."""
        block_q = block_q or max(1, 128 // heads)
        n_cols = block_q * heads
        chunks = dim // 8  # 16-byte cp.async pieces per key row
        if not plain_logits_fits(heads, dim, block_n, threads) or n_cols % 16:
            raise ValueError(f"plain logits kernel needs block_q * heads % 16 == 0, dim % 64 == 0 and the tile "
                             f"split evenly over the threads; got heads={heads}, dim={dim}, threads={threads}, "
                             f"block_q={block_q}")
        rows_per_pass = threads // chunks
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_rows = T.dynamic("n_rows")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32

        @T.macro
        def load_tile(K, k_s, k0, t_kv, tx):
            for r in T.unroll(block_n // rows_per_pass):
                row = r * rows_per_pass + tx // chunks
                col = (tx % chunks) * 8
                key = k0 + row
                T.ptx_cp_async(
                    T.access_ptr(k_s[row, col], "w", 8),
                    T.access_ptr(K[T.min(key, t_kv - 1), col], "r", 8),
                    8,
                    predicate=key < t_kv,
                )
            T.ptx_commit_group()

        load_query_rows, score_tile, _ = _logits_macros(T, heads, dim, block_n, block_q, True)

        hist_start, hist_tile, hist_store = _hist_macros(T, block_n, block_q, threads) if hist else (None,) * 3

        @T.macro
        def kernel(Q, K, W, Starts, Ends, RowOffset, Logits, Hist):
            with T.Kernel(T.ceildiv(n_rows, block_q), threads=threads) as bx:
                T.annotate_min_blocks_per_sm(min_blocks)
                q_s = T.alloc_shared([n_cols, dim], bf16)
                k0_s = T.alloc_shared([block_n, dim], bf16)
                k1_s = T.alloc_shared([block_n, dim], bf16)
                s_f = T.alloc_fragment([block_n, n_cols], f32)
                s_r = T.reshape(s_f, [block_n, block_q, heads])
                w_f = T.alloc_fragment([block_q, heads], f32)
                l_s = T.alloc_shared([block_n, block_q], f32)
                lo = T.alloc_var(i32)
                hi = T.alloc_var(i32)
                if Hist is not None:
                    h_s = T.alloc_shared([block_q * FIRST_ROUND_BINS], i32)
                    rs_s = T.alloc_shared([block_q], i32)
                    re_s = T.alloc_shared([block_q], i32)

                tx = T.get_thread_binding()
                r_base = bx * block_q
                t_base = RowOffset[0] + r_base
                lo = t_kv
                hi = 0
                for i in T.serial(block_q):
                    if r_base + i < n_rows:
                        s = T.max(T.min(Starts[t_base + i], t_kv), 0)
                        e = T.max(T.min(Ends[t_base + i], t_kv), 0)
                        if e > s:
                            lo = T.min(lo, s)
                            hi = T.max(hi, e)
                n_tiles = T.ceildiv(T.max(hi - lo, 0), block_n)
                if n_tiles > 0:
                    load_tile(K, k0_s, lo, t_kv, tx)
                load_query_rows(Q, W, q_s, w_f, r_base, t_base, n_rows, t_len)
                if Hist is not None:
                    hist_start(Starts, Ends, rs_s, re_s, h_s, t_base, r_base, n_rows, t_kv, tx)

                for ip in T.serial(T.ceildiv(n_tiles, 2)):
                    # even tile in stage 0 (the odd one loads meanwhile), then the odd tile in stage 1
                    if 2 * ip + 1 < n_tiles:
                        load_tile(K, k1_s, lo + (2 * ip + 1) * block_n, t_kv, tx)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    T.fence_proxy_async()
                    score_tile(k0_s, q_s, s_f, s_r, w_f, l_s, Logits, r_base, lo + 2 * ip * block_n, n_rows, hi)
                    if Hist is not None:
                        hist_tile(l_s, h_s, rs_s, re_s, lo + 2 * ip * block_n, tx)
                    T.sync_threads()
                    if 2 * ip + 1 < n_tiles:
                        if 2 * ip + 2 < n_tiles:
                            load_tile(K, k0_s, lo + (2 * ip + 2) * block_n, t_kv, tx)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()
                        T.fence_proxy_async()
                        score_tile(k1_s, q_s, s_f, s_r, w_f, l_s, Logits, r_base, lo + (2 * ip + 1) * block_n,
                                   n_rows, hi)
                        if Hist is not None:
                            hist_tile(l_s, h_s, rs_s, re_s, lo + (2 * ip + 1) * block_n, tx)
                        T.sync_threads()
                if Hist is not None:
                    hist_store(h_s, Hist, r_base, n_rows, tx)

        return _logits_entry(T, kernel, hist, heads, dim, t_len, t_kv, n_rows)

    return indexer_logits_plain


@functools.cache
def _jit_logits_overlap():
    """The overlapped logits factory: built by default without TileLang's thread-storage syncs (``storage_sync=False``:
    the kernel places its two barriers per step itself), or with them (``storage_sync=True``, for comparison)."""
    tilelang, T = tilelang_modules()
    configs = {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
               tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    build = _logits_overlap_program(T)
    synced = tilelang.jit(pass_configs=configs)(build)
    lean = tilelang.jit(pass_configs={**configs, tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})(build)

    def indexer_logits_overlap(heads: int, dim: int, block_n: int = 64, threads: int = 128, min_blocks: int = 2,
                               stages: int = 3, hist: bool = False, storage_sync: bool = False):
        return (synced if storage_sync else lean)(heads, dim, block_n, threads, min_blocks, stages, hist, storage_sync)

    indexer_logits_overlap.__doc__ = build.__doc__
    return indexer_logits_overlap


def _logits_overlap_program(T):
    def indexer_logits_overlap(heads: int, dim: int, block_n: int = 64, threads: int = 128, min_blocks: int = 2,
                               stages: int = 3, hist: bool = False, storage_sync: bool = False):
        """The logits kernel's contract (``indexer_logits``, exact products) with tile ``n + 1``'s GEMM running while
        the warpgroup finishes tile ``n`` (opt-in, not yet measured on a GPU). Why: the plain kernel (the interface's)
        runs each tile's load wait -> GEMM -> ReLU / weights / head sum / store in series on its one warpgroup, and
        only the second CTA on the SM overlaps it (ncu, H200, 32K: SM 50.7 %, L2 27.6 %, latency-bound; about 45 %
        of the tensor peak by its 9.6 ms, derived, not an ncu figure). Here two accumulators alternate: tile
        ``n + 1``'s ``wgmma`` is issued (asynchronously) before tile ``n``'s epilogue, whose register math then runs
        under it (FA3's intra-warpgroup overlap), and ``stages`` key stages keep the next tiles' ``cp.async`` in
        flight meanwhile (tile
        ``n + stages - 1`` is loaded in step ``n``, into the stage tile ``n - 1`` used). ``block_n`` 64: two
        ``[64, 128]`` fp32 accumulators are 128 registers per thread, where two 128-key ones would not fit.

        How the steps are laid out is what keeps ``ptxas`` from serialising the ``wgmma`` (its C7514 / C7515: a
        non-``wgmma`` instruction touching an in-flight accumulator; checked with ``scripts/bench/ptxas_regs.py``):
        every step issues its next GEMM and waits ``wait_group 1`` unconditionally (past the CTA's last tile the GEMM
        reads a stale stage and its scores are never stored; only the epilogue is skipped, whose accumulator is no
        longer in flight), so no control-flow merge copies an in-flight accumulator; and no GEMM is in flight across
        the loop's back edge (``wait_group 0`` at the end of each pass over the two unrolled steps: it leaves a gap
        between two GEMM issues, the epilogue still overlaps), whose phi copies did the same. The loop body is the
        two steps of the two accumulators (static); the key stages are one ``[stages, block_n, dim]`` buffer indexed
        by ``n % stages`` (a descriptor offset), so a CTA runs at most one step past its last tile.

        Barriers (``storage_sync=False``, the default): two per step, placed here (``storage_sync=True`` leaves them
        to TileLang's planner, which puts in more).
        The one in ``issue`` (after this thread's ``cp.async`` wait, before the GEMM) makes the tile's copies
        visible, and also orders the previous step's reads of ``l_s`` before this step's writes; the one between the
        head sum's write of ``l_s`` and the store's reads (``finish_tile``'s ``explicit_sync``). A stage is refilled
        only in a step after an epilogue (every warp past its ``wait_group 1`` on the GEMM that read it, then that
        epilogue's barrier), and the counts' zeroing and store have their own barriers.

        Bitwise equal to the plain kernel by construction: each score is the same 8-step ``k16`` dot product over
        ``dim`` (the key tiling does not change a row's reduction) and the same per-head products and head sum
        (``finish_tile``, shared with the other kernels). ``hist``: also the select's first radix round, as the plain
        kernel's ``hist`` (experimental)."""
        block_q = max(1, 128 // heads)
        n_cols = block_q * heads
        chunks = dim // 8  # 16-byte cp.async pieces per key row
        if not plain_logits_fits(heads, dim, block_n, threads) or n_cols % 16 or threads != 128 or block_n != 64 \
                or stages not in (3, 4):
            raise ValueError(f"overlap logits kernel needs one warpgroup (threads=128), 64-key tiles, 3 or 4 stages, "
                             f"(128 // heads) * heads % 16 == 0 and dim % 64 == 0; got heads={heads}, dim={dim}, "
                             f"block_n={block_n}, threads={threads}, stages={stages}")
        rows_per_pass = threads // chunks
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_rows = T.dynamic("n_rows")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        n_acc = 2
        steps = list(range(n_acc))  # the loop body: one step per accumulator (a Python list expands at trace time)
        ahead = stages - 1  # tiles loaded ahead of the one whose GEMM runs
        first_tiles = list(range(ahead))
        acc_regs = block_n * n_cols // threads  # fp32 accumulator registers per thread

        @T.macro
        def load_tile(K, k_all, stage, k0, t_kv, tx):
            for r in T.unroll(block_n // rows_per_pass):
                row = r * rows_per_pass + tx // chunks
                col = (tx % chunks) * 8
                key = k0 + row
                T.ptx_cp_async(
                    T.access_ptr(k_all[stage, row, col], "w", 8),
                    T.access_ptr(K[T.min(key, t_kv - 1), col], "r", 8),
                    8,
                    predicate=key < t_kv,
                )
            T.ptx_commit_group()

        @T.macro
        def load_or_skip(K, k_all, n, n_tiles, lo, t_kv, tx):
            # one commit group per tile whether or not it exists, so that "all but the newest ``stages - 2``
            # groups done" always means the next tile has landed
            if n < n_tiles:
                load_tile(K, k_all, n % stages, lo + n * block_n, t_kv, tx)
            else:
                T.ptx_commit_group()

        load_query_rows, _, finish_tile = _logits_macros(T, heads, dim, block_n, block_q, True,
                                                         explicit_sync=not storage_sync)

        @T.macro
        def issue(k_all, n, q_s, s_f):
            # this thread's copies of the tile are done; the barrier makes everyone's visible, the fence hands them
            # (generic proxy) to the tensor cores (async proxy); the GEMM is left running
            T.ptx_wait_group(stages - 2)
            T.sync_threads()
            T.fence_proxy_async()
            T.wgmma_gemm(k_all[n % stages, :, :], q_s, s_f, transpose_B=True, clear_accum=True)

        hist_start, hist_tile, hist_store = _hist_macros(T, block_n, block_q, threads) if hist else (None,) * 3

        @T.macro
        def kernel(Q, K, W, Starts, Ends, RowOffset, Logits, Hist):
            with T.Kernel(T.ceildiv(n_rows, block_q), threads=threads) as bx:
                T.annotate_min_blocks_per_sm(min_blocks)
                q_s = T.alloc_shared([n_cols, dim], bf16)
                k_all = T.alloc_shared([stages, block_n, dim], bf16)
                s0_f = T.alloc_fragment([block_n, n_cols], f32)
                s1_f = T.alloc_fragment([block_n, n_cols], f32)
                s0_r = T.reshape(s0_f, [block_n, block_q, heads])
                s1_r = T.reshape(s1_f, [block_n, block_q, heads])
                w_f = T.alloc_fragment([block_q, heads], f32)
                l_s = T.alloc_shared([block_n, block_q], f32)
                lo = T.alloc_var(i32)
                hi = T.alloc_var(i32)
                accs = ((s0_f, s0_r), (s1_f, s1_r))
                if Hist is not None:
                    h_s = T.alloc_shared([block_q * FIRST_ROUND_BINS], i32)
                    rs_s = T.alloc_shared([block_q], i32)
                    re_s = T.alloc_shared([block_q], i32)

                tx = T.get_thread_binding()
                r_base = bx * block_q
                t_base = RowOffset[0] + r_base
                lo = t_kv
                hi = 0
                for i in T.serial(block_q):
                    if r_base + i < n_rows:
                        s = T.max(T.min(Starts[t_base + i], t_kv), 0)
                        e = T.max(T.min(Ends[t_base + i], t_kv), 0)
                        if e > s:
                            lo = T.min(lo, s)
                            hi = T.max(hi, e)
                n_tiles = T.ceildiv(T.max(hi - lo, 0), block_n)
                for a in first_tiles:  # tiles 0 .. stages - 2
                    load_or_skip(K, k_all, a, n_tiles, lo, t_kv, tx)
                load_query_rows(Q, W, q_s, w_f, r_base, t_base, n_rows, t_len)
                if Hist is not None:
                    hist_start(Starts, Ends, rs_s, re_s, h_s, t_base, r_base, n_rows, t_kv, tx)
                if n_tiles > 0:
                    issue(k_all, 0, q_s, s0_f)
                    T.wait_wgmma(0)

                for ip in T.serial(T.ceildiv(n_tiles, n_acc)):
                    for j in steps:  # a static accumulator per step; the stage index is n % stages
                        n = ip * n_acc + j
                        cur_f, cur_r = accs[j]
                        nxt_f, _ = accs[1 - j]
                        load_or_skip(K, k_all, n + ahead, n_tiles, lo, t_kv, tx)
                        issue(k_all, n + 1, q_s, nxt_f)
                        T.wait_wgmma(1)  # tile n's GEMM done; tile n + 1's keeps running
                        T.warpgroup_fence_operand(cur_f, num_regs=acc_regs)  # no read of tile n's scores above it
                        if n < n_tiles:
                            finish_tile(cur_f, cur_r, w_f, l_s, Logits, r_base, lo + n * block_n, n_rows, hi)
                            if Hist is not None:
                                hist_tile(l_s, h_s, rs_s, re_s, lo + n * block_n, tx)
                    T.wait_wgmma(0)
                if Hist is not None:
                    hist_store(h_s, Hist, r_base, n_rows, tx)

        return _logits_entry(T, kernel, hist, heads, dim, t_len, t_kv, n_rows)

    return indexer_logits_overlap


@functools.cache
def _jit_select():
    """The select factory: ``lean`` builds go through TileLang without its safe-memory pass (their loads are in
    bounds by construction; the pass's guards were about half the loop's instructions) and without its barrier
    insertion (the kernel's own ``T.sync_threads()`` order every shared access; the pass added two barriers per
    score to the collect pass), the others as before."""
    tilelang, T = tilelang_modules()
    build = _select_program(T)
    guarded = tilelang.jit(build)
    lean_jit = tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
                                          tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})(build)

    def topk_select(topk: int, threads: int = 256, min_blocks: int = 0, batch: int = 4, digit_bits: int = 8,
                    lean: bool = True, shortlist: int | None = None, pre_hist: bool = False):
        if shortlist is None:  # the default where it applies (lean, 8-bit digits)
            shortlist = SHORTLIST if lean and digit_bits == 8 and threads >= SHORTLIST else 0
        extra = (True,) if pre_hist else ()  # without it, the call (and kernel) of the builds before the option
        return (lean_jit if lean else guarded)(topk, threads, min_blocks, batch, digit_bits, lean, shortlist, *extra)

    topk_select.__doc__ = build.__doc__
    return topk_select


def _select_program(T):
    def topk_select(topk: int, threads: int = 256, min_blocks: int = 0, batch: int = 4, digit_bits: int = 8,
                    lean: bool = True, shortlist: int = 0, pre_hist: bool = False):
        """Exact top-``topk`` of ``Logits[r, starts[t]:ends[t]]`` per row, sorted, ties to the lower index.

        ``min_blocks`` (0: as many as the SM's 2048 threads allow): CTAs per SM the registers must leave room for.
        Resident CTAs matter most, not bandwidth (measured: keeping the row in shared memory, or a two-pass select
        with a candidate list, cost CTAs per SM and were slower; 4 CTAs with ``batch=8`` too). ``batch``: scores each thread loads before it bins any of them, per pass over the
        row (1: one load in flight per thread, each pass a chain of dependent load -> bin steps). ``digit_bits``:
        width of the score's radix digits (8: four rounds over the score word; 11: three, 11 + 11 + 10, with a
        2048-bin histogram searched by 256 threads of 8 bins each; 12: 12 + 12 + 8), so fewer passes over the row
        usually reach the bucket that holds the k-th key (measured slower on H200 all the same: the wider first
        round aggregates fewer equal digits per warp, and every round zeroes and searches all bins); the index
        word's digits stay 8 bits (they run only on exact ties). ``lean``: fewer instructions per score and pass for
        the same rows bitwise: each pass runs its whole iterations without the row-end clamp and test (one clamped
        iteration at the end), loads without TileLang's safe-access guards, and the score key is three branch-free
        integer ops (``0x80000000 +/- |bits|``, which maps -0.0 onto +0.0 by itself) instead of the fold and the
        sign branch. ``shortlist`` (lean, 8-bit digits; 0: off): the third pass over the row is also the collect
        pass. Once two rounds have fixed the 16-bit prefix ``P`` of the k-th key, every key above ``P`` is selected
        and only ``need`` keys inside ``P`` remain to choose (typically a few dozen candidates), so that pass writes
        the keys above ``P`` to the output list and the ones inside ``P`` to a shortlist of this many entries; each
        shortlisted key's rank among the others (a loop over the shortlist) says whether it is selected and where it
        goes. A row whose bucket overflows the shortlist runs the usual rounds and collect pass instead.
        ``pre_hist`` (lean, 8-bit digits; experimental): the first round's histogram comes in as ``Hist [n_rows,
        256]`` int32 (an extra second argument), counted by the logits kernel as it stored the row
        (``_jit_logits_plain(hist=True)``; :func:`first_round_histogram` is its torch oracle), so the first of the
        usual three passes over the row is not made. Same rows bitwise when ``Hist`` is right; it must come from
        the same ``Logits``, bounds and ``RowOffset`` (counts that total less than a row's top-k leave the select's
        bucket undefined: the interface always pairs them)."""
        if pre_hist and (not lean or digit_bits != 8):
            raise ValueError(f"topk_select's pre_hist needs lean=True and digit_bits=8 (the logits kernel counts the "
                             f"top byte of the lean score key), got lean={lean}, digit_bits={digit_bits}")
        if shortlist and (not lean or digit_bits != 8 or shortlist > threads):
            raise ValueError(f"topk_select's shortlist needs lean=True, digit_bits=8 and at most {threads} entries, "
                             f"got shortlist={shortlist}, lean={lean}, digit_bits={digit_bits}")
        blocks = min_blocks or max(1, 2048 // threads)
        sort_n = next_power_of_2(max(topk, 2))
        if threads % 32 or threads < 256:
            raise ValueError(f"topk_select needs threads >= 256 and a multiple of 32, got {threads}")
        if batch < 1:
            raise ValueError(f"topk_select needs batch >= 1, got {batch}")
        span = threads * batch  # row elements per iteration of a pass
        if digit_bits not in (8, 11, 12):  # 9 and 10 leave four score rounds, as 8 does: nothing saved
            raise ValueError(f"topk_select needs digit_bits 8, 11 or 12, got {digit_bits}")
        # Radix rounds, high digit first: (word, shift, bits); "h" the score word, "l" the ~index word. A Python list:
        # it expands at trace time (compile-time digits); range() would become a TIR loop.
        rounds = []
        rem = 32
        while rem > 0:
            b = min(digit_bits, rem)
            rem -= b
            rounds.append(("h", rem, b))
        n_score = len(rounds)
        rounds += [("l", sh, 8) for sh in (24, 16, 8, 0)]
        hist_n = 1 << digit_bits  # 256 bins for 8-bit digits
        per_thread = hist_n // 256  # bins each of the first 256 threads searches
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_rows = T.dynamic("n_rows")
        f32, i32, u32 = T.float32, T.int32, T.uint32
        n_sort_pairs = sort_n // 2
        log_sort = sort_n.bit_length() - 1

        # Each pass over the row: the non-lean kernel as one loop of clamped iterations; the lean one as its whole
        # iterations (every element inside the row: no clamp, no test) and then at most one clamped iteration.
        parts = ("whole", "tail") if lean else ("all",)

        def part_range(part, n, n_it):
            if part == "whole":
                return 0, n // span
            if part == "tail":  # always one iteration, masked where the row ends on a whole one
                return n // span, n // span + 1
            return 0, n_it

        def load_index(j, e0, t_kv, part):
            """Where row element ``j`` is loaded from in this part of a pass (in bounds without guards)."""
            if part == "whole":
                return j
            if part == "tail":  # an empty row at key 0 loads key 0, never key -1
                return T.max(T.min(j, e0 - 1), 0)
            return T.min(j, t_kv - 1)

        def in_row(j, e0, part):
            """Whether row element ``j`` is inside the row (always, in a whole iteration)."""
            return T.bool(True) if part == "whole" else j < e0

        def score_key(bits):
            """Order-preserving uint32 key of fp32 ``bits`` (larger float -> larger key; -0.0 and +0.0 one key).
            Lean: 0x80000000 + |x| bits for x >= +0, 0x80000000 - |x| bits for x <= -0, three branch-free ops, every
            key >= 1 (the sort's (0, 0) padding stays last). Otherwise the first map: -0.0 folded into +0.0, then
            the sign bit set on positives and all bits flipped on negatives."""
            if lean:
                sg = T.cast(T.shift_right(T.cast(bits, i32), 31), u32)
                return ((bits & T.uint32(0x7FFFFFFF)) ^ sg) - sg + T.uint32(0x80000000)
            folded = T.if_then_else((bits & T.uint32(0x7FFFFFFF)) == T.uint32(0), T.uint32(0), bits)
            return T.if_then_else((folded & T.uint32(0x80000000)) != T.uint32(0), ~folded,
                                  folded | T.uint32(0x80000000))

        def shared_add(buf, i, val):
            """``atomicAdd`` on a shared int, returning the old value: a shared-memory ``ATOMS`` (TileLang's
            ``atomic_add(..., return_prev=True)`` goes through ``cuda::atomic_ref``: a generic, GPU-scope ``ATOM``)."""
            return T.call_extern("int32", "atomicAdd", T.address_of(buf[i]), val)

        @T.macro
        def load_scores(Logits, raw, bx, it, s0, e0, t_kv, tx, part):
            # all loads first: ``batch`` in flight per thread (in bounds, so unconditional; j >= e0 is masked later)
            for v in T.unroll(batch):
                raw[v] = T.reinterpret(Logits[bx, load_index(s0 + it * span + v * threads + tx, e0, t_kv, part)], u32)

        @T.macro
        def kernel(Logits, Hist, Starts, Ends, RowOffset, Out):
            with T.Kernel(n_rows, threads=threads) as bx:
                T.annotate_min_blocks_per_sm(blocks)
                hist = T.alloc_shared([hist_n], i32)
                wsum = T.alloc_shared([8], i32)
                # st: 0 prefix_hi, 1 prefix_lo, 2 remaining need, 3 done, 5 digit, 6 above, 7 bucket,
                #     8 threshold_hi, 9 threshold_lo
                st = T.alloc_shared([16], u32)
                key_h = T.alloc_shared([sort_n], u32)
                key_l = T.alloc_shared([sort_n], u32)
                cnt_s = T.alloc_shared([2], i32)  # 0: keys collected, 1: keys shortlisted
                sl_h = T.alloc_shared([max(shortlist, 1)], u32)
                sl_l = T.alloc_shared([max(shortlist, 1)], u32)
                rank = T.alloc_var(i32)
                n_sl = T.alloc_var(i32)
                it_end = T.alloc_var(i32)
                above = T.alloc_var(i32)
                suffix = T.alloc_var(i32)
                mine = T.alloc_var(i32)
                base = T.alloc_var(i32)
                kh = T.alloc_var(u32)
                kl = T.alloc_var(u32)
                dg = T.alloc_var(i32)
                peers = T.alloc_var(u32)
                ballot = T.alloc_var(u32)
                pos = T.alloc_var(i32)
                raw = T.alloc_local([batch], u32)
                run = T.alloc_var(i32)

                tx = T.get_thread_binding()
                lane = tx % 32
                lanes_below = (T.uint32(1) << T.cast(lane, u32)) - T.uint32(1)
                t = RowOffset[0] + bx
                # A row past T (a launch beyond the bounds' length) is empty and writes nothing: the lean build has
                # no access guards, so the bounds are read at a clamped token and its store is skipped.
                tc = T.min(t, t_len - 1)
                s0 = T.max(T.min(Starts[tc], t_kv), 0)
                e0 = T.if_then_else(t < t_len, T.max(T.min(Ends[tc], t_kv), s0), s0)
                n = e0 - s0
                n_it = T.ceildiv(n, span)

                if tx == 0:
                    st[0] = T.uint32(0)
                    st[1] = T.uint32(0)
                    st[2] = T.cast(topk, u32)
                    st[3] = T.if_then_else(n <= topk, T.uint32(1), T.uint32(0))
                    cnt_s[0] = 0
                    cnt_s[1] = 0
                    st[10] = T.uint32(0)  # 1: the shortlist pass selected the row (no collect pass)
                    st[8] = T.uint32(0)
                    st[9] = T.uint32(0)
                T.sync_threads()

                for r, (word, shift, bits) in enumerate(rounds):
                    if shortlist and r == 2 and st[3] == T.uint32(0):
                        # One pass: keys above the 16-bit prefix to the output list, keys inside it to the shortlist.
                        ph = st[0]
                        for part in parts:
                          it0, it1 = part_range(part, n, n_it)
                          for it in T.serial(it0, it1):
                            load_scores(Logits, raw, bx, it, s0, e0, t_kv, tx, part)
                            for v in T.unroll(batch):
                                j = s0 + it * span + v * threads + tx
                                kh = score_key(raw[v])
                                kl = T.uint32(0xFFFFFFFF) - T.cast(j, u32)
                                ok = in_row(j, e0, part)
                                up = ok and (kh >> T.uint32(16)) > ph
                                inside = ok and (kh >> T.uint32(16)) == ph
                                ballot = T.cast(T.ballot_sync(up), u32)
                                if ballot != T.uint32(0):
                                    if lane == 0:
                                        base = shared_add(cnt_s, 0, T.cast(T.popcount(ballot), i32))
                                    base = T.shfl_sync(base, 0)
                                    pos = base + T.cast(T.popcount(ballot & lanes_below), i32)
                                    if up and pos < sort_n:
                                        key_h[pos] = kh
                                        key_l[pos] = kl
                                if inside:  # a few dozen keys per row: one shared atomic each, no ballot
                                    pos = shared_add(cnt_s, 1, 1)
                                    if pos < shortlist:
                                        sl_h[pos] = kh
                                        sl_l[pos] = kl
                        T.sync_threads()
                        n_sl = cnt_s[1]
                        if n_sl <= shortlist:
                            # The shortlisted key of rank q (0: the largest) is selected when q < need, and goes
                            # right after the keys above the prefix.
                            need = T.cast(st[2], i32)
                            if tx < n_sl:
                                kh = sl_h[tx]
                                kl = sl_l[tx]
                                rank = 0
                                for q in T.serial(n_sl):
                                    if sl_h[q] > kh or (sl_h[q] == kh and sl_l[q] > kl):
                                        rank = rank + 1
                                if rank < need and cnt_s[0] + rank < sort_n:  # always: topk - need keys above
                                    key_h[cnt_s[0] + rank] = kh
                                    key_l[cnt_s[0] + rank] = kl
                            T.sync_threads()
                            if tx == 0:
                                cnt_s[0] = cnt_s[0] + need
                                st[3] = T.uint32(1)
                                st[10] = T.uint32(1)
                        else:  # overflow: the usual rounds and collect pass
                            if tx == 0:
                                cnt_s[0] = 0
                        T.sync_threads()
                    counted = r == 0 and Hist is not None  # (trace time) the logits kernel counted this round
                    if st[3] == T.uint32(0):
                        for hz in T.unroll(cdiv(hist_n, threads)):
                            if hz * threads + tx < hist_n:
                                if counted:
                                    hist[hz * threads + tx] = Hist[bx, hz * threads + tx]
                                else:
                                    hist[hz * threads + tx] = 0
                        T.sync_threads()
                        ph = st[0]
                        pl = st[1]
                        for part in (() if counted else parts):  # no pass over the row for a counted round
                          it0, it1 = part_range(part, n, n_it)
                          for it in T.serial(it0, it1):
                            load_scores(Logits, raw, bx, it, s0, e0, t_kv, tx, part)
                            for v in T.unroll(batch):
                                j = s0 + it * span + v * threads + tx
                                kh = score_key(raw[v])
                                # The low word ~index makes every key distinct and prefers the lower index.
                                kl = T.uint32(0xFFFFFFFF) - T.cast(j, u32)
                                dg = hist_n  # no digit: the key left the prefix (or the row)
                                mask = T.uint32((1 << bits) - 1)
                                if in_row(j, e0, part):
                                    if r == 0:
                                        dg = T.cast(kh >> T.uint32(shift), i32)
                                    elif word == "h":
                                        if (kh >> T.uint32(shift + bits)) == ph:
                                            dg = T.cast((kh >> T.uint32(shift)) & mask, i32)
                                    elif r == n_score:
                                        if kh == ph:
                                            dg = T.cast(kl >> T.uint32(shift), i32)
                                    else:
                                        if kh == ph and (kl >> T.uint32(shift + bits)) == pl:
                                            dg = T.cast((kl >> T.uint32(shift)) & mask, i32)
                                if r == 0:
                                    # Every element lands in the first histogram, often in a few bins (scores share
                                    # their exponent): aggregate per warp, one shared atomic per distinct digit.
                                    peers = T.match_any_sync(dg)
                                    if lean:  # the leader: no lower lane among the peers (no bit reverse + find)
                                        if dg < hist_n and (peers & lanes_below) == T.uint32(0):
                                            T.atomic_add(hist[dg], T.cast(T.popcount(peers), i32))
                                    elif dg < hist_n and lane == T.__ffs(T.cast(peers, i32)) - 1:
                                        T.atomic_add(hist[dg], T.cast(T.popcount(peers), i32))
                                elif dg < hist_n:
                                    # Later rounds only see the few elements that still match the prefix.
                                    T.atomic_add(hist[dg], 1)
                        T.sync_threads()
                        # The bucket holding the need-th largest key: suffix sums of the histogram, a warp-shuffle
                        # scan per 32 threads plus the totals of the warps above; each of the first 256 threads owns
                        # ``per_thread`` consecutive bins (one for 8-bit digits).
                        if tx < 256:
                            if per_thread == 1:
                                mine = hist[tx]
                            else:
                                mine = 0
                                for gi in T.unroll(per_thread):
                                    mine = mine + hist[tx * per_thread + gi]
                            suffix = mine
                            for d in T.unroll(5):
                                above = T.shfl_down(suffix, 1 << d)
                                if lane + (1 << d) < 32:
                                    suffix = suffix + above
                            if lane == 0:
                                wsum[tx // 32] = suffix
                        T.sync_threads()
                        if tx < 256:
                            above = suffix - mine
                            for w in T.unroll(8):
                                if w > tx // 32:
                                    above = above + wsum[w]
                            need = T.cast(st[2], i32)
                            if per_thread == 1:
                                if above < need and above + mine >= need:
                                    st[5] = T.cast(tx, u32)
                                    st[6] = T.cast(above, u32)
                                    st[7] = T.cast(mine, u32)
                            else:  # walk this thread's bins from the highest down
                                run = above
                                for gi in T.unroll(per_thread):
                                    bin_ = tx * per_thread + (per_thread - 1 - gi)
                                    if run < need and run + hist[bin_] >= need:
                                        st[5] = T.cast(bin_, u32)
                                        st[6] = T.cast(run, u32)
                                        st[7] = T.cast(hist[bin_], u32)
                                    run = run + hist[bin_]
                        T.sync_threads()
                        if tx == 0:
                            b = st[5]
                            need_new = st[2] - st[6]
                            st[2] = need_new
                            # Threshold = prefix padded with zeros: select keys >= it.
                            if word == "h":
                                st[0] = (st[0] << T.uint32(bits)) | b
                                st[8] = st[0] << T.uint32(shift)
                                st[9] = T.uint32(0)
                            else:
                                st[1] = (st[1] << T.uint32(bits)) | b
                                st[8] = st[0]
                                st[9] = st[1] << T.uint32(shift)
                            if st[7] == need_new:
                                st[3] = T.uint32(1)
                        T.sync_threads()

                # Collect the selected keys (exactly min(n, topk) of them), compacted per warp with a ballot.
                th = st[8]
                tl_ = st[9]
                for part in parts:
                  it0, it1 = part_range(part, n, n_it)
                  it_end = it1
                  if shortlist:
                      if st[10] != T.uint32(0):  # the shortlist pass collected the row already
                          it_end = it0
                  for it in T.serial(it0, it_end):
                    load_scores(Logits, raw, bx, it, s0, e0, t_kv, tx, part)
                    for v in T.unroll(batch):
                        j = s0 + it * span + v * threads + tx
                        kh = score_key(raw[v])  # same key as in the rounds above
                        kl = T.uint32(0xFFFFFFFF) - T.cast(j, u32)
                        sel = in_row(j, e0, part) and ((kh > th) or (kh == th and kl >= tl_))
                        ballot = T.cast(T.ballot_sync(sel), u32)
                        if lane == 0:
                            if lean:
                                base = shared_add(cnt_s, 0, T.cast(T.popcount(ballot), i32))
                            else:
                                base = T.atomic_add(cnt_s[0], T.cast(T.popcount(ballot), i32), return_prev=True)
                        base = T.shfl_sync(base, 0)
                        # (the lane mask written out here: hoisted, TileLang's barrier planner refuses topk <= 64)
                        below = ballot & ((T.uint32(1) << T.cast(lane, u32)) - T.uint32(1))
                        pos = base + T.cast(T.popcount(below), i32)
                        if sel and pos < sort_n:
                            key_h[pos] = kh
                            key_l[pos] = kl
                T.sync_threads()
                count = T.min(cnt_s[0], sort_n)
                for it in T.serial(T.ceildiv(sort_n, threads)):
                    p = it * threads + tx
                    if p < sort_n and p >= count:
                        key_h[p] = T.uint32(0)
                        key_l[p] = T.uint32(0)
                T.sync_threads()

                # Bitonic sort, descending by (key_h, key_l); unused slots hold (0, 0) and sink to the end.
                for ls in T.serial(log_sort):
                    for ss in T.serial(ls + 1):
                        size = 2 << ls
                        stride = size >> (ss + 1)
                        for it in T.unroll(T.ceildiv(n_sort_pairs, threads)):
                            i = it * threads + tx
                            if i < n_sort_pairs:
                                a = (i // stride) * (2 * stride) + (i % stride)
                                b = a + stride
                                ah = key_h[a]
                                al = key_l[a]
                                bh = key_h[b]
                                bl = key_l[b]
                                a_less = (ah < bh) or (ah == bh and al < bl)
                                # Blocks with (a & size) == 0 sort descending, the others ascending.
                                swap = T.if_then_else((a & size) == 0, a_less, not a_less)
                                if swap:
                                    key_h[a] = bh
                                    key_l[a] = bl
                                    key_h[b] = ah
                                    key_l[b] = al
                        T.sync_threads()

                for it in T.serial(T.ceildiv(topk, threads)):
                    p = it * threads + tx
                    if p < topk and t < t_len:
                        Out[t, p] = T.if_then_else(
                            p < count, T.cast(T.uint32(0xFFFFFFFF) - key_l[p], i32), -1
                        )

        if pre_hist:
            @T.prim_func
            def main(
                Logits: T.Tensor([n_rows, t_kv], f32),
                Hist: T.Tensor([n_rows, FIRST_ROUND_BINS], i32),
                Starts: T.Tensor([t_len], i32),
                Ends: T.Tensor([t_len], i32),
                RowOffset: T.Tensor([1], i32),
                Out: T.Tensor([t_len, topk], i32),
            ):
                kernel(Logits, Hist, Starts, Ends, RowOffset, Out)
        else:
            @T.prim_func
            def main(
                Logits: T.Tensor([n_rows, t_kv], f32),
                Starts: T.Tensor([t_len], i32),
                Ends: T.Tensor([t_len], i32),
                RowOffset: T.Tensor([1], i32),
                Out: T.Tensor([t_len, topk], i32),
            ):
                kernel(Logits, None, Starts, Ends, RowOffset, Out)

        return main

    return topk_select


# --------------------------------------------------------------------------------------------------------------------
# Checked interface
# --------------------------------------------------------------------------------------------------------------------


def logits_chunk_rows(t_kv: int, block_q: int) -> int:
    """Query rows per chunk so the fp32 logits buffer ``[rows, T_kv]`` stays near ``LOGITS_CHUNK_BYTES``."""
    rows = max(block_q, LOGITS_CHUNK_BYTES // max(1, 4 * t_kv))
    return max(block_q, rows // block_q * block_q)


def plain_logits_fits(heads: int, dim: int, block_n: int = 128, threads: int = 128) -> bool:
    """Whether the logits kernel without warp specialisation takes this indexer shape (its tile load splits evenly)."""
    chunks = dim // 8
    return (max(1, 128 // heads) * heads) % 16 == 0 and dim % 64 == 0 and threads % chunks == 0 \
        and block_n % (threads // chunks) == 0


def logits_overlap_stages() -> int:
    """Key stages of the overlapped logits kernel in force (0: the plain kernel): ``MEGATRON_GLM5_LOGITS_OVERLAP``
    (``0``, ``3`` or ``4``) when set and not empty, else ``LOGITS_OVERLAP_STAGES``."""
    return int(env_switch(LOGITS_OVERLAP_ENV, ("0", "3", "4"), str(LOGITS_OVERLAP_STAGES)))


def fused_first_round() -> bool:
    """Whether the interface has the logits kernel count the select's first radix round:
    ``MEGATRON_GLM5_INDEXER_FUSED_HIST`` (``1`` / ``0``) when set and not empty, else ``INDEXER_FUSED_HIST``."""
    return env_switch(INDEXER_FUSED_HIST_ENV, ("0", "1"), "1" if INDEXER_FUSED_HIST else "0") == "1"


def _ignored(switch: str, heads: int, dim: int) -> None:
    """Log once that a kernel switch is set but does not apply at this indexer shape (a benchmark would otherwise
    time the default kernels without a word)."""
    if (switch, heads, dim) not in _IGNORED:
        _IGNORED.add((switch, heads, dim))
        logging.getLogger("megatron_glm5").warning(
            "megatron-glm5: %s is set but applies only at the indexer shapes %s; heads=%d, dim=%d keep the plain "
            "logits kernel and the usual select", switch, sorted(LOGITS_OPTION_SHAPES), heads, dim)


_IGNORED: set = set()


def select_score_key(scores: torch.Tensor) -> torch.Tensor:
    """The lean select's 32-bit score key of fp32 ``scores``, as int64: ``0x80000000 + |bits|`` for ``x >= +0``,
    ``0x80000000 - |bits|`` for ``x <= -0`` (the kernel's three integer ops); larger score, larger key."""
    bits = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = bits & 0x7FFFFFFF
    return torch.where((bits >> 31) == 1, 0x80000000 - mag, 0x80000000 + mag)


def first_round_histogram(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                          row_offset: int = 0) -> torch.Tensor:
    """Torch oracle of the logits kernels' ``hist`` output: int32 ``[n_rows, 256]``, for chunk row ``r`` (token
    ``row_offset + r``) how many keys of its range (clamped as the select clamps it) have each top byte of the
    select's lean score key (``0x80000000 + |bits|`` for ``x >= +0``, ``0x80000000 - |bits|`` for ``x <= -0``:
    order-preserving, ``-0.0`` and ``+0.0`` one key)."""
    n_rows, t_kv = logits.shape
    key = select_score_key(logits)
    rows = row_offset + torch.arange(n_rows, device=logits.device)
    s = starts[rows].long().clamp(0, t_kv)
    e = torch.maximum(ends[rows].long().clamp(max=t_kv), s)
    cols = torch.arange(t_kv, device=logits.device)
    inside = ((cols[None] >= s[:, None]) & (cols[None] < e[:, None])).long()
    hist = torch.zeros(n_rows, FIRST_ROUND_BINS, dtype=torch.int64, device=logits.device)
    return hist.scatter_add_(1, key >> 24, inside).int()


def logits_kernel(heads: int, dim: int, hist: bool = False):
    """The logits kernel :func:`indexer_topk_interface` runs: the one without warp specialisation (128 threads, two
    CTAs per SM so one's epilogue overlaps the other's GEMM) where the shape fits, else the warp-specialised one. Both
    write bitwise equal logits (H200 sweep: 9.56 against 10.54 ms at 32K tokens, 32 x 128 heads;
    ``scripts/bench/RESULTS_kernels.md``, round 2, second session). With :func:`logits_overlap_stages` the
    overlapped kernel instead (``_jit_logits_overlap``: experimental, bitwise equal by construction), at the screened
    shapes :data:`LOGITS_OPTION_SHAPES` only (elsewhere the switch is logged once and ignored). ``hist`` (screened
    shapes only): the build that also counts the select's first radix round (an extra ``Hist`` argument)."""
    screened = (heads, dim) in LOGITS_OPTION_SHAPES  # all of them fit the plain kernel
    if hist and not screened:
        raise ValueError(f"the select's first round is counted only at the screened indexer shapes "
                         f"{sorted(LOGITS_OPTION_SHAPES)}, got heads={heads}, dim={dim}")
    stages = logits_overlap_stages()
    if stages and not screened:
        _ignored(LOGITS_OVERLAP_ENV, heads, dim)
    if plain_logits_fits(heads, dim):
        extra = (True,) if hist else ()  # without it, the call (and kernel) of the builds before the option
        if stages and screened:
            return _jit_logits_overlap()(heads, dim, 64, 128, 2, stages, *extra)
        if hist:
            return _jit_logits_plain()(heads, dim, 128, 128, 2, 0, True)
        return _jit_logits_plain()(heads, dim)
    return _jit_logits()(heads, dim)


def indexer_topk_interface(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Checked entry point; see the module docstring for the contract. Returns int32 ``[T, topk]``."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    check_tensor("k", k, dtype=torch.bfloat16, ndim=2, device=q.device)
    check_tensor("weights", weights, dtype=torch.float32, ndim=2, device=q.device)
    check_tensor("starts", starts, dtype=torch.int32, ndim=1, device=q.device)
    check_tensor("ends", ends, dtype=torch.int32, ndim=1, device=q.device)
    t_len, heads, dim = q.shape
    t_kv = k.shape[0]
    if k.shape[1] != dim:
        raise ValueError(f"k must be [T_kv, {dim}] like q's last dim, got {tuple(k.shape)}")
    if tuple(weights.shape) != (t_len, heads):
        raise ValueError(f"weights must be [T={t_len}, Hi={heads}], got {tuple(weights.shape)}")
    if starts.shape[0] != t_len or ends.shape[0] != t_len:
        raise ValueError(f"starts/ends must be [T={t_len}], got {tuple(starts.shape)} / {tuple(ends.shape)}")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    block_q = max(1, 128 // heads)
    if (block_q * heads) % 16 or dim % 16:
        raise ValueError(f"indexer heads and dim must make (128 // heads) * heads and dim multiples of 16, got {heads}, {dim}")
    out = torch.empty(t_len, topk, dtype=torch.int32, device=q.device)
    if t_len == 0:
        return out
    if t_kv == 0:
        return out.fill_(-1)

    counted = fused_first_round()
    if counted and (heads, dim) not in LOGITS_OPTION_SHAPES:
        _ignored(INDEXER_FUSED_HIST_ENV, heads, dim)
        counted = False
    logits = logits_kernel(heads, dim, hist=counted)
    select_kernel = _jit_select()(topk, pre_hist=True) if counted else _jit_select()(topk)
    rows = chunk_rows or logits_chunk_rows(t_kv, block_q)
    buf = torch.empty(min(rows, t_len), t_kv, dtype=torch.float32, device=q.device)
    counts = torch.empty(min(rows, t_len), FIRST_ROUND_BINS, dtype=torch.int32, device=q.device) if counted else None
    for c0 in range(0, t_len, rows):
        c1 = min(t_len, c0 + rows)
        row0 = torch.full((1,), c0, dtype=torch.int32, device=q.device)
        chunk = buf[: c1 - c0]
        if counted:  # the select's first radix round counted as the logits are stored: one pass less over them
            logits(q, k, weights, starts, ends, row0, chunk, counts[: c1 - c0])
            select_kernel(chunk, counts[: c1 - c0], starts, ends, row0, out)
        else:
            logits(q, k, weights, starts, ends, row0, chunk)
            select_kernel(chunk, starts, ends, row0, out)
    return out
