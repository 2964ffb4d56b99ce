"""Benchmark the sparse DSA indexer loss on one GPU: our fused TileLang path vs our torch oracle vs megatron-core
0.19.2's fused TileLang path, in one process, at GLM-5 shapes (indexer 32 x 128, top-k 2048, 16 main heads per rank,
absorbed dim 576 = 512 + 64 RoPE, scale 1/16, causal, bf16; one TP rank).

Each path does: indexer scores + top-k selection, the sparse attention target (head-summed probabilities over the
selected keys, L1-normalised), the KL loss forward and its backward to the indexer inputs (qi, ki, w):

(a) ours: ``kernels.indexer_topk`` -> ``kernels.sparse_attention_target`` (from the LSE the sparse-MLA forward
    returns; that forward belongs to the attention and is timed separately, not counted) -> normalise ->
    ``kernels.fused_sparse_indexer_loss`` forward + backward;
(b) oracle: ``dsa.reference.indexer_topk`` -> ``dsa.indexer_loss.sparse_target`` -> ``sparse_indexer_loss`` fwd + bwd
    (pure torch; wall time of one warm run, or of the first run when that took over a quarter of ``--oracle-limit``;
    skipped at longer sequences once one run exceeds ``--oracle-limit`` seconds);
(c) megatron-core: ``ops.tilelang_dsa.run_fused_qk_topk_with_loss(..., block_size=8192)`` + backward of its loss
    (a single-rank gloo process group stands in for TP).

Timing: ``triton.testing.do_bench`` median after an untimed call; peak memory: ``torch.cuda.max_memory_allocated``
above the memory held before the call (inputs excluded), after ``reset_peak_memory_stats``.

    source .gpu/install.sh && PYTHONPATH=$PWD python scripts/bench/bench_indexer_loss.py --out indexer_loss.md
    PYTHONPATH=$PWD python scripts/bench/bench_indexer_loss.py --precompile-only   # only fill TileLang's disk cache

Every kernel is first built in parallel worker processes (``--workers``, default one per CPU up to 16; 0 skips it).

The check (on unless ``--no-check``) first compares ours with the oracle at S=4096 (target, loss, gradients; the
same top-k) and exits with status 1 on a mismatch ("CHECK FAILED"), before any timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace

import torch

SCALE = 1.0 / 16
HI, DI, H, D, D_V, TOPK = 32, 128, 16, 576, 512, 2048
BLOCK_SIZE = 8192  # megatron-core's fused indexer row block

_MC = "megatron.core.transformer.experimental_attention_variant.ops."
KERNELS = [
    ("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain", (HI, DI)),
    ("megatron_glm5.kernels.indexer_topk", "_jit_select", (TOPK,)),
    ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (H, D, D_V, SCALE)),
    ("megatron_glm5.kernels.sparse_attention_target", "_jit_target", (H, D, SCALE)),
    ("megatron_glm5.kernels.indexer_loss", "_jit_index_scores", (HI, DI)),
    ("megatron_glm5.kernels.indexer_loss", "_jit_index_bwd", (HI, DI)),
    ("megatron_glm5.kernels.indexer_loss", "_jit_index_bwd", (HI, DI, True)),
    ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_dkv_reduce", (DI, 1, 128)),
    ("megatron_glm5.kernels.indexer_loss", "_jit_index_bwd", (HI, DI, False, 64, 0, "bulk")),
    ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_delta", (H, D_V)),
    ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (H, D, D_V, SCALE, False)),
    ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (H, D, D_V, SCALE, False, 32, 0, True)),
]
MCORE_KERNELS = [
    (_MC + "tilelang_indexer_fwd", "_get_indexer_fwd_kernel", (HI, DI)),
    (_MC + "tilelang_indexer_fwd", "_get_clean_logits_kernel", ()),
    (_MC + "tilelang_indexer_loss", "_get_target_kernel", (H, D, TOPK, SCALE)),
    (_MC + "tilelang_indexer_loss", "_get_kl_kernel", (TOPK,)),
    (_MC + "tilelang_indexer_bwd", "_get_indexer_bwd_kernel", (HI, DI, TOPK)),
]


def precompile(workers: int, include_mcore: bool) -> bool:
    """Build every kernel of the benchmark in ``workers`` processes (fills TileLang's disk cache)."""
    from bench_dsa_kernels import build_in_parallel

    return build_in_parallel(KERNELS + (MCORE_KERNELS if include_mcore else []), workers)


# ----------------------------------------------------------------------------------------------------------------
# Inputs and helpers
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(seq: int, seed: int = 0) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    return dict(
        qi=torch.randn(seq, HI, DI, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(),
        ki=torch.randn(seq, DI, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(),
        w=(torch.randn(seq, HI, device=dev, generator=g) * (HI**-0.5 * DI**-0.5)).requires_grad_(),
        query=torch.randn(seq, H, D, device=dev, dtype=torch.bfloat16, generator=g),
        kv=torch.randn(seq, D, device=dev, dtype=torch.bfloat16, generator=g),
        starts=torch.zeros(seq, dtype=torch.int32, device=dev),
        ends=torch.arange(1, seq + 1, dtype=torch.int32, device=dev),
    )


def timed(fn) -> float:
    """Median ms (``triton.testing.do_bench``) after one untimed call."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=max(25, 3 * est), rep=max(100, 5 * est), return_mode="median")


def peak_gib(fn) -> tuple[object, float]:
    """``(fn(), GiB allocated above the pre-call level at the peak)``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    return res, (torch.cuda.max_memory_allocated() - base) / 2**30


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _grads(x: dict):
    return (x["qi"], x["ki"], x["w"])


# ----------------------------------------------------------------------------------------------------------------
# The three paths
# ----------------------------------------------------------------------------------------------------------------


def ours_target(x: dict, topk: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    from megatron_glm5.kernels import sparse_attention_target

    target = sparse_attention_target(x["query"], x["kv"], topk, lse, SCALE)  # TP would all-reduce here
    return target.div_(target.sum(-1, keepdim=True).clamp_min(1e-10))


def ours_loss_fwd_bwd(x: dict, topk: torch.Tensor, target: torch.Tensor, rw: torch.Tensor):
    from megatron_glm5.kernels import fused_sparse_indexer_loss

    loss = fused_sparse_indexer_loss(x["qi"], x["ki"], x["w"], topk, target, rw)
    return loss.detach(), torch.autograd.grad(loss, _grads(x))


def ours_attention_lse(x: dict, topk: torch.Tensor) -> torch.Tensor:
    from megatron_glm5.kernels import sparse_mla_with_lse

    with torch.no_grad():
        return sparse_mla_with_lse(x["query"], x["kv"], topk, SCALE)[1]


def ours_topk(x: dict) -> torch.Tensor:
    from megatron_glm5.kernels import indexer_topk

    with torch.no_grad():
        return indexer_topk(x["qi"].detach(), x["ki"].detach(), x["w"].detach(), x["starts"], x["ends"], TOPK)


def row_weights(x: dict) -> torch.Tensor:
    from megatron_glm5.dsa import indexer_loss as il

    return il.row_weights(il.valid_query_rows(x["starts"], x["ends"]), coeff=1.0, per_token=False)


def oracle_path(x: dict, topk: torch.Tensor | None = None):
    """Pure torch (fp32 math): top-k (unless given), target, loss forward and backward."""
    from megatron_glm5.dsa import indexer_loss as il
    from megatron_glm5.dsa import reference as ref

    if topk is None:
        with torch.no_grad():
            topk = ref.indexer_topk(x["qi"].detach(), x["ki"].detach(), x["w"].detach(), x["starts"], x["ends"], TOPK)
    target = il.sparse_target(x["query"], x["kv"], topk, SCALE)
    loss = il.sparse_indexer_loss(x["qi"], x["ki"], x["w"], topk, target, row_weights(x))
    return loss.detach(), torch.autograd.grad(loss, _grads(x)), target


def mcore_path(x: dict, pg):
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa import run_fused_qk_topk_with_loss

    res = run_fused_qk_topk_with_loss(
        q=x["qi"][:, None], k=x["ki"][:, None], weights=x["w"][:, None], index_topk=TOPK,
        starts=x["starts"], ends=x["ends"], block_size=BLOCK_SIZE, query=x["query"][:, None],
        key=x["kv"][:, None, None, :], softmax_scale=SCALE, loss_coeff=1.0, pg_collection=pg,
    )
    if res is None:
        raise RuntimeError("run_fused_qk_topk_with_loss returned None (its fused path rejected the inputs)")
    topk, loss = res
    return loss.detach(), torch.autograd.grad(loss, _grads(x)), topk[0]


def single_rank_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return SimpleNamespace(tp=dist.group.WORLD)


# ----------------------------------------------------------------------------------------------------------------
# --check
# ----------------------------------------------------------------------------------------------------------------


def check(seq: int = 4096) -> bool:
    """Ours vs the oracle on the same top-k (ours), same inputs: target, loss, gradients. Loud on failure."""
    from megatron_glm5.dsa import indexer_loss as il

    x = make_inputs(seq, seed=1)
    topk = ours_topk(x)
    lse = ours_attention_lse(x, topk)
    target = ours_target(x, topk, lse)
    target_ref = il.sparse_target(x["query"], x["kv"], topk, SCALE, lse=lse)
    t_err = max_rel(target, target_ref)
    loss, grads = ours_loss_fwd_bwd(x, topk, target_ref, row_weights(x))
    loss_ref = il.sparse_indexer_loss(x["qi"], x["ki"], x["w"], topk, target_ref, row_weights(x))
    grads_ref = torch.autograd.grad(loss_ref, _grads(x))
    l_err = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
    g = [(n, max_rel(a, b), cosine(a, b)) for n, a, b in zip(("dqi", "dki", "dw"), grads, grads_ref)]
    ok = t_err <= 1e-3 and l_err <= 1e-3 and all(e <= 2e-2 and c >= 0.999 for _, e, c in g)
    print(f"[check] S={seq}: target max_rel={t_err:.2e}; loss {loss.item():.6f} vs oracle {loss_ref.item():.6f} "
          f"(rel {l_err:.2e}); " + "; ".join(f"{n} max_rel={e:.2e} cos={c:.6f}" for n, e, c in g), flush=True)
    print("[check] OK" if ok else "[check] CHECK FAILED: ours differs from the torch oracle", flush=True)
    return ok


# ----------------------------------------------------------------------------------------------------------------
# Benchmark one sequence length
# ----------------------------------------------------------------------------------------------------------------


def bench(seq: int, *, mcore: bool, oracle: bool, oracle_limit: float) -> dict:
    x = make_inputs(seq)
    rw = row_weights(x)
    row: dict = {"S": seq}

    # (a) ours, piece by piece, then the whole path
    topk = ours_topk(x)
    lse = ours_attention_lse(x, topk)
    target = ours_target(x, topk, lse)
    row["topk_ms"] = timed(lambda: ours_topk(x))
    row["attn_fwd_ms"] = timed(lambda: ours_attention_lse(x, topk))
    row["target_ms"] = timed(lambda: ours_target(x, topk, lse))
    from megatron_glm5.kernels import fused_sparse_indexer_loss

    row["loss_fwd_ms"] = timed(lambda: fused_sparse_indexer_loss(x["qi"], x["ki"], x["w"], topk, target, rw))
    loss = fused_sparse_indexer_loss(x["qi"], x["ki"], x["w"], topk, target, rw)
    row["loss_bwd_ms"] = timed(lambda: torch.autograd.grad(loss, _grads(x), retain_graph=True))
    del loss
    loss = fused_sparse_indexer_loss(x["qi"], x["ki"], x["w"], topk, target, rw, deterministic=True)
    row["loss_bwd_det_ms"] = timed(lambda: torch.autograd.grad(loss, _grads(x), retain_graph=True))
    del loss
    # the index backward kernel alone: dki by bulk reductions (default) vs float2 atomics
    from megatron_glm5.kernels.indexer_loss import index_score_bwd_interface

    ds = torch.randn(topk.shape, device="cuda") * (topk >= 0)
    w32 = x["w"].detach().float().contiguous()
    for how in ("bulk", "atomic"):
        row[f"index_bwd_{how}_ms"] = timed(lambda: index_score_bwd_interface(
            x["qi"].detach(), x["ki"].detach(), w32, topk, ds, dk_reduce=how))
    # the sparse-MLA backward with and without the head-summed P (the loss-after-attention target)
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface

    with torch.no_grad():
        from megatron_glm5.kernels import sparse_mla_with_lse

        out, lse_a = sparse_mla_with_lse(x["query"], x["kv"], topk, SCALE)
    grad_out = torch.randn_like(out)
    for tag, with_target in (("attn_bwd_ms", False), ("attn_bwd_target_ms", True)):
        row[tag] = timed(lambda: sparse_mla_bwd_interface(x["query"], x["kv"], out, lse_a, grad_out, topk, SCALE,
                                                          D_V, with_target=with_target))
    del ds, out, grad_out

    def ours_all():
        t = ours_topk(x)
        return ours_loss_fwd_bwd(x, t, ours_target(x, t, lse), rw)

    (row["ours_loss"], _), row["ours_peak_gib"] = peak_gib(ours_all)
    row["ours_ms"] = timed(ours_all)
    row["ours_loss"] = float(row["ours_loss"])
    torch.cuda.empty_cache()

    # (c) megatron-core
    if mcore:
        try:
            pg = single_rank_group()
            (mc_loss, _, mc_topk), row["mc_peak_gib"] = peak_gib(lambda: mcore_path(x, pg))
            row["mc_loss"] = float(mc_loss)
            row["mc_ms"] = timed(lambda: mcore_path(x, pg))
            same = (mc_topk.sort(-1).values == topk.sort(-1).values).all(-1)
            row["same_topk_rows"] = float(same.float().mean())
            del mc_topk
        except Exception as err:
            traceback.print_exc()
            row["mcore_error"] = repr(err)[:200]
        torch.cuda.empty_cache()

    # (b) the torch oracle: once, within the time limit
    if oracle:
        try:
            t0 = time.perf_counter()
            (o_loss, _, _), row["oracle_peak_gib"] = peak_gib(lambda: oracle_path(x))
            row["oracle_ms"] = (time.perf_counter() - t0) * 1e3
            row["oracle_loss"] = float(o_loss)
            if row["oracle_ms"] < oracle_limit * 1e3 / 4:  # a second, warm run (the first one warms the caches)
                t0 = time.perf_counter()
                oracle_path(x)
                torch.cuda.synchronize()
                row["oracle_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as err:
            traceback.print_exc()
            row["oracle_error"] = repr(err)[:200]
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def report(rows: list[dict], notes: list[str]) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    import tilelang

    lines = [
        "# Sparse indexer loss: megatron_glm5.kernels vs the torch oracle vs megatron-core 0.19.2 (TileLang)",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}; git commit: {commit or '?'} (+ working tree)",
        f"- GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; tilelang {tilelang.__version__}",
        f"- indexer {HI} x {DI}, top-k {TOPK}, {H} main heads x {D} (512 + 64 RoPE), scale 1/16, causal, bf16, TP=1;"
        f" megatron-core block_size {BLOCK_SIZE}",
        "- each path: indexer + top-k, sparse attention target, normalise, KL loss forward + backward to qi, ki, w;"
        " ours excludes the sparse-MLA forward that gives it the LSE (part of the attention; its time is listed)",
        "- `triton.testing.do_bench` median; peak = max allocated above the pre-call level (inputs excluded)",
        "",
        "| S | ours ms | mcore ms | speed-up vs mcore | oracle ms | ours peak GiB | mcore peak GiB | oracle peak GiB "
        "| loss ours / mcore / oracle | rows with mcore's top-k set |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['S']} | FAILED: {r['error']} |||||||||")
            continue
        mc, om = r.get("mc_ms"), r.get("oracle_ms")
        lines.append(
            f"| {r['S']} | {r['ours_ms']:.2f} | {_f(mc, '{:.2f}')} | {_f(mc and mc / r['ours_ms'], '{:.2f}')} "
            f"| {_f(om, '{:.0f}')} | {r['ours_peak_gib']:.2f} | {_f(r.get('mc_peak_gib'), '{:.2f}')} "
            f"| {_f(r.get('oracle_peak_gib'), '{:.2f}')} | {r['ours_loss']:.6f} / {_f(r.get('mc_loss'), '{:.6f}')} / "
            f"{_f(r.get('oracle_loss'), '{:.6f}')} | {_f(r.get('same_topk_rows'), '{:.5f}')} |"
            + "".join(f" {k}: {r[k]}" for k in ("mcore_error", "oracle_error") if k in r)
        )
    lines += [
        "",
        "Our path piece by piece (ms):",
        "",
        "| S | indexer + top-k | target (+ normalise) | loss fwd (scores + KL glue) | loss bwd | sum | "
        "(not counted) sparse-MLA fwd for the LSE | loss bwd with deterministic=True |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            continue
        parts = [r["topk_ms"], r["target_ms"], r["loss_fwd_ms"], r["loss_bwd_ms"]]
        lines.append(f"| {r['S']} | " + " | ".join(f"{p:.2f}" for p in parts) + f" | {sum(parts):.2f} | "
                     f"{r['attn_fwd_ms']:.2f} | {r['loss_bwd_det_ms']:.2f} |")
    lines += [
        "",
        "The loss after the attention (the `tilelang` backend's default): the target is the sparse-MLA backward's own"
        " head-summed P, so the target kernel is replaced by the extra cost of that output (ms):",
        "",
        "| S | index bwd, dki by bulk reductions | index bwd, float2 atomics | sparse-MLA bwd | sparse-MLA bwd + target "
        "| target's extra cost | loss cost beyond the top-k (target extra + loss fwd + loss bwd) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "attn_bwd_ms" not in r:
            continue
        extra = r["attn_bwd_target_ms"] - r["attn_bwd_ms"]
        lines.append(f"| {r['S']} | {r['index_bwd_bulk_ms']:.2f} | {r['index_bwd_atomic_ms']:.2f} | "
                     f"{r['attn_bwd_ms']:.2f} | {r['attn_bwd_target_ms']:.2f} | {extra:.2f} | "
                     f"{extra + r['loss_fwd_ms'] + r['loss_bwd_ms']:.2f} |")
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the markdown report here (also printed)")
    ap.add_argument("--seqs", default="16384,32768", help="comma-separated sequence lengths")
    ap.add_argument("--precompile-only", action="store_true", help="build every kernel in parallel, then exit")
    ap.add_argument("--workers", type=int, default=-1,
                    help="precompile in this many processes first (default: one per CPU, up to 16; 0: skip)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="compare ours with the oracle at S=4096 before timing, exit 1 on a mismatch (default on)")
    ap.add_argument("--no-mcore", action="store_true")
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--oracle-limit", type=float, default=60.0,
                    help="seconds: skip the oracle at longer sequences once one run took longer")
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",") if s]
    workers = min(16, os.cpu_count() or 4) if args.workers < 0 else args.workers
    if workers or args.precompile_only:
        ok = precompile(max(1, workers), include_mcore=not args.no_mcore)
        if args.precompile_only:
            return 0 if ok else 1
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.check and not check():
        return 1
    rows, notes = [], []
    oracle = not args.no_oracle
    for seq in seqs:
        try:
            r = bench(seq, mcore=not args.no_mcore, oracle=oracle, oracle_limit=args.oracle_limit)
        except Exception as err:
            traceback.print_exc()
            r = {"S": seq, "error": repr(err)[:160]}
        print(r, flush=True)
        rows.append(r)
        if oracle and r.get("oracle_ms", 0) > args.oracle_limit * 1e3:
            oracle = False
            notes.append(f"oracle skipped after S={seq}: one run took {r['oracle_ms'] / 1e3:.0f} s "
                         f"(> --oracle-limit {args.oracle_limit:.0f} s)")
        torch.cuda.empty_cache()
    text = report(rows, notes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
