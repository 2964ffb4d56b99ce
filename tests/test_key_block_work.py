"""The key-block dKV route's work bound (``megatron_glm5.kernels.key_block_work``) and the autograd route it decides.

The bound must never be below the exact per-block query ranges (``selection_bitmap.key_block_query_range``), sit close
to them on causal sets, single and packed, and make the autograd backward take the key blocks for a packed batch past
8K tokens while a single long sequence (past about 11K tokens at top-2048) keeps the atomic backward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_glm5.kernels.key_block_work import (
    KeyBlockWorkProbe,
    dense_pairs_bound,
    row_key_span,
    row_key_span_reference,
    span_query_ranges,
)
from megatron_glm5.kernels.selection_bitmap import key_block_query_range, selection_bitmap_reference
from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCKS_MAX_DENSE_PER_SPARSE, KEY_BLOCKS_MAX_TOKENS

REPO = Path(__file__).resolve().parents[1]


def causal_sets(lengths: list[int], k: int, seed: int) -> torch.Tensor:
    """int32 ``[sum(lengths), k]``: each row's random distinct keys among its sequence's positions up to its own
    (all of them when fewer than ``k``), -1 padded at the tail: the indexer's top-k layout on a packed batch."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    s0 = 0
    for n in lengths:
        pos = torch.arange(n)
        score = torch.rand(n, n, generator=g).masked_fill(pos[None, :] > pos[:, None], -1.0)
        top = score.topk(min(k, n), dim=1)
        keys = torch.where(top.values >= 0, top.indices + s0, -1).to(torch.int32)
        rows.append(torch.nn.functional.pad(keys, (0, k - keys.shape[1]), value=-1))
        s0 += n
    return torch.cat(rows)


def exact_dense_pairs(idx: torch.Tensor, t_kv: int, block_k: int = 64) -> int:
    bits, _ = selection_bitmap_reference(idx, t_kv, block_k=block_k)
    rng = key_block_query_range(bits, block_k)
    return int((rng[:, 1] - rng[:, 0]).sum()) * block_k


def test_row_key_span_reference_is_min_and_max_valid_key():
    idx = torch.tensor([[5, -1, 2, 9], [-1, -1, -1, -1], [12, 3, 40, 7]], dtype=torch.int32)
    lo, hi = row_key_span_reference(idx, 12)  # 12 and 40 are out of range
    assert lo.tolist() == [2, 12, 3] and hi.tolist() == [9, -1, 7]
    assert lo.dtype == hi.dtype == torch.int32
    lo, hi = row_key_span_reference(torch.zeros(3, 0, dtype=torch.int32), 5)
    assert lo.tolist() == [5] * 3 and hi.tolist() == [-1] * 3
    with pytest.raises(TypeError, match="int32"):
        row_key_span(idx.long(), 12)


@pytest.mark.parametrize("lengths,k", [([300], 32), ([40, 200, 7, 120], 16), ([64] * 5, 64), ([90, 33], 200)])
def test_bound_is_never_below_the_exact_ranges_and_close_on_causal_sets(lengths, k):
    idx = causal_sets(lengths, k, seed=sum(lengths) + k)
    t = idx.shape[0]
    idx[min(3, t - 1)] = -1  # a query without keys
    exact = exact_dense_pairs(idx, t)
    bound = int(dense_pairs_bound(*row_key_span(idx, t), t))
    assert exact <= bound <= 1.06 * exact, (exact, bound)


def test_bound_equals_the_exact_ranges_on_packed_sets_with_position_and_sequence_start():
    """Equal on this data (a measured tightness, not a theorem: each sequence's last row also has to select a key of
    every block of its sequence, which random sets of 20 keys here do)."""
    idx = causal_sets([100, 150, 70], 20, seed=4)
    pos, start = torch.arange(320), torch.tensor([0] * 100 + [100] * 150 + [250] * 70)
    idx[:, 0], idx[:, 1] = start.to(torch.int32), pos.to(torch.int32)
    idx[start == pos, 1] = -1  # no repeated key at each sequence's first row
    for block_k in (32, 64):
        assert int(dense_pairs_bound(*row_key_span(idx, 320), 320, block_k)) == exact_dense_pairs(idx, 320, block_k)


@pytest.mark.parametrize("seed", range(6))
def test_span_ranges_contain_the_exact_ranges(seed):
    g = torch.Generator().manual_seed(seed)
    t_len, t_kv = (int(x) for x in torch.randint(1, 300, (2,), generator=g))
    block_k = 32 * (1 + seed % 3)
    idx = torch.randint(-3, t_kv + 3, (t_len, 7), generator=g, dtype=torch.int32)
    idx[torch.rand(t_len, 7, generator=g) < 0.3] = -1
    exact = key_block_query_range(selection_bitmap_reference(idx, t_kv, block_k=block_k)[0], block_k)
    span = span_query_ranges(*row_key_span(idx, t_kv), t_kv, block_k)
    assert span.shape == exact.shape and span.dtype == torch.int32
    used = exact[:, 1] > exact[:, 0]
    assert bool((span[used, 0] <= exact[used, 0]).all() and (span[used, 1] >= exact[used, 1]).all())
    assert int((span[:, 1] - span[:, 0]).sum()) * block_k == int(dense_pairs_bound(*row_key_span(idx, t_kv), t_kv,
                                                                                   block_k))


def test_span_ranges_equal_the_exact_ones_on_packed_causal_sets():
    idx = causal_sets([300, 41, 700], 64, seed=3)
    exact = key_block_query_range(selection_bitmap_reference(idx, 1041)[0], 64)
    assert torch.equal(span_query_ranges(*row_key_span(idx, 1041), 1041), exact)


def test_rows_without_keys_stay_out_of_a_partial_last_block():
    idx = torch.full((10, 3), -1, dtype=torch.int32)
    idx[:5, 0] = torch.arange(5, dtype=torch.int32)  # rows 5-9 select nothing (lo = t_kv = 40 < the block's end 63)
    assert int(dense_pairs_bound(*row_key_span(idx, 40), 40)) == exact_dense_pairs(idx, 40) == 5 * 64


def test_bound_of_unordered_and_empty_inputs():
    idx = torch.tensor([[7, 1], [0, -1], [3, 3]], dtype=torch.int32)  # row 0 reaches past row 1 both ways
    assert exact_dense_pairs(idx, 8, 32) <= int(dense_pairs_bound(*row_key_span(idx, 8), 8, 32))
    empty = torch.zeros(0, 4, dtype=torch.int32)
    assert int(dense_pairs_bound(*row_key_span(empty, 0), 0)) == 0
    assert int(dense_pairs_bound(*row_key_span(torch.full((4, 2), -1, dtype=torch.int32), 4), 4)) == 0
    with pytest.raises(ValueError, match="block_k"):
        dense_pairs_bound(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 4, 48)


def test_probe_ratio_follows_the_sequences_not_the_tokens():
    """Top-k 256 on 1024-token sequences is the measured 8K / top-2048 point scaled by 8 (ratio 2.30 there);
    2048 tokens the 16K point (4.28). A packed batch of 1024-token sequences keeps the single sequence's ratio."""
    one = causal_sets([1024], 256, seed=0)
    long_ = causal_sets([2048], 256, seed=1)
    packed = causal_sets([1024, 1024, 1024, 1024], 256, seed=2)
    r_one, r_long, r_packed = (
        KeyBlockWorkProbe(i, (i >= 0).sum(1, dtype=torch.int32), i.shape[0]).dense_per_sparse()
        for i in (one, long_, packed)
    )
    assert 2.2 < r_one < 2.6 and 4.1 < r_long < 4.6, (r_one, r_long)  # at top-k 2048: 2.30 and 4.28
    assert abs(r_packed - r_one) < 0.05, (r_packed, r_one)
    empty = torch.full((4, 8), -1, dtype=torch.int32)
    assert KeyBlockWorkProbe(empty, torch.zeros(4, dtype=torch.int32), 4).dense_per_sparse() == 0.0


def test_key_blocks_pay_past_8k_only_by_the_measured_work():
    from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCKS_BITMAP_BYTES, key_blocks_fit, key_blocks_pay

    big = 4 * KEY_BLOCKS_MAX_TOKENS
    assert not key_blocks_pay(16, big, 576, 512)  # nothing measured: the atomic backward
    for (d_qk, d_v), limit in KEY_BLOCKS_MAX_DENSE_PER_SPARSE.items():  # each latent its own limit
        assert key_blocks_pay(16, big, d_qk, d_v, dense_per_sparse=limit)
        assert not key_blocks_pay(16, big, d_qk, d_v, dense_per_sparse=limit + 0.01)
    assert key_blocks_pay(16, big, 576, 512, dense_per_sparse=4.28)  # 16K (4.28) ran 1.20x
    assert not key_blocks_pay(16, big, 576, 512, dense_per_sparse=5.28)  # 20K (5.28) ran 1.00x
    assert key_blocks_pay(16, big, 512, 512, dense_per_sparse=4.28)  # NoPE: 16K ran 1.14x
    assert not key_blocks_pay(16, big, 512, 512, dense_per_sparse=4.6)  # NoPE: 20K (5.28) ran 0.95x
    assert key_blocks_pay(16, KEY_BLOCKS_MAX_TOKENS, 576, 512, dense_per_sparse=9.0)  # measured faster to 8K
    assert not key_blocks_pay(64, big, 576, 512, dense_per_sparse=1.0)  # 64 heads: not there
    assert key_blocks_fit(16, 65536, 65536, 576, 512) and 65536 * 65536 // 8 == KEY_BLOCKS_BITMAP_BYTES
    assert not key_blocks_fit(16, 65537, 65536, 576, 512)  # the bitmap would pass 512 MiB


def _route_of(monkeypatch, idx: torch.Tensor, heads: int = 16, requires_grad: bool = True,
              d_qk: int = 576, grouped: bool = False) -> list[str]:
    """Run ``SparseMLAFunction`` with the kernels replaced by shape-only stand-ins and return the ``dkv_reduce`` each
    backward asked for (``"atomic"`` when it passed none): the route's decision, not the kernels' math."""
    from megatron_glm5.kernels import sparse_mla_bwd as bwd

    t = idx.shape[0]
    seen: list[str] = []

    def fwd(q, kv, indices, scale, d_v, **kw):
        return torch.zeros(1, 1, 1, dtype=torch.bfloat16).expand(t, heads, d_v), torch.zeros(t, heads)

    def bwd_stub(q, kv, out, lse, grad_out, indices, scale, d_v, **kw):
        seen.append(kw.get("dkv_reduce", "atomic"))
        return torch.zeros_like(q[:1, :1, :1]).expand_as(q), torch.zeros_like(kv[:1, :1]).expand_as(kv)

    monkeypatch.setattr(bwd, "sparse_mla_fwd_interface", fwd)
    monkeypatch.setattr(bwd, "sparse_mla_bwd_interface", bwd_stub)
    q = torch.zeros(1, 1, 1, dtype=torch.bfloat16).expand(t, heads, d_qk).requires_grad_(requires_grad)
    kv = torch.zeros(1, 1, dtype=torch.bfloat16).expand(t, d_qk)
    with torch.set_grad_enabled(requires_grad):
        out, _ = bwd.sparse_mla_autograd(q, kv, idx, 0.04, 512, key_blocks=True, grouped=grouped)
    if requires_grad:
        out.float().sum().backward()
    return seen


def test_autograd_takes_key_blocks_for_a_packed_batch_past_8k(monkeypatch):
    packed = causal_sets([256] * 40, 128, seed=5)  # 10240 tokens in 256-token sequences: ratio about 1.4
    t = 2 * KEY_BLOCKS_MAX_TOKENS  # one long sequence: 8 random causal keys per row (dense work about 1000x)
    single = (torch.rand(t, 8, generator=torch.Generator().manual_seed(6)) * torch.arange(1, t + 1)[:, None])
    single = single.to(torch.int32)
    assert packed.shape[0] > KEY_BLOCKS_MAX_TOKENS
    assert _route_of(monkeypatch, packed) == ["key_blocks"]
    assert _route_of(monkeypatch, single) == ["atomic"]
    assert _route_of(monkeypatch, packed[:4096]) == ["key_blocks"]  # within 8K: as measured, no probe
    assert _route_of(monkeypatch, packed, heads=32) == ["atomic"]


def test_autograd_takes_key_blocks_on_the_nope_latent(monkeypatch):
    """GLM-5.3-Flash's NoPE latent (d_qk = d_v = 512) takes the route as GLM-5's does (measured 1.15-1.61x at 2K-8K);
    past 8K by its own threshold. A latent not measured keeps the atomic backward."""
    packed = causal_sets([256] * 40, 128, seed=5)
    assert _route_of(monkeypatch, packed[:4096], d_qk=512) == ["key_blocks"]
    assert _route_of(monkeypatch, packed, d_qk=512) == ["key_blocks"]
    assert _route_of(monkeypatch, packed[:4096], d_qk=640) == ["atomic"]


def test_no_probe_without_a_backward(monkeypatch):
    from megatron_glm5.kernels import key_block_work, sparse_mla_bwd as bwd

    made = []
    monkeypatch.setattr(bwd, "KeyBlockWorkProbe", lambda *a: made.append(a) or key_block_work.KeyBlockWorkProbe(*a))
    packed = causal_sets([256] * 40, 128, seed=5)
    assert _route_of(monkeypatch, packed, requires_grad=False) == [] and made == []
    assert _route_of(monkeypatch, packed) == ["key_blocks"] and len(made) == 1


_SCRIPT = r"""
import torch
from megatron_glm5.kernels.key_block_work import row_key_span, row_key_span_reference
g = torch.Generator().manual_seed(0)
for t_len, k, t_kv in ((37, 24, 100), (5, 70, 64), (9, 8, 3), (4, 1, 10)):
    idx = torch.randint(-1, t_kv + 2, (t_len, k), generator=g, dtype=torch.int32)
    idx[0] = -1
    got, want = row_key_span(idx, t_kv), row_key_span_reference(idx, t_kv)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (t_len, k, t_kv, got, want)
print("OK")
"""


def test_row_key_span_triton_kernel_in_interpreter_and_for_sm90():
    pytest.importorskip("triton")
    from tests.triton_checks import compile_sm90, passed, run_in_interpreter

    from megatron_glm5.kernels.key_block_work import _triton

    assert passed(run_in_interpreter(_SCRIPT))
    ptx = compile_sm90(_triton(), {"IDX": "*i32", "LO": "*i32", "HI": "*i32", "k": "i32", "t_kv": "i32"},
                       {"KP": 2048})
    assert "min.s32" in ptx and "max.s32" in ptx


def test_a_failing_probe_leaves_the_atomic_backward(monkeypatch, caplog):
    from megatron_glm5.kernels import sparse_mla_bwd as bwd

    def broken(*a):
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(bwd, "KeyBlockWorkProbe", broken)
    with caplog.at_level("WARNING"):
        assert _route_of(monkeypatch, causal_sets([256] * 40, 128, seed=5)) == ["atomic"]
    assert "work probe failed (no Triton here)" in caplog.text


def test_packed_bench_builds_per_sequence_sets_and_judges_the_route():
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    try:
        import bench_dkv_key_blocks as bench
    finally:
        sys.path.remove(str(REPO / "scripts" / "bench"))
    idx = bench.packed_indices([5, 3000, 7], torch.device("cpu"))
    starts = torch.tensor([0] * 5 + [5] * 3000 + [3005] * 7)[:, None]
    pos = torch.arange(3012)[:, None]
    valid = idx >= 0
    assert idx.shape == (3012, bench.TOPK) and bool(((idx >= starts) & (idx <= pos) | ~valid).all())
    assert valid.sum(1).tolist() == [min(p + 1, bench.TOPK) for n in (5, 3000, 7) for p in range(n)]
    row = {"batch": "b", "T": 9, "H": 16, "atomic_ms": 2.0, "key_blocks_ms": 1.0, "atomic_tflops": 1.0,
           "key_blocks_tflops": 2.0, "probe_ms": 0.01, "probe_ratio": 4.0, "exact_ratio": 3.9, "route": "atomic",
           "dkv_vs_atomic": 1e-3, "dq_bitwise_atomic": True}
    assert "| 2.00x |" in bench.report_packed([row])[-1] and "| NO |" in bench.report_packed([row])[-1]
    assert "| yes |" in bench.report_packed([dict(row, route="key_blocks")])[-1]


@pytest.mark.parametrize("d_qk", [576, 512])
def test_route_rule_picks_the_faster_backward_on_the_measured_batches(d_qk):
    """The committed H200 rows (eleventh session, ``wsp`` with its two-loop score pass, GLM-5's latent and the NoPE
    one: ``bench_dkv_key_blocks.py --packed all [--d-qk 512]``, packed batches and single sequences of 10K-24K
    tokens): with today's limits, every measured ratio leads to the backward that ran faster, or to either where the two
    ran within 2 % (GLM-5's 20K row: 44.07 vs 44.23 ms). Moving a limit past a measured crossing fails here."""
    import json

    from megatron_glm5.kernels.sparse_mla_dkv import key_blocks_pay

    path = REPO / "scripts" / "bench" / "kernels_round11" / f"4_dkv_packed_{d_qk}.json"
    rows = json.loads(path.read_text())
    assert len(rows) == 13 and max(r["T"] for r in rows) >= 24576
    for r in rows:
        takes = key_blocks_pay(r["H"], r["T"], d_qk, 512, dense_per_sparse=r["probe_ratio"])
        speed_up = r["atomic_ms"] / r["key_blocks_ms"]
        assert takes == (speed_up > 1) or abs(speed_up - 1) < 0.02, (r["batch"], r["probe_ratio"], speed_up)
    assert sum(abs(r["atomic_ms"] / r["key_blocks_ms"] - 1) >= 0.02 for r in rows) >= 12  # the ties are few


def test_key_blocks_over_grouped_follows_the_measured_rows():
    """The rule between the key-block route and the grouped backward picks the faster one on every row of the
    measurement it was fitted to (16 heads, 8K and 16K tokens, random and local sets: ``kernels_round12``), where the
    two differ by more than 2 %; a call within 8K (no work probe) is judged by the 8K ratio."""
    from megatron_glm5.kernels.sparse_mla_bwd import key_blocks_over_grouped

    rows = json.loads((REPO / "scripts/bench/kernels_round12/1_sharing_16h.json").read_text())
    assert len(rows) == 8
    for r in rows:
        ratio = r["dense_over_sparse"]
        if abs(r["key_blocks_ms"] / r["grouped_ms"] - 1) > 0.02:
            assert key_blocks_over_grouped(r["sharing"], ratio) == (r["key_blocks_ms"] < r["grouped_ms"]), r
    assert key_blocks_over_grouped(3.3) and not key_blocks_over_grouped(3.4)  # within 8K: 3.32
    assert key_blocks_over_grouped(2.35, 4.28) and not key_blocks_over_grouped(2.45, 4.28)  # 16K: 2.40


def test_key_blocks_below_the_grouped_backwards_threshold(monkeypatch):
    """Where the fitted costs would prefer the grouped backward but the sets share too few keys for it
    (``GROUPED_BWD_MIN_SHARING``), the backward still takes the key blocks, not the atomic backward: at the route's
    own limit (dense / sparse 4.8) the fitted crossing, 2.239, lies below 2.25."""
    from megatron_glm5.kernels import sparse_mla_bwd as bwd
    from megatron_glm5.kernels.index_groups import GROUPED_BWD_MIN_SHARING, SharingProbe

    limit = KEY_BLOCKS_MAX_DENSE_PER_SPARSE[576, 512]
    sharing = (6.0 / (1 + 0.35 * limit) + GROUPED_BWD_MIN_SHARING) / 2  # between the crossing and 2.25
    fitted = sharing * (1 + bwd.KEY_BLOCKS_DENSE_SLOPE * limit) < bwd.KEY_BLOCKS_OVER_GROUPED
    assert not fitted and sharing < GROUPED_BWD_MIN_SHARING  # the costs alone say grouped; it is not there
    assert bwd.key_blocks_over_grouped(sharing, limit)

    class Probe:
        def sharing(self):
            return sharing

    class Work:
        def __init__(self, *a):
            pass

        def dense_per_sparse(self):
            return limit

    monkeypatch.setattr(bwd, "KeyBlockWorkProbe", Work)
    monkeypatch.setattr(SharingProbe, "start", classmethod(lambda cls, *a: Probe()))
    monkeypatch.setattr(bwd, "grouped_group", lambda *a, **k: 4)
    monkeypatch.setattr(bwd, "group_union_indices", lambda idx, g, key_bound: (idx, idx))
    monkeypatch.setattr(bwd, "load_grouped_backward", lambda *a: None)
    packed = causal_sets([256] * 40, 128, seed=5)  # past 8K tokens: the work probe runs
    assert _route_of(monkeypatch, packed, grouped=True) == ["key_blocks"]
    monkeypatch.setattr(bwd, "GROUPED_BWD_MIN_SHARING", sharing - 0.001)  # grouped possible: the rule prefers it
    assert _route_of(monkeypatch, packed, grouped=True) == ["atomic"]  # the stub's label for any other route
