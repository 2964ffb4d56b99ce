"""The indexer KL loss (``megatron_glm5.dsa.indexer_loss``) against megatron-core's ``compute_dsa_indexer_loss`` on
the same tensors (fp32: value and indexer gradients within 1e-6 relative) and against an fp64 closed form; sparse and
dense, bshd and THD (with padding rows that attend to nothing), per-token mode, and the recall diagnostic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_glm5.dsa import indexer_loss as il
from megatron_glm5.dsa import reference

H, D, HI, DI = 4, 24, 3, 16
SCALE = D**-0.5


def _inputs(t_total: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(query=mk(t_total, H, D) * 2.0, kv=mk(t_total, D), qi=mk(t_total, HI, DI),
                ki=mk(t_total, DI), w=mk(t_total, HI).abs() * 0.5)


def _layout(kind: str):
    if kind == "bshd":  # b = 2, s = 24 flattened batch-major
        cu = reference.uniform_cu_seqlens(2, 24)
        total = 48
    else:  # THD: three documents (one shorter than top-k), 5 padding rows at the end
        cu = torch.tensor([0, 20, 26, 41], dtype=torch.int32)
        total = 46
    starts, ends = reference.causal_bounds(cu, total=total)
    return cu, starts, ends, total


def _mcore_loss(x, topk, starts, ends, kind, sparse, coeff, per_token):
    """megatron-core's reference loss on the same tensors (``[sq, b, ...]`` with b = 1 over the flattened rows)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        _compute_index_scores,
        compute_dsa_indexer_loss,
    )

    qi, ki, w = x["qi"], x["ki"], x["w"]
    scores = _compute_index_scores(qi[:, None], w[:, None], ki[:, None], use_relu=True)  # [1, T, T]
    key = x["kv"][:, None, None, :].expand(-1, 1, H, D)
    valid_rows = ends > starts
    return compute_dsa_indexer_loss(
        scores, topk.long()[None], x["query"][:, None], key, SCALE, coeff, sparse,
        SimpleNamespace(tp=dist.group.WORLD), varlen_starts=starts, varlen_ends=ends,
        query_valid_rows=valid_rows if kind == "thd" else None, calculate_per_token_loss=per_token,
    )


def _grads(loss, x):
    return torch.autograd.grad(loss, [x["qi"], x["ki"], x["w"]])


def _leaf(x):
    return {k: (v.clone().requires_grad_(k in ("qi", "ki", "w"))) for k, v in x.items()}


@pytest.mark.parametrize("kind", ["bshd", "thd"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
def test_matches_megatron_core(gloo_world, kind, sparse, per_token):
    cu, starts, ends, total = _layout(kind)
    x = _inputs(total, seed=3)
    topk = reference.indexer_topk(x["qi"], x["ki"], x["w"], starts, ends, 8)
    assert (topk == -1).any() and (topk >= 0).any()
    ours_in, mc_in = _leaf(x), _leaf(x)
    ours = il.indexer_loss(ours_in["qi"], ours_in["ki"], ours_in["w"], ours_in["query"], ours_in["kv"], starts, ends,
                           SCALE, coeff=0.37, topk=topk if sparse else None, per_token=per_token,
                           budget_bytes=4096)  # tiny budget: many chunks
    ref = _mcore_loss(mc_in, topk, starts, ends, kind, sparse, 0.37, per_token)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    for a, b in zip(_grads(ours, ours_in), _grads(ref, mc_in)):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())


def _closed_form(x, topk, starts, ends, sparse, coeff):
    """fp64, dense tensors, straight from the definition."""
    t_total = x["query"].shape[0]
    keys = torch.arange(t_total)
    allowed = (keys[None] >= starts[:, None].long()) & (keys[None] < ends[:, None].long())
    if sparse:
        chosen = torch.zeros(t_total, t_total + 1, dtype=torch.bool)
        chosen.scatter_(1, torch.where(topk >= 0, topk.long(), t_total), True)
        allowed = allowed & chosen[:, :t_total]
    logits = torch.einsum("thd,sd->ths", x["query"], x["kv"]) * SCALE
    probs = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), -1).nan_to_num(0.0).sum(1)
    target = probs / probs.sum(-1, keepdim=True).clamp_min(1e-10)
    score = torch.einsum("thd,sd->ths", x["qi"], x["ki"]).relu().mul(x["w"][..., None]).sum(1)
    log_pred = torch.log_softmax(score.masked_fill(~allowed, float("-inf")), -1)
    kl = torch.where(allowed, target * (target.clamp_min(1e-10).log() - log_pred), 0.0).sum(-1)
    valid = ends > starts
    return coeff * (kl * valid).sum() / valid.sum()


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_fp64_closed_form(sparse):
    cu, starts, ends, total = _layout("thd")
    x = _inputs(total, seed=5, dtype=torch.float64)
    topk = reference.indexer_topk(x["qi"], x["ki"], x["w"], starts, ends, 8)
    a_in, b_in = _leaf(x), _leaf(x)
    ours = il.indexer_loss(a_in["qi"], a_in["ki"], a_in["w"], a_in["query"], a_in["kv"], starts, ends, SCALE,
                           coeff=1.0, topk=topk if sparse else None)
    ref = _closed_form(b_in, topk, starts, ends, sparse, 1.0)
    assert ours.dtype == torch.float32  # the loss is reported in fp32 (megatron-core's tracker dtype)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-7, atol=0)
    for a, b in zip(_grads(ours, a_in), _grads(ref, b_in)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_lse_given_target_equals_softmax_target():
    """A fused kernel hands in the attention's own LSE: same target as forming each head's softmax."""
    cu, starts, ends, total = _layout("thd")
    x = _inputs(total, seed=7)
    topk = reference.indexer_topk(x["qi"], x["ki"], x["w"], starts, ends, 8)
    _, lse = reference.sparse_mla(x["query"], x["kv"], topk, SCALE, D)
    a = il.sparse_target(x["query"], x["kv"], topk, SCALE)
    b = il.sparse_target(x["query"], x["kv"], topk, SCALE, lse=lse)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    rows = (topk >= 0).any(-1)
    torch.testing.assert_close(a.sum(-1)[rows], torch.ones(int(rows.sum())))
    assert (a[topk < 0] == 0).all() and (a[~rows] == 0).all()


def test_only_indexer_inputs_get_gradients():
    cu, starts, ends, total = _layout("bshd")
    x = _inputs(total, seed=1)
    x = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    loss = il.indexer_loss(x["qi"], x["ki"], x["w"], x["query"], x["kv"], starts, ends, SCALE, coeff=1.0)
    loss.backward()
    assert x["query"].grad is None and x["kv"].grad is None
    assert all(x[k].grad is not None and x[k].grad.abs().max() > 0 for k in ("qi", "ki", "w"))


def test_perfect_indexer_has_zero_loss_and_recall_one():
    """When the index scores equal the attention logits of a single head, the prediction is the target exactly."""
    t_total = 30
    starts, ends = reference.causal_bounds(reference.uniform_cu_seqlens(1, t_total))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t_total, 1, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(t_total, 8, generator=g, dtype=torch.float64)
    # relu(q . k) with a shift that keeps every dot positive: score = q . k + c, and softmax is shift-invariant
    qi = torch.cat([q, torch.full((t_total, 1, 1), 50.0, dtype=torch.float64)], -1)
    ki = torch.cat([kv, torch.ones(t_total, 1, dtype=torch.float64)], -1)
    w = torch.ones(t_total, 1, dtype=torch.float64)
    loss = il.indexer_loss(qi, ki, w, q, kv, starts, ends, 1.0, coeff=1.0)
    assert loss.abs() < 1e-6
    topk = reference.indexer_topk(qi, ki, w, starts, ends, 6)
    stats = il.attention_recall(q, kv, topk, starts, ends, 1.0)
    torch.testing.assert_close(stats.captured, stats.best, rtol=1e-9, atol=1e-9)
    random_topk = reference.indexer_topk(torch.randn_like(qi), ki, w, starts, ends, 6)
    worse = il.attention_recall(q, kv, random_topk, starts, ends, 1.0)
    assert worse.captured < stats.captured - 0.05
    assert 0 < worse.captured <= worse.best <= 1


def test_dense_loss_measures_the_same_recall_as_attention_recall():
    """The warm-up takes its recall from the dense loss's own targets: the same numbers as the standalone pass."""
    cu, starts, ends, total = _layout("thd")
    x = _inputs(total, seed=11)
    topk = reference.indexer_topk(x["qi"], x["ki"], x["w"], starts, ends, 8)
    rw = il.row_weights(il.valid_query_rows(starts, ends), 1.0, False)
    loss, stats = il.dense_indexer_loss(x["qi"], x["ki"], x["w"], x["query"], x["kv"], starts, ends, SCALE, rw,
                                        recall_topk=topk, budget_bytes=4096)
    alone = il.attention_recall(x["query"], x["kv"], topk, starts, ends, SCALE)
    torch.testing.assert_close(stats.captured, alone.captured, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats.best, alone.best, rtol=1e-6, atol=0)
    assert 0 < stats.captured < stats.best <= 1
    torch.testing.assert_close(loss, il.indexer_loss(x["qi"], x["ki"], x["w"], x["query"], x["kv"], starts, ends,
                                                     SCALE, coeff=1.0), rtol=0, atol=0)
