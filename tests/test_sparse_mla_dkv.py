"""The key-block dKV pass (``megatron_glm5.kernels.sparse_mla_dkv``) and its selection bitmaps, on CPU.

The TileLang kernel runs only on a GPU (``tests/gpu/test_sparse_mla_dkv_gpu.py``); here the torch form of the same
algorithm (bitmap mask, per-block query ranges, query chunks, partial sums) is checked against the sparse-MLA oracle's
autograd ``dKV``, and the Triton bitmap build against its torch oracle in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa.reference import sparse_mla
from megatron_glm5.kernels.selection_bitmap import (
    bitmap_words,
    key_block_query_range,
    selection_bitmap,
    selection_bitmap_reference,
)
from megatron_glm5.kernels.sparse_mla_dkv import dkv_key_blocks_reference


def _causal_topk(t_len: int, k: int, seed: int, starts: list[int] | None = None) -> torch.Tensor:
    """Random distinct causal keys per row (within the row's sequence when ``starts`` packs several), -1 padded."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((t_len, k), -1, dtype=torch.int32)
    bounds = sorted(set((starts or [0]) + [t_len]))
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        for t in range(s0, s1):
            n = t - s0 + 1
            keys = torch.randperm(n, generator=g)[: min(k, n)] + s0
            idx[t, : keys.numel()] = keys.to(torch.int32)
    return idx


def _bits_of(bits: torch.Tensor, t: int, key: int) -> bool:
    return bool((int(bits[t, key // 32]) >> (key % 32)) & 1)


def test_bitmap_reference_sets_exactly_the_valid_slots():
    idx = _causal_topk(40, 9, 0)
    idx[3, 2] = 200  # out of range: ignored
    idx[5] = -1  # a row without keys
    bits, repeats = selection_bitmap_reference(idx, 70, block_k=64)
    assert bits.shape == (40, bitmap_words(70, 64)) == (40, 4) and repeats.item() == 0
    for t in range(40):
        want = {v for v in idx[t].tolist() if 0 <= v < 70}
        assert {k for k in range(128) if _bits_of(bits, t, k)} == want


def test_bitmap_counts_repeats_and_uses_bit_31():
    idx = torch.tensor([[31, 31, 63, 5], [1, 2, 2, 2]], dtype=torch.int32)
    bits, repeats = selection_bitmap_reference(idx, 64, block_k=64)
    assert repeats.item() == 3  # one repeat in row 0, two in row 1
    assert int(bits[0, 0]) == -(1 << 31) + (1 << 5) and int(bits[0, 1]) == -(1 << 31)
    assert int(bits[1, 0]) == 0b110


def test_key_block_query_range_is_first_and_one_past_last_query():
    idx = _causal_topk(50, 6, 1, starts=[0, 20])
    bits, _ = selection_bitmap_reference(idx, 50, block_k=32)
    rng = key_block_query_range(bits, 32).tolist()
    for kb, (lo, hi) in enumerate(rng):
        qs = [t for t in range(50) if any(32 * kb <= v < 32 * kb + 32 for v in idx[t].tolist())]
        assert (lo, hi) == ((qs[0], qs[-1] + 1) if qs else (0, 0))
    with pytest.raises(ValueError, match="multiple"):
        key_block_query_range(torch.zeros(4, 3, dtype=torch.int32), 64)


def _oracle_dkv(q, kv, idx, scale, d_v, grad_out, grad_lse):
    qd, kvd = q.double().requires_grad_(), kv.double().requires_grad_()
    out, lse = sparse_mla(qd, kvd, idx, scale, d_v)
    ((out * grad_out.double()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * grad_lse.double()).sum()).backward()
    out, lse = out.detach(), lse.detach()
    delta = (out * grad_out.double()).sum(-1) - grad_lse.double()
    return kvd.grad, lse, delta


@pytest.mark.parametrize(
    "t_len,heads,k,starts,block_k,n_chunks",
    [
        (70, 3, 16, None, 32, 1),  # causal, T > K: sparse rows
        (70, 3, 16, None, 64, 5),  # chunks that cut the triangle
        (23, 16, 32, None, 32, 3),  # T < K: every row dense
        (90, 2, 12, [0, 37, 60], 32, 4),  # packed (THD) sequences
        (33, 1, 8, None, 32, 7),  # more chunks than some blocks' queries
    ],
)
@pytest.mark.parametrize("ranges", ["bitmap", "span"])
def test_key_block_algorithm_matches_the_sparse_oracle(t_len, heads, k, starts, block_k, n_chunks, ranges):
    g = torch.Generator().manual_seed(t_len * heads + k)
    d_v, d_qk, scale = 32, 48, 0.2
    q = torch.randn(t_len, heads, d_qk, generator=g)
    kv = torch.randn(t_len, d_qk, generator=g)
    idx = _causal_topk(t_len, k, t_len, starts)
    idx[4] = -1  # a query with no keys (lse = +inf)
    grad_out = torch.randn(t_len, heads, d_v, generator=g)
    grad_lse = torch.randn(t_len, heads, generator=g)
    want, lse, delta = _oracle_dkv(q, kv, idx, scale, d_v, grad_out, grad_lse)
    got = dkv_key_blocks_reference(q, kv, grad_out, lse.float(), delta.float(), idx, scale, d_v,
                                   n_chunks=n_chunks, block_k=block_k, ranges=ranges)
    assert got.shape == (t_len, d_qk) and got.dtype == torch.float32
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


def test_key_block_reference_rounds_p_and_ds_like_the_kernels():
    """bf16 inputs: the reference rounds P and dS to bf16 before their products, so it sits within bf16 rounding of
    the exact dKV, not bitwise on it (a change of that rounding would move it past the fp32 tolerance above)."""
    g = torch.Generator().manual_seed(3)
    t_len, heads, d_v, d_qk, scale = 40, 4, 32, 48, 0.2
    q = torch.randn(t_len, heads, d_qk, generator=g).bfloat16()
    kv = torch.randn(t_len, d_qk, generator=g).bfloat16()
    idx = _causal_topk(t_len, 10, 2)
    grad_out = torch.randn(t_len, heads, d_v, generator=g).bfloat16()
    grad_lse = torch.zeros(t_len, heads)
    want, lse, delta = _oracle_dkv(q, kv, idx, scale, d_v, grad_out, grad_lse)
    got = dkv_key_blocks_reference(q, kv, grad_out, lse.float(), delta.float(), idx, scale, d_v, block_k=32)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert 1e-6 < err < 2e-2, err


def test_interface_refuses_key_blocks_with_groups_and_unknown_reductions():
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface

    q = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 576, dtype=torch.bfloat16)
    idx = torch.full((8, 64), -1, dtype=torch.int32)
    out = torch.zeros(8, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="group"):
        sparse_mla_bwd_interface(q, kv, out, lse, out, idx, 1 / 16, 512, group=4, dkv_reduce="key_blocks")
    with pytest.raises(ValueError, match="dkv_reduce"):
        sparse_mla_bwd_interface(q, kv, out, lse, out, idx, 1 / 16, 512, dkv_reduce="blocks")


_SCRIPT = r"""
import torch
from megatron_glm5.kernels.selection_bitmap import selection_bitmap, selection_bitmap_reference
g = torch.Generator().manual_seed(0)
for t_len, k, t_kv, block_k in ((37, 24, 100, 64), (5, 70, 64, 32), (9, 8, 3, 64)):
    idx = torch.randint(-1, t_kv + 2, (t_len, k), generator=g, dtype=torch.int32)
    got, rep = selection_bitmap(idx, t_kv, block_k=block_k)
    want, rep_want = selection_bitmap_reference(idx, t_kv, block_k=block_k)
    assert torch.equal(got, want), (t_len, k, t_kv)
    assert rep.item() == rep_want.item() > 0, (rep.item(), rep_want.item())
print("OK")
"""


def test_bitmap_triton_kernel_in_interpreter_and_for_sm90():
    pytest.importorskip("triton")
    from tests.triton_checks import compile_sm90, passed, run_in_interpreter

    from megatron_glm5.kernels.selection_bitmap import _triton

    assert passed(run_in_interpreter(_SCRIPT))
    sig = {"IDX": "*i32", "BITS": "*i32", "REPEATS": "*i32", "k": "i32", "t_kv": "i32", "n_words": "i32"}
    assert "relaxed.or.b32" in compile_sm90(_triton(), sig, {"KP": 2048})


def test_bitmap_without_interpreter_takes_the_torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    idx = _causal_topk(10, 4, 5)
    got, _ = selection_bitmap(idx, 10)
    assert torch.equal(got, selection_bitmap_reference(idx, 10)[0])


def test_key_blocks_pay_where_measured():
    from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCKS_MAX_TOKENS, key_blocks_pay

    assert key_blocks_pay(16, 8192, 576, 512) and key_blocks_pay(8, 1, 576, 512)
    assert not key_blocks_pay(16, KEY_BLOCKS_MAX_TOKENS + 1, 576, 512)  # past 8K only with a measured work ratio
    assert not key_blocks_pay(64, 4096, 576, 512)  # 64 heads: slower at every length measured
    assert key_blocks_pay(16, 4096, 512, 512)  # GLM-5.3-Flash's NoPE latent: 1.54x at 4K
    assert not key_blocks_pay(16, 4096, 640, 512)  # a latent not measured
    assert not key_blocks_pay(16, 0, 576, 512)


def test_default_chunks_bound_the_partial_buffer():
    from megatron_glm5.kernels.sparse_mla_dkv import MAX_CHUNKS, PARTIAL_BYTES, default_chunks

    for t in (1, 100, 2048, 8192, 16384, 65536, 1 << 20):
        n = default_chunks(t, t, torch.device("cpu"))
        assert 1 <= n <= MAX_CHUNKS and (n == 1 or n * t * 576 * 4 <= PARTIAL_BYTES), (t, n)


def test_dkv_key_blocks_names_its_schedules():
    from megatron_glm5.kernels.sparse_mla_dkv import SCHEDULES, dkv_key_blocks

    assert SCHEDULES == ("wsp", "split", "plain")
    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one of \('wsp', 'split', 'plain'\), got 'tma'"):
        dkv_key_blocks(q, q[:, 0], q[..., :512], q[..., 0].float(), q[..., 0].float(),
                       torch.zeros(4, 8, dtype=torch.int32), 1 / 16, schedule="tma")
    with pytest.raises(ValueError, match="ranges must be 'bitmap' or 'span', got 'exact'"):
        dkv_key_blocks(q, q[:, 0], q[..., :512], q[..., 0].float(), q[..., 0].float(),
                       torch.zeros(4, 8, dtype=torch.int32), 1 / 16, ranges="exact")


def test_key_block_algorithm_over_wider_span_ranges():
    """Rows whose keys jump over whole key blocks make the span ranges strictly wider than the exact ones; the extra
    rows add nothing (masked), so the result still matches the oracle."""
    from megatron_glm5.kernels.key_block_work import row_key_span, span_query_ranges

    g = torch.Generator().manual_seed(8)
    t_len, heads, d_v, d_qk, scale = 130, 2, 32, 48, 0.2
    q = torch.randn(t_len, heads, d_qk, generator=g)
    kv = torch.randn(t_len, d_qk, generator=g)
    idx = _causal_topk(t_len, 6, 8)
    idx[100:] = -1
    idx[100:, 0] = torch.arange(100, 130, dtype=torch.int32)  # the diagonal
    idx[100:, 1] = 0  # and key 0: their spans cover the middle blocks they do not select
    bits, _ = selection_bitmap_reference(idx, t_len, block_k=32)
    exact = key_block_query_range(bits, 32)
    span = span_query_ranges(*row_key_span(idx, t_len), t_len, 32)
    assert not torch.equal(span, exact)
    grad_out = torch.randn(t_len, heads, d_v, generator=g)
    grad_lse = torch.zeros(t_len, heads)
    want, lse, delta = _oracle_dkv(q, kv, idx, scale, d_v, grad_out, grad_lse)
    got = dkv_key_blocks_reference(q, kv, grad_out, lse.float(), delta.float(), idx, scale, d_v, n_chunks=3,
                                   block_k=32, ranges="span")
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-5
