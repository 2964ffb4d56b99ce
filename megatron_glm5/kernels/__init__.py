"""TileLang kernels for DSA training: sparse absorbed-MLA forward/backward and the lightning indexer + top-k.

All kernels use the flattened-token layout of ``megatron_glm5.dsa.reference`` (every token of a micro-batch in one
axis of ``T`` rows, indices are global rows) and that module is their test oracle. TileLang is imported on first
use, so importing this package works without it; the kernels need a CUDA device (SM90).

Public API:

* ``sparse_mla(q, kv, indices, softmax_scale, d_v=512, *, deterministic=False) -> out``
* ``sparse_mla_with_lse(q, kv, indices, softmax_scale, d_v=512, *, deterministic=False) -> (out, lse)``
* ``indexer_topk(q, k, weights, starts, ends, topk) -> int32 [T, topk]``

GLM-5's softmax scale is 1/16 (``qk_head_dim ** -0.5`` with 192 + 64): always pass it explicitly.
"""

import torch

from megatron_glm5.kernels.indexer_topk import indexer_topk_interface
from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_autograd

__all__ = ["indexer_topk", "sparse_mla", "sparse_mla_with_lse"]


def sparse_mla_with_lse(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed-MLA attention, differentiable in ``q`` and ``kv`` (and through ``lse``).

    Args:
        q: ``[T, H, D]`` bf16 (GLM-5: D = 576 = 512 latent + 64 rope), H per rank in [1, 128].
        kv: ``[T_kv, D]`` bf16 latent keys; the first ``d_v`` channels are the values.
        indices: int32 ``[T, K]`` global rows of ``kv``; -1 marks an unused slot (never read).
        softmax_scale: multiplies ``q . k`` (GLM-5: 1/16).
        deterministic: bitwise reproducible backward (no float atomics), at a documented cost.
    Returns: ``out [T, H, d_v]`` bf16 and natural-log ``lse [T, H]`` fp32 (+inf, out 0 on rows without an index).
    """
    return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, deterministic=deterministic)


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """``sparse_mla_with_lse(...)[0]``."""
    return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, deterministic=deterministic)[0]


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Lightning indexer + exact top-k: int32 ``[T, topk]``, sorted by score desc, ties to the lower index, -1 tail.

    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` (fp32) over ``starts[t] <= s < ends[t]``.
    Shapes: q ``[T, Hi, Di]`` bf16, k ``[T_kv, Di]`` bf16, weights ``[T, Hi]`` (fp32; other float dtypes are
    converted), starts/ends ``[T]`` (int32; other integer dtypes are converted).
    """
    weights = weights.to(torch.float32).contiguous()
    starts = starts.to(torch.int32).contiguous()
    ends = ends.to(torch.int32).contiguous()
    return indexer_topk_interface(q, k, weights, starts, ends, topk)
