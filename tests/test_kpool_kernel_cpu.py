"""The *glue* of the KPool kernel path on CPU: everything ``megatron_glm5.kernels.kpool_topk`` does around the TileLang
indexer + top-k call (fixed-size pool keys, per-query pool ranges, expansion to token rows and the tail, the public
wrapper and ``kpool_select``'s kernel branch) against the torch reference ``megatron_glm5.dsa.kpool``.

Not a test of the kernel: the TileLang indexer + top-k is replaced by the reference's own per-token top-k
(``megatron_glm5.dsa.reference.indexer_topk``) run over the pool keys: it computes the scores with the same einsum at
the same chunk shapes as the KPool reference, so everything else must agree bit for bit (index, order, -1 padding).
The kernel itself is compared with the reference on the GPU (``tests/gpu/test_kernels_gpu.py``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_glm5.dsa import kpool
from megatron_glm5.dsa import reference as ref
from megatron_glm5.dsa.kpool_indexer import kpool_select, layout_documents
from megatron_glm5.dsa.layout import TokenLayout
from megatron_glm5.kernels import kpool_indexer_topk
from megatron_glm5.kernels.kpool_topk import kernel_supports, kpool_select_topk, pool_keys_fixed

topk_mod = importlib.import_module("megatron_glm5.kernels.indexer_topk")


def _inputs(t: int, heads: int, dim: int, pool: int, dtype=torch.float64, seed: int = 0, t_q: int | None = None):
    g = torch.Generator().manual_seed(seed)
    t_q = t if t_q is None else t_q
    q = torch.randn(t_q, heads, dim, generator=g).to(dtype)
    k = torch.randn(t, dim, generator=g).to(dtype)
    gate = torch.randn(t, dim, generator=g).to(dtype)
    ape = torch.randn(pool, dim, generator=g).to(dtype)
    w = (torch.rand(t_q, heads, generator=g) - 0.3) * heads**-0.5 * dim**-0.5
    return q, k, gate, ape, w


def _composed(q, k, gate, ape, w, cu, starts, ends, index_topk, select_tail):
    return kpool_select_topk(q, k, gate, ape, w, cu, starts, ends, index_topk=index_topk, select_tail=select_tail,
                             select_fn=ref.indexer_topk, validate=True)


def _reference(q, k, gate, ape, w, cu, starts, ends, index_topk, select_tail):
    pools = kpool.pool_keys(k, gate, ape, cu)
    return kpool.kpool_topk(q, w, pools, starts, ends, index_topk=index_topk, select_tail=select_tail)


CASES = [
    # (document lengths, rows past the last document, P, index_topk)
    ([301, 3, 1100, 598], 0, 4, 64),  # 4 documents: one shorter than P, lengths not multiples of P
    ([37, 2, 90], 5, 4, 16),  # padding rows past cu_seqlens[-1]
    ([50, 70], 0, 4, 2048),  # T < index_topk: every row sees fewer pools than it selects
    ([130, 77], 3, 16, 64),  # transformers' default P
    ([41, 9], 0, 1, 8),  # P = 1: per-token selection, no tail slots
    ([3000], 0, 4, 512),  # several query chunks (reference chunk 1024)
]


@pytest.mark.parametrize("select_tail", [True, False])
@pytest.mark.parametrize("lengths,pad,pool,index_topk", CASES)
def test_glue_with_reference_select_equals_reference(lengths, pad, pool, index_topk, select_tail):
    total = sum(lengths) + pad
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, gate, ape, w = _inputs(total, 4, 16, pool, seed=len(lengths) + pool)
    starts, ends = ref.causal_bounds(cu, total=total)
    got = _composed(q, k, gate, ape, w, cu, starts, ends, index_topk, select_tail)
    want = _reference(q, k, gate, ape, w, cu, starts, ends, index_topk, select_tail)
    width = kpool.topk_width(index_topk, pool, select_tail)
    assert got.dtype == torch.int32 and got.shape == want.shape == (total, width)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glue_with_reference_select_equals_reference_low_precision(dtype):
    """fp32 / bf16 inputs: the pool keys are built op for op like the reference's and the scores at the same
    shapes, so even the rounding agrees."""
    pool, index_topk, total = 4, 256, 700 + 13 + 1500
    cu = torch.tensor([0, 700, 713, 2213], dtype=torch.int32)
    q, k, gate, ape, w = _inputs(total, 8, 32, pool, dtype=dtype, seed=3)
    starts, ends = ref.causal_bounds(cu)
    got = _composed(q, k, gate, ape, w, cu, starts, ends, index_topk, True)
    assert torch.equal(got, _reference(q, k, gate, ape, w, cu, starts, ends, index_topk, True))


def test_glue_with_reference_select_exact_ties_pick_the_lower_pool():
    """Zero keys: every pool scores exactly 0, so each row takes its document's first pools in order."""
    pool, index_topk = 4, 32
    cu = torch.tensor([0, 90, 135], dtype=torch.int32)  # documents of 90 and 45 rows
    q, k, gate, ape, w = _inputs(135, 4, 16, pool, seed=4)
    k = torch.zeros_like(k)
    starts, ends = ref.causal_bounds(cu)
    got = _composed(q, k, gate, ape, w, cu, starts, ends, index_topk, True)
    assert torch.equal(got, _reference(q, k, gate, ape, w, cu, starts, ends, index_topk, True))
    t = 89  # document 0, 90 visible rows = 22 complete pools (8 selected) + 2 tail rows
    assert got[t, :32].tolist() == list(range(32)) and got[t, 32:].tolist() == [88, 89, -1]


def test_pool_keys_fixed_match_reference_keys():
    cu = torch.tensor([0, 10, 11, 30], dtype=torch.int32)
    _, k, gate, ape, _ = _inputs(33, 1, 8, 4, dtype=torch.float32, seed=5)
    keys, first_row, doc_pool_start = pool_keys_fixed(k, gate, ape, cu)
    pools = kpool.pool_keys(k, gate, ape, cu)
    n = pools.num_pools
    assert keys.shape == (33 // 4, 8) and n == 2 + 0 + 4
    assert torch.equal(keys[:n], pools.keys) and (keys[n:] == 0).all()
    assert torch.equal(first_row[:n].long(), pools.first_row) and first_row.dtype == torch.int32
    assert torch.equal(doc_pool_start, pools.doc_pool_start)


def test_glue_with_reference_select_zigzag_cp_query_rows():
    """Query rows that are a subset of the key rows (a zigzag CP rank): explicit starts / ends into the key axis."""
    b, full, cp_size, pool, index_topk = 2, 96, 2, 4, 16
    local = full // cp_size
    q, k, gate, ape, w = _inputs(b * full, 4, 16, pool, seed=6)
    order = TokenLayout.key_order(local, cp_size, torch.device("cpu"))
    natural = torch.empty_like(order)
    natural[order] = torch.arange(order.numel())
    for rank in range(cp_size):
        layout = TokenLayout.build_zigzag_cp(local, b, rank, cp_size, torch.device("cpu"))
        pos = natural[rank * local:(rank + 1) * local]
        rows = (torch.arange(b)[:, None] * full + pos[None]).reshape(-1)
        cu = layout_documents(layout)
        got = _composed(q[rows], k, gate, ape, w[rows], cu, layout.starts, layout.ends, index_topk, True)
        want = _reference(q[rows], k, gate, ape, w[rows], cu, layout.starts, layout.ends, index_topk, True)
        assert torch.equal(got, want), f"rank {rank}"


def test_glue_of_public_wrapper_and_model_path_with_reference_select(monkeypatch):
    """``kernels.kpool_indexer_topk`` and ``kpool_select``'s kernel branch, with the TileLang call replaced by the
    reference top-k (bf16 inputs, as on the GPU): equal to the reference selection."""
    monkeypatch.setattr(topk_mod, "indexer_topk_interface", ref.indexer_topk)
    lengths, pool, index_topk = [300, 2, 250], 4, 64
    total = sum(lengths)
    cu = torch.tensor([0, 300, 302, 552], dtype=torch.int32)
    q, k, gate, ape, w = _inputs(total, 8, 16, pool, dtype=torch.bfloat16, seed=7)
    want = kpool.kpool_indexer_topk(q, k, gate, ape, w, cu, index_topk=index_topk)
    assert torch.equal(kpool_indexer_topk(q, k, gate, ape, w, cu, index_topk=index_topk), want)
    starts, ends = ref.causal_bounds(cu)
    got = kpool_indexer_topk(q, k, gate, ape, w.double(), cu.long(), index_topk=index_topk, starts=starts.long(),
                             ends=ends, validate=True)
    assert torch.equal(got, want)

    class Packed:
        qkv_format = "thd"
        cu_seqlens_q = cu
        cu_seqlens_q_padded = None

    layout = TokenLayout.build(total, 1, torch.device("cpu"), Packed())
    import megatron_glm5.dsa.kpool_indexer as kpi

    monkeypatch.setattr(kpi, "_kernel_applies", lambda *args: True)
    assert torch.equal(kpool_select(q, k, gate, ape, w, layout, index_topk=index_topk, select_tail=True), want)


def test_glue_empty_inputs_and_argument_checks():
    q, k, gate, ape, w = _inputs(8, 2, 16, 4, seed=8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    starts, ends = ref.causal_bounds(cu)
    with pytest.raises(ValueError, match=r"index_topk \(10\) must be a positive multiple of index_kpool \(4\)"):
        _composed(q, k, gate, ape, w, cu, starts, ends, 10, True)
    with pytest.raises(ValueError, match="not a document start"):
        _composed(q, k, gate, ape, w, cu, starts + 1, ends + 1, 8, True)
    with pytest.raises(ValueError, match=r"ape must be \[P >= 1, D=16\]"):
        pool_keys_fixed(k, gate, ape[:, :3], cu)
    # fewer key rows than P: no pool at all, only the tail, from slot select_k * P = 0
    args = (q[:3], k[:3], gate[:3], ape, w[:3], torch.tensor([0, 3]), starts[:3], ends[:3], 8, True)
    got = _composed(*args)
    assert torch.equal(got, _reference(*args))
    assert got.tolist() == [[0] + [-1] * 10, [0, 1] + [-1] * 9, [0, 1, 2] + [-1] * 8]


def test_kernel_supports():
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert kernel_supports(q, k)
    assert not kernel_supports(q.float(), k.float())
    assert not kernel_supports(q[..., :8], k[..., :8])  # head dim not a multiple of 16
    assert not kernel_supports(torch.zeros(4, 3, 128, dtype=torch.bfloat16), k)  # (128 // 3) * 3 = 126 heads-rows
