"""Micro-benchmark: the routed experts of one MoE layer, megatron-core's ``SequentialMLP`` forward against
megatron-glm5's ``TorchGroupedMLP`` (``torch.nn.functional.grouped_mm``). Both run on the same module and weights:
``impl="sequential"`` is ``SequentialMLP.forward``, unchanged.

    python scripts/bench/bench_grouped_experts.py [--tokens 8192] [--topk 8] [--experts 16] [--hidden 6144]
                                                  [--ffn 2048] [--dtype bfloat16] [--out results.md]

Default shapes are GLM-5's expert dims (hidden 6144, expert ffn 2048, SwiGLU) with 16 local experts. 8K tokens are
routed top-8 uniformly at random, which gives 65,536 rows, about 4,096 per expert, in bf16 on one GPU. The router
probs are fp32 and the activation is megatron-core's fused weighted SwiGLU (``bias_activation_fusion``, as
``RuntimePolicy`` turns it on with CUDA).

For each implementation the script reports ms per call (``triton.testing.do_bench``, median) for forward (grad mode)
and forward+backward, the peak extra memory, and the max |diff| of output and weight gradients against
``SequentialMLP``. It also reports the ms for stacking the local expert weights, a cost the grouped path pays twice
per step. Token counts come on the host, as megatron-core's dispatchers hand them over; the "device counts" row keeps
them on the GPU, with no host sync. The markdown table, with date, commit and GPU, is appended to ``--out``.

Without CUDA, ``--device cpu`` runs the same code on small shapes with a wall-clock timer (a smoke test,
``tests/test_grouped_experts.py``). Importing this file does nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import time


def build_experts(*, hidden: int, ffn: int, experts: int, topk: int, dtype, device: str):
    """A ``TorchGroupedMLP`` (megatron-core parallel state initialised) with N(0, 0.02) weights on ``device``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_glm5.providers import GLMLocalSpecProvider

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_router_topk=topk, moe_grouped_gemm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device == "cpu", perform_initialization=False, gradient_accumulation_fusion=False,
        bias_activation_fusion=device == "cuda", moe_token_dispatcher_type="allgather",
    )
    build = GLMLocalSpecProvider().grouped_mlp_modules(True)
    module = build(experts, config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    return module


def make_inputs(*, tokens: int, topk: int, experts: int, hidden: int, dtype, device: str):
    """Uniform random top-k routing: (x [rows, H] sorted by expert, host counts [E], fp32 probs [rows])."""
    import torch

    gen = torch.Generator().manual_seed(1)
    chosen = torch.rand(tokens, experts, generator=gen).topk(topk, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    rows = int(counts.sum())
    x = (torch.randn(rows, hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)
    probs = torch.rand(rows, generator=gen).to(device)
    return x, counts, probs


def time_ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        import triton.testing as tt

        return tt.do_bench(fn, warmup=25, rep=max(100, reps * 10), return_mode="median")  # times in ms
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def measure(module, impl: str, x, counts, probs, dy, device: str, reps: int) -> dict:
    import torch

    module.impl = impl
    xg, pg = x.detach().requires_grad_(True), probs.detach().requires_grad_(True)

    def forward():
        return module(xg, counts, pg)[0]

    def step():
        module.zero_grad(set_to_none=True)
        forward().backward(dy)

    step()
    y = forward().detach()
    step()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    fwd = time_ms(forward, device, reps)
    both = time_ms(step, device, reps)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if device == "cuda" else float("nan")
    module.zero_grad(set_to_none=True)
    return {"fwd": fwd, "both": both, "peak": peak, "y": y, "grads": grads}


def stack_ms(module, device: str, reps: int) -> float:
    import torch

    w1 = [e.linear_fc1.weight for e in module.local_experts]
    w2 = [e.linear_fc2.weight for e in module.local_experts]
    return time_ms(lambda: (torch.stack(w1), torch.stack(w2)), device, reps)


def _max_rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="markdown file to append the table to")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

    import torch

    from megatron_glm5.cpu import enable_cpu_mode
    from megatron_glm5.parallel import initialize_model_parallel

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        raise SystemExit("no CUDA device: run on a GPU, or pass --device cpu with small shapes (a smoke test)")
    if device == "cpu":
        enable_cpu_mode()
    initialize_model_parallel()
    dtype = getattr(torch, args.dtype)
    shape = dict(hidden=args.hidden, experts=args.experts)
    module = build_experts(ffn=args.ffn, topk=args.topk, dtype=dtype, device=device, **shape)
    x, counts, probs = make_inputs(tokens=args.tokens, topk=args.topk, dtype=dtype, device=device, **shape)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype) * 0.01

    results = {
        "SequentialMLP": measure(module, "sequential", x, counts, probs, dy, device, args.reps),
        "TorchGroupedMLP": measure(module, "grouped_mm", x, counts, probs, dy, device, args.reps),
        "TorchGroupedMLP, device counts": measure(module, "grouped_mm", x, counts.to(device), probs, dy, device,
                                                  args.reps),
    }
    stack = stack_ms(module, device, args.reps)
    ref = results["SequentialMLP"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    lines = [
        f"## Routed experts: SequentialMLP vs TorchGroupedMLP ({datetime.date.today()}, commit {commit or 'n/a'}, "
        f"{where}, torch {torch.__version__})",
        "",
        f"{args.experts} local experts, hidden {args.hidden}, expert ffn {args.ffn} (SwiGLU, fc1 "
        f"{2 * args.ffn}x{args.hidden}), {args.tokens} tokens top-{args.topk} uniform ({x.shape[0]} rows, "
        f"{int(counts.min())}-{int(counts.max())} per expert), {args.dtype}, fp32 probs. ms: median per call.",
        "",
        "| implementation | forward ms | fwd+bwd ms | peak extra GB | fwd speed-up | fwd+bwd speed-up "
        "| max abs diff out (rel.) | max abs diff dW (rel.) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        dw = max(_max_rel(r["grads"][n], ref["grads"][n]) for n in ref["grads"])
        peak = f"{r['peak']:.2f}" if device == "cuda" else "-"
        lines.append(f"| {name} | {r['fwd']:.2f} | {r['both']:.2f} | {peak} | {ref['fwd'] / r['fwd']:.2f}x "
                     f"| {ref['both'] / r['both']:.2f}x | {_max_rel(r['y'], ref['y']):.2e} | {dw:.2e} |")
    lines += ["", f"Stacking the local expert weights (fc1 + fc2, done twice per step by TorchGroupedMLP): "
                  f"{stack:.2f} ms.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
