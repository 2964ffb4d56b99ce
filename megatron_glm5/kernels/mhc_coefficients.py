"""mHC coefficients (GLM-5.3-Flash's hyper-connections) after the projection, in one Triton kernel each way.

Why: from the projection ``z = fn @ xhat`` (``[T, (2 + N) N]`` fp32) to ``pre``, ``post`` and the doubly stochastic
``comb``, torch launches about a hundred kernels per hyper-connection forward (sigmoids, a softmax, then ``2 iters -
1`` Sinkhorn normalisations of ``[T, N, N]`` tensors, each a sum, an add and a divide) and as many backward; on the
Flash slice that is thousands of tiny launches per step and the step is host-bound
(``scripts/bench/RESULTS_glm53_step.md``). Here one program handles a block of tokens in registers.

Contract (:func:`mhc_coefficients`): ``z [T, (2 + N) N]`` fp32, ``base [(2 + N) N]`` and ``scale [3]`` (used in
fp32), on one CUDA device (or CPU under ``TRITON_INTERPRET=1``); returns fp32 ``pre [T, N]``, ``post [T, N]``,
``comb [T, N, N]`` with the expressions of :func:`mhc_coefficients_reference` (transformers'
``Glm5NextTextHyperConnection``):

* ``pre = sigmoid(scale_0 z[:N] + base[:N]) + eps``, ``post = 2 sigmoid(scale_1 z[N:2N] + base[N:2N])``;
* ``comb = softmax_row(scale_2 z[2N:] + base[2N:]) + eps``, then normalised over columns (``comb.sum(-2)``), then
  ``iters - 1`` times over rows and columns, every denominator ``+ eps``.

Backward: gradients to ``z`` (``[T, (2 + N) N]``), ``base`` and ``scale`` (summed over tokens per program, the
programs' partial sums added in a fixed order: deterministic). The backward saves only ``z`` and recomputes the rest;
through Sinkhorn it recomputes the state before each normalisation from the softmax (``O(iters^2)`` tiny steps per
token, far cheaper than storing ``2 iters`` states per token).

Oracle: :func:`mhc_coefficients_reference` (what ``HyperConnection`` runs in torch). fp32 throughout; only the order
of the small sums differs.
"""

from __future__ import annotations

import functools

import torch

from megatron_glm5.kernels._common import cdiv, next_power_of_2, triton_runs_on

BLOCK_T = 32  # tokens per program


def mhc_coefficients_reference(z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch expressions (autograd): ``(pre, post, comb)`` from the projection ``z [.., (2 + n) n]``."""
    pre_w, post_w, comb_w = z.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    s_pre, s_post, s_comb = scale.unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def mhc_coefficients_supported(z: torch.Tensor) -> bool:
    """Whether :func:`mhc_coefficients` runs here (fp32 on CUDA, or CPU under Triton's interpreter; Triton present)."""
    return triton_runs_on(z) and z.dtype == torch.float32 and _kernels() is not None


def mhc_coefficients(z: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [.., n], post [.., n], comb [.., n, n])`` fp32 from ``z [.., (2 + n) n]`` (module docstring)."""
    rows = (2 + n) * n
    if z.shape[-1] != rows or base.shape != (rows,) or scale.shape != (3,):
        raise ValueError(f"mhc_coefficients: z {tuple(z.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)}"
                         f" do not fit n={n} ([.., {rows}], [{rows}], [3])")
    if z.dtype != torch.float32:
        raise ValueError(f"mhc_coefficients: z must be fp32, got {z.dtype}")
    lead = z.shape[:-1]
    # base / scale are fp32 parameters, unless a wrapper cast the model (then used in fp32, as torch promotes them)
    pre, post, comb = _MHCCoefficients.apply(z.reshape(-1, rows), base.float(), scale.float(), n, max(1, iters), eps)
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


class _MHCCoefficients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, base, scale, n, iters, eps):
        z = z.contiguous()
        t_len = z.shape[0]
        pre = torch.empty(t_len, n, dtype=torch.float32, device=z.device)
        post = torch.empty_like(pre)
        comb = torch.empty(t_len, n, n, dtype=torch.float32, device=z.device)
        if t_len:
            _kernels()[0][(cdiv(t_len, BLOCK_T),)](
                z, base.contiguous(), scale.contiguous(), pre, post, comb, t_len, iters, eps, N=n, NP=next_power_of_2(n),
                BT=BLOCK_T)
        ctx.save_for_backward(z, base, scale)
        ctx.meta = (n, iters, eps)
        return pre, post, comb

    @staticmethod
    def backward(ctx, d_pre, d_post, d_comb):
        z, base, scale = ctx.saved_tensors
        n, iters, eps = ctx.meta
        t_len, rows = z.shape
        zeros = functools.partial(torch.zeros, dtype=torch.float32, device=z.device)
        d_pre = zeros(t_len, n) if d_pre is None else d_pre.float().contiguous()
        d_post = zeros(t_len, n) if d_post is None else d_post.float().contiguous()
        d_comb = zeros(t_len, n, n) if d_comb is None else d_comb.float().contiguous()
        programs = cdiv(t_len, BLOCK_T)
        dz = torch.empty_like(z)
        d_base = zeros(max(programs, 1), rows)
        d_scale = zeros(max(programs, 1), 3)
        if t_len:
            _kernels()[1][(programs,)](
                z, base.contiguous(), scale.contiguous(), d_pre, d_post, d_comb, dz, d_base, d_scale, t_len, iters,
                eps, N=n, NP=next_power_of_2(n), BT=BLOCK_T)
        return dz, d_base.sum(0), d_scale.sum(0), None, None, None



def _kernels():
    """The forward and backward kernels, or None without Triton."""
    return None if triton is None else (mhc_coefficients_fwd, mhc_coefficients_bwd)


try:  # module-level kernels: Triton's interpreter resolves the jit helpers by their global names
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton comes with torch on Linux
    triton = tl = None

if triton is not None:
    @triton.jit
    def _normalise(c, axis: tl.constexpr, eps):
        """One Sinkhorn step on ``c [BT, NP, NP]`` (token, j, i): axis 1 = columns (``sum(-2)``), 2 = rows."""
        return c / (tl.expand_dims(tl.sum(c, axis=axis), axis) + eps)

    @triton.jit
    def _normalise_bwd(c, g, axis: tl.constexpr, eps):
        """Gradient through ``y = c / (sum_axis(c) + eps)``, given ``g = dL/dy``."""
        den = tl.expand_dims(tl.sum(c, axis=axis), axis) + eps
        return g / den - tl.expand_dims(tl.sum(g * c, axis=axis), axis) / (den * den)

    @triton.jit
    def _comb_start(z_ptr, base_ptr, s2, tok, rows_t, t_ok, N: tl.constexpr, NP: tl.constexpr, eps):
        """softmax over ``i`` of ``s2 z[2N + j N + i] + base[...]``, plus eps (0 on padded lanes); the softmax, the
        ``z`` slice, its columns and masks, and the offsets of ``comb [T, N, N]``."""
        jj = tl.arange(0, NP)
        ii = tl.arange(0, NP)
        lane_ok = (jj[:, None] < N) & (ii[None, :] < N)
        col = 2 * N + jj[:, None] * N + ii[None, :]
        ok = t_ok[:, None, None] & lane_ok[None, :, :]
        zc = tl.load(z_ptr + rows_t[:, None, None] + col[None, :, :], mask=ok, other=0.0)
        bc = tl.load(base_ptr + col, mask=lane_ok, other=0.0)
        logit = tl.where(lane_ok[None, :, :], zc * s2 + bc[None, :, :], float("-inf"))
        mx = tl.max(logit, axis=2)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # padded rows (j >= N): all -inf
        e = tl.exp(logit - tl.expand_dims(mx, 2))
        sm = e / tl.maximum(tl.expand_dims(tl.sum(e, axis=2), 2), 1e-30)
        c = tl.where(lane_ok[None, :, :], sm + eps, 0.0)
        out_c = tok.to(tl.int64)[:, None, None] * (N * N) + (jj[:, None] * N + ii[None, :])[None, :, :]
        return c, sm, zc, col, ok, lane_ok, out_c

    @triton.jit
    def _gate_logits(Z, BASE, SCALE, tok, T, N: tl.constexpr, NP: tl.constexpr):
        """The block's rows of ``z`` and the ``pre`` / ``post`` logits ``scale z + base`` (``[BT, NP]``, masked)."""
        t_ok = tok < T
        rows_t = tok.to(tl.int64) * ((2 + N) * N)
        kk = tl.arange(0, NP)
        k_ok = kk < N
        m2 = t_ok[:, None] & k_ok[None, :]
        s0 = tl.load(SCALE)
        s1 = tl.load(SCALE + 1)
        z0 = tl.load(Z + rows_t[:, None] + kk[None, :], mask=m2, other=0.0)
        z1 = tl.load(Z + rows_t[:, None] + N + kk[None, :], mask=m2, other=0.0)
        a0 = z0 * s0 + tl.load(BASE + kk, mask=k_ok, other=0.0)[None, :]
        a1 = z1 * s1 + tl.load(BASE + N + kk, mask=k_ok, other=0.0)[None, :]
        out_t = tok.to(tl.int64)[:, None] * N + kk[None, :]
        return t_ok, rows_t, m2, out_t, z0, z1, a0, a1, s0, s1

    @triton.jit
    def mhc_coefficients_fwd(Z, BASE, SCALE, PRE, POST, COMB, T, iters, eps, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        t_ok, rows_t, m2, out_t, z0, z1, a0, a1, s0, s1 = _gate_logits(Z, BASE, SCALE, tok, T, N, NP)
        tl.store(PRE + out_t, tl.sigmoid(a0) + eps, mask=m2)
        tl.store(POST + out_t, 2.0 * tl.sigmoid(a1), mask=m2)
        s2 = tl.load(SCALE + 2)
        c, sm, zc, col, ok, lane_ok, out_c = _comb_start(Z, BASE, s2, tok, rows_t, t_ok, N, NP, eps)
        c = _normalise(c, 1, eps)
        for _ in range(1, iters):
            c = _normalise(c, 2, eps)
            c = _normalise(c, 1, eps)
        tl.store(COMB + out_c, c, mask=ok)

    @triton.jit
    def mhc_coefficients_bwd(Z, BASE, SCALE, DPRE, DPOST, DCOMB, DZ, DBASE, DSCALE, T, iters, eps,
                             N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        pid = tl.program_id(0)
        tok = pid * BT + tl.arange(0, BT)
        t_ok, rows_t, m2, out_t, z0, z1, a0, a1, s0, s1 = _gate_logits(Z, BASE, SCALE, tok, T, N, NP)
        s2 = tl.load(SCALE + 2)
        kk = tl.arange(0, NP)
        k_ok = kk < N
        # pre and post: sigmoids
        p = tl.sigmoid(a0)
        q = tl.sigmoid(a1)
        g0 = tl.where(m2, tl.load(DPRE + out_t, mask=m2, other=0.0) * p * (1.0 - p), 0.0)
        g1 = tl.where(m2, tl.load(DPOST + out_t, mask=m2, other=0.0) * 2.0 * q * (1.0 - q), 0.0)
        tl.store(DZ + rows_t[:, None] + kk[None, :], g0 * s0, mask=m2)
        tl.store(DZ + rows_t[:, None] + N + kk[None, :], g1 * s1, mask=m2)
        # comb: back through the 2 iters - 1 normalisations (step k: columns if k is even, rows if odd), each
        # step's input recomputed from the start
        c0, sm, zc, col, ok, lane_ok, out_c = _comb_start(Z, BASE, s2, tok, rows_t, t_ok, N, NP, eps)
        g = tl.load(DCOMB + out_c, mask=ok, other=0.0)
        steps = 2 * iters - 1
        for back in range(0, steps):
            k = steps - 1 - back
            c = c0
            for s in range(0, k):
                if s % 2 == 0:
                    c = _normalise(c, 1, eps)
                else:
                    c = _normalise(c, 2, eps)
            if k % 2 == 0:
                g = _normalise_bwd(c, g, 1, eps)
            else:
                g = _normalise_bwd(c, g, 2, eps)
        # softmax (the + eps has no gradient)
        gl = sm * (g - tl.expand_dims(tl.sum(g * sm, axis=2), 2))
        gl = tl.where(ok, gl, 0.0)
        tl.store(DZ + rows_t[:, None, None] + col[None, :, :], gl * s2, mask=ok)
        # base and scale: this block's partial sums over its tokens
        tl.store(DBASE + pid * ((2 + N) * N) + kk, tl.sum(g0, axis=0), mask=k_ok)
        tl.store(DBASE + pid * ((2 + N) * N) + N + kk, tl.sum(g1, axis=0), mask=k_ok)
        tl.store(DBASE + pid * ((2 + N) * N) + col, tl.sum(gl, axis=0), mask=lane_ok)
        tl.store(DSCALE + pid * 3, tl.sum(tl.sum(g0 * z0, axis=1), axis=0))
        tl.store(DSCALE + pid * 3 + 1, tl.sum(tl.sum(g1 * z1, axis=1), axis=0))
        tl.store(DSCALE + pid * 3 + 2, tl.sum(tl.sum(tl.sum(gl * zc, axis=2), axis=1), axis=0))

