"""Kernel variant sweep for the DSA kernels' round 2 (one H200): which tile and epilogue settings to make the default.

Sections (each prints one markdown table; ``--out`` also writes them):

* ``ties``: identical key rows through the indexer logits kernel: rows whose scores are not all bitwise equal, with
  and without ``exact_products``, plus one-hot head weights (the GEMM alone), and the full ``indexer_topk`` against
  the closed form (the first ``topk`` keys of each row).
* ``logits``: the indexer logits kernel at 32K (32 x 128 heads): tiles, stages and ``exact_products`` of the
  warp-specialised kernel, the kernel without warp specialisation (``_jit_logits_plain``, 2-3 CTAs per SM; the
  interface's) and the overlapped one (``_jit_logits_overlap``: tile n + 1's GEMM under tile n's epilogue, 3 or 4
  key stages); outputs compared bitwise with the first's.
* ``first_round``: the indexer end to end (logits + select) at 8K and 32K with and without the select's first radix
  round counted by the logits kernel (``hist`` / ``pre_hist``), plain and overlapped logits; top-k compared.
* ``select``: the top-k select at 8K / 32K / 64K: threads and the CTAs per SM its registers leave room for; every
  variant's output must equal the default's (the selection is exact, so any difference is a bug).
* ``bwd``: the sparse-MLA backward at 16K, 64 and 16 heads: ``block_s`` / threads / ``dkv_split`` / ``dkv_reduce``
  (float2 atomics or bulk reductions); gradients compared with the current default's (max error over the tensor's
  max magnitude).
* ``bwd_bulk``: the bulk dKV reduction against the atomics through the interface: NoPE at 64 heads, the grouped
  backward on random and 90 %-local sets.
* ``union``: the union build of the grouped kernels (``kernels.index_groups``) at 4 / 8 warps against the torch
  oracle, at 16K and 64K, bitwise compared.
* ``route``: the autograd route (forward + backward, union builds included) with ``grouped`` off and on.
* ``grouped``: the grouped forward and backward (the interfaces' ``group=4``, the default route at 16 heads: 4
  queries x 16 heads per CTA over the union of their sets; and the backward's experimental 32-row ``group=2``)
  against the per-query kernels at 16K / 16 heads, on random index sets and on sets with locality, with the union
  builds' cost and the output / gradient differences.

The round-2 runs (``scripts/bench/kernels_round2/sweep*.md``) also measured variants whose code was not kept (a select
holding its row in shared memory, a two-pass select with a candidate list): see ``RESULTS_kernels.md``.

    source .gpu/install.sh && python scripts/bench/sweep_dsa_round2.py --workers 16 --out sweep.md
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsa_kernels import build_in_parallel, causal_random_indices, run_sweep_sections, timed  # noqa: E402

SCALE = 1.0 / 16
IDX = "megatron_glm5.kernels.indexer_topk"
BWD = "megatron_glm5.kernels.sparse_mla_bwd"
# (block_n, num_stages, threads, block_q, exact_products); the default first
LOGITS_VARIANTS = [(128, 2, 256, 4, True)]
# the logits kernel without warp specialisation (_jit_logits_plain): (block_n, threads, min_blocks[, block_q]);
# the interface's default first
PLAIN_VARIANTS = [(128, 128, 2), (64, 128, 3), (64, 128, 2)]
# the overlapped logits kernel (_jit_logits_overlap: tile n + 1's GEMM under tile n's epilogue): (block_n, threads,
# min_blocks, stages[, hist, storage_sync])
OVERLAP_VARIANTS = [(64, 128, 2, 3), (64, 128, 2, 4), (64, 128, 2, 3, False, True)]  # the last: TileLang's syncs
# (threads, min_blocks: 0 = 2048 // threads, batch: scores loaded per thread before binning[, digit_bits: the score
# digits' width, 8 by default[, lean: fewer instructions per score[, shortlist entries]]]); the kernel before the
# lean one first
SELECT_VARIANTS = [(256, 0, 4, 8, False, 0), (256, 0, 4, 8, True, 0), (256, 0, 4, 8, True, 256),
                   (256, 0, 2, 8, True, 256), (256, 0, 8, 8, True, 0)]
# (block_s, threads, dkv_split, dkv_reduce); the default first
BWD_VARIANTS = {64: [(32, 0, 4, "atomic"), (32, 0, 4, "bulk"), (32, 0, 2, "atomic")],
                16: [(32, 0, 4, "atomic"), (32, 0, 4, "bulk"), (32, 0, 2, "atomic")]}


# sections whose kernels are known by factory name (the others build the whole list)
SECTION_KERNELS = {"select": {"_jit_select", "_jit_logits"},
                   "logits": {"_jit_logits", "_jit_logits_plain", "_jit_logits_overlap"},
                   "first_round": {"_jit_logits_plain", "_jit_logits_overlap", "_jit_select"}}


def kernels_to_build() -> list[tuple]:
    cases = [(IDX, "_jit_logits", (32, 128, *v)) for v in LOGITS_VARIANTS]
    cases += [(IDX, "_jit_logits_plain", (32, 128, *v)) for v in PLAIN_VARIANTS]
    cases += [(IDX, "_jit_logits_overlap", (32, 128, *v)) for v in OVERLAP_VARIANTS]
    # the first radix round counted by the logits kernels, and the select that starts after it (section first_round)
    cases += [(IDX, "_jit_logits_plain", (32, 128, 128, 128, 2, 0, True)),
              (IDX, "_jit_logits_overlap", (32, 128, 64, 128, 2, 3, True)),
              (IDX, "_jit_select", (2048,)), (IDX, "_jit_select", (2048, 256, 0, 4, 8, True, None, True))]
    cases += [(IDX, "_jit_select", (2048, *v)) for v in SELECT_VARIANTS]
    cases += [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (16, 576, 512, SCALE)),
              ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (16, 576, 512, SCALE, 64, 4)),
              (BWD, "_jit_bwd", (16, 576, 512, SCALE, False)),
              (BWD, "_jit_bwd", (16, 576, 512, SCALE, False, 32, 0, False, 0, 2)),
              (BWD, "_jit_bwd", (16, 576, 512, SCALE, False, 32, 0, False, 0, 4))]
    for h, variants in BWD_VARIANTS.items():
        cases += [(BWD, "_jit_bwd", (h, 576, 512, SCALE, False, bs, th, False, sp, 1, red))
                  for bs, th, sp, red in variants]
        cases += [(BWD, "_jit_delta", (h, 512))]
    cases += [(BWD, "_jit_bwd", (16, 576, 512, SCALE, False, 32, 0, False, 0, 4, "bulk")),
              (BWD, "_jit_bwd", (64, 512, 512, SCALE, False, 32, 0, False, 0, 1, "bulk")),
              (BWD, "_jit_bwd", (64, 512, 512, SCALE, False))]
    return cases


def indexer_inputs(seq: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(seq, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(seq, 32, device="cuda", generator=g) * (32**-0.5 * 128**-0.5)
    starts = torch.zeros(seq, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, seq + 1, dtype=torch.int32, device="cuda")
    return q, k, w, starts, ends


def run_logits(kernel, q, k, w, starts, ends, rows: int, buf: torch.Tensor):
    seq = q.shape[0]
    for c0 in range(0, seq, rows):
        c1 = min(seq, c0 + rows)
        kernel(q, k, w, starts, ends, torch.full((1,), c0, dtype=torch.int32, device="cuda"), buf[: c1 - c0])


def section_ties() -> list[str]:
    im = importlib.import_module(IDX)
    t_len = 3000
    q, _, w, starts, ends = indexer_inputs(t_len, seed=8)
    k = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16).expand(t_len, 128).contiguous()
    onehot = torch.zeros_like(w)
    onehot[:, 0] = 1.0
    tri = torch.ones(t_len, t_len, dtype=torch.bool, device="cuda").tril()
    lines = ["| logits variant | weights | rows with unequal scores (of 3000) | max spread / max score |", "|---|---|---|---|"]
    for v in LOGITS_VARIANTS[:2]:
        for wname, weights in (("random", w), ("one-hot", onehot)):
            kern = im._jit_logits()(32, 128, *v)
            buf = torch.zeros(t_len, t_len, device="cuda")
            run_logits(kern, q, k, weights, starts, ends, t_len, buf)
            hi = torch.where(tri, buf, -float("inf")).amax(dim=1)
            lo = torch.where(tri, buf, float("inf")).amin(dim=1)
            spread = float(((hi - lo) / hi.abs().clamp_min(1e-30)).max())
            lines.append(f"| exact products {v[4]} | {wname} | {int((hi != lo).sum())} | {spread:.1e} |")
    out = im.indexer_topk_interface(q, k, w, starts, ends, 512)
    expect = torch.arange(512, device="cuda", dtype=torch.int32).expand(t_len, 512).clone()
    expect[expect >= ends[:, None]] = -1
    bad = int((out != expect).any(dim=1).sum())
    lines.append(f"\nindexer_topk (default config) on identical keys: {bad} of {t_len} rows differ from the closed form")
    return lines


def section_logits(seq: int = 32768, check_seq: int = 5000) -> list[str]:
    im = importlib.import_module(IDX)
    q, k, w, starts, ends = indexer_inputs(seq)
    rows = im.logits_chunk_rows(seq, 4)
    buf = torch.empty(rows, seq, device="cuda")
    pairs = seq * (seq + 1) / 2
    # exactness on a length with partial tiles: every causal entry written and bitwise equal to the default's
    cq, ck, cw, cs, ce = indexer_inputs(check_seq, seed=3)
    cbuf = torch.empty(check_seq, check_seq, device="cuda")
    causal = torch.ones(check_seq, check_seq, dtype=torch.bool, device="cuda").tril()
    # the same tokens as 1K-token documents (packed): short rows, where a CTA's steps past its last tile weigh more
    from megatron_glm5.kernels.bounds import causal_bounds

    p_starts, p_ends = causal_bounds(torch.arange(0, seq + 1, 1024, dtype=torch.int32, device="cuda"))
    p_pairs = (seq // 1024) * 1024 * 1025 / 2
    lines = [f"| logits (S={seq}): ws (block_n, stages, threads, block_q, exact), plain (block_n, threads, "
             f"min CTAs per SM[, queries per CTA]) or overlap (block_n, threads, min CTAs, stages) | ms "
             f"| TFLOP/s (causal pairs) | packed 1K documents ms (TFLOP/s) "
             f"| bitwise equal to the first at {check_seq} tokens |",
             "|---|---|---|---|---|"]
    ref = None
    variants = ([("ws", v) for v in LOGITS_VARIANTS] + [("plain", v) for v in PLAIN_VARIANTS]
                + [("overlap", v) for v in OVERLAP_VARIANTS])
    factories = {"ws": im._jit_logits, "plain": im._jit_logits_plain, "overlap": im._jit_logits_overlap}
    for family, v in variants:
        kern = factories[family]()(32, 128, *v)
        ms = timed(lambda: run_logits(kern, q, k, w, starts, ends, rows, buf))
        p_ms = timed(lambda: run_logits(kern, q, k, w, p_starts, p_ends, rows, buf))
        cbuf.fill_(float("nan"))  # an entry the kernel does not write fails the comparison
        run_logits(kern, cq, ck, cw, cs, ce, check_seq, cbuf)
        got = cbuf[causal]
        same = "-" if ref is None else str(bool(torch.equal(got, ref)))
        ref = got.clone() if ref is None else ref
        lines.append(f"| {family} {v} | {ms:.2f} | {2 * pairs * 32 * 128 / ms / 1e9:.0f} "
                     f"| {p_ms:.3f} ({2 * p_pairs * 32 * 128 / p_ms / 1e9:.0f}) | {same} |")
    return lines


def section_first_round(seqs=(8192, 32768), topk: int = 2048) -> list[str]:
    """The indexer end to end (logits + select, chunked as the interface runs them) with and without the select's
    first radix round counted by the logits kernel (``hist`` / ``pre_hist``), on the plain and the overlapped logits
    kernels; every variant's top-k must equal the first's."""
    im = importlib.import_module(IDX)
    lines = ["| S | logits kernel | first round | ms (logits + select) | speed-up | top-k equal to the first |",
             "|---|---|---|---|---|---|"]
    for seq in seqs:
        q, k, w, starts, ends = indexer_inputs(seq)
        rows = im.logits_chunk_rows(seq, 4)
        buf = torch.empty(rows, seq, device="cuda")
        counts = torch.empty(rows, im.FIRST_ROUND_BINS, dtype=torch.int32, device="cuda")
        out = torch.empty(seq, topk, dtype=torch.int32, device="cuda")
        ref = base = None
        for name, factory, args in (("plain", im._jit_logits_plain, (32, 128)),
                                    ("overlap 3", im._jit_logits_overlap, (32, 128, 64, 128, 2, 3))):
            for counted in (False, True):
                logits = factory()(*args, *((128, 128, 2, 0, True) if counted and name == "plain" else
                                            (True,) if counted else ()))
                select = im._jit_select()(topk, pre_hist=True) if counted else im._jit_select()(topk)

                def run():
                    for c0 in range(0, seq, rows):
                        c1 = min(seq, c0 + rows)
                        off = torch.full((1,), c0, dtype=torch.int32, device="cuda")
                        if counted:
                            logits(q, k, w, starts, ends, off, buf[: c1 - c0], counts[: c1 - c0])
                            select(buf[: c1 - c0], counts[: c1 - c0], starts, ends, off, out)
                        else:
                            logits(q, k, w, starts, ends, off, buf[: c1 - c0])
                            select(buf[: c1 - c0], starts, ends, off, out)

                ms = timed(run)
                run()
                same = "-" if ref is None else str(bool(torch.equal(out, ref)))
                ref = out.clone() if ref is None else ref
                base = base or ms
                lines.append(f"| {seq} | {name} | {'counted' if counted else 'select pass'} | {ms:.2f} "
                             f"| {base / ms:.2f}x | {same} |")
        del q, k, w, buf, counts, out, ref
        torch.cuda.empty_cache()
    return lines


def section_grouped(seq: int = 16384, heads: int = 16, localities=(None, 0.5, 0.9, 1.0)) -> list[str]:
    """The grouped forward and backward (4 queries x 16 heads per CTA over the union of their index sets)
    against the per-query kernels, on random index sets and on sets with locality (``local_mix_indices``)."""
    from bench_dsa_kernels import group_sharing, local_mix_indices

    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.index_groups import group_union_indices
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(seq, heads, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(seq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    group = 64 // heads
    lines = [f"| indices (S={seq}, {heads} heads) | sharing (groups of {group}) | per-query fwd ms | union build ms "
             "| grouped fwd ms | speed-up (kernel / with build) | out max err | lse max err "
             "| bwd ms (per-query / grouped) | bwd speed-up | dq / dkv err (of max) "
             "| group 2 bwd: union build ms / bwd ms / speed-up / dq, dkv err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    do = torch.randn(seq, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    for loc in localities:
        dev = torch.device("cuda")
        idx = causal_random_indices(seq, 2048, dev) if loc is None else local_mix_indices(seq, 2048, dev, loc)
        vlen = row_valid_len(idx)
        pairs = float(vlen.sum())
        base = timed(lambda: sparse_mla_fwd_interface(q, kv, idx, SCALE, 512, valid_len=vlen))
        build = timed(lambda: group_union_indices(idx, group, key_bound=seq))
        union = group_union_indices(idx, group, key_bound=seq)
        out_b, lse_b = sparse_mla_fwd_interface(q, kv, idx, SCALE, 512, valid_len=vlen)  # the per-query reference
        try:
            ms = timed(lambda: sparse_mla_fwd_interface(q, kv, idx, SCALE, 512, group=group, union=union))
            out_g, lse_g = sparse_mla_fwd_interface(q, kv, idx, SCALE, 512, group=group, union=union)
            err_o = float((out_g.float() - out_b.float()).abs().max())
            fin = torch.isfinite(lse_b)
            err_l = float((lse_g[fin] - lse_b[fin]).abs().max()) if bool(fin.any()) else 0.0
            same_inf = bool(torch.equal(torch.isinf(lse_g), torch.isinf(lse_b)))
            res = (f"{ms:.2f} | {base / ms:.2f} / {base / (ms + build):.2f} | {err_o:.2e} | "
                   f"{err_l:.2e}{'' if same_inf else ' (empty rows differ)'}")
        except Exception as err:  # report and go on
            res = f"FAILED {err!r}"[:200] + " | | |"
        try:
            b_ms = timed(lambda: sparse_mla_bwd_interface(q, kv, out_b, lse_b, do, idx, SCALE, 512, valid_len=vlen))
            g_ms = timed(lambda: sparse_mla_bwd_interface(q, kv, out_b, lse_b, do, idx, SCALE, 512, group=group,
                                                          union=union))
            dq_b, dkv_b = sparse_mla_bwd_interface(q, kv, out_b, lse_b, do, idx, SCALE, 512, valid_len=vlen)
            dq_g, dkv_g = sparse_mla_bwd_interface(q, kv, out_b, lse_b, do, idx, SCALE, 512, group=group, union=union)
            eq = float((dq_g.float() - dq_b.float()).abs().max() / dq_b.float().abs().max())
            ekv = float((dkv_g.float() - dkv_b.float()).abs().max() / dkv_b.float().abs().max())
            res += f" | {b_ms:.2f} / {g_ms:.2f} | {b_ms / g_ms:.2f} | {eq:.1e} / {ekv:.1e}"
        except Exception as err:
            res += f" | FAILED {err!r}"[:200] + " | |"
        try:  # the experimental 32-row tiles (2 queries): no register spills, less sharing, its own union
            build2 = timed(lambda: group_union_indices(idx, 2, key_bound=seq))
            union2 = group_union_indices(idx, 2, key_bound=seq)
            g2_ms = timed(lambda: sparse_mla_bwd_interface(q, kv, out_b, lse_b, do, idx, SCALE, 512, group=2,
                                                           union=union2))
            dq_2, dkv_2 = sparse_mla_bwd_interface(q, kv, out_b, lse_b, do, idx, SCALE, 512, group=2, union=union2)
            e2 = float((dq_2.float() - dq_b.float()).abs().max() / dq_b.float().abs().max())
            ekv2 = float((dkv_2.float() - dkv_b.float()).abs().max() / dkv_b.float().abs().max())
            res += f" | {build2:.2f} / {g2_ms:.2f} / {b_ms / g2_ms:.2f} / {e2:.1e}, {ekv2:.1e}"
            del union2
        except Exception as err:
            res += f" | FAILED {err!r}"[:200]
        name = "random" if loc is None else f"local {loc:g}"
        lines.append(f"| {name} | {group_sharing(idx, group):.2f} | {base:.2f} ({2 * pairs * heads * 1088 / base / 1e9:.0f} "
                     f"TFLOP/s) | {build:.2f} | {res} |")
        del idx, vlen, union, out_b, lse_b
        torch.cuda.empty_cache()
    return lines


def section_union(seqs=(16384, 65536), localities=(None, 0.9),
                  warps=(4, 8)) -> list[str]:
    """The union build (``group_union_indices``, its warps) against the torch oracle it replaces: time, and whether
    every row equals the oracle's (the kernel's rows are wider: the rest must be -1). The sort-based builds measured
    in round 2's second session are in ``RESULTS_kernels.md``."""
    from bench_dsa_kernels import local_mix_indices

    from megatron_glm5.kernels.index_groups import group_union_indices, group_union_indices_reference

    names = [f"kernel {w} warps ms" for w in warps]
    lines = ["| S | indices | torch oracle ms | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(warps)]
    for seq in seqs:
        for loc in localities:
            dev = torch.device("cuda")
            idx = causal_random_indices(seq, 2048, dev) if loc is None else local_mix_indices(seq, 2048, dev, loc)
            ref_u, ref_l = group_union_indices_reference(idx, 4)
            ref_ms = timed(lambda: group_union_indices_reference(idx, 4))
            cells = []
            for w in warps:
                try:
                    ms = timed(lambda: group_union_indices(idx, 4, key_bound=seq, num_warps=w))
                    u, n = group_union_indices(idx, 4, key_bound=seq, num_warps=w)
                    width = ref_u.shape[1]
                    same = bool(torch.equal(n, ref_l) and torch.equal(u[:, :width], ref_u)
                                and bool((u[:, width:] == -1).all()))
                    cells.append(f"{ms:.3f}" + ("" if same else " (differs from the oracle)"))
                except Exception as err:  # report, go on
                    cells.append(f"FAILED {err!r}"[:80])
            name = "random" if loc is None else f"local {loc:g}"
            lines.append(f"| {seq} | {name} | {ref_ms:.2f} | " + " | ".join(cells) + " |")
            del idx, ref_u, ref_l
            torch.cuda.empty_cache()
    return lines


def section_route(seq: int = 16384, heads: int = 16, localities=(None, 0.5, 0.9, 1.0)) -> list[str]:
    """The autograd route (``sparse_mla_autograd``, forward + backward) with ``grouped`` off and on, union builds and
    the sharing probe included: what a training step sees."""
    from bench_dsa_kernels import group_sharing, local_mix_indices

    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_autograd

    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(seq, heads, 576, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kv = torch.randn(seq, 576, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(seq, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    lines = [f"| indices (S={seq}, {heads} heads) | sharing | fwd+bwd ms, per-query | fwd+bwd ms, grouped route "
             "| speed-up |", "|---|---|---|---|---|"]
    for loc in localities:
        dev = torch.device("cuda")
        idx = causal_random_indices(seq, 2048, dev) if loc is None else local_mix_indices(seq, 2048, dev, loc)

        def step(grouped: bool):
            q.grad = kv.grad = None
            out, _ = sparse_mla_autograd(q, kv, idx, SCALE, 512, grouped=grouped)
            out.backward(do)

        base, grp = timed(lambda: step(False)), timed(lambda: step(True))
        name = "random" if loc is None else f"local {loc:g}"
        lines.append(f"| {name} | {group_sharing(idx, 4):.2f} | {base:.2f} | {grp:.2f} | {base / grp:.2f} |")
        del idx
        torch.cuda.empty_cache()
    return lines


def section_select(seqs=(8192, 32768, 65536)) -> list[str]:
    im = importlib.import_module(IDX)
    lines = ["| S | threads | min CTAs per SM | batch | digit bits | lean | shortlist | select ms (all chunks) "
             "| equal to the first variant |",
             "|---|---|---|---|---|---|---|---|---|"]
    for seq in seqs:
        q, k, w, starts, ends = indexer_inputs(seq)
        rows = im.logits_chunk_rows(seq, 4)
        chunks = [(c0, min(seq, c0 + rows)) for c0 in range(0, seq, rows)]
        bufs = []
        lk = im._jit_logits()(32, 128)
        for c0, c1 in chunks:  # every chunk's logits kept (a few GiB at 64K)
            b = torch.empty(c1 - c0, seq, device="cuda")
            lk(q, k, w, starts, ends, torch.full((1,), c0, dtype=torch.int32, device="cuda"), b)
            bufs.append((torch.full((1,), c0, dtype=torch.int32, device="cuda"), b))
        ref = None
        for v in SELECT_VARIANTS:
            sk = im._jit_select()(2048, *v)
            out = torch.full((seq, 2048), -7, dtype=torch.int32, device="cuda")
            ms = timed(lambda: [sk(b, starts, ends, o, out) for o, b in bufs])
            same = "-" if ref is None else str(bool(torch.equal(out, ref)))
            ref = out.clone() if ref is None else ref
            bits = v[3] if len(v) > 3 else 8
            lean = bool(v[4]) if len(v) > 4 else True
            short = v[5] if len(v) > 5 else "default"
            lines.append(f"| {seq} | {v[0]} | {v[1] or 2048 // v[0]} | {v[2]} | {bits} | {lean} | {short} | {ms:.2f} "
                         f"| {same} |")
        del bufs
        torch.cuda.empty_cache()
    return lines


def section_bwd(seq: int = 16384) -> list[str]:
    bm = importlib.import_module(BWD)
    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    lines = ["| S | H | block_s | threads | dkv_split | dKV add | bwd ms | TFLOP/s | dq err | dkv err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for h, variants in BWD_VARIANTS.items():
        g = torch.Generator(device="cuda").manual_seed(h)
        q = torch.randn(seq, h, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(seq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = causal_random_indices(seq, 2048, torch.device("cuda"))
        do = torch.randn(seq, h, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        vlen = row_valid_len(idx)
        out, lse = sparse_mla_fwd_interface(q, kv, idx, SCALE, 512, valid_len=vlen)
        delta = bm._jit_delta()(h, 512)(out, do, torch.zeros_like(lse))
        pairs = float(vlen.sum())
        flops = 2 * pairs * h * (3 * 576 + 2 * 512)
        ref = None
        for bs, th, sp, red in variants:
            kern = bm._jit_bwd()(h, 576, 512, SCALE, False, bs, th, False, sp, 1, red)
            dq = torch.empty_like(q)
            dkv = torch.zeros(seq, 576, device="cuda")
            row0 = torch.zeros(1, dtype=torch.int32, device="cuda")
            tgt = torch.empty(1, device="cuda")

            def run():
                dkv.zero_()
                kern(q, kv, do, idx, vlen, lse, delta, row0, dq, dkv, tgt)

            try:
                ms = timed(run)
            except Exception as err:  # e.g. too much shared memory: report, go on
                lines.append(f"| {seq} | {h} | {bs} | {th or 'auto'} | {sp} | {red} | FAILED {err!r} |||| "[:300])
                continue
            run()
            if ref is None:
                ref = (dq.float().clone(), dkv.clone())
                eq = ekv = "-"
            else:
                eq = f"{float((dq.float() - ref[0]).abs().max() / ref[0].abs().max()):.1e}"
                ekv = f"{float((dkv - ref[1]).abs().max() / ref[1].abs().max()):.1e}"
            lines.append(f"| {seq} | {h} | {bs} | {th or 'auto'} | {sp} | {red} | {ms:.2f} "
                         f"| {flops / ms / 1e9:.0f} | {eq} | {ekv} |")
        del q, kv, idx, do, out, lse, delta
        torch.cuda.empty_cache()
    return lines


def section_bwd_bulk(seq: int = 16384) -> list[str]:
    """The bulk dKV reduction (``dkv_reduce="bulk"``) against the float2 atomics through the interface: NoPE at 64
    heads, and the grouped backward (4 queries x 16 heads) on random and 90 %-local sets."""
    from bench_dsa_kernels import local_mix_indices

    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.index_groups import group_union_indices
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    lines = ["| case | atomic ms | bulk ms | speed-up | dq equal | dkv max diff (of max) |",
             "|---|---|---|---|---|---|"]
    dev = torch.device("cuda")
    cases = (("NoPE 64 heads", 64, 512, 1, None), ("grouped 16 heads, random", 16, 576, 4, None),
             ("grouped 16 heads, local 0.9", 16, 576, 4, 0.9))
    for name, h, d_qk, group, loc in cases:
        g = torch.Generator(device="cuda").manual_seed(11)
        q = torch.randn(seq, h, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(seq, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
        do = torch.randn(seq, h, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = causal_random_indices(seq, 2048, dev) if loc is None else local_mix_indices(seq, 2048, dev, loc)
        vlen = row_valid_len(idx)
        out, lse = sparse_mla_fwd_interface(q, kv, idx, SCALE, 512, valid_len=vlen)
        kw = dict(valid_len=vlen) if group == 1 else dict(group=group, union=group_union_indices(idx, group,
                                                                                                  key_bound=seq))
        res = {}
        for red in ("atomic", "bulk"):
            try:
                ms = timed(lambda: sparse_mla_bwd_interface(q, kv, out, lse, do, idx, SCALE, 512, dkv_reduce=red, **kw))
                res[red] = (ms, *sparse_mla_bwd_interface(q, kv, out, lse, do, idx, SCALE, 512, dkv_reduce=red, **kw))
            except Exception as err:
                lines.append(f"| {name} ({red}) | FAILED {err!r} |||||"[:300])
        if len(res) == 2:
            (a_ms, dq_a, dkv_a), (b_ms, dq_b, dkv_b) = res["atomic"], res["bulk"]
            ekv = float((dkv_b.float() - dkv_a.float()).abs().max() / dkv_a.float().abs().max())
            lines.append(f"| {name} | {a_ms:.2f} | {b_ms:.2f} | {a_ms / b_ms:.2f} | {bool(torch.equal(dq_a, dq_b))} "
                         f"| {ekv:.1e} |")
        del q, kv, do, idx, vlen, out, lse, kw, res
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="ties,logits,select,bwd,grouped")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--precompile-only", action="store_true",
                    help="build the sections' kernels (--workers of them at a time) and stop: for scripts/tl_cache.py")
    args = ap.parse_args()
    wanted = set(args.sections.split(","))
    cases = kernels_to_build()
    if wanted <= set(SECTION_KERNELS):  # only these sections: build only their kernels
        getters = set().union(*(SECTION_KERNELS[w] for w in wanted))
        cases = [c for c in cases if c[1] in getters]
    if args.precompile_only:
        return 0 if build_in_parallel(cases, max(1, args.workers)) else 1
    if args.workers and not build_in_parallel(cases, args.workers):
        print("some kernels failed to build (see above); the sections that need them will fail", flush=True)
    sections = {k[len("section_"):]: v for k, v in globals().items() if k.startswith("section_")}
    run_sweep_sections(args.sections, sections, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
