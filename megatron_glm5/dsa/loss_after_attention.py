"""The sparse indexer loss computed in the backward, right after the main attention's backward.

The sparse loss's target is the main attention's probabilities over each row's selected keys, summed over heads. The
sparse-MLA backward forms exactly those probabilities (``P = exp(scale * q . kv - lse)``) for its own gradients, so
summing them over heads there is nearly free; forming them in the forward costs a second gather of every selected
latent row (about as much as the attention forward itself). So on the ``tilelang`` backend the loss and its gradients
are computed once that backward has run:

* forward: ``token = loss.token(qi, ki, w, topk, rw)`` (an empty tensor that carries the indexer's inputs),
  ``query = loss.after(query, token)`` (identity: the attention consumes the token), then the attention with
  ``target_box=loss.box``;
* backward: the attention's backward fills ``loss.box``; the identity passes the token an empty gradient; then the
  token's backward all-reduces the target over TP, normalises it, computes the loss value and the indexer gradients
  (scaled by megatron-core's main-loss backward scale, the factor ``DSAIndexerLossAutoScaler`` applies) and logs the
  value in the layer's tracker slot.

Same loss value, gradients and log line as attaching the loss in the forward (``indexer_training.attach_loss``); the
difference is only when they are computed. Without a filled box (the torch attention: CPU, other dtypes) the target
is formed from the attention's saved ``query``, ``kv`` and LSE instead, which is how CPU tests check this path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..kernels.sparse_mla_bwd import AttentionTargetBox
from . import indexer_loss

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class LossAfterAttention:
    """One layer's sparse indexer loss for one forward, computed in the backward (module docstring).

    ``loss_fn(qi, ki, w, topk, target, rw)`` is the loss with autograd (the fused kernels or the torch oracle),
    ``scale_fn(device)`` the gradient factor of the loss (the main loss's backward scale), ``log_fn(loss)`` logs it,
    ``target_fn(topk)`` gives the normalised, TP-summed target when the attention left none in :attr:`box` (the torch
    attention; None while unbound). The plan holds no tensors of its own: the token's inputs are saved with
    ``save_for_backward`` (so activation offload's saved-tensor hooks see them), and only a torch-path fallback
    closes over the attention's tensors."""

    loss_fn: LossFn
    scale_fn: Callable[[torch.device], torch.Tensor]
    log_fn: Callable[[torch.Tensor], None]
    tp_group: Optional[torch.distributed.ProcessGroup] = None
    target_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    box: AttentionTargetBox = field(default_factory=AttentionTargetBox)

    def token(self, qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, topk: torch.Tensor,
              rw: torch.Tensor) -> torch.Tensor:
        """The empty tensor whose backward computes the loss over ``topk [T, K]`` with row weights ``rw [T]``;
        ``qi``, ``ki``, ``w`` must carry gradients."""
        if not (qi.requires_grad or ki.requires_grad or w.requires_grad):
            raise ValueError("the indexer loss after the attention needs indexer inputs that require grad")
        return _LossToken.apply(qi, ki, w, topk, rw, self)

    @staticmethod
    def after(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """``x`` unchanged, made to depend on ``token``: its consumer's backward runs before the token's."""
        return _AfterToken.apply(x, token)

    def final_target(self, topk: torch.Tensor) -> torch.Tensor:
        """The normalised target over all heads (all TP ranks): the attention backward's head sum when it left one."""
        target = self.box.take()
        if target is None:
            if self.target_fn is None:
                raise RuntimeError("indexer loss after the attention: the attention left no target and no fallback "
                                   "was bound (TileLangSparseAttention.bind_attention)")
            return self.target_fn(topk)
        return indexer_loss.finish_target_(target, self.tp_group)


class _LossToken(torch.autograd.Function):
    """``forward(qi, ki, w, topk, rw, plan)`` -> an empty tensor; ``backward``: the loss and the gradients of ``qi``,
    ``ki``, ``w`` (module docstring)."""

    @staticmethod
    def forward(ctx, qi, ki, w, topk, rw, plan):  # noqa: D102
        ctx.save_for_backward(qi, ki, w, topk, rw)
        ctx.plan = plan
        return qi.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _grad):  # noqa: D102
        plan: Optional[LossAfterAttention] = ctx.plan
        if plan is None:
            raise RuntimeError("the indexer loss after the attention runs once per forward: a second backward through "
                               "the same graph (retain_graph=True) is not supported")
        ctx.plan = None  # a torch-path fallback closes over the attention's tensors: free them now
        qi, ki, w, topk, rw = ctx.saved_tensors
        target = plan.final_target(topk)
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(True) for t in (qi, ki, w)]
            loss = plan.loss_fn(*inputs, topk, target, rw)
            scale = plan.scale_fn(loss.device).to(loss.dtype).reshape(loss.shape)
            grads = torch.autograd.grad(loss, inputs, grad_outputs=scale)
        plan.log_fn(loss.detach())
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])) + (None, None, None)


class _AfterToken(torch.autograd.Function):
    """Identity on ``x`` that takes ``token`` as an input, so the token's backward waits for ``x``'s consumers."""

    @staticmethod
    def forward(ctx, x, token):  # noqa: D102
        ctx.token_meta = (token.dtype, token.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        dtype, device = ctx.token_meta
        return grad, torch.zeros(0, dtype=dtype, device=device)
