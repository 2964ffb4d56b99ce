"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism megatron-core's output layer leaves each rank with a slice ``[N, V / TP]`` of the logits
(``parallel_output=True``). :func:`vocab_parallel_logprobs` reduces over the slices with two all-reduces per call
(a MAX for the stable shift, then one SUM of three ``[N]`` statistics) and has its own backward, which needs no
collective and keeps only the input logits plus three ``[N]`` fp32 vectors:

* ``x = logits / temperature`` (fp32), ``lse = logsumexp(x)`` over the whole vocabulary,
* ``logprob[n] = x[n, target[n]] - lse[n]``,
* ``entropy[n] = lse[n] - sum_v p[n, v] x[n, v]`` (``p = softmax(x)``),
* backward: ``dx = g_logprob * (onehot(target) - p) - g_entropy * p * (x - E_p[x])``, then ``dlogits = dx / T``.

The fp32 temporaries are bounded to ``chunk x V / TP`` (rows are processed in chunks), so a 32K-token micro-batch
never holds an fp32 copy of its logits. megatron-core has the cross-entropy half of this
(``VocabParallelCrossEntropy``) but no entropy and no temperature; this is the same reduction pattern.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ROWS = 2048


def vocab_range(vocab_local: int, group) -> tuple[int, int]:
    """``[start, end)`` of this rank's vocabulary slice (megatron-core's even split over the TP group)."""
    rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    return rank * vocab_local, (rank + 1) * vocab_local


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math, fp64 for fp64 logits (gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, group, vocab_size, chunk):
        n, v_local = logits.shape
        start, end = vocab_range(v_local, group)
        # Columns of the padded vocabulary (>= vocab_size) are excluded from the softmax.
        valid_cols = None if vocab_size is None or end <= vocab_size else max(0, vocab_size - start)
        local_target = target - start
        owned = (local_target >= 0) & (local_target < v_local)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        acc = _acc_dtype(logits.dtype)

        def scaled(c0, c1):
            x = logits[c0:c1].to(acc)
            if temperature != 1.0:
                x = x / temperature
            if valid_cols is not None:
                x[:, valid_cols:] = float("-inf")
            return x

        m = torch.empty(n, dtype=acc, device=logits.device)
        for c0 in range(0, n, chunk):
            m[c0:c0 + chunk] = scaled(c0, min(n, c0 + chunk)).amax(-1)
        m = _all_reduce(m, dist.ReduceOp.MAX, group)
        stats = torch.zeros(3, n, dtype=acc, device=logits.device)  # sum exp, sum exp * x, target logit
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            x = scaled(c0, c1)
            e = (x - m[c0:c1, None]).exp_()
            stats[0, c0:c1] = e.sum(-1)
            stats[1, c0:c1] = (e * x.nan_to_num(neginf=0.0)).sum(-1)
            picked = x.gather(1, local_target[c0:c1, None])[:, 0]
            stats[2, c0:c1] = torch.where(owned[c0:c1], picked, torch.zeros_like(picked))
            del x, e
        stats = _all_reduce(stats, dist.ReduceOp.SUM, group)
        lse = m + stats[0].log()
        mean_x = stats[1] / stats[0]
        logprob = stats[2] - lse
        entropy = lse - mean_x
        ctx.save_for_backward(logits, target, lse, mean_x)
        ctx.temperature, ctx.group, ctx.valid_cols, ctx.chunk = temperature, group, valid_cols, chunk
        ctx.mark_non_differentiable(target)
        return logprob, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprob, g_entropy):
        logits, target, lse, mean_x = ctx.saved_tensors
        temperature, group, valid_cols, chunk = ctx.temperature, ctx.group, ctx.valid_cols, ctx.chunk
        n, v_local = logits.shape
        start, _ = vocab_range(v_local, group)
        local_target = target - start
        owned = (local_target >= 0) & (local_target < v_local)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        grad = torch.empty_like(logits)
        acc = _acc_dtype(logits.dtype)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            x = logits[c0:c1].to(acc)
            if temperature != 1.0:
                x = x / temperature
            if valid_cols is not None:
                x[:, valid_cols:] = float("-inf")
            p = (x - lse[c0:c1, None]).exp_()  # 0 on excluded columns
            dx = torch.zeros_like(x)
            if g_entropy is not None:
                centred = (x - mean_x[c0:c1, None]).nan_to_num_(neginf=0.0)
                dx.addcmul_(p * centred, -g_entropy[c0:c1, None].to(acc))
            if g_logprob is not None:
                g = g_logprob[c0:c1].to(acc)
                dx.addcmul_(p, -g[:, None])
                rows = torch.arange(c1 - c0, device=x.device)[owned[c0:c1]]
                dx[rows, local_target[c0:c1][owned[c0:c1]]] += g[owned[c0:c1]]
            if temperature != 1.0:
                dx /= temperature
            grad[c0:c1] = dx.to(grad.dtype)
            del x, p, dx
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    vocab_size: int | None = None,
    chunk: int = CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprob, entropy)``, both fp32 ``[N]``, of ``target`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary slice (any float dtype; the math is fp32). Differentiable.
        target: int ``[N]`` global token ids (any value is allowed where the caller masks the result).
        temperature: divides the logits (the sampler's temperature).
        group: the tensor-parallel group the vocabulary is split over (None: the whole vocabulary is local).
        vocab_size: the real vocabulary size when the output layer is padded (Megatron-LM's
            ``--make-vocab-size-divisible-by``); columns past it take no part in the softmax.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [N, V_local] and target [N], got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    return _VocabParallelLogProbs.apply(logits, target.long(), float(temperature), group, vocab_size, chunk)
