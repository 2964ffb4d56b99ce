"""A layer's full recompute split at the attention / MLP boundary, with the MLP half in sequence chunks
(``mlp_chunks_for_training > 1`` under ``recompute_granularity="full"``; switch ``MEGATRON_GLM5_SPLIT_RECOMPUTE``).

Why: megatron-core's full recompute re-runs a whole layer and then backpropagates it, so while the MLP half is being
backpropagated the attention half's recomputed tensors (norm outputs, RoPE'd queries, the sparse MLA's output and
LSE, projections) are alive too: the peak is their sum. :mod:`megatron_glm5.core.mlp_chunks` shrinks the MLP's share
but pays ``(n - 1) / n`` of one more MLP forward, because the layer's recompute must produce the MLP output.

Here the backward of such a layer runs the two halves one after the other, each from its own input:

1. the first (no-grad) pass keeps the MLP half's input ``h`` (the residual stream after attention) on the checkpoint's
   node, through the activation-offload window when offload is on;
2. the recompute builds no graph for the layer: it returns a placeholder output of the right shape through
   :class:`_SplitLayerBackward`, whose backward
3. recomputes and backpropagates the MLP half chunk by chunk from the kept ``h`` (each chunk's graph freed before the
   next is built), giving ``dh``; then
4. recomputes the attention half from the layer input with its graph (the DSA top-k replayed as before) and
   backpropagates ``dh`` through it.

The peak is the larger half's instead of their sum, the MLP is computed twice (as without chunks) instead of
``2 + (n - 1) / n`` times, and each layer keeps one more hidden-state-sized tensor from its forward to its backward.

Only where the recomputed output's value is never read: the layer is the last of a megatron-core ``TransformerBlock``
checkpoint chunk (:func:`megatron_glm5.compat.checkpoint_last_layer`; with ``recompute_num_layers=1`` every layer).
Elsewhere (an MTP layer's checkpoint, earlier layers of a multi-layer chunk) and wherever the split could change the
math (dropout: the halves' random streams would move; packed sequences: the MoE un-flattening is not per token) the
layer recomputes as :mod:`~megatron_glm5.core.mlp_chunks` describes. Gradients: all of the layer's parameter gradients
are returned as the function's input gradients, so each accumulation node runs once per backward (megatron-core's
DDP hook contract); the recomputed chunks' are summed as in :mod:`~megatron_glm5.core.mlp_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import compat, offload
from .mlp_chunks import backward_chunks, chunk_sizes

_STASH = "_glm5_split_mlp_input"  # attribute of the checkpoint node: {layer module: held MLP-half input}
# MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH: fewest tokens per chunk. The chunks only pay where the MoE's activations are a
# large part of the peak; at 16K tokens on the GLM-5 slice 4 chunks of 4096 cost +9.1 % (issue 23, round 6)
MIN_CHUNK_TOKENS = 16384


def split_applies(layer, packed_seq_params) -> bool:
    """The layer's recompute may be split (module docstring) on the running checkpoint; the caller has checked that
    this is a training pass inside a megatron-core checkpoint."""
    config = layer.config
    if not (layer.split_recompute and config.mlp_chunks_for_training > 1) or packed_seq_params is not None:
        return False
    if config.hidden_dropout or config.attention_dropout:
        return False
    return compat.checkpoint_last_layer(compat.checkpoint_node()) is layer


def split_chunks(layer, hidden_states: torch.Tensor) -> int:
    """How many chunks the split runs the MLP half in for this call: ``mlp_chunks_for_training``, or with
    ``layer.chunks_by_length`` (``MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH``, experimental) at most one per
    :data:`MIN_CHUNK_TOKENS` tokens (``[s, b, ...]``: ``s * b``), and at least one."""
    chunks = layer.config.mlp_chunks_for_training
    if getattr(layer, "chunks_by_length", False):
        tokens = hidden_states.shape[0] * (hidden_states.shape[1] if hidden_states.dim() > 2 else 1)
        chunks = max(1, min(chunks, tokens // MIN_CHUNK_TOKENS))
    return chunks


def keep_mlp_input(layer, hidden_states: torch.Tensor) -> None:
    """First pass: keep the MLP half's input on the running checkpoint's node for the split recompute."""
    node = compat.checkpoint_node()
    stash = getattr(node, _STASH, None)
    if stash is None:
        stash = {}
        setattr(node, _STASH, stash)
    stash[layer] = (offload.hold(hidden_states), hidden_states.shape, hidden_states.dtype,
                    split_chunks(layer, hidden_states))


def take_mlp_input(layer) -> Optional[tuple]:
    """Recompute: ``(held MLP-half input, its shape, its dtype, chunks)`` as this layer kept it in the first pass of
    the running checkpoint, or None."""
    node = compat.checkpoint_node()
    return getattr(node, _STASH, {}).pop(layer, None) if node is not None else None


@dataclass
class _Plan:
    """What the backward of one split layer needs; dropped when it has run."""

    attention: Callable[[torch.Tensor], torch.Tensor]  # layer input -> MLP-half input, with its graph
    mlp_half: Callable[[int, torch.Tensor], torch.Tensor]  # chunk index, chunk of the MLP-half input -> output
    sizes: list[int]
    held_input: Any  # offload.hold(MLP-half input)
    params: tuple[torch.Tensor, ...]
    shape: torch.Size  # the MLP half's input's = the layer output's
    dtype: torch.dtype


class _SplitLayerBackward(torch.autograd.Function):
    """The recompute of a split layer: a placeholder output (its value is never read) whose backward runs the MLP half
    in chunks, then the attention half (module docstring). Returns the layer input's and every parameter's
    gradient."""

    @staticmethod
    def forward(ctx, plan: _Plan, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        ctx.save_for_backward(x)
        # no storage: CheckpointFunction only backpropagates from it
        return x.new_empty((), dtype=plan.dtype).expand(plan.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan, ctx.plan = ctx.plan, None
        (x,) = ctx.saved_tensors
        h = offload.release(plan.held_input)
        plan.held_input = None
        dh, sums = backward_chunks(plan.mlp_half, plan.sizes, h, dy.contiguous(), plan.params)
        del h
        xd = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            h_recomputed = plan.attention(xd)
        wrt = ((xd,) if xd.requires_grad else ()) + plan.params
        grads = list(torch.autograd.grad(h_recomputed, wrt, dh, allow_unused=True))
        del h_recomputed, dh
        dx = grads.pop(0) if xd.requires_grad else None
        out = []
        for p, g_mlp, g_attn in zip(plan.params, sums, grads):
            if g_mlp is None or g_attn is None:
                out.append(g_mlp if g_attn is None else g_attn)
            elif getattr(p, "grad_added_to_main_grad", False):
                out.append(g_mlp)  # both halves added theirs to main_grad; pass one placeholder on
            else:
                out.append(g_mlp.to(g_attn.dtype) + g_attn)  # a parameter used by both halves (none in our layers)
        return (None, dx, *out)


def split_layer_recompute(layer, kept: tuple, kwargs: dict, attention: Callable[[torch.Tensor], torch.Tensor],
                          mlp_half: Callable) -> torch.Tensor:
    """The layer's recomputed output under the split (module docstring): a storage-less placeholder of the MLP half's
    input's shape (the layer output's) attached to :class:`_SplitLayerBackward`. ``kept`` is
    :func:`take_mlp_input`'s; ``kwargs`` the layer call's (megatron-core's chunk function passes keywords only);
    ``attention(x)`` recomputes the attention half from the layer input ``x``; ``mlp_half(h_i, mask_i)`` runs the MLP
    half, unchunked, on a chunk of its input."""
    held_input, shape, dtype, chunks = kept
    x = kwargs["hidden_states"]
    sizes = chunk_sizes(shape[0], chunks)
    padding_mask = kwargs.get("padding_mask")
    masks = padding_mask.split(sizes, 1) if padding_mask is not None else [None] * len(sizes)
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    plan = _Plan(attention=attention, mlp_half=lambda i, h: mlp_half(h, masks[i]), sizes=sizes,
                 held_input=held_input, params=params, shape=shape, dtype=dtype)
    return _SplitLayerBackward.apply(plan, x, *params)
