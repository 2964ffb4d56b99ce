"""The chunked torch DSA (the CPU backend and the kernels' oracle) against brute-force dense math."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa.reference import causal_bounds, indexer_topk, pad_topk, sparse_mla, uniform_cu_seqlens


def _dense_scores(q, k, w, starts, ends):
    s = torch.einsum("thd,sd->ths", q.double(), k.double()).clamp_min(0)
    s = torch.einsum("ths,th->ts", s, w.double())
    keys = torch.arange(k.shape[0])
    valid = (keys[None] >= starts[:, None].long()) & (keys[None] < ends[:, None].long())
    return s.masked_fill(~valid, float("-inf")), valid


def test_causal_bounds_packed_and_padding():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    starts, ends = causal_bounds(cu, total=9)
    assert starts.tolist() == [0, 0, 0, 3, 3, 3, 3, 7, 8]
    assert ends.tolist() == [1, 2, 3, 4, 5, 6, 7, 7, 8]  # the two padding rows have empty ranges
    assert uniform_cu_seqlens(2, 5).tolist() == [0, 5, 10]


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_indexer_topk_matches_dense_and_never_crosses_sequences(chunk):
    torch.manual_seed(0)
    cu = torch.tensor([0, 40, 45, 100], dtype=torch.int32)  # one sequence shorter than topk
    T, H, D, K = 100, 8, 16, 12
    q, k, w = torch.randn(T, H, D), torch.randn(T, D), torch.randn(T, H)
    starts, ends = causal_bounds(cu)
    idx = indexer_topk(q, k, w, starts, ends, K, chunk=chunk)
    assert idx.dtype == torch.int32 and idx.shape == (T, K)
    scores, valid = _dense_scores(q, k, w, starts, ends)
    for t in range(T):
        n = min(K, int(ends[t] - starts[t]))
        row = idx[t]
        assert (row[n:] == -1).all() and (row[:n] >= 0).all(), "tail-only -1 padding"
        assert ((row[:n] >= starts[t]) & (row[:n] < ends[t])).all(), "indices stay in the row's causal range"
        ref = torch.topk(scores[t], n).indices
        assert set(row[:n].tolist()) == set(ref.tolist())
        picked = scores[t][row[:n].long()]
        assert (picked[:-1] >= picked[1:]).all(), "sorted by descending score"


def test_indexer_topk_ties_lowest_index_wins():
    T, H, D = 6, 1, 4
    q = torch.ones(T, H, D)
    k = torch.ones(T, D)  # every score equal
    starts, ends = causal_bounds(uniform_cu_seqlens(1, T))
    idx = indexer_topk(q, k, torch.ones(T, H), starts, ends, 3)
    assert idx[5].tolist() == [0, 1, 2]
    assert idx[1].tolist() == [0, 1, -1]
    assert torch.equal(idx, indexer_topk(q, k, torch.ones(T, H), starts, ends, 3, chunk=2))


def test_sparse_mla_matches_dense_masked_attention_and_grads():
    torch.manual_seed(1)
    T, H, D, DV, K = 30, 4, 24, 16, 8
    q = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    starts, ends = causal_bounds(uniform_cu_seqlens(1, T))
    idx = indexer_topk(torch.randn(T, 4, 8), torch.randn(T, 8), torch.randn(T, 4), starts, ends, K)
    scale = 0.3
    out, lse = sparse_mla(q, kv, idx, scale, DV, chunk=7)
    # dense reference: full [T, T] scores with everything outside the top-k masked
    mask = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        mask[t, idx[t][idx[t] >= 0].long()] = True
    logits = torch.einsum("thd,sd->ths", q, kv) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    ref = torch.einsum("ths,sd->thd", torch.softmax(logits, -1), kv[:, :DV])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    gq, gkv = torch.autograd.grad((out * g).sum(), (q, kv))
    rq, rkv = torch.autograd.grad((ref * g).sum(), (q, kv))
    torch.testing.assert_close(gq, rq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gkv, rkv, rtol=1e-10, atol=1e-10)


def test_sparse_mla_empty_rows_and_minus_one_never_read():
    T, H, D, DV = 5, 2, 8, 4
    q = torch.randn(T, H, D)
    kv = torch.randn(T, D)
    idx = torch.full((T, 4), -1, dtype=torch.int32)
    idx[1, 0] = 0
    kv_poisoned = kv.clone()
    kv_poisoned[-1] = float("nan")  # row -1 wraps to the last row if a -1 were ever read
    kv_poisoned[2:4] = float("nan")  # unreferenced rows
    out, lse = sparse_mla(q, kv_poisoned, idx, 1.0, DV)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()
    torch.testing.assert_close(out[1], kv[0, :DV].expand(H, DV))
    poisoned0 = kv.clone()
    poisoned0[0] = float("nan")  # row 0 is where -1 slots are clamped to before masking
    idx2 = torch.full((T, 4), -1, dtype=torch.int32)
    idx2[:, 0] = 1
    out2, _ = sparse_mla(q, poisoned0, idx2, 1.0, DV)
    assert torch.isfinite(out2).all(), "a -1 slot must not carry kv row 0 into the output"


def test_pad_topk():
    idx = torch.tensor([[3, 1]], dtype=torch.int32)
    assert pad_topk(idx, 4).tolist() == [[3, 1, -1, -1]]
    with pytest.raises(ValueError, match="exceeds the fixed width 1"):
        pad_topk(idx, 1)
