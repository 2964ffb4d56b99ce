"""Add a grouped weight gradient into each group's fp32 ``main_grad`` in one launch (Triton).

Why: with gradient-accumulation fusion megatron-core's linear layers add their weight gradient to ``main_grad``
themselves. ``torch.nn.functional.grouped_mm`` cannot accumulate into its output. So the routed experts' bf16
``[E, N, K]`` gradient went back to megatron-core's DDP hook as ``E`` separate gradients, and each was added with its
own ``add_``: 16 per grouped GEMM, 192 of the 258 adds of the GLM-5 slice's step (3 MoE layers, 2 weights, 2
micro-batches), which took 15.1 ms together (issue 23, round 3). And before that, a second pass zeroed the empty
experts' slices (``grouped_mm`` leaves them unwritten).

Here one program per (group, block) adds one block of ``dw[e]`` into ``main_grads[e]``. It finds ``main_grads[e]``
through a device table of pointers, so the gradients may lie anywhere in DDP's buffer, in any order. An empty group's
programs return after reading one byte: that replaces the zero-groups pass as well.

Contract (:func:`accumulate_groups`): ``dw [E, ...]`` contiguous (bf16, fp16 or fp32); ``main_grads``: ``E`` fp32
tensors on ``dw``'s device, each contiguous with ``dw[e]``'s shape; ``empty``: bool ``[E]`` on the device.
``main_grads[e] += dw[e]`` (in fp32) where ``not empty[e]``, in place. Oracle: :func:`accumulate_groups_reference`
(torch's ``add_`` per non-empty group, what DDP's hook did; the kernel is bitwise equal to it). The oracle runs
wherever the kernel does not take the tensors.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from megatron_glm5.kernels._common import cdiv, triton_kernels, triton_runs_on

BLOCK = 4096
_MAX_BLOCKS = 65535  # the grid's second dimension
_TABLES: dict[tuple, torch.Tensor] = {}  # (device, pointers) -> int64 device table: DDP's buffers do not move
_MAX_TABLES = 256
_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()


def accumulate_groups_reference(dw: torch.Tensor, main_grads: Sequence[torch.Tensor], empty) -> None:
    """The oracle: ``main_grads[e].add_(dw[e])`` for each group not in ``empty`` (a bool ``[E]`` tensor or a
    collection of group indices). A device mask stays on the device (an empty group adds a masked zero; no sync)."""
    if isinstance(empty, torch.Tensor):
        for e, main in enumerate(main_grads):
            main.add_(dw[e].masked_fill(empty[e], 0))
        return
    skip = set(empty)
    for e, main in enumerate(main_grads):
        if e not in skip:
            main.add_(dw[e])


def accumulate_groups_supported(dw: torch.Tensor, main_grads: Sequence[torch.Tensor], empty: torch.Tensor) -> bool:
    per_group = dw[0].numel() if dw.shape[0] else 0
    return (dw.dim() >= 2 and dw.is_contiguous() and len(main_grads) == dw.shape[0]
            and dw.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(m.dtype == torch.float32 and m.device == dw.device and m.shape == dw.shape[1:]
                    and m.is_contiguous() for m in main_grads)
            and isinstance(empty, torch.Tensor) and empty.dtype == torch.bool and empty.shape == (dw.shape[0],)
            and empty.device == dw.device and triton_runs_on(dw) and 0 < cdiv(per_group, BLOCK) <= _MAX_BLOCKS
            and _triton() is not None)


def _pointer_table(main_grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    key = (str(device), tuple(m.data_ptr() for m in main_grads))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(key[1], dtype=torch.int64, device=device)
    return table


def accumulate_groups(dw: torch.Tensor, main_grads: Sequence[torch.Tensor], empty) -> None:
    """``main_grads[e] += dw[e]`` for the non-empty groups (module docstring): the kernel where it takes the tensors,
    else the oracle."""
    if not accumulate_groups_supported(dw, main_grads, empty):
        if dw.is_cuda and "fallback" not in _logged:
            _logged.add("fallback")
            _log.info("megatron-glm5: grouped weight-gradient accumulation runs one add per expert (the Triton kernel "
                      "does not take %s %s into %d main_grads; non-contiguous or non-fp32 main_grad, or no Triton)",
                      tuple(dw.shape), dw.dtype, len(main_grads))
        accumulate_groups_reference(dw, main_grads, empty)
        return
    per_group = dw[0].numel()
    _triton()[(dw.shape[0], cdiv(per_group, BLOCK))](dw, _pointer_table(main_grads, dw.device),
                                                     empty.contiguous().view(torch.uint8), per_group, BLOCK=BLOCK,
                                                     num_warps=8)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def accumulate_groups_kernel(DW, MAINS, EMPTY, per_group, BLOCK: tl.constexpr):
        group = tl.program_id(0)
        if tl.load(EMPTY + group) == 0:
            offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < per_group
            main = tl.load(MAINS + group).to(tl.pointer_type(tl.float32))
            g = tl.load(DW + group.to(tl.int64) * per_group + offs, mask=mask, other=0.0)
            acc = tl.load(main + offs, mask=mask, other=0.0)
            tl.store(main + offs, acc + g.to(tl.float32), mask=mask)

    return accumulate_groups_kernel
