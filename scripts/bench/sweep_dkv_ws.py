"""The warp-specialised key-block kernel (``sparse_mla_dkv._jit_dkv_key_blocks_ws``, schedule ``wsp``) by register
split, at one shape per latent width (random causal top-2048 sets, 16 heads): kernel ms, dense TFLOP/s, and whether
the result is bitwise the default split's. (Its first run, ``kernels_round10/5_sweep_dkv_ws.md``, also had the
retired ``ws`` schedule.)

    source .gpu/install.sh && python scripts/bench/sweep_dkv_ws.py --seq 8192 --out sweep_dkv_ws.md
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCALE, D_V, TOPK, HEADS = 1.0 / 16, 512, 2048, 16
NREGS = ((136, 168, 200), (120, 168, 216), (152, 168, 184), (104, 184, 216), (168, 168, 168))


def configs(d_qks: list[int]) -> list[tuple[int, tuple[int, int, int]]]:
    return [(d_qk, nreg) for d_qk in d_qks for nreg in NREGS]


def _build(cfg) -> tuple[tuple, str]:
    from megatron_glm5.kernels.sparse_mla_dkv import _jit_dkv_key_blocks_ws

    d_qk, nreg = cfg
    try:
        _jit_dkv_key_blocks_ws()(HEADS, d_qk, D_V, SCALE, 64, 32, nreg)
        return cfg, ""
    except Exception as e:  # a split ptxas refuses is a row, not a crash
        return cfg, f"{type(e).__name__}: {str(e)[:120]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--d-qk", default="576,512")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--out", default="sweep_dkv_ws.md")
    a = ap.parse_args(argv)
    import multiprocessing as mp

    from bench_dsa_kernels import causal_random_indices, timed

    from megatron_glm5.kernels.selection_bitmap import key_block_query_range, selection_bitmap
    from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCK, ROW_TILE, _jit_dkv_key_blocks_ws, default_chunks

    cfgs = configs([int(x) for x in a.d_qk.split(",")])
    with cf.ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn")) as ex:
        errors = dict(ex.map(_build, cfgs))
    dev, s = torch.device("cuda"), a.seq
    torch.manual_seed(s)
    idx = causal_random_indices(s, TOPK, dev)
    bits, _ = selection_bitmap(idx, s)
    qrange = key_block_query_range(bits, KEY_BLOCK)
    n = default_chunks(s, s, dev)
    qpc = -(-s // n)
    tiles = sum(-(-(min((c + 1) * qpc, e, s) - max(c * qpc, f)) * HEADS // ROW_TILE)
                for f, e in qrange.tolist() for c in range(n) if min((c + 1) * qpc, e, s) > max(c * qpc, f))
    rows = []
    for d_qk in sorted({c[0] for c in cfgs}, reverse=True):
        q = torch.randn(s * HEADS, d_qk, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(s, d_qk, device=dev, dtype=torch.bfloat16)
        g = torch.randn(s * HEADS, D_V, device=dev, dtype=torch.bfloat16)
        lse = torch.randn(s * HEADS, device=dev).abs_() + 8
        delta = torch.randn(s * HEADS, device=dev)
        ref = None
        for cfg in (c for c in cfgs if c[0] == d_qk):
            if errors[cfg]:
                rows.append((cfg, None, None, errors[cfg]))
                continue
            k = _jit_dkv_key_blocks_ws()(HEADS, d_qk, D_V, SCALE, 64, 32, cfg[1])
            part = torch.empty(n, s, d_qk, dtype=torch.float32, device=dev)
            args = (q, kv, g, lse, delta, bits, qrange, part)
            ms = timed(lambda: k(*args))
            k(*args)
            if ref is None:
                ref = part.clone()
            rows.append((cfg, ms, bool(torch.equal(ref, part)), ""))
            print(cfg, f"{ms:.3f} ms", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# Key-block kernel by schedule and register split ({datetime.date.today()}, commit {commit} + working "
             f"tree, {torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"{s} tokens, {HEADS} heads, random causal top-{TOPK}, {n} chunks; nreg = registers of the score "
             "warpgroup, the left and the right dKV warpgroup; bitwise: equal to the first row of its latent width.",
             "", "| d_qk | nreg | kernel ms | dense TFLOP/s | bitwise | note |", "|---|---|---|---|---|---|"]
    for (d_qk, nreg), ms, same, err in rows:
        dense = 2 * tiles * ROW_TILE * KEY_BLOCK * (2 * d_qk + 2 * D_V)
        lines.append(f"| {d_qk} | {nreg} | "
                     f"{'-' if ms is None else f'{ms:.3f}'} | {'-' if ms is None else f'{dense / ms / 1e9:.0f}'} | "
                     f"{'-' if same is None else same} | {err} |")
    open(a.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
