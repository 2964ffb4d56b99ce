"""Benchmark: one GLM-5 attention layer (16 heads per rank, real dims, bf16) forward + backward with indexer training
off / sparse loss / warm-up (dense attention + dense loss), for our two backends and megatron-core 0.19.2's own DSA
layer (its spec, its TileLang kernels: its fused sparse-loss path, its O(S^2) dense loss), in one process so the
ratios are like for like. Each model is a 1-layer GPTModel (dense MLP 256, vocab 1024) as in bench_glm5_layer.py.

    python scripts/bench/bench_indexer_training.py --seqs 16384 32768 [--variants ...] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_glm5_layer import _glm5_layer_config, _mcore_baseline  # noqa: E402  (same layer, same baseline)
from report import emit  # noqa: E402

LOSS = {
    "off": {},
    "sparse": dict(dsa_indexer_loss_coeff=0.01, dsa_indexer_use_sparse_loss=True),
    # tilelang only: the sparse loss computed in the forward (its separate target kernel), as before the loss moved
    # after the attention's backward (megatron_glm5.dsa.loss_after_attention)
    "sparse-fwd": dict(dsa_indexer_loss_coeff=0.01, dsa_indexer_use_sparse_loss=True),
    "dense": dict(dsa_indexer_loss_coeff=0.01),
    "warmup": dict(dsa_indexer_warmup=True),
}
VARIANTS = [f"{impl}:{loss}" for impl in ("tilelang", "megatron", "mcore") for loss in ("off", "sparse")] + [
    "tilelang:sparse-fwd", "tilelang:warmup", "megatron:warmup", "mcore:dense"]


def build(impl: str, loss: str, heads: int):
    from megatron_glm5.config import RuntimePolicy, parse_hf_config
    from megatron_glm5.model import build_model

    policy = RuntimePolicy(params_dtype=torch.bfloat16, mcore_dsa_kernels="tilelang", **LOSS[loss])
    arch = parse_hf_config(_glm5_layer_config(heads))
    if impl != "mcore":
        return build_model(arch, policy, backend=impl).cuda()
    return _mcore_baseline(heads, **LOSS[loss])  # megatron-core's own layer, its spec


def measure(impl: str, loss: str, seq: int, heads: int, rep: int) -> dict:
    import triton.testing as tt
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    from megatron_glm5.dsa.tilelang_attention import TileLangSparseAttention

    TileLangSparseAttention.loss_after_attention = False if loss == "sparse-fwd" else None
    torch.manual_seed(0)
    model = build(impl, loss, heads)
    model.train()
    ids = torch.randint(0, 1024, (1, seq), device="cuda")
    pos = torch.arange(seq, device="cuda")[None]

    def step():
        model(ids, pos, None, labels=ids).float().mean().backward()

    t0 = time.time()
    step()  # JIT / autotune
    torch.cuda.synchronize()
    first = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = tt.do_bench(step, warmup=1, rep=rep)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    with_grad = sum(int(p.grad is not None and bool(p.grad.abs().sum() > 0)) for p in indexer)
    logged = DSAIndexerLossLoggingHelper.tracker.get("values")
    logged = None if logged is None else float(logged.sum())
    DSAIndexerLossLoggingHelper.tracker.clear()
    del model
    torch.cuda.empty_cache()
    return dict(ms=ms, peak=peak, first=first, grads=f"{with_grad}/{len(indexer)}", logged=logged)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[16384])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--variants", nargs="+", default=VARIANTS, help="impl:loss, impl in tilelang|megatron|mcore")
    p.add_argument("--rep", type=int, default=5, help="do_bench repetition time (ms)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"## Indexer training, one GLM-5 attention layer fwd+bwd ({datetime.date.today()}, commit {commit or 'n/a'}, "
        f"{torch.cuda.get_device_name(0)})", "",
        f"hidden 6144, {args.heads} heads per rank, indexer 32x128, top-k 2048, bf16, 1-layer GPTModel (dense MLP 256, "
        "vocab 1024); `off` = no indexer loss, `sparse` = sparse KL loss (coeff 0.01), `warmup` = dense attention + "
        "dense loss, indexers only, `dense` = megatron-core's dense loss.", "",
        "| seq | implementation | loss | fwd+bwd ms | vs same impl, loss off | peak extra GB | indexer params with grad "
        "| logged loss | first step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq in args.seqs:
        off = {}
        for v in args.variants:
            impl, loss = v.split(":")
            try:
                r = measure(impl, loss, seq, args.heads, args.rep)
            except Exception as e:  # keep going: report what failed
                torch.cuda.empty_cache()
                msg = f"FAILED {type(e).__name__}: {str(e)[:160]}".replace("|", "/").replace("\n", " ")
                lines.append(f"| {seq} | {impl} | {loss} | {msg} | - | - | - | - | - |")
                print(lines[-1], flush=True)
                continue
            if loss == "off":
                off[impl] = r["ms"]
            ratio = f"{r['ms'] / off[impl]:.2f}x" if impl in off and loss != "off" else "-"
            logged = "-" if r["logged"] is None else f"{r['logged']:.4g}"
            lines.append(f"| {seq} | {impl} | {loss} | {r['ms']:.1f} | {ratio} | {r['peak']:.2f} | {r['grads']} | "
                         f"{logged} | {r['first']:.1f} |")
            print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
