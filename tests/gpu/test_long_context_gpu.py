"""The DSA kernels at 262144 tokens (the longest sequence the GLM-5 slice trains on one H200 with
``mlp_chunks_for_training``, issue 23): element offsets of ``q`` / ``dq`` ``[T, 16, 576]`` pass 2^31 there, so the
rows past that point are checked against the fp32 oracle, forward and ``dq`` of sparse MLA and the indexer's top-k
sets, on the rows at the end of the sequence (the largest offsets) and a few at its start."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa import reference as ref
from megatron_glm5.kernels import indexer_topk, sparse_mla_with_lse

pytestmark = pytest.mark.gpu

T_LEN, HEADS, TOPK = 262144, 16, 2048
D_QK, D_V, SCALE = 576, 512, 1.0 / 16
ROWS = [0, 1, 2047, 233016, 233017, 250000, 262142, 262143]  # 233017 * 16 * 576 > 2^31


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


def test_sparse_mla_rows_past_int32_offsets():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T_LEN, HEADS, D_QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    kv = torch.randn(T_LEN, D_QK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    idx = _strided_causal_indices(T_LEN, TOPK, g)
    grad = torch.randn(T_LEN, HEADS, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = sparse_mla_with_lse(q, kv, idx, SCALE, D_V)
    out.backward(grad)
    rows = torch.tensor(ROWS, device="cuda")
    qr = q.detach()[rows].float().requires_grad_(True)
    out_ref, lse_ref = ref.sparse_mla(qr, kv.detach().float(), idx[rows], SCALE, D_V)
    out_ref.backward(grad[rows].float())
    errs = dict(out=_err(out[rows], out_ref), lse=float((lse.detach()[rows] - lse_ref.detach()).abs().max()),
                dq=_err(q.grad[rows], qr.grad))
    print(f"sparse MLA at T={T_LEN}, {HEADS} heads, rows {ROWS}: {errs}; dkv finite: "
          f"{bool(torch.isfinite(kv.grad).all())}")
    assert errs["out"] < 2e-2 and errs["lse"] < 1e-2 and errs["dq"] < 2e-2
    assert torch.isfinite(kv.grad).all()


def test_indexer_topk_rows_at_the_end():
    g = torch.Generator(device="cuda").manual_seed(1)
    hi, di = 32, 128
    q = torch.randn(T_LEN, hi, di, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T_LEN, di, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(T_LEN, hi, device="cuda", generator=g) * hi**-0.5 * di**-0.5
    starts, ends = ref.causal_bounds(ref.uniform_cu_seqlens(1, T_LEN, device="cuda"))
    out = indexer_topk(q, k, w, starts, ends, TOPK)
    rows = torch.tensor(ROWS, device="cuda")
    s = ref.indexer_scores(q[rows].float(), k.float(), w[rows])  # [rows, T] fp32
    cols = torch.arange(T_LEN, device="cuda")
    s = s.masked_fill(cols[None] >= ends[rows].long()[:, None], float("-inf"))
    n = ends[rows].long().clamp(max=TOPK)
    mismatched = []
    for i, r in enumerate(ROWS):
        got = out[r][out[r] >= 0]
        assert got.numel() == int(n[i]), f"row {r}: {got.numel()} valid slots, expected {int(n[i])}"
        vals, top = s[i].topk(int(n[i]))
        kth = vals[-1]
        nxt = s[i][s[i] < kth].max() if int(n[i]) < int(ends[r]) else None
        tie = nxt is not None and float((kth - nxt).abs()) <= 1e-5 * max(1.0, float(kth.abs()))
        if not tie and not torch.equal(got.sort().values, top.int().sort().values):
            mismatched.append(r)
    print(f"indexer top-k at T={T_LEN}: rows {ROWS}, set mismatches at {mismatched}")
    assert not mismatched
