"""Scale gradients in place by a clip coefficient read on the device, writing nothing when it is not below one
(Triton).

Why: without apex / TE megatron-core reads the gradient norm on the host (``.item()``) before it clips, so the GPU
idles from the norm's end until the host has computed the coefficient, walked the parameters and queued the
optimizer step. Left on the device (megatron-core's tensor branch), the clip becomes one multiplication of every
gradient by the clamped coefficient: a read and a write of all of them (2.8 G fp32 gradients, about 5.5 ms per step
of the GLM-5 slice on an H200), although almost every step's norm is below the clip. Here every program reads the
coefficient first, and where it is not below one, reads and writes nothing.

Contract (:func:`scale_below_one`): ``tensors``: fp32 tensors on one CUDA device, each contiguous (DDP's gradient
buffers); ``coef``: a one-element floating tensor there. With ``c`` the coefficient rounded to fp32: where
``c < 1``, each tensor is multiplied by ``c`` in place (fp32 products, as torch's ``mul``); where ``c >= 1`` or NaN,
nothing is written. Oracle: :func:`scale_below_one_reference` (torch's foreach multiply by ``c`` where ``c < 1``,
else by 1, which changes no value). The oracle runs wherever the kernel does not take the tensors.

Tested: with :func:`megatron_glm5.optim_fusions.grad_norm_on_device`, the clipped gradients are bitwise those of
megatron-core's host path (``tests/test_optimizer_phase.py``, ``tests/gpu/test_optimizer_phase_gpu.py``) at
``max_norm=1.0`` only; other clip values take the same code but were not compared.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from megatron_glm5.kernels._common import triton_kernels, triton_runs_on

BLOCK = 16384  # elements per program
_TABLES: dict[tuple, torch.Tensor] = {}  # (device, (pointer, numel) per tensor) -> [programs, 2] int64 device table
_MAX_TABLES = 16
_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()


def _coef32(coef: torch.Tensor) -> torch.Tensor:
    return coef.detach().reshape(()).to(torch.float32)


def scale_below_one_reference(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """The oracle: every tensor times ``c`` (``coef`` in fp32) where ``c < 1``, else times 1; no host sync."""
    tensors = list(tensors)
    if not tensors:
        return
    c = _coef32(coef)
    torch._foreach_mul_(tensors, torch.where(c < 1.0, c, torch.ones_like(c)))


def scale_below_one_supported(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> bool:
    if not tensors or not isinstance(coef, torch.Tensor) or coef.numel() != 1 or not coef.is_floating_point():
        return False
    device = tensors[0].device
    return (coef.device == device and triton_runs_on(tensors[0]) and _triton() is not None
            and all(t.dtype == torch.float32 and t.device == device and t.is_contiguous() for t in tensors))


def _chunk_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One row per program: (address of its first element, element count). Cached per list of (pointer, size):
    DDP's gradient buffers do not move."""
    key = (str(device), tuple((t.data_ptr(), t.numel()) for t in tensors))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        ptrs = torch.tensor([p for p, _ in key[1]], dtype=torch.int64)
        sizes = torch.tensor([n for _, n in key[1]], dtype=torch.int64)
        per = (sizes + BLOCK - 1) // BLOCK
        which = torch.repeat_interleave(torch.arange(len(sizes)), per)
        first = torch.repeat_interleave(per.cumsum(0) - per, per)
        chunk = torch.arange(int(per.sum())) - first
        start = chunk * BLOCK
        rows = torch.stack((ptrs[which] + 4 * start, torch.clamp(sizes[which] - start, max=BLOCK)), dim=1)
        if device.type == "cuda":  # from pinned memory: no host sync, even on the first call
            rows = rows.pin_memory()
        table = _TABLES[key] = rows.to(device, non_blocking=True)
    return table


def scale_below_one(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Each tensor times ``coef`` (in fp32) in place where that is below one, else untouched (module docstring): the
    kernel where it takes the tensors, else the oracle."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    if not scale_below_one_supported(tensors, coef):
        if "fallback" not in _logged:
            _logged.add("fallback")
            _log.info("megatron-glm5: the gradient clip scales with torch's foreach multiply (the Triton kernel takes "
                      "contiguous fp32 CUDA tensors and a one-element coefficient on their device)")
        scale_below_one_reference(tensors, coef)
        return
    table = _chunk_table(tensors, tensors[0].device)
    _triton()[(table.shape[0],)](table, coef.detach().reshape(1), BLOCK=BLOCK, num_warps=8)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_below_one_kernel(TABLE, COEF, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.load(COEF).to(tl.float32)
        if c < 1.0:  # false for NaN as well: nothing is read or written
            base = tl.load(TABLE + 2 * row).to(tl.pointer_type(tl.float32))
            n = tl.load(TABLE + 2 * row + 1)
            offs = tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(base + offs, mask=mask)
            tl.store(base + offs, x * c, mask=mask)

    return scale_below_one_kernel


__all__ = ["BLOCK", "scale_below_one", "scale_below_one_reference", "scale_below_one_supported"]
