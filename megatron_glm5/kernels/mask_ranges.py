"""Each query row's allowed key range of a dense attention mask, in one pass over the mask (Triton).

Why: :mod:`megatron_glm5.dsa.masks` turns the dense mask Megatron-LM's ``pretrain_gpt.py`` builds (causal,
document or padding) into per-row ``[start, end)`` key ranges. In torch that is about 25 kernels over the mask per
micro-batch (sum, two argmaxes over a flipped copy, the checks): 50 kernels and 2.35 ms per step of the GLM-5 slice at
8K tokens (issue 23, round 7's profile). Here one program per (row, batch) scans its row once.

Contract (:func:`mask_ranges`): ``mask`` ``[B, s, s]``, ``bool`` (True = blocked) or floating (additive: blocked
where negative), any strides. Returns ``(starts, ends, ok)``: int64 ``[B, s]`` (a row that allows nothing gets
``[t, t)``), and a 0-dim bool that is False when some row allows more than one contiguous run of keys or a key after
the query. Oracle: :func:`mask_ranges_reference` (torch, in row chunks), which runs where the kernel does not take
the mask; the two are equal element for element.

Switch: ``MEGATRON_GLM5_MASK_RANGES_KERNEL`` (on; GPU test ``tests/gpu/test_mask_ranges_gpu.py``: 56 vs 1148 us at
8K tokens on the H200).
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import triton_kernels, triton_runs_on

BLOCK = 1024  # mask columns per step of a row's scan
ROW_CHUNK = 1024  # the reference: at least this many query rows per pass over the mask
CHUNK_ELEMENTS = 1 << 26  # the reference: at most this many mask elements per pass (more rows when s is short)
_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)
_MAX_GRID_Y = 65535


def _blocked(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask < 0


def mask_ranges_reference(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle (module docstring), in passes of rows (about 20 kernels each; one pass up to 8K tokens)."""
    batch, seqlen = mask.shape[0], mask.shape[-1]
    rows = torch.arange(seqlen, device=mask.device)
    starts = torch.empty(batch, seqlen, dtype=torch.int64, device=mask.device)
    ends = torch.empty_like(starts)
    ok = torch.ones((), dtype=torch.bool, device=mask.device)
    chunk = max(ROW_CHUNK, CHUNK_ELEMENTS // max(1, batch * seqlen))
    for r0 in range(0, seqlen, chunk):
        r1 = min(seqlen, r0 + chunk)
        allowed = ~_blocked(mask[:, r0:r1])  # [B, c, s]
        count = allowed.sum(-1)  # [B, c]
        first = allowed.to(torch.uint8).argmax(-1)
        last = seqlen - 1 - allowed.flip(-1).to(torch.uint8).argmax(-1)
        t = rows[r0:r1]
        empty = count == 0
        ok &= (empty | ((last - first + 1 == count) & (last <= t))).all()
        starts[:, r0:r1] = torch.where(empty, t, first)
        ends[:, r0:r1] = torch.where(empty, t, last + 1)
    return starts, ends, ok


def mask_ranges_supported(mask: torch.Tensor) -> bool:
    return (mask.dim() == 3 and mask.shape[1] == mask.shape[2] and mask.dtype in _DTYPES and mask.numel() > 0
            and mask.shape[0] <= _MAX_GRID_Y and triton_runs_on(mask) and _triton() is not None)


def mask_ranges(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts, ends, ok)`` of ``mask`` (module docstring): the kernel where it takes the mask, else the oracle."""
    if not mask_ranges_supported(mask):
        return mask_ranges_reference(mask)
    batch, seqlen = mask.shape[0], mask.shape[-1]
    starts = torch.empty(batch, seqlen, dtype=torch.int64, device=mask.device)
    ends = torch.empty_like(starts)
    bad = torch.zeros(batch, seqlen, dtype=torch.uint8, device=mask.device)
    data = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    _triton()[(seqlen, batch)](data, starts, ends, bad, seqlen, *mask.stride(),
                               IS_FLOAT=mask.dtype != torch.bool, BLOCK=min(BLOCK, 1 << (seqlen - 1).bit_length()))
    return starts, ends, ~bad.bool().any()


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def mask_ranges_kernel(MASK, STARTS, ENDS, BAD, S, stride_b, stride_r, stride_c,
                           IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        b = tl.program_id(1)
        row = MASK + b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_r
        count = tl.zeros([BLOCK], dtype=tl.int32)
        first = tl.full([BLOCK], S, dtype=tl.int32)
        last = tl.full([BLOCK], -1, dtype=tl.int32)
        for c0 in range(0, S, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            inside = cols < S
            v = tl.load(row + cols.to(tl.int64) * stride_c, mask=inside, other=1)
            if IS_FLOAT:
                blocked = v.to(tl.float32) < 0  # additive: blocked where negative (NaN is not, as in torch)
            else:
                blocked = v != 0  # bool viewed as bytes: True (1) is blocked
            allowed = (blocked == 0) & inside
            count += allowed.to(tl.int32)
            first = tl.minimum(first, tl.where(allowed, cols, S))
            last = tl.maximum(last, tl.where(allowed, cols, -1))
        n = tl.sum(count, axis=0)
        lo = tl.min(first, axis=0)
        hi = tl.max(last, axis=0)
        empty = n == 0
        good = empty | ((hi - lo + 1 == n) & (hi <= t))
        out = b.to(tl.int64) * S + t
        tl.store(STARTS + out, tl.where(empty, t, lo).to(tl.int64))
        tl.store(ENDS + out, tl.where(empty, t, hi + 1).to(tl.int64))
        tl.store(BAD + out, tl.where(good, 0, 1).to(tl.uint8))

    return mask_ranges_kernel


__all__ = ["BLOCK", "mask_ranges", "mask_ranges_reference", "mask_ranges_supported"]
