"""Dense attention masks -> the per-row key ranges DSA attends within.

DSA attention selects keys from a causal range per query row (``[starts, ends)`` in the flattened-token layout of
:mod:`megatron_glm5.dsa.reference`). A dense mask is honoured when each of its rows allows one contiguous, causal
range of keys, which covers what callers pass in practice:

* the plain causal mask Megatron-LM's ``pretrain_gpt.py`` builds by default (``[b, 1, s, s]``);
* block-diagonal causal masks (``--reset-attention-mask``: one range per document);
* HF-style padding masks, left or right (a padded query row may allow nothing: its output is 0).

Anything else (a row allowing a future key, or two separate runs of keys) is refused by a device-side check.

Conventions: a ``bool`` mask is True where attention is *blocked* (megatron-core's convention); a floating mask is
additive (blocked where negative, e.g. ``-inf``, as HF builds them). Shape ``[B, 1, s, s]`` or ``[B, s, s]`` with
``B`` the batch or 1 (broadcast).

Cost: one pass over the mask (:mod:`megatron_glm5.kernels.mask_ranges`: one Triton kernel on the GPU, or torch in
row chunks with ``MEGATRON_GLM5_MASK_RANGES_KERNEL=0`` and where the kernel does not take the mask), per distinct
mask: every layer of a forward (and the recompute of its checkpoints, which see detached views of the same storage)
reuses the ranges of the first layer (:func:`key_ranges` memoises by storage, shape and in-place version).
"""

from __future__ import annotations

import weakref

import torch

from .. import fusions
from ..device_check import check_on_device
from ..kernels.mask_ranges import mask_ranges, mask_ranges_reference

_MEMO_SIZE = 8
_memo: dict[tuple, tuple[weakref.ref, int, tuple[torch.Tensor, torch.Tensor]]] = {}


def _ranges(mask: torch.Tensor, seqlen: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    if mask.ndim == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"attention_mask must be [b, 1, s, s] (one mask for all heads), got {tuple(mask.shape)}")
        mask = mask[:, 0]
    if mask.ndim != 3 or mask.shape[1:] != (seqlen, seqlen) or mask.shape[0] not in (1, batch):
        raise ValueError(
            f"attention_mask must be [b, 1, s, s] or [b, s, s] with b in (1, {batch}) and s = {seqlen} (the full "
            f"sequence), got {tuple(mask.shape)}"
        )
    # the Triton kernel (one pass) where enabled and it takes the mask, else the torch passes it is checked against
    ranges = mask_ranges if fusions.enabled(fusions.MASK_RANGES_KERNEL_ENV) else mask_ranges_reference
    starts, ends, ok = ranges(mask)
    check_on_device(
        ok,
        "attention_mask: every row must allow one contiguous range of keys at or before the query (causal, "
        "document or padding masks); give other patterns as THD packing",
    )
    return starts, ends


def key_ranges(mask: torch.Tensor, seqlen: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)`` int32 ``[batch * seqlen]``: each query row's allowed keys as global rows of the flattened
    (batch-major) layout; a row that allows nothing gets the empty range ``[t, t)``."""
    key = (mask.untyped_storage().data_ptr(), mask.storage_offset(), tuple(mask.shape), tuple(mask.stride()),
           mask.dtype, mask.device, seqlen, batch)
    hit = _memo.get(key)
    if hit is not None and hit[0]() is not None and hit[1] == mask._version:
        return hit[2]
    starts, ends = _ranges(mask, seqlen, batch)
    base = torch.arange(batch, device=mask.device)[:, None] * seqlen
    starts = (starts.expand(batch, seqlen) + base).reshape(-1).to(torch.int32)
    ends = (ends.expand(batch, seqlen) + base).reshape(-1).to(torch.int32)
    ranges = (starts, ends)
    if len(_memo) >= _MEMO_SIZE:
        _memo.pop(next(iter(_memo)))
    _memo[key] = (weakref.ref(mask), mask._version, ranges)
    return ranges
