"""mHC stream mixing (GLM-5.3-Flash's hyper-connections) in one Triton kernel per direction.

Why: per token, mHC mixes ``N = hc_mult`` residual streams of width ``h`` with per-token coefficients: the sublayer
input ``u = sum_j pre_j X_j`` and the merge ``X'_i = post_i y + sum_j C[j, i] X_j``. In torch the merge is a batched
``[4, 4] @ [4, h]`` matmul per token, for which cuBLAS picks a 32x32 WMMA kernel: on the Flash slice
(``scripts/bench/RESULTS_glm53_step.md``) its forward and backward GEMMs alone took 80 of the 242 ms that mHC cost in
a 701 ms step, and ``u`` materialised an fp32 ``[T, N, h]`` product. Both are memory-bound elementwise work: here one
program reads a token's streams once.

Contract (:func:`stream_mix`): ``x [..., N * h]`` (streams, stream-major), ``a [..., O, N]`` (mixing weights),
optionally ``b [..., O]`` with ``y [..., h]``; returns ``out [..., O * h]`` in ``x``'s dtype with

    ``out[o] = sum_j a[o, j] x[j] + b[o] y``,

every product and sum in fp32 (the inputs as given, whatever their dtype), rounded once to ``x``'s dtype. Autograd to
all four inputs, again in fp32 and rounded once: ``dx[j] = sum_o a[o, j] g[o]``, ``dy = sum_o b[o] g[o]``,
``da[o, j] = <g[o], x[j]>``, ``db[o] = <g[o], y>`` (the dot products summed in a fixed order: deterministic), cast to
each input's dtype. ``x``, ``a``, ``b``, ``y`` on one CUDA device (or CPU under ``TRITON_INTERPRET=1``).

Oracle: :func:`stream_mix_reference` (the same expressions in fp32 torch). Only summation orders differ.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels._common import cdiv, next_power_of_2, triton_kernels, triton_runs_on

BLOCK_H = 256  # columns of h per program (forward) / per loop step (backward)


def stream_mix_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
                         y: torch.Tensor | None = None) -> torch.Tensor:
    """The contract's expressions in fp32 torch (autograd): the kernel's test oracle."""
    n = a.shape[-1]
    xs = x.float().unflatten(-1, (n, -1))
    out = torch.matmul(a.float(), xs)
    if b is not None:
        out = out + b.float().unsqueeze(-1) * y.float().unsqueeze(-2)
    return out.flatten(-2).to(x.dtype)


def stream_mix_supported(x: torch.Tensor) -> bool:
    """Whether :func:`stream_mix` runs here (a CUDA tensor, or CPU under Triton's interpreter, and Triton present)."""
    return triton_runs_on(x) and _kernels() is not None


def stream_mix(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None,
               y: torch.Tensor | None = None) -> torch.Tensor:
    """``out[..., o, :] = sum_j a[..., o, j] x[..., j, :] + b[..., o] y[..., :]`` (module docstring)."""
    if (b is None) != (y is None):
        raise ValueError("stream_mix: give both b and y, or neither")
    lead, (o, n) = a.shape[:-2], a.shape[-2:]
    if x.shape[:-1] != lead or x.shape[-1] % n:
        raise ValueError(f"stream_mix: x {tuple(x.shape)} is not [..., N * h] for a {tuple(a.shape)} ([..., O, N])")
    h = x.shape[-1] // n
    if b is not None and (b.shape != (*lead, o) or y.shape != (*lead, h)):
        raise ValueError(f"stream_mix: b {tuple(b.shape)} / y {tuple(y.shape)} must be [..., {o}] / [..., {h}] "
                         f"for x {tuple(x.shape)} and a {tuple(a.shape)}")
    return _StreamMix.apply(x, a, b, y)


class _StreamMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, y):
        o, n = a.shape[-2:]
        h = x.shape[-1] // n
        xf, af = x.reshape(-1, n * h).contiguous(), a.reshape(-1, o, n).contiguous()
        bf = b.reshape(-1, o).contiguous() if b is not None else af
        yf = y.reshape(-1, h).contiguous() if y is not None else xf
        t_len = xf.shape[0]
        out = torch.empty(t_len, o * h, dtype=x.dtype, device=x.device)
        if t_len and h:
            _kernels()[0][(t_len, cdiv(h, BLOCK_H))](
                xf, af, bf, yf, out, h, N=n, O=o, NP=next_power_of_2(n), OP=next_power_of_2(o), HAS_Y=y is not None, BLOCK=BLOCK_H)
        ctx.save_for_backward(xf, af, bf if b is not None else None, yf if y is not None else None)
        ctx.shapes = (x.shape, a.shape, None if b is None else b.shape, None if y is None else y.shape)
        ctx.dtypes = (a.dtype, None if b is None else b.dtype, None if y is None else y.dtype)
        return out.view(*x.shape[:-1], o * h)

    @staticmethod
    def backward(ctx, grad):
        xf, af, bf, yf = ctx.saved_tensors
        x_shape, a_shape, b_shape, y_shape = ctx.shapes
        a_dtype, b_dtype, y_dtype = ctx.dtypes
        t_len, (o, n) = af.shape[0], af.shape[1:]
        h = xf.shape[1] // n
        has_y = yf is not None
        g = grad.reshape(t_len, o * h).contiguous()
        dx = torch.empty_like(xf)
        da = torch.empty(t_len, o, n, dtype=torch.float32, device=xf.device)
        dy = torch.empty_like(yf) if has_y else dx
        db = torch.empty(t_len, o, dtype=torch.float32, device=xf.device) if has_y else da
        if t_len:
            _kernels()[1][(t_len,)](xf, af, bf if has_y else af, yf if has_y else xf, g, dx, da, db, dy, h, N=n,
                                    O=o, NP=next_power_of_2(n), OP=next_power_of_2(o), HAS_Y=has_y, BLOCK=BLOCK_H)
        return (dx.view(x_shape), da.to(a_dtype).view(a_shape),
                db.to(b_dtype).view(b_shape) if has_y else None, dy.view(y_shape) if has_y else None)



@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_mix_fwd(X, A, B, Y, OUT, H, N: tl.constexpr, O: tl.constexpr, NP: tl.constexpr, OP: tl.constexpr,
                       HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        oo = tl.arange(0, OP)
        jj = tl.arange(0, NP)
        in_h = cols < H
        a = tl.load(A + t * (O * N) + oo[:, None] * N + jj[None, :], mask=(oo[:, None] < O) & (jj[None, :] < N),
                    other=0.0).to(tl.float32)
        x = tl.load(X + t * (N * H) + jj[:, None] * H + cols[None, :], mask=(jj[:, None] < N) & in_h[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.sum(a[:, :, None] * x[None, :, :], axis=1)
        if HAS_Y:
            b = tl.load(B + t * O + oo, mask=oo < O, other=0.0).to(tl.float32)
            y = tl.load(Y + t * H + cols, mask=in_h, other=0.0).to(tl.float32)
            acc += b[:, None] * y[None, :]
        tl.store(OUT + t * (O * H) + oo[:, None] * H + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=(oo[:, None] < O) & in_h[None, :])

    @triton.jit
    def stream_mix_bwd(X, A, B, Y, G, DX, DA, DB, DY, H, N: tl.constexpr, O: tl.constexpr, NP: tl.constexpr,
                       OP: tl.constexpr, HAS_Y: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        oo = tl.arange(0, OP)
        jj = tl.arange(0, NP)
        o_ok = oo < O
        j_ok = jj < N
        a = tl.load(A + t * (O * N) + oo[:, None] * N + jj[None, :], mask=o_ok[:, None] & j_ok[None, :],
                    other=0.0).to(tl.float32)
        da = tl.zeros([OP, NP], dtype=tl.float32)
        if HAS_Y:
            b = tl.load(B + t * O + oo, mask=o_ok, other=0.0).to(tl.float32)
            db = tl.zeros([OP], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_h = cols < H
            g = tl.load(G + t * (O * H) + oo[:, None] * H + cols[None, :], mask=o_ok[:, None] & in_h[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(X + t * (N * H) + jj[:, None] * H + cols[None, :], mask=j_ok[:, None] & in_h[None, :],
                        other=0.0).to(tl.float32)
            dx = tl.sum(a[:, :, None] * g[:, None, :], axis=0)
            tl.store(DX + t * (N * H) + jj[:, None] * H + cols[None, :], dx.to(DX.dtype.element_ty),
                     mask=j_ok[:, None] & in_h[None, :])
            da += tl.sum(g[:, None, :] * x[None, :, :], axis=2)
            if HAS_Y:
                y = tl.load(Y + t * H + cols, mask=in_h, other=0.0).to(tl.float32)
                dy = tl.sum(b[:, None] * g, axis=0)
                tl.store(DY + t * H + cols, dy.to(DY.dtype.element_ty), mask=in_h)
                db += tl.sum(g * y[None, :], axis=1)
        tl.store(DA + t * (O * N) + oo[:, None] * N + jj[None, :], da, mask=o_ok[:, None] & j_ok[None, :])
        if HAS_Y:
            tl.store(DB + t * O + oo, db, mask=o_ok)

    return stream_mix_fwd, stream_mix_bwd
