"""One launch of the indexer's logits kernel or its top-k select at a given shape, for a profiler (issue #22: what
bounds each of the two kernels behind ``indexer_topk_interface``). Only the launch of interest runs inside
``cudaProfilerStart/Stop``, so ``--profile-from-start off`` picks it without launch counting. The launch is the last
query chunk of the interface's chunking (its longest causal rows), after one warm-up launch of both kernels on it.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --profile-from-start off \\
        python scripts/bench/profile_indexer.py --kernel logits --seq 32768
    ncu ... python scripts/bench/profile_indexer.py --kernel select --seq 32768
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=["logits", "select"], required=True)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--select-batch", type=int, default=None, help="the select's batch (default: the interface's)")
    args = ap.parse_args()
    im = importlib.import_module("megatron_glm5.kernels.indexer_topk")  # the package exports a function of that name

    g = torch.Generator(device="cuda").manual_seed(0)
    s = args.seq
    q = torch.randn(s, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(s, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(s, 32, device="cuda", generator=g) * (32**-0.5 * 128**-0.5)
    starts = torch.zeros(s, dtype=torch.int32, device="cuda")
    ends = torch.arange(1, s + 1, dtype=torch.int32, device="cuda")
    logits = im.logits_kernel(32, 128)
    select = im._jit_select()(args.topk) if args.select_batch is None else \
        im._jit_select()(args.topk, batch=args.select_batch)
    rows = im.logits_chunk_rows(s, 4)
    c0 = (s - 1) // rows * rows  # the last chunk
    row0 = torch.full((1,), c0, dtype=torch.int32, device="cuda")
    buf = torch.empty(s - c0, s, device="cuda")
    out = torch.empty(s, args.topk, dtype=torch.int32, device="cuda")

    def launch_logits():
        logits(q, k, w, starts, ends, row0, buf)

    def launch_select():
        select(buf, starts, ends, row0, out)

    launch_logits()
    launch_select()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    (launch_logits if args.kernel == "logits" else launch_select)()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
