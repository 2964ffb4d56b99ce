"""Benchmark our TileLang DSA kernels against megatron-core 0.19.2's on one GPU, side by side in one process.

(a) sparse MLA fwd / bwd / fwd+bwd at S in {4K, 16K, 32K}, 16 and 64 heads, top-k 2048, causal random indices
    (each query: min(t+1, 2048) distinct earlier rows, -1 tail), scale 1/16. TFLOP/s over valid (query, key) pairs:
    fwd 2*pairs*H*(576+512), bwd 2*pairs*H*(3*576+2*512). megatron-core's backward re-runs its forward, so its
    "bwd" is (fwd+bwd) - fwd; ours is the backward alone (it reuses the saved out/LSE).
(b) indexer + top-k at S in {8K, 32K, 64K}, 32 heads x 128, top-k 2048, causal: ms and peak memory, against
    ``fused_qk_topk_lighting(..., block_size=8192)``.

(c) ``--sections kpool``: the KPool selection of GLM-5.3-Flash (``kernels.kpool_indexer_topk``: 32 x 128 indexer,
    P = 4, index_topk 2048, causal) against the torch reference ``megatron_glm5.dsa.kpool`` at S in ``--kpool-seqs``.
(d) ``--sections nope``: NoPE sparse MLA (d_qk = d_v = 512, KPool width 2051, scale 1/16) fwd / bwd at
    ``--nope-seqs`` x ``--nope-heads`` against the torch reference ``megatron_glm5.dsa.reference.sparse_mla``.
(e) ``--sections packed``: RL-shaped packed (THD) batches of 4-8 sequences of 1K-8K (``PACKED_BATCHES``, plus one 1K
    sequence for the per-call overhead): indexer + top-k + sparse MLA fwd + bwd, ours against megatron-core's path.

Also cross-checks our outputs against megatron-core's at every benchmarked shape (output cosine, top-k overlap).
Timing: ``triton.testing.do_bench`` median after one untimed call (JIT compile) and >= 3 warm-up calls.

    source .gpu/install.sh && python scripts/bench/bench_dsa_kernels.py --out results.md
    python scripts/bench/bench_dsa_kernels.py --precompile-only --workers 16   # fill TileLang's disk cache in parallel
    # GLM-5.3-Flash pieces only (KPool selection, NoPE sparse MLA), kernels of those sections only:
    python scripts/bench/bench_dsa_kernels.py --sections kpool,nope --precompile-only --workers 16
    python scripts/bench/bench_dsa_kernels.py --sections kpool,nope --out flash.md
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

import torch
from report import emit  # scripts/bench is sys.path[0] (run as a script) or was put there by the importer

SCALE = 1.0 / 16
D_QK, D_V, TOPK = 576, 512, 2048

# Every kernel the GPU tests and this benchmark build: (module, getter, args). Building them in parallel worker
# processes fills TileLang's disk cache, so the single-process test and benchmark runs only load them.
OUR_KERNELS = (
    [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (h, D_QK, D_V, SCALE)) for h in (8, 16, 64, 128)]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (16, D_QK, D_V, SCALE, 64, 4))]  # grouped
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (48, D_QK, D_V, SCALE))]  # the sv tests' reference
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_sv", (h, d, d_v, SCALE))  # the opt-in sv schedule
       for h in (48, 64, 128) for d, d_v in ((D_QK, D_V), (512, 512))]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_sv", (16, D_QK, D_V, SCALE, 4))]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (h, d, d_v, SCALE))  # the default at 64 MMA rows
       for h in (48, 64, 128) for d, d_v in ((D_QK, D_V), (512, 512))]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (16, D_QK, D_V, SCALE, 4))]  # grouped
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (h, d, D_V, SCALE, g, (216, 216, 72), *opts))
       for h, d, g in ((64, D_QK, 1), (128, D_QK, 1), (64, 512, 1), (16, D_QK, 4))
       for opts in ((False, True, False, False), (True, False, True, True), (False, False, False, True),
                    (True, True, True, False, True))]
    # ^ the pp options off, for their tests (tests/gpu/test_kernels_gpu.py PP_OPTIONS)
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (h, d, D_V, SCALE, False, 32, 0, False, 0, g, "bulk"))
       for h, d, g in ((16, D_QK, 1), (64, D_QK, 1), (128, D_QK, 1), (64, 512, 1), (16, D_QK, 4))]  # bulk dKV
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (h, 512, 512, SCALE)) for h in (48, 128)]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, D_QK, D_V, SCALE, False, 32, 0, False, 0, 2))]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, D_QK, D_V, SCALE, False, 32, 0, False, 0, 4))]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_simple", (h, D_QK, D_V, SCALE)) for h in (16, 64)]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (h, D_QK, D_V, SCALE, det))
       for h in (8, 16, 64, 128) for det in (False, True)]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_delta", (h, D_V)) for h in (8, 16, 64, 128)]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_dkv_reduce", (D_QK, 1))]
    + [("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain", (32, 128))]  # indexer_topk's logits kernel
    + [("megatron_glm5.kernels.indexer_topk", "_jit_select", (k,)) for k in (256, 512, 2048)]
)
# GLM-5.3-Flash: NoPE sparse MLA (512 / 512; both forward variants at 64 heads for the tests, the deterministic
# backward for the tests) and the KPool selection (the 32 x 128 logits kernel, top-(2048 / 4) select).
D_NOPE, KPOOL_P, KPOOL_WIDTH = 512, 4, TOPK + 4 - 1
NOPE_KERNELS = (
    [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (h, D_NOPE, D_NOPE, SCALE)) for h in (16, 64)]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (64, D_NOPE, D_NOPE, SCALE))]
    + [("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_simple", (64, D_NOPE, D_NOPE, SCALE))]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (h, D_NOPE, D_NOPE, SCALE, False)) for h in (16, 64)]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (64, D_NOPE, D_NOPE, SCALE, True))]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_delta", (h, D_NOPE)) for h in (16, 64)]
    + [("megatron_glm5.kernels.sparse_mla_bwd", "_jit_dkv_reduce", (D_NOPE, 1))]
)
KPOOL_KERNELS = [
    ("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain", (32, 128)),
    ("megatron_glm5.kernels.indexer_topk", "_jit_select", (TOPK // KPOOL_P,)),
]
# small_flash_config (tests/gpu/test_glm5_next_gpu.py, examples/pretrain_glm53_flash_tiny.sh): 8 attention heads,
# an 8 x 128 KPool indexer, top-(256 / 4)
FLASH_SMALL_KERNELS = [
    ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (8, D_NOPE, D_NOPE, SCALE)),
    ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (8, D_NOPE, D_NOPE, SCALE, False)),
    ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_delta", (8, D_NOPE)),
    ("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain", (8, 128)),
    ("megatron_glm5.kernels.indexer_topk", "_jit_select", (256 // KPOOL_P,)),
]
_MC = "megatron.core.transformer.experimental_attention_variant.ops."
MCORE_KERNELS = (
    [(_MC + "tilelang_sparse_mla_fwd", "_get_sparse_mla_fwd_kernel", (h, 512, 64, TOPK, 1, SCALE, 64, 2, 256)) for h in (16, 64)]
    + [(_MC + "tilelang_sparse_mla_bwd", "_get_bwd_kernel", (h, 512, 64, TOPK, 1, SCALE, 32)) for h in (16, 64)]
    + [(_MC + "tilelang_sparse_mla_bwd", "_get_preprocess_kernel", (h, 512)) for h in (16, 64)]
    + [(_MC + "tilelang_sparse_mla_bwd", "_get_postprocess_kernel", (512, 64, 1))]
    + [(_MC + "tilelang_indexer_fwd", "_get_indexer_fwd_kernel", (32, 128))]
    + [(_MC + "tilelang_indexer_fwd", "_get_clean_logits_kernel", ())]
)


def _build(case: tuple) -> tuple[str, float, str]:
    module, getter, args = case
    t0 = time.time()
    try:
        fn = getattr(importlib.import_module(module), getter)
        fn(*args) if module.startswith("megatron.core") else fn()(*args)
        return f"{getter}{args}", time.time() - t0, ""
    except Exception:  # report and go on: one broken kernel must not hide the others
        return f"{getter}{args}", time.time() - t0, traceback.format_exc(limit=3)


def precompile(workers: int, include_mcore: bool = True, sections: tuple[str, ...] = ("sparse", "indexer")) -> bool:
    """Build the kernels of ``sections`` in ``workers`` processes (GLM-5 sections: every kernel of the GLM-5 tests
    and benchmark; ``kpool`` / ``nope``: those of GLM-5.3-Flash). Duplicates are built once."""
    cases = []
    if {"sparse", "indexer"} & set(sections):
        cases += list(OUR_KERNELS) + (list(MCORE_KERNELS) if include_mcore else [])
    if "nope" in sections:
        cases += NOPE_KERNELS
    if "kpool" in sections:
        cases += KPOOL_KERNELS
    if "flash_small" in sections:
        cases += FLASH_SMALL_KERNELS
    return build_in_parallel(cases, workers)


def precompile_step(cases: list[tuple], workers: int, only: bool) -> int | None:
    """A benchmark's ``--workers`` / ``--precompile-only`` step: build ``cases`` in parallel when asked; the exit code
    when the script stops here (``only``: 0, or 1 if a kernel failed), else None (failures are printed and their
    rows fail later)."""
    if (workers or only) and not build_in_parallel(cases, max(workers, 1)):
        print("some kernels failed to build (see above)", flush=True)
        if only:
            return 1
    return 0 if only else None


def build_in_parallel(cases: list[tuple], workers: int) -> bool:
    """Build ``(module, getter, args)`` kernels in ``workers`` spawned processes (fills TileLang's disk cache), each
    once; every failure is printed and the others still build. True when all built."""
    cases = list(dict.fromkeys(cases))
    ok = True
    with cf.ProcessPoolExecutor(max_workers=max(1, min(workers, len(cases))),
                                mp_context=mp.get_context("spawn")) as pool:
        for name, secs, err in pool.map(_build, cases):
            print(f"[precompile] {name}: {secs:.1f} s {'OK' if not err else 'FAILED'}", flush=True)
            if err:
                ok = False
                print(err, flush=True)
    return ok


def run_sweep_sections(names: str, sections: dict, out: str | None) -> list[str]:
    """Run the sweep scripts' sections (``sections[name]()`` -> markdown lines) in order under a date / commit / GPU
    header; a failing section is reported and the others still run; the report is printed and, with ``out``,
    written."""
    import datetime
    import subprocess
    import traceback

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}; commit {commit or '?'}; GPU "
             f"{torch.cuda.get_device_name()}", ""]
    for name in [n for n in names.split(",") if n]:
        try:
            part = sections[name]()
        except Exception as err:  # keep the other sections
            traceback.print_exc()
            part = [f"{name}: FAILED {err!r}"[:300]]
        lines += [f"### {name}", ""] + part + [""]
        print("\n".join(part), flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------


def causal_random_indices(seq: int, topk: int, device: torch.device, chunk: int = 1024, seed: int = 0) -> torch.Tensor:
    """int32 [S, topk]: row t holds min(t+1, topk) distinct random rows of [0, t] (random order), then -1."""
    return local_mix_indices(seq, topk, device, 0.0, sinks=0, chunk=chunk, seed=seed)


@torch.no_grad()
def local_mix_indices(seq: int, topk: int, device: torch.device, locality: float, sinks: int = 16, chunk: int = 1024,
                      seed: int = 0) -> torch.Tensor:
    """int32 [S, topk] like ``causal_random_indices`` (min(t+1, topk) distinct rows of [0, t], -1 tail), but with
    locality, a stand-in for a trained indexer's top-k (none is available here): the first ``sinks`` keys,
    then the ``locality * (topk - sinks)`` most recent keys, then random earlier keys, in that order (an indexer's
    order: by score). ``locality`` 0 gives random sets (neighbouring queries share few keys), 1 gives sinks plus a
    sliding window (they share nearly all)."""
    if not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality must be in [0, 1], got {locality}")
    g = torch.Generator(device=device).manual_seed(seed)
    window = int(round(locality * max(topk - sinks, 0)))
    out = torch.full((seq, topk), -1, dtype=torch.int32, device=device)
    for r0 in range(0, seq, chunk):
        r1 = min(seq, r0 + chunk)
        rows = torch.arange(r0, r1, device=device)[:, None]
        cols = torch.arange(r1, device=device)[None]
        score = torch.rand(r1 - r0, r1, device=device, generator=g)  # random keys: [0, 1)
        score += 2.0 * ((rows - cols) < window)  # recency window: [2, 3)
        score += 4.0 * (cols < sinks)  # sinks: >= 4
        score.masked_fill_(cols > rows, -1.0)
        width = min(topk, r1)
        vals, idx = score.topk(width, dim=-1)
        out[r0:r1, :width] = torch.where(vals >= 0, idx, -1).int()  # by score, as an indexer orders them
    return out


@torch.no_grad()
def group_sharing(indices: torch.Tensor, group: int = 4) -> float:
    """How many of ``group`` neighbouring queries use an average selected key: the sum of the group's valid slots over
    the size of their union (``kernels.index_groups``), averaged over whole groups (1 = no sharing, ``group`` =
    identical sets). The gain bound of a kernel that serves a group of queries over the union of their sets."""
    from megatron_glm5.kernels.index_groups import KEY_LIMIT, group_union_indices

    t = indices.shape[0] // group * group
    if t == 0:
        return 1.0
    _, length = group_union_indices(indices[:t], group)
    valid = ((indices[:t] >= 0) & (indices[:t] < KEY_LIMIT)).reshape(t // group, -1).sum(dim=-1)
    return float((valid / length.clamp_min(1)).mean())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def timed(fn, min_warmup: int = 3) -> float:
    """Median ms; one untimed call first (compiles), warm-up >= ``min_warmup`` calls."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=max(25, min_warmup * est), rep=max(100, 5 * est), return_mode="median")


# ----------------------------------------------------------------------------------------------------------------
# (a) sparse MLA
# ----------------------------------------------------------------------------------------------------------------


def bench_sparse(seq: int, heads: int, mcore: bool, det: bool, variant: str = "auto", bwd: bool = True,
                 locality: float | None = None) -> dict:
    from megatron_glm5.fusions import KEY_BLOCK_DKV_ENV, enabled
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_autograd

    key_blocks = enabled(KEY_BLOCK_DKV_ENV)  # as the TileLang attention calls it (where key_blocks_pay holds)

    def sparse_mla_with_lse(q, kv, idx, scale, *, deterministic=False):
        return sparse_mla_autograd(q, kv, idx, scale, D_V, deterministic=deterministic, variant=variant,
                                   key_blocks=key_blocks)

    dev = torch.device("cuda")
    torch.manual_seed(seq + heads)
    q = torch.randn(seq, heads, D_QK, device=dev, dtype=torch.bfloat16).requires_grad_()
    kv = torch.randn(seq, D_QK, device=dev, dtype=torch.bfloat16).requires_grad_()
    if locality is None:
        idx = causal_random_indices(seq, TOPK, dev)
    else:
        idx = local_mix_indices(seq, TOPK, dev, locality)
    g = torch.randn(seq, heads, D_V, device=dev, dtype=torch.bfloat16)
    pairs = int((idx >= 0).sum())
    f_fwd = 2 * pairs * heads * (D_QK + D_V)
    f_bwd = 2 * pairs * heads * (3 * D_QK + 2 * D_V)
    row = {"S": seq, "H": heads, "pairs": pairs, "indices": "random" if locality is None else f"local {locality:g}",
           "sharing": group_sharing(idx, 4)}

    def ours_fwd():
        with torch.no_grad():
            return sparse_mla_with_lse(q, kv, idx, SCALE)

    out, lse = sparse_mla_with_lse(q, kv, idx, SCALE)

    def ours_bwd():
        torch.autograd.grad(out, (q, kv), g, retain_graph=True)

    def ours_fb():
        o, _ = sparse_mla_with_lse(q, kv, idx, SCALE)
        torch.autograd.grad(o, (q, kv), g)

    row["ours_fwd_ms"] = timed(ours_fwd)
    row["ours_fwd_tflops"] = f_fwd / row["ours_fwd_ms"] / 1e9
    # Kernel-only forward of each variant that fits (valid_len precomputed): the wrapper overhead, which kernel wins.
    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    vlen = row_valid_len(idx)
    for v in ("ws", "pp", "sv", "simple"):
        if (variant == v or (variant == "auto" and v != "sv")) and (v not in ("pp", "sv") or heads > 32):
            try:
                row[f"fwd_{v}_kernel_ms"] = timed(
                    lambda v=v: sparse_mla_fwd_interface(q.detach(), kv.detach(), idx, SCALE, D_V, valid_len=vlen, variant=v)
                )
            except Exception as err:
                row[f"fwd_{v}_error"] = repr(err)[:120]
    if bwd:
        row["ours_bwd_ms"] = timed(ours_bwd)
        row["ours_fb_ms"] = timed(ours_fb)
        row["ours_bwd_tflops"] = f_bwd / row["ours_bwd_ms"] / 1e9
    if det and bwd:
        out_d, _ = sparse_mla_with_lse(q, kv, idx, SCALE, deterministic=True)
        row["ours_bwd_det_ms"] = timed(lambda: torch.autograd.grad(out_d, (q, kv), g, retain_graph=True))
        del out_d
    if mcore:
        try:
            from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA

            kv3, idx3 = kv[:, None], idx[:, None]

            def mc_fwd():
                with torch.no_grad():
                    return SparseMLA.apply(q, kv3, idx3, SCALE)

            def mc_fb():
                o, _ = SparseMLA.apply(q, kv3, idx3, SCALE)
                torch.autograd.grad(o, (q, kv), g)

            with torch.no_grad():
                mc_out, mc_lse = SparseMLA.apply(q.detach(), kv3.detach(), idx3, SCALE)
            row["out_cos_vs_mcore"] = cosine(out.detach(), mc_out)
            del mc_out, mc_lse
            row["mc_fwd_ms"] = timed(mc_fwd)
            row["mc_fwd_tflops"] = f_fwd / row["mc_fwd_ms"] / 1e9
            if bwd:
                row["mc_fb_ms"] = timed(mc_fb)
                row["mc_bwd_ms"] = row["mc_fb_ms"] - row["mc_fwd_ms"]
                row["mc_bwd_tflops"] = f_bwd / row["mc_bwd_ms"] / 1e9
        except Exception as err:  # keep benchmarking our side
            row["mcore_error"] = repr(err)[:200]
    return row


# ----------------------------------------------------------------------------------------------------------------
# (b) indexer + top-k
# ----------------------------------------------------------------------------------------------------------------


def _peak(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    return res, (torch.cuda.max_memory_allocated() - base) / 2**30


@torch.no_grad()
def topk_overlap(a: torch.Tensor, b: torch.Tensor, seq: int, chunk: int = 1024) -> float:
    """Mean over rows of |a ∩ b| / |b valid| (index sets, -1 ignored)."""
    hit = tot = 0
    for r0 in range(0, a.shape[0], chunk):
        r1 = min(a.shape[0], r0 + chunk)
        mask = torch.zeros(r1 - r0, seq + 1, dtype=torch.bool, device=a.device)
        mask.scatter_(1, torch.where(a[r0:r1] >= 0, a[r0:r1], seq).long(), True)
        mask[:, seq] = False
        bb = b[r0:r1]
        hit += int((mask.gather(1, torch.where(bb >= 0, bb, seq).long()) & (bb >= 0)).sum())
        tot += int((bb >= 0).sum())
    return hit / max(tot, 1)


def bench_indexer(seq: int, mcore: bool) -> dict:
    from megatron_glm5.kernels import indexer_topk

    dev = torch.device("cuda")
    torch.manual_seed(seq)
    q = torch.randn(seq, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(seq, 128, device=dev, dtype=torch.bfloat16)
    w = torch.randn(seq, 32, device=dev) * (32**-0.5 * 128**-0.5)
    starts = torch.zeros(seq, dtype=torch.int32, device=dev)
    ends = torch.arange(1, seq + 1, dtype=torch.int32, device=dev)
    row = {"S": seq}
    ours = lambda: indexer_topk(q, k, w, starts, ends, TOPK)  # noqa: E731
    ours()
    out, row["ours_peak_gib"] = _peak(ours)
    row["ours_ms"] = timed(ours)
    again = ours()
    row["ours_deterministic"] = bool(torch.equal(out, again))
    del again
    try:  # split: the logits GEMM kernel vs the top-k select kernel (select timed on the last chunk's logits)
        im = importlib.import_module("megatron_glm5.kernels.indexer_topk")
        lk, sk = im.logits_kernel(32, 128), im._jit_select()(TOPK)
        rows = im.logits_chunk_rows(seq, 4)
        buf = torch.empty(min(rows, seq), seq, dtype=torch.float32, device=dev)
        res = torch.empty(seq, TOPK, dtype=torch.int32, device=dev)
        offs = [(c0, min(seq, c0 + rows), torch.full((1,), c0, dtype=torch.int32, device=dev)) for c0 in range(0, seq, rows)]
        row["logits_ms"] = timed(lambda: [lk(q, k, w, starts, ends, o, buf[: c1 - c0]) for c0, c1, o in offs])
        row["select_ms"] = timed(lambda: [sk(buf[: c1 - c0], starts, ends, o, res) for c0, c1, o in offs])
    except Exception as err:
        row["split_error"] = repr(err)[:120]
    if mcore:
        try:
            from megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa import fused_qk_topk_lighting

            q4, k3, w3 = q[:, None], k[:, None], w[:, None]
            mc = lambda: fused_qk_topk_lighting(q4, k3, w3, TOPK, starts, ends, 8192)  # noqa: E731
            mc()
            mc_out, row["mc_peak_gib"] = _peak(mc)
            row["mc_ms"] = timed(mc)
            row["overlap_vs_mcore"] = topk_overlap(out, mc_out[0], seq)
        except Exception as err:
            row["mcore_error"] = repr(err)[:200]
    return row


# ----------------------------------------------------------------------------------------------------------------
# (e) RL: short packed (THD) batches, the whole DSA attention (indexer + top-k + sparse MLA fwd + bwd)
# ----------------------------------------------------------------------------------------------------------------

PACKED_BATCHES = {
    "1 x 1K": [1024],
    "8 x 1K": [1024] * 8,
    "4 x 1K-8K": [1024, 2048, 4096, 8192],
    "8 x 1K-8K": [8192, 1024, 4096, 2048, 1024, 8192, 2048, 4096],
}


def bench_packed(name: str, lengths: list[int], heads: int, mcore: bool) -> dict:
    """One packed batch of ``lengths`` (causal within each sequence): indexer + top-k, then sparse MLA forward and
    backward on those indices, ours against megatron-core's TileLang path (same inputs; each side its own top-k)."""
    from megatron_glm5.fusions import KEY_BLOCK_DKV_ENV, enabled
    from megatron_glm5.kernels import indexer_topk
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_autograd

    key_blocks = enabled(KEY_BLOCK_DKV_ENV)  # as the TileLang attention calls it
    dev = torch.device("cuda")
    total = sum(lengths)
    g = torch.Generator(device=dev).manual_seed(total + heads)
    starts = torch.cat([torch.full((n,), o, dtype=torch.int32) for n, o in
                        zip(lengths, [sum(lengths[:i]) for i in range(len(lengths))])]).to(dev)
    ends = torch.arange(1, total + 1, dtype=torch.int32, device=dev)
    qi = torch.randn(total, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    ki = torch.randn(total, 128, device=dev, dtype=torch.bfloat16, generator=g)
    wi = torch.randn(total, 32, device=dev, generator=g) * (32**-0.5 * 128**-0.5)
    q = torch.randn(total, heads, D_QK, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    kv = torch.randn(total, D_QK, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    go = torch.randn(total, heads, D_V, device=dev, dtype=torch.bfloat16, generator=g)
    row = {"batch": name, "T": total, "H": heads}

    def ours():
        idx = indexer_topk(qi, ki, wi, starts, ends, TOPK)
        o, _ = sparse_mla_autograd(q, kv, idx, SCALE, D_V, key_blocks=key_blocks)
        torch.autograd.grad(o, (q, kv), go)

    row["ours_topk_ms"] = timed(lambda: indexer_topk(qi, ki, wi, starts, ends, TOPK))
    row["ours_ms"] = timed(ours)
    if mcore:
        try:
            from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA
            from megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa import fused_qk_topk_lighting

            def mc_topk():
                return fused_qk_topk_lighting(qi[:, None], ki[:, None], wi[:, None], TOPK, starts, ends, 8192)[0]

            def mc():
                o, _ = SparseMLA.apply(q, kv[:, None], mc_topk()[:, None], SCALE)
                torch.autograd.grad(o, (q, kv), go)

            row["mc_topk_ms"] = timed(mc_topk)
            row["mc_ms"] = timed(mc)
        except Exception as err:
            row["mcore_error"] = repr(err)[:200]
    return row


def report_packed(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "## (e) RL packed batches: indexer + top-k + sparse MLA fwd + bwd (32 x 128 indexer, top-k 2048, causal per "
        "sequence)",
        "",
        "| batch | tokens | H | top-k ms (ours / mcore) | whole ms (ours / mcore) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r.get('T', '-')} | {r.get('H', '-')} | FAILED: {r['error']} |||")
            continue
        mc = r.get("mc_ms")
        lines.append(
            f"| {r['batch']} | {r['T']} | {r['H']} | {r['ours_topk_ms']:.2f} / {_f(r.get('mc_topk_ms'), '{:.2f}')} "
            f"| {r['ours_ms']:.2f} / {_f(mc, '{:.2f}')} | {_f(mc and mc / r['ours_ms'], '{:.2f}')} |"
        )
    return lines


# ----------------------------------------------------------------------------------------------------------------
# (c) KPool selection, (d) NoPE sparse MLA (GLM-5.3-Flash)
# ----------------------------------------------------------------------------------------------------------------


def timed_few(fn, reps: int = 3) -> float:
    """Median ms of ``reps`` CUDA-event-timed calls after one untimed call (for slow torch references)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def bench_kpool(seq: int) -> dict:
    from megatron_glm5.dsa import kpool
    from megatron_glm5.kernels import kpool_indexer_topk
    from megatron_glm5.kernels import kpool_topk as kt
    from megatron_glm5.kernels.indexer_topk import indexer_topk_interface

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seq)
    q = torch.randn(seq, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(seq, 128, device=dev, dtype=torch.bfloat16, generator=g)
    gate = torch.randn(seq, 128, device=dev, dtype=torch.bfloat16, generator=g)
    ape = torch.randn(KPOOL_P, 128, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(seq, 32, device=dev, generator=g) * (32**-0.5 * 128**-0.5)
    cu = torch.tensor([0, seq], dtype=torch.int32, device=dev)
    starts = torch.zeros(seq, dtype=torch.int32, device=dev)
    ends = torch.arange(1, seq + 1, dtype=torch.int32, device=dev)
    row = {"S": seq}
    ours = lambda: kpool_indexer_topk(q, k, gate, ape, w, cu, index_topk=TOPK, starts=starts, ends=ends)  # noqa: E731
    ours()
    out, row["ours_peak_gib"] = _peak(ours)
    row["ours_ms"] = timed(ours)
    row["deterministic"] = bool(torch.equal(out, ours()))
    # split: pool keys (torch), pool scores + top-k (the two kernels), expansion + tail (torch)
    keys, first_row, dps = kt.pool_keys_fixed(k, gate, ape, cu)
    lo, hi, sel_k, vis = kt.pool_ranges(starts, ends, cu, dps, KPOOL_P, TOPK // KPOOL_P)
    pidx = indexer_topk_interface(q, keys, w, lo, hi, TOPK // KPOOL_P)
    row["keys_ms"] = timed(lambda: kt.pool_keys_fixed(k, gate, ape, cu))
    row["select_ms"] = timed(lambda: indexer_topk_interface(q, keys, w, lo, hi, TOPK // KPOOL_P))
    row["expand_ms"] = timed(lambda: kt.expand_pools(pidx, first_row, starts, vis, sel_k, KPOOL_P, KPOOL_WIDTH, True))
    ref_fn = lambda: kpool.kpool_indexer_topk(q, k, gate, ape, w, cu, index_topk=TOPK)  # noqa: E731
    want, row["ref_peak_gib"] = _peak(ref_fn)
    row["ref_ms"] = timed_few(ref_fn)
    same = (out.sort(-1).values == want.sort(-1).values).all(-1)
    row["same_set_rows"] = float(same.float().mean())
    row["bitwise_rows"] = float((out == want).all(-1).float().mean())
    return row


def bench_nope(seq: int, heads: int) -> dict:
    from megatron_glm5.dsa import reference as ref
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_autograd

    dev = torch.device("cuda")
    torch.manual_seed(seq + heads)
    d = D_NOPE
    q = torch.randn(seq, heads, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    kv = torch.randn(seq, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    idx = causal_random_indices(seq, KPOOL_WIDTH, dev)  # width 2051: no multiple of any block
    g = torch.randn(seq, heads, d, device=dev, dtype=torch.bfloat16)
    pairs = int((idx >= 0).sum())
    f_fwd, f_bwd = 2 * pairs * heads * (d + d), 2 * pairs * heads * (3 * d + 2 * d)
    row = {"S": seq, "H": heads, "pairs": pairs, "indices": "random", "sharing": group_sharing(idx, 4)}

    def ours_fwd():
        with torch.no_grad():
            return sparse_mla_autograd(q, kv, idx, SCALE, d)

    out, _ = sparse_mla_autograd(q, kv, idx, SCALE, d)
    row["ours_fwd_ms"] = timed(ours_fwd)
    row["ours_bwd_ms"] = timed(lambda: torch.autograd.grad(out, (q, kv), g, retain_graph=True))
    row["ours_fb_ms"] = timed(lambda: torch.autograd.grad(sparse_mla_autograd(q, kv, idx, SCALE, d)[0], (q, kv), g))
    row["ours_fwd_tflops"] = f_fwd / row["ours_fwd_ms"] / 1e9
    row["ours_bwd_tflops"] = f_bwd / row["ours_bwd_ms"] / 1e9
    out_d = out.detach()
    # torch reference (bf16 inputs, fp32 math, 256-row chunks): fwd, fwd+bwd; bwd = the difference
    chunk = 256

    def ref_fwd():
        with torch.no_grad():
            return ref.sparse_mla(q, kv, idx, SCALE, d, chunk=chunk)

    def ref_fb():
        o, _ = ref.sparse_mla(q, kv, idx, SCALE, d, chunk=chunk)
        torch.autograd.grad(o, (q, kv), g)

    try:
        o_ref, _ = ref_fwd()
        row["out_cos_vs_ref"] = cosine(out_d, o_ref)
        del o_ref
        row["ref_fwd_ms"] = timed_few(ref_fwd, reps=2)
        row["ref_fb_ms"] = timed_few(ref_fb, reps=2)
        row["ref_bwd_ms"] = row["ref_fb_ms"] - row["ref_fwd_ms"]
    except Exception as err:  # e.g. out of memory: keep our numbers
        row["ref_error"] = repr(err)[:160]
    return row


def report_flash(kpool_rows: list[dict], nope_rows: list[dict]) -> list[str]:
    lines = []
    if kpool_rows:
        lines += [
            "",
            f"## (c) KPool selection (GLM-5.3-Flash: 32 x 128 indexer, P = {KPOOL_P}, index_topk {TOPK}, width "
            f"{KPOOL_WIDTH}, causal) vs the torch reference `megatron_glm5.dsa.kpool`",
            "",
            "| S | ours ms | torch ref ms | speed-up | ours peak GiB | ref peak GiB | split: pool keys / scores+top-k / "
            "expand ms | rows with the ref's index set | rows bitwise equal | deterministic |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in kpool_rows:
            if "error" in r:
                lines.append(f"| {r['S']} | FAILED: {r['error']} |||||||||")
                continue
            lines.append(
                f"| {r['S']} | {r['ours_ms']:.2f} | {r['ref_ms']:.2f} | {r['ref_ms'] / r['ours_ms']:.1f} "
                f"| {r['ours_peak_gib']:.2f} | {r['ref_peak_gib']:.2f} "
                f"| {r['keys_ms']:.2f} / {r['select_ms']:.2f} / {r['expand_ms']:.2f} | {r['same_set_rows']:.5f} "
                f"| {r['bitwise_rows']:.5f} | {r['deterministic']} |"
            )
        lines += ["", "Rows whose index set differs from the reference can only be fp32 near-ties at the top-k "
                  "boundary (the tests exclude and count them)."]
    if nope_rows:
        lines += [
            "",
            f"## (d) NoPE sparse MLA (GLM-5.3-Flash: d_qk = d_v = {D_NOPE}, width {KPOOL_WIDTH}, scale 1/16, causal "
            "random indices) vs the torch reference `megatron_glm5.dsa.reference.sparse_mla` (fp32 math)",
            "",
            f"TFLOP/s over valid pairs: fwd 2*pairs*H*({D_NOPE}+{D_NOPE}), bwd 2*pairs*H*(3*{D_NOPE}+2*{D_NOPE}).",
            "",
            "| S | H | fwd ms (ours / ref) | fwd TFLOP/s (ours) | fwd x | bwd ms (ours / ref) | bwd TFLOP/s (ours) | bwd x "
            "| fwd+bwd ms (ours / ref) | fwd+bwd x | out cos vs ref |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in nope_rows:
            if "error" in r:
                lines.append(f"| {r['S']} | {r['H']} | FAILED: {r['error']} |||||||||")
                continue
            rf, rb, rfb = r.get("ref_fwd_ms"), r.get("ref_bwd_ms"), r.get("ref_fb_ms")
            lines.append(
                f"| {r['S']} | {r['H']} | {r['ours_fwd_ms']:.2f} / {_f(rf, '{:.1f}')} | {r['ours_fwd_tflops']:.1f} "
                f"| {_f(rf and rf / r['ours_fwd_ms'], '{:.1f}')} | {r['ours_bwd_ms']:.2f} / {_f(rb, '{:.1f}')} "
                f"| {r['ours_bwd_tflops']:.1f} | {_f(rb and rb / r['ours_bwd_ms'], '{:.1f}')} "
                f"| {r['ours_fb_ms']:.2f} / {_f(rfb, '{:.1f}')} | {_f(rfb and rfb / r['ours_fb_ms'], '{:.1f}')} "
                f"| {_f(r.get('out_cos_vs_ref'), '{:.6f}')} |"
                + (f" ref: {r['ref_error']}" if "ref_error" in r else "")
            )
    return lines


def smoke(variant: str) -> int:
    """Every kernel once at a tiny shape against the torch oracle; exit code 0 only if all agree."""
    from megatron_glm5.dsa import reference as ref
    from megatron_glm5.kernels import indexer_topk
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_autograd
    from megatron_glm5.kernels.sparse_mla_fwd import pick_fwd_variant, sparse_mla_fwd_interface

    dev = torch.device("cuda")
    ok = True
    for heads in (64, 16):
        q = torch.randn(300, heads, D_QK, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(300, D_QK, device=dev, dtype=torch.bfloat16)
        idx = causal_random_indices(300, 256, dev)
        o_ref, l_ref = ref.sparse_mla(q.float(), kv.float(), idx, SCALE, D_V)
        forced = variant if variant != "auto" else pick_fwd_variant(heads, D_QK, D_V)
        for v in ("simple", forced if forced in ("ws", "simple") or heads > 32 else "ws"):  # pp / sv: 64-row tiles
            t0 = time.time()
            o, l = sparse_mla_fwd_interface(q, kv, idx, SCALE, D_V, variant=v)
            torch.cuda.synchronize()
            c = cosine(o, o_ref)
            print(f"[smoke] fwd {v} H={heads}: cos={c:.6f} lse_err={(l - l_ref).abs().max().item():.2e} ({time.time() - t0:.1f} s)", flush=True)
            ok &= c > 0.9999
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        g = torch.randn(300, heads, D_V, device=dev, dtype=torch.bfloat16)
        sparse_mla_autograd(qq, kk, idx, SCALE, D_V, variant=variant if heads > 32 else "auto")[0].backward(g)
        qf, kf = q.float().requires_grad_(), kv.float().requires_grad_()
        ref.sparse_mla(qf, kf, idx, SCALE, D_V)[0].backward(g.float())
        c1, c2 = cosine(qq.grad, qf.grad), cosine(kk.grad, kf.grad)
        print(f"[smoke] bwd H={heads}: dq cos={c1:.6f} dkv cos={c2:.6f}", flush=True)
        ok &= c1 > 0.999 and c2 > 0.999
    q = torch.randn(700, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(700, 128, device=dev, dtype=torch.bfloat16)
    w = torch.randn(700, 32, device=dev) / 64
    st, en = ref.causal_bounds(ref.uniform_cu_seqlens(1, 700, device=dev))
    got, exp = indexer_topk(q, k, w, st, en, 256), ref.indexer_topk(q, k, w, st, en, 256)
    same = float((got.sort(-1).values == exp.sort(-1).values).all(-1).float().mean())
    print(f"[smoke] indexer: rows with identical top-k sets {same:.4f}", flush=True)
    ok &= same > 0.98
    print("[smoke] OK" if ok else "[smoke] FAILED", flush=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def report(sparse_rows: list[dict], idx_rows: list[dict], notes: list[str], kpool_rows: list[dict] = (),
           nope_rows: list[dict] = (), packed_rows: list[dict] = ()) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    import tilelang

    head = [
        "# DSA kernel benchmark: megatron_glm5.kernels vs megatron-core 0.19.2 (TileLang)",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}; git commit: {commit or '?'} (+ working tree)",
        f"- GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}; torch {torch.__version__}; tilelang {tilelang.__version__}",
    ]
    flash = report_flash(list(kpool_rows), list(nope_rows)) + report_packed(list(packed_rows))
    if not sparse_rows and not idx_rows:  # GLM-5.3-Flash sections only
        lines = head + ["- bf16; `triton.testing.do_bench` median (ours), median of CUDA-event-timed calls (torch refs)"]
        lines += flash + ([""] + ["Notes:", ""] + [f"- {n}" for n in notes] if notes else [])
        return "\n".join(lines) + "\n"
    lines = head + [
        "- bf16, d_qk 576 / d_v 512, top-k 2048, causal random indices, scale 1/16; `triton.testing.do_bench` median",
        "- TFLOP/s over valid pairs: fwd 2*pairs*H*(576+512), bwd 2*pairs*H*(3*576+2*512); mcore bwd = (fwd+bwd) - fwd",
        "  (it re-runs its forward), ours = backward alone (saved out/LSE). Ratio = ours speed / megatron-core speed.",
        "",
        "## (a) sparse MLA",
        "",
        "| S | H | fwd ms (ours / mcore) | fwd TFLOP/s (ours / mcore) | fwd x | bwd ms (ours / mcore) "
        "| bwd TFLOP/s (ours / mcore) | bwd x | fwd+bwd ms (ours / mcore) | fwd+bwd x | out cos vs mcore "
        "| indices (sharing in groups of 4) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sparse_rows:
        if "error" in r:
            lines.append(f"| {r['S']} | {r['H']} | FAILED: {r['error']} |||||||||")
            continue
        mf, mb, mfb = r.get("mc_fwd_ms"), r.get("mc_bwd_ms"), r.get("mc_fb_ms")
        lines.append(
            f"| {r['S']} | {r['H']} | {_f(r['ours_fwd_ms'], '{:.2f}')} / {_f(mf, '{:.2f}')} "
            f"| {_f(r['ours_fwd_tflops'])} / {_f(r.get('mc_fwd_tflops'))} | {_f(mf and mf / r['ours_fwd_ms'], '{:.2f}')} "
            f"| {_f(r.get('ours_bwd_ms'), '{:.2f}')} / {_f(mb, '{:.2f}')} | {_f(r.get('ours_bwd_tflops'))} / {_f(r.get('mc_bwd_tflops'))} "
            f"| {_f(mb and r.get('ours_bwd_ms') and mb / r['ours_bwd_ms'], '{:.2f}')} "
            f"| {_f(r.get('ours_fb_ms'), '{:.2f}')} / {_f(mfb, '{:.2f}')} "
            f"| {_f(mfb and r.get('ours_fb_ms') and mfb / r['ours_fb_ms'], '{:.2f}')} | {_f(r.get('out_cos_vs_mcore'), '{:.6f}')} "
            f"| {r.get('indices', 'random')} ({_f(r.get('sharing'), '{:.2f}')}x) |"
        )
    lines += ["", "Forward kernels alone (valid-length precomputed), TFLOP/s over valid pairs:", ""]
    for r in sparse_rows:
        if "error" in r:
            continue
        f_fwd = 2 * r["pairs"] * r["H"] * (D_QK + D_V)
        parts = [
            f"{v} {r[k]:.2f} ms = {f_fwd / r[k] / 1e9:.0f} TFLOP/s"
            for v, k in (("ws", "fwd_ws_kernel_ms"), ("pp", "fwd_pp_kernel_ms"), ("sv", "fwd_sv_kernel_ms"),
                         ("simple", "fwd_simple_kernel_ms"))
            if k in r
        ]
        lines.append(f"- S={r['S']} H={r['H']}: " + "; ".join(parts))
    dets = [r for r in sparse_rows if "ours_bwd_det_ms" in r]
    if dets:
        lines += ["", "Deterministic backward (no float atomics, fixed-order dKV reduction):", ""]
        for r in dets:
            lines.append(
                f"- S={r['S']} H={r['H']}: {r['ours_bwd_det_ms']:.2f} ms vs {r['ours_bwd_ms']:.2f} ms atomic "
                f"({r['ours_bwd_det_ms'] / r['ours_bwd_ms']:.2f}x)"
            )
    lines += [
        "",
        "## (b) indexer + top-k (32 heads x 128, top-k 2048, causal)",
        "",
        "| S | ours ms | mcore ms | speed-up | ours peak GiB | mcore peak GiB | top-k overlap vs mcore | deterministic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in idx_rows:
        if "error" in r:
            lines.append(f"| {r['S']} | FAILED: {r['error']} |||||||")
            continue
        mc = r.get("mc_ms")
        lines.append(
            f"| {r['S']} | {r['ours_ms']:.2f} | {_f(mc, '{:.2f}')} | {_f(mc and mc / r['ours_ms'], '{:.2f}')} "
            f"| {r['ours_peak_gib']:.2f} | {_f(r.get('mc_peak_gib'), '{:.2f}')} | {_f(r.get('overlap_vs_mcore'), '{:.5f}')} "
            f"| {r['ours_deterministic']} |"
        )
    splits = [r for r in idx_rows if "logits_ms" in r]
    if splits:
        lines += ["", "Indexer split (logits kernel / top-k select kernel, select timed on the last chunk's logits):", ""]
        for r in splits:
            f = 2 * r["S"] * (r["S"] + 1) / 2 * 32 * 128
            lines.append(
                f"- S={r['S']}: logits {r['logits_ms']:.2f} ms ({f / r['logits_ms'] / 1e9:.0f} TFLOP/s on causal pairs), "
                f"select {r['select_ms']:.2f} ms"
            )
    lines += flash
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the markdown table here (also printed)")
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--workers", type=int, default=0, help="precompile in this many processes first (0: skip)")
    ap.add_argument("--no-mcore", action="store_true")
    ap.add_argument("--seqs", default="4096,16384,32768")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--indexer-seqs", default="8192,32768,65536")
    ap.add_argument("--fwd-variant", default="auto", choices=["auto", "ws", "pp", "sv", "simple"])
    ap.add_argument("--index-locality", default="",
                    help="sparse MLA: also time index sets with this locality (comma list in [0, 1]; see "
                         "local_mix_indices), besides the random ones")
    ap.add_argument("--smoke", action="store_true", help="tiny run of every kernel, compared to the torch oracle")
    ap.add_argument("--fwd-only", action="store_true", help="sparse MLA: time the forward only")
    ap.add_argument("--sections", default="sparse,indexer",
                    help="comma list of sparse (a), indexer (b), kpool (c), nope (d), packed (e); also what --precompile-only builds "
                         "(plus flash_small: the kernels of small_flash_config, precompile only)")
    ap.add_argument("--kpool-seqs", default="8192,16384")
    ap.add_argument("--nope-seqs", default="16384")
    ap.add_argument("--nope-heads", default="64,16")
    ap.add_argument("--packed-batches", default=";".join(PACKED_BATCHES), help="';'-separated names of PACKED_BATCHES")
    ap.add_argument("--packed-heads", default="16,64")
    args = ap.parse_args(argv)
    mcore = not args.no_mcore
    sections = tuple(x for x in args.sections.split(",") if x)
    unknown = set(sections) - {"sparse", "indexer", "kpool", "nope", "flash_small", "packed"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    if args.workers or args.precompile_only:
        ok = precompile(args.workers or os.cpu_count() or 4, include_mcore=mcore, sections=sections)
        if args.precompile_only:
            return 0 if ok else 1
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        return smoke(args.fwd_variant)
    sparse_rows, idx_rows, kpool_rows, nope_rows, notes = [], [], [], [], []
    localities = [None] + [float(x) for x in args.index_locality.split(",") if x]
    for seq in [int(s) for s in args.seqs.split(",") if s and "sparse" in sections]:
        for heads in [int(h) for h in args.heads.split(",") if h]:
            for loc in localities:
                try:
                    r = bench_sparse(seq, heads, mcore, det=(seq == 16384 and heads == 64 and loc is None),
                                     variant=args.fwd_variant, bwd=not args.fwd_only, locality=loc)
                except Exception as err:
                    traceback.print_exc()
                    r = {"S": seq, "H": heads, "error": repr(err)[:160]}
                print(r, flush=True)
                sparse_rows.append(r)
                torch.cuda.empty_cache()
    for seq in [int(s) for s in args.indexer_seqs.split(",") if s and "indexer" in sections]:
        try:
            r = bench_indexer(seq, mcore)
        except Exception as err:
            traceback.print_exc()
            r = {"S": seq, "error": repr(err)[:160]}
        print(r, flush=True)
        idx_rows.append(r)
        torch.cuda.empty_cache()
    for seq in [int(s) for s in args.kpool_seqs.split(",") if s and "kpool" in sections]:
        try:
            r = bench_kpool(seq)
        except Exception as err:
            traceback.print_exc()
            r = {"S": seq, "error": repr(err)[:160]}
        print(r, flush=True)
        kpool_rows.append(r)
        torch.cuda.empty_cache()
    for seq in [int(s) for s in args.nope_seqs.split(",") if s and "nope" in sections]:
        for heads in [int(h) for h in args.nope_heads.split(",") if h]:
            try:
                r = bench_nope(seq, heads)
            except Exception as err:
                traceback.print_exc()
                r = {"S": seq, "H": heads, "error": repr(err)[:160]}
            print(r, flush=True)
            nope_rows.append(r)
            torch.cuda.empty_cache()
    packed_rows = []
    for name in [b for b in args.packed_batches.split(";") if b and "packed" in sections]:
        for heads in [int(h) for h in args.packed_heads.split(",") if h]:
            try:
                r = bench_packed(name, PACKED_BATCHES[name], heads, mcore)
            except Exception as err:
                traceback.print_exc()
                r = {"batch": name, "H": heads, "error": repr(err)[:160]}
            print(r, flush=True)
            packed_rows.append(r)
            torch.cuda.empty_cache()
    if args.fwd_variant != "auto":
        notes.append(f"forward kernel variant forced to '{args.fwd_variant}'")
    emit(report(sparse_rows, idx_rows, notes, kpool_rows, nope_rows, packed_rows), args.out, append=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
