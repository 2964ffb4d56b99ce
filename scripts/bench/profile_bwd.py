"""One sparse-MLA backward (or, with ``--forward``, forward) launch at a given shape, for a profiler: the profile
that explains the kernel's speed (round-2 notes: atomics vs the MMA pipes vs registers). Only the call of interest
runs inside ``cudaProfilerStart/Stop``, so ``--profile-from-start off`` picks it without launch counting: the forward
is one ``main_kernel`` launch, the backward two (its ``Delta`` preprocessing, then the backward kernel).

    ncu --set full --profile-from-start off -k regex:main_kernel python scripts/bench/profile_bwd.py --heads 64
    ncu ... python scripts/bench/profile_bwd.py --heads 16 --grouped --index-locality 0.9   # the grouped backward
    ncu ... python scripts/bench/profile_bwd.py --heads 64 --forward                        # the forward
    ncu ... python scripts/bench/profile_bwd.py --heads 16 --seq 8192 --key-blocks wsp      # the key-block dKV kernel

``--key-blocks SCHEDULE`` profiles the key-block dKV kernel alone (``kernels.sparse_mla_dkv``, one launch; its
bitmap, query ranges and ``Delta`` are built before the profiler starts).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsa_kernels import causal_random_indices, local_mix_indices  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--d-qk", type=int, default=576, help="latent width (512: GLM-5.3-Flash's NoPE latent)")
    ap.add_argument("--grouped", action="store_true", help="the grouped kernels (16 heads: 4 queries per CTA)")
    ap.add_argument("--forward", action="store_true", help="profile the forward launch instead of the backward")
    ap.add_argument("--fwd-variant", default="auto", help="the forward kernel (sparse_mla_fwd_interface's variant)")
    ap.add_argument("--index-locality", type=float, default=None,
                    help="synthetic sets with this share of a recency window (local_mix_indices); default random")
    ap.add_argument("--key-blocks", default=None, choices=("wsp", "split", "plain"),
                    help="profile the key-block dKV kernel (this schedule) alone")
    args = ap.parse_args()
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    g = torch.Generator(device="cuda").manual_seed(0)
    h, s = args.heads, args.seq
    q = torch.randn(s, h, args.d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(s, args.d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    dev = torch.device("cuda")
    loc = args.index_locality
    idx = causal_random_indices(s, 2048, dev) if loc is None else local_mix_indices(s, 2048, dev, loc)
    grouped = {}
    if args.grouped:
        from megatron_glm5.kernels.index_groups import group_union_indices

        grouped = {"group": 64 // h, "union": group_union_indices(idx, 64 // h, key_bound=s)}
    do = torch.randn(s, h, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    fwd_kw = {"group": grouped["group"], "union": grouped["union"]} if grouped else {}
    fwd_kw["variant"] = args.fwd_variant

    def forward():
        return sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512, **fwd_kw)

    def backward():
        sparse_mla_bwd_interface(q, kv, out, lse, do, idx, 1 / 16, 512, deterministic=args.deterministic, **grouped)

    out, lse = forward()  # compiled, caches warm: the second launch is the one to look at
    launch = forward if args.forward else backward
    if args.key_blocks:
        launch = key_block_launch(args.key_blocks, q, kv, out, lse, do, idx)
    launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def key_block_launch(schedule: str, q, kv, out, lse, do, idx):
    """The key-block dKV kernel's launch with every input built, as ``sparse_mla_dkv.dkv_key_blocks`` calls it."""
    from megatron_glm5.kernels.selection_bitmap import key_block_query_range, selection_bitmap
    from megatron_glm5.kernels.sparse_mla_bwd import _jit_delta
    from megatron_glm5.kernels.sparse_mla_dkv import KEY_BLOCK, default_chunks, key_block_kernel

    t, h, d_qk = q.shape
    d_v = do.shape[-1]
    delta = _jit_delta()(h, d_v)(out, do, torch.zeros_like(lse))
    bits, _ = selection_bitmap(idx, kv.shape[0])
    qrange = key_block_query_range(bits, KEY_BLOCK)
    part = torch.empty(default_chunks(t, kv.shape[0], q.device), kv.shape[0], d_qk, dtype=torch.float32,
                       device=q.device)
    kernel = key_block_kernel(schedule, h, d_qk, d_v, 1 / 16)
    args = (q.view(t * h, d_qk), kv, do.view(t * h, d_v), lse.view(-1), delta.view(-1), bits, qrange, part)
    return lambda: kernel(*args)


if __name__ == "__main__":
    sys.exit(main())
