"""Fused RMSNorm (Triton), forward and backward, with the numerics of :class:`megatron_glm5.providers.TorchNorm`
(transformers' / sglang's order): normalise in fp32, cast to the input dtype, multiply by the weight in that dtype.

Why: without Transformer Engine every RMSNorm of the model (input / pre-MLP norms, the q and kv latent norms, the
final norm) ran as six to eight torch kernels over fp32 copies of its input, forward and backward, and autograd kept
the fp32 intermediates (issue 23: norms, RoPE and elementwise work were 21 % of a training step). Here one kernel
reads the input once and writes the output and one fp32 ``rstd`` per row; the backward reads the input again.

Contract (:func:`rms_norm`): ``x [..., N]`` and ``weight [N]`` on CUDA, both bf16 (or both fp16), the last dim
contiguous; returns ``y`` of ``x``'s shape and dtype and autograd to ``x`` and ``weight``:

* ``y = weight * (x_f32 * rstd).to(dtype)`` with ``rstd = rsqrt(mean(x_f32^2) + eps)`` per row;
* ``dx = rstd * (g - x_f32 * rstd^2 * mean(g * x_f32))`` with ``g = (dy * weight).to(dtype)`` in fp32 (the
  product is rounded to the dtype first, as torch's autograd of the bf16 multiply rounds it), cast to ``dtype``;
* ``dweight = sum over rows of (dy * (x_f32 * rstd).to(dtype)).to(dtype)``, accumulated in fp32 per block of rows and
  the blocks summed in a fixed order (deterministic), cast to the weight's dtype.

Oracle: :func:`rms_norm_reference` (the same expressions in torch; ``TorchNorm`` computes exactly that). The only
differences are summation orders (the row mean and the weight-gradient sum), so outputs agree bitwise except for
rare one-ulp flips. CPU tests run these kernels in Triton's interpreter (``TRITON_INTERPRET=1``), which rounds
fp32 -> bf16 differently from the GPU (not to nearest even): there the comparison allows two ulps.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import triton_kernels, triton_runs_on

MAX_N = 16384  # one row per program in registers; GLM widths: 6144 (hidden), 2048 (q_lora), 512 (kv_lora), 4096


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch expressions (autograd): :class:`~megatron_glm5.providers.TorchNorm`'s RMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` takes these tensors (else use :func:`rms_norm_reference`)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.shape[-1] <= MAX_N
            and weight.shape == x.shape[-1:] and triton_runs_on(x) and _triton() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm (module docstring); ``rms_norm_supported(x, weight)`` must hold."""
    return _RMSNorm.apply(x, weight, eps)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 past 349525 rows of 6144
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        h = (x * rstd).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        y = (h.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * stride_y + cols, y, mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def bwd(X, W, DY, DX, RSTD, DW_PART, stride_x, stride_dy, stride_dx, rows, rows_per_prog, N,
            BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        first = pid.to(tl.int64) * rows_per_prog
        for i in range(0, rows_per_prog):
            row = first + i
            if row < rows:
                x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0)
                rstd = tl.load(RSTD + row)
                xr = x * rstd
                h = xr.to(DY.dtype.element_ty).to(tl.float32)
                dw += (dy.to(tl.float32) * h).to(DY.dtype.element_ty).to(tl.float32)
                g = (dy.to(tl.float32) * w).to(DY.dtype.element_ty).to(tl.float32)
                dx = rstd * (g - xr * (tl.sum(g * xr, axis=0) / N))
                tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DW_PART + pid * N + cols, dw, mask=mask)

    return fwd, bwd


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` -> ``[R, N]`` with a unit last stride (a view when the strides allow)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _warps(block: int) -> int:
    return min(16, max(1, block // 512))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        fwd, _ = _triton()
        x2, w = _rows(x), weight.contiguous()
        rows, n = x2.shape
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = max(16, 1 << (n - 1).bit_length())
        if rows:
            fwd[(rows,)](x2, w, y, rstd, x2.stride(0), y.stride(0), n, eps, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape, ctx.block = x.shape, block
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _, bwd = _triton()
        x2, w, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
        progs = max(1, min(rows, _programs(x2.device)))
        per = -(-rows // progs) if rows else 0
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)  # every program writes its row
        if rows:
            bwd[(progs,)](x2, w, dy2, dx, rstd, dw_part, x2.stride(0), dy2.stride(0), dx.stride(0), rows, per, n,
                          BLOCK=ctx.block, num_warps=_warps(ctx.block))
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (dw_part.sum(0) if rows else torch.zeros(n, dtype=torch.float32, device=w.device)).to(w.dtype)
        return dx.view(ctx.shape), dw, None


def _programs(device: torch.device) -> int:
    """Backward programs: a few per SM, each owning a block of rows and one fp32 partial weight gradient."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
