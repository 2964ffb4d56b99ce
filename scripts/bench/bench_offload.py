"""Benchmark: how long a sequence one GPU trains with and without activation offload (:mod:`megatron_glm5.offload`),
and what offload costs in step time. CUDA only.

The model is a GLM-5-shaped slice built through the project's Python API (``build_model`` with a ``RuntimePolicy``):
hidden 6144, 16 heads (GLM-5's 64 at TP=4), q_lora 2048, kv_lora 512 + rope 64, v 256, 4 MoE layers with 16 experts
top-8 of width 2048 plus a shared expert, indexer 32 heads x 128 with top-k 2048, IndexShare
``[full, shared, full, shared]``, bf16, vocabulary 1024 (the real 154880 would put tens of GB of logits in every
step and measure the loss, not the layers). For each setting the sequence doubles from ``--start`` (8K) until one
fwd+bwd step runs out of GPU memory (``torch.cuda.OutOfMemoryError``, memory released before the next setting), runs
out of the host budget for the offloaded copies, or reaches ``--max-seq`` (with ``--bisect-step``, a binary search
between the last fit and the first failure follows; the model is built again after each failed attempt, whose
leftovers made shorter attempts fail early); the step time at ``--time-seqs`` (16K, 32K) is the median of ``--reps``
timed steps after a warm-up, taken before the search. One model is alive at a time. Appends a
markdown table (date, commit, GPU) to ``--out``.

    python scripts/bench/bench_offload.py [--recompute none|full] [--mlp-chunks N] [--bisect-step 16384] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from report import emit

GB = 1e9


def glm5_slice_config() -> dict:
    from megatron_glm5.testing import tiny_glm52_config

    return tiny_glm52_config(
        vocab_size=1024, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=4, first_k_dense_replace=0, n_routed_experts=16, num_experts_per_tok=8, n_shared_experts=1,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256, v_head_dim=256, head_dim=192,
        index_n_heads=32, index_head_dim=128, index_topk=2048,
        indexer_types=["full", "shared", "full", "shared"], num_nextn_predict_layers=0, dtype="bfloat16",
        max_position_embeddings=1 << 21,
    )


def build(offload: bool, recompute: str, backend: str, mlp_chunks: int = 1):
    from megatron_glm5.config import RuntimePolicy, parse_hf_config
    from megatron_glm5.model import build_model

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if recompute == "full" else {}
    policy = RuntimePolicy(params_dtype=torch.bfloat16, activation_offload=offload, mlp_chunks_for_training=mlp_chunks,
                           **extra)
    torch.manual_seed(0)
    model = build_model(parse_hf_config(glm5_slice_config()), policy, backend=backend)
    return model.cuda().train()


def release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def step(model, seq: int) -> None:
    device = next(model.parameters()).device
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)  # same routing
    pos = torch.arange(seq, device=device)[None]
    model.zero_grad(set_to_none=False)  # gradients stay allocated across steps (as in training)
    model(ids, pos, None, labels=ids).float().mean().backward()


def try_step(model, seq: int, repeat: int = 1) -> dict:
    """``repeat`` fwd+bwd steps in a row at ``seq`` tokens (no collection between them, as in training): peak GPU GB
    over them, host GB offloaded, or the reason one failed."""
    from megatron_glm5 import offload

    release()
    torch.cuda.reset_peak_memory_stats()
    error = None
    with offload.recording() as log:
        try:
            for _ in range(repeat):
                step(model, seq)
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            error = "GPU OOM"
        except RuntimeError as e:  # pinned host memory exhausted surfaces as a CUDA "out of memory" RuntimeError
            if "out of memory" not in str(e):
                raise
            error = f"OOM ({str(e).splitlines()[0][:60]})"
    # the exception (and the frames holding the failed step's graph) is gone here: give its memory back
    release()
    return dict(ok=error is None, error=error, peak_gb=torch.cuda.max_memory_allocated() / GB,
                host_gb=log.bytes_offloaded / GB)


def longest(model, args, host_budget_gb: float, attempt=None) -> tuple[int, list[tuple[int, dict]]]:
    """The longest sequence one step fits: doubling from ``--start``, then (``--bisect-step`` > 0) a binary search
    between the last length that fit and the first that did not, in multiples of ``--bisect-step``. ``attempt``
    (default :func:`try_step` on ``model``) returns ``try_step``'s dict."""
    attempt = attempt or (lambda seq: try_step(model, seq))
    rows, seq, best, failed = [], args.start, 0, None
    while seq <= args.max_seq:
        if rows and rows[-1][1]["host_gb"] * 2 > host_budget_gb:  # the next size would not fit on the host
            rows.append((seq, dict(ok=False, error=f"host budget {host_budget_gb:.0f} GB", peak_gb=float("nan"),
                                   host_gb=float("nan"))))
            break
        result = attempt(seq)
        rows.append((seq, result))
        print(f"  seq {seq}: {result}", flush=True)
        if not result["ok"]:
            failed = seq
            break
        best = seq
        seq *= 2
    step = getattr(args, "bisect_step", 0)
    if step and failed is not None and best:
        lo, hi = best // step, failed // step  # lo * step fits, hi * step does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            result = attempt(mid * step)
            rows.append((mid * step, result))
            print(f"  seq {mid * step}: {result}", flush=True)
            lo, hi = (mid, hi) if result["ok"] else (lo, mid)
        best = lo * step
    return best, sorted(rows, key=lambda r: r[0])


def time_step(model, seq: int, reps: int) -> float | None:
    """Median ms of ``reps`` fwd+bwd steps after one warm-up; None if the step does not fit."""
    if not try_step(model, seq)["ok"]:
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, seq)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    release()
    return statistics.median(times)


def _host_budget_gb(requested: float | None) -> float:
    if requested is not None:
        return requested
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return 0.7 * total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recompute", choices=["none", "full"], default="none")
    p.add_argument("--backend", choices=["megatron", "tilelang"], default="tilelang")
    p.add_argument("--start", type=int, default=8192)
    p.add_argument("--max-seq", type=int, default=1 << 20)
    p.add_argument("--time-seqs", type=int, nargs="*", default=[16384, 32768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bisect-step", type=int, default=0,
                   help="after the doubling search, bisect between the last fit and the first failure in multiples "
                        "of this many tokens (0: powers of two only)")
    p.add_argument("--repeat", type=int, default=1,
                   help="steps in a row per attempt of the search (2: the steady state of training, where a step "
                        "starts with what the one before left)")
    p.add_argument("--mlp-chunks", type=int, default=1,
                   help="RuntimePolicy.mlp_chunks_for_training: under full recompute the MLP is recomputed in this "
                        "many sequence chunks (megatron_glm5.core.mlp_chunks)")
    p.add_argument("--host-budget-gb", type=float, default=None,
                   help="stop the offload search before the host copies would exceed this (default 70%% of RAM)")
    p.add_argument("--settings", choices=["both", "no-offload", "offload"], default="both",
                   help="run one setting only (e.g. to split the benchmark across two time-limited runs)")
    p.add_argument("--out", default=None)
    p.add_argument("--results-json", default=None, help=argparse.SUPPRESS)  # one setting's results, for "both"
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_offload.py needs a CUDA device")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_glm5 import fusions
    from megatron_glm5.parallel import destroy_model_parallel, initialize_model_parallel

    budget = _host_budget_gb(args.host_budget_gb)
    results = {}
    if args.settings == "both":
        # each setting in its own process: a model deleted in-process did not give all of its memory back (the
        # second setting's peaks read 26 GB high on the H200)
        for setting, label in (("no-offload", "no offload"), ("offload", "offload")):
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                argv = [a for a in sys.argv[1:] if not a.startswith(("--out=", "--settings="))]
                for flag in ("--out", "--settings"):
                    while flag in argv:
                        i = argv.index(flag)
                        del argv[i:i + 2]
                subprocess.run([sys.executable, __file__, *argv, "--settings", setting, "--results-json", tmp.name],
                               check=True)
                got = json.load(open(tmp.name))
            results[label] = dict(best=got["best"], rows=[(seq, r) for seq, r in got["rows"]],
                                  times={int(k): v for k, v in got["times"].items()})
    else:
        initialize_model_parallel()
    chosen = {"both": (), "no-offload": (False,), "offload": (True,)}[args.settings]
    for offload_on in chosen:
        label = "offload" if offload_on else "no offload"
        print(f"[{label}] building the model", flush=True)
        model = build(offload_on, args.recompute, args.backend, args.mlp_chunks)
        # timed steps first: after the search's out-of-memory step the allocator is fragmented (a 16K step that ran
        # before OOMed after it on the H200)
        times = {seq: time_step(model, seq, args.reps) for seq in args.time_seqs}
        holder = [model]
        del model

        def attempt(seq: int, offload_on=offload_on) -> dict:
            """``try_step``; after a failure the model is built again: a step that ran out of memory half-way
            leaves state behind (the recompute's graph held by module state, the stashed top-k) that made the
            next, shorter attempts fail 10-15 GB early on the H200."""
            result = try_step(holder[0], seq, args.repeat)
            if not result["ok"]:
                holder[0] = None
                release()
                holder[0] = build(offload_on, args.recompute, args.backend, args.mlp_chunks)
            return result

        best, rows = longest(None, args, budget if offload_on else float("inf"), attempt)  # no second reference
        model = holder.pop()
        results[label] = dict(best=best, rows=rows, times=times)
        del model
        release()
    if chosen:
        destroy_model_parallel()
    if args.results_json:
        (label,) = results
        with open(args.results_json, "w") as f:
            json.dump(results[label], f)
        return

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"## Activation offload: longest trainable sequence and step time ({datetime.date.today()}, commit "
        f"{commit or 'n/a'}, {torch.cuda.get_device_name(0)}, "
        f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)",
        "",
        f"GLM-5-shaped slice (hidden 6144, 16 heads, 4 MoE layers of 16 experts top-8 width 2048 + shared, indexer "
        f"32x128 top-k 2048, IndexShare [F,S,F,S], vocab 1024), bf16, `{args.backend}` backend, recompute "
        f"{args.recompute}, MLP chunks {args.mlp_chunks} "
        f"(by length: {fusions.enabled(fusions.MLP_CHUNKS_BY_LENGTH_ENV)}), "
        f"batch 1, one fwd+bwd per size; PYTORCH_CUDA_ALLOC_CONF="
        f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'unset')}; host budget for offload {budget:.0f} GB.",
        "",
        "| tokens | no offload: peak GB | offload: peak GB | offload: host GB |",
        "|---|---|---|---|",
    ]
    empty = dict(best=None, rows=[], times={seq: None for seq in args.time_seqs})
    for label in ("no offload", "offload"):
        results.setdefault(label, empty)  # a setting not run (--settings): its cells show "-"
    by_seq: dict[int, dict] = {}
    for label in ("no offload", "offload"):
        for seq, r in results[label]["rows"]:
            by_seq.setdefault(seq, {})[label] = r

    def cell(r, key):
        if r is None:
            return "-"
        return f"{r[key]:.1f}" if r["ok"] else r["error"]

    for seq in sorted(by_seq):
        a, b = by_seq[seq].get("no offload"), by_seq[seq].get("offload")
        lines.append(f"| {seq} | {cell(a, 'peak_gb')} | {cell(b, 'peak_gb')} | "
                     f"{cell(b, 'host_gb') if b is not None else '-'} |")
    def best(label):
        return "not run" if results[label]["best"] is None else f"**{results[label]['best']}** tokens"

    def ms(label, seq):
        if results[label]["best"] is None:
            return "-"
        t = results[label]["times"][seq]
        return f"{t:.0f}" if t else "OOM"

    lines += ["", f"Longest sequence: {best('no offload')} without offload, {best('offload')} with offload.", "",
              "| tokens | step ms, no offload | step ms, offload | offload cost |", "|---|---|---|---|"]
    for seq in args.time_seqs:
        a, b = results["no offload"]["times"][seq], results["offload"]["times"][seq]
        cost = f"{(b / a - 1) * 100:+.0f}%" if a and b else "-"
        lines.append(f"| {seq} | {ms('no offload', seq)} | {ms('offload', seq)} | {cost} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
