"""Interleaved RoPE and the concatenation around it as one Triton kernel each way (``MEGATRON_GLM5_FUSED_ROPE`` in
:mod:`megatron_glm5.fusions`, on by default).

Why: the ``tilelang`` attention builds its four RoPE'd operands (the query ``[q_nope W_kc | rope(q_pe)]``, the latent
keys ``[c | rope(k_pe)]``, the indexer's ``[rope(q[:r]) | q[r:]]`` and ``[rope(k[:r]) | k[r:]]``) with
:func:`megatron_glm5.dsa.rope.apply_interleaved_rope` and ``torch.cat``: an fp32 copy, four products, two sums, two
concatenations and a cast, each a kernel, and about as many again in the backward (368 kernels, 3.4 ms per step of
the GLM-5 slice, plus the copies of the concatenations; issue 23's profile). Here the rotated part and the copied part
are written once, straight into the concatenated output.

Contract (:func:`rope_cat`): ``x [T, H, R]`` or ``[T, R]`` (the RoPE part, any float dtype, last dim contiguous),
``rest`` of the same leading shape and last dim ``A`` (copied), ``cos`` / ``sin`` fp32 ``[T, R/2]`` (no gradient):

* ``out = cat([rope(x), rest])`` (``rope_first``) or ``cat([rest, rope(x)])``, in ``out_dtype`` (default ``x``'s),
  with ``rope(x) = [e cos - o sin | o cos + e sin]`` for ``e = x[..., 0::2]``, ``o = x[..., 1::2]`` in fp32 and one
  rounding (the de-interleaved layout of :func:`~megatron_glm5.dsa.rope.apply_interleaved_rope`);
* backward: ``d rest`` the slice of the gradient (in ``rest``'s dtype), ``dx`` the inverse rotation of its slice,
  re-interleaved, in fp32 and one rounding to ``x``'s dtype.

Oracle: :func:`rope_cat_reference` (the torch expressions the attention runs otherwise). Bitwise equal on the GPU,
forward and backward: each product is rounded on its own (``mul.rn``) as torch's separate kernels round it, so the
compiler cannot contract ``a b - c d`` into a fused multiply-add (which flipped up to 4 bf16 ulps, and 15 in
near-cancelling gradients, on the H200). Triton's interpreter (the CPU tests) has no inline PTX and multiplies
plainly, which numpy rounds the same way.
"""

from __future__ import annotations

import os

import torch

from megatron_glm5.kernels._common import next_power_of_2, triton_kernels, triton_runs_on

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_ROWS = 16
mul_rn = None  # the kernels' product helper (a Triton function), set by _triton() when Triton is first used


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` (``[T, ..., d]``) with per-row ``cos/sin`` ``[T, d/2]``; fp32 math, one cast; the
    result de-interleaved (:mod:`megatron_glm5.dsa.rope`, which re-exports it, says why)."""
    while cos.ndim < x.ndim:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).to(x.dtype)


def rope_cat_reference(x: torch.Tensor, rest: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                       rope_first: bool, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch expressions (autograd): RoPE in fp32 and one cast, then the concatenation, then ``out_dtype``."""
    r = apply_interleaved_rope(x, cos, sin)
    out = torch.cat([r, rest] if rope_first else [rest, r], dim=-1)
    return out.to(out_dtype or x.dtype)


def rope_cat_supported(x: torch.Tensor, rest: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rope_cat` takes these tensors (else use :func:`rope_cat_reference`)."""
    return (x.dim() in (2, 3) and rest.shape[:-1] == x.shape[:-1] and x.shape[-1] % 2 == 0 and x.shape[-1] > 0
            and x.dtype in _DTYPES and rest.dtype in _DTYPES and x.stride(-1) == 1 and rest.stride(-1) == 1
            and cos.shape == (x.shape[0], x.shape[-1] // 2) and cos.dtype == torch.float32
            and triton_runs_on(x) and _triton() is not None)


def rope_cat(x: torch.Tensor, rest: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rope_first: bool,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused RoPE + concatenation (module docstring); ``rope_cat_supported(x, rest, cos)`` must hold."""
    return _RopeCat.apply(x, rest, cos.contiguous(), sin.contiguous(), rope_first, out_dtype or x.dtype)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _mul_rn(a, b, EXACT: tl.constexpr):
        """``a * b`` rounded on its own (never contracted into an FMA) where inline PTX runs."""
        if EXACT:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return a * b

    globals()["mul_rn"] = _mul_rn  # a module global: neither Triton's compiler nor its interpreter sees closures

    @triton.jit
    def fwd(X, REST, COS, SIN, OUT, n_rows, heads, sxt, sxh, srt, srh, half, width_rest, rope_off, rest_off,
            width, BH: tl.constexpr, BA: tl.constexpr, BLOCK_ROWS: tl.constexpr, EXACT: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        t = rows // heads
        h = rows % heads
        j = tl.arange(0, BH)
        mj = live[:, None] & (j < half)[None, :]
        xrow = X + (t * sxt + h * sxh)[:, None]
        e = tl.load(xrow + 2 * j[None, :], mask=mj, other=0.0).to(tl.float32)
        o = tl.load(xrow + 2 * j[None, :] + 1, mask=mj, other=0.0).to(tl.float32)
        c = tl.load(COS + (t * half)[:, None] + j[None, :], mask=mj, other=0.0)
        s = tl.load(SIN + (t * half)[:, None] + j[None, :], mask=mj, other=0.0)
        orow = OUT + (rows * width)[:, None]
        r1 = mul_rn(e, c, EXACT) - mul_rn(o, s, EXACT)
        r2 = mul_rn(o, c, EXACT) + mul_rn(e, s, EXACT)
        tl.store(orow + rope_off + j[None, :], r1.to(OUT.dtype.element_ty), mask=mj)
        tl.store(orow + rope_off + half + j[None, :], r2.to(OUT.dtype.element_ty), mask=mj)
        a = tl.arange(0, BA)
        ma = live[:, None] & (a < width_rest)[None, :]
        v = tl.load(REST + (t * srt + h * srh)[:, None] + a[None, :], mask=ma, other=0.0)
        tl.store(orow + rest_off + a[None, :], v.to(OUT.dtype.element_ty), mask=ma)

    @triton.jit
    def bwd(G, COS, SIN, DX, n_rows, heads, sgt, sgh, half, rope_off, BH: tl.constexpr, BLOCK_ROWS: tl.constexpr,
            EXACT: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        t = rows // heads
        h = rows % heads
        j = tl.arange(0, BH)
        mj = live[:, None] & (j < half)[None, :]
        grow = G + (t * sgt + h * sgh)[:, None] + rope_off
        g1 = tl.load(grow + j[None, :], mask=mj, other=0.0).to(tl.float32)
        g2 = tl.load(grow + half + j[None, :], mask=mj, other=0.0).to(tl.float32)
        c = tl.load(COS + (t * half)[:, None] + j[None, :], mask=mj, other=0.0)
        s = tl.load(SIN + (t * half)[:, None] + j[None, :], mask=mj, other=0.0)
        drow = DX + (rows * (2 * half))[:, None]
        d_even = mul_rn(g1, c, EXACT) + mul_rn(g2, s, EXACT)
        d_odd = mul_rn(g2, c, EXACT) - mul_rn(g1, s, EXACT)
        tl.store(drow + 2 * j[None, :], d_even.to(DX.dtype.element_ty), mask=mj)
        tl.store(drow + 2 * j[None, :] + 1, d_odd.to(DX.dtype.element_ty), mask=mj)

    return fwd, bwd


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _as3d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(1)


class _RopeCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rest, cos, sin, rope_first: bool, out_dtype: torch.dtype):
        fwd, _ = _triton()
        x3, r3 = _as3d(x), _as3d(rest)
        tokens, heads, width_rope = x3.shape
        width_rest = r3.shape[-1]
        half = width_rope // 2
        width = width_rope + width_rest
        rope_off, rest_off = (0, width_rope) if rope_first else (width_rest, 0)
        out = torch.empty((tokens, heads, width), dtype=out_dtype, device=x.device)
        n_rows = tokens * heads
        if n_rows:
            fwd[(-(-n_rows // BLOCK_ROWS),)](
                x3, r3, cos, sin, out, n_rows, heads, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), half,
                width_rest, rope_off, rest_off, width, BH=next_power_of_2(max(half, 2)),
                BA=next_power_of_2(max(width_rest, 2)), BLOCK_ROWS=BLOCK_ROWS,
                EXACT=x.is_cuda and not _interpreted())
        ctx.save_for_backward(cos, sin)
        ctx.meta = (x.shape, x.dtype, rest.shape, rest.dtype, heads, half, rope_off, rest_off, width_rest)
        return out.view(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        _, bwd = _triton()
        cos, sin = ctx.saved_tensors
        x_shape, x_dtype, rest_shape, rest_dtype, heads, half, rope_off, rest_off, width_rest = ctx.meta
        g3 = _as3d(g)
        if g3.stride(-1) != 1:
            g3 = g3.contiguous()
        d_rest = g3[..., rest_off: rest_off + width_rest].to(rest_dtype).reshape(rest_shape)
        dx = torch.empty((g3.shape[0], heads, 2 * half), dtype=x_dtype, device=g.device)
        n_rows = g3.shape[0] * heads
        if n_rows:
            bwd[(-(-n_rows // BLOCK_ROWS),)](g3, cos, sin, dx, n_rows, heads, g3.stride(0), g3.stride(1), half,
                                             rope_off, BH=next_power_of_2(max(half, 2)), BLOCK_ROWS=BLOCK_ROWS,
                                             EXACT=g.is_cuda and not _interpreted())
        return dx.view(x_shape), d_rest, None, None, None, None
