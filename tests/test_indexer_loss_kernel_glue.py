"""The torch glue of the fused sparse indexer loss (``megatron_glm5.kernels.indexer_loss``) on CPU: its two kernels
(index scores, score backward) are monkeypatched by torch oracles, and the autograd function must then equal
``megatron_glm5.dsa.indexer_loss.sparse_indexer_loss`` (value and gradients), including -1 tails, mid-row -1 slots,
empty rows, duplicated keys, zero row weights, a non-unit incoming gradient and row chunking. The kernels themselves
are checked on the GPU (``tests/gpu/test_indexer_loss_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa import indexer_loss as il
from megatron_glm5.dsa import reference
from megatron_glm5.kernels import indexer_loss as kil

H, D, HI, DI, K = 4, 24, 3, 16, 8
SCALE = D**-0.5


def _fake_scores(qi, ki, w, topk, *, valid_len=None):
    """Kernel 1's oracle (fp32 math on the same inputs)."""
    return il.sparse_index_scores(qi, ki, w, topk)


def _fake_bwd(qi, ki, w, topk, dscore, grad_scale=None, *, valid_len=None, deterministic=False, impl="ours"):
    """Kernel 3's oracle: autograd of ``score = sum_h w relu(qi . ki[topk])`` (fp32) against ``dscore * grad``."""
    with torch.enable_grad():  # autograd runs backward functions with grad mode off
        qf, kf, wf = (x.detach().float().requires_grad_() for x in (qi, ki, w))
        idx = topk.long()
        valid = (idx >= 0) & (idx < ki.shape[0])
        keys = kf[idx.clamp(0, ki.shape[0] - 1)] * valid[..., None]
        score = torch.einsum("thk,th->tk", torch.einsum("thd,tkd->thk", qf, keys).clamp_min(0.0), wf)
        scale = 1.0 if grad_scale is None else grad_scale.reshape(())
        dq, dk, dw = torch.autograd.grad(score, (qf, kf, wf), dscore * scale)
    return dq.to(qi.dtype), dk.to(ki.dtype), dw


@pytest.fixture
def oracle_kernels(monkeypatch):
    monkeypatch.setattr(kil, "sparse_index_scores_interface", _fake_scores)
    monkeypatch.setattr(kil, "index_score_bwd_interface", _fake_bwd)


def _case(seed: int, *, w_dtype=torch.float32, per_token=False):
    """THD layout: 3 documents (one shorter than K) and 5 padding rows without keys; mid-row -1 slots and a
    duplicated key planted in two rows."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 20, 26, 41], dtype=torch.int32)
    total = 46
    starts, ends = reference.causal_bounds(cu, total=total)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    qi = mk(total, HI, DI).to(torch.bfloat16)
    ki = mk(total, DI).to(torch.bfloat16)
    w = (mk(total, HI).abs() * 0.5).to(w_dtype)
    topk = reference.indexer_topk(qi.float(), ki.float(), w.float(), starts, ends, K)
    topk[12, 2] = -1  # mid-row -1 slots (valid slots after them)
    topk[30, 0] = -1
    topk[33, 5] = topk[33, 1]  # a key selected twice in one row
    query, kv = mk(total, H, D), mk(total, D)
    target = il.sparse_target(query, kv, topk, SCALE)
    rw = il.row_weights(il.valid_query_rows(starts, ends), coeff=0.7, per_token=per_token)
    rw[3] = 0.0  # a valid row with zero weight
    return qi, ki, w, topk, target, rw


def _loss_and_grads(fn, qi, ki, w, topk, target, rw, grad_out=1.0):
    leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
    loss = fn(*leaves, topk, target, rw)
    grads = torch.autograd.grad(loss * grad_out, leaves)
    return loss.detach(), grads


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
@pytest.mark.parametrize("grad_out", [1.0, -2.5])
def test_glue_matches_sparse_indexer_loss(oracle_kernels, per_token, grad_out):
    x = _case(1, per_token=per_token)
    got, g_got = _loss_and_grads(kil.fused_sparse_indexer_loss, *x, grad_out=grad_out)
    want, g_want = _loss_and_grads(il.sparse_indexer_loss, *x, grad_out=grad_out)
    assert got.dtype == torch.float32 and got.ndim == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for name, a, b, src in zip(("dqi", "dki", "dw"), g_got, g_want, x[:3]):
        assert a.dtype == src.dtype, name
        # bf16 gradients: both sides round the same fp32 values, up to fp32 summation order (one bf16 ulp)
        tol = dict(rtol=1e-2, atol=1e-6) if src.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    assert g_got[0][41:].abs().sum() == 0 and g_got[2][41:].abs().sum() == 0  # padding rows (no key) get nothing
    assert g_got[0][3].abs().sum() == 0  # zero row weight


def test_glue_bf16_weights_get_bf16_gradient(oracle_kernels):
    x = _case(2, w_dtype=torch.bfloat16)
    got, g_got = _loss_and_grads(kil.fused_sparse_indexer_loss, *x)
    want, g_want = _loss_and_grads(il.sparse_indexer_loss, *x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert g_got[2].dtype == torch.bfloat16
    torch.testing.assert_close(g_got[2].float(), g_want[2].float(), rtol=1e-2, atol=1e-6)


def test_kl_glue_chunking_and_dscore():
    """Row chunks change nothing; dscore is rw * (softmax * sum(p) - p) on valid slots and 0 elsewhere."""
    qi, ki, w, topk, target, rw = _case(3)
    score = il.sparse_index_scores(qi, ki, w, topk)
    a, b = score.clone(), score.clone()
    la = kil.kl_loss_and_dscore_(a, target, rw, topk, ki.shape[0])
    lb = kil.kl_loss_and_dscore_(b, target, rw, topk, ki.shape[0], chunk_rows=7)
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=0)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    valid = topk >= 0
    pred = torch.softmax(score, dim=-1).nan_to_num(0.0)  # rows without a valid slot: all -inf -> NaN -> 0
    expect = (pred * target.sum(-1, keepdim=True) - target) * rw[:, None]
    torch.testing.assert_close(a, expect.masked_fill(~valid, 0.0), rtol=1e-5, atol=1e-7)
    assert (a[~valid] == 0).all() and torch.isfinite(la)


def test_glue_checks_shapes(oracle_kernels):
    qi, ki, w, topk, target, rw = _case(4)
    with pytest.raises(ValueError, match="target must be shaped like topk"):
        kil.fused_sparse_indexer_loss(qi, ki, w, topk, target[:, :4], rw)
    with pytest.raises(ValueError, match="rw must be"):
        kil.fused_sparse_indexer_loss(qi, ki, w, topk, target, rw[:5])


def test_supported_is_false_off_gpu():
    qi = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    query = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    topk = torch.zeros(8, 64, dtype=torch.int32)
    assert not kil.indexer_loss_supported(qi, query, topk)
