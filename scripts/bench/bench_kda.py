"""Benchmark: GLM-5.3-Flash's KDA (Kimi Delta Attention), flash-linear-attention's ``chunk_kda`` against our torch
reference (:func:`megatron_glm5.glm5_next.kda_reference.chunk_kda`, fp32 autograd; what runs without fla), forward +
backward, bf16 inputs, at 4K / 16K / 64K tokens.

Two levels:

* ``kernel``: the recurrence alone (``q, k, v, g, beta`` as the layer passes them; q/k L2 norm in the kernel);
* ``layer``: the whole ``KimiDeltaAttention`` module (projections, short convolution, gate, recurrence, gated norm,
  output projection) at GLM-5.3-Flash's widths: hidden 4096, head width 128, ``--heads`` heads (default 8: the 64
  KDA heads of the model at TP=8, as one GPU of a TP=8 group computes them).

The torch reference builds a ``[B, H, T/64, 64, 64, 128]`` fp32 decay tensor (and autograd keeps several of its
size), so at long sequences it runs out of memory: such rows say "OOM" with the size that failed. Timings: CUDA
events around ``--reps`` repetitions after one warm-up (which also runs fla's autotuning for the shape: run
``scripts/fla_precompile.py --keys bench`` first to keep that out of this run), the median reported.

    python3 scripts/bench/bench_kda.py --out OUT/kda.md [--seqs 4096,16384,65536] [--heads 8] [--full-heads]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dsa_kernels import timed_few  # noqa: E402  (median of CUDA-event-timed calls after a warm-up)
from report import emit  # noqa: E402


def _guarded(fn, reps: int) -> tuple[str, float | None, float]:
    """(label, ms or None, peak GiB)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        ms = timed_few(fn, reps)  # one untimed call first (fla's autotuning, the allocator)
        return f"{ms:.2f}", ms, torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        return f"OOM (> {peak:.0f} GiB)", None, peak


def kernel_inputs(t: int, h: int, d: int = 128, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.nn.functional.silu(torch.randn(1, t, h, d, device="cuda", generator=gen)).bfloat16()
               for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(1, t, h, d, device="cuda", generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(1, t, h, device="cuda", generator=gen)).bfloat16()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def kernel_step(kind: str, inputs):
    from megatron_glm5.glm5_next import kda_reference as ref
    from megatron_glm5.glm5_next.kda import fla_chunk_kda

    d = inputs[0].shape[-1]
    do = torch.randn_like(inputs[2])

    def step():
        for x in inputs:
            x.grad = None
        if kind == "fla":
            o, _ = fla_chunk_kda()(*inputs, scale=d**-0.5, use_qk_l2norm_in_kernel=True)
        else:
            o = ref.chunk_kda(*inputs, scale=d**-0.5)
        o.backward(do)

    return step


def build_layer(kind: str, heads: int, hidden: int = 4096):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.glm5_next.config import parse_glm5_next_config
    from megatron_glm5.glm5_next.mcore_config import build_transformer_config
    from megatron_glm5.glm5_next.spec import kda_attention_spec
    from megatron_glm5.glm5_next.testing import small_flash_config
    from megatron_glm5.providers import default_provider

    arch = parse_glm5_next_config({"model_type": "glm5_next", **small_flash_config(
        hidden_size=hidden, linear_num_heads=heads, linear_head_dim=128)})
    cfg = build_transformer_config(arch, RuntimePolicy(params_dtype=torch.bfloat16), kda_kernel=kind)
    torch.manual_seed(0)
    return build_module(kda_attention_spec(default_provider()), config=cfg, layer_number=1).cuda()


def layer_step(layer, t: int, hidden: int = 4096):
    x = torch.randn(t, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        out, _ = layer(x)
        out.backward(dy)

    return step


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="4096,16384,65536")
    p.add_argument("--heads", type=int, default=8, help="KDA heads on this GPU (default 8: 64 heads at TP=8)")
    p.add_argument("--full-heads", action="store_true", help="also the kernel at 64 heads (one GPU, no TP)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--torch-max-seq", type=int, default=65536, help="skip the torch reference above this length")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from megatron_glm5.glm5_next.kda import fla_chunk_kda
    from megatron_glm5.parallel import destroy_model_parallel, initialize_model_parallel

    if fla_chunk_kda() is None:
        print("flash-linear-attention is not installed (bash scripts/gpu_glm5_next.sh installs it)", file=sys.stderr)
        return 1
    seqs = [int(s) for s in args.seqs.split(",")]
    rows = []

    def measure(level: str, heads: int, t: int, make):
        res = {}
        for kind in ("fla", "torch"):
            if kind == "torch" and t > args.torch_max_seq:
                res[kind] = ("skipped", None, 0.0)
                continue
            step = make(kind)
            res[kind] = _guarded(step, args.reps if kind == "fla" or t <= 16384 else 1)
            del step
            torch.cuda.empty_cache()
        fla_ms, torch_ms = res["fla"][1], res["torch"][1]
        speedup = f"{torch_ms / fla_ms:.1f}x" if fla_ms and torch_ms else "-"
        tok_s = f"{t / fla_ms * 1e3 / 1e6:.2f}" if fla_ms else "-"
        row = (level, heads, t, res["fla"][0], f"{res['fla'][2]:.1f}", res["torch"][0], f"{res['torch'][2]:.1f}",
               speedup, tok_s)
        rows.append(row)
        print("  ".join(str(c) for c in row), flush=True)

    initialize_model_parallel()
    try:
        for t in seqs:
            inputs = kernel_inputs(t, args.heads)
            measure("kernel", args.heads, t, lambda kind: kernel_step(kind, inputs))
            del inputs
            layers = {}
            measure("layer", args.heads, t,
                    lambda kind: layer_step(layers.setdefault(kind, build_layer(kind, args.heads)), t))
            del layers
        if args.full_heads:
            for t in seqs[:2]:
                inputs = kernel_inputs(t, 64)
                measure("kernel", 64, t, lambda kind: kernel_step(kind, inputs))
                del inputs
    finally:
        destroy_model_parallel()

    import fla
    import triton

    head = ("| level | KDA heads | tokens | fla fwd+bwd ms | fla peak GiB | torch fwd+bwd ms | torch peak GiB | "
            "fla speed-up | fla M tokens/s |")
    lines = [
        f"## {datetime.date.today()}, commit {git_commit()}, {torch.cuda.get_device_name()}",
        "",
        f"`python3 scripts/bench/bench_kda.py {' '.join(argv if argv is not None else sys.argv[1:])}`; torch "
        f"{torch.__version__}, triton {triton.__version__}, fla {fla.__version__}; bf16 inputs, batch 1, head width "
        "128, fwd + bwd, median of the repetitions after a warm-up (torch above 16K: one repetition).",
        "",
        head,
        "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    emit(lines, args.out, append=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
