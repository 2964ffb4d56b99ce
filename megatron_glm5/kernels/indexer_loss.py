"""Fused TileLang kernels of the sparse DSA indexer KL loss, and the autograd function that ties them together.

Contract (flattened-token layout of ``megatron_glm5.dsa.reference``: every token of a micro-batch is one row of ``T``,
indices are global key rows, ``-1`` marks an unused slot; a slot is valid iff ``0 <= idx < S``, an invalid slot is
never read). Test oracle: ``megatron_glm5.dsa.indexer_loss`` (``sparse_index_scores``, ``sparse_target`` with
``lse=``, ``sparse_indexer_loss``).

* :func:`sparse_index_scores` ``(qi [T, Hi, Di] bf16, ki [S, Di] bf16, w [T, Hi] fp32, topk [T, K] int32)`` ->
  fp32 ``[T, K]``: ``sum_h w[t, h] * relu(qi[t, h] . ki[topk[t, k]])``, ``-inf`` on invalid slots.
* :func:`sparse_attention_target` ``(query [T, H, D] bf16, kv [S, D] bf16, topk [T, K] int32, lse [T, H] fp32,
  softmax_scale)`` -> fp32 ``[T, K]``: the **unnormalised** head sum ``sum_h exp(scale * q[t, h] . kv[topk[t, k]] -
  lse[t, h])``; 0 on invalid slots, and a head whose ``lse`` is ``+inf`` (a row without a valid slot, as
  ``sparse_mla_with_lse`` returns it) contributes 0. The caller all-reduces it over TP and L1-normalises it.
* :func:`fused_sparse_indexer_loss` ``(qi, ki, w, topk, target, rw)`` -> fp32 scalar: exactly the contract of
  ``indexer_loss.sparse_indexer_loss`` (normalised ``target [T, K]``, row weights ``rw [T]``; differentiable in
  ``qi``, ``ki``, ``w`` only; gradients in the inputs' dtypes).
* :func:`indexer_loss_supported` ``(qi, query, topk)``: whether these kernels accept the tensors (else use the oracle).

Slots are independent: a key repeated in two slots of a row gets its value in each slot (as the sparse attention,
whose softmax and LSE count it twice) and its gradient twice.

Preconditions (checked, errors name the argument, the expected and the found value): CUDA SM90 device, every tensor
contiguous on one device; ``qi``/``ki``/``query``/``kv`` bf16, ``w``/``lse``/``target``/``rw`` fp32 (the public
wrappers convert other float dtypes, and int64 ``topk`` to int32); ``1 <= Hi <= 64``, ``Di`` a multiple of 64 in
[64, 256] (GLM-5: 32 x 128); ``1 <= H <= 128`` heads per rank, ``D`` a multiple of 64 in [128, 576] (GLM-5 576,
NoPE 512); any ``T``, ``S`` and ``K >= 1`` (no padding of K needed; tail -1 padding costs nothing). ``softmax_scale``
is a compile-time constant of the target kernel (one build per scale; GLM-5 always 1/16).

Kernels (one CTA per query row; the selected key rows are gathered with guarded ``cp.async`` into two shared-memory
stages, the next block loading while this one computes; -1 slots are zero-filled without a memory read; blocks past
a row's last valid slot (``row_valid_len``) are skipped and their outputs written as constants):

1. ``index_scores``: 128 threads, 64-slot blocks. ``z [Hp, 64] = qi[t] ki_blk^T`` (bf16 MMA, fp32 accumulate; heads
   padded to ``Hp = max(16, next_pow2(Hi)) <= 64`` with zero queries and zero weights), ``relu(z) * w``, head sum.
   Gather-bound: ``K * Di * 2`` bytes per row (512 KB at K = 2048) for ``2 * K * Hi * Di`` FLOPs.
2. ``attention_target`` (its own module, :mod:`megatron_glm5.kernels.sparse_attention_target`, re-exported here):
   grid ``(T, ceil(H / 64))``, 32-slot blocks; ``exp(scale * q . kv - lse)`` summed over heads in one gather pass.
3. ``index_score_bwd``: from ``dscore [T, K]`` (times a device scalar ``grad``): recompute ``z``, then
   ``dw[h] = sum_k ds * relu(z)`` (fp32, kept per (head, lane) over the row's blocks and reduced once per row),
   ``dz = ds * w * (z > 0)`` (bf16 in shared memory, as flash-attention's dS),
   ``dqi = dz ki_blk`` accumulated in registers over the row's blocks (one bf16 store per row), and
   ``dki[idx] += dz^T qi`` into an ``[S, Di]`` fp32 buffer, cast once to bf16. The add (``dk_reduce``):
   ``"atomic"`` (default): ``atomicAdd`` on float2 straight from the MMA fragment (about 2 G atomics at 16K x 2048);
   ``"bulk"``: the block's ``[64, Di]`` fp32 rows staged in shared memory, one sm90 bulk reduction
   (``cp.reduce.async.bulk.global.shared::cta.add.f32``, ``Di * 4`` bytes) per slot. Measured (H200, 16K x 2048,
   ``scripts/bench/RESULTS_indexer_training.md``) the kernel is bound by latency at 2 CTAs per SM (253 registers),
   not by the atomics alone: capping registers for 4 CTAs per SM (``min_blocks``) takes it from 15.2 to 10.4 ms,
   while the bulk staging buffer (35 KB) keeps it at 2 CTAs per SM (13.9 ms). 128 threads up to 32 index heads, 256
   at 64. That ``dki`` is not bitwise reproducible run to run (fp32 summation order); ``dqi``, ``dw`` and the loss
   are.
   ``deterministic=True``: no float atomics. Rows run in chunks; each (row, slot) stores its ``Di``-wide fp32
   contribution to a partial buffer ``[rows, K, Di]`` (``DETERMINISTIC_PARTIAL_BYTES``, 2 GiB: ~2K rows at
   K = 2048), then ``sparse_mla_bwd``'s fixed-order reduction sums each key's contributions in (row, slot) order
   (from a stable sort of the chunk's indices). Bitwise reproducible; costs one write and one read of the partial
   buffer (``4 K Di`` bytes per row: 1 MiB at K = 2048) and a sort per chunk.

The loss glue between kernel 1 and 3: masked log-softmax of the scores over the valid slots,
``KL_t = sum_k p (log max(p, 1e-10) - log_pred)``, loss ``sum_t rw_t KL_t`` and
``dscore = rw * (softmax(score) * sum(p) - p)`` (0 on invalid slots), written over the score buffer and saved for the
backward (4 bytes per slot: 256 MB at 32K x 2048). On the GPU it is one Triton program per row
(:mod:`megatron_glm5.kernels.indexer_kl`); :func:`kl_loss_and_dscore_` is the same in torch, chunked over rows
(``[rows, K]`` temporaries of ``GLUE_CHUNK_BYTES``), and its oracle.

Provenance: the gather (guarded ``cp.async``, two stages, per-row block count) is the one of our
``sparse_mla_bwd``; the per-row indexer-backward shape (score gradient -> dq, dw by row, dk by atomics) follows the
facts of megatron-core 0.19.2 ``ops/tilelang_indexer_bwd.py`` (itself from tile-ai/tilelang
``examples/dsa_sparse_finetune/indexer_bwd.py``), rewritten: bf16 operands instead of fp32 shared tiles, pipelined
``cp.async`` gathers, blocks past the valid length skipped, any ``Hi <= 64``, any K (no power-of-two padding),
vectorised atomics straight from the MMA fragments, and the incoming gradient folded in on the device.
megatron-core's ``indexer_bwd_interface`` stays selectable (``bwd_impl="mcore"``) as a cross-check.

No ``from __future__ import annotations`` here: TileLang evaluates the nested prim_funcs' annotations.
"""

import functools
from typing import Literal

import torch

from megatron_glm5.kernels._common import (
    BULK_ADD_F32_SRC,
    check_tensor,
    multiprocessor_count,
    next_power_of_2,
    row_valid_len,
    tilelang_modules,
)
from megatron_glm5.kernels.gather import index_gather_macro
from megatron_glm5.kernels.indexer_kl import kl_rows_and_dscore_, kl_supported
from megatron_glm5.kernels.sparse_attention_target import sparse_attention_target  # noqa: F401 (re-exported)

TARGET_EPS = 1e-10  # megatron-core's INDEXER_LOSS_EPS (= megatron_glm5.dsa.indexer_loss.TARGET_EPS)
GLUE_CHUNK_BYTES = 64 << 20  # per [rows, K] fp32 temporary of the torch loss glue
DETERMINISTIC_PARTIAL_BYTES = 2 << 30  # the deterministic backward's per-chunk partial dki buffer
MAX_INDEX_HEADS = 64
BwdImpl = Literal["ours", "mcore"]
DK_REDUCE = ("atomic", "bulk")  # how the non-deterministic index backward adds dki (module docstring, kernel 3)


def index_head_block(heads: int) -> int:
    """Padded index-head count of the kernels' MMA tiles (the M dimension): 16, 32 or 64."""
    return max(16, next_power_of_2(heads))


# --------------------------------------------------------------------------------------------------------------------
# TileLang factories
# --------------------------------------------------------------------------------------------------------------------

_PASS_CONFIGS = ("TL_DISABLE_TMA_LOWER", "TL_DISABLE_WARP_SPECIALIZED")


def _pass_configs(tilelang) -> dict:
    return {getattr(tilelang.PassConfigKey, k): True for k in _PASS_CONFIGS}


@functools.cache
def _jit_index_scores():
    tilelang, T = tilelang_modules()

    @tilelang.jit(out_idx=[5], pass_configs=_pass_configs(tilelang))  # non-negative: see _common.OUT_IDX_NOTE
    def sparse_index_scores_kernel(heads: int, dim: int, block_s: int = 64, threads: int = 128):
        """``Score[t, k] = sum_h W[t, h] relu(QI[t, h] . KI[Idx[t, k]])``, -inf on invalid slots."""
        block_h = index_head_block(heads)
        if heads > MAX_INDEX_HEADS or dim % 64 or dim > 256 or block_s % (threads // (dim // 8)):
            raise ValueError(f"index scores kernel needs heads <= 64, dim a multiple of 64 up to 256 and block_s a "
                             f"multiple of threads / (dim / 8); got heads={heads}, dim={dim}, block_s={block_s}")
        bs = block_s
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        gather = index_gather_macro(T, dim, bs, threads, with_grad=False)

        @T.macro
        def block_step(Score, t, topk, q_s, w_s, k_s, idx_s, acc, sc, blk):
            T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True)
            for h, j in T.Parallel(block_h, bs):
                acc[h, j] = T.max(acc[h, j], 0) * w_s[h]
            T.reduce_sum(acc, sc, dim=0)
            for j in T.Parallel(bs):
                if blk * bs + j < topk:
                    Score[t, blk * bs + j] = T.if_then_else(idx_s[j] >= 0, sc[j], -T.infinity(f32))

        @T.prim_func
        def main(
            QI: T.Tensor([t_len, heads, dim], bf16),
            KI: T.Tensor([t_kv, dim], bf16),
            W: T.Tensor([t_len, heads], f32),
            Idx: T.Tensor([t_len, topk], i32),
            VLen: T.Tensor([t_len], i32),
            Score: T.Tensor([t_len, topk], f32),
        ):
            with T.Kernel(t_len, threads=threads) as t:
                q_s = T.alloc_shared([block_h, dim], bf16)
                w_s = T.alloc_shared([block_h], f32)
                k0 = T.alloc_shared([bs, dim], bf16)
                k1 = T.alloc_shared([bs, dim], bf16)
                idx0 = T.alloc_shared([bs], i32)
                idx1 = T.alloc_shared([bs], i32)
                acc = T.alloc_fragment([block_h, bs], f32)
                sc = T.alloc_fragment([bs], f32)

                tx = T.get_thread_binding()
                n_blk = T.ceildiv(VLen[t], bs)
                # Padded heads: zero queries and zero weights, so they add nothing.
                for h, d in T.Parallel(block_h, dim):
                    q_s[h, d] = T.if_then_else(h < heads, QI[t, T.min(h, heads - 1), d], 0)
                for h in T.Parallel(block_h):
                    w_s[h] = T.if_then_else(h < heads, W[t, T.min(h, heads - 1)], 0)
                # Slots of the skipped tail blocks (all invalid): -inf.
                for it in T.serial(T.ceildiv(T.max(topk - n_blk * bs, 0), threads)):
                    slot = n_blk * bs + it * threads + tx
                    if slot < topk:
                        Score[t, slot] = -T.infinity(f32)
                if n_blk > 0:
                    gather(KI, Idx, None, None, t, t_kv, topk, tx, k0, idx0, None, 0)
                for ip in T.serial(T.ceildiv(n_blk, 2)):
                    if 2 * ip + 1 < n_blk:
                        gather(KI, Idx, None, None, t, t_kv, topk, tx, k1, idx1, None, 2 * ip + 1)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    T.fence_proxy_async()
                    block_step(Score, t, topk, q_s, w_s, k0, idx0, acc, sc, 2 * ip)
                    T.sync_threads()
                    if 2 * ip + 1 < n_blk:
                        if 2 * ip + 2 < n_blk:
                            gather(KI, Idx, None, None, t, t_kv, topk, tx, k0, idx0, None, 2 * ip + 2)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()
                        T.fence_proxy_async()
                        block_step(Score, t, topk, q_s, w_s, k1, idx1, acc, sc, 2 * ip + 1)
                        T.sync_threads()

        return main

    return sparse_index_scores_kernel


@functools.cache
def _jit_index_bwd():
    tilelang, T = tilelang_modules()

    @tilelang.jit(pass_configs=_pass_configs(tilelang))
    def sparse_index_score_bwd_kernel(heads: int, dim: int, deterministic: bool = False, block_s: int = 64,
                                      threads: int = 0, dk_reduce: str = "atomic", min_blocks: int = -1):
        """``dQI``, ``dW`` per row and ``dKI`` from ``DS * GradScale[0]``. ``dKI`` is an fp32 ``[S, Di]`` buffer
        that the rows add into (``dk_reduce``: ``"bulk"`` one TMA ``cp.reduce.async.bulk`` add of a slot's whole
        ``Di``-wide row from shared memory, ``"atomic"`` float2 atomics from the MMA fragment), or
        (``deterministic``) a per-slot partial buffer ``[n_rows, 1, K, Di]`` of the launch's rows (row ``bx`` is
        token ``RowOffset[0] + bx``), summed afterwards in a fixed order.
        ``min_blocks`` > 0: ``__launch_bounds__(threads, min_blocks)``, capping registers for that many CTAs per SM;
        -1 (default): 4 for the 128-thread non-deterministic float2-atomic kernel with ``dim <= 128`` (253 -> 128
        registers, a few bytes spilled; 10.4 ms instead of 15.2 at 16K x 2048 on the H200,
        ``scripts/bench/sweep_indexer_loss_kernels.py``), else none (wider heads would spill heavily; the bulk
        variant's shared memory allows 2 CTAs per SM anyway)."""
        block_h = index_head_block(heads)
        if threads == 0:
            threads = 256 if block_h >= 64 else 128
        if min_blocks < 0:  # measured for GLM-5's 128-wide heads with float2 atomics only
            min_blocks = 4 if threads == 128 and not deterministic and dim <= 128 and dk_reduce == "atomic" else 0
        if dk_reduce not in DK_REDUCE:
            raise ValueError(f"dk_reduce must be one of {DK_REDUCE}, got {dk_reduce!r}")
        bulk = dk_reduce == "bulk" and not deterministic
        if bulk and block_s > threads:
            raise ValueError(f"the bulk dki reduction issues one copy per slot and thread: block_s={block_s} must be "
                             f"<= threads={threads}")
        if heads > MAX_INDEX_HEADS or dim % 64 or dim > 256 or block_s % (threads // (dim // 8)):
            raise ValueError(f"index backward kernel needs heads <= 64, dim a multiple of 64 up to 256 and block_s a "
                             f"multiple of threads / (dim / 8); got heads={heads}, dim={dim}, block_s={block_s}")
        bs = block_s
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")
        n_rows = T.dynamic("n_rows")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32
        gather = index_gather_macro(T, dim, bs, threads, with_grad=True)
        dk_shape = [n_rows, 1, topk, dim] if deterministic else [t_kv, dim]
        grid_rows = n_rows if deterministic else t_len

        @T.macro
        def block_step(dKI, bx, blk, q_s, w_s, k_s, idx_s, ds_s, dz_s, acc_z, acc_dw, acc_dq, acc_dk, dk_s, tx):
            T.gemm(q_s, k_s, acc_z, transpose_B=True, clear_accum=True)
            for h, j in T.Parallel(block_h, bs):
                # dw terms stay per (head, lane) across the row's blocks: one cross-thread reduction per row
                acc_dw[h, j] = acc_dw[h, j] + ds_s[j] * T.max(acc_z[h, j], 0)
            for h, j in T.Parallel(block_h, bs):  # a loop of its own: the float2-vectorised dw update above
                acc_z[h, j] = T.if_then_else(acc_z[h, j] > 0, ds_s[j] * w_s[h], 0)
            T.copy(acc_z, dz_s)
            T.gemm(dz_s, k_s, acc_dq)  # dqi [Hp, Di] += dz [Hp, bs] ki [bs, Di]
            T.gemm(dz_s, q_s, acc_dk, transpose_A=True, clear_accum=True)  # dk [bs, Di] = dz^T qi
            if deterministic:
                for j, d in T.Parallel(bs, dim):
                    if blk * bs + j < topk:
                        dKI[bx, 0, blk * bs + j, d] = acc_dk[j, d]
            elif bulk:
                # Staging rows are padded by 8 floats (fragment stores without bank conflicts; rows stay 16 B
                # aligned). The previous block's bulk adds must have read the staging buffer before it is reused.
                if tx < bs:
                    T.tma_store_wait(0)
                T.sync_threads()
                for j, d in T.Parallel(bs, dim):
                    dk_s[j, d] = acc_dk[j, d]
                T.fence_proxy_async()  # generic-proxy writes -> visible to the bulk copy engine
                T.sync_threads()
                if tx < bs:
                    if idx_s[tx] >= 0:
                        T.call_extern("handle", "glm5_bulk_add_f32", T.access_ptr(dk_s[tx, 0], "r", dim),
                                      T.access_ptr(dKI[idx_s[tx], 0], "rw", dim), dim * 4)
                    T.tma_store_arrive()
            else:
                for j, d in T.Parallel(bs, dim):
                    if idx_s[j] >= 0:
                        T.atomic_add(dKI[idx_s[j], d], acc_dk[j, d])

        @T.prim_func
        def main(
            QI: T.Tensor([t_len, heads, dim], bf16),
            KI: T.Tensor([t_kv, dim], bf16),
            W: T.Tensor([t_len, heads], f32),
            Idx: T.Tensor([t_len, topk], i32),
            VLen: T.Tensor([t_len], i32),
            DS: T.Tensor([t_len, topk], f32),
            GradScale: T.Tensor([1], f32),
            RowOffset: T.Tensor([1], i32),
            dQI: T.Tensor([t_len, heads, dim], bf16),
            dW: T.Tensor([t_len, heads], f32),
            dKI: T.Tensor(dk_shape, f32),
        ):
            with T.Kernel(grid_rows, threads=threads) as bx:
                if min_blocks:
                    T.annotate_min_blocks_per_sm(min_blocks)
                q_s = T.alloc_shared([block_h, dim], bf16)
                w_s = T.alloc_shared([block_h], f32)
                k0 = T.alloc_shared([bs, dim], bf16)
                k1 = T.alloc_shared([bs, dim], bf16)
                idx0 = T.alloc_shared([bs], i32)
                idx1 = T.alloc_shared([bs], i32)
                ds0 = T.alloc_shared([bs], f32)
                ds1 = T.alloc_shared([bs], f32)
                dz_s = T.alloc_shared([block_h, bs], bf16)
                acc_z = T.alloc_fragment([block_h, bs], f32)
                acc_dw = T.alloc_fragment([block_h, bs], f32)
                dw_acc = T.alloc_fragment([block_h], f32)
                acc_dq = T.alloc_fragment([block_h, dim], f32)
                acc_dk = T.alloc_fragment([bs, dim], f32)
                dk_s = T.alloc_shared([bs, dim + 8], f32) if bulk else None
                if bulk:
                    T.import_source(BULK_ADD_F32_SRC)

                tx = T.get_thread_binding()
                t = RowOffset[0] + bx
                n_blk = T.ceildiv(VLen[t], bs)
                gs = GradScale[0]
                for h, d in T.Parallel(block_h, dim):
                    q_s[h, d] = T.if_then_else(h < heads, QI[t, T.min(h, heads - 1), d], 0)
                for h in T.Parallel(block_h):
                    w_s[h] = T.if_then_else(h < heads, W[t, T.min(h, heads - 1)], 0)
                T.clear(acc_dq)
                T.clear(acc_dw)
                if n_blk > 0:
                    gather(KI, Idx, DS, gs, t, t_kv, topk, tx, k0, idx0, ds0, 0)
                for ip in T.serial(T.ceildiv(n_blk, 2)):
                    if 2 * ip + 1 < n_blk:
                        gather(KI, Idx, DS, gs, t, t_kv, topk, tx, k1, idx1, ds1, 2 * ip + 1)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    T.fence_proxy_async()
                    block_step(dKI, bx, 2 * ip, q_s, w_s, k0, idx0, ds0, dz_s, acc_z, acc_dw, acc_dq, acc_dk, dk_s, tx)
                    T.sync_threads()
                    if 2 * ip + 1 < n_blk:
                        if 2 * ip + 2 < n_blk:
                            gather(KI, Idx, DS, gs, t, t_kv, topk, tx, k0, idx0, ds0, 2 * ip + 2)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()
                        T.fence_proxy_async()
                        block_step(dKI, bx, 2 * ip + 1, q_s, w_s, k1, idx1, ds1, dz_s, acc_z, acc_dw, acc_dq, acc_dk,
                                   dk_s, tx)
                        T.sync_threads()

                for h, d in T.Parallel(block_h, dim):
                    if h < heads:
                        dQI[t, h, d] = T.cast(acc_dq[h, d], bf16)
                T.reduce_sum(acc_dw, dw_acc, dim=1)
                for h in T.Parallel(block_h):
                    if h < heads:
                        dW[t, h] = dw_acc[h]
                if bulk:  # the staging buffer must outlive the last bulk adds' reads
                    if tx < bs:
                        T.tma_store_wait(0)

        return main

    return sparse_index_score_bwd_kernel


# --------------------------------------------------------------------------------------------------------------------
# Checked interfaces
# --------------------------------------------------------------------------------------------------------------------


def check_index_args(qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, topk: torch.Tensor) -> None:
    """Validate the indexer-side tensors: ``qi [T, Hi, Di]`` bf16, ``ki [S, Di]`` bf16, ``w [T, Hi]`` fp32,
    ``topk [T, K]`` int32, all contiguous on one device; ``1 <= Hi <= 64``, ``Di`` a multiple of 64 up to 256."""
    check_tensor("qi", qi, dtype=torch.bfloat16, ndim=3)
    check_tensor("ki", ki, dtype=torch.bfloat16, ndim=2, device=qi.device)
    check_tensor("w", w, dtype=torch.float32, ndim=2, device=qi.device)
    check_tensor("topk", topk, dtype=torch.int32, ndim=2, device=qi.device)
    t_len, heads, dim = qi.shape
    if ki.shape[1] != dim:
        raise ValueError(f"ki must be [S, {dim}] like qi's last dim, got {tuple(ki.shape)}")
    if tuple(w.shape) != (t_len, heads):
        raise ValueError(f"w must be [T={t_len}, Hi={heads}] like qi, got {tuple(w.shape)}")
    if topk.shape[0] != t_len:
        raise ValueError(f"topk must be [T={t_len}, K] like qi, got {tuple(topk.shape)}")
    if not 1 <= heads <= MAX_INDEX_HEADS:
        raise ValueError(f"index heads must be in [1, {MAX_INDEX_HEADS}], got {heads}")
    if dim % 64 or not 64 <= dim <= 256:
        raise ValueError(f"index head dim must be a multiple of 64 in [64, 256] (GLM-5: 128), got {dim}")
    if topk.shape[1] == 0:
        raise ValueError("topk must have at least one slot (K >= 1)")


def sparse_index_scores_interface(
    qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, topk: torch.Tensor, *, valid_len: torch.Tensor | None = None
) -> torch.Tensor:
    """Kernel 1 (strict dtypes, see :func:`check_index_args`): fp32 ``[T, K]``, -inf on invalid slots.
    ``valid_len`` (``row_valid_len(topk)``) may be passed in when the caller has it."""
    check_index_args(qi, ki, w, topk)
    t_len, heads, dim = qi.shape
    if t_len == 0 or ki.shape[0] == 0:  # no row, or no key to select: every slot is invalid
        return torch.full(topk.shape, float("-inf"), dtype=torch.float32, device=qi.device)
    if valid_len is None:
        valid_len = row_valid_len(topk)
    kernel = _jit_index_scores()(heads, dim)
    return kernel(qi, ki, w, topk, valid_len)


def index_score_bwd_interface(
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    topk: torch.Tensor,
    dscore: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    *,
    valid_len: torch.Tensor | None = None,
    deterministic: bool = False,
    impl: BwdImpl = "ours",
    dk_reduce: str = "atomic",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel 3: gradients of ``score = sum_h w relu(qi . ki[topk])`` given ``d score = dscore * grad_scale``
    (``grad_scale`` a 1-element fp32 device tensor, default 1): ``(dqi [T, Hi, Di] bf16, dki [S, Di] bf16,
    dw [T, Hi] fp32)``. ``deterministic=True``: dki without float atomics (module docstring), bitwise reproducible.
    ``dk_reduce`` (non-deterministic only): ``"atomic"`` (default) adds ``dki`` with float2 atomics, ``"bulk"`` each
    slot's row with one sm90 bulk reduction (slower here: its shared staging buffer halves the CTAs per SM).
    ``impl="mcore"`` runs megatron-core 0.19.2's ``indexer_bwd_interface`` instead (needs ``Hi % 8 == 0``; pads K
    to a power of two; fp32 atomics)."""
    check_index_args(qi, ki, w, topk)
    check_tensor("dscore", dscore, dtype=torch.float32, ndim=2, device=qi.device)
    if dscore.shape != topk.shape:
        raise ValueError(f"dscore must be shaped like topk {tuple(topk.shape)}, got {tuple(dscore.shape)}")
    t_len, heads, dim = qi.shape
    if grad_scale is None:
        grad_scale = torch.ones(1, dtype=torch.float32, device=qi.device)
    grad_scale = grad_scale.reshape(1).to(device=qi.device, dtype=torch.float32).contiguous()
    if impl == "mcore":
        from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_bwd import (
            indexer_bwd_interface,
            is_supported_indexer_bwd_head_count,
        )

        if not is_supported_indexer_bwd_head_count(heads):
            raise ValueError(f"bwd_impl='mcore' needs index heads <= 64 and a multiple of 8, got {heads}")
        if deterministic:
            raise ValueError("bwd_impl='mcore' has no deterministic mode (it adds dki with fp32 atomics)")
        dq, dw, dk = indexer_bwd_interface(qi, w, ki, topk, dscore * grad_scale)
        return dq, dk, dw
    if impl != "ours":
        raise ValueError(f"impl must be 'ours' or 'mcore', got {impl!r}")
    dk_acc = torch.zeros(ki.shape, dtype=torch.float32, device=qi.device)
    if t_len == 0 or ki.shape[0] == 0:
        return torch.zeros_like(qi), dk_acc.to(ki.dtype), torch.zeros_like(w)
    dq = torch.empty_like(qi)
    dw = torch.empty_like(w)
    if valid_len is None:
        valid_len = row_valid_len(topk)
    if dk_reduce not in DK_REDUCE:
        raise ValueError(f"dk_reduce must be one of {DK_REDUCE}, got {dk_reduce!r}")
    if deterministic and dk_reduce != "atomic":
        raise ValueError(f"deterministic=True has its own dki path (partial sums, no float adds): it takes no "
                         f"dk_reduce={dk_reduce!r}")
    kernel = _jit_index_bwd()(heads, dim, bool(deterministic), dk_reduce=dk_reduce)
    if not deterministic:
        row0 = torch.zeros(1, dtype=torch.int32, device=qi.device)
        kernel(qi, ki, w, topk, valid_len, dscore, grad_scale, row0, dq, dw, dk_acc)
        return dq, dk_acc.to(ki.dtype), dw

    # Deterministic: per chunk of rows, each (row, slot) writes its Di-wide contribution (no atomics); then every key
    # sums its contributions in (row, slot) order, from a stable sort of the chunk's indices.
    from megatron_glm5.kernels.sparse_mla_bwd import _jit_dkv_reduce

    t_kv, width = ki.shape[0], topk.shape[1]
    chunk = deterministic_chunk_rows(width, dim, qi.device)
    partial = torch.empty(min(chunk, t_len), 1, width, dim, dtype=torch.float32, device=qi.device)
    reduce = _jit_dkv_reduce()(dim, 1, 128)
    key_range = torch.arange(t_kv + 1, dtype=torch.int64, device=qi.device)
    for c0 in range(0, t_len, chunk):
        c1 = min(t_len, c0 + chunk)
        row0 = torch.full((1,), c0, dtype=torch.int32, device=qi.device)
        kernel(qi, ki, w, topk, valid_len, dscore, grad_scale, row0, dq, dw, partial[: c1 - c0])
        keys = topk[c0:c1].reshape(-1).to(torch.int64)
        keys = torch.where((keys >= 0) & (keys < t_kv), keys, t_kv)  # invalid slots sort past every key
        sorted_keys, order = torch.sort(keys, stable=True)
        offsets = torch.searchsorted(sorted_keys, key_range, out_int32=True)
        reduce(partial[: c1 - c0], order.to(torch.int32), offsets, dk_acc)
    return dq, dk_acc.to(ki.dtype), dw


def deterministic_chunk_rows(width: int, dim: int, device: torch.device) -> int:
    """Rows per deterministic backward chunk: the fp32 partial buffer ``[rows, K, Di]`` stays near
    ``DETERMINISTIC_PARTIAL_BYTES``; a whole number of waves of one CTA per SM when larger than one wave."""
    rows = max(1, DETERMINISTIC_PARTIAL_BYTES // (width * dim * 4))
    sms = multiprocessor_count(device)
    return rows // sms * sms if rows > sms else rows


# --------------------------------------------------------------------------------------------------------------------
# Loss glue (torch, chunked over rows) and autograd
# --------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def kl_loss_and_dscore_(
    score: torch.Tensor,
    target: torch.Tensor,
    rw: torch.Tensor,
    topk: torch.Tensor,
    n_keys: int,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The KL value ``sum_t rw_t sum_k p (log max(p, eps) - log_softmax(score))`` over the valid slots
    (``0 <= topk < n_keys``), fp32 0-dim; ``score [T, K]`` fp32 (-inf on invalid slots) is overwritten in place by
    ``dscore = rw * (softmax(score) * sum(p) - p)`` (0 on invalid slots). Rows without a valid slot give 0."""
    t_len, width = score.shape
    rows = chunk_rows or max(1, GLUE_CHUNK_BYTES // (4 * max(1, width)))
    total = torch.zeros((), dtype=torch.float32, device=score.device)
    for c0 in range(0, t_len, rows):
        c1 = min(t_len, c0 + rows)
        s = score[c0:c1]
        idx = topk[c0:c1]
        valid = (idx >= 0) & (idx < n_keys)
        tgt = target[c0:c1].to(torch.float32)
        r = rw[c0:c1].to(torch.float32)
        lse = torch.logsumexp(s.masked_fill(~valid, float("-inf")), dim=-1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        log_pred = s.masked_fill(~valid, float("-inf")).sub_(lse)
        terms = tgt.clamp_min(TARGET_EPS).log_().sub_(log_pred).mul_(tgt).masked_fill_(~valid, 0.0)
        total += (terms.sum(-1) * r).sum()
        del terms
        pred = log_pred.exp_()  # 0 on invalid slots
        s.copy_(pred.mul_(tgt.sum(-1, keepdim=True)).sub_(tgt).mul_(r[:, None]).masked_fill_(~valid, 0.0))
    return total


class SparseIndexerLoss(torch.autograd.Function):
    """``loss = sum_t rw_t KL(target_t || softmax(score_t))`` over each row's valid slots, with ``score`` from
    kernel 1; saves ``dscore [T, K]`` fp32 (not the scores) and runs kernel 3 in the backward.

    Same contract as ``megatron_glm5.dsa.indexer_loss.sparse_indexer_loss`` (the oracle): ``qi [T, Hi, Di]`` and
    ``ki [S, Di]`` bf16, ``w [T, Hi]`` (any float dtype; fp32 inside), ``topk [T, K]`` int32 (int64 converted),
    ``target [T, K]`` the normalised target (fp32; no gradient), ``rw [T]`` row weights (no gradient). Returns an
    fp32 scalar; gradients reach ``qi``, ``ki``, ``w`` only, in their own dtypes.
    """

    @staticmethod
    def forward(ctx, qi, ki, w, topk, target, rw, deterministic, bwd_impl):  # noqa: D102
        w32 = w.detach().to(torch.float32).contiguous()
        topk32 = topk.to(torch.int32).contiguous()
        if target.shape != topk.shape:
            raise ValueError(f"target must be shaped like topk {tuple(topk.shape)}, got {tuple(target.shape)}")
        if rw.shape != (qi.shape[0],):
            raise ValueError(f"rw must be [T={qi.shape[0]}], got {tuple(rw.shape)}")
        valid_len = row_valid_len(topk32)
        score = sparse_index_scores_interface(qi, ki, w32, topk32, valid_len=valid_len)
        target32, rw32 = target.detach().to(torch.float32).contiguous(), rw.detach().to(torch.float32)
        if kl_supported(score):  # one Triton pass per row (indexer_kl); the torch glue is its oracle
            loss = kl_rows_and_dscore_(score, target32, rw32, topk32, ki.shape[0]).sum()
        else:
            loss = kl_loss_and_dscore_(score, target32, rw32, topk32, ki.shape[0])
        ctx.save_for_backward(qi, ki, w32, topk32, valid_len, score)  # score now holds dscore
        ctx.w_dtype = w.dtype
        ctx.deterministic = deterministic
        ctx.bwd_impl = bwd_impl
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: D102
        qi, ki, w32, topk, valid_len, dscore = ctx.saved_tensors
        dqi, dki, dw = index_score_bwd_interface(
            qi, ki, w32, topk, dscore, grad.detach(), valid_len=valid_len, deterministic=ctx.deterministic,
            impl=ctx.bwd_impl,
        )
        return dqi.to(qi.dtype), dki.to(ki.dtype), dw.to(ctx.w_dtype), None, None, None, None, None


def fused_sparse_indexer_loss(
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    topk: torch.Tensor,
    target: torch.Tensor,
    rw: torch.Tensor,
    *,
    deterministic: bool = False,
    bwd_impl: BwdImpl = "ours",
) -> torch.Tensor:
    """Sparse indexer KL loss with the fused kernels; the contract of
    ``megatron_glm5.dsa.indexer_loss.sparse_indexer_loss`` (see :class:`SparseIndexerLoss`). The loss, ``dqi`` and
    ``dw`` are bitwise reproducible run to run; ``dki`` too with ``deterministic=True`` (no float atomics; costs a
    write and a read of a ``[rows, K, Di]`` fp32 partial buffer per chunk of rows, and a sort of the indices)."""
    return SparseIndexerLoss.apply(qi, ki, w, topk, target.detach(), rw.detach(), bool(deterministic), bwd_impl)


def sparse_index_scores(qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, K]``: ``sum_h w[t, h] * relu(qi[t, h] . ki[topk[t, k]])``, -inf on invalid slots (no autograd).
    ``w`` of any float dtype and int64 ``topk`` are converted."""
    return sparse_index_scores_interface(qi, ki, w.to(torch.float32).contiguous(), topk.to(torch.int32).contiguous())


# --------------------------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------------------------


def indexer_loss_supported(qi: torch.Tensor, query: torch.Tensor | None = None, topk: torch.Tensor | None = None) -> bool:
    """Whether the fused kernels accept these tensors (else use ``megatron_glm5.dsa.indexer_loss``): TileLang
    importable, CUDA device of compute capability >= 9.0 (SM90), bf16 ``qi [T, Hi, Di]`` with ``1 <= Hi <= 64`` and
    ``Di`` a multiple of 64 in [64, 256]; bf16 ``query [T, H, D]`` with ``1 <= H <= 128`` and ``D`` a multiple of 64
    in [128, 576] (GLM-5 576, NoPE 512); integer ``topk [T, K]`` (int32, or int64 that the wrappers convert),
    ``K >= 1``, ``T`` equal everywhere. ``ki``, ``w``, ``kv`` and ``lse`` are checked by the calls themselves."""
    if not isinstance(qi, torch.Tensor) or not qi.is_cuda or qi.dtype != torch.bfloat16 or qi.ndim != 3:
        return False
    t_len, heads, dim = qi.shape
    if not 1 <= heads <= MAX_INDEX_HEADS or dim % 64 or not 64 <= dim <= 256:
        return False
    if query is not None:
        if not query.is_cuda or query.dtype != torch.bfloat16 or query.ndim != 3 or query.shape[0] != t_len:
            return False
        if not 1 <= query.shape[1] <= 128 or query.shape[2] % 64 or not 128 <= query.shape[2] <= 576:
            return False
    if topk is not None:
        if not topk.is_cuda or topk.dtype not in (torch.int32, torch.int64) or topk.ndim != 2:
            return False
        if topk.shape[0] != t_len or topk.shape[1] < 1:
            return False
    if torch.cuda.get_device_capability(qi.device)[0] < 9:
        return False
    try:
        tilelang_modules()
    except ImportError:
        return False
    return True
