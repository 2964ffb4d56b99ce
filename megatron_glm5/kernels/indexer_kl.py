"""The sparse indexer loss's per-row KL step in one Triton kernel: from the index scores over each row's selected
slots and the normalised target, the row's weighted KL term and the score gradient, in one read of each.

Why: between the index-score and index-backward kernels (:mod:`megatron_glm5.kernels.indexer_loss`) the torch glue
(``kl_loss_and_dscore_``) made about fifteen passes over ``[T, K]`` fp32 tensors (2.0 ms of a 16K x 2048 loss whose
kernels take 12.9 ms). Here one program per row reads its scores, top-k and target once and writes ``dscore`` over
the scores and one fp32 value.

Contract (:func:`kl_rows_and_dscore_`): ``score [T, K]`` fp32 (any value on invalid slots), ``target [T, K]`` fp32
(normalised; 0 on invalid slots), ``topk [T, K]`` int32 (a slot is valid iff ``0 <= idx < n_keys``), ``rw [T]`` fp32,
all contiguous on one CUDA device (or CPU under ``TRITON_INTERPRET=1``). Per row over the valid slots:
``lse = logsumexp(score)`` (0 for a row without a valid slot), ``log_pred = score - lse``,
``kl = sum p (log max(p, 1e-10) - log_pred)``, then ``score <- rw * (exp(log_pred) * sum(p) - p)`` (0 on invalid
slots) and ``out[t] = rw * kl``. Returns ``out [T]``; its sum is the loss. Oracle: ``indexer_loss.kl_loss_and_dscore_``
(the torch glue; same expressions, summation orders differ).
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import triton_kernels, triton_runs_on

TARGET_EPS = 1e-10  # megatron-core's INDEXER_LOSS_EPS
MAX_K = 16384  # one row per program in registers


def kl_supported(score: torch.Tensor) -> bool:
    """Whether :func:`kl_rows_and_dscore_` takes this score buffer (else use the torch glue)."""
    return (score.ndim == 2 and score.shape[1] <= MAX_K and score.dtype == torch.float32
            and triton_runs_on(score) and _kernel() is not None)


def kl_rows_and_dscore_(score: torch.Tensor, target: torch.Tensor, rw: torch.Tensor, topk: torch.Tensor,
                        n_keys: int) -> torch.Tensor:
    """The per-row weighted KL terms ``[T]`` fp32; ``score`` is overwritten by ``dscore`` (module docstring)."""
    t_len, width = score.shape
    for name, t, dtype in (("target", target, torch.float32), ("topk", topk, torch.int32)):
        if t.shape != score.shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor shaped like score {tuple(score.shape)}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if rw.shape != (t_len,) or rw.dtype != torch.float32 or not score.is_contiguous():
        raise ValueError(f"rw must be fp32 [T={t_len}] and score contiguous; got rw {rw.dtype} {tuple(rw.shape)}")
    out = torch.empty(t_len, dtype=torch.float32, device=score.device)
    if t_len:
        block = max(16, 1 << (width - 1).bit_length())
        _kernel()[(t_len,)](score, target, topk, rw.contiguous(), out, width, n_keys, TARGET_EPS, BLOCK=block,
                            num_warps=min(16, max(1, block // 256)))
    return out


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kl_rows(S, P, IDX, RW, OUT, K, n_keys, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < K
        idx = tl.load(IDX + row * K + cols, mask=inside, other=-1)
        valid = inside & (idx >= 0) & (idx < n_keys)
        s = tl.load(S + row * K + cols, mask=inside, other=0.0)
        s = tl.where(valid, s, float("-inf"))
        p = tl.where(valid, tl.load(P + row * K + cols, mask=inside, other=0.0), 0.0)
        mx = tl.max(s, axis=0)
        any_valid = mx > float("-inf")
        mx = tl.where(any_valid, mx, 0.0)
        den = tl.sum(tl.where(valid, tl.exp(s - mx), 0.0), axis=0)
        lse = tl.where(any_valid, mx + tl.log(den), 0.0)
        log_pred = tl.where(valid, s - lse, 0.0)
        kl = tl.sum(tl.where(valid, p * (tl.log(tl.maximum(p, eps)) - log_pred), 0.0), axis=0)
        r = tl.load(RW + row)
        pred = tl.where(valid, tl.exp(log_pred), 0.0)
        ds = tl.where(valid, r * (pred * tl.sum(p, axis=0) - p), 0.0)
        tl.store(S + row * K + cols, ds, mask=inside)
        tl.store(OUT + row, r * kl)

    return kl_rows
