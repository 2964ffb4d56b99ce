"""KDA (Kimi Delta Attention) in plain PyTorch: the CPU path of GLM-5.3-Flash's linear-attention layers and the oracle
for the GPU kernel (``flash-linear-attention``'s ``chunk_kda``).

Math (transformers 5.24 ``Glm5NextTextLinearAttention``; per head ``h``, ``d = head_dim``, all fp32):

* ``q, k, v = SiLU(causal depthwise conv_K([Wq x; Wk x; Wv x]))`` (:func:`causal_conv`; weights fp32, no bias);
* ``q <- q / sqrt(|q|^2 + 1e-6) * d**-0.5``, ``k <- k / sqrt(|k|^2 + 1e-6)`` (:func:`l2norm`);
* ``g_t = lb * sigmoid(exp(A_log_h) * (f_t + dt_bias))`` in ``(lb, 0)^d``, or ``-exp(A_log_h) * softplus(f_t +
  dt_bias)`` without a lower bound (:func:`kda_gate`); ``beta_t = sigmoid(b_t)`` per head;
* ``S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T``, ``S_0 = 0``, ``o_t = S_t^T q_t``
  (:func:`recurrent_kda`, the definition);
* all in fp32 (fp64 when q is fp64: an oracle for kernels); :func:`chunk_kda` computes the same in chunks of 64
  (transformers' and fla's chunk size): within a chunk the delta-rule corrections are one unit-lower-triangular solve
  (the WY form), between chunks the state is carried.

Layout: ``[B, T, H, d]`` tensors; ``cu_seqlens`` (int ``[N + 1]``, batch 1) makes ``T`` a concatenation of
independent sequences (THD), each starting from ``S = 0`` and a zero conv history. The chunked form runs each
sequence on its own (a loop on the host: the reference favours clarity; the GPU kernel is varlen-native).

Differences from transformers' torch fallback, none numerical beyond fp32 rounding: the within-chunk correction is
``torch.linalg.solve_triangular`` instead of a Python forward substitution (autograd-friendly, same matrix), and
packed sequences are supported (transformers' fallback refuses ``cu_seqlens``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' form: eps inside the root, not max)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: each row's offset in its sequence of ``cu_seqlens`` (rows past the end count on)."""
    cu = cu_seqlens.to(torch.int64)
    rows = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.numel() - 2)
    return rows - cu[seq]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution followed by SiLU: ``x [B, T, C]``, ``weight [C, K]`` ->
    ``SiLU(sum_j weight[:, K-1-j] * x[t - j])`` over ``j < K`` with ``t - j`` in the same sequence, computed in the
    weight's dtype (fp32) and returned in ``x``'s dtype. ``positions [T]`` (offset of each row in its sequence,
    :func:`segment_positions`) is given for packed input; without it every row of ``x`` is one sequence.
    Equals ``F.conv1d(x, weight[:, None], padding=K - 1, groups=C)[..., :T]`` (transformers' form) per sequence."""
    dtype = x.dtype
    xf = x.to(weight.dtype)
    k = weight.shape[-1]
    t = x.shape[1]
    out = xf * weight[:, k - 1]
    for j in range(1, min(k, t)):
        shifted = F.pad(xf[:, : t - j], (0, 0, j, 0))  # row r holds x[r - j]
        if positions is not None:
            shifted = shifted * (positions >= j).to(shifted.dtype)[None, :, None]
        out = out + shifted * weight[:, k - 1 - j]
    return F.silu(out).to(dtype)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay, fp32 ``[..., H, d]`` from the forget-gate projection ``f [..., H * d]``, ``A_log [H]``
    and ``dt_bias [H * d]``: ``lb * sigmoid(exp(A_log) * (f + dt_bias))`` (the "safe gate", in ``(lb, 0)``), or
    ``-exp(A_log) * softplus(f + dt_bias)`` when ``lower_bound`` is None."""
    heads = a_log.shape[0]
    g = (f.float() + dt_bias.float()).unflatten(-1, (heads, -1))
    rate = a_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))  # transformers' softplus with its cutoff


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: ``RMSNorm_w(o) * sigmoid(gate)`` over the head dim, all in fp32 (the weight is not cast
    down first), returned in ``o``'s dtype."""
    dtype = o.dtype
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h * torch.sigmoid(gate.float())).to(dtype)


def _prepare(q, k, v, g, beta, scale, l2norm_eps):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64 in: an fp64 oracle for kernels
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if l2norm_eps is not None:
        q, k = l2norm(q, l2norm_eps), l2norm(k, l2norm_eps)
    return q * scale, k, v, g, beta


def recurrent_kda(q, k, v, g, beta, *, scale: float | None = None, l2norm_eps: float | None = 1e-6,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The delta rule token by token (the definition; slow). ``q, k [B, T, H, d_k]``, ``v [B, T, H, d_v]``, log-decay
    ``g [B, T, H, d_k]``, ``beta [B, T, H]`` -> ``o [B, T, H, d_v]`` in ``q``'s dtype. ``l2norm_eps=None`` skips
    the q/k normalisation; ``scale`` defaults to ``d_k**-0.5``."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, l2norm_eps)
    b, t, h, dk = k.shape
    starts = {0} if cu_seqlens is None else {int(c) for c in cu_seqlens[:-1].tolist()}
    out = torch.zeros(b, t, h, v.shape[-1], dtype=q.dtype, device=q.device)
    state = q.new_zeros(b, h, dk, v.shape[-1])
    for i in range(t):
        if i in starts:
            state = q.new_zeros(b, h, dk, v.shape[-1])
        state = state * g[:, i].exp()[..., None]
        kv_mem = (state * k[:, i, ..., None]).sum(-2)
        delta = (v[:, i] - kv_mem) * beta[:, i, :, None]
        state = state + k[:, i, ..., None] * delta[..., None, :]
        out[:, i] = (state * q[:, i, ..., None]).sum(-2)
    return out.to(dtype)


def chunk_kda(q, k, v, g, beta, *, scale: float | None = None, l2norm_eps: float | None = 1e-6,
              cu_seqlens: torch.Tensor | None = None, chunk_size: int = CHUNK) -> torch.Tensor:
    """:func:`recurrent_kda` in chunks (same arguments): what the CPU path runs, forward and backward (autograd)."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, l2norm_eps)
    if cu_seqlens is None:
        return _chunk_bshd(q, k, v, g, beta, chunk_size).to(dtype)
    if q.shape[0] != 1:
        raise ValueError(f"packed input (cu_seqlens) must have batch 1, got {q.shape[0]}")
    bounds = [int(c) for c in cu_seqlens.tolist()]
    parts = [_chunk_bshd(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], chunk_size)
             for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(parts, dim=1).to(dtype)


def _chunk_bshd(q, k, v, g, beta, chunk: int) -> torch.Tensor:
    """fp32 ``[B, T, H, d]`` inputs (q already scaled and normalised) -> fp32 ``[B, T, H, d_v]``."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def blocks(x):  # [B, T, H, ...] -> [B, H, n, C, ...], zero padded (a padded row neither decays nor writes)
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.ndim == 4 else F.pad(x, (0, pad))
        return x.reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    g = g.cumsum(-2)  # within-chunk cumulative log-decay [B, H, n, C, dk]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # j <= i
    # decay[i, j] = exp(G_i - G_j) per channel for j <= i (masked before exp: never overflows)
    decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(~lower[..., None], float("-inf")).exp()
    k_beta = k * beta[..., None]
    # A[i, j] = beta_i k_i . (k_j * decay_ij) for j < i; T = (I + A)^-1 (the WY correction)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    a = torch.einsum("...id,...jd,...ijd->...ij", k_beta, k, decay) * (1.0 - eye)  # decay is 0 above the diagonal
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    u = t_inv @ (v * beta[..., None])  # corrected values
    w = t_inv @ (k_beta * g.exp())  # what the carried state subtracts from them
    attn = torch.einsum("...id,...jd,...ijd->...ij", q, k, decay)  # intra-chunk scores, j <= i
    state = q.new_zeros(b, h, dk, dv)
    outs = []
    for i in range(n):
        g_i, g_last = g[:, :, i], g[:, :, i, -1]  # [B, H, C, dk], [B, H, dk]
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append((q[:, :, i] * g_i.exp()) @ state + attn[:, :, i] @ v_new)
        k_decayed = k[:, :, i] * (g_last[:, :, None] - g_i).exp()  # each key decayed to the chunk's end
        state = state * g_last.exp()[..., None] + k_decayed.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return out.transpose(1, 2)
