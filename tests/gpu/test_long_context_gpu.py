"""The kernels at long sequences (issue 23): 262144 tokens (the longest power of two the GLM-5 slice trains on one
H200 with ``mlp_chunks_for_training``) and 524288. Element offsets of ``q`` / ``dq`` ``[T, 16, 576]`` pass 2^31 at
262144 and 2^32 at 524288, those of the hidden-size RMSNorm ``[T, 6144]`` pass 2^31 past 349525 rows (its 32-bit row
offsets faulted there), so the rows past those points are checked against the fp32 oracle: forward and ``dq`` of
sparse MLA, the indexer's top-k sets, the RMSNorm's output and ``dx``, on the rows at the end of the sequence (the
largest offsets) and a few at its start. At 64 heads the default forward is the ping-pong kernel: its output rows
are checked past 2^31 element offsets of ``q`` and ``out`` and 2^33 of ``q`` at 262144 tokens (forward only)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa import reference as ref
from megatron_glm5.kernels import indexer_topk, sparse_mla_with_lse
from megatron_glm5.kernels.rms_norm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.gpu

HEADS, TOPK = 16, 2048
D_QK, D_V, SCALE = 576, 512, 1.0 / 16
LENGTHS = [262144, 524288]


def _rows(t_len: int) -> list[int]:
    """Rows at the start, on both sides of 2^31 (233017 * 16 * 576) and 2^32 (466034 * 16 * 576) element offsets of
    ``q``, and at the end."""
    rows = [0, 1, 2047, 233016, 233017, t_len // 2 + 3, t_len - 2, t_len - 1]
    return sorted(set(rows + ([466033, 466034] if t_len > 466034 else [])))


def _strided_causal_indices(t_len: int, topk: int, generator) -> torch.Tensor:
    """Row t: min(t + 1, topk) distinct keys of [0, t] (a random phase on a stride of max(1, (t + 1) // topk)),
    -1 tail; built without a [T, T] score matrix."""
    rows = torch.arange(t_len, device="cuda")[:, None]
    slot = torch.arange(topk, device="cuda")[None]
    step = ((rows + 1) // topk).clamp(min=1)
    phase = (torch.rand(t_len, 1, device="cuda", generator=generator) * step).long()
    idx = rows - slot * step - phase
    return torch.where((slot <= rows) & (idx >= 0), idx, -1).int().contiguous()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("t_len", LENGTHS)
def test_sparse_mla_rows_past_int32_offsets(t_len):
    picked = _rows(t_len)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t_len, HEADS, D_QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    kv = torch.randn(t_len, D_QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    idx = _strided_causal_indices(t_len, TOPK, g)
    grad = torch.randn(t_len, HEADS, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = sparse_mla_with_lse(q, kv, idx, SCALE, D_V)
    out.backward(grad)
    rows = torch.tensor(picked, device="cuda")
    qr = q.detach()[rows].float().requires_grad_(True)
    out_ref, lse_ref = ref.sparse_mla(qr, kv.detach().float(), idx[rows], SCALE, D_V)
    out_ref.backward(grad[rows].float())
    errs = dict(out=_err(out[rows], out_ref), lse=float((lse.detach()[rows] - lse_ref.detach()).abs().max()),
                dq=_err(q.grad[rows], qr.grad))
    print(f"sparse MLA at T={t_len}, {HEADS} heads, rows {picked}: {errs}; dkv finite: "
          f"{bool(torch.isfinite(kv.grad).all())}")
    assert errs["out"] < 2e-2 and errs["lse"] < 1e-2 and errs["dq"] < 2e-2
    assert torch.isfinite(kv.grad).all()


def test_pp_forward_rows_past_int32_offsets_at_64_heads():
    """The ping-pong forward (the default at 64 heads) at 262144 tokens: element offsets of ``q`` pass 2^31 at row
    58255 and 2^32 at 116509 (2^33 near the end), those of ``out`` 2^31 at row 65536; forward only (q and out alone
    are 36 GB)."""
    from megatron_glm5.kernels.sparse_mla_fwd import pick_fwd_variant, sparse_mla_fwd_interface

    t_len, heads = 262144, 64
    assert pick_fwd_variant(heads, D_QK, D_V) == "pp"
    picked = [0, 2047, 58254, 58255, 65535, 65536, 116508, 116509, t_len - 1]
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(t_len, heads, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(t_len, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = _strided_causal_indices(t_len, TOPK, g)
    out, lse = sparse_mla_fwd_interface(q, kv, idx, SCALE, D_V)
    rows = torch.tensor(picked, device="cuda")
    out_ref, lse_ref = ref.sparse_mla(q[rows].float(), kv.float(), idx[rows], SCALE, D_V)
    errs = dict(out=_err(out[rows], out_ref), lse=float((lse[rows] - lse_ref).abs().max()))
    print(f"pp forward at T={t_len}, {heads} heads, rows {picked}: {errs}")
    assert errs["out"] < 2e-2 and errs["lse"] < 1e-2


@pytest.mark.parametrize("t_len", LENGTHS)
def test_indexer_topk_rows_at_the_end(t_len):
    picked = _rows(t_len)
    g = torch.Generator(device="cuda").manual_seed(1)
    hi, di = 32, 128
    q = torch.randn(t_len, hi, di, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t_len, di, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(t_len, hi, device="cuda", generator=g) * hi**-0.5 * di**-0.5
    starts, ends = ref.causal_bounds(ref.uniform_cu_seqlens(1, t_len, device="cuda"))
    out = indexer_topk(q, k, w, starts, ends, TOPK)
    rows = torch.tensor(picked, device="cuda")
    s = ref.indexer_scores(q[rows].float(), k.float(), w[rows])  # [rows, T] fp32
    cols = torch.arange(t_len, device="cuda")
    s = s.masked_fill(cols[None] >= ends[rows].long()[:, None], float("-inf"))
    n = ends[rows].long().clamp(max=TOPK)
    mismatched = []
    for i, r in enumerate(picked):
        got = out[r][out[r] >= 0]
        assert got.numel() == int(n[i]), f"row {r}: {got.numel()} valid slots, expected {int(n[i])}"
        vals, top = s[i].topk(int(n[i]))
        kth = vals[-1]
        nxt = s[i][s[i] < kth].max() if int(n[i]) < int(ends[r]) else None
        tie = nxt is not None and float((kth - nxt).abs()) <= 1e-5 * max(1.0, float(kth.abs()))
        if not tie and not torch.equal(got.sort().values, top.int().sort().values):
            mismatched.append(r)
    print(f"indexer top-k at T={t_len}: rows {picked}, set mismatches at {mismatched}")
    assert not mismatched


def test_rms_norm_rows_past_int32_offsets():
    """[524288, 6144]: row offsets pass 2^31 at row 349526 (the hidden norm of a 393216-token step faulted)."""
    t_len, n = 524288, 6144
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(t_len, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(t_len, n, device="cuda", dtype=torch.bfloat16, generator=g)
    y = rms_norm(x, w, 1e-6)
    y.backward(dy)
    rows = torch.tensor([0, 1, 349525, 349526, 500000, t_len - 1], device="cuda")
    xr = x.detach()[rows].float().requires_grad_(True)
    yr = rms_norm_reference(xr, w.detach().float(), 1e-6)
    yr.backward(dy[rows].float())
    errs = dict(y=_err(y.detach()[rows], yr), dx=_err(x.grad[rows], xr.grad))
    print(f"RMSNorm at [{t_len}, {n}], rows {rows.tolist()}: {errs}; dw finite: {bool(torch.isfinite(w.grad).all())}")
    assert errs["y"] < 1e-2 and errs["dx"] < 2e-2
    assert torch.isfinite(w.grad).all()
