"""The sparse-MLA backward with its gathers' index entries loaded one gather ahead (``_jit_bwd(slot_prefetch=True)``,
the default) against the same kernel loading them after each block's barrier (``slot_prefetch=False``), in one
process on one GPU: the 64-head atomic backward, the 16-head atomic backward and the 16-head dQ pass of the
key-block route (``dkv_reduce="key_blocks"``, whose dQ pass is this kernel without dKV). Random causal top-2048
sets. dQ must be bitwise equal (the math is the same); dKV within fp32 atomic-order noise.

    source .gpu/install.sh && python scripts/bench/bench_slot_prefetch.py --workers 16 --out prefetch.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsa_kernels import causal_random_indices, precompile_step, timed  # noqa: E402
from report import emit  # noqa: E402

BWD = "megatron_glm5.kernels.sparse_mla_bwd"
SCALE = 1.0 / 16
D_QK, D_V = 576, 512
CASES = [  # (label, heads, tokens, dkv_reduce)
    ("atomic backward, 64 heads", 64, 16384, "atomic"),
    ("atomic backward, 16 heads", 16, 8192, "atomic"),
    ("key-block route (dQ pass + key blocks), 16 heads", 16, 8192, "key_blocks"),
    ("key-block route (dQ pass + key blocks), 16 heads", 16, 16384, "key_blocks"),
]


def kernels_to_build() -> list[tuple]:
    out = []
    for prefetch in (True, False):
        extra = () if prefetch else (False,)  # positional: slot_prefetch is the last argument
        out += [(BWD, "_jit_bwd", (h, D_QK, D_V, SCALE, False, 32, 0, False, 0, 1, "atomic", True, *extra))
                for h in (16, 64)]
        out += [(BWD, "_jit_bwd", (16, D_QK, D_V, SCALE, False, 32, 0, False, 0, 1, "atomic", False, *extra))]
    return out


@contextlib.contextmanager
def slot_prefetch(on: bool):
    """``_jit_bwd`` as the interface sees it, with ``slot_prefetch`` forced (the interface passes keywords)."""
    from megatron_glm5.kernels import sparse_mla_bwd as mod

    real = mod._jit_bwd

    def patched():
        build = real()

        def make(*args, **kwargs):
            return build(*args, **kwargs) if on else build(*args, **kwargs, slot_prefetch=False)

        return make

    mod._jit_bwd = patched
    try:
        yield
    finally:
        mod._jit_bwd = real


def run_case(heads: int, seq: int, reduce: str) -> dict:
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    g = torch.Generator(device="cuda").manual_seed(heads + seq)
    q = torch.randn(seq, heads, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(seq, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(seq, heads, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = causal_random_indices(seq, 2048, torch.device("cuda"))
    out, lse = sparse_mla_fwd_interface(q, kv, idx, SCALE, D_V)
    pairs = float((idx >= 0).sum())
    flops = 2 * pairs * heads * (D_QK + D_V + D_QK + D_QK + D_V)  # dP, S (recomputed), dQ, dK, dV
    res = {}
    for on in (False, True):
        with slot_prefetch(on):
            fn = lambda: sparse_mla_bwd_interface(q, kv, out, lse, do, idx, SCALE, D_V, dkv_reduce=reduce)  # noqa: E731
            ms = timed(fn)
            dq, dkv = fn()
        res[on] = (ms, dq, dkv)
    (ms0, dq0, dkv0), (ms1, dq1, dkv1) = res[False], res[True]
    scale = float(dkv0.float().abs().max())
    return {"ms_before": ms0, "ms_after": ms1, "tflops_after": flops / ms1 / 1e9, "speedup": ms0 / ms1,
            "dq_bitwise": bool(torch.equal(dq0, dq1)),
            "dkv_rel_err": float((dkv0.float() - dkv1.float()).abs().max()) / max(scale, 1e-30)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    stop = precompile_step(kernels_to_build(), a.workers, a.precompile_only)
    if stop is not None:
        return stop
    lines = ["Sparse-MLA backward: gather entries prefetched one gather ahead (H200, random causal top-2048)", "",
             "| case | S | entries after the barrier ms | prefetched ms | speed-up | TFLOP/s | dQ bitwise | "
             "dKV max diff / max |", "|---|---|---|---|---|---|---|---|"]
    for label, heads, seq, reduce in CASES:
        r = run_case(heads, seq, reduce)
        lines.append(f"| {label} | {seq} | {r['ms_before']:.2f} | {r['ms_after']:.2f} | {r['speedup']:.3f}x | "
                     f"{r['tflops_after']:.0f} | {r['dq_bitwise']} | {r['dkv_rel_err']:.1e} |")
        print(lines[-1], flush=True)
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
