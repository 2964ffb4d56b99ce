"""Benchmark: whole training steps of a GLM-5.3-Flash-shaped one-GPU slice through Megatron-LM's training loop
(``python -m megatron_glm5.pretrain --hf-config``), per attention backend and KDA kernel.

The slice: GLM-5.3-Flash's real widths (hidden 4096; KDA heads 128 wide with a width-4 short convolution; NoPE DSA
with q/k/v 256, q_lora 1536, kv_lora 512, a 32 x 128 KPool indexer with pools of 4 and top-k 2048; mHC with 4
streams; dense FFN 12288; routed experts 2048 wide, one shared expert) in the real KDA : DSA ratio, 4 layers
(KDA + dense MLP, KDA + MoE, KDA + MoE, DSA + MoE), 16 attention and 16 KDA heads (the model's 64 at TP=4, as the
GLM-5 slice of ``bench_step.py`` takes 16 of GLM-5's 64), 16 experts top-8 (288 do not fit one GPU), no MTP; vocab
4096 (NullTokenizer); 8192 tokens per sequence, micro-batch 1, global batch 2; bf16, no Transformer Engine.

Variants (``--variants``): ``tilelang-fla`` (our TileLang NoPE sparse MLA and KPool kernels, fla's ``chunk_kda``),
``megatron-fla`` (the ``megatron`` backend: megatron-core's modules, our KPool selection), ``tilelang-torch`` (our
torch KDA recurrence: what runs without fla). No peer trains this model on Megatron; the comparison rows are our own
torch-KDA path and, per token, the GLM-5 slice of ``RESULTS_step.md``.

Numbers per run, parsed from Megatron-LM's log with ``bench_step.py``'s parser: ms per iteration (mean after
``--skip``), tokens/s, peak allocated memory, the loss; then one profiled iteration per variant in
``--profile-variants`` bucketed by what launched each kernel (``bench_step.classify``: KDA mixer, mHC, sparse
attention, indexer, MoE, optimizer, ...). Megatron-LM's own TFLOP/s is not reported: it counts every layer as dense
softmax attention.

    # GPU machine (.gpu/, .mlm/ and, for fla, .whl/ carried; fla installed by scripts/gpu_glm5_next.sh):
    python3 scripts/bench/bench_glm53_step.py --out OUT/glm53_step.md
    python3 scripts/bench/bench_glm53_step.py --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step as bs  # noqa: E402  (the log parser, runner and profile classifier)

REPO = bs.REPO


@dataclass(frozen=True)
class Variant:
    name: str
    backend: str
    kda_kernel: str
    description: str
    env: tuple[tuple[str, str], ...] = ()  # environment of this variant's runs (on top of the bench's)


VARIANTS = {v.name: v for v in (
    Variant("tilelang-fla", "tilelang", "fla", "our TileLang DSA kernels, fla KDA"),
    Variant("megatron-fla", "megatron", "fla", "megatron backend, fla KDA"),
    Variant("tilelang-torch", "tilelang", "torch", "our TileLang DSA kernels, torch KDA reference"),
    Variant("tilelang-fla-torch-mhc", "tilelang", "fla", "as tilelang-fla, mHC stream mixes in torch",
            (("MEGATRON_GLM5_MHC_KERNEL", "torch"),)),
)}
DEFAULT_VARIANTS = "tilelang-fla,megatron-fla,tilelang-torch"
BASELINE = "tilelang-torch"

KDA, DSA = "linear_attention", "indexed_attention"
SLICE = dict(
    vocab_size=4096, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16, num_experts_per_tok=8, n_shared_experts=1,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=256, qk_rope_head_dim=0,
    v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32, index_kpool=4, linear_head_dim=128,
    linear_num_heads=16, linear_conv_kernel_dim=4, hc_mult=4, swiglu_limit=10.0, pad_token_id=0,
    num_nextn_predict_layers=0, max_position_embeddings=65536,
    layer_types=[KDA, KDA, KDA, DSA], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full"] * 4,
)


def write_config(directory: Path, scale_down: bool = False) -> Path:
    from megatron_glm5.glm5_next.testing import small_flash_config

    text = dict(SLICE)
    if scale_down:  # debug: the same structure at a size that builds in seconds
        text.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, index_topk=256,
                    q_lora_rank=128, n_routed_experts=4, num_experts_per_tok=2)
    cfg = {"model_type": "glm5_next", **small_flash_config(**text)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def pretrain_argv(v: Variant, hf_dir: Path, *, seq: int, iters: int, extra=(), profile_step: int | None = None,
                  tb_dir: Path | None = None) -> list[str]:
    if profile_step is not None:
        iters = profile_step + 1
    argv = [
        "--hf-config", str(hf_dir), "--glm5-backend", v.backend, "--kda-kernel", v.kda_kernel,
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
        "--moe-token-dispatcher-type", "allgather",
        "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16",
        "--log-interval", "1", "--log-memory-interval", str(iters), "--eval-iters", "0", "--eval-interval", "1000",
        "--seed", "1234",
    ]
    if profile_step is not None:
        argv += bs.profile_args(profile_step, tb_dir or Path("tb"))
    return argv + list(extra)


def torchrun_cmd(python: str, port: int, argv: list[str]) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
            "-m", "megatron_glm5.pretrain", *argv]


@dataclass
class Result:
    variant: Variant
    main: bs.RunResult | None = None
    profile: bs.RunResult | None = None
    breakdown: bs.Breakdown | None = None
    trace_path: str = ""

    def stats(self, skip: int, tokens: int) -> dict[str, float]:
        its = self.main.log.steady(skip) if self.main else []
        ms = [float(it[bs.MS_KEY]) for it in its if isinstance(it.get(bs.MS_KEY), float)]
        m, sd = bs.mean_std(ms)
        peak = self.main.log.peak_allocated_mb if self.main else None
        return {"iters": len(ms), "ms_mean": m, "ms_std": sd,
                "tokens_per_s": tokens / (m / 1000.0) if ms else math.nan,
                "peak_gib": peak / 1024.0 if peak is not None else math.nan}


def run(kind: str, r: Result, argv: list[str], args, env, log_dir: Path, expected: int) -> bs.RunResult:
    suffix = "" if kind == "main" else f"_{kind}"
    log_path = log_dir / f"glm53_step_{r.variant.name}{suffix}.log"
    cmd = torchrun_cmd(args.python, bs.free_port(), argv)
    print(f"[glm53_step] {r.variant.name}: {kind} run -> {log_path}", flush=True)
    rc, secs = bs.run_logged(cmd, {**env, **dict(r.variant.env)}, log_path, args.timeout)
    log = bs.parse_log(log_path.read_text(errors="replace"))
    res = bs.RunResult(kind, cmd, str(log_path), rc, secs, log,
                       bs.check_run(kind, r.variant.name, rc, log, expected, log_path))
    print(f"[glm53_step] {r.variant.name}: {kind} rc={rc} in {secs:.0f} s" + (f"; {res.error}" if res.error else ""),
          flush=True)
    return res


def render(results: list[Result], args, meta: dict) -> str:
    tokens = args.seq * 2
    stats = {r.variant.name: r.stats(args.skip, tokens) for r in results}
    base = stats.get(BASELINE, {}).get("ms_mean", math.nan)
    lines = [
        f"## GLM-5.3-Flash one-GPU slice ({meta['date']}, commit {meta['commit']}, {meta['gpu']})", "",
        f"`{bs._md(meta['command'])}`; {meta['versions']}.", "",
        "Slice: 4 layers (KDA + dense, KDA + MoE, KDA + MoE, NoPE DSA + MoE), hidden 4096, 16 KDA heads x 128, 16 "
        "attention heads (q/k/v 256, q_lora 1536, kv_lora 512), KPool indexer 32 x 128 pools of 4 top-k 2048, mHC 4 "
        f"streams, 16 experts top-8 (2048 wide, 1 shared), dense FFN 12288, vocab 4096, no MTP; {args.seq} tokens x "
        f"global batch 2, micro-batch 1, bf16; means over iterations {args.skip + 1}-{args.iters}.", "",
        f"| variant | ms / iteration | tokens/s | peak allocated GiB | speed vs {BASELINE} |", "|---|---|---|---|---|",
    ]
    for r in results:
        s = stats[r.variant.name]
        label = f"`{r.variant.name}`: {r.variant.description}"
        if r.main is None or not r.main.ok:
            lines.append(f"| {label} | FAILED: {bs._md(r.main.error if r.main else 'not run')} | | | |")
            continue
        ratio = f"{base / s['ms_mean']:.2f}x" if not math.isnan(base) else "-"
        lines.append(f"| {label} | {s['ms_mean']:.1f} ± {s['ms_std']:.1f} | {s['tokens_per_s']:.0f} | "
                     f"{bs._f(s['peak_gib'], '.2f')} | {ratio} |")
    lines += bs.loss_table(results)
    for r in results:
        b = r.breakdown
        if b is None:
            if r.profile is not None and not r.profile.ok:
                lines += ["", f"Profile of `{r.variant.name}` FAILED: {bs._md(r.profile.error)}"]
            continue
        lines += ["", f"GPU time per step by bucket, `{r.variant.name}` (profiled iteration {args.profile_step}):", "",
                  "| bucket | ms | share of GPU busy |", "|---|---|---|"]
        for name, ms in b.buckets_ms.items():
            if ms:
                lines.append(f"| {name} | {ms:.1f} | {100 * ms / max(b.busy_ms, 1e-9):.0f} % |")
        lines.append(f"| **GPU busy** (sum of kernels) | {b.busy_ms:.1f} ({b.kernel_sum_ms:.1f}) | |")
        lines.append(f"| host gaps vs the unprofiled mean | "
                     f"{bs._f(stats[r.variant.name]['ms_mean'] - b.busy_ms)} | |")
        lines += ["", f"Top kernels, `{r.variant.name}`:", "", "| kernel | bucket | calls | ms |", "|---|---|---|---|"]
        for name, bucket, calls, ms in b.top:
            lines.append(f"| `{bs._md(name if len(name) <= 100 else name[:97] + '...')}` | {bucket} | {calls} | "
                         f"{ms:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"from {list(VARIANTS)}")
    p.add_argument("--profile-variants", default="tilelang-fla", help="variants that get a profiled run ('' none)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--profile-step", type=int, default=4)
    p.add_argument("--extra-args", default="", help="appended to every run's flags (one shell-quoted string)")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--mlm", default=str(REPO / ".mlm"), help="Megatron-LM (megatron.training) folder")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--scale-down", action="store_true", help="debug: hidden 256, small experts, top-k 256")
    p.add_argument("--out", default="glm53_step.md")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if not names or any(n not in VARIANTS for n in names):
        p.error(f"--variants: choose from {list(VARIANTS)}")
    profiled = [v for v in args.profile_variants.split(",") if v]
    out = Path(args.out).resolve()
    log_dir = out.parent
    hf_dir = write_config(Path(tempfile.mkdtemp(prefix="glm53_slice_")), args.scale_down)
    extra = shlex.split(args.extra_args)
    results = [Result(VARIANTS[n]) for n in names]
    if args.dry_run:
        for r in results:
            print(shlex.join(torchrun_cmd(args.python, 29500, pretrain_argv(r.variant, hf_dir, seq=args.seq,
                                                                             iters=args.iters, extra=extra))))
        print(f"# config: {hf_dir / 'config.json'}")
        return 0
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, bs._on_signal)
    shim = bs.make_shim()
    env = bs.run_env(Path(args.mlm).resolve(), shim)
    probe = bs.environment(args.python, env)
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": bs.git_commit(),
            "gpu": probe.get("gpu", "?"), "versions": ", ".join(f"{k} {v}" for k, v in probe.items() if k != "gpu"),
            "command": "python3 scripts/bench/bench_glm53_step.py " + shlex.join(argv if argv is not None
                                                                                 else sys.argv[1:])}
    failures = []
    try:
        for r in results:
            r.main = run("main", r, pretrain_argv(r.variant, hf_dir, seq=args.seq, iters=args.iters, extra=extra),
                         args, env, log_dir, args.iters)
            out.write_text(render(results, args, meta))
        for r in results:
            if r.variant.name not in profiled or r.main is None or not r.main.ok:
                continue
            prof_dir = log_dir / f"glm53_step_{r.variant.name}_prof"
            shutil.rmtree(prof_dir, ignore_errors=True)
            argv_p = pretrain_argv(r.variant, hf_dir, seq=args.seq, iters=args.iters, extra=extra,
                                   profile_step=args.profile_step, tb_dir=prof_dir / "tb")
            r.profile = run("profile", r, argv_p, args, env, log_dir, args.profile_step + 1)
            trace = prof_dir / "torch_profile" / "rank-0.json.gz"
            if trace.exists():
                dest = log_dir / f"glm53_step_{r.variant.name}_trace.json.gz"
                shutil.move(str(trace), dest)
                r.trace_path = str(dest)
                r.breakdown = bs.trace_breakdown(bs.load_trace(dest))
            shutil.rmtree(prof_dir, ignore_errors=True)
            out.write_text(render(results, args, meta))
        for r in results:
            for res in (r.main, r.profile):
                if res is not None and not res.ok:
                    failures.append(res.error)
                    shown = res.log.traceback or Path(res.log_path).read_text(errors="replace").splitlines()[-25:]
                    print(f"--- {r.variant.name}, {res.kind}:\n" + "\n".join(shown), file=sys.stderr)
        print(out.read_text())
    finally:
        shutil.rmtree(shim, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
