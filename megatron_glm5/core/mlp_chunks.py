"""The MLP half of a decoder layer recomputed in sequence chunks inside full-layer recompute (megatron-core's
``mlp_chunks_for_training``, Megatron-LM's ``--mlp-chunks-for-training``).

Why: under ``recompute_granularity="full"`` the peak of a long sequence is one layer's recomputed activations in its
backward, and the MoE holds most of them: on the GLM-5 slice at 64K tokens, 333 of about 560 KB per token (the
permuted tokens, fc1's output, the activation and their gradients; ``scripts/bench/RESULTS_step.md``, long context).
megatron-core's own ``mlp_chunks_for_training`` runs the MLP in chunks along the sequence but keeps every chunk's
activations for the backward, so it lowers only the transient part of the peak.

Here, in the recompute of a layer, the first ``n - 1`` chunks run without a graph (their output only) and are
recomputed one at a time in the backward (:class:`_ChunkRecompute`); the last chunk runs with its graph, as without
chunks. Its graph was built last, so the backward runs it first and frees it, then recomputes and backpropagates the
other chunks one by one: the MLP's share of the peak falls to about ``1 / n`` of what it was, for ``(n - 1) / n`` of
one more MLP forward. Outside a recompute (a forward that keeps its graph, or a checkpoint's first pass)
megatron-core's own branch runs (it keeps every chunk's activations). GLM-5.3-Flash's mHC layers run the same chunks
inside their own MLP half (:mod:`megatron_glm5.glm5_next.layer`).

Gradients: the recomputed chunks' parameter gradients are summed (in fp32 when there are several) and handed to
autograd as the function's input gradients, so each parameter's accumulation node runs once per backward, as without
chunks (megatron-core's DDP hook refuses a second gradient under ``overlap_grad_reduce``). Weights whose gradient the
GEMM adds to ``main_grad`` itself (``gradient_accumulation_fusion``; the routed experts' grouped GEMMs too) return
a placeholder, and the first chunk's is passed on as it is. The cost in memory: until the layer's backward ends, the
MLP's parameter gradients or placeholders (routed experts: views of one ``[N, K]`` block with the per-expert
weight-gradient GEMMs, else ``grouped_mm``'s bf16 ``[E, N, K]``) are held once, and
with 3 or more chunks also the fp32 sums of those that are not placeholders.

Where the layer's recomputed output is never read (the last layer of a megatron-core block checkpoint), the
recompute is split at the attention / MLP boundary instead (:mod:`megatron_glm5.core.split_recompute`): no third MLP
forward, and the attention half's tensors are not alive during the MLP's backward. This module's path serves the
other layers (MTP's, the earlier layers of a multi-layer chunk, pipeline stages without offload, packed batches the
MoE un-flattens) and ``MEGATRON_GLM5_SPLIT_RECOMPUTE=0``.

The math per token is unchanged; what depends on the whole sequence or on random numbers is refused
(:func:`check_chunkable`), and so is RL routing replay (:mod:`megatron_glm5.rl.replay`: one routing record per router
and micro-batch). An MLP with a dropout at run time (LoRA's is attached after the build) runs megatron-core's branch
in the recompute instead (:func:`random_modules`). The chunks are ``torch.chunk``'s, as in megatron-core's branch. The router counts tokens for the
expert bias only where gradients are enabled: once per recomputed chunk in the backward and once for the last chunk,
so once per token in all, as without chunks.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def check_chunkable(config) -> None:
    """Raise ``ValueError`` (naming the settings) where chunks would change the math: a sequence- or batch-level MoE
    loss (aux, z), routing decided over the whole call (Sinkhorn, quantile balancing, a capacity factor that drops
    tokens), random routing (input jitter, forced balancing or bias: the backward's recompute runs outside the
    checkpoint's RNG restore), a bias on the MLP's output."""
    problems = []
    aux = getattr(config, "moe_aux_loss_coeff", 0.0)
    aux_on = any(aux) if isinstance(aux, (list, tuple)) else bool(aux)
    balancing = getattr(config, "moe_router_load_balancing_type", "none")
    balancing = list(balancing) if isinstance(balancing, (list, tuple)) else [balancing]
    if aux_on and any(t != "none" for t in balancing):
        problems.append(f"moe_aux_loss_coeff={aux} with moe_router_load_balancing_type={balancing}")
    whole_call = [t for t in balancing if t in ("sinkhorn", "quantile_balancing")]
    if whole_call:
        problems.append(f"moe_router_load_balancing_type={whole_call}")
    for name in ("moe_z_loss_coeff", "moe_input_jitter_eps", "moe_expert_capacity_factor", "moe_router_force_biased"):
        if getattr(config, name, None):
            problems.append(f"{name}={getattr(config, name)}")
    if getattr(config, "moe_router_force_load_balancing", False):
        problems.append("moe_router_force_load_balancing")
    if getattr(config, "add_bias_linear", False):
        problems.append("add_bias_linear")
    if problems:
        raise ValueError(f"mlp_chunks_for_training={config.mlp_chunks_for_training} (the MLP recomputed in sequence "
                         f"chunks under full recompute) cannot be combined with: {', '.join(problems)}")


def random_modules(module: torch.nn.Module) -> list[str]:
    """What draws random numbers in ``module`` (dropout with ``p > 0``: a layer's ``hidden_dropout``, LoRA's
    dropout): a chunk recomputed in the backward runs outside the checkpoint's RNG restore and would draw other
    masks, so such a module is not chunked there."""
    found = [f"hidden_dropout={module.hidden_dropout}"] if getattr(module, "hidden_dropout", 0.0) else []
    found += [name for name, m in module.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    return found


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """``torch.chunk``'s piece sizes of ``length`` rows in ``chunks`` (as megatron-core's branch runs them in the
    checkpoint's first pass: same GEMM shapes)."""
    return [c.shape[0] for c in torch.empty(length, 0).chunk(max(1, min(chunks, length)), 0)]


def backward_chunks(run: Callable[[int, torch.Tensor], torch.Tensor], sizes: list[int], x: torch.Tensor,
                    dy: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """Run each chunk of ``x`` (dim 0, ``sizes``) again with gradients, one at a time, and backpropagate its part of
    ``dy``: returns ``dx`` and the gradients of ``params`` summed over the chunks (in fp32 when there are several;
    ``None`` where no chunk used a parameter; a weight whose GEMM adds to ``main_grad`` itself passes the first
    chunk's placeholder on)."""
    several = len(sizes) > 1
    dx = torch.empty_like(x)
    sums: list[Optional[torch.Tensor]] = [None] * len(params)
    for i, (xi, dyi, dxi) in enumerate(zip(x.split(sizes, 0), dy.split(sizes, 0), dx.split(sizes, 0))):
        xi = xi.detach().requires_grad_(True)
        with torch.enable_grad():
            yi = run(i, xi)
        grads = torch.autograd.grad(yi, (xi, *params), dyi, allow_unused=True)
        dxi.copy_(grads[0])
        del yi
        for j, (p, g) in enumerate(zip(params, grads[1:])):
            if g is None:
                continue
            if sums[j] is None:
                placeholder = getattr(p, "grad_added_to_main_grad", False)
                sums[j] = g.float() if several and not placeholder else g
            elif not getattr(p, "grad_added_to_main_grad", False):
                sums[j].add_(g)
    return dx, sums


class _ChunkRecompute(torch.autograd.Function):
    """``cat(run(i, x_i))`` over the chunks ``x_i`` of ``x`` (dim 0, ``sizes``) without a graph; the backward runs
    each chunk again with gradients and returns ``dx`` and the summed gradients of ``params`` (module docstring)."""

    @staticmethod
    def forward(ctx, run: Callable[[int, torch.Tensor], torch.Tensor], sizes: list[int], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.sizes, ctx.params = run, sizes, params
        ctx.save_for_backward(x)
        return torch.cat([run(i, xi) for i, xi in enumerate(x.split(sizes, 0))], 0)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        dx, sums = backward_chunks(ctx.run, ctx.sizes, x, dy, ctx.params)
        return (None, None, dx, *sums)


def chunked_mlp(mlp: torch.nn.Module, x: torch.Tensor, chunks: int,
                padding_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, None]:
    """``mlp`` on ``x`` (``[s, b, h]``) in ``chunks`` pieces along ``s``: all but the last recomputed in the backward
    (module docstring). ``padding_mask`` (``[b, s]``) is split with ``x``. Returns ``(output, None)``, megatron-core's
    ``(output, bias)`` pair (a bias is refused by :func:`check_chunkable`)."""
    sizes = chunk_sizes(x.shape[0], chunks)
    masks: Sequence[Optional[torch.Tensor]] = (
        padding_mask.split(sizes, 1) if padding_mask is not None else [None] * len(sizes))

    def run(i: int, xi: torch.Tensor) -> torch.Tensor:
        out, bias = mlp(xi, padding_mask=masks[i])
        if bias is not None:
            raise RuntimeError("mlp_chunks_for_training: the MLP returned a bias (refused by check_chunkable)")
        return out

    if len(sizes) == 1:
        return run(0, x), None
    head, last = x.split([x.shape[0] - sizes[-1], sizes[-1]], 0)
    params = tuple(p for p in mlp.parameters() if p.requires_grad)
    first = _ChunkRecompute.apply(run, sizes[:-1], head, *params)
    return torch.cat([first, run(len(sizes) - 1, last)], 0), None


def forward_mlp_in_chunks(layer, hidden_states: torch.Tensor, padding_mask, packed_seq_params,
                          chunks: Optional[int] = None) -> torch.Tensor:
    """megatron-core's ``TransformerLayer._forward_mlp`` (pre-MLP norm, MoE un-flattening, MLP, bias-dropout-add)
    with the MLP run by :func:`chunked_mlp` in ``chunks`` pieces (default ``mlp_chunks_for_training``); used by
    :class:`~megatron_glm5.core.layer.DSADecoderLayer` in the recompute of a layer, and with ``chunks=1`` on each
    chunk of a split recompute (:mod:`megatron_glm5.core.split_recompute`)."""
    pre = layer._forward_pre_mlp_layernorm(hidden_states)
    pre, residual = pre if isinstance(pre, tuple) else (pre, hidden_states)
    if layer.config.fp32_residual_connection:
        residual = residual.float()
    pre, padding_mask, mbs = layer._maybe_unflatten_for_moe(pre, padding_mask, packed_seq_params)
    chunks = layer.config.mlp_chunks_for_training if chunks is None else chunks
    out, bias = chunked_mlp(layer.mlp, pre, chunks, padding_mask)
    if mbs is not None:
        out = layer._maybe_reflatten_from_moe(out, packed_seq_params, mbs)
    return layer._forward_post_mlp((out, bias), residual)
