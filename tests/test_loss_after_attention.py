"""``megatron_glm5.dsa.loss_after_attention``: the sparse indexer loss computed in the backward runs after the
attention's backward (so the target that backward leaves is there), gives the gradients of the loss computed in the
forward times the main-loss scale, logs its value once, and prefers the attention's target over the fallback."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa import indexer_loss as il
from megatron_glm5.dsa.loss_after_attention import LossAfterAttention

T, S, K, HI, DI, H, D = 12, 12, 5, 4, 16, 3, 24


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    qi = torch.randn(T, HI, DI, generator=g, dtype=torch.float64, requires_grad=True)
    ki = torch.randn(S, DI, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(T, HI, generator=g, dtype=torch.float64, requires_grad=True)
    query = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    # causal top-k rows: min(t + 1, K) distinct keys of [0, t], then -1
    topk = torch.stack([torch.cat([torch.randperm(t + 1, generator=g)[: min(K, t + 1)],
                                   torch.full((max(0, K - t - 1),), -1)]) for t in range(T)]).int()
    rw = torch.full((T,), 0.1 / T, dtype=torch.float64)
    return qi, ki, w, query, kv, topk, rw


class _Attention(torch.autograd.Function):
    """A stand-in attention: ``y = 2 x``; its backward records the order and leaves a target in the box."""

    @staticmethod
    def forward(ctx, x, box, target, order):
        ctx.box, ctx.target, ctx.order = box, target, order
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        ctx.order.append("attention")
        if ctx.box is not None:
            ctx.box.target = ctx.target.clone()
        return 2 * g, None, None, None


def _plan(target_fn, order, logged, scale=1.0, tp_group=None):
    def loss_fn(*args):
        order.append("loss")
        return il.sparse_indexer_loss(*args)

    return LossAfterAttention(loss_fn=loss_fn, target_fn=target_fn, tp_group=tp_group,
                              scale_fn=lambda device: torch.tensor(scale, dtype=torch.float64),
                              log_fn=logged.append)


def test_runs_after_the_attention_backward_with_its_target_and_scale():
    qi, ki, w, query, kv, topk, rw = _inputs()
    target = il.sparse_target(query, kv, topk, 0.2)  # normalised
    raw = target * torch.linspace(1, 3, T, dtype=torch.float64)[:, None]  # unnormalised per row, as a kernel leaves it
    order, logged, fallback = [], [], []
    plan = _plan(lambda topk_: fallback.append(1) or target, order, logged, scale=0.25)
    x = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    y = _Attention.apply(plan.after(x, plan.token(qi, ki, w, topk, rw)), plan.box, raw, order)
    y.sum().backward()
    assert order == ["attention", "loss"] and not fallback, "the attention's backward first, its target used"
    assert torch.equal(x.grad, torch.full_like(x, 2.0)), "the identity passes the attention's gradient through"
    qi2, ki2, w2 = (t.detach().requires_grad_(True) for t in (qi, ki, w))
    ref = il.sparse_indexer_loss(qi2, ki2, w2, topk, target, rw)
    (0.25 * ref).backward()
    assert len(logged) == 1 and torch.allclose(logged[0], ref.detach(), rtol=1e-12, atol=0)
    for got, want in ((qi.grad, qi2.grad), (ki.grad, ki2.grad), (w.grad, w2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert plan.box.target is None, "the box is emptied by its reader"
    y2 = _Attention.apply(plan.after(x, plan.token(qi, ki, w, topk, rw)), plan.box, raw, order)
    y2.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        y2.sum().backward()


def test_falls_back_to_the_bound_target_when_the_attention_left_none():
    qi, ki, w, query, kv, topk, rw = _inputs(1)
    target = il.sparse_target(query, kv, topk, 0.2)
    order, logged = [], []
    got_topk = []
    plan = _plan(lambda topk_: got_topk.append(topk_) or target, order, logged)
    x = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    _Attention.apply(plan.after(x, plan.token(qi, ki, w, topk, rw)), None, None, order).sum().backward()
    assert order == ["attention", "loss"] and len(logged) == 1
    assert len(got_topk) == 1 and torch.equal(got_topk[0], topk), "the fallback gets the saved top-k"
    qi2, ki2, w2 = (t.detach().requires_grad_(True) for t in (qi, ki, w))
    il.sparse_indexer_loss(qi2, ki2, w2, topk, target, rw).backward()
    torch.testing.assert_close(ki.grad, ki2.grad, rtol=1e-10, atol=1e-14)


def test_frozen_attention_inputs_still_train_the_indexer():
    """Everything but the indexer frozen: the attention input needs no gradient, yet the loss still runs."""
    qi, ki, w, query, kv, topk, rw = _inputs(2)
    target = il.sparse_target(query, kv, topk, 0.2)
    order, logged = [], []
    plan = _plan(lambda topk_: target, order, logged)
    x = torch.randn(T, H, D, dtype=torch.float64)  # frozen upstream
    _Attention.apply(plan.after(x, plan.token(qi, ki, w, topk, rw)), None, None, order).sum().backward()
    assert order == ["attention", "loss"] and x.grad is None and qi.grad is not None and len(logged) == 1


def test_no_target_and_no_fallback_is_an_error():
    qi, ki, w, query, kv, topk, rw = _inputs(3)
    order, logged = [], []
    plan = _plan(None, order, logged)
    x = torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)
    y = _Attention.apply(plan.after(x, plan.token(qi, ki, w, topk, rw)), None, None, order)
    with pytest.raises(RuntimeError, match="no target and no fallback"):
        y.sum().backward()


def test_tensors_reach_saved_tensor_hooks():
    """The top-k, the row weights and the indexer inputs are saved tensors (activation offload's hooks move them);
    the plan itself holds none."""
    qi, ki, w, query, kv, topk, rw = _inputs(4)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        plan = _plan(None, [], [])
        plan.token(qi, ki, w, topk, rw)
    assert any(t is topk for t in seen) and any(t is rw for t in seen) and any(t is qi for t in seen)
    assert not [v for v in vars(plan).values() if isinstance(v, torch.Tensor)]
