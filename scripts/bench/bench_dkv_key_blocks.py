"""The sparse-MLA backward with dKV by key blocks (``dkv_reduce="key_blocks"``: the per-query dQ pass, then
``kernels.sparse_mla_dkv``) against the atomic per-query backward (the default) and megatron-core's, in one process.

Per shape (top-k 2048, causal, d_qk 576 / d_v 512, scale 1/16): the backward kernels alone from saved ``out`` / ``lse``
(ms, TFLOP/s over the valid pairs: ``2 * pairs * H * (3 * 576 + 2 * 512)``), the key-block route's pieces (dQ pass,
bitmap + ranges, the key-block kernel at several chunk counts, the chunk sum), the key-block kernel's dense TFLOP/s
(every (key block, row tile) it multiplies), dKV against the atomic route and dQ bitwise, and bitwise repeatability.

    source .gpu/install.sh && python scripts/bench/bench_dkv_key_blocks.py --precompile --workers 16 --out dkv.md

``--packed all --seqs ''`` (``--d-qk 512``: on the NoPE latent): packed (THD) batches past 8K tokens, where the
autograd route decides by the forward's bound of the dense work (``kernels.key_block_work``): both backwards, the
probe's cost and ratio, and whether the route picked the faster one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCALE = 1.0 / 16
D_QK, D_V, TOPK = 576, 512, 2048
GROUP = 4  # the grouped backward's queries per CTA at 16 heads (64 rows), as the autograd route takes it


def kernel_cases(heads: tuple[int, ...], nope_heads: tuple[int, ...] = (16,)) -> list[tuple[str, str, tuple, dict]]:
    """(module, getter, args, kwargs) of every kernel this benchmark and ``tests/gpu/test_sparse_mla_dkv_gpu.py``
    build, called exactly as the interfaces call them (TileLang's cache key includes how the arguments came); the
    NoPE latent's only at ``nope_heads`` (the GPU tests run it at 16 heads)."""
    bwd, dkv = "megatron_glm5.kernels.sparse_mla_bwd", "megatron_glm5.kernels.sparse_mla_dkv"
    cases = []
    for h in heads:
        for d_qk, d_v in [(D_QK, D_V)] + ([(512, 512)] if h in nope_heads else []):
            cases.append((bwd, "_jit_bwd", (h, d_qk, d_v, SCALE, False), {"with_target": False, "with_dkv": False}))
            cases.append((dkv, "_jit_dkv_key_blocks", (h, d_qk, d_v, SCALE, 64), {}))
            cases.append((dkv, "_jit_dkv_key_blocks", (h, d_qk, d_v, SCALE, 64), {"schedule": "plain"}))
            cases.append((dkv, "_jit_dkv_key_blocks_ws", (h, d_qk, d_v, SCALE, 64), {}))
            cases.append((bwd, "_jit_bwd", (h, d_qk, d_v, SCALE, False), {"with_target": False}))
            if h * GROUP == 64:  # the grouped backward the shape rows compare with (compare_backwards)
                cases.append((bwd, "_jit_bwd", (h, d_qk, d_v, SCALE, False), {"with_target": False, "group": GROUP}))
            cases.append((bwd, "_jit_delta", (h, d_v), {}))
            cases.append(_fwd_case(h, d_qk, d_v))
    return cases


def _fwd_case(heads: int, d_qk: int, d_v: int) -> tuple[str, str, tuple, dict]:
    """The forward kernel ``sparse_mla_fwd_interface(variant="auto")`` takes at this shape, called as it calls it."""
    from megatron_glm5.kernels.sparse_mla_fwd import pick_fwd_variant

    kind = pick_fwd_variant(heads, d_qk, d_v, "auto")
    return ("megatron_glm5.kernels.sparse_mla_fwd", f"_jit_fwd_{kind}", (heads, d_qk, d_v, SCALE), {})


def _build(case) -> tuple[str, float, str]:
    import importlib

    module, getter, args, kwargs = case
    t0 = time.time()
    try:
        getattr(importlib.import_module(module), getter)()(*args, **kwargs)
        return f"{getter}{args}{kwargs}", time.time() - t0, ""
    except Exception:
        return f"{getter}{args}{kwargs}", time.time() - t0, traceback.format_exc(limit=3)


def precompile(cases, workers: int) -> bool:
    import multiprocessing as mp

    ok = True
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for name, sec, err in ex.map(_build, cases):
            print(f"[precompile] {name}: {sec:.1f}s{' FAILED' if err else ''}", flush=True)
            if err:
                print(err, flush=True)
                ok = False
    return ok


def compare_backwards(q, kv, out, lse, g, idx, vlen, f_bwd: float, grouped: bool = False) -> dict:
    """The atomic and the key-block backward from the same saved ``out`` / ``lse``: ms, TFLOP/s (``f_bwd`` FLOP),
    dKV against the atomic route, dQ bitwise, and the key-block route's run-to-run equality. ``grouped`` (16 heads):
    also the grouped backward (4 queries per CTA over their union, the union built inside the timing as the autograd
    backward builds it) and the sets' sharing (valid pairs per union entry), which decides between the two routes
    (``sparse_mla_bwd.key_blocks_over_grouped``)."""
    from bench_dsa_kernels import timed

    from megatron_glm5.kernels.index_groups import group_union_indices
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface

    def bwd(reduce: str):
        return sparse_mla_bwd_interface(q, kv, out, lse, g, idx, SCALE, D_V, valid_len=vlen, dkv_reduce=reduce)

    row = {"atomic_ms": timed(lambda: bwd("atomic")), "key_blocks_ms": timed(lambda: bwd("key_blocks"))}
    row["atomic_tflops"] = f_bwd / row["atomic_ms"] / 1e9
    row["key_blocks_tflops"] = f_bwd / row["key_blocks_ms"] / 1e9
    if grouped:
        group = GROUP

        def bwd_grouped():
            union = group_union_indices(idx, group, key_bound=kv.shape[0])
            return sparse_mla_bwd_interface(q, kv, out, lse, g, idx, SCALE, D_V, group=group, union=union)

        row["grouped_ms"] = timed(bwd_grouped)
        _, union_len = group_union_indices(idx, group, key_bound=kv.shape[0])
        row["sharing"] = float(vlen.sum()) / max(1, int(union_len.sum()))
    dq_a, dkv_a = bwd("atomic")
    dq_k, dkv_k = bwd("key_blocks")
    dq_k2, dkv_k2 = bwd("key_blocks")
    row["dq_bitwise_atomic"] = bool(torch.equal(dq_a, dq_k))
    row["dkv_vs_atomic"] = float((dkv_k.float() - dkv_a.float()).abs().max() / dkv_a.float().abs().max())
    row["key_blocks_repeatable"] = bool(torch.equal(dq_k, dq_k2) and torch.equal(dkv_k, dkv_k2))
    return row


def bench_shape(seq: int, heads: int, locality: float | None, chunks: list[int], mcore: bool,
                d_qk: int = D_QK) -> dict:
    from bench_dsa_kernels import causal_random_indices, local_mix_indices, timed

    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.key_block_work import row_key_span, span_query_ranges
    from megatron_glm5.kernels.selection_bitmap import key_block_query_range, selection_bitmap
    from megatron_glm5.kernels.sparse_mla_bwd import _jit_bwd, _jit_delta
    from megatron_glm5.kernels.sparse_mla_dkv import (
        KEY_BLOCK,
        ROW_TILE,
        default_chunks,
        key_block_kernel,
    )
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    dev = torch.device("cuda")
    torch.manual_seed(seq + heads)
    q = torch.randn(seq, heads, d_qk, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(seq, d_qk, device=dev, dtype=torch.bfloat16)
    idx = causal_random_indices(seq, TOPK, dev) if locality is None else local_mix_indices(seq, TOPK, dev, locality)
    g = torch.randn(seq, heads, D_V, device=dev, dtype=torch.bfloat16)
    vlen = row_valid_len(idx)
    pairs = int((idx >= 0).sum())
    f_bwd = 2 * pairs * heads * (3 * d_qk + 2 * D_V)
    row = {"S": seq, "H": heads, "indices": ("random" if locality is None else f"local {locality:g}")
           + ("" if d_qk == D_QK else f", d_qk {d_qk}"), "pairs": pairs}
    out, lse = sparse_mla_fwd_interface(q, kv, idx, SCALE, D_V, valid_len=vlen)

    row.update(compare_backwards(q, kv, out, lse, g, idx, vlen, f_bwd, grouped=heads * GROUP == 64))

    # pieces
    delta = _jit_delta()(heads, D_V)(out, g, torch.zeros_like(lse))
    row["delta_ms"] = timed(lambda: _jit_delta()(heads, D_V)(out, g, torch.zeros_like(lse)))
    dq = torch.empty_like(q)
    row0 = torch.zeros(1, dtype=torch.int32, device=dev)
    unused = torch.empty(1, d_qk, dtype=torch.float32, device=dev)
    tgt = torch.empty(1, dtype=torch.float32, device=dev)
    k_dq = _jit_bwd()(heads, d_qk, D_V, SCALE, False, with_target=False, with_dkv=False)
    row["dq_pass_ms"] = timed(lambda: k_dq(q, kv, g, idx, vlen, lse, delta, row0, dq, unused, tgt))
    row["bitmap_ms"] = timed(lambda: key_block_query_range(selection_bitmap(idx, seq)[0], KEY_BLOCK))
    row["bitmap_only_ms"] = timed(lambda: selection_bitmap(idx, seq))
    row["span_ranges_ms"] = timed(lambda: span_query_ranges(*row_key_span(idx, seq), seq, KEY_BLOCK))
    bits, _ = selection_bitmap(idx, seq)
    qrange = key_block_query_range(bits, KEY_BLOCK)
    k_kb = key_block_kernel("split", heads, d_qk, D_V, SCALE)
    default = default_chunks(seq, seq, dev)
    row["default_chunks"] = default
    for n in sorted(set(chunks + [default])):
        part = torch.empty(n, seq, d_qk, dtype=torch.float32, device=dev)
        args = (q.view(-1, d_qk), kv, g.view(-1, D_V), lse.view(-1), delta.view(-1), bits, qrange, part)
        ms = timed(lambda: k_kb(*args))
        # dense work: every row tile of every (block, chunk) range
        qpc = -(-seq // n)
        rng = qrange.tolist()
        tiles = 0
        for first, end in rng:
            for c in range(n):
                lo, hi = max(c * qpc, first), min((c + 1) * qpc, end, seq)
                if hi > lo:
                    tiles += -(-(hi - lo) * heads // ROW_TILE)
        dense_flop = 2 * tiles * ROW_TILE * KEY_BLOCK * (2 * d_qk + 2 * D_V)
        row[f"kb_kernel_ms_c{n}"] = ms
        row[f"kb_dense_tflops_c{n}"] = dense_flop / ms / 1e9
        if n == default:
            row["sum_ms"] = timed(lambda: part.sum(0))
            row["dense_over_sparse"] = tiles * ROW_TILE * KEY_BLOCK / (pairs * heads)
            k_plain = key_block_kernel("plain", heads, d_qk, D_V, SCALE)
            row["plain_kernel_ms"] = timed(lambda: k_plain(*args))
            k_split = key_block_kernel("split", heads, d_qk, D_V, SCALE)
            row["split_kernel_ms"] = timed(lambda: k_split(*args))
            k_wsp = key_block_kernel("wsp", heads, d_qk, D_V, SCALE)
            row["wsp_kernel_ms"] = timed(lambda: k_wsp(*args))
            row["wsp_dense_tflops"] = dense_flop / row["wsp_kernel_ms"] / 1e9
            ref = part.clone()
            k_split(*args)
            ref.copy_(part)
            k_wsp(*args)
            row["wsp_bitwise_split"] = bool(torch.equal(ref, part))
        del part
    if mcore:
        try:
            from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA

            qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
            kv3, idx3 = kvg[:, None], idx[:, None]

            def mc_fwd():
                with torch.no_grad():
                    return SparseMLA.apply(qg, kv3, idx3, SCALE)

            def mc_fb():
                o, _ = SparseMLA.apply(qg, kv3, idx3, SCALE)
                torch.autograd.grad(o, (qg, kvg), g)

            row["mc_bwd_ms"] = timed(mc_fb) - timed(mc_fwd)
            row["mc_bwd_tflops"] = f_bwd / row["mc_bwd_ms"] / 1e9
        except Exception as err:
            row["mcore_error"] = repr(err)[:200]
    return row


# Packed (THD) batches past 8K tokens: where the route's rule is the forward's bound of the dense work (``key_block_work``)
PACKED = {
    "8 x 1K-8K": [8192, 1024, 4096, 2048, 1024, 8192, 2048, 4096],
    "4 x 4K": [4096] * 4,
    "2 x 8K": [8192] * 2,
    "8 x 8K": [8192] * 8,
    "16 x 2K": [2048] * 16,
    "12K + 4K": [12288, 4096],
    "1 x 10K": [10240],
    "1 x 11K": [11264],
    "1 x 12K": [12288],
    "1 x 16K": [16384],
    "2 x 16K": [16384] * 2,
    "1 x 20K": [20480],
    "1 x 24K": [24576],
}


def packed_indices(lengths: list[int], dev: torch.device) -> torch.Tensor:
    """int32 ``[sum(lengths), TOPK]``: causal random top-k sets within each sequence (global rows), -1 tail."""
    from bench_dsa_kernels import causal_random_indices

    parts, s0 = [], 0
    for i, n in enumerate(lengths):
        idx = causal_random_indices(n, TOPK, dev, seed=i)
        parts.append(torch.where(idx >= 0, idx + s0, idx))
        s0 += n
    return torch.cat(parts)


def bench_packed(name: str, lengths: list[int], heads: int, d_qk: int = D_QK) -> dict:
    """One packed batch: the atomic and the key-block backward from saved ``out`` / ``lse``, the forward's work probe
    (its ms and its dense / sparse ratio against the exact ranges') and the route ``key_blocks_pay`` picks for the
    latent ``(d_qk, 512)``."""
    from bench_dsa_kernels import timed

    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.key_block_work import KeyBlockWorkProbe, dense_pairs_bound, row_key_span
    from megatron_glm5.kernels.selection_bitmap import key_block_query_range, selection_bitmap
    from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCK, key_blocks_pay
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    dev = torch.device("cuda")
    total = sum(lengths)
    torch.manual_seed(total + heads)
    q = torch.randn(total, heads, d_qk, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(total, d_qk, device=dev, dtype=torch.bfloat16)
    g = torch.randn(total, heads, D_V, device=dev, dtype=torch.bfloat16)
    idx = packed_indices(lengths, dev)
    vlen = row_valid_len(idx)
    pairs = int((idx >= 0).sum())
    f_bwd = 2 * pairs * heads * (3 * d_qk + 2 * D_V)
    out, lse = sparse_mla_fwd_interface(q, kv, idx, SCALE, D_V, valid_len=vlen)
    row = {"batch": name, "T": total, "H": heads, "d_qk": d_qk, "pairs": pairs}
    row["probe_ms"] = timed(lambda: dense_pairs_bound(*row_key_span(idx, total), total))  # the forward's device work
    row["probe_ratio"] = KeyBlockWorkProbe(idx, vlen, total).dense_per_sparse()
    bits, _ = selection_bitmap(idx, total)
    rng = key_block_query_range(bits, KEY_BLOCK)
    row["exact_ratio"] = int((rng[:, 1] - rng[:, 0]).sum()) * KEY_BLOCK / pairs
    del bits, rng
    row["route"] = "key_blocks" if key_blocks_pay(heads, total, d_qk, D_V, t_kv=total,
                                                   dense_per_sparse=row["probe_ratio"]) else "atomic"
    row.update(compare_backwards(q, kv, out, lse, g, idx, vlen, f_bwd, grouped=heads * GROUP == 64))
    return row


def report_packed(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCKS_MAX_DENSE_PER_SPARSE

    d_qk = rows[0].get("d_qk", D_QK)
    limit = KEY_BLOCKS_MAX_DENSE_PER_SPARSE[d_qk, D_V]
    lines = ["", f"Packed (THD) batches, d_qk {d_qk}: the route past 8K tokens by the forward's work bound "
             f"(take key blocks at dense / sparse <= {limit}):", "",
             "| batch | T | H | atomic bwd ms (TFLOP/s) | key blocks ms (TFLOP/s) | speed-up | probe ms | "
             "dense / sparse (bound) | (exact) | route | right? | dKV vs atomic | dQ bitwise |",
             "|" + "---|" * 13]
    for r in rows:
        speed = r["atomic_ms"] / r["key_blocks_ms"]
        right = (r["route"] == "key_blocks") == (speed > 1.0)
        lines.append(
            f"| {r['batch']} | {r['T']} | {r['H']} | {r['atomic_ms']:.2f} ({r['atomic_tflops']:.0f}) | "
            f"{r['key_blocks_ms']:.2f} ({r['key_blocks_tflops']:.0f}) | {speed:.2f}x | {r['probe_ms']:.3f} | "
            f"{r['probe_ratio']:.2f} | {r['exact_ratio']:.2f} | {r['route']} | {'yes' if right else 'NO'} | "
            f"{r['dkv_vs_atomic']:.1e} | {r['dq_bitwise_atomic']} |")
    return lines


def report(rows: list[dict], chunks: list[int]) -> list[str]:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [
        "| S | H | indices | atomic bwd ms (TFLOP/s) | key blocks ms (TFLOP/s) | speed-up | "
        "grouped bwd ms (sharing) | megatron-core bwd ms | "
        "dQ pass | bitmap + ranges (bitmap alone; span ranges) | key-block kernel (chunks) | dense TFLOP/s | "
        "plain / split / wsp kernel ms | wsp dense TFLOP/s | wsp bitwise split | "
        "chunk sum | dense / sparse work | dKV vs atomic | dQ bitwise | repeatable |",
        "|" + "---|" * 20,
    ]
    for r in rows:
        c = r["default_chunks"]
        lines.append(
            f"| {r['S']} | {r['H']} | {r['indices']} | {f(r['atomic_ms'])} ({f(r['atomic_tflops'], '{:.0f}')}) | "
            f"{f(r['key_blocks_ms'])} ({f(r['key_blocks_tflops'], '{:.0f}')}) | "
            f"{f(r['atomic_ms'] / r['key_blocks_ms'])}x | {f(r.get('grouped_ms'))} ({f(r.get('sharing'))}) | "
            f"{f(r.get('mc_bwd_ms'))} | {f(r['dq_pass_ms'])} | "
            f"{f(r['bitmap_ms'])} ({f(r.get('bitmap_only_ms'))}; {f(r.get('span_ranges_ms'), '{:.3f}')}) | "
            f"{f(r[f'kb_kernel_ms_c{c}'])} ({c}) | {f(r[f'kb_dense_tflops_c{c}'], '{:.0f}')} | "
            f"{f(r.get('plain_kernel_ms'))} / {f(r.get('split_kernel_ms'))} / {f(r.get('wsp_kernel_ms'))} | "
            f"{f(r.get('wsp_dense_tflops'), '{:.0f}')} | {r.get('wsp_bitwise_split')} | "
            f"{f(r['sum_ms'])} | {f(r['dense_over_sparse'])} | {r['dkv_vs_atomic']:.1e} | {r['dq_bitwise_atomic']} | "
            f"{r['key_blocks_repeatable']} |")
    lines += ["", "Key-block kernel ms by query chunks:", "",
              "| S | H | indices | " + " | ".join(f"{n} chunks" for n in chunks) + " |",
              "|" + "---|" * (3 + len(chunks))]
    for r in rows:
        lines.append(f"| {r['S']} | {r['H']} | {r['indices']} | "
                     + " | ".join(f"{f(r.get(f'kb_kernel_ms_c{n}'))}" for n in chunks) + " |")
    return lines


def _one_row(fn, *args) -> list[dict]:
    """``[fn(*args)]``, printed with its time, or ``[]`` with the traceback (one shape's failure ends no run)."""
    t0 = time.time()
    try:
        r = fn(*args)
    except Exception:
        traceback.print_exc()
        return []
    print(json.dumps(r), f"({time.time() - t0:.0f}s)", flush=True)
    torch.cuda.empty_cache()
    return [r]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--localities", default="random", help="comma list: random or a locality in [0, 1]")
    ap.add_argument("--chunks", default="4,8,16")
    ap.add_argument("--mcore", action="store_true")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--test-heads", default="8,16,64,128", help="heads whose kernels the GPU tests need")
    ap.add_argument("--d-qk", type=int, default=D_QK, help="latent width (512: GLM-5.3-Flash's NoPE latent)")
    ap.add_argument("--packed", default="", help=f"';'-separated names of PACKED ({'; '.join(PACKED)}) or 'all'")
    ap.add_argument("--packed-heads", default="16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    heads = [int(x) for x in a.heads.split(",")]
    if a.precompile or a.precompile_only:
        hs = tuple(sorted(set(heads) | {int(x) for x in a.test_heads.split(",") if x}))
        ok = precompile(kernel_cases(hs, nope_heads=(16,) + ((tuple(heads)) if a.d_qk == 512 else ())), a.workers)
        if a.precompile_only:
            return 0 if ok else 1
    chunks = [int(x) for x in a.chunks.split(",")]
    rows = [r for loc in a.localities.split(",") for s in (int(x) for x in a.seqs.split(",") if x) for h in heads
            for r in _one_row(bench_shape, s, h, None if loc == "random" else float(loc), chunks, a.mcore, a.d_qk)]
    names = list(PACKED) if a.packed == "all" else [n for n in a.packed.split(";") if n]
    packed_rows = [r for name in names for h in (int(x) for x in a.packed_heads.split(",") if x)
                   for r in _one_row(bench_packed, name, PACKED[name], h, a.d_qk)]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    head = [f"# Sparse-MLA backward: dKV by key blocks vs atomic dKV ({datetime.date.today()}, commit {commit} + "
            f"working tree, {torch.cuda.get_device_name()}, torch {torch.__version__})", ""]
    text = "\n".join(head + (report(rows, chunks) if rows else []) + report_packed(packed_rows)) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as fh:
            json.dump(rows + packed_rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
