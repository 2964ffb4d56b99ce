"""KPool indexer reference (``megatron_glm5.dsa.kpool``) against transformers 5.24's ``Glm5NextTextIndexer`` on tiny
random weights: identical index sets per row (exact rows where no score is near-tied), THD packing equal to
per-document runs, left-padding anchoring, sequences shorter and longer than ``index_topk``.

Near-ties: a row whose k-th and (k+1)-th candidate pool scores are within ``TIE_TOL`` can legitimately select a
different pool (two correct implementations round differently); such rows are skipped, reported as warnings, and
at least 90% of the rows must be checked. 8 indexer heads keep ReLU zero plateaus (exact ties) rare.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_glm5.dsa.kpool import kpool_indexer_topk, kpool_topk, pool_keys, topk_width
from megatron_glm5.dsa.reference import causal_bounds, indexer_scores, uniform_cu_seqlens

HIDDEN, Q_LORA, HEADS, HEAD_DIM = 64, 24, 8, 16
TIE_TOL = 1e-5  # relative gap between neighbouring pool scores below which a row counts as near-tied
MIN_CHECKED = 0.9


def make_indexer(pool: int, index_topk: int, select_tail: bool = True, seed: int = 0):
    """transformers' own indexer module on a tiny config, every parameter random (the compress gate/ape start at
    zero in transformers, which would make pooling a plain mean)."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = Glm5NextTextConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=Q_LORA, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=index_topk,
        index_head_dim=HEAD_DIM, index_n_heads=HEADS, index_kpool=pool,
        index_kpool_always_select_tail=select_tail, linear_head_dim=8, linear_num_heads=4, pad_token_id=0,
    )
    module = Glm5NextTextIndexer(cfg, layer_idx=3).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if name.startswith("k_norm") or "compress" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name == "k_norm.weight" else 0.0))
    return module


def our_inputs(module, x: torch.Tensor, q_resid: torch.Tensor):
    """The reference's inputs from the module's weights: x ``[T, hidden]``, q_resid ``[T, q_lora]``."""
    with torch.no_grad():
        q = module.wq_b(q_resid).view(x.shape[0], HEADS, HEAD_DIM)
        k = module.k_norm(module.wk(x))
        gate = x @ module.index_kpool_compress_gate.T
        weights = module.weights_proj(x) * HEADS**-0.5 * HEAD_DIM**-0.5
    return q, k, gate, module.index_kpool_compress_ape.detach(), weights


def ours(module, x, q_resid, cu, index_topk, select_tail=True, chunk=1024):
    q, k, gate, ape, w = our_inputs(module, x, q_resid)
    return kpool_indexer_topk(q, k, gate, ape, w, cu, index_topk=index_topk, select_tail=select_tail, chunk=chunk)


def hf(module, x, q_resid, mask=None):
    """transformers on a batch ``[B, S, ...]``; returns int32 ``[B, S, width]``."""
    if mask is None:
        mask = torch.ones(x.shape[:2], dtype=torch.bool)
    return module(hidden_states=x, q_resid=q_resid, attention_mask=mask, cache=None)


def candidate_scores(module, x, q_resid, cu):
    """Per query row, the sorted (descending) scores of its candidate pools and its select_k (test-side, small T)."""
    q, k, gate, ape, w = our_inputs(module, x, q_resid)
    pools = pool_keys(k, gate, ape, cu)
    starts, ends = causal_bounds(cu, total=x.shape[0])
    scores = indexer_scores(q, pools.keys, w)  # [T, N]
    out = []
    for t in range(x.shape[0]):
        if ends[t] <= starts[t]:
            out.append((torch.empty(0), 0))
            continue
        d = int(torch.searchsorted(pools.cu_seqlens[1:], starts[t : t + 1].long(), right=True))
        a, b = int(pools.doc_pool_start[d]), int(pools.doc_pool_start[d + 1])
        n_cand = int(ends[t] - starts[t]) // pools.pool_size
        select_k = min(module.index_topk // pools.pool_size, b - a)
        out.append((scores[t, a : a + n_cand].sort(descending=True).values, select_k))
    return out


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= TIE_TOL * max(1.0, abs(a), abs(b))


def compare_rows(got: torch.Tensor, want: torch.Tensor, cand, label: str) -> None:
    """Index sets equal on every row without a boundary near-tie; whole rows (order, -1 slots, tail) equal on rows
    with no near-tie among the selected pools. Near-tied rows are reported, and >= 90% must be checked."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int32, (got.shape, want.shape, got.dtype)
    skipped, checked = [], 0
    for t in range(got.shape[0]):
        s, k = cand[t]
        n = s.numel()
        boundary_tie = n > k > 0 and _near(float(s[k - 1]), float(s[k]))
        if boundary_tie:
            skipped.append(t)
            continue
        g, w = got[t], want[t]
        assert set(g[g >= 0].tolist()) == set(w[w >= 0].tolist()), f"{label} row {t}: {g.tolist()} vs {w.tolist()}"
        top = s[: min(n, k + 1)]
        if not any(_near(float(top[i]), float(top[i + 1])) for i in range(top.numel() - 1)):
            assert torch.equal(g, w), f"{label} row {t} (no near-tie) order differs: {g.tolist()} vs {w.tolist()}"
        checked += 1
    if skipped:
        warnings.warn(f"{label}: {len(skipped)} near-tied rows not compared: {skipped}")
    assert checked >= MIN_CHECKED * got.shape[0], f"{label}: only {checked}/{got.shape[0]} rows checked"


def random_inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=gen), torch.randn(n, Q_LORA, generator=gen)


# (P, index_topk): the released pool size, transformers' default pool size, and P = 1 (no tail slots)
POOLS = [(4, 16), (16, 32), (1, 8)]


@pytest.mark.parametrize("pool, index_topk", POOLS)
@pytest.mark.parametrize("kind", ["shorter-than-topk", "longer-than-topk"])
def test_single_sequence_matches_transformers(pool, index_topk, kind):
    seqlen = index_topk - 3 if kind == "shorter-than-topk" else 90
    module = make_indexer(pool, index_topk)
    x, qr = random_inputs(seqlen, seed=seqlen)
    cu = uniform_cu_seqlens(1, seqlen)
    got = ours(module, x, qr, cu, index_topk)
    want = hf(module, x[None], qr[None])[0]
    compare_rows(got, want, candidate_scores(module, x, qr, cu), f"P={pool} S={seqlen}")
    if seqlen <= index_topk:  # every complete pool plus the tail: dense causal attention
        for t in range(seqlen):
            assert sorted(v for v in got[t].tolist() if v >= 0) == list(range(t + 1))


def test_batch_matches_transformers():
    """A bshd batch of two equal-length rows, flattened batch-major."""
    pool, index_topk, b, s = 4, 16, 2, 50
    module = make_indexer(pool, index_topk, seed=1)
    x, qr = random_inputs(b * s, seed=7)
    cu = uniform_cu_seqlens(b, s)
    got = ours(module, x, qr, cu, index_topk)
    want = hf(module, x.view(b, s, -1), qr.view(b, s, -1))
    want = torch.where(want >= 0, want + torch.arange(b)[:, None, None] * s, want).to(torch.int32).view(b * s, -1)
    compare_rows(got, want, candidate_scores(module, x, qr, cu), "batch")


def test_tail_off_matches_transformers():
    pool, index_topk, s = 4, 16, 70
    module = make_indexer(pool, index_topk, select_tail=False, seed=2)
    x, qr = random_inputs(s, seed=3)
    cu = uniform_cu_seqlens(1, s)
    got = ours(module, x, qr, cu, index_topk, select_tail=False)
    assert got.shape == (s, index_topk)
    compare_rows(got, hf(module, x[None], qr[None])[0], candidate_scores(module, x, qr, cu), "no tail")
    assert (got[: pool - 1] == -1).all()  # before the first complete pool a query sees nothing without the tail


@pytest.mark.parametrize("pool, index_topk", POOLS[:2])
def test_thd_packing_equals_per_document_runs(pool, index_topk):
    """3 packed documents (one shorter than index_topk, lengths not multiples of P): each document anchors its pools
    at its own start. Equal to transformers run per document (indices offset by the document start), and exactly
    equal to our own per-document runs."""
    lengths = [37, index_topk - 5, 58]
    module = make_indexer(pool, index_topk, seed=3)
    x, qr = random_inputs(sum(lengths), seed=11)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = ours(module, x, qr, cu, index_topk)
    cand = candidate_scores(module, x, qr, cu)
    for i, n in enumerate(lengths):
        a = int(cu[i])
        xs, qs = x[a : a + n], qr[a : a + n]
        want = hf(module, xs[None], qs[None])[0]
        want = torch.where(want >= 0, want + a, want).to(torch.int32)
        compare_rows(packed[a : a + n], want, cand[a : a + n], f"doc {i}")
        alone = ours(module, xs, qs, uniform_cu_seqlens(1, n), index_topk)
        assert torch.equal(packed[a : a + n], torch.where(alone >= 0, alone + a, alone).to(torch.int32))


def test_left_padding_anchors_like_a_document():
    """transformers anchors pools at the first non-pad token: a left-padded row equals our run of the document."""
    pool, index_topk, pad, n = 4, 16, 3, 45
    module = make_indexer(pool, index_topk, seed=4)
    x, qr = random_inputs(pad + n, seed=5)
    mask = torch.ones(1, pad + n, dtype=torch.bool)
    mask[0, :pad] = False
    want = hf(module, x[None], qr[None], mask)[0]
    assert (want[:pad] == -1).all()
    doc = ours(module, x[pad:], qr[pad:], uniform_cu_seqlens(1, n), index_topk)
    doc = torch.where(doc >= 0, doc + pad, doc).to(torch.int32)
    compare_rows(doc, want[pad:], candidate_scores(module, x[pad:], qr[pad:], uniform_cu_seqlens(1, n)), "left pad")


# --------------------------------------------------------------------------------------------------------------------
# properties (no transformers)
# --------------------------------------------------------------------------------------------------------------------


def test_invariants_and_chunking():
    """Chunk size does not change the result; every index is causal and in the query's document; selected pools are
    whole; with the tail on every live row sees at least its own pool's visible rows; padding rows are all -1."""
    pool, index_topk = 4, 16
    lengths = [29, 3, 66]
    total = sum(lengths) + 5  # 5 padding rows past cu_seqlens[-1]
    module = make_indexer(pool, index_topk, seed=6)
    x, qr = random_inputs(total, seed=9)
    cu = torch.tensor([0, 29, 32, 98], dtype=torch.int32)
    full = ours(module, x, qr, cu, index_topk)
    assert torch.equal(full, ours(module, x, qr, cu, index_topk, chunk=7))
    assert full.shape == (total, topk_width(index_topk, pool)) and full.dtype == torch.int32
    starts, ends = causal_bounds(cu, total=total)
    for t in range(total):
        row = full[t]
        vals = row[row >= 0]
        if ends[t] <= starts[t]:
            assert vals.numel() == 0
            continue
        assert ((vals >= starts[t]) & (vals < ends[t])).all() and vals.unique().numel() == vals.numel()
        n_vis = int(ends[t] - starts[t])
        tail_rows = set(range(int(starts[t]) + n_vis - n_vis % pool, int(ends[t])))
        assert tail_rows <= set(vals.tolist())
        pooled = sorted(set(vals.tolist()) - tail_rows)
        assert len(pooled) % pool == 0
        for j in range(0, len(pooled), pool):  # whole pools, anchored at the document start
            block = pooled[j : j + pool]
            assert (block[0] - int(starts[t])) % pool == 0 and block == list(range(block[0], block[0] + pool))


def test_bad_arguments():
    q, w = torch.zeros(8, 2, 4), torch.zeros(8, 2)
    pools = pool_keys(torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(4, 4), uniform_cu_seqlens(1, 8))
    starts, ends = causal_bounds(uniform_cu_seqlens(1, 8))
    with pytest.raises(ValueError, match=r"index_topk \(10\) must be a multiple of index_kpool \(4\)"):
        kpool_topk(q, w, pools, starts, ends, index_topk=10)
    with pytest.raises(ValueError, match="not a document start"):
        kpool_topk(q, w, pools, starts + 1, ends + 1, index_topk=8)
    with pytest.raises(ValueError, match=r"ape must be \[P, D=4\]"):
        pool_keys(torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(4, 3), uniform_cu_seqlens(1, 8))
