"""Sparse absorbed-MLA backward in TileLang, and the autograd function tying it to the forward.

Given the forward's saved ``out`` and natural-log ``lse`` (the forward is never re-run), computes

    P = exp(scale * Q K^T - lse),  dP = dO V^T,  dS = P * (dP - Delta) * scale,  Delta = rowsum(O * dO) - dlse
    dQ = dS K,  dKV[idx] += dS^T Q (all d_qk channels) + P^T dO (first d_v channels)

Test oracle: autograd through ``megatron_glm5.dsa.reference.sparse_mla``.

Kernel: one CTA per (token, head block of 16/32/64). The selected KV rows are gathered with ``cp.async`` into two
shared-memory stages (the next block loads while this one computes); -1 slots are zero-filled without a memory read
(pitfall P1), and blocks past a row's last valid slot are skipped. ``dKV`` is written two ways:

* ``deterministic=False``: fp32 ``atomicAdd`` into a ``[T_kv, d_qk]`` buffer straight from the MMA fragments, then one
  cast to bf16. Fast, but the fp32 summation order (and so the low bits) varies run to run (pitfall P5).
* ``deterministic=True``: each (token, slot) writes its ``d_qk``-wide fp32 contribution to a partial buffer (no
  atomics); a second kernel sums, per key, the contributions in a fixed (token, slot) order taken from a stable sort
  of the indices. Bitwise reproducible. Cost: the partial buffer is ``4 * K * d_qk`` bytes per token (4.7 MB at K=2048),
  so tokens are processed in chunks that keep it near 2 GiB, plus one write and one read of it (~155 GB at 16K
  tokens), a sort per chunk and a launch per chunk; see ``scripts/bench/RESULTS_kernels.md`` for the measured cost.

``dKV = dS^T Q + P^T dO`` is formed in column chunks of 128 (``dkv_split``), each chunk's fp32 accumulator scattered
before the next. What bounds the kernel (ncu on H200, 16K tokens, ``scripts/bench/kernels_round2/ncu_bwd_h*.txt``):
at 64 heads the load/store path (L1/TEX 72 % busy: the dKV atomics, about twice the bytes of the KV gather) with
one 8-warp CTA per SM (222 KB of shared memory, 255 registers), the tensor pipe at 22 %; at 16 heads L2 (74 %, the
same atomics for a quarter of the math).

Provenance: the per-block math follows tile-ai/tilelang ``examples/deepseek_v32/sparse_mla_bwd.py`` (256 threads and
64-head blocks at 64 heads). Differences: saved natural-log LSE instead of a forward re-run, a fused ``dlse`` term, the
``cp.async`` two-stage gather with guarded -1 slots, d_v in 128-column chunks so the dKV accumulator stays small,
atomics issued from registers (no shared staging buffer), head padding with bounded loads/stores, the deterministic
partial-sum path.

Head dims: ``d_qk = d_v + d_tail`` with ``d_v / 2`` and ``d_tail`` multiples of 64; GLM-5 has ``d_tail = 64`` (RoPE),
the NoPE GLM-5.3-Flash ``d_tail = 0`` (``d_qk = d_v = 512``), for which every tail buffer, load and GEMM is left out
at trace time.

No ``from __future__ import annotations`` here: TileLang evaluates the nested prim_funcs' annotations.
"""

import functools
import logging
from dataclasses import dataclass

import torch

from megatron_glm5.kernels._common import (
    BULK_ADD_F32_SRC,
    LOG2E,
    cdiv,
    multiprocessor_count,
    row_valid_len,
    tilelang_modules,
)
from megatron_glm5.kernels.gather import latent_gather_macro, slot_load_macro
from megatron_glm5.kernels.index_groups import (
    GROUPED_BWD_MIN_SHARING,
    KEY_LIMIT,
    MEMBER_SHIFT,
    RowMap,
    SharingProbe,
    group_union_indices,
    grouped_group,
    grouped_rows,
    grouped_tile_rows,
)
from megatron_glm5.kernels.key_block_work import KeyBlockWorkProbe
from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCKS_MAX_TOKENS, dkv_key_blocks, key_blocks_fit, key_blocks_pay
from megatron_glm5.kernels.sparse_mla_fwd import (
    Variant,
    check_sparse_mla_args,
    head_block,
    sparse_mla_fwd_interface,
)

_log = logging.getLogger("megatron_glm5")

DKV_REDUCTIONS = ("atomic", "bulk", "key_blocks")  # sparse_mla_bwd_interface(dkv_reduce=...)
# Key blocks or the grouped backward, where both may serve (16 heads, sets sharing keys in groups of 4). Per selected
# pair the grouped backward cost 2.17 / sharing and the key-block route 0.362 + 0.127 * dense_per_sparse (ns per pair;
# H200, GLM-5's latent, 8K and 16K tokens at sharing 1.6-3.3: scripts/bench/kernels_round12/1_sharing_16h.json), so
# key blocks while ``sharing * (1 + 0.35 * dense_per_sparse) < 6.0``: sharing 3.32 at 8K (ratio 2.30), 2.40 at 16K
# (ratio 4.28). Up to ``KEY_BLOCKS_MAX_TOKENS`` no work probe runs; the ratio is then at most a single causal 8K
# sequence's. Below ``GROUPED_BWD_MIN_SHARING`` there is no grouped backward to beat (at the route's own limit, ratio
# 4.8, the fitted crossing 2.239 lies just below it).
KEY_BLOCKS_OVER_GROUPED = 6.0
KEY_BLOCKS_DENSE_SLOPE = 0.35
KEY_BLOCKS_SHORT_DENSE_PER_SPARSE = 2.30


def key_blocks_over_grouped(sharing: float, dense_per_sparse: float | None = None) -> bool:
    """Whether the key-block dKV beats the grouped backward for sets with this group ``sharing`` (the forward's
    ``SharingProbe``) and the key blocks' ``dense_per_sparse`` (``KeyBlockWorkProbe``; ``None`` for a call of at most
    ``KEY_BLOCKS_MAX_TOKENS`` tokens, bounded by ``KEY_BLOCKS_SHORT_DENSE_PER_SPARSE``); always below
    ``GROUPED_BWD_MIN_SHARING``, where the grouped backward is not taken."""
    ratio = KEY_BLOCKS_SHORT_DENSE_PER_SPARSE if dense_per_sparse is None else dense_per_sparse
    return (sharing < GROUPED_BWD_MIN_SHARING
            or sharing * (1.0 + KEY_BLOCKS_DENSE_SLOPE * ratio) < KEY_BLOCKS_OVER_GROUPED)


DETERMINISTIC_PARTIAL_BYTES = 2 << 30  # budget for the per-chunk partial dKV buffer

# The bulk dKV reduction's raw staging (``_jit_bwd(dkv_reduce="bulk")``): fp32 at float offsets from a shared buffer's
# first element, past TileLang's (swizzled) layout of that buffer.
STAGE_SRC = r"""
__device__ __forceinline__ void glm5_st_f32(void* base, int off, float v) { static_cast<float*>(base)[off] = v; }
__device__ __forceinline__ void glm5_bulk_add_f32_at(void* base, int off, float* gmem, int bytes) {
  glm5_bulk_add_f32(static_cast<float*>(base) + off, gmem, bytes);
}
"""

# The grouped backward's CTA row tiles: 64 (4 queries at 16 heads, the autograd route's) and, experimental, 32
# (2 queries): the 64-row tile's dQ accumulator spills at 256 threads (255 registers, 348 bytes), the 32-row one does
# not (228 registers; ptxas, sm_90a).
GROUPED_BWD_ROW_TILES = (64, 32)


# --------------------------------------------------------------------------------------------------------------------
# TileLang factories
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def _jit_delta():
    tilelang, T = tilelang_modules()

    @tilelang.jit(out_idx=[3])  # non-negative: see _common.OUT_IDX_NOTE
    def sparse_mla_delta(heads: int, d_v: int, block_t: int = 32, block_d: int = 128, threads: int = 128):
        """``Delta[t, h] = sum_d O * dO - dlse`` in fp32 (the softmax-gradient row term)."""
        t_len = T.dynamic("t_len")
        bf16, f32 = T.bfloat16, T.float32

        @T.prim_func
        def main(
            O: T.Tensor([t_len, heads, d_v], bf16),
            dO: T.Tensor([t_len, heads, d_v], bf16),
            dLse: T.Tensor([t_len, heads], f32),
            Delta: T.Tensor([t_len, heads], f32),
        ):
            with T.Kernel(T.ceildiv(t_len, block_t), heads, threads=threads) as (bx, h):
                prod = T.alloc_fragment([block_t, block_d], f32)
                acc = T.alloc_fragment([block_t], f32)
                t0 = bx * block_t
                T.fill(acc, 0)
                for dc in T.serial(d_v // block_d):
                    for i, d in T.Parallel(block_t, block_d):
                        prod[i, d] = T.if_then_else(
                            t0 + i < t_len,
                            T.cast(O[t0 + i, h, dc * block_d + d], f32) * T.cast(dO[t0 + i, h, dc * block_d + d], f32),
                            0,
                        )
                    T.reduce_sum(prod, acc, dim=1, clear=False)
                for i in T.Parallel(block_t):
                    if t0 + i < t_len:
                        Delta[t0 + i, h] = acc[i] - dLse[t0 + i, h]

        return main

    return sparse_mla_delta


@functools.cache
def _jit_bwd():
    tilelang, T = tilelang_modules()

    @tilelang.jit(
        pass_configs={
            tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        },
    )
    def sparse_mla_bwd(
        heads: int,
        d_qk: int,
        d_v: int,
        softmax_scale: float,
        deterministic: bool = False,
        block_s: int = 32,
        threads: int = 0,
        with_target: bool = False,
        dkv_split: int = 0,
        group: int = 1,
        dkv_reduce: str = "atomic",
        with_dkv: bool = True,
        slot_prefetch: bool = True,
    ):
        """Main backward kernel. ``deterministic`` switches the dKV epilogue from atomics to partial-buffer stores;
        ``dkv_split``: dKV column chunks (0: automatic); ``group`` > 1 (atomic dKV only): one CTA per ``group``
        consecutive queries over the union of their index sets, as the grouped forward (``kernels.index_groups``;
        ``group * heads`` one of :data:`GROUPED_BWD_ROW_TILES`): a union key's dKV is summed over the group's
        queries on chip before its one atomic write;
        ``with_target`` also writes ``Tgt[hb, t, k] = sum_{h in head block hb} P[h, t, k]`` (the sparse indexer
        loss's unnormalised target, from the ``P`` this kernel forms anyway; slots of skipped blocks are left as the
        caller's zeros).

        ``dkv_reduce`` (atomic dKV only): ``"atomic"``, float2 atomics straight from the MMA fragments, or
        ``"bulk"`` (experimental, measured slower: the GLM-5 layer 72.5 vs 58.7 ms): each dKV chunk staged in shared
        memory over the block's own KV stage (free once the dQ GEMMs have read it, so no extra shared memory and no
        lost occupancy), then sm90 bulk reductions (``cp.reduce.async.bulk ... add.f32``) per slot row and chunk
        instead of float2 atomics. Staged rows are rotated by ``8 * (row % 4)`` floats (scalar fragment stores with
        at most 2-way bank conflicts instead of 4-way on float2; a row with a rotation goes out as two bulk copies:
        280 copies per 32-slot block for GLM-5). It pays about ten CTA barriers per block (with those TileLang's
        sync pass adds) and one warp issuing every copy, where the atomics leave all warps' registers at once.
        Needs ``d_v / dkv_split`` and the RoPE tail at most ``d_v / 4`` (a stage half holds ``d_v / 4`` fp32 per
        row) and ``block_s <= threads``.

        ``with_dkv=False`` (per-query, not deterministic): ``dQ`` (and the target) only, no dKV GEMMs and no atomics;
        ``dKV`` is then a ``[1, d_qk]`` placeholder the kernel never touches (the key-block pass,
        ``kernels.sparse_mla_dkv``, forms it).

        ``slot_prefetch`` (default): each gather's index entries are loaded into registers one gather ahead (right
        after the previous gather is issued), so their latency hides under the previous block's math; without it
        every thread waited for its entry between the block's last barrier and its copies. Bitwise unchanged.

        Grid ``(n_rows, head blocks)``; row ``bx`` is token ``row0 + bx`` (the deterministic path runs in chunks).
        """
        block_h, n_hblk = head_block(heads)
        if group > 1:
            if deterministic or with_target:
                raise ValueError(f"the grouped backward has atomic dKV only and no target; got "
                                 f"deterministic={deterministic}, target={with_target}")
            block_h, n_hblk = grouped_tile_rows(heads, group, GROUPED_BWD_ROW_TILES), 1
        if threads == 0:
            threads = 256 if block_h >= 32 else 128
        dh = d_v // 2
        # dKV in column chunks of 128 (d_v = 512: 4 chunks; 2 for small test latents): fewer registers than halves
        # (16 heads 210 vs 238; 64 heads spill 328 vs 436 bytes), 2 % faster at 64 heads (RESULTS_kernels.md, round 2)
        dkv_split = dkv_split or max(2, d_v // 128)
        dc = d_v // dkv_split  # dKV columns per GEMM chunk: the fp32 accumulator is [block_s, dc]
        dkv_chunks = [(c, c * dc // dh, c * dc % dh) for c in range(dkv_split)]  # (chunk, Q/dO half, offset)
        d_tail = d_qk - d_v
        has_tail = d_tail > 0  # GLM-5: the 64 RoPE channels; none for a NoPE latent (GLM-5.3-Flash, d_qk == d_v)
        bs = block_s
        rows_per_pass = threads // 8
        if dh % 64 or d_tail % 64 or d_tail < 0 or bs % rows_per_pass or dkv_split < 2 or dh % dc or dc % 64:
            raise ValueError(f"bwd kernel needs d_v/2, d_qk-d_v >= 0 multiples of 64, block_s % (threads/8) == 0 and "
                             f"d_v / dkv_split a multiple of 64 dividing d_v/2; got d_v={d_v}, d_qk={d_qk}, "
                             f"block_s={bs}, threads={threads}, dkv_split={dkv_split}")
        if dkv_reduce not in ("atomic", "bulk"):
            raise ValueError(f"dkv_reduce must be 'atomic' or 'bulk', got {dkv_reduce!r}")
        bulk = dkv_reduce == "bulk"
        if not with_dkv and (deterministic or group > 1 or bulk):
            raise ValueError("with_dkv=False is the per-query kernel's dQ pass: not deterministic, grouped or bulk")
        if bulk and deterministic:
            raise ValueError("dkv_reduce='bulk' adds dKV in a varying order: not with deterministic=True")
        stage_w = dh // 2  # fp32 per row of one stage half viewed as the dKV staging buffer
        if bulk and (dc > stage_w or d_tail > stage_w or bs > threads):
            raise ValueError(f"the bulk dKV reduction stages a [block_s, d_v/dkv_split] fp32 chunk in half a KV "
                             f"stage ([block_s, d_v/4] fp32) with a thread per slot row; got d_v={d_v}, "
                             f"dkv_split={dkv_split}, d_tail={d_tail}, block_s={bs}, threads={threads}")
        scale_log2 = softmax_scale * LOG2E
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        n_rows = T.dynamic("n_rows")
        topk = T.dynamic("topk")  # index width: one kernel serves every K
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        dkv_shape = [n_rows, n_hblk, topk, d_qk] if deterministic else [t_kv, d_qk] if with_dkv else [1, d_qk]
        tgt_shape = [n_hblk, t_len, topk] if with_target else [1]
        n_idx = t_len if group == 1 else T.dynamic("n_grp")  # index rows: one per query, or one union per group
        # the deterministic path runs a chunk of rows per launch; the grouped one a CTA per group
        grid_rows = n_rows if deterministic else n_idx
        key_mask = KEY_LIMIT - 1
        rows = RowMap(heads, group)

        @T.macro
        def load_rows(src, t, h0, tx, buf, col0, width):
            n_vec = block_h * (width // 8)
            for it in T.unroll(cdiv(n_vec, threads)):
                ch = it * threads + tx
                if ch < n_vec:
                    h = ch // (width // 8)
                    c = (ch % (width // 8)) * 8
                    for v in T.vectorized(8):
                        buf[h, c + v] = T.if_then_else(  # a dead row is never read (padded heads: P6)
                            rows.live(t, h0, h, t_len),
                            src[rows.load_query(T, t, h, t_len), rows.head(h0, h), col0 + c + v],
                            0,
                        )

        gather = latent_gather_macro(T, rows=bs, rows_per_pass=rows_per_pass, dh=dh, d_tail=d_tail, tail0=d_v,
                                     record_index=True, commit=True, key_bits=MEMBER_SHIFT if group > 1 else 0,
                                     prefetched=slot_prefetch)
        load_slots = slot_load_macro(T, rows=bs, rows_per_pass=rows_per_pass)

        @T.macro
        def gather_block(KV, Idx, slots, t, t_kv, topk, tx, kv_l, kv_r, kt, idx_s, blk):
            # block blk's rows; with slot_prefetch from the entries loaded one gather ahead, then block blk + 1's
            if slot_prefetch:
                gather(KV, slots, t, t_kv, topk, tx, kv_l, kv_r, kt, idx_s, blk)
                load_slots(Idx, t, topk, tx, slots, blk + 1)
            else:
                gather(KV, Idx, t, t_kv, topk, tx, kv_l, kv_r, kt, idx_s, blk)

        @T.macro
        def scatter(dKV, acc, idx_s, bx, hb, blk, col0, width):
            if deterministic:
                for j, d in T.Parallel(bs, width):
                    if blk * bs + j < topk:
                        dKV[bx, hb, blk * bs + j, col0 + d] = acc[j, d]
            elif group == 1:
                for j, d in T.Parallel(bs, width):
                    if idx_s[j] >= 0:
                        T.atomic_add(dKV[idx_s[j], col0 + d], acc[j, d])
            else:  # the recorded entry carries member bits above the key
                for j, d in T.Parallel(bs, width):
                    if idx_s[j] >= 0:
                        T.atomic_add(dKV[idx_s[j] & key_mask, col0 + d], acc[j, d])

        @T.macro
        def bulk_chunk(dKV, acc, idx_s, stage, col0, width):
            # acc [bs, width] -> stage (a KV stage half as raw fp32 [bs, stage_w], rows rotated by 8 * (row % 4)
            # floats) -> one or two bulk adds per valid row
            tx = T.get_thread_binding()
            base = T.access_ptr(stage[0, 0], "rw", bs * dh)  # the whole half: [bs, dh] bf16 = [bs, stage_w] fp32
            for j, d in T.Parallel(bs, width):
                T.call_extern("handle", "glm5_st_f32", base, j * stage_w + (d + (j % 4) * 8) % width, acc[j, d])
            T.fence_proxy_async()  # generic-proxy writes -> visible to the bulk copy engine
            if tx < bs:
                T.tma_store_wait(0)  # the previous chunk's adds have read the other stage half
            T.sync_threads()
            if tx < bs:
                entry = idx_s[tx]
                if entry >= 0:
                    key = entry if group == 1 else entry & key_mask
                    rot = (tx % 4) * 8
                    T.call_extern("handle", "glm5_bulk_add_f32_at", base, tx * stage_w + rot,
                                  T.access_ptr(dKV[key, col0], "rw", width - rot), (width - rot) * 4)
                    if rot > 0:
                        T.call_extern("handle", "glm5_bulk_add_f32_at", base, tx * stage_w,
                                      T.access_ptr(dKV[key, col0 + width - rot], "rw", rot), rot * 4)
                T.tma_store_arrive()

        @T.macro
        def block_step(
            kv_l, kv_r, kt, idx_s, blk, bx, hb, dKV,
            q_l, q_r, q_t, do_l, do_r, p_s, ds_s, lse_s, delta_s,
            acc_p, acc_dp, acc_dq_l, acc_dq_r, acc_dq_t, acc_dkv, acc_dkv_t, Tgt, tsum, t,
        ):  # fmt: skip
            if group == 1:
                for h, j in T.Parallel(block_h, bs):
                    acc_p[h, j] = T.if_then_else(idx_s[j] >= 0, 0, -T.infinity(f32))
            else:  # a union entry: row h's query decides by its member bit
                for h, j in T.Parallel(block_h, bs):
                    acc_p[h, j] = T.if_then_else((idx_s[j] >= 0) and rows.member(idx_s[j], h), 0, -T.infinity(f32))
            T.gemm(q_l, kv_l, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(q_r, kv_r, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            if has_tail:
                T.gemm(q_t, kt, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            for h, j in T.Parallel(block_h, bs):
                acc_p[h, j] = T.exp2(acc_p[h, j] * scale_log2 - lse_s[h])
            if with_target:  # head sum of the fp32 P (padded heads and -1 slots are exact zeros)
                T.reduce_sum(acc_p, tsum, dim=0)
                for j in T.Parallel(bs):
                    if blk * bs + j < topk:
                        Tgt[hb, t, blk * bs + j] = tsum[j]
            if with_dkv:  # P^T dO is dKV's only use of the bf16 P
                T.copy(acc_p, p_s)
            T.gemm(do_l, kv_l, acc_dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(do_r, kv_r, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            for h, j in T.Parallel(block_h, bs):
                acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - delta_s[h]) * softmax_scale
            T.copy(acc_dp, ds_s)
            T.gemm(ds_s, kv_l, acc_dq_l, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(ds_s, kv_r, acc_dq_r, policy=T.GemmWarpPolicy.FullCol)
            if has_tail:
                T.gemm(ds_s, kt, acc_dq_t, policy=T.GemmWarpPolicy.FullCol)
            # dKV = dS^T Q + P^T dO, ``dc`` columns of d_v at a time (keeps the fp32 accumulator at [block_s, dc]).
            # With bulk adds the chunks are staged alternately over this block's KV stage halves (kv_l / kv_r as raw
            # fp32: their GEMM layout is swizzled, a staged row must be contiguous), which every warp's dQ GEMMs above
            # must have read first.
            for c, half, c0 in dkv_chunks if with_dkv else ():  # trace-time loop
                src_q = (q_l, q_r)[half]
                src_do = (do_l, do_r)[half]
                T.gemm(ds_s, src_q[:, c0 : c0 + dc], acc_dkv, transpose_A=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_s, src_do[:, c0 : c0 + dc], acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                if bulk:
                    if c == 0:
                        T.sync_threads()
                    bulk_chunk(dKV, acc_dkv, idx_s, (kv_l, kv_r)[c % 2], c * dc, dc)
                else:
                    scatter(dKV, acc_dkv, idx_s, bx, hb, blk, c * dc, dc)
            if has_tail and with_dkv:
                T.gemm(ds_s, q_t, acc_dkv_t, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                if bulk:
                    bulk_chunk(dKV, acc_dkv_t, idx_s, (kv_l, kv_r)[dkv_split % 2], d_v, d_tail)
                else:
                    scatter(dKV, acc_dkv_t, idx_s, bx, hb, blk, d_v, d_tail)
            if bulk:  # the stage is gathered into again after the caller's barrier: its adds must have read it
                if T.get_thread_binding() < bs:
                    T.tma_store_wait(0)

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            dO: T.Tensor([t_len, heads, d_v], bf16),
            Idx: T.Tensor([n_idx, topk], i32),
            VLen: T.Tensor([n_idx], i32),
            Lse: T.Tensor([t_len, heads], f32),
            Delta: T.Tensor([t_len, heads], f32),
            RowOffset: T.Tensor([1], i32),
            dQ: T.Tensor([t_len, heads, d_qk], bf16),
            dKV: T.Tensor(dkv_shape, f32),
            Tgt: T.Tensor(tgt_shape, f32),
        ):
            with T.Kernel(grid_rows, n_hblk, threads=threads) as (bx, hb):
                q_l = T.alloc_shared([block_h, dh], bf16)
                q_r = T.alloc_shared([block_h, dh], bf16)
                # no tail buffers (None) for a NoPE latent: every tail step is skipped at trace time
                q_t = T.alloc_shared([block_h, d_tail], bf16) if has_tail else None
                do_l = T.alloc_shared([block_h, dh], bf16)
                do_r = T.alloc_shared([block_h, dh], bf16)
                kv0_l = T.alloc_shared([bs, dh], bf16)
                kv0_r = T.alloc_shared([bs, dh], bf16)
                kt0 = T.alloc_shared([bs, d_tail], bf16) if has_tail else None
                kv1_l = T.alloc_shared([bs, dh], bf16)
                kv1_r = T.alloc_shared([bs, dh], bf16)
                kt1 = T.alloc_shared([bs, d_tail], bf16) if has_tail else None
                idx0 = T.alloc_shared([bs], i32)
                idx1 = T.alloc_shared([bs], i32)
                p_s = T.alloc_shared([block_h, bs], bf16)
                ds_s = T.alloc_shared([block_h, bs], bf16)
                lse_s = T.alloc_shared([block_h], f32)
                delta_s = T.alloc_shared([block_h], f32)

                acc_p = T.alloc_fragment([block_h, bs], f32)
                acc_dp = T.alloc_fragment([block_h, bs], f32)
                acc_dq_l = T.alloc_fragment([block_h, dh], f32)
                acc_dq_r = T.alloc_fragment([block_h, dh], f32)
                acc_dq_t = T.alloc_fragment([block_h, d_tail], f32) if has_tail else None
                acc_dkv = T.alloc_fragment([bs, dc], f32)
                acc_dkv_t = T.alloc_fragment([bs, d_tail], f32) if has_tail else None
                tsum = T.alloc_fragment([bs], f32) if with_target else None
                slots = T.alloc_local([bs // rows_per_pass], i32) if slot_prefetch else None  # the next gather's entries
                if bulk:
                    T.import_source(BULK_ADD_F32_SRC + STAGE_SRC)

                tx = T.get_thread_binding()
                t = RowOffset[0] + bx
                h0 = hb * block_h
                n_blk = T.ceildiv(VLen[t], bs)

                load_rows(Q, t, h0, tx, q_l, 0, dh)
                load_rows(Q, t, h0, tx, q_r, dh, dh)
                if has_tail:
                    load_rows(Q, t, h0, tx, q_t, d_v, d_tail)
                load_rows(dO, t, h0, tx, do_l, 0, dh)
                load_rows(dO, t, h0, tx, do_r, dh, dh)
                for h in T.Parallel(block_h):
                    # Padded heads (and, grouped, rows past the last query): lse = +inf gives P = 0.
                    live = rows.live(t, h0, h, t_len)
                    tq = rows.load_query(T, t, h, t_len)
                    head = T.min(rows.head(h0, h), heads - 1)
                    lse_s[h] = T.if_then_else(live, Lse[tq, head] * LOG2E, T.infinity(f32))
                    delta_s[h] = T.if_then_else(live, Delta[tq, head], 0)
                T.clear(acc_dq_l)
                T.clear(acc_dq_r)
                if has_tail:
                    T.clear(acc_dq_t)
                if n_blk > 0:
                    if slot_prefetch:
                        load_slots(Idx, t, topk, tx, slots, 0)
                    gather_block(KV, Idx, slots, t, t_kv, topk, tx, kv0_l, kv0_r, kt0, idx0, 0)
                for ip in T.serial(T.ceildiv(n_blk, 2)):
                    if 2 * ip + 1 < n_blk:
                        gather_block(KV, Idx, slots, t, t_kv, topk, tx, kv1_l, kv1_r, kt1, idx1, 2 * ip + 1)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    T.fence_proxy_async()
                    block_step(
                        kv0_l, kv0_r, kt0, idx0, 2 * ip, bx, hb, dKV,
                        q_l, q_r, q_t, do_l, do_r, p_s, ds_s, lse_s, delta_s,
                        acc_p, acc_dp, acc_dq_l, acc_dq_r, acc_dq_t, acc_dkv, acc_dkv_t, Tgt, tsum, t,
                    )  # fmt: skip
                    T.sync_threads()
                    if 2 * ip + 1 < n_blk:
                        if 2 * ip + 2 < n_blk:
                            gather_block(KV, Idx, slots, t, t_kv, topk, tx, kv0_l, kv0_r, kt0, idx0, 2 * ip + 2)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()
                        T.fence_proxy_async()
                        block_step(
                            kv1_l, kv1_r, kt1, idx1, 2 * ip + 1, bx, hb, dKV,
                            q_l, q_r, q_t, do_l, do_r, p_s, ds_s, lse_s, delta_s,
                            acc_p, acc_dp, acc_dq_l, acc_dq_r, acc_dq_t, acc_dkv, acc_dkv_t, Tgt, tsum, t,
                        )  # fmt: skip
                        T.sync_threads()

                for h, d in T.Parallel(block_h, dh):
                    if rows.live(t, h0, h, t_len):
                        dQ[rows.query(t, h), rows.head(h0, h), d] = T.cast(acc_dq_l[h, d], bf16)
                        dQ[rows.query(t, h), rows.head(h0, h), dh + d] = T.cast(acc_dq_r[h, d], bf16)
                if has_tail:
                    for h, d in T.Parallel(block_h, d_tail):
                        if rows.live(t, h0, h, t_len):
                            dQ[rows.query(t, h), rows.head(h0, h), d_v + d] = T.cast(acc_dq_t[h, d], bf16)

        return main

    return sparse_mla_bwd


@functools.cache
def _jit_dkv_reduce():
    tilelang, T = tilelang_modules()

    @tilelang.jit
    def sparse_mla_dkv_reduce(d_qk: int, n_hblk: int, threads: int = 192):
        """Deterministic dKV: ``Acc[s] += sum of Partial[pair] over the pairs of key s``, in ``Perm`` order."""
        t_kv = T.dynamic("t_kv")
        n_rows = T.dynamic("n_rows")
        n_pairs = T.dynamic("n_pairs")
        n_off = T.dynamic("n_off")  # t_kv + 1 (own symbol: shapes bind from plain variables)
        topk = T.dynamic("topk")
        f32, i32 = T.float32, T.int32
        per_thread = cdiv(d_qk, threads)

        @T.prim_func
        def main(
            Partial: T.Tensor([n_rows, n_hblk, topk, d_qk], f32),
            Perm: T.Tensor([n_pairs], i32),
            Offsets: T.Tensor([n_off], i32),
            Acc: T.Tensor([t_kv, d_qk], f32),
        ):
            with T.Kernel(t_kv, threads=threads) as s:
                tx = T.get_thread_binding()
                acc = T.alloc_local([per_thread], f32)
                p0 = Offsets[s]
                p1 = Offsets[s + 1]
                if p1 > p0:
                    for k in T.unroll(per_thread):
                        c = k * threads + tx
                        acc[k] = T.if_then_else(c < d_qk, Acc[s, T.min(c, d_qk - 1)], 0)
                    for p in T.serial(p1 - p0):
                        pair = Perm[p0 + p]
                        r = pair // topk
                        j = pair % topk
                        for hb in T.unroll(n_hblk):
                            for k in T.unroll(per_thread):
                                c = k * threads + tx
                                if c < d_qk:
                                    acc[k] = acc[k] + Partial[r, hb, j, c]
                    for k in T.unroll(per_thread):
                        c = k * threads + tx
                        if c < d_qk:
                            Acc[s, c] = acc[k]

        return main

    return sparse_mla_dkv_reduce


# --------------------------------------------------------------------------------------------------------------------
# Checked interface
# --------------------------------------------------------------------------------------------------------------------


def deterministic_chunk_rows(topk: int, heads: int, d_qk: int, device: torch.device) -> int:
    """Tokens per deterministic chunk: the partial buffer stays near ``DETERMINISTIC_PARTIAL_BYTES``, and a chunk
    is a whole number of waves of one CTA per SM when it is larger than one wave."""
    _, n_hblk = head_block(heads)
    rows = max(1, DETERMINISTIC_PARTIAL_BYTES // (n_hblk * topk * d_qk * 4))
    sms = multiprocessor_count(device)
    return rows // sms * sms if rows > sms else rows


_LOADED_GROUPED_BWD: set[tuple] = set()


def load_grouped_backward(heads: int, d_qk: int, d_v: int, softmax_scale: float, group: int) -> None:
    """Build the grouped backward kernel (or load it from TileLang's disk cache) that the backward of a grouped
    forward may take, once per parameter set. Why: the backward takes it only once the query groups' top-k sets
    share enough keys (``GROUPED_BWD_MIN_SHARING``), which can first happen many steps in, and loading the kernel
    then stalls that step (issue 23: one step of 25 on the GLM-5 slice, 150-250 ms slower). Loading it with the
    first grouped forward moves that cost to the first step."""
    key = (heads, d_qk, d_v, float(softmax_scale), group)
    if key not in _LOADED_GROUPED_BWD:
        _jit_bwd()(heads, d_qk, d_v, float(softmax_scale), False, with_target=False, group=group)
        _LOADED_GROUPED_BWD.add(key)


def sparse_mla_bwd_interface(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    grad_lse: torch.Tensor | None = None,
    valid_len: torch.Tensor | None = None,
    deterministic: bool = False,
    with_target: bool = False,
    group: int = 1,
    union: tuple[torch.Tensor, torch.Tensor] | None = None,
    dkv_reduce: str = "atomic",
) -> tuple[torch.Tensor, ...]:
    """Backward kernel calls: ``(dq [T, H, d_qk] bf16, dkv [T_kv, d_qk] bf16)`` from the saved ``out`` and ``lse``;
    with ``with_target`` also the unnormalised head sum of ``P`` over the selected slots, fp32 ``[T, K]`` (0 on
    invalid slots; the contract of ``sparse_attention_target`` with this ``lse``), formed by the same kernel.

    ``grad_lse`` (fp32 ``[T, H]``) adds the gradient flowing into the returned LSE (``dS += P * grad_lse``).
    ``group`` != 1 (atomic dKV, no target; 0: ``64 // H``; ``32 // H`` experimental): one CTA per ``group``
    consecutive queries over the union of their index sets, as the grouped forward (``union``: a prebuilt
    ``group_union_indices`` of the same group). ``dkv_reduce`` (atomic dKV): ``"atomic"`` or ``"bulk"``
    (experimental, measured slower; ``_jit_bwd``'s bulk reductions; ``d_v`` of 512 or more, not deterministic) or
    ``"key_blocks"``: the per-query kernel forms ``dQ`` only and ``kernels.sparse_mla_dkv`` forms dKV by key blocks
    (no float atomics anywhere: deterministic whatever ``deterministic`` says; needs each row's valid indices
    distinct, as the indexer's top-k are; per-query only).
    """
    check_sparse_mla_args(q, kv, indices, d_v)
    if dkv_reduce not in DKV_REDUCTIONS:
        raise ValueError(f"dkv_reduce must be one of {DKV_REDUCTIONS}, got {dkv_reduce!r}")
    if dkv_reduce == "bulk" and deterministic:
        raise ValueError("dkv_reduce='bulk' adds dKV in a varying order: not with deterministic=True")
    if dkv_reduce == "key_blocks" and group != 1:
        raise ValueError("dkv_reduce='key_blocks' follows the per-query dQ pass: not with group != 1")
    t_len, heads, d_qk = q.shape
    t_kv = kv.shape[0]
    for name, t, shape, dtype in (
        ("out", out, (t_len, heads, d_v), torch.bfloat16),
        ("grad_out", grad_out, (t_len, heads, d_v), torch.bfloat16),
        ("lse", lse, (t_len, heads), torch.float32),
    ):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    _, n_hblk = head_block(heads)
    topk = indices.shape[1]
    if with_target:
        target = torch.zeros(n_hblk, t_len, topk, dtype=torch.float32, device=q.device)
    else:
        target = torch.empty(1, dtype=torch.float32, device=q.device)
    if t_len == 0:
        return (torch.zeros_like(q), torch.zeros_like(kv)) + ((target[0],) if with_target else ())
    if group != 1:
        if deterministic or with_target:
            raise ValueError("the grouped backward has atomic dKV only and no attention target")
        # the kernel reads the union rows
        group, indices, valid_len = grouped_rows(indices, heads, group, union, kv.shape[0], GROUPED_BWD_ROW_TILES)
    elif valid_len is None:
        valid_len = row_valid_len(indices)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    else:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    scale = float(softmax_scale)

    delta = _jit_delta()(heads, d_v)(out, grad_out, grad_lse)
    dq = torch.empty_like(q)
    if dkv_reduce == "key_blocks":
        kernel = _jit_bwd()(heads, d_qk, d_v, scale, False, with_target=with_target, with_dkv=False)
        row0 = torch.zeros(1, dtype=torch.int32, device=q.device)
        unused = torch.empty(1, d_qk, dtype=torch.float32, device=q.device)
        kernel(q, kv, grad_out, indices, valid_len, lse, delta, row0, dq, unused, target)
        dkv = dkv_key_blocks(q, kv, grad_out, lse, delta, indices, scale, d_v).to(kv.dtype)
        if with_target:
            return dq, dkv, (target[0] if n_hblk == 1 else target.sum(0))
        return dq, dkv
    extra = {"group": group} if group != 1 else {}  # the per-query kernel keeps its precompiled cache key
    if dkv_reduce != "atomic":
        extra["dkv_reduce"] = dkv_reduce
    kernel = _jit_bwd()(heads, d_qk, d_v, scale, deterministic, with_target=with_target, **extra)
    def outputs(dkv_acc: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads = (dq, dkv_acc.to(kv.dtype))
        return grads + ((target[0] if n_hblk == 1 else target.sum(0)),) if with_target else grads

    if not deterministic:
        dkv_acc = torch.zeros(t_kv, d_qk, dtype=torch.float32, device=q.device)
        row0 = torch.zeros(1, dtype=torch.int32, device=q.device)
        kernel(q, kv, grad_out, indices, valid_len, lse, delta, row0, dq, dkv_acc, target)
        return outputs(dkv_acc)

    # Deterministic: chunked partial contributions, then a fixed-order per-key sum (see module docstring).
    chunk = deterministic_chunk_rows(topk, heads, d_qk, q.device)
    partial = torch.empty(min(chunk, t_len), n_hblk, topk, d_qk, dtype=torch.float32, device=q.device)
    dkv_acc = torch.zeros(t_kv, d_qk, dtype=torch.float32, device=q.device)
    reduce = _jit_dkv_reduce()(d_qk, n_hblk)
    key_range = torch.arange(t_kv + 1, dtype=torch.int64, device=q.device)
    for c0 in range(0, t_len, chunk):
        c1 = min(t_len, c0 + chunk)
        row0 = torch.full((1,), c0, dtype=torch.int32, device=q.device)
        kernel(q, kv, grad_out, indices, valid_len, lse, delta, row0, dq, partial[: c1 - c0], target)
        keys = indices[c0:c1].reshape(-1).to(torch.int64)
        keys = torch.where((keys >= 0) & (keys < t_kv), keys, t_kv)  # invalid slots sort past every key
        sorted_keys, order = torch.sort(keys, stable=True)  # stable: a key's pairs stay in (token, slot) order
        offsets = torch.searchsorted(sorted_keys, key_range, out_int32=True)
        reduce(partial[: c1 - c0], order.to(torch.int32), offsets, dkv_acc)
    return outputs(dkv_acc)


# --------------------------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class AttentionTargetBox:
    """Where the sparse-MLA backward leaves, when given one at the forward, the unnormalised head sum of its ``P`` over
    each row's selected slots: fp32 ``[T, K]`` for this rank's heads (``sparse_attention_target``'s contract with the
    forward's LSE), the sparse indexer loss's target before the TP all-reduce and normalisation. The reader takes it
    (:meth:`take`), so a box serves one backward."""

    target: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        target, self.target = self.target, None
        return target


class SparseMLAFunction(torch.autograd.Function):
    """``(out, lse) = sparse_mla(q, kv, indices)`` with gradients for ``q`` and ``kv`` (and through ``lse``).

    Contract (oracle: ``megatron_glm5.dsa.reference.sparse_mla``):
        q ``[T, H, D]`` bf16 contiguous, H in [1, 128] (padded to 16/32/64-head blocks inside, never read or written
        out of range); kv ``[T_kv, D]`` bf16, the first ``d_v`` channels are the values; indices int32 ``[T, K]``
        global rows of kv, -1 (or anything outside ``[0, T_kv)``) = unused, never read. Any T, any K.
        Returns out ``[T, H, d_v]`` bf16 and natural-log lse ``[T, H]`` fp32 (+inf and out 0 for a row without a
        valid index). Forward saves ``out`` and ``lse``; the backward never re-runs the forward.
        ``deterministic=True`` gives bitwise run-to-run identical dq/dkv (no float atomics; slower, see
        ``sparse_mla_bwd``). ``target_box`` (an :class:`AttentionTargetBox`): the backward also writes the head-summed
        ``P`` into it (same kernel, no extra pass over the keys).
        ``grouped=True``: at 16 heads and up to 64K tokens (``index_groups.grouped_group``) the forward runs the
        grouped kernel (one CTA per 4 neighbouring queries over the union of their sets) and the backward too where
        those sets share enough keys (``GROUPED_BWD_MIN_SHARING``, measured in the forward); same contract, other
        rounding.
        ``key_blocks=True``: where ``sparse_mla_dkv.key_blocks_pay`` holds (past 8K tokens by the forward's bound of
        the dense work, ``key_block_work``: packed batches of shorter sequences) and no ``target_box`` is given, the
        backward forms dKV by key blocks
        (``dkv_reduce="key_blocks"``: no float atomics, deterministic) unless the grouped forward measured a
        sharing where the grouped backward is faster (``key_blocks_over_grouped``);
        needs each row's valid indices distinct (the indexer's top-k).
    """

    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, deterministic, variant, target_box=None, grouped=False,
                key_blocks=False, backward_follows=True):  # noqa: D102
        valid_len = row_valid_len(indices)
        group = grouped_group(q.shape[1], deterministic=deterministic, with_target=target_box is not None,
                              tokens=q.shape[0])
        ctx.probe = None
        if grouped and group > 1 and variant in ("auto", "ws", "sv", "pp"):
            union = group_union_indices(indices, group, key_bound=kv.shape[0])
            out, lse = sparse_mla_fwd_interface(q, kv, indices, softmax_scale, d_v, group=group, union=union,
                                                variant=variant)
            ctx.probe = SharingProbe.start(valid_len, union[1])  # the backward's choice, without a host sync
            if backward_follows:  # not under no_grad: a log-prob or eval forward never runs the backward
                try:
                    load_grouped_backward(q.shape[1], q.shape[2], d_v, softmax_scale, group)
                except Exception as err:  # the backward builds it again and raises there if it must
                    _log.warning("sparse MLA: loading the grouped backward kernel early failed (%s); the backward "
                                 "will build it", err)
            del union  # rebuilt by a grouped backward: the union is as large as the indices
        else:
            out, lse = sparse_mla_fwd_interface(q, kv, indices, softmax_scale, d_v, valid_len=valid_len,
                                                variant=variant)
        ctx.save_for_backward(q, kv, indices, valid_len, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.d_v = d_v
        ctx.deterministic = deterministic
        ctx.target_box = target_box
        # not with an attention target (the indexer loss after attention): that route is not measured with it
        ctx.key_blocks = (bool(key_blocks) and target_box is None
                          and key_blocks_fit(q.shape[1], q.shape[0], kv.shape[0], q.shape[2], d_v))
        ctx.work = None
        if ctx.key_blocks and backward_follows and q.shape[0] > KEY_BLOCKS_MAX_TOKENS:
            try:  # a packed batch (or a sequence a little past 8K) may pay: measure its dense work
                ctx.work = KeyBlockWorkProbe(indices, valid_len, kv.shape[0])
            except Exception as err:  # the atomic backward needs no probe
                _log.warning("sparse MLA: the key-block work probe failed (%s); the backward adds dKV atomically", err)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # noqa: D102
        q, kv, indices, valid_len, out, lse = ctx.saved_tensors
        box = ctx.target_box
        grouped = {}
        sharing = ctx.probe.sharing() if ctx.probe is not None else 0.0
        dense_per_sparse = ctx.work.dense_per_sparse() if ctx.work is not None else None
        key_blocks = ctx.key_blocks and key_blocks_pay(
            q.shape[1], q.shape[0], q.shape[2], ctx.d_v, t_kv=kv.shape[0], dense_per_sparse=dense_per_sparse)
        if key_blocks and key_blocks_over_grouped(sharing, dense_per_sparse):
            grouped = {"dkv_reduce": "key_blocks"}
        elif sharing >= GROUPED_BWD_MIN_SHARING:
            group = 64 // q.shape[1]  # grouped_group's, as in the forward
            grouped = {"group": group, "union": group_union_indices(indices, group, key_bound=kv.shape[0])}
        grads = sparse_mla_bwd_interface(
            q,
            kv,
            out,
            lse,
            grad_out.to(torch.bfloat16).contiguous(),
            indices,
            ctx.softmax_scale,
            ctx.d_v,
            grad_lse=grad_lse,
            valid_len=valid_len,
            deterministic=ctx.deterministic,
            with_target=box is not None,
            **grouped,
        )
        if box is not None:
            box.target = grads[2]
        return grads[0], grads[1], None, None, None, None, None, None, None, None, None


def sparse_mla_autograd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    deterministic: bool = False,
    variant: Variant = "auto",
    target_box: AttentionTargetBox | None = None,
    grouped: bool = False,
    key_blocks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(out, lse)``; see ``SparseMLAFunction`` for the contract."""
    backward_follows = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    return SparseMLAFunction.apply(q, kv, indices, float(softmax_scale), int(d_v), bool(deterministic), variant,
                                   target_box, bool(grouped), bool(key_blocks), backward_follows)
