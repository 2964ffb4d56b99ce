"""Fused SwiGLU (Triton), forward and backward, plain and weighted by a per-row scale (the MoE experts' routing
probabilities), with the numerics megatron-core's ``fused_bias_swiglu`` has when its ``jit_fuser`` compiles it:
every operation in fp32, one rounding to the output dtype.

Why: without Transformer Engine, and with ``torch.compile`` off (``TORCHDYNAMO_DISABLE=1``, or a machine where
inductor cannot build), megatron-core's ``swiglu`` / ``swiglu_back`` / ``weighted_swiglu`` / ``weighted_swiglu_back``
run eagerly: the backward alone launched about 2.4 kernels per expert-row block of work, 1,600 kernels and 47 ms per
step of the GLM-5 slice, and the whole SwiGLU 63 ms (issue 23's profile, ``scripts/bench/RESULTS_step.md``). Here
each direction is one kernel that reads ``y`` (and the gradient) once.

Contract, on ``y [R, 2F]`` (last dim contiguous; gate ``a = y[:, :F]``, linear ``b = y[:, F:]``), bf16 / fp16 /
fp32, on CUDA (or under Triton's interpreter):

* :func:`swiglu`: ``out = silu(a) * b``, ``[R, F]`` in ``y``'s dtype; backward ``da = g sig(a) (1 + a (1 - sig(a)))
  b``, ``db = g silu(a)``, cast to ``y``'s dtype.
* :func:`weighted_swiglu` with ``w [R, 1]`` (any float dtype): ``out = silu(a) * b * w``, cast to ``y``'s dtype;
  backward as above with ``g w`` for ``g``, and ``dw = sum_j silu(a) b g`` accumulated in fp32 in one program per
  row (deterministic), cast to ``w``'s dtype.

Oracle: :func:`swiglu_reference` / :func:`weighted_swiglu_reference`, megatron-core's expressions on fp32 copies of
the inputs, rounded once (autograd gives the gradients). The kernels agree with them up to the last bit of fp32
``exp``; in bf16 that is rare one-ulp flips. megatron-core's eager path rounds ``silu(a)`` to the dtype before the
product; a compiled one does not, and neither does this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_glm5.kernels._common import next_power_of_2, triton_kernels, triton_runs_on

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` in fp32, one rounding (autograd)."""
    a, b = torch.chunk(y.float(), 2, -1)
    return (F.silu(a) * b).to(y.dtype)


def weighted_swiglu_reference(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b * w`` in fp32, one rounding (autograd; ``w``'s gradient comes back in ``w``'s dtype)."""
    a, b = torch.chunk(y.float(), 2, -1)
    return (F.silu(a) * b * w.float()).to(y.dtype)


def swiglu_supported(y: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    """Whether :func:`swiglu` / :func:`weighted_swiglu` take these tensors (else use the references)."""
    ok = (y.dim() == 2 and y.dtype in _DTYPES and y.shape[-1] % 2 == 0 and y.stride(-1) == 1 and triton_runs_on(y)
          and _triton() is not None)
    if w is not None:
        ok = ok and w.dtype in _DTYPES and w.shape == (y.shape[0], 1) and w.device == y.device
    return ok


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU (module docstring); ``swiglu_supported(y)`` must hold."""
    return _SwiGLU.apply(y)


def weighted_swiglu(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU scaled per row by ``w [R, 1]`` (module docstring); ``swiglu_supported(y, w)`` must hold."""
    return _WeightedSwiGLU.apply(y, w)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(Y, Wt, OUT, stride_y, stride_o, n, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        a = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(Y + row * stride_y + n + cols, mask=mask, other=0.0).to(tl.float32)
        out = a * tl.sigmoid(a) * b
        if HAS_W:
            out = out * tl.load(Wt + row).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def bwd(Y, G, Wt, DY, DW, stride_y, stride_g, stride_dy, n, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        # HAS_W: one program per row, looping over its column blocks (the row sum of dw stays in the program);
        # else one program per (row, column block)
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * BLOCK
        last = first + BLOCK
        scale = 1.0
        if HAS_W:
            first = 0
            last = n
            scale = tl.load(Wt + row).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(first, last, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n
            a = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(Y + row * stride_y + n + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(a)
            silu = a * sig
            if HAS_W:
                acc += silu * b * g
            gs = g * scale
            da = gs * sig * (1.0 + a * (1.0 - sig)) * b
            db = gs * silu
            tl.store(DY + row * stride_dy + cols, da.to(DY.dtype.element_ty), mask=mask)
            tl.store(DY + row * stride_dy + n + cols, db.to(DY.dtype.element_ty), mask=mask)
        if HAS_W:
            tl.store(DW + row, tl.sum(acc, axis=0))

    return fwd, bwd


def _block(n: int) -> int:
    return min(2048, max(16, next_power_of_2(n)))


def _warps(block: int) -> int:
    return min(8, max(1, block // 256))


def _forward(y: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    fwd, _ = _triton()
    rows, n = y.shape[0], y.shape[1] // 2
    out = torch.empty((rows, n), dtype=y.dtype, device=y.device)
    block = _block(n)
    if rows and n:
        fwd[(rows, -(-n // block))](y, w if w is not None else y, out, y.stride(0), out.stride(0), n,
                                    HAS_W=w is not None, BLOCK=block, num_warps=_warps(block))
    return out


def _backward(y: torch.Tensor, g: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, bwd = _triton()
    rows, n = y.shape[0], y.shape[1] // 2
    g = g if g.stride(-1) == 1 else g.contiguous()
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    dw = torch.empty((rows, 1), dtype=torch.float32, device=y.device) if w is not None else None
    block = _block(n)
    if rows and n:
        grid = (rows,) if w is not None else (rows, -(-n // block))
        bwd[grid](y, g, w if w is not None else y, dy, dw if dw is not None else y, y.stride(0), g.stride(0),
                  dy.stride(0), n, HAS_W=w is not None, BLOCK=block, num_warps=_warps(block))
    elif dw is not None:
        dw.zero_()
    return dy, dw


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return _forward(y, None)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        return _backward(y, g, None)[0]


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, w)
        return _forward(y, w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, w = ctx.saved_tensors
        dy, dw = _backward(y, g, w)
        return dy, dw.to(w.dtype)
