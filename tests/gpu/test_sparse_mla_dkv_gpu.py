"""The key-block dKV route (``sparse_mla_bwd_interface(dkv_reduce="key_blocks")``: the per-query kernel's dQ pass,
then ``kernels.sparse_mla_dkv``) against the fp32 oracle per element, against the atomic route, and bitwise across
runs. Run on the H200 machine: ``pytest tests/gpu/test_sparse_mla_dkv_gpu.py -q -s``."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa import reference as ref
from megatron_glm5.kernels import sparse_mla_bwd as bwd_mod
from megatron_glm5.kernels import sparse_mla_fwd as fwd_mod
from megatron_glm5.kernels.selection_bitmap import selection_bitmap, selection_bitmap_reference
from megatron_glm5.kernels.sparse_mla_dkv import dkv_key_blocks_reference

from .test_kernels_gpu import SCALE, SCALED_ERR_BOUND, causal_random_indices, scaled_err

pytestmark = pytest.mark.gpu


def _inputs(t_len, heads, topk, d_qk, d_v, seed, starts=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t_len, heads, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(t_len, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = causal_random_indices(t_len, topk, "cuda", generator=g, starts=starts)
    grad_out = torch.randn(t_len, heads, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
    grad_lse = torch.randn(t_len, heads, device="cuda", generator=g)
    return q, kv, idx, grad_out, grad_lse


def _oracle(q, kv, idx, grad_out, grad_lse, d_v):
    qf, kvf = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    out, lse = ref.sparse_mla(qf, kvf, idx, SCALE, d_v, chunk=256)
    torch.autograd.backward((out, lse), (grad_out.float(), grad_lse.masked_fill(torch.isinf(lse), 0)))
    return qf.grad, kvf.grad


@pytest.mark.parametrize(
    "t_len,heads,topk,d_qk,packed",
    [(1500, 16, 512, 576, False), (1500, 64, 512, 576, False), (700, 8, 2048, 576, False),
     (300, 128, 256, 576, False), (1500, 16, 512, 512, False), (1400, 16, 512, 576, True)],
)
def test_key_blocks_match_oracle_and_atomic_route(t_len, heads, topk, d_qk, packed):
    d_v = 512
    starts = None
    if packed:  # three sequences in one THD batch
        bounds = torch.tensor([0, 500, 1100], device="cuda")
        starts = bounds[torch.searchsorted(bounds, torch.arange(t_len, device="cuda"), right=True) - 1]
    q, kv, idx, grad_out, grad_lse = _inputs(t_len, heads, topk, d_qk, d_v, seed=t_len + heads + d_qk, starts=starts)
    idx[3] = -1  # a row without keys
    out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
    dq_a, dkv_a = bwd_mod.sparse_mla_bwd_interface(q, kv, out, lse, grad_out, idx, SCALE, d_v, grad_lse=grad_lse)
    dq_k, dkv_k = bwd_mod.sparse_mla_bwd_interface(q, kv, out, lse, grad_out, idx, SCALE, d_v, grad_lse=grad_lse,
                                                   dkv_reduce="key_blocks")
    dq_ref, dkv_ref = _oracle(q, kv, idx, grad_out, grad_lse, d_v)
    e_q, e_kv, e_a = scaled_err(dq_k, dq_ref), scaled_err(dkv_k, dkv_ref), scaled_err(dkv_k, dkv_a.float())
    print(f"key blocks T={t_len} H={heads} K={topk} d_qk={d_qk} packed={packed}: dq {e_q:.2e} dkv {e_kv:.2e} of the "
          f"max vs the oracle (atomic route dkv {scaled_err(dkv_a, dkv_ref):.2e}); vs the atomic route {e_a:.2e}")
    assert torch.equal(dq_k, dq_a), "the dQ pass must give the atomic kernel's dQ bitwise"
    assert torch.isfinite(dkv_k).all() and e_kv <= SCALED_ERR_BOUND and e_q <= SCALED_ERR_BOUND
    assert e_a <= 2 ** -7


@pytest.mark.parametrize("schedule,heads,d_qk", [("split", 16, 576), ("wsp", 16, 576), ("wsp", 64, 576),
                                                 ("wsp", 8, 576), ("wsp", 16, 512)])
def test_key_blocks_kernel_matches_its_torch_form(schedule, heads, d_qk):
    """The kernel and ``dkv_key_blocks_reference`` (same bitmap, ranges, chunks; P and dS rounded to bf16 alike)
    agree to fp32 summation order: a mask, range, chunk or stage-handover bug would be O(1) here. ``wsp`` (the dKV
    warpgroups load the tiles, two ahead) is also checked run to run; with 1300 tokens its CTAs see odd and even tile
    counts, one and two tiles, and a partial last tile."""
    from megatron_glm5.kernels.sparse_mla_dkv import dkv_key_blocks

    t_len, topk, d_v = (900, 256, 512) if schedule == "split" else (1300, 512, 512)
    q, kv, idx, grad_out, grad_lse = _inputs(t_len, heads, topk, d_qk, d_v, seed=4 + heads + d_qk)
    idx[7] = -1
    out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
    delta = (out.float() * grad_out.float()).sum(-1) - grad_lse
    got = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v, n_chunks=5, schedule=schedule)
    want = dkv_key_blocks_reference(q, kv, grad_out, lse, delta, idx, SCALE, d_v, n_chunks=5)
    err = scaled_err(got, want)
    print(f"key-block kernel ({schedule}, H={heads}, d_qk={d_qk}) vs its torch form: {err:.2e} of the max")
    assert err <= 1e-3
    if schedule == "wsp":
        again = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v, n_chunks=5, schedule=schedule)
        assert torch.equal(got, again)


@pytest.mark.parametrize("heads,d_qk", [(16, 576), (64, 576), (16, 512)])
def test_schedules_equal_bitwise(heads, d_qk):
    """The split schedule (one warpgroup per score GEMM, LSE / Delta / mask staged by cp.async) and the
    warp-specialised one (the default) form every element exactly as the plain one: same GEMM k-order, same fp32 P
    into dS."""
    from megatron_glm5.kernels.sparse_mla_dkv import dkv_key_blocks

    t_len, topk, d_v = 1300, 512, 512
    q, kv, idx, grad_out, grad_lse = _inputs(t_len, heads, topk, d_qk, d_v, seed=heads + d_qk)
    idx[7] = -1
    out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
    delta = (out.float() * grad_out.float()).sum(-1) - grad_lse
    split = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v, n_chunks=3, schedule="split")
    plain = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v, n_chunks=3, schedule="plain")
    wsp = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v, n_chunks=3, schedule="wsp")
    print(f"split vs plain H={heads} d_qk={d_qk}: bitwise={torch.equal(split, plain)} "
          f"max diff {scaled_err(split, plain):.1e}; wsp vs split bitwise={torch.equal(wsp, split)} "
          f"max diff {scaled_err(wsp, split):.1e}")
    assert torch.equal(split, plain) and torch.equal(wsp, split)


def test_key_blocks_are_bitwise_reproducible():
    t_len, heads, topk, d_v = 2500, 16, 1024, 512
    q, kv, idx, grad_out, _ = _inputs(t_len, heads, topk, 576, d_v, seed=7)
    out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
    runs = [bwd_mod.sparse_mla_bwd_interface(q, kv, out, lse, grad_out, idx, SCALE, d_v, dkv_reduce="key_blocks")
            for _ in range(3)]
    assert all(torch.equal(runs[0][0], r[0]) and torch.equal(runs[0][1], r[1]) for r in runs[1:])


def test_selection_bitmap_kernel_matches_oracle_on_device():
    g = torch.Generator(device="cuda").manual_seed(1)
    idx = causal_random_indices(3000, 2048, "cuda", generator=g)
    got, rep = selection_bitmap(idx, 3000)
    want, rep_want = selection_bitmap_reference(idx, 3000)
    assert torch.equal(got, want) and rep.item() == rep_want.item() == 0
    idx[5, 1] = idx[5, 0]
    assert selection_bitmap(idx, 3000)[1].item() == 1


@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_key_blocks_route(deterministic):
    """``sparse_mla_autograd(key_blocks=True)`` at 16 heads takes the key-block backward: dQ bitwise the per-query
    kernel's, dKV bitwise the interface's key-block dKV (also with ``deterministic``, which it satisfies)."""
    t_len, heads, topk, d_v = 1500, 16, 512, 512
    q, kv, idx, grad_out, _ = _inputs(t_len, heads, topk, 576, d_v, seed=11)
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = bwd_mod.sparse_mla_autograd(qg, kvg, idx, SCALE, d_v, deterministic=deterministic, key_blocks=True)
    out.backward(grad_out)
    out_k, lse_k = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
    dq_k, dkv_k = bwd_mod.sparse_mla_bwd_interface(q, kv, out_k, lse_k, grad_out, idx, SCALE, d_v,
                                                   dkv_reduce="key_blocks")
    assert torch.equal(qg.grad, dq_k) and torch.equal(kvg.grad, dkv_k)


def test_row_key_span_kernel_and_bound_on_device():
    """The work probe's Triton span pass against its torch oracle, and its bound against the exact ranges."""
    from megatron_glm5.kernels.key_block_work import dense_pairs_bound, row_key_span, row_key_span_reference
    from megatron_glm5.kernels.selection_bitmap import key_block_query_range

    g = torch.Generator(device="cuda").manual_seed(2)
    bounds = torch.tensor([0, 900, 2500], device="cuda")
    starts = bounds[torch.searchsorted(bounds, torch.arange(3000, device="cuda"), right=True) - 1]
    idx = causal_random_indices(3000, 2048, "cuda", generator=g, starts=starts)
    idx[7] = -1
    lo, hi = row_key_span(idx, 3000)
    lo_want, hi_want = row_key_span_reference(idx, 3000)
    assert torch.equal(lo, lo_want) and torch.equal(hi, hi_want)
    rng = key_block_query_range(selection_bitmap(idx, 3000)[0], 64)
    exact = int((rng[:, 1] - rng[:, 0]).sum()) * 64
    bound = int(dense_pairs_bound(lo, hi, 3000))
    assert exact <= bound <= 1.02 * exact, (exact, bound)


def test_autograd_takes_key_blocks_for_a_packed_batch_past_8k(monkeypatch):
    """Past 8K tokens the forward's work probe decides: a packed batch of 2K-token sequences takes the key-block
    backward (dKV bitwise the interface's key-block dKV), one 32K-token sequence the atomic one (dense work about 8x
    the selected pairs, past every latent's limit)."""
    heads, topk, d_v = 16, 2048, 512
    routes = []
    interface = bwd_mod.sparse_mla_bwd_interface

    def recording(*args, **kwargs):
        routes.append(kwargs.get("dkv_reduce", "atomic"))
        return interface(*args, **kwargs)

    monkeypatch.setattr(bwd_mod, "sparse_mla_bwd_interface", recording)
    for lengths, want_key_blocks in (([2048] * 5, True), ([32768], False)):
        t_len = sum(lengths)
        bounds = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], device="cuda")
        starts = bounds[torch.searchsorted(bounds, torch.arange(t_len, device="cuda"), right=True) - 1]
        g = torch.Generator(device="cuda").manual_seed(t_len)
        q = torch.randn(t_len, heads, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(t_len, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = causal_random_indices(t_len, topk, "cuda", generator=g, starts=starts)
        grad_out = torch.randn(t_len, heads, d_v, device="cuda", dtype=torch.bfloat16, generator=g)
        qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, _ = bwd_mod.sparse_mla_autograd(qg, kvg, idx, SCALE, d_v, key_blocks=True)
        routes.clear()
        out.backward(grad_out)
        reduce = "key_blocks" if want_key_blocks else "atomic"
        assert routes == [reduce], (lengths, routes)
        o, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
        dq, dkv = interface(q, kv, o, lse, grad_out, idx, SCALE, d_v, dkv_reduce=reduce)
        assert torch.equal(qg.grad, dq), lengths
        if want_key_blocks:
            assert torch.equal(kvg.grad, dkv), lengths
        else:  # atomic dKV: the order of the float additions varies
            assert scaled_err(kvg.grad, dkv.float()) < 1e-2, lengths


def test_span_ranges_give_the_bitmap_ranges_result():
    """``dkv_key_blocks(ranges="span")`` (query ranges from the rows' key spans, a superset) on a packed batch with
    rows whose keys jump over whole blocks: within fp32 summation order of the exact ranges' result."""
    from megatron_glm5.kernels.sparse_mla_dkv import dkv_key_blocks

    t_len, heads, topk, d_v = 1400, 16, 512, 512
    bounds = torch.tensor([0, 500, 1100], device="cuda")
    starts = bounds[torch.searchsorted(bounds, torch.arange(t_len, device="cuda"), right=True) - 1]
    q, kv, idx, grad_out, grad_lse = _inputs(t_len, heads, topk, 576, d_v, seed=21, starts=starts)
    idx[1300:] = -1
    idx[1300:, 0] = torch.arange(1300, 1400, dtype=torch.int32, device="cuda")
    idx[1300:, 1] = 1100  # the sequence start: the span covers blocks these rows do not select
    out, lse = fwd_mod.sparse_mla_fwd_interface(q, kv, idx, SCALE, d_v)
    delta = (out.float() * grad_out.float()).sum(-1) - grad_lse
    exact = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v)
    span = dkv_key_blocks(q, kv, grad_out, lse, delta, idx, SCALE, d_v, ranges="span")
    err = scaled_err(span, exact)
    print(f"span vs bitmap ranges: {err:.1e} of the max, bitwise {torch.equal(span, exact)}")
    assert err <= 1e-5
