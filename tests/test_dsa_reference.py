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


def _naive_sparse_mla(q, kv, idx, scale, d_v):
    """Dense autograd oracle of the same math: full ``[T, S]`` scores, each key weighted by how many slots of its row
    pick it (a repeated index is one softmax term per slot), everything else masked; out 0 / lse +inf on empty rows."""
    t_len, s_len = q.shape[0], kv.shape[0]
    idx = idx.long()
    valid = idx >= 0
    rows = torch.arange(t_len)[:, None].expand_as(idx)
    count = torch.zeros(t_len, s_len, dtype=q.dtype)
    count.index_put_((rows[valid], idx[valid]), torch.ones(int(valid.sum()), dtype=q.dtype), accumulate=True)
    logits = torch.einsum("thd,sd->ths", q, kv) * scale + count.clamp_min(1).log()[:, None, :]
    logits = logits.masked_fill((count == 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    empty = torch.isneginf(lse)
    probs = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("ths,sd->thd", probs, kv[:, :d_v])
    return out, torch.where(empty, torch.full_like(lse, float("inf")), lse)


def _plain_autograd_sparse_mla(q, kv, indices, softmax_scale, d_v, chunk):
    """The previous implementation of ``sparse_mla``: the same chunked math, plain autograd (keeps every chunk's keys
    and probabilities for the backward). Only here as the saved-memory comparison."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for c0 in range(0, q.shape[0], chunk):
        c1 = min(q.shape[0], c0 + chunk)
        idx = indices[c0:c1].long()
        valid = idx >= 0
        gathered = kv[idx.clamp_min(0)].to(acc).masked_fill(~valid[..., None], 0.0)
        logits = torch.einsum("chd,ckd->chk", q[c0:c1].to(acc), gathered) * softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        empty = torch.isneginf(lse)
        probs = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
        outs.append(torch.einsum("chk,ckd->chd", probs, gathered[..., :d_v]).to(q.dtype))
        lses.append(torch.where(empty, torch.full_like(lse, float("inf")), lse))
    return torch.cat(outs), torch.cat(lses)


def _messy_indices(t_len, s_len, k, seed):
    """Random rows of ``kv`` with what the kernels' contract allows and more: repeats within a row, -1 slots in the
    middle and at the tail, rows with no valid index."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, s_len, (t_len, k), generator=g)
    idx[torch.rand(t_len, k, generator=g) < 0.25] = -1  # -1 in the middle
    idx[::3, k // 2 :] = -1  # -1 tail
    idx[1, :3] = min(4, s_len - 1)  # the same key three times
    idx[2, 1] = idx[2, 0] = min(2, s_len - 1)
    idx[0] = -1  # no valid index
    idx[t_len - 1] = -1
    return idx.to(torch.int32)


# (T, S, H, D, d_v, K, chunk): several chunks with a ragged last one; T < K; S != T (CP: keys gathered, queries local)
GRAD_CASES = [(23, 23, 3, 20, 12, 8, 5), (5, 5, 2, 12, 8, 8, 2), (10, 17, 2, 12, 8, 6, 4)]


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sparse_mla_grads_match_dense_autograd(case, dtype):
    t_len, s_len, heads, d, d_v, k, chunk = case
    torch.manual_seed(2)
    q = torch.randn(t_len, heads, d, dtype=torch.float64)
    kv = torch.randn(s_len, d, dtype=torch.float64)
    idx = _messy_indices(t_len, s_len, k, seed=3)
    scale = 0.4
    g_out = torch.randn(t_len, heads, d_v, dtype=torch.float64)
    g_lse = torch.randn(t_len, heads, dtype=torch.float64)  # also on the empty rows: their lse is a constant +inf

    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    ref_out, ref_lse = _naive_sparse_mla(qr, kvr, idx, scale, d_v)
    ref_dq, ref_dkv = torch.autograd.grad((ref_out, ref_lse), (qr, kvr), (g_out, g_lse), retain_graph=True)

    qt, kvt = q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_()
    out, lse = sparse_mla(qt, kvt, idx, scale, d_v, chunk=chunk)
    assert out.dtype == dtype and lse.dtype == dtype
    dq, dkv = torch.autograd.grad((out, lse), (qt, kvt), (g_out.to(dtype), g_lse.to(dtype)), retain_graph=True)
    assert dq.dtype == dtype and dkv.dtype == dtype
    assert torch.isposinf(lse[0]).all() and (out[0] == 0).all()
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    torch.testing.assert_close(dq.double(), ref_dq, **tol)
    torch.testing.assert_close(dkv.double(), ref_dkv, **tol)
    # lse alone and out alone (the other output gets no gradient at all)
    for outputs, grads, refs in (((lse,), (g_lse,), (ref_lse,)), ((out,), (g_out,), (ref_out,))):
        got = torch.autograd.grad(outputs, (qt, kvt), tuple(x.to(dtype) for x in grads), retain_graph=True)
        want = torch.autograd.grad(refs, (qr, kvr), grads, retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, **tol)


def test_sparse_mla_backward_never_reads_minus_one_slots():
    """A NaN in kv row 0 (where -1 slots are clamped to) reaches neither dq nor dkv when no index names row 0."""
    torch.manual_seed(4)
    t_len, heads, d, d_v = 6, 2, 8, 4
    idx = torch.tensor([[-1, -1, -1], [1, -1, 2], [-1, 3, 3], [4, 5, -1], [2, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    q = torch.randn(t_len, heads, d, requires_grad=True)
    kv = torch.randn(t_len, d)
    kv[0] = float("nan")
    kv.requires_grad_()
    out, lse = sparse_mla(q, kv, idx, 0.5, d_v, chunk=4)
    dq, dkv = torch.autograd.grad((out, lse), (q, kv), (torch.randn_like(out), torch.randn_like(lse)))
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    assert (dkv[0] == 0).all() and (dq[[0, 5]] == 0).all()


def test_sparse_mla_gradcheck():
    torch.manual_seed(5)
    q = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, -1, 3], [2, 2, 5], [-1, -1, -1], [1, 4, -1], [5, 0, 0]], dtype=torch.int32)

    def fn(q, kv):
        out, lse = sparse_mla(q, kv, idx, 0.7, 3, chunk=2)
        return out, lse.masked_fill(torch.isinf(lse), 0.0)  # the empty row's +inf is constant, not differentiable

    assert torch.autograd.gradcheck(fn, (q, kv))


def _saved_bytes(fn, inputs):
    """Bytes autograd keeps for the backward of ``fn()``, counting each storage once and leaving out the inputs'."""
    inputs_storage = {t.untyped_storage().data_ptr() for t in inputs}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs_storage:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = fn()
    return sum(kept.values()), outs


@pytest.mark.parametrize("k, d", [(8, 16), (32, 64)])
def test_sparse_mla_saves_only_the_lse(k, d):
    torch.manual_seed(6)
    t_len, heads, d_v, chunk = 64, 2, d // 2, 16
    q = torch.randn(t_len, heads, d, requires_grad=True)
    kv = torch.randn(t_len, d, requires_grad=True)
    idx = _messy_indices(t_len, t_len, k, seed=7)
    budget = t_len * heads * 8  # the [T, H] LSE, fp64 at most
    new, (out, lse) = _saved_bytes(lambda: sparse_mla(q, kv, idx, 0.3, d_v, chunk=chunk), (q, kv, idx))
    assert new <= budget and new == t_len * heads * 4, "fp32 LSE only: independent of K and D"
    old, (out_old, lse_old) = _saved_bytes(
        lambda: _plain_autograd_sparse_mla(q, kv, idx, 0.3, d_v, chunk), (q, kv, idx))
    assert old >= t_len * k * d * 4 > 10 * budget, "plain autograd keeps every chunk's [c, K, D] keys"
    torch.testing.assert_close(out, out_old, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse_old, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (q, kv), g), torch.autograd.grad(out_old, (q, kv), g),
                               rtol=1e-5, atol=1e-5)


def test_sparse_mla_bf16_dtypes_and_one_sided_grads():
    """bf16 in: out bf16, lse fp32, grads in the inputs' dtypes (fp32 math inside); a gradient for only one input."""
    torch.manual_seed(10)
    q32, kv32 = torch.randn(12, 2, 16), torch.randn(12, 16)
    idx = _messy_indices(12, 12, 6, seed=11)
    g = torch.randn(12, 2, 8).bfloat16().float()
    q, kv = q32.bfloat16().requires_grad_(), kv32.bfloat16().requires_grad_()
    out, lse = sparse_mla(q, kv, idx, 0.5, 8, chunk=5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    dq, dkv = torch.autograd.grad(out, (q, kv), g.bfloat16())
    assert dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16
    qf, kvf = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    out_f, lse_f = sparse_mla(qf, kvf, idx, 0.5, 8, chunk=5)
    torch.testing.assert_close(lse, lse_f)  # same fp32 math on the same (bf16-representable) values
    rq, rkv = torch.autograd.grad(out_f, (qf, kvf), g)
    torch.testing.assert_close(dq, rq.bfloat16())
    torch.testing.assert_close(dkv, rkv.bfloat16())
    (only_q,) = torch.autograd.grad(sparse_mla(qf, kvf.detach(), idx, 0.5, 8, chunk=5)[0], qf, g)
    (only_kv,) = torch.autograd.grad(sparse_mla(qf.detach(), kvf, idx, 0.5, 8, chunk=5)[0], kvf, g)
    torch.testing.assert_close(only_q, rq, rtol=0, atol=0)
    torch.testing.assert_close(only_kv, rkv, rtol=0, atol=0)


def test_sparse_mla_empty_t():
    q = torch.randn(0, 2, 8, requires_grad=True)
    kv = torch.randn(3, 8, requires_grad=True)
    out, lse = sparse_mla(q, kv, torch.zeros(0, 4, dtype=torch.int32), 1.0, 4)
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2) and lse.dtype == torch.float32
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    assert dq.shape == q.shape and (dkv == 0).all()


def test_backend_torch_fallbacks_go_through_sparse_mla():
    """Both backends' CPU / uncovered-shape path returns the output of :func:`reference.sparse_mla` (its recomputing
    backward), not a copy of the math."""
    from types import SimpleNamespace

    from megatron_glm5.dsa import attention
    from megatron_glm5.dsa.tilelang_attention import TileLangSparseAttention

    torch.manual_seed(8)
    q = torch.randn(9, 2, 12, requires_grad=True)
    kv = torch.randn(9, 12, requires_grad=True)
    idx = _messy_indices(9, 9, 4, seed=9)
    want, _ = sparse_mla(q, kv, idx, 0.5, 8)
    outs = [
        attention.sparse_attention(SimpleNamespace(attention_backend="unfused"), q, kv, idx, 0.5, 8),
        TileLangSparseAttention.forward(SimpleNamespace(config=None), q, kv, idx, 0.5, 8),
    ]
    for out in outs:
        assert type(out.grad_fn) is type(want.grad_fn) and "SparseMLA" in type(out.grad_fn).__name__
        assert torch.equal(out, want)


def test_pad_topk():
    idx = torch.tensor([[3, 1]], dtype=torch.int32)
    assert pad_topk(idx, 4).tolist() == [[3, 1, -1, -1]]
    with pytest.raises(ValueError, match="exceeds the fixed width 1"):
        pad_topk(idx, 1)
