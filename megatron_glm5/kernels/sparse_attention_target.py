"""The sparse DSA indexer loss's attention target in TileLang: the unnormalised head-summed attention probabilities
over each row's selected keys, from the LSE the sparse-MLA forward already returned.

``sparse_attention_target(query [T, H, D] bf16, kv [S, D] bf16, topk [T, K] int32, lse [T, H] fp32, softmax_scale)``
-> fp32 ``[T, K]``: ``sum_h exp(softmax_scale * query[t, h] . kv[topk[t, k]] - lse[t, h])``. A slot is valid iff
``0 <= idx < S`` (-1 = unused, never read); invalid slots give 0, and a head whose ``lse`` is ``+inf`` (a row without
a valid slot, as ``sparse_mla_with_lse`` returns it) adds 0. Not normalised: the caller all-reduces it over TP (heads
are split) and L1-normalises each row; with the attention's own LSE over the same slots each non-empty row sums to
``H``. A key repeated in two slots gets its value in both (the attention's softmax counts it twice too). Test oracle:
``megatron_glm5.dsa.indexer_loss.sparse_target(..., lse=lse)`` (which also normalises).

Preconditions (checked; errors name the argument, the expected and the found value): CUDA SM90 device, contiguous
tensors on one device, bf16 ``query``/``kv``, int32 ``topk``, fp32 ``lse`` (the public wrapper converts int64
indices and other float LSE dtypes); ``1 <= H <= 128`` heads per rank; ``D`` a multiple of 64 in [128, 576] (GLM-5
576 = 512 + 64 RoPE, NoPE 512); any ``T``, ``S`` and ``K >= 1``. ``softmax_scale`` is a compile-time constant (one
build per scale; GLM-5 always 1/16).

Kernel: grid ``(T, ceil(H / 64))``, one CTA per (row, head block of 16 / 32 / 64, padded with zero queries and
``lse = +inf``), 128 threads for a 16-head block, 256 for 32 / 64. The row's selected KV rows are gathered in 32-slot
blocks with guarded ``cp.async`` (16 B per lane, zero-fill without a read for invalid slots) into two shared-memory
stages, the next block loading while this one computes; blocks past the row's last valid slot (``row_valid_len``)
are skipped and their slots written as 0. Per block: ``s [Hb, 32] = q[t] kv_blk^T`` over all ``D`` channels (split
256 + 256 + 64-channel tail like the sparse-MLA kernels; NoPE has no tail; mma.sync at 16 / 32 heads, wgmma at 64),
``exp2(s * scale * log2e - lse * log2e)``, a head sum, one store. It is the QK half of the sparse-MLA forward with the
LSE known (no online softmax, one pass), so it costs about one gather of ``K x D`` bf16 per row (2.25 MiB at K = 2048,
D = 576): gather-bound like the forward at 16 heads per rank. Shared memory 92 KiB at 16 heads (two CTAs per SM),
146 KiB at 64. With more than 64 heads each head block writes a partial ``[T, K]`` and the interface adds them in a
fixed order.

Provenance: the gather and its two-stage ``cp.async`` pipeline are those of our ``sparse_mla_bwd``; the math is the
forward's ``P`` with the saved LSE (as the backward recomputes it). megatron-core 0.19.2's
``ops/tilelang_indexer_loss.sparse_indexer_target`` (read for facts) instead re-forms each head's softmax in two
passes over the keys with synchronous loads.

No ``from __future__ import annotations`` here: TileLang evaluates the nested prim_funcs' annotations.
"""

import functools

import torch

from megatron_glm5.kernels._common import LOG2E, check_tensor, row_valid_len, tilelang_modules
from megatron_glm5.kernels.gather import latent_gather_macro
from megatron_glm5.kernels.sparse_mla_fwd import head_block

# --------------------------------------------------------------------------------------------------------------------
# TileLang factory
# --------------------------------------------------------------------------------------------------------------------


def _pass_configs(tilelang) -> dict:
    return {
        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    }


@functools.cache
def _jit_target():
    tilelang, T = tilelang_modules()

    @tilelang.jit(out_idx=[5], pass_configs=_pass_configs(tilelang))  # non-negative: see _common.OUT_IDX_NOTE
    def sparse_attention_target_kernel(heads: int, d_qk: int, softmax_scale: float, block_s: int = 32,
                                       threads: int = 0):
        """``Out[hb, t, k] = sum_{h in head block hb} exp2(scale*log2e * Q[t,h] . KV[Idx[t,k]] - log2e * Lse[t,h])``."""
        block_h, n_hblk = head_block(heads)
        if threads == 0:
            threads = 256 if block_h >= 32 else 128
        d_tail = d_qk % 128  # GLM-5: the 64 RoPE channels of 576; NoPE (512): none
        dh = (d_qk - d_tail) // 2
        has_tail = d_tail > 0
        rows_per_pass = threads // 8
        if d_qk % 64 or dh % 64 or block_s % rows_per_pass:
            raise ValueError(f"attention target kernel needs d_qk a multiple of 64 (and >= 128) and block_s a multiple "
                             f"of threads / 8; got d_qk={d_qk}, block_s={block_s}, threads={threads}")
        scale_log2 = softmax_scale * LOG2E
        bs = block_s
        t_len = T.dynamic("t_len")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")
        bf16, f32, i32 = T.bfloat16, T.float32, T.int32

        @T.macro
        def load_q(Q, t, h0, tx, buf, col0, width):
            n_vec = block_h * (width // 8)
            for it in T.unroll((n_vec + threads - 1) // threads):
                ch = it * threads + tx
                if ch < n_vec:
                    h = ch // (width // 8)
                    c = (ch % (width // 8)) * 8
                    for v in T.vectorized(8):
                        buf[h, c + v] = T.if_then_else(h0 + h < heads, Q[t, T.min(h0 + h, heads - 1), col0 + c + v], 0)

        gather = latent_gather_macro(T, rows=bs, rows_per_pass=rows_per_pass, dh=dh, d_tail=d_tail, tail0=2 * dh,
                                     record_index=True, commit=True)

        @T.macro
        def block_step(Out, t, hb, topk, q_l, q_r, q_t, kv_l, kv_r, kt, idx_s, lse_s, acc, tsum, blk):
            for h, j in T.Parallel(block_h, bs):
                acc[h, j] = T.if_then_else(idx_s[j] >= 0, 0, -T.infinity(f32))
            T.gemm(q_l, kv_l, acc, transpose_B=True)
            T.gemm(q_r, kv_r, acc, transpose_B=True)
            if has_tail:
                T.gemm(q_t, kt, acc, transpose_B=True)
            for h, j in T.Parallel(block_h, bs):
                acc[h, j] = T.exp2(acc[h, j] * scale_log2 - lse_s[h])
            T.reduce_sum(acc, tsum, dim=0)
            for j in T.Parallel(bs):
                if blk * bs + j < topk:
                    Out[hb, t, blk * bs + j] = tsum[j]

        @T.prim_func
        def main(
            Q: T.Tensor([t_len, heads, d_qk], bf16),
            KV: T.Tensor([t_kv, d_qk], bf16),
            Idx: T.Tensor([t_len, topk], i32),
            VLen: T.Tensor([t_len], i32),
            Lse: T.Tensor([t_len, heads], f32),
            Out: T.Tensor([n_hblk, t_len, topk], f32),
        ):
            with T.Kernel(t_len, n_hblk, threads=threads) as (t, hb):
                q_l = T.alloc_shared([block_h, dh], bf16)
                q_r = T.alloc_shared([block_h, dh], bf16)
                q_t = T.alloc_shared([block_h, d_tail], bf16) if has_tail else None
                kv0_l = T.alloc_shared([bs, dh], bf16)
                kv0_r = T.alloc_shared([bs, dh], bf16)
                kt0 = T.alloc_shared([bs, d_tail], bf16) if has_tail else None
                kv1_l = T.alloc_shared([bs, dh], bf16)
                kv1_r = T.alloc_shared([bs, dh], bf16)
                kt1 = T.alloc_shared([bs, d_tail], bf16) if has_tail else None
                idx0 = T.alloc_shared([bs], i32)
                idx1 = T.alloc_shared([bs], i32)
                lse_s = T.alloc_shared([block_h], f32)
                acc = T.alloc_fragment([block_h, bs], f32)
                tsum = T.alloc_fragment([bs], f32)

                tx = T.get_thread_binding()
                h0 = hb * block_h
                n_blk = T.ceildiv(VLen[t], bs)
                load_q(Q, t, h0, tx, q_l, 0, dh)
                load_q(Q, t, h0, tx, q_r, dh, dh)
                if has_tail:
                    load_q(Q, t, h0, tx, q_t, 2 * dh, d_tail)
                for h in T.Parallel(block_h):
                    # Padded heads: lse = +inf, so exp2(... - inf) = 0 and they add nothing; so does an empty row's.
                    lse_s[h] = T.if_then_else(h0 + h < heads, Lse[t, T.min(h0 + h, heads - 1)] * LOG2E, T.infinity(f32))
                for it in T.serial(T.ceildiv(T.max(topk - n_blk * bs, 0), threads)):
                    slot = n_blk * bs + it * threads + tx
                    if slot < topk:
                        Out[hb, t, slot] = 0
                if n_blk > 0:
                    gather(KV, Idx, t, t_kv, topk, tx, kv0_l, kv0_r, kt0, idx0, 0)
                for ip in T.serial(T.ceildiv(n_blk, 2)):
                    if 2 * ip + 1 < n_blk:
                        gather(KV, Idx, t, t_kv, topk, tx, kv1_l, kv1_r, kt1, idx1, 2 * ip + 1)
                        T.ptx_wait_group(1)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    T.fence_proxy_async()
                    block_step(Out, t, hb, topk, q_l, q_r, q_t, kv0_l, kv0_r, kt0, idx0, lse_s, acc, tsum, 2 * ip)
                    T.sync_threads()
                    if 2 * ip + 1 < n_blk:
                        if 2 * ip + 2 < n_blk:
                            gather(KV, Idx, t, t_kv, topk, tx, kv0_l, kv0_r, kt0, idx0, 2 * ip + 2)
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                        T.sync_threads()
                        T.fence_proxy_async()
                        block_step(Out, t, hb, topk, q_l, q_r, q_t, kv1_l, kv1_r, kt1, idx1, lse_s, acc, tsum,
                                   2 * ip + 1)
                        T.sync_threads()

        return main

    return sparse_attention_target_kernel


# --------------------------------------------------------------------------------------------------------------------
# Checked interface
# --------------------------------------------------------------------------------------------------------------------


def check_target_args(query: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, lse: torch.Tensor) -> None:
    """Validate the attention-side tensors: ``query [T, H, D]`` bf16 (``1 <= H <= 128``, ``D`` a multiple of 64 in
    [128, 576]: GLM-5 576, NoPE 512), ``kv [S, D]`` bf16, ``topk [T, K]`` int32, ``lse [T, H]`` fp32."""
    check_tensor("query", query, dtype=torch.bfloat16, ndim=3)
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=2, device=query.device)
    check_tensor("topk", topk, dtype=torch.int32, ndim=2, device=query.device)
    check_tensor("lse", lse, dtype=torch.float32, ndim=2, device=query.device)
    t_len, heads, d_qk = query.shape
    if kv.shape[1] != d_qk:
        raise ValueError(f"kv must be [S, {d_qk}] like query's last dim, got {tuple(kv.shape)}")
    if topk.shape[0] != t_len:
        raise ValueError(f"topk must be [T={t_len}, K] like query, got {tuple(topk.shape)}")
    if tuple(lse.shape) != (t_len, heads):
        raise ValueError(f"lse must be [T={t_len}, H={heads}] like query, got {tuple(lse.shape)}")
    if not 1 <= heads <= 128:
        raise ValueError(f"attention heads per rank must be in [1, 128], got {heads}")
    if d_qk % 64 or not 128 <= d_qk <= 576:
        raise ValueError(f"query/kv dim must be a multiple of 64 in [128, 576] (GLM-5: 576, NoPE: 512), got {d_qk}")
    if topk.shape[1] == 0:
        raise ValueError("topk must have at least one slot (K >= 1)")


def sparse_attention_target_interface(
    query: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    *,
    valid_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel call (strict dtypes, see :func:`check_target_args`): the unnormalised head-summed probabilities,
    fp32 ``[T, K]``. ``valid_len`` (``row_valid_len(topk)``) may be passed in when the caller has it."""
    check_target_args(query, kv, topk, lse)
    t_len, heads, d_qk = query.shape
    if t_len == 0 or kv.shape[0] == 0:
        return torch.zeros(topk.shape, dtype=torch.float32, device=query.device)
    if valid_len is None:
        valid_len = row_valid_len(topk)
    kernel = _jit_target()(heads, d_qk, float(softmax_scale))
    out = kernel(query, kv, topk, valid_len, lse)  # [n_hblk, T, K]
    return out[0] if out.shape[0] == 1 else out.sum(0)


def sparse_attention_target(
    query: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, lse: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """fp32 ``[T, K]``: ``sum_h exp(softmax_scale * query[t, h] . kv[topk[t, k]] - lse[t, h])``, unnormalised (the
    caller all-reduces over TP, then L1-normalises); 0 on invalid slots and for heads with ``lse = +inf``. ``lse`` is
    the natural-log LSE of ``sparse_mla_with_lse`` over the same ``topk`` (any float dtype; int64 ``topk``
    converted). No autograd (the target is a constant of the loss)."""
    return sparse_attention_target_interface(
        query, kv, topk.to(torch.int32).contiguous(), lse.detach().to(torch.float32).contiguous(), softmax_scale
    )
