"""Top-k index sets as per-row bitmaps: the mask of the key-block dKV pass (``kernels.sparse_mla_dkv``).

Layout: ``bits`` int32 ``[T, W]``; bit ``k % 32`` of word ``bits[t, k // 32]`` is set where row ``t`` selects key
``k`` (a valid slot: ``0 <= k < t_kv``). ``W`` is ``ceil(t_kv / block_k) * block_k / 32``, so every key block of
``block_k`` keys owns whole words. 4 MB per 8K x 8K; 64 MB at 32K.

A key repeated within a row sets its bit once: the bitmap describes a *set*. The sparse-MLA contract counts a repeated
slot twice, so the key-block pass is only exact for rows whose valid indices are distinct (the indexer's top-k).
The build counts the repeats it meets (``repeats``: slots whose bit was already set), so callers and tests can check.

GPU: one Triton program per row, relaxed atomic ORs into a zeroed bitmap (L2-resident); the torch oracle
:func:`selection_bitmap_reference` runs where Triton does not.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import cdiv, check_index_rows, next_power_of_2, triton_kernels, triton_runs_on


def bitmap_words(t_kv: int, block_k: int) -> int:
    """Words per bitmap row: whole key blocks of ``block_k`` (a multiple of 32) keys."""
    if block_k % 32 or block_k <= 0:
        raise ValueError(f"block_k must be a positive multiple of 32, got {block_k}")
    return cdiv(max(t_kv, 0), block_k) * (block_k // 32)


def selection_bitmap(indices: torch.Tensor, t_kv: int, *, block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits int32 [T, W], repeats int32 [1])`` of top-k ``indices`` int32 ``[T, K]`` over keys ``[0, t_kv)``.

    ``repeats`` counts valid slots whose key an earlier slot of the same row already set (0 for the indexer's
    top-k); it stays on the device (no host sync)."""
    check_index_rows(indices, t_kv)
    n_words = bitmap_words(t_kv, block_k)
    t_len, k = indices.shape
    if not triton_runs_on(indices) or _triton() is None:
        return selection_bitmap_reference(indices, t_kv, block_k=block_k)
    bits = torch.zeros(t_len, n_words, dtype=torch.int32, device=indices.device)
    repeats = torch.zeros(1, dtype=torch.int32, device=indices.device)
    if t_len == 0 or k == 0 or n_words == 0:
        return bits, repeats
    indices = indices.contiguous()
    _triton()[(t_len,)](indices, bits, repeats, k, t_kv, n_words, KP=next_power_of_2(k), num_warps=4)
    return bits, repeats


def selection_bitmap_reference(indices: torch.Tensor, t_kv: int, *, block_k: int = 64
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of :func:`selection_bitmap` (a dense ``[T, W * 32]`` boolean mask, then packed)."""
    check_index_rows(indices, t_kv)
    n_words = bitmap_words(t_kv, block_k)
    t_len, k = indices.shape
    dev = indices.device
    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (idx < t_kv)
    count = torch.zeros(t_len, n_words * 32 + 1, dtype=torch.int64, device=dev)
    count.scatter_add_(1, torch.where(valid, idx, n_words * 32), valid.to(torch.int64))
    count = count[:, : n_words * 32]
    repeats = (count - 1).clamp_min(0).sum().reshape(1).to(torch.int32)
    weights = torch.ones(32, dtype=torch.int64, device=dev) << torch.arange(32, device=dev)
    words = ((count > 0).to(torch.int64).view(t_len, n_words, 32) * weights).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # bit 31 is the int32 sign bit
    return words.to(torch.int32), repeats


def key_block_query_range(bits: torch.Tensor, block_k: int = 64) -> torch.Tensor:
    """int32 ``[n_blocks, 2]``: for each key block, the first query whose bitmap row selects a key in it and one past
    the last (``[0, 0)`` when none does). The key-block pass visits only those queries, so a packed (THD) batch's
    blocks skip the other sequences' queries and a causal set skips the queries before its keys."""
    if bits.dtype != torch.int32 or bits.dim() != 2 or bits.shape[1] % (block_k // 32):
        raise ValueError(f"bits must be int32 [T, W] with W a multiple of block_k / 32 = {block_k // 32}, got "
                         f"{bits.dtype} {tuple(bits.shape)}")
    t_len, n_words = bits.shape
    n_blocks = n_words // (block_k // 32)
    hit = (bits.view(t_len, n_blocks, block_k // 32) != 0).any(-1)  # [T, n_blocks]
    out = torch.zeros(n_blocks, 2, dtype=torch.int32, device=bits.device)
    if t_len == 0 or n_blocks == 0:
        return out
    any_hit = hit.any(0)
    hit8 = hit.to(torch.uint8)
    first = hit8.argmax(0)
    last = t_len - 1 - hit8.flip(0).argmax(0)
    out[:, 0] = torch.where(any_hit, first, 0).to(torch.int32)
    out[:, 1] = torch.where(any_hit, last + 1, 0).to(torch.int32)
    return out


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def selection_bitmap_kernel(IDX, BITS, REPEATS, k, t_kv, n_words, KP: tl.constexpr):
        # One program per row: every valid slot ORs its bit into the row's zeroed words; an OR that finds its bit
        # already set is a repeated key (counted once per repeat).
        t = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, KP)
        key = tl.load(IDX + t * k + s, mask=s < k, other=-1)
        ok = (key >= 0) & (key < t_kv)
        bit = 1 << (key & 31)
        old = tl.atomic_or(BITS + t * n_words + (key >> 5), bit, mask=ok, sem="relaxed")
        rep = tl.sum(((old & bit) != 0) & ok, axis=0)
        if rep > 0:
            tl.atomic_add(REPEATS, rep.to(tl.int32), sem="relaxed")

    return selection_bitmap_kernel
