"""MoE token permutation without scatter-adds: the sum side of permute / unpermute as a gather (Triton).

Why: megatron-core's un-fused permutation (``moe_utils.permute`` / ``unpermute``, what its all-gather dispatcher runs
without Transformer Engine) gathers tokens into expert order with ``index_select`` and sums them back with
``scatter_add_``; the permute's backward is ``index_add_``. Both sums are atomic adds in the tokens' dtype (bf16):
19.5 ms of ``index_add`` and 9.2 ms of ``scatter_add`` per step of the GLM-5 slice (issue 23's profile), rounding at
every add, in an order that changes from run to run. Here each token's rows are summed by one program in fp32 and
rounded once: deterministic, and one read of the permuted rows.

Layout (megatron-core's): the permuted rows are grouped by expert, tokens ascending within an expert. For a
``routing_map [T, E]`` (bool), :func:`expert_rows` gives each (token, expert) pair's row in that order (int32
``[T, E]``, -1 where the token does not go to the expert), and :func:`sorted_token_indices` megatron-core's
``sorted_indices`` (the token of each row).

Contract (CUDA, or Triton's interpreter; any float dtype; ``H`` = hidden, last dim contiguous):

* :func:`gather_sum` ``(src [N, H], rows [T, E]) -> [T, H]``: ``out[t] = sum_e src[rows[t, e]]`` over ``rows >= 0``, in
  fp32, one rounding to ``src``'s dtype; zero rows for tokens with no row.
* :func:`permute_tokens` ``(tokens [T, H], sorted_indices [N], rows) -> [N, H]``: ``tokens[sorted_indices]``;
  backward :func:`gather_sum` of the gradient.
* :func:`unpermute_tokens` ``(permuted [N, H], sorted_indices, rows) -> [T, H]``: :func:`gather_sum`; backward
  ``grad[sorted_indices]``.

Oracle: :func:`gather_sum_reference` (torch, fp32, one rounding). megatron-core's own functions give the same values up
to their bf16 rounding of every partial sum.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import next_power_of_2, triton_kernels, triton_runs_on

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def expert_rows(routing_map: torch.Tensor) -> torch.Tensor:
    """int32 ``[T, E]``: the permuted row of each (token, expert) pair of ``routing_map`` (megatron-core's order:
    expert-major, tokens ascending), -1 where the token does not go to the expert. No host sync."""
    m = routing_map.bool()
    # Scanned expert-major ([E, T], tokens along the contiguous dim): torch's scan over the outer dim of [T, E] ran
    # 1.3 ms per call at 8192 x 16 on the H200 (15 ms per step of the GLM-5 slice).
    ones = m.t().contiguous().to(torch.int32)  # [E, T]
    counts = ones.sum(1, dtype=torch.int32)
    first_row = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # [E]
    rank = torch.cumsum(ones, 1, dtype=torch.int32) - ones  # [E, T]: earlier tokens of the same expert
    return torch.where(m.t(), rank + first_row[:, None], -1).t().contiguous()


def sorted_token_indices(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 ``[num_rows]``: the token of each permuted row (megatron-core's ``sorted_indices``). No host sync: pairs
    without a row (or past ``num_rows``) are written to a spare slot that is dropped."""
    tokens, experts = rows.shape
    slot = torch.where((rows >= 0) & (rows < num_rows), rows.long(), torch.full_like(rows, num_rows, dtype=torch.long))
    token = torch.arange(tokens, device=rows.device).unsqueeze(1).expand(tokens, experts)
    out = torch.empty(num_rows + 1, dtype=torch.long, device=rows.device)
    return out.scatter_(0, slot.reshape(-1), token.reshape(-1))[:num_rows]


def gather_sum_reference(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The oracle of :func:`gather_sum`: fp32 sum over each token's rows, one rounding."""
    wide = src.to(torch.promote_types(src.dtype, torch.float32))
    if src.shape[0] == 0:  # no rows at all (every token routed elsewhere)
        return src.new_zeros(rows.shape[0], src.shape[1])
    picked = wide[rows.clamp(min=0).long()] * (rows >= 0).unsqueeze(-1)  # [T, E, H]
    return picked.sum(1).to(src.dtype)


def moe_permute_supported(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t`` (``[rows, H]``, a float dtype, last dim contiguous, where Triton runs)."""
    return t.dim() == 2 and t.dtype in _DTYPES and t.stride(-1) == 1 and triton_runs_on(t) and _triton() is not None


def gather_sum(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_e src[rows[t, e]]`` (module docstring); no autograd."""
    kernel = _triton()
    tokens, experts = rows.shape
    hidden = src.shape[1]
    out = torch.empty((tokens, hidden), dtype=src.dtype, device=src.device)
    rows = rows.to(torch.int32).contiguous()
    block = min(2048, max(16, next_power_of_2(hidden)))
    if tokens and hidden:
        kernel[(tokens, -(-hidden // block))](src, rows, out, src.stride(0), out.stride(0), hidden, experts,
                                              BLOCK=block, num_warps=min(8, max(1, block // 256)))
    return out


def permute_tokens(tokens: torch.Tensor, sorted_indices: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``tokens[sorted_indices]`` with a gather-sum backward (module docstring)."""
    return _Permute.apply(tokens, sorted_indices, rows)


def unpermute_tokens(permuted: torch.Tensor, sorted_indices: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each token's rows summed (fp32, one rounding), with a gather backward (module docstring)."""
    return _Unpermute.apply(permuted, sorted_indices, rows)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum_kernel(SRC, ROWS, OUT, stride_src, stride_out, hidden, experts, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for e in range(0, experts):
            row = tl.load(ROWS + token * experts + e).to(tl.int64)
            safe = tl.maximum(row, 0)
            acc += tl.load(SRC + safe * stride_src + cols, mask=in_row & (row >= 0), other=0.0).to(tl.float32)
        tl.store(OUT + token * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=in_row)

    return gather_sum_kernel


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, sorted_indices: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return gather_sum(grad, rows), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted: torch.Tensor, sorted_indices: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        return gather_sum(permuted, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None
