"""Tile sweep of the sparse indexer loss's two row kernels (``megatron_glm5.kernels.indexer_loss``) on one GPU: the
index-score kernel (``block_s`` x ``threads``) and the index backward (``block_s`` x ``threads`` x ``dk_reduce``),
plus the torch loss glue between them, each against the default variant's outputs (same inputs), so a faster tile can
be made the default with the numbers behind it.

    python scripts/bench/sweep_indexer_loss_kernels.py --seq 16384 [--out sweep.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsa_kernels import build_in_parallel  # noqa: E402
from bench_indexer_loss import DI, HI, make_inputs, ours_topk, timed  # noqa: E402
from report import emit  # noqa: E402

MOD = "megatron_glm5.kernels.indexer_loss"
SCORES = [(64, 128), (32, 128), (128, 128), (64, 256), (128, 256)]  # (block_s, threads); first = default
# (block_s, threads, dk add, min CTAs per SM for __launch_bounds__ (0: none, -1: the kernel's default, 4 here));
# first = the default kernel. (A two-kernel split, dq/dw then dk, measured 6.1 + 9.3 ms against 10.4 ms on
# 2026-12-02, RESULTS_indexer_training.md, was removed.)
BWD = [(64, 128, "atomic", -1), (64, 128, "bulk", 0), (64, 128, "atomic", 0), (64, 128, "atomic", 3),
       (64, 128, "atomic", 4), (64, 128, "bulk", 3), (32, 128, "bulk", 3), (32, 128, "atomic", 3),
       (64, 256, "atomic", 0)]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    a, b = a[finite].double(), b[finite].double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = [(MOD, "_jit_index_scores", (HI, DI, bs, th)) for bs, th in SCORES]
    cases += [(MOD, "_jit_index_bwd", (HI, DI, False, *v)) for v in BWD]
    build_in_parallel(cases, args.workers)

    from megatron_glm5.kernels._common import row_valid_len
    from megatron_glm5.kernels.indexer_loss import _jit_index_bwd, _jit_index_scores, kl_loss_and_dscore_

    x = make_inputs(args.seq)
    qi, ki, w = x["qi"].detach(), x["ki"].detach(), x["w"].detach().float().contiguous()
    topk = ours_topk(x)
    vlen = row_valid_len(topk)
    lines = [f"## Indexer-loss kernel tiles ({datetime.date.today()}, commit "
             f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}"
             f" + working tree, {torch.cuda.get_device_name(0)}, S={args.seq}, indexer {HI} x {DI}, top-k "
             f"{topk.shape[1]}, causal random top-k)", "",
             "| kernel | block_s | threads | dk add | min CTAs/SM | ms | max rel vs default |",
             "|---|---|---|---|---|---|---|"]

    ref = None
    for bs, th in SCORES:
        kern = _jit_index_scores()(HI, DI, bs, th)
        out = kern(qi, ki, w, topk, vlen)
        ref = out if ref is None else ref
        ms = timed(lambda: kern(qi, ki, w, topk, vlen))
        lines.append(f"| index scores | {bs} | {th} | - | - | {ms:.2f} | {max_rel(out, ref):.1e} |")
        print(lines[-1], flush=True)

    g = torch.Generator(device="cuda").manual_seed(1)
    target = torch.rand(topk.shape, device="cuda", generator=g) * (topk >= 0)
    target /= target.sum(-1, keepdim=True).clamp_min(1e-10)
    rw = torch.full((args.seq,), 1.0 / args.seq, device="cuda")
    score = ref.clone()
    glue_ms = timed(lambda: kl_loss_and_dscore_(score.copy_(ref), target, rw, topk, ki.shape[0]))
    lines.append(f"| loss glue (torch: log-softmax, KL, dscore) | - | - | - | - | {glue_ms:.2f} | - |")
    print(lines[-1], flush=True)
    dscore = score  # holds dscore now

    scale = torch.ones(1, device="cuda")
    row0 = torch.zeros(1, dtype=torch.int32, device="cuda")
    base = None
    for bs, th, how, mb in BWD:
        kern = _jit_index_bwd()(HI, DI, False, bs, th, how, mb)
        dq, dw = torch.empty_like(qi), torch.empty_like(w)
        dk = torch.zeros(ki.shape, dtype=torch.float32, device="cuda")

        def run():
            dk.zero_()
            kern(qi, ki, w, topk, vlen, dscore, scale, row0, dq, dw, dk)

        run()
        got = (dq.clone(), dw.clone(), dk.clone())
        base = got if base is None else base
        ms = timed(run)
        err = max(max_rel(a, b) for a, b in zip(got, base))
        mbs = "default" if mb < 0 else (mb or "-")
        lines.append(f"| index backward | {bs} | {th} | {how} | {mbs} | {ms:.2f} | {err:.1e} |")
        print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
