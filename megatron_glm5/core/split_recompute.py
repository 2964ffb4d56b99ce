"""A layer's full recompute split at the attention / MLP boundary, with the MLP half in sequence chunks
(``mlp_chunks_for_training > 1`` under ``recompute_granularity="full"``; switch ``MEGATRON_GLM5_SPLIT_RECOMPUTE``).

Why: megatron-core's full recompute re-runs a whole layer and then backpropagates it, so while the MLP half is being
backpropagated the attention half's recomputed tensors (norm outputs, RoPE'd queries, the sparse MLA's output and
LSE, projections) are alive too: the peak is their sum. :mod:`megatron_glm5.core.mlp_chunks` shrinks the MLP's share
but pays ``(n - 1) / n`` of one more MLP forward, because the layer's recompute must produce the MLP output.

Here the backward of such a layer runs the two halves one after the other, each from its own input:

1. the first (no-grad) pass keeps the MLP half's input ``h`` (the residual stream after attention) on the checkpoint's
   node, through the activation-offload window when offload is on;
2. the recompute builds no graph for the layer: it returns storage-less placeholders through two chained functions,
   :class:`_AttentionHalf` (layer input -> ``h``) and :class:`_MLPHalf` (``h`` -> layer output);
3. the backward of :class:`_MLPHalf` recomputes and backpropagates the MLP half chunk by chunk from the kept ``h``
   (each chunk's graph freed before the next is built), giving ``dh``; its parameter gradients reach their
   accumulation nodes (DDP's hooks) and the layer's output gradient is freed before
4. the backward of :class:`_AttentionHalf` recomputes the attention half from the layer input with its graph (the DSA
   top-k replayed as before) and backpropagates ``dh`` through it.

The peak is the larger half's instead of their sum, and the MLP is computed twice (as without chunks) instead of
``2 + (n - 1) / n`` times. The cost: each layer keeps one more hidden-state-sized tensor from its forward to its
backward, per micro-batch in flight; offload moves it to the host with the layer input. So under pipeline
parallelism, where a stage holds several micro-batches, the split is used only with activation offload; without
pipelining the extra tensors (one per layer of the stage) outweigh the attention's recomputed tensors from about 8
layers per stage on GLM-5's shapes (``MEGATRON_GLM5_SPLIT_RECOMPUTE=0`` there, or offload).

Only where the recomputed output's value is never read: the layer is the last of a megatron-core ``TransformerBlock``
checkpoint chunk (:func:`megatron_glm5.compat.checkpoint_last_layer`; with ``recompute_num_layers=1`` every layer).
Elsewhere (an MTP layer's checkpoint, earlier layers of a multi-layer chunk) and wherever the split could change the
math (dropout, LoRA's included: the halves recompute outside the checkpoint's RNG restore; packed batches the MoE
un-flattens: not per token) the layer recomputes as :mod:`~megatron_glm5.core.mlp_chunks` describes. Gradients: each
half returns its parameters' gradients as the function's input gradients, so each accumulation node runs once per
backward (megatron-core's DDP hook contract); the recomputed chunks' are summed as in
:mod:`~megatron_glm5.core.mlp_chunks`. A parameter used by both halves is refused when it is met.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import compat, offload
from .mlp_chunks import backward_chunks, chunk_sizes, random_modules

_STASH = "_glm5_split_mlp_input"  # attribute of the checkpoint node: {layer module: what keep_mlp_input kept}
# MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH: fewest tokens per chunk. The chunks only pay where the MoE's activations are a
# large part of the peak; at 16K tokens on the GLM-5 slice 4 chunks of 4096 cost +9.1 % (issue 23, round 6)
MIN_CHUNK_TOKENS = 16384


def split_applies(layer, node, packed_seq_params) -> bool:
    """The layer's recompute may be split (module docstring) on the checkpoint ``node``; the caller has checked that
    this is a training pass inside a megatron-core checkpoint."""
    config = layer.config
    if not (layer.split_recompute and config.mlp_chunks_for_training > 1):
        return False
    if packed_seq_params is not None and getattr(packed_seq_params, "tokens_per_sample", None) is not None:
        return False  # the MoE un-flattens such batches: not per token along dim 0
    if config.pipeline_model_parallel_size > 1 and layer.activation_offload is None:
        return False  # each micro-batch in flight would keep one more hidden state per layer on the device
    if config.attention_dropout or random_modules(layer):
        return False
    return compat.checkpoint_last_layer(node) is layer


def split_chunks(layer, hidden_states: torch.Tensor) -> int:
    """How many chunks the split runs the MLP half in for this call: ``mlp_chunks_for_training``, or with
    ``layer.chunks_by_length`` (``MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH``, on by default) at most one per
    :data:`MIN_CHUNK_TOKENS` tokens (``[s, b, ...]``: ``s * b``), and at least one. Not by length under expert
    parallelism: the ranks of an expert group may hold different lengths and must run as many MoE calls."""
    chunks = layer.config.mlp_chunks_for_training
    if getattr(layer, "chunks_by_length", False) and layer.config.expert_model_parallel_size == 1:
        tokens = hidden_states.shape[0] * (hidden_states.shape[1] if hidden_states.dim() > 2 else 1)
        chunks = max(1, min(chunks, tokens // MIN_CHUNK_TOKENS))
    return chunks


@dataclass(frozen=True, kw_only=True, slots=True)
class Kept:
    """What the first pass keeps on the checkpoint's node for one split layer."""

    held_input: Any  # offload.hold(MLP-half input)
    shape: torch.Size  # the MLP half's input's = the layer output's
    in_dtype: torch.dtype  # the MLP half's input's
    out_dtype: torch.dtype  # the layer output's (fp32 with fp32_residual_connection)
    chunks: int


def keep_mlp_input(layer, node, hidden_states: torch.Tensor) -> None:
    """First pass: keep the MLP half's input on the checkpoint ``node`` for the split recompute."""
    stash = getattr(node, _STASH, None)
    if stash is None:
        stash = {}
        setattr(node, _STASH, stash)
    out_dtype = torch.float32 if layer.config.fp32_residual_connection else hidden_states.dtype
    stash[layer] = Kept(held_input=offload.hold(hidden_states), shape=hidden_states.shape,
                        in_dtype=hidden_states.dtype, out_dtype=out_dtype, chunks=split_chunks(layer, hidden_states))


def take_mlp_input(layer) -> Optional[Kept]:
    """Recompute: what this layer kept in the first pass of the running checkpoint, or None."""
    node = compat.checkpoint_node()
    return getattr(node, _STASH, {}).pop(layer, None) if node is not None else None


def _placeholder(shape: torch.Size, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``shape`` without storage: the recompute only backpropagates from it."""
    return like.new_empty((), dtype=dtype).expand(shape)


def _refuse_shared(half: str, params: tuple, grads) -> None:
    used = [tuple(p.shape) for p, g in zip(params, grads) if g is not None]
    if used:
        raise RuntimeError(f"split recompute: the {half} half used parameters of the other half (shapes {used}); set "
                           "MEGATRON_GLM5_SPLIT_RECOMPUTE=0 for layers whose halves share parameters")


@dataclass(kw_only=True, slots=True)
class _Plan:
    """What the backward of one split layer needs; each half drops its part when it has run."""

    attention: Optional[Callable[[torch.Tensor], torch.Tensor]]  # layer input -> MLP-half input, with its graph
    mlp_half: Optional[Callable[[int, torch.Tensor], torch.Tensor]]  # chunk index, chunk of its input -> output
    sizes: list[int]
    held_input: Any
    attn_params: tuple[torch.Tensor, ...]
    mlp_params: tuple[torch.Tensor, ...]


class _AttentionHalf(torch.autograd.Function):
    """The attention half of a split layer: a placeholder for its output (the MLP half's input); the backward
    recomputes the half from the layer input and backpropagates ``dh`` through it."""

    @staticmethod
    def forward(ctx, plan: _Plan, shape: torch.Size, dtype: torch.dtype, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        ctx.save_for_backward(x)
        return _placeholder(shape, dtype, x)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        plan, ctx.plan = ctx.plan, None
        (x,) = ctx.saved_tensors
        xd = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            h = plan.attention(xd)
        plan.attention = None
        wrt = ((xd,) if xd.requires_grad else ()) + plan.attn_params + plan.mlp_params
        grads = list(torch.autograd.grad(h, wrt, dh, allow_unused=True))
        del h
        dx = grads.pop(0) if xd.requires_grad else None
        _refuse_shared("attention", plan.mlp_params, grads[len(plan.attn_params):])
        return (None, None, None, dx, *grads[:len(plan.attn_params)])


class _MLPHalf(torch.autograd.Function):
    """The MLP half of a split layer: a placeholder for the layer output; the backward recomputes and backpropagates
    the half chunk by chunk from its input kept by the first pass and returns ``dh``. Its parameter gradients go to
    their accumulation nodes before the attention half's backward starts, and ``dy`` is freed by then."""

    @staticmethod
    def forward(ctx, plan: _Plan, shape: torch.Size, dtype: torch.dtype, h: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        return _placeholder(shape, dtype, h)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan, ctx.plan = ctx.plan, None
        h = offload.release(plan.held_input)
        plan.held_input = None
        dh, grads = backward_chunks(plan.mlp_half, plan.sizes, h, dy.contiguous(),
                                    plan.mlp_params + plan.attn_params)
        plan.mlp_half = None
        _refuse_shared("MLP", plan.attn_params, grads[len(plan.mlp_params):])
        return (None, None, None, dh, *grads[:len(plan.mlp_params)])


def split_layer_recompute(layer, kept: Kept, kwargs: dict, attention: Callable[[torch.Tensor], torch.Tensor],
                          mlp_half: Callable) -> torch.Tensor:
    """The layer's recomputed output under the split (module docstring): a storage-less placeholder of the layer
    output's shape at the end of :class:`_AttentionHalf` -> :class:`_MLPHalf`. ``kwargs`` are the layer call's
    (megatron-core's chunk function passes keywords only); ``attention(x)`` recomputes the attention half from the
    layer input ``x``; ``mlp_half(h_i, mask_i)`` runs the MLP half, unchunked, on a chunk of its input."""
    x = kwargs["hidden_states"]
    sizes = chunk_sizes(kept.shape[0], kept.chunks)
    padding_mask = kwargs.get("padding_mask")
    masks = padding_mask.split(sizes, 1) if padding_mask is not None else [None] * len(sizes)
    mlp_ids = {id(p) for m in layer.mlp_half_modules() for p in m.parameters()}
    params = [p for p in layer.parameters() if p.requires_grad]
    plan = _Plan(attention=attention, mlp_half=lambda i, h: mlp_half(h, masks[i]), sizes=sizes,
                 held_input=kept.held_input, attn_params=tuple(p for p in params if id(p) not in mlp_ids),
                 mlp_params=tuple(p for p in params if id(p) in mlp_ids))
    h = _AttentionHalf.apply(plan, kept.shape, kept.in_dtype, x, *plan.attn_params)
    return _MLPHalf.apply(plan, kept.shape, kept.out_dtype, h, *plan.mlp_params)
