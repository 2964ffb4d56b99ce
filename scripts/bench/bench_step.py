"""Benchmark: whole training steps of a GLM-5-shaped one-GPU slice through Megatron-LM's own training loop.

Each variant runs as a subprocess of the real ``pretrain_gpt.py`` (the client in ``shared/clients/megatron_lm``, copied
to ``.mlm/`` in the repo root as ``run_pretrain_gpt.sh`` expects), on one GPU, with mock data:

    tilelang        --spec megatron_glm5.spec get_glm5_tilelang_spec                   (our TileLang kernels)
    mcore-kernels   --spec megatron_glm5.spec get_glm5_spec --dsa-kernel-backend tilelang
                    (megatron backend with megatron-core's TileLang DSA kernels; run_pretrain_gpt.sh's
                    "get_glm5_spec+mcore-kernels")
    megatron-torch  --spec megatron_glm5.spec get_glm5_spec  (megatron backend, no DSA kernels: the chunked torch paths)

The slice (issue #13): 4 layers, the first dense and three MoE; hidden 6144; 16 heads (GLM-5's 64 at TP=4); q_lora
2048, kv_lora 512, qk nope 192 / rope 64, v 256; indexer 32 heads x 128, top-k 2048; IndexShare freq 4 / offset 3
(layers 1-3 own an indexer, layer 4 shares); 16 experts, top-8, expert and shared-expert width 2048; dense FFN 12288
(GLM-5's); vocab 4096 (NullTokenizer); 8192 tokens per sequence, micro-batch 1, global batch 2; bf16; no Transformer
Engine (``--transformer-impl local``; Megatron-LM's default gradient-accumulation fusion, served without apex by
megatron-glm5's own since issue 23's round 3; the client's glm5_flags.sh turns it off, its other runtime flags are used
too). ``--extra-args`` is appended to every run (e.g. ``--moe-grouped-gemm`` to A/B it); shape
flags given there are read back, so the FLOP count follows them.

Per variant: one run of ``--iters`` iterations with ``--log-throughput --log-interval 1 --log-memory-interval N``;
parsed from Megatron-LM's log: ms per iteration and its TFLOP/s ("elapsed time per iteration (ms)", "throughput per
GPU (TFLOP/s/GPU)"), the loss ("lm loss"), and peak memory (the "max allocated" of its last "[Rank 0] (after N
iterations) memory (MB)" line: torch.cuda.max_memory_allocated). Averages leave out the first ``--skip`` iterations
(TileLang JIT, allocator warm-up; Megatron-LM also reports iteration 2 as the mean of iterations 1 and 2, loss and
time alike, because it does not reset its counters after the first one). Then one short profiled run per variant
(``--profile --use-pytorch-profiler --profile-step-start P --profile-step-end P+1
--pytorch-profiler-collect-callstack --tensorboard-dir D``: megatron.training.training.train records step P with
torch.profiler and writes ``D/../torch_profile/rank-0.json.gz``, moved here to ``bench_step_<variant>_trace.json.gz``).
Its GPU kernels are bucketed by what launched them (:func:`classify`): every kernel is tied to its launch (CUDA
runtime / driver event, same ``correlation``), the launch to the CPU ops and Python frames around it (the call stack
needs ``--pytorch-profiler-collect-callstack``), and a backward kernel to the forward op that made its autograd node
(``Sequence number``). Host gaps are the step's wall time minus the time the GPU was busy (union of kernel, memcpy
and memset intervals), both in the profiled step (the profiler's Python tracing slows the host) and against the
unprofiled run's mean.

FLOP count, "our count" (``flop_count``), per iteration (global batch of B sequences of S tokens, T = B S tokens,
L layers, n heads; FLOPs = 2 x multiply-adds; training = 3 x forward, backward = 2 x forward, except the indexer):

    attention projections  3 * 2 * L * T * [H q_lora + q_lora n (d_nope + d_rope) + H (kv_lora + d_rope)
                                            + n d_nope kv_lora + n kv_lora d_v + n d_v H]
                           (the absorbed form: q_nope -> latent and latent -> v replace kv_up, same count)
    sparse attention       3 * 2 * L * B * pairs(S, K) * n * [(kv_lora + d_rope) + kv_lora]
                           pairs(S, K) = sum_{i<S} min(i + 1, K): query i attends to min(i + 1, top-k) keys, not to
                           the dense causal S(S+1)/2; latent dims 576 (QK) and 512 (PV), as both kernels compute
    indexer (full layers)  1 * 2 * L_full * [T (q_lora N_i D_i + H D_i + H N_i) + B * S(S+1)/2 * N_i D_i]
                           forward only (its inputs are detached and there is no indexer loss: no backward);
                           logits dense causal
    dense MLP              3 * 2 * L_dense * T * 3 H F
    MoE                    3 * 2 * L_moe * T * [H E + k 3 H F_e + 3 H F_s]     (router, k routed, shared expert)
    logits                 3 * 2 * T * H V

Megatron-LM's own count (its TFLOP/s) uses dense causal attention over nope+rope / v dims, no indexer, no router.

    # on the GPU machine, from the repo root (.gpu/ and .mlm/ carried):
    source .gpu/install.sh && python3 scripts/bench/bench_step.py --out OUT/step.md
    python3 scripts/bench/bench_step.py --variants tilelang,mcore-kernels,megatron-torch --extra-args=--moe-grouped-gemm
    python3 scripts/bench/bench_step.py --dry-run                     # print the commands and the FLOP count
    python3 scripts/bench/bench_step.py --cpu-check --scale-down      # CPU: parse, build, one fwd/bwd per variant
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------------------------------------------
# Variants and flags
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    spec: str  # function of megatron_glm5.spec
    args: tuple[str, ...]
    description: str
    env: tuple[tuple[str, str], ...] = ()  # environment of this variant's runs (on top of the bench's)


# Round 3's fusions (on by default since): off, with Megatron-LM's gradient-accumulation fusion off, is round 2's step.
_ROUND3_OFF = (("MEGATRON_GLM5_FUSED_MOE_PERMUTE", "0"), ("MEGATRON_GLM5_FUSED_ROPE", "0"),
               ("MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION", "0"), ("MEGATRON_GLM5_FUSED_ADAM", "0"))
_NO_GAF = ("--no-gradient-accumulation-fusion",)

VARIANTS = {
    v.name: v
    for v in (
        Variant("tilelang", "get_glm5_tilelang_spec", (), "(a) our TileLang kernels"),
        Variant("mcore-kernels", "get_glm5_spec", ("--dsa-kernel-backend", "tilelang"),
                "(b) megatron backend + megatron-core's TileLang DSA kernels"),
        Variant("megatron-torch", "get_glm5_spec", (), "(c) megatron backend, no DSA kernels (torch paths)"),
        Variant("tilelang-grouped-round2", "get_glm5_tilelang_spec", ("--moe-grouped-gemm", *_NO_GAF),
                "(a) with grouped-GEMM experts, round 2's fusions only (no MoE permutation, RoPE, weight-gradient "
                "accumulation or fused Adam)", _ROUND3_OFF),
        Variant("mcore-kernels-grouped-round2", "get_glm5_spec",
                ("--dsa-kernel-backend", "tilelang", "--moe-grouped-gemm", *_NO_GAF),
                "(b) with grouped-GEMM experts, round 2's fusions only", _ROUND3_OFF),
        Variant("tilelang-unfused", "get_glm5_tilelang_spec", (),
                "(a) with torch's RMSNorm and megatron-core's eager SwiGLU (the fusions off)",
                (("MEGATRON_GLM5_FUSED_RMSNORM", "0"), ("MEGATRON_GLM5_FUSED_SWIGLU", "0"))),
        Variant("tilelang-grouped", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts (`TorchGroupedMLP`)"),
        Variant("mcore-kernels-grouped", "get_glm5_spec", ("--dsa-kernel-backend", "tilelang", "--moe-grouped-gemm"),
                "(b) with grouped-GEMM experts (`TorchGroupedMLP`)"),
        Variant("tilelang-grouped-per-query-mla", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, the sparse MLA per query only (the grouped sparse MLA, 4 "
                "neighbouring queries per CTA over the union of their index sets, is the default since round 2's "
                "third kernel session)", (("MEGATRON_GLM5_GROUPED_SPARSE_MLA", "0"),)),
        Variant("tilelang-grouped-masked-zero", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, empty experts' weight gradients zeroed by a masked pass over every "
                "expert's (round 3; the Triton kernel is the default since round 4)",
                (("MEGATRON_GLM5_ZERO_GROUPS_KERNEL", "0"),)),
        Variant("tilelang-grouped-local-scale", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, megatron-core's no-apex multi-tensor scale (a product and a copy per "
                "tensor for the main -> model parameter copies; the foreach route is the default since round 7)",
                (("MEGATRON_GLM5_FUSED_MULTI_TENSOR_SCALE", "0"),)),
        Variant("tilelang-grouped-mask-torch", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, the dense mask's key ranges by the torch passes (the one-pass "
                "Triton kernel is the default since round 8)", (("MEGATRON_GLM5_MASK_RANGES_KERNEL", "0"),)),
        Variant("tilelang-grouped-host-clip", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts and megatron-core's host clip (its norm read on the host; the device "
                "clip is the default since round 15; `MEGATRON_GLM5_DEVICE_GRAD_CLIP=0`)",
                (("MEGATRON_GLM5_DEVICE_GRAD_CLIP", "0"),)),
        Variant("tilelang-grouped-host-checks", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, megatron-core's loss and gradient checks at once and its host clip "
                "(the deferred checks and the device clip are the default since round 15; "
                "`MEGATRON_GLM5_DEFERRED_GRAD_CHECKS=0`, `MEGATRON_GLM5_DEVICE_GRAD_CLIP=0`)",
                (("MEGATRON_GLM5_DEFERRED_GRAD_CHECKS", "0"), ("MEGATRON_GLM5_DEVICE_GRAD_CLIP", "0"))),
        Variant("tilelang-grouped-torch-adam", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, torch's fused AdamW and megatron-core's per-tensor main -> model "
                "copies (the AdamW kernel writing the copies is the default since round 15; "
                "`MEGATRON_GLM5_ADAM_MODEL_COPY=0`)", (("MEGATRON_GLM5_ADAM_MODEL_COPY", "0"),)),
        Variant("tilelang-grouped-round14-optimizer", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts and round 14's optimizer phase: checks at once, host clip, torch's "
                "AdamW and the per-tensor copies (`MEGATRON_GLM5_DEFERRED_GRAD_CHECKS=0`, "
                "`MEGATRON_GLM5_DEVICE_GRAD_CLIP=0`, `MEGATRON_GLM5_ADAM_MODEL_COPY=0`)",
                (("MEGATRON_GLM5_DEFERRED_GRAD_CHECKS", "0"), ("MEGATRON_GLM5_DEVICE_GRAD_CLIP", "0"),
                 ("MEGATRON_GLM5_ADAM_MODEL_COPY", "0"))),
        Variant("tilelang-grouped-pp-named", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, the `pp` sparse-MLA forward with named barriers for the math "
                "warpgroups' exchanges (experimental; `MEGATRON_GLM5_PP_OPTIONS=named_exchange`)",
                (("MEGATRON_GLM5_PP_OPTIONS", "named_exchange"),)),
        Variant("tilelang-grouped-pp-persistent", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, the `pp` sparse-MLA forward as a persistent grid of one CTA per SM "
                "(experimental; `MEGATRON_GLM5_PP_OPTIONS=persistent`)", (("MEGATRON_GLM5_PP_OPTIONS", "persistent"),)),
        Variant("tilelang-grouped-indexer-fused", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, the indexer's overlapped logits kernel counting the select's first "
                "radix round (experimental; `MEGATRON_GLM5_LOGITS_OVERLAP=3`, `MEGATRON_GLM5_INDEXER_FUSED_HIST=1`)",
                (("MEGATRON_GLM5_LOGITS_OVERLAP", "3"), ("MEGATRON_GLM5_INDEXER_FUSED_HIST", "1"))),
        Variant("tilelang-grouped-grouped-wgrad", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts whose weight gradients are one grouped GEMM (bf16) added into "
                "`main_grad` in one launch (round 8's default; one GEMM per expert adding into `main_grad` is the "
                "default since round 9)", (("MEGATRON_GLM5_EXPERT_WGRAD_GEMMS", "0"),)),
        Variant("tilelang-grouped-module-walks", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, megatron-core's per-step walks over every module for the routers "
                "(the cached router list is the default since round 8)", (("MEGATRON_GLM5_CACHED_ROUTER_WALKS", "0"),)),
        Variant("tilelang-grouped-atomic-dkv", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, the sparse-MLA backward's dKV by fp32 atomics (round 9's default; dKV "
                "by key blocks, a dQ pass then one CTA per 64 keys over the queries that select them, is the default "
                "since round 10)", (("MEGATRON_GLM5_KEY_BLOCK_DKV", "0"),)),
        Variant("tilelang-grouped-gc-freeze", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts, Python's collector frozen after iteration 2 (`gc.freeze()`: what "
                "exists then is never walked again; needs `--host-timers`, whose sitecustomize does it)",
                (("GLM5_GC_FREEZE_AT", "3"),)),
        Variant("tilelang-grouped-per-expert-wgrad", "get_glm5_tilelang_spec", ("--moe-grouped-gemm",),
                "(a) with grouped-GEMM experts whose weight gradients go to DDP's hook one per expert (16 adds per "
                "grouped GEMM after a zeroing pass; the one-launch accumulation is the default since round 6)",
                (("MEGATRON_GLM5_GROUPED_WGRAD_ACCUMULATION", "0"),)),
    )
}
DEFAULT_VARIANTS = "tilelang,mcore-kernels,tilelang-grouped"
BASELINES = ("mcore-kernels", "mcore-kernels-grouped")  # the ratio column: speed relative to the first one run


def baseline(stats: dict) -> str:
    """The variant the speed column divides by: the first of :data:`BASELINES` that ran."""
    return next((b for b in BASELINES if b in stats), BASELINES[0])

# The slice, as Megatron-LM flags. GLM numerics flags as in the client's glm5_flags.sh.
SLICE = {
    "num_layers": 4, "hidden": 6144, "ffn": 12288, "heads": 16, "q_lora": 2048, "kv_lora": 512, "qk_nope": 192,
    "qk_rope": 64, "v_head": 256, "index_heads": 32, "index_dim": 128, "topk": 2048, "experts": 16, "router_topk": 8,
    "moe_ffn": 2048, "shared_ffn": 2048, "vocab": 4096,
}
# --scale-down: the same structure at a size a 2-core / 24 GiB CPU builds and steps in seconds (debug only).
SCALED_DOWN = dict(SLICE, hidden=1024, ffn=2048, q_lora=256, topk=256, moe_ffn=256, shared_ffn=256)


def model_args(d: dict[str, int], seq: int) -> list[str]:
    """Architecture flags of the slice (first layer dense, the rest MoE)."""
    n = d["num_layers"]
    return [
        "--num-layers", str(n), "--hidden-size", str(d["hidden"]), "--ffn-hidden-size", str(d["ffn"]),
        "--num-attention-heads", str(d["heads"]),
        "--multi-latent-attention", "--q-lora-rank", str(d["q_lora"]), "--kv-lora-rank", str(d["kv_lora"]),
        "--qk-head-dim", str(d["qk_nope"]), "--qk-pos-emb-head-dim", str(d["qk_rope"]),
        "--v-head-dim", str(d["v_head"]),
        "--qk-layernorm", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--rope-type", "rope",
        "--rotary-base", "8000000", "--no-rope-fusion", "--max-position-embeddings", str(seq),
        "--make-vocab-size-divisible-by", "128",
        "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", str(d["index_heads"]),
        "--dsa-indexer-head-dim", str(d["index_dim"]), "--dsa-indexer-topk", str(d["topk"]),
        "--dsa-indexer-topk-freq", "4", "--dsa-indexer-skip-topk-offset", "3", "--dsa-indexer-rope-interleaved",
        "--no-dsa-indexer-rotate-activation", "--dsa-indexer-k-norm-epsilon", "1e-6", "--dsa-indexer-k-norm-fp32",
        "--num-experts", str(d["experts"]), "--moe-router-topk", str(d["router_topk"]),
        "--moe-ffn-hidden-size", str(d["moe_ffn"]), "--moe-shared-expert-intermediate-size", str(d["shared_ffn"]),
        "--moe-layer-freq", f"([0]*1+[1]*{n - 1})", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
        "--moe-router-pre-softmax", "--moe-token-dispatcher-type", "allgather",
        "--hidden-dropout", "0", "--attention-dropout", "0",
    ]


def runtime_args(d: dict[str, int], *, seq: int, iters: int) -> list[str]:
    """One GPU, no TE / apex, mock data, bf16, per-iteration logging of time, TFLOP/s, loss and memory."""
    return [
        "--transformer-impl", "local",  # gradient-accumulation fusion: Megatron-LM's default, without apex ours
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(d["vocab"]),
        "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16",
        "--log-interval", "1", "--log-throughput", "--log-memory-interval", str(iters),
        "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
    ]


def profile_args(step: int, tb_dir: Path) -> list[str]:
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(step), "--profile-step-end",
            str(step + 1), "--pytorch-profiler-collect-callstack", "--tensorboard-dir", str(tb_dir)]


def pretrain_argv(variant: Variant, *, seq: int, iters: int, scale_down: bool = False, extra: Iterable[str] = (),
                  profile_step: int | None = None, tb_dir: Path | None = None) -> list[str]:
    """pretrain_gpt.py's flags for one run. A profiled run stops right after its profiled step (the profiler writes
    its trace when the step after it starts)."""
    d = SCALED_DOWN if scale_down else SLICE
    if profile_step is not None:
        iters = profile_step + 1
    argv = ["--spec", "megatron_glm5.spec", variant.spec, *model_args(d, seq),
            *runtime_args(d, seq=seq, iters=iters), *variant.args]
    if profile_step is not None:
        argv += profile_args(profile_step, tb_dir or Path("tb"))
    return argv + list(extra)


def torchrun_cmd(python: str, mlm: Path, port: int, argv: list[str]) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
            str(mlm / "pretrain_gpt.py"), *argv]


# ----------------------------------------------------------------------------------------------------------------
# Shapes and the FLOP count
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    index_heads: int
    index_dim: int
    topk: int
    topk_freq: int
    skip_offset: int
    experts: int
    router_topk: int
    moe_ffn: int
    shared_ffn: int
    moe_pattern: tuple[int, ...]  # 1 = MoE layer
    vocab: int  # padded, as Megatron-LM pads it
    seq: int
    global_batch: int

    @property
    def full_layers(self) -> list[int]:
        """1-based layers that own an indexer (megatron-core's rule, dsa.py's is_dsa_skip_topk_layer)."""
        off = max(self.skip_offset, 1)
        return [n for n in range(1, self.num_layers + 1) if max(n - off, 0) % max(self.topk_freq, 1) == 0]

    def summary(self) -> str:
        n_moe = sum(self.moe_pattern)
        return (f"{self.num_layers} layers ({self.num_layers - n_moe} dense, {n_moe} MoE; indexer on layers "
                f"{','.join(map(str, self.full_layers))}), hidden {self.hidden}, {self.heads} heads, q_lora "
                f"{self.q_lora}, kv_lora {self.kv_lora}, qk {self.qk_nope}+{self.qk_rope}, v {self.v_head}, indexer "
                f"{self.index_heads}x{self.index_dim} top-k {self.topk}, {self.experts} experts top-{self.router_topk} "
                f"(width {self.moe_ffn}, shared {self.shared_ffn}), dense FFN {self.ffn}, vocab {self.vocab}, "
                f"seq {self.seq}, global batch {self.global_batch}")


def moe_pattern(value: str | None, num_layers: int, has_experts: bool) -> tuple[int, ...]:
    """``--moe-layer-freq`` as Megatron-LM reads it: an int N (every N-th layer from 0) or a list expression."""
    if not has_experts:
        return (0,) * num_layers
    value = "1" if value is None else value.strip()
    if value.lstrip("-").isdigit():
        n = int(value)
        return tuple(1 if i % n == 0 else 0 for i in range(num_layers))
    pattern = eval(value, {"__builtins__": {}}, {})  # noqa: S307 - Megatron-LM evaluates the same expression
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {value!r} has {len(pattern)} entries for {num_layers} layers")
    return tuple(int(x) for x in pattern)


def shape_from_argv(argv: list[str]) -> Shape:
    """The model shape a pretrain_gpt.py flag list describes (last occurrence wins, as in argparse)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, default in (
        ("--num-layers", None), ("--hidden-size", None), ("--ffn-hidden-size", None), ("--num-attention-heads", None),
        ("--q-lora-rank", None), ("--kv-lora-rank", 512), ("--qk-head-dim", 128), ("--qk-pos-emb-head-dim", 64),
        ("--v-head-dim", 128), ("--dsa-indexer-n-heads", 0), ("--dsa-indexer-head-dim", 0), ("--dsa-indexer-topk", 0),
        ("--dsa-indexer-topk-freq", 1), ("--dsa-indexer-skip-topk-offset", 0), ("--num-experts", None),
        ("--moe-router-topk", 2), ("--moe-ffn-hidden-size", None), ("--moe-shared-expert-intermediate-size", None),
        ("--vocab-size", None), ("--make-vocab-size-divisible-by", 128), ("--tensor-model-parallel-size", 1),
        ("--seq-length", None), ("--global-batch-size", None),
    ):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--moe-layer-freq", default=None)
    a, _ = p.parse_known_args(argv)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "vocab_size",
                           "seq_length", "global_batch_size") if getattr(a, k) is None]
    if missing:
        raise ValueError(f"the flags lack {missing}: cannot count FLOPs")
    div = a.make_vocab_size_divisible_by * a.tensor_model_parallel_size
    ffn = a.ffn_hidden_size if a.ffn_hidden_size is not None else 4 * a.hidden_size
    return Shape(
        num_layers=a.num_layers, hidden=a.hidden_size, ffn=ffn, heads=a.num_attention_heads, q_lora=a.q_lora_rank,
        kv_lora=a.kv_lora_rank, qk_nope=a.qk_head_dim, qk_rope=a.qk_pos_emb_head_dim, v_head=a.v_head_dim,
        index_heads=a.dsa_indexer_n_heads, index_dim=a.dsa_indexer_head_dim, topk=a.dsa_indexer_topk,
        topk_freq=a.dsa_indexer_topk_freq, skip_offset=a.dsa_indexer_skip_topk_offset, experts=a.num_experts or 0,
        router_topk=a.moe_router_topk, moe_ffn=a.moe_ffn_hidden_size or ffn,
        shared_ffn=a.moe_shared_expert_intermediate_size or 0,
        moe_pattern=moe_pattern(a.moe_layer_freq, a.num_layers, bool(a.num_experts)),
        vocab=-(-a.vocab_size // div) * div, seq=a.seq_length, global_batch=a.global_batch_size,
    )


def sparse_pairs(seq: int, topk: int) -> int:
    """(query, key) pairs of causal top-k attention over one sequence: query i sees min(i + 1, topk) keys."""
    k = min(seq, topk)
    return k * (k + 1) // 2 + (seq - k) * topk


def causal_pairs(seq: int) -> int:
    return seq * (seq + 1) // 2


def flop_count(s: Shape) -> dict[str, float]:
    """FLOPs of one training iteration by part, "our count" (formula in the module docstring)."""
    tokens, seqs, n, h = s.seq * s.global_batch, s.global_batch, s.heads, s.hidden
    n_moe = sum(s.moe_pattern)
    n_dense = s.num_layers - n_moe
    attn_tok = (h * s.q_lora + s.q_lora * n * (s.qk_nope + s.qk_rope) + h * (s.kv_lora + s.qk_rope)
                + n * s.qk_nope * s.kv_lora + n * s.kv_lora * s.v_head + n * s.v_head * h)
    core_pair = n * ((s.kv_lora + s.qk_rope) + s.kv_lora)
    idx_tok = s.q_lora * s.index_heads * s.index_dim + h * s.index_dim + h * s.index_heads
    moe_tok = h * s.experts + s.router_topk * 3 * h * s.moe_ffn + 3 * h * s.shared_ffn
    return {
        "attention projections": 3 * 2 * s.num_layers * tokens * attn_tok,
        "sparse attention": 3 * 2 * s.num_layers * seqs * sparse_pairs(s.seq, s.topk) * core_pair,
        "indexer (forward only)": 2 * len(s.full_layers) * (tokens * idx_tok + seqs * causal_pairs(s.seq)
                                                            * s.index_heads * s.index_dim),
        "dense MLP": 3 * 2 * n_dense * tokens * 3 * h * s.ffn,
        "MoE (router, routed, shared)": 3 * 2 * n_moe * tokens * moe_tok,
        "logits": 3 * 2 * tokens * h * s.vocab,
    }


# ----------------------------------------------------------------------------------------------------------------
# Megatron-LM log
# ----------------------------------------------------------------------------------------------------------------

_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)((?: \| [a-z ]+: [-\d.]+)+)")
_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \(\d+, \d+\): (\d+)")
_EXC = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*")  # an exception line, not indented
MS_KEY, TFLOPS_KEY, LOSS_KEY = "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)", "lm loss"


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


@dataclass
class RunLog:
    iterations: list[dict[str, Any]] = field(default_factory=list)  # one per logged iteration, in order
    memory: list[dict[str, float]] = field(default_factory=list)  # Megatron-LM's report_memory lines
    params: int | None = None
    traceback: list[str] = field(default_factory=list)  # the root cause's traceback lines, if any
    error: str = ""  # its exception line ("AssertionError: Megatron requires CUDA.")

    def steady(self, skip: int) -> list[dict[str, Any]]:
        return [it for it in self.iterations if it["iteration"] > skip]

    @property
    def peak_allocated_mb(self) -> float | None:
        return self.memory[-1]["max allocated"] if self.memory else None


def parse_log(text: str) -> RunLog:
    """Megatron-LM's training_log / report_memory lines from a run's combined output."""
    log = RunLog()
    lines = text.splitlines()
    for line in lines:
        m = _ITER.search(line)
        if m:
            it: dict[str, Any] = {"iteration": int(m.group(1)), "train_iters": int(m.group(2))}
            for part in line[m.end():].split("|"):
                key, sep, value = part.partition(":")
                if sep and key.strip():
                    it[key.strip()] = _number(value.strip())
            log.iterations.append(it)
            continue
        m = _MEM.search(line)
        if m:
            mem: dict[str, float] = {"rank": int(m.group(1)), "after": int(m.group(2))}
            for part in m.group(3).split("|"):
                key, sep, value = part.partition(":")
                if sep:
                    mem[key.strip()] = float(value)
            log.memory.append(mem)
            continue
        m = _PARAMS.search(line)
        if m:
            log.params = int(m.group(1))
    # The root cause: the first traceback that is not torchrun's own report of a failed worker.
    for start, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        end = next((j for j in range(start + 1, len(lines)) if _EXC.match(lines[j])), None)
        if end is not None and "ChildFailedError" not in lines[end]:
            log.traceback, log.error = lines[start:end + 1][-40:], lines[end].strip()
            break
    return log


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Profiler trace -> GPU time by bucket
# ----------------------------------------------------------------------------------------------------------------

BUCKETS = (
    "linear attention (KDA)",
    "mHC streams",
    "sparse attention",
    "indexer + top-k",
    "MoE router + dispatch/permute",
    "expert GEMMs (routed)",
    "other GEMMs",
    "norms, RoPE, elementwise, copies",
    "optimizer + grad buffers",
)
CATCH_ALL = "norms, RoPE, elementwise, copies"  # what no rule claims; broken down by source in the report
_NEUTRAL = "-"  # a context that ends the search without a bucket (e.g. the shared expert inside the MoE layer)
# (region, pattern on a CPU op / Python frame name), tried innermost frame first; the first match decides. Python
# frames are "path/file.py(line): function" or "nn.Module: Class_i"; backward ops are linked to their forward op.
_REGIONS = [
    ("kda", re.compile(r"nn\.Module: KimiDeltaAttention|glm5_next/kda(_reference)?\.py|fla/ops/kda|chunk_kda")),
    ("mhc", re.compile(r"glm5_next/mhc\.py|nn\.Module: (HyperConnection|MHC)|kernels/stream_mix\.py|_?StreamMix")),
    ("sparse", re.compile(r"sparse_mla|SparseMLA|(?<![A-Za-z])sparse_attention|nn\.Module: TileLangSparseAttention"
                          r"|FusedSparseAttention|flash_mla")),
    ("indexer", re.compile(r"compute_topk|select_topk|forward_before_topk|indexer_topk|qk_topk|nn\.Module: DSAIndexer"
                           r"|IndexerFunction|tilelang_indexer|ops/indexer\.py|indexer_fwd|FusedQKTopK|kpool|KPool")),
    (_NEUTRAL, re.compile(r"shared_experts\.py|SharedExpertMLP|moe_layer\.py\(\d+\): shared_experts_compute")),
    ("experts", re.compile(r"moe/experts\.py|nn\.Module: (SequentialMLP|GroupedMLP|TEGroupedMLP)"
                           r"|moe_layer\.py\(\d+\): routed_experts_compute")),
    ("dispatch", re.compile(r"moe/token_dispatcher\.py|moe/router\.py|moe/moe_utils\.py|nn\.Module: TopKRouter"
                            r"|moe_layer\.py\(\d+\): (route|preprocess|dispatch|combine|postprocess"
                            r"|router_and_preprocess)\b")),
    # the routed experts' weight gradients added into DDP's main_grad (kernels/grouped_wgrad_accum.py): DDP's adds
    ("optimizer", re.compile(r"megatron/core/optimizer/|torch/optim/|clip_grads|AccumulateGrad|grouped_wgrad_accum"
                             r"|param_and_grad_buffer\.py|distributed_data_parallel\.py\(\d+\): (?!forward)"
                             r"|finalize_model_grads")),
]
_GEMM = re.compile(r"gemm|nvjet|cublas|cutlass|gemv|splitKreduce|xmma|wgmma", re.I)
_KERNEL_NAME_RULES = [  # when no context decides
    ("sparse attention", re.compile(r"sparse_mla", re.I)),
    ("mHC streams", re.compile(r"stream_mix", re.I)),
    ("indexer + top-k", re.compile(r"indexer|topk|clean_logits", re.I)),
    ("optimizer + grad buffers", re.compile(r"multi_tensor_apply|adam", re.I)),
]
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_CONTEXT_CATS = ("cpu_op", "python_function", "user_annotation")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_BWD = "autograd::engine::evaluate_function"
# CUDA runtime calls where the host waits for the device (a D2H copy into pageable memory waits inside cudaMemcpyAsync)
_SYNC = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$|^cudaStreamWaitEvent_sync$")
IDLE_MIN_US = 5.0  # a GPU gap shorter than this is launch latency between back-to-back kernels, not idle time
_PY_FRAME = re.compile(r"\.py\(\d+\): ")
_LIBRARY_FRAME = re.compile(r"(^|/)(torch|contextlib|functools|threading|typing)(/|\.py)|^<built-in|^<frozen")


def source_of(context_inner_first: list[str]) -> str:
    """Where in the model's code a kernel (or a host wait) comes from: the innermost Python frame outside torch and
    the standard library, and, when that is megatron-core's, the innermost frame of ours below it."""
    frames = [f for f in context_inner_first if _PY_FRAME.search(f) and not _LIBRARY_FRAME.search(f)]
    if not frames:
        module = next((f for f in context_inner_first if f.startswith("nn.Module: ")), None)
        return module or (context_inner_first[0] if context_inner_first else "(no launch recorded)")
    inner = frames[0]
    ours = next((f for f in frames if "megatron_glm5/" in f), None)
    return inner if ours is None or ours == inner else f"{inner} < {ours}"


def classify(kernel: str, context_inner_first: list[str]) -> str:
    """The bucket of one GPU kernel from its name and the names of the frames that launched it (innermost first)."""
    region = None
    for frame in context_inner_first:
        for r, pattern in _REGIONS:
            if pattern.search(frame):
                region = r
                break
        if region is not None:
            break
    gemm = bool(_GEMM.search(kernel))
    if region == "kda":
        return "linear attention (KDA)"
    if region == "mhc":
        return "mHC streams"
    if region == "sparse":
        return "sparse attention"
    if region == "indexer":
        return "indexer + top-k"
    if region == "dispatch":
        return "MoE router + dispatch/permute"
    if region == "optimizer":
        return "optimizer + grad buffers"
    if region == "experts" and gemm:
        return "expert GEMMs (routed)"
    if region is None:
        for bucket, pattern in _KERNEL_NAME_RULES:
            if pattern.search(kernel):
                return bucket
    return "other GEMMs" if gemm else CATCH_ALL


@dataclass
class Breakdown:
    steps: int
    wall_ms: float  # per step: first step start to the later of last step end and last GPU activity end
    busy_ms: float  # per step: union of GPU activity intervals
    kernel_sum_ms: float  # per step: sum of GPU activity durations (> busy when streams overlap)
    buckets_ms: dict[str, float]  # per step
    top: list[tuple[str, str, int, float]]  # (kernel, bucket, calls per step, ms per step)
    linked: float  # share of GPU time whose launch was found
    python_frames: int  # Python tracer events in the trace (0: no call stack, buckets from names only)
    # The catch-all bucket by the code that launched it: (source, calls per step, ms per step), largest first.
    sources: list[tuple[str, int, float]] = field(default_factory=list)
    # Host waits on the device in the step: (source, runtime call, calls per step, host ms per step).
    syncs: list[tuple[str, str, int, float]] = field(default_factory=list)
    # GPU idle time by the launch that ended it (what the GPU was waiting for): (source, gaps, ms per step).
    idle: list[tuple[str, int, float]] = field(default_factory=list)

    @property
    def host_gap_ms(self) -> float:
        return self.wall_ms - self.busy_ms


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data if isinstance(data, list) else data.get("traceEvents", [])
    return [e for e in events if isinstance(e, dict)]


def _enclosing(frames: list[tuple[float, float, int]], queries: list[tuple[float, Any]]) -> dict[Any, list[int]]:
    """For each query (time, key): indices of the frames (start, end, index) open at that time, outermost first.
    ``frames`` sorted by (start, -duration)."""
    out: dict[Any, list[int]] = {}
    stack: list[tuple[float, float, int]] = []
    fi = 0
    for t, key in sorted(queries, key=lambda q: q[0]):
        while fi < len(frames) and frames[fi][0] <= t:
            start = frames[fi][0]
            while stack and stack[-1][1] < start:
                stack.pop()
            stack.append(frames[fi])
            fi += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[key] = [idx for s, e, idx in stack if e >= t]
    return out


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1000.0


def trace_breakdown(events: list[dict], top: int = 15) -> Breakdown:
    """GPU time of the trace's profiler steps by bucket (module docstring)."""
    ctx_events: list[dict] = []
    launches: dict[Any, dict] = {}
    gpu: list[dict] = []
    steps: list[dict] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in _GPU_CATS:
            gpu.append(e)
        elif cat in _LAUNCH_CATS:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat in _CONTEXT_CATS:
            if cat == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#"):
                steps.append(e)
            ctx_events.append(e)
    # Frames per host thread; queries: kernel launches and forward ops that own an autograd node.
    by_thread: dict[Any, list[tuple[float, float, int]]] = defaultdict(list)
    for i, e in enumerate(ctx_events):
        by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), i))
    for frames in by_thread.values():
        frames.sort(key=lambda f: (f[0], -(f[1] - f[0])))
    fwd_op: dict[int, int] = {}  # sequence number -> innermost forward op (index into ctx_events)
    for i, e in enumerate(ctx_events):
        a = e.get("args", {})
        seq = a.get("Sequence number")
        if (e.get("cat") == "cpu_op" and seq is not None and not a.get("Fwd thread id")
                and not str(e.get("name", "")).startswith(_BWD)):
            j = fwd_op.get(seq)
            if j is None or float(e.get("dur", 0)) < float(ctx_events[j].get("dur", 0)):
                fwd_op[seq] = i
    # Where each GPU activity was launched: its CUDA runtime / driver call (same correlation id), else the CPU op
    # its "External id" names (e.g. when the profiler did not record the driver call of a JIT-compiled kernel).
    ext_op = {e["args"]["External id"]: i for i, e in enumerate(ctx_events)
              if e.get("cat") == "cpu_op" and e.get("args", {}).get("External id")}
    queries: dict[Any, list[tuple[float, Any]]] = defaultdict(list)
    anchors: list[Any] = []
    sync_events = [e for e in launches.values() if _SYNC.search(str(e.get("name", "")))]
    sync_events += [e for e in events if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS
                    and e.get("args", {}).get("correlation") is None and _SYNC.search(str(e.get("name", "")))]
    for j, e in enumerate(sync_events):
        queries[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), ("sync", j)))
    for e in gpu:
        a = e.get("args", {})
        launch = launches.get(a.get("correlation"))
        if launch is not None:
            key = ("launch", a.get("correlation"))
            queries[(launch.get("pid"), launch.get("tid"))].append((float(launch["ts"]), key))
        elif a.get("External id") in ext_op:
            key = ("op", a["External id"])
            op = ctx_events[ext_op[a["External id"]]]
            queries[(op.get("pid"), op.get("tid"))].append((float(op["ts"]) + min(float(op.get("dur", 0)) / 2, 1e-3),
                                                            key))
        else:
            key = None
        anchors.append(key)
    for seq, i in fwd_op.items():
        e = ctx_events[i]
        queries[(e.get("pid"), e.get("tid"))].append((float(e["ts"]) + min(float(e.get("dur", 0)) / 2, 1e-3),
                                                      ("fwd", seq)))
    stacks: dict[Any, list[int]] = {}
    for thread, qs in queries.items():
        stacks.update(_enclosing(by_thread.get(thread, []), qs))

    def names(idxs: Iterable[int]) -> list[str]:
        return [str(ctx_events[i].get("name", "")) for i in idxs]

    def context(key) -> list[str] | None:
        stack = stacks.get(key) if key is not None else None
        if stack is None:
            return None
        inner_first = stack[::-1]
        for pos, i in enumerate(inner_first):  # the innermost backward node: splice in its forward op's frames
            e = ctx_events[i]
            seq = e.get("args", {}).get("Sequence number")
            if str(e.get("name", "")).startswith(_BWD) and seq in fwd_op:
                fwd = stacks.get(("fwd", seq), [])[::-1]
                return names(inner_first[: pos + 1]) + names(fwd) + names(inner_first[pos + 1:])
        return names(inner_first)

    bucket_us: dict[str, float] = {b: 0.0 for b in BUCKETS}
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    per_source: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    linked_us = total_us = 0.0
    intervals = []
    for e, key in zip(gpu, anchors):
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        name = str(e.get("name", ""))
        ctx = context(key)
        bucket = classify(name, ctx or [])
        bucket_us[bucket] += dur
        k = per_kernel[(name, bucket)]
        k[0] += 1
        k[1] += dur
        if bucket == CATCH_ALL:
            src = per_source[source_of(ctx) if ctx is not None else "(no launch recorded)"]
            src[0] += 1
            src[1] += dur
        total_us += dur
        linked_us += dur if ctx is not None else 0.0
        intervals.append((ts, ts + dur))
    n_steps = max(len(steps), 1)
    if steps:
        start = min(float(s["ts"]) for s in steps)
        end = max(float(s["ts"]) + float(s.get("dur", 0)) for s in steps)
    else:
        start, end = min((s for s, _ in intervals), default=0.0), 0.0
    end = max([end] + [e for _, e in intervals])
    top_rows = sorted(((n, b, int(c / n_steps), us / n_steps / 1000.0) for (n, b), (c, us) in per_kernel.items()),
                      key=lambda r: -r[3])[:top]
    source_rows = sorted(((k, int(c / n_steps), us / n_steps / 1000.0) for k, (c, us) in per_source.items()),
                         key=lambda r: -r[2])[:2 * top]
    per_idle: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    busy_until = start
    for e, key in sorted(zip(gpu, anchors), key=lambda p: float(p[0]["ts"])):
        ts, te = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if steps and ts > end:
            break
        if ts - busy_until > IDLE_MIN_US and ts >= start:
            k = per_idle[source_of(context(key) or []) if key is not None else "(no launch recorded)"]
            k[0] += 1
            k[1] += ts - busy_until
        busy_until = max(busy_until, te)
    idle_rows = sorted(((src, int(c / n_steps) or 1, us / n_steps / 1000.0) for src, (c, us) in per_idle.items()),
                       key=lambda r: -r[2])[:top]
    per_sync: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for j, e in enumerate(sync_events):
        if steps and not start <= float(e["ts"]) <= end:
            continue
        k = per_sync[(source_of(context(("sync", j)) or []), str(e.get("name", "")))]
        k[0] += 1
        k[1] += float(e.get("dur", 0))
    sync_rows = sorted(((src, call, int(c / n_steps) or 1, us / n_steps / 1000.0)
                        for (src, call), (c, us) in per_sync.items()), key=lambda r: -r[3])
    return Breakdown(
        steps=n_steps,
        wall_ms=(end - start) / 1000.0 / n_steps,
        busy_ms=_union_ms(intervals) / n_steps,
        kernel_sum_ms=total_us / 1000.0 / n_steps,
        buckets_ms={b: us / 1000.0 / n_steps for b, us in bucket_us.items()},
        top=top_rows,
        linked=linked_us / total_us if total_us else 0.0,
        python_frames=sum(1 for e in ctx_events if e.get("cat") == "python_function"),
        sources=source_rows,
        syncs=sync_rows,
        idle=idle_rows,
    )


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------

_MAKE_SHIM = """#!/usr/bin/env bash
# megatron.training's initialize runs `make -C <megatron/core/datasets>`; the megatron-core wheel ships the built
# helpers but no Makefile (the same stand-in as .mlm/run_pretrain_gpt.sh's).
if [ "$1" = "-C" ] && [ ! -e "$2/Makefile" ] && ls "$2"/helpers_cpp*.so >/dev/null 2>&1; then
  echo "[make shim] $2 has no Makefile (megatron-core wheel) but ships helpers_cpp*.so -> nothing to build"
  exit 0
fi
REAL_MAKE=%s
[ -n "$REAL_MAKE" ] && exec "$REAL_MAKE" "$@"
echo "[make shim] no make on this machine" >&2; exit 127
"""
_ACTIVE: list[subprocess.Popen] = []


def run_env(mlm: Path, shim_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{shim_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(mlm)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def make_shim() -> Path:
    d = Path(tempfile.mkdtemp(prefix="bench_step_shim_"))
    (d / "make").write_text(_MAKE_SHIM % shlex.quote(shutil.which("make") or ""))
    (d / "make").chmod(0o755)
    return d


_TIMERS_SITE = """\
import importlib.machinery, importlib.util, os, sys
_spec = importlib.util.spec_from_file_location("host_timers", {path!r})
_module = importlib.util.module_from_spec(_spec)
sys.modules["host_timers"] = _module
_spec.loader.exec_module(_module)
_module.install()
# the sitecustomize this one shadows, if any
_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p) != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
"""


def host_timers_table(record: dict) -> list[str]:
    """Markdown rows of one ``host_timers.py`` record: per function, calls and host ms per iteration (inclusive)."""
    n = max(1, record["iterations"])
    rows = ["| function (inclusive) | calls / iteration | host ms / iteration | ms / call |", "|---|---|---|---|"]
    for name, ms in sorted(record["calls"].items(), key=lambda kv: -sum(kv[1])):
        rows.append(f"| `{name}` | {len(ms) / n:.1f} | {sum(ms) / n:.2f} | {sum(ms) / len(ms):.3f} |")
    if record.get("gc"):
        rows += ["", "Full (generation 2) collections of Python's garbage collector: " + ", ".join(
            f"iteration {it}: {ms:.1f} ms ({collected} collected)" for it, _, ms, collected in record["gc"]) + "."]
    if record.get("heap"):
        heap = record["heap"]
        rows += ["", f"Objects the collector tracks at exit: {heap['objects']} ({heap.get('frozen', 0)} frozen); "
                     "commonest: " + ", ".join(f"`{t}` {n}" for t, n in heap["top"]) + "."]
    return rows


def host_timers_env(env: dict[str, str], out: Path, skip: int) -> tuple[dict[str, str], Path]:
    """Environment of a run timed by ``host_timers.py`` (a ``sitecustomize`` that loads and installs it, first on the
    path), and that ``sitecustomize``'s folder (the caller removes it)."""
    site = Path(tempfile.mkdtemp(prefix="bench_step_timers_"))
    (site / "sitecustomize.py").write_text(
        _TIMERS_SITE.format(path=str(Path(__file__).resolve().parent / "host_timers.py")))
    return ({"PYTHONPATH": os.pathsep.join([str(site), env["PYTHONPATH"]]), "GLM5_HOST_TIMERS_OUT": str(out),
             "GLM5_HOST_TIMERS_SKIP": str(skip)}, site)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_logged(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, float]:
    """Run ``cmd`` (its own process group) with output to ``log_path``; 124 on timeout. Returns (rc, seconds)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _ACTIVE.append(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = 124
        finally:
            _ACTIVE.remove(proc)
    return rc, time.time() - t0


def _kill(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _on_signal(signum, frame):  # a time limit from outside (e.g. gpu_checks' timeout): take the run down too
    for proc in list(_ACTIVE):
        _kill(proc)
    sys.exit(128 + signum)


def environment(python: str, env: dict[str, str]) -> dict[str, str]:
    code = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else "
        "'no CUDA device'}\n"
        "import megatron.core\nd['megatron-core'] = megatron.core.__version__\n"
        "try:\n import tilelang; d['tilelang'] = tilelang.__version__\n"
        "except Exception as e:\n d['tilelang'] = repr(e)\n"
        "try:\n import transformer_engine; d['transformer_engine'] = 'present'\nexcept ImportError:\n"
        " d['transformer_engine'] = 'not installed'\n"
        "print(json.dumps(d))\n"
    )
    try:
        out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # the report still gets written
        return {"probe": f"failed: {type(e).__name__}: {e}"}


def git_commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "n/a"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + (" (with uncommitted changes)" if dirty else "")


@dataclass
class RunResult:
    kind: str  # "main" | "profile" | "cpu-check"
    cmd: list[str]
    log_path: str
    rc: int
    seconds: float
    log: RunLog
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class VariantResult:
    variant: Variant
    argv: list[str]
    shape: Shape
    main: RunResult | None = None
    profile: RunResult | None = None
    breakdown: Breakdown | None = None
    trace_path: str = ""
    host_timers: dict | None = None  # host_timers.py's record of the timed run (--host-timers)

    def stats(self, skip: int) -> dict[str, float]:
        its = self.main.log.steady(skip) if self.main else []
        timed = [(float(it[MS_KEY]), it["iteration"]) for it in its if isinstance(it.get(MS_KEY), float)]
        ms = [t for t, _ in timed]
        tf = [float(it[TFLOPS_KEY]) for it in its if isinstance(it.get(TFLOPS_KEY), float)]
        m, sd = mean_std(ms)
        tokens = self.shape.seq * self.shape.global_batch
        ours = sum(flop_count(self.shape).values())
        both = tf and len(tf) == len(ms)
        mcore_tflop = statistics.fmean(t * x / 1000.0 for t, x in zip(tf, ms)) if both else math.nan
        peak = self.main.log.peak_allocated_mb if self.main else None
        return {
            "iters": len(ms), "ms_mean": m, "ms_std": sd, "tokens_per_s": tokens / (m / 1000.0) if ms else math.nan,
            # a run's slowest iteration moves the mean and sd far (round 8: one ~700 ms iteration in 25)
            "ms_median": statistics.median(ms) if ms else math.nan,
            "ms_max": max(timed)[0] if timed else math.nan, "slowest_iteration": max(timed)[1] if timed else -1,
            "tflops_megatron": statistics.fmean(tf) if tf else math.nan,
            "tflops_ours": ours / (m / 1000.0) / 1e12 if ms else math.nan,
            "tflop_per_iter_megatron": mcore_tflop, "tflop_per_iter_ours": ours / 1e12,
            "peak_gib": peak / 1024.0 if peak is not None else math.nan,
        }


def check_run(kind: str, variant: str, rc: int, log: RunLog, expected_iters: int, log_path: Path) -> str:
    """'' when the run did what it should, else why not (names the variant and the log)."""
    why = ""
    if rc == 124:
        why = "timed out"
    elif rc != 0:
        why = f"exit status {rc}"
    elif len({it["iteration"] for it in log.iterations}) < expected_iters:
        why = f"{len(log.iterations)} of {expected_iters} iterations logged"
    if not why:
        return ""
    tb = f"; {log.error}" if log.error else ""
    return f"variant {variant}, {kind} run: {why}{tb} (log: {log_path})"


def run_variant_main(vr: VariantResult, args, env, log_dir: Path) -> None:
    log_path = log_dir / f"bench_step_{vr.variant.name}.log"
    cmd = torchrun_cmd(args.python, args.mlm, free_port(), vr.argv)
    print(f"[bench_step] {vr.variant.name}: {args.iters} iterations -> {log_path}", flush=True)
    timers_path = log_dir / f"bench_step_{vr.variant.name}_host_timers.jsonl"
    extra_env, site = {}, None
    if args.host_timers:
        timers_path.unlink(missing_ok=True)
        extra_env, site = host_timers_env(env, timers_path, args.skip)
    try:
        rc, secs = run_logged(cmd, {**env, **dict(vr.variant.env), **extra_env}, log_path, args.timeout)
    finally:
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)
    if args.host_timers and timers_path.exists():
        vr.host_timers = json.loads(timers_path.read_text().splitlines()[0])  # first rank to exit
    log = parse_log(log_path.read_text(errors="replace"))
    vr.main = RunResult("main", cmd, str(log_path), rc, secs, log,
                        check_run("main", vr.variant.name, rc, log, args.iters, log_path))
    st = vr.stats(args.skip)
    print(f"[bench_step] {vr.variant.name}: rc={rc} in {secs:.0f} s; {st['ms_mean']:.1f} +- {st['ms_std']:.1f} "
          f"ms/iter (median {st['ms_median']:.1f}, slowest {st['ms_max']:.1f} at #{st['slowest_iteration']}), "
          f"peak {st['peak_gib']:.1f} GiB", flush=True)


def run_variant_profile(vr: VariantResult, args, env, log_dir: Path) -> None:
    name = vr.variant.name
    log_path = log_dir / f"bench_step_{name}_profile.log"
    prof_dir = log_dir / f"bench_step_{name}_prof"
    shutil.rmtree(prof_dir, ignore_errors=True)
    argv = pretrain_argv(vr.variant, seq=args.seq, iters=args.iters, scale_down=args.scale_down, extra=args.extra,
                         profile_step=args.profile_step, tb_dir=prof_dir / "tb")
    cmd = torchrun_cmd(args.python, args.mlm, free_port(), argv)
    print(f"[bench_step] {name}: profiling iteration {args.profile_step} -> {log_path}", flush=True)
    rc, secs = run_logged(cmd, {**env, **dict(vr.variant.env)}, log_path, args.timeout)
    log = parse_log(log_path.read_text(errors="replace"))
    error = check_run("profile", name, rc, log, args.profile_step + 1, log_path)
    trace = prof_dir / "torch_profile" / "rank-0.json.gz"
    if not error and not trace.exists():
        error = f"variant {name}, profile run: no trace at {trace} (log: {log_path})"
    vr.profile = RunResult("profile", cmd, str(log_path), rc, secs, log, error)
    if trace.exists():
        dest = log_dir / f"bench_step_{name}_trace.json.gz"
        shutil.move(str(trace), dest)
        vr.trace_path = str(dest)
        try:
            vr.breakdown = trace_breakdown(load_trace(dest))
        except Exception as e:  # keep the rest of the report
            vr.profile.error = f"variant {name}, profile run: trace unreadable: {type(e).__name__}: {e} ({dest})"
    shutil.rmtree(prof_dir, ignore_errors=True)
    print(f"[bench_step] {name}: profile rc={rc} in {secs:.0f} s"
          + (f"; {vr.profile.error}" if vr.profile.error else ""), flush=True)


def cpu_check(vr: VariantResult, args, env, log_dir: Path) -> RunResult:
    """The client's CPU pre-flight (check_args_cpu.py: parse, config, FLOPs, spec; with --scale-down also build and
    one forward/backward through pretrain_gpt's forward_step) on this variant's profiled-run flags. megatron-core
    refuses ``--dsa-kernel-backend tilelang`` without CUDA after parsing; that variant is then checked without it."""
    checker = args.mlm / "check_args_cpu.py"
    argv = pretrain_argv(vr.variant, seq=args.seq, iters=args.iters, scale_down=args.scale_down, extra=args.extra,
                         profile_step=args.profile_step, tb_dir=log_dir / "tb")
    build = ["--build"] if args.scale_down else []
    log_path = log_dir / f"bench_step_{vr.variant.name}_cpu.log"
    cmd = [args.python, str(checker), vr.variant.spec, *build, "--", *argv]
    rc, secs = run_logged(cmd, {**env, **dict(vr.variant.env)}, log_path, args.timeout)
    text = log_path.read_text(errors="replace")
    note = ""
    if rc != 0 and "PARSE: OK" in text and "requires a CUDA device" in text and "--dsa-kernel-backend" in argv:
        i = argv.index("--dsa-kernel-backend")
        cmd = [args.python, str(checker), vr.variant.spec, *build, "--", *argv[:i], *argv[i + 2:]]
        rc, secs2 = run_logged(cmd, {**env, **dict(vr.variant.env)},
                               log_path.with_name(log_path.stem + "_nokernels.log"), args.timeout)
        text += "\n" + log_path.with_name(log_path.stem + "_nokernels.log").read_text(errors="replace")
        secs += secs2
        note = " (parsed with --dsa-kernel-backend tilelang; the rest without it: megatron-core needs CUDA for it)"
    want = ("PARSE", "CONFIG", "FLOPS", "SPEC") + (("BUILD", "DATA", "FWD/BWD") if build else ())
    got = [k for k in want if re.search(rf"^{re.escape(k)}: OK", text, re.M)]
    error = "" if rc == 0 and len(got) == len(want) else (
        f"variant {vr.variant.name}, cpu check: exit status {rc}, passed {got} of {list(want)} (log: {log_path})")
    for line in text.splitlines():
        if re.match(r"^(PARSE|CONFIG|FLOPS|SPEC|BUILD|DATA|FWD/BWD):", line):
            print(f"[bench_step] {vr.variant.name}: {line}", flush=True)
    print(f"[bench_step] {vr.variant.name}: cpu check {'OK' if not error else 'FAILED'}{note} in {secs:.0f} s",
          flush=True)
    return RunResult("cpu-check", cmd, str(log_path), rc, secs, parse_log(text), error)


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def _f(x: float, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def loss_table(results) -> list[str]:
    """Markdown lines: the ``lm loss`` of every logged iteration per variant (``results``: objects with
    ``.variant.name`` and ``.main``, a :class:`RunResult` or None)."""
    iters = sorted({it["iteration"] for r in results if r.main for it in r.main.log.iterations})
    if not iters:
        return []
    lines = ["", "Loss per iteration (`lm loss`; iteration 2 is Megatron-LM's mean of 1 and 2):", "",
             "| iteration | " + " | ".join(r.variant.name for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    by_iter = [{it["iteration"]: it for it in (r.main.log.iterations if r.main else [])} for r in results]
    for i in iters:
        cells = [its.get(i, {}).get(LOSS_KEY) for its in by_iter]
        lines.append(f"| {i} | " + " | ".join(f"{v:.4f}" if isinstance(v, float) else "-" for v in cells) + " |")
    return lines


def render_report(results: list[VariantResult], *, skip: int, meta: dict[str, Any]) -> str:
    stats = {r.variant.name: r.stats(skip) for r in results}
    base = stats.get(baseline(stats), {}).get("ms_mean", math.nan)
    shape = results[0].shape
    flops = flop_count(shape)
    lines = [
        f"## Whole training step, GLM-5-shaped one-GPU slice ({meta['date']}, commit {meta['commit']}, {meta['gpu']})",
        "",
        f"`{_md(meta['command'])}`; {meta['versions']}.",
        "",
        f"Slice: {shape.summary()}; bf16, mock data, micro-batch 1, Megatron-LM's pretrain_gpt.py "
        f"(`--transformer-impl local`, gradient-accumulation fusion on){meta['extra']}.",
        "",
        f"FLOP per iteration, our count: {sum(flops.values()) / 1e12:.1f} T ("
        + ", ".join(f"{k} {v / 1e12:.1f}" for k, v in flops.items())
        + "); Megatron-LM's count (its TFLOP/s x its time): "
        + ", ".join(f"{r.variant.name} {_f(stats[r.variant.name]['tflop_per_iter_megatron'])} T" for r in results)
        + f". Means over iterations {skip + 1}-{meta['iters']}.",
        "",
        "| variant | ms / iteration (mean ± sd; median; slowest, its iteration) | tokens/s "
        "| TFLOP/s (Megatron's count) | TFLOP/s (our count) | peak allocated GiB "
        f"| speed vs {baseline(stats)} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = stats[r.variant.name]
        label = f"`{r.variant.name}`: {r.variant.description}"
        if r.main is None or not r.main.ok:
            why = r.main.error if r.main else "not run"
            lines.append(f"| {label} | FAILED: {_md(why)} | | | | | |")
            continue
        ratio = f"{base / s['ms_mean']:.2f}x" if not math.isnan(base) else "-"
        lines.append(f"| {label} | {s['ms_mean']:.1f} ± {s['ms_std']:.1f}; {s['ms_median']:.1f}; "
                     f"{s['ms_max']:.1f} (#{s['slowest_iteration']}) | {s['tokens_per_s']:.0f} | "
                     f"{s['tflops_megatron']:.1f} | {s['tflops_ours']:.1f} | {_f(s['peak_gib'], '.2f')} | {ratio} |")
    lines += loss_table(results)
    # Breakdown
    profiled = [r for r in results if r.breakdown is not None or r.profile is not None]
    if profiled:
        lines += ["", f"GPU time per step by bucket, profiled run at iteration {meta['profile_step']} "
                      "(torch.profiler; ms and share of GPU busy time):", "",
                  "| bucket | " + " | ".join(r.variant.name for r in profiled) + " |",
                  "|---" * (len(profiled) + 1) + "|"]

        def row(label: str, fn) -> str:
            return f"| {label} | " + " | ".join(fn(r) if r.breakdown else "-" for r in profiled) + " |"

        def share(r, b: str) -> str:
            ms = r.breakdown.buckets_ms[b]
            return f"{ms:.1f} ({100 * ms / max(r.breakdown.busy_ms, 1e-9):.0f} %)"

        for b in BUCKETS:
            if any(r.breakdown and r.breakdown.buckets_ms[b] for r in profiled):  # no KDA rows for GLM-5, say
                lines.append(row(b, lambda r, b=b: share(r, b)))
        lines.append(row("**GPU busy** (union; sum of kernel times)",
                         lambda r: f"{r.breakdown.busy_ms:.1f} ({r.breakdown.kernel_sum_ms:.1f})"))
        lines.append(row("step wall time, profiled", lambda r: f"{r.breakdown.wall_ms:.1f}"))
        lines.append(row("host gaps, profiled step (wall - busy)", lambda r: f"{r.breakdown.host_gap_ms:.1f}"))
        lines.append(row("host gaps vs the unprofiled mean (ms/iteration - busy)",
                         lambda r: _f(stats[r.variant.name]["ms_mean"] - r.breakdown.busy_ms)))
        lines.append(row("ms / iteration without the optimizer (unprofiled mean - its GPU time); TFLOP/s (Megatron's)",
                         lambda r: _without_optimizer(stats[r.variant.name], r.breakdown)))
        lines.append(row("GPU time tied to a launch; Python frames in trace",
                         lambda r: f"{100 * r.breakdown.linked:.0f} %; {r.breakdown.python_frames}"))
        for r in profiled:
            if r.profile is not None and not r.profile.ok:
                lines += ["", f"Profile of `{r.variant.name}` FAILED: {_md(r.profile.error)}"]
        for r in profiled:
            if r.breakdown is None:
                continue
            lines += ["", f"Top kernels, `{r.variant.name}` (per step):", "", "| kernel | bucket | calls | ms |",
                      "|---|---|---|---|"]
            for name, bucket, calls, ms in r.breakdown.top:
                short = name if len(name) <= 100 else name[:97] + "..."
                lines.append(f"| `{_md(short)}` | {bucket} | {calls} | {ms:.2f} |")
            if r.breakdown.sources:
                lines += ["", f"\"{CATCH_ALL}\" by the code that launched it, `{r.variant.name}` (per step; "
                              "innermost frame outside torch, and ours below it):", "",
                          "| source | kernels | ms |", "|---|---|---|"]
                lines += [f"| `{_md(src)}` | {calls} | {ms:.2f} |" for src, calls, ms in r.breakdown.sources]
            lines += ["", f"Host waits on the GPU in the profiled step, `{r.variant.name}`: "
                          + (f"{sum(c for *_, c, _ in r.breakdown.syncs)} calls, "
                             f"{sum(ms for *_, ms in r.breakdown.syncs):.1f} ms host time" if r.breakdown.syncs
                             else "none recorded")]
            if r.breakdown.syncs:
                lines += ["", "| source | runtime call | calls | host ms |", "|---|---|---|---|"]
                lines += [f"| `{_md(src)}` | {call} | {calls} | {ms:.2f} |"
                          for src, call, calls, ms in r.breakdown.syncs]
            if r.breakdown.idle:
                lines += ["", f"GPU idle (gaps over {IDLE_MIN_US:.0f} us) by the launch that ended it, "
                              f"`{r.variant.name}` (per step; the profiler's Python tracing inflates host time):", "",
                          "| source | gaps | idle ms |", "|---|---|---|"]
                lines += [f"| `{_md(src)}` | {n} | {ms:.2f} |" for src, n, ms in r.breakdown.idle]
    for r in results:
        if r.host_timers:
            lines += ["", f"Host time of Megatron's step phases, `{r.variant.name}` (timed run, `--host-timers`: "
                          f"perf_counter around each function, no sync added; iterations past {skip}):", ""]
            lines += host_timers_table(r.host_timers)
    files = [Path(p).name for r in results for p in (r.main.log_path if r.main else "",
                                                     r.profile.log_path if r.profile else "", r.trace_path) if p]
    lines += ["", "Logs and traces (next to this file): " + ", ".join(f"`{f}`" for f in files) + "."]
    return "\n".join(lines) + "\n"


def _without_optimizer(stats: dict[str, float], b: Breakdown) -> str:
    """The step with the optimizer's GPU time taken out (Megatron-LM's optimizer: its torch fallback without TE or
    apex is not the model's), and Megatron's TFLOP/s at that time."""
    ms = stats.get("ms_mean", math.nan) - b.buckets_ms.get("optimizer + grad buffers", 0.0)
    flop = stats.get("tflop_per_iter_megatron", math.nan)
    return f"{ms:.1f}; {flop / ms * 1000:.1f}" if ms > 0 else "-"


def summary_lines(results: list[VariantResult], skip: int) -> list[str]:
    """A few lines per variant for the end of the output (gpu_checks shows the log's tail)."""
    stats = {r.variant.name: r.stats(skip) for r in results}
    base = stats.get(baseline(stats), {}).get("ms_mean", math.nan)
    lines = []
    for r in results:
        s = stats[r.variant.name]
        if r.main is None or not r.main.ok:
            lines.append(f"[bench_step] {r.variant.name}: FAILED: {r.main.error if r.main else 'not run'}")
            continue
        lines.append(f"[bench_step] {r.variant.name}: {s['ms_mean']:.1f} +- {s['ms_std']:.1f} ms/iteration, "
                     f"{s['tokens_per_s']:.0f} tokens/s, {s['tflops_megatron']:.1f} TFLOP/s (Megatron) / "
                     f"{s['tflops_ours']:.1f} (ours), peak {_f(s['peak_gib'], '.2f')} GiB, "
                     f"{_f(base / s['ms_mean'], '.2f')}x vs {baseline(stats)}")
        b = r.breakdown
        if b is not None:
            lines.append(f"[bench_step] {r.variant.name} GPU ms/step: " + ", ".join(
                f"{k} {v:.1f}" for k, v in b.buckets_ms.items()) + f"; busy {b.busy_ms:.1f}, host gaps "
                f"{_f(s['ms_mean'] - b.busy_ms)} (profiled step {b.host_gap_ms:.1f})")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated, from {list(VARIANTS)} (default {DEFAULT_VARIANTS})")
    p.add_argument("--iters", type=int, default=12, help="training iterations per variant (default 12)")
    p.add_argument("--skip", type=int, default=3, help="iterations left out of the averages (default 3)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 8192; --cpu-check: 512)")
    p.add_argument("--extra-args", default="",
                   help="appended to every run's pretrain_gpt.py flags, one shell-quoted string; write it "
                        "--extra-args=--moe-grouped-gemm (a lone flag after a space reads as an option)")
    p.add_argument("--profile-step", type=int, default=5, help="iteration the profiled run records (default 5)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    p.add_argument("--host-timers", action="store_true",
                   help="time Megatron's step phases on the host in the timed runs (scripts/bench/host_timers.py)")
    p.add_argument("--profile-variants", default=None,
                   help="comma-separated subset of --variants that get a profiled run (default: all of them)")
    p.add_argument("--out", default="bench_step.md",
                   help="markdown report (rewritten after each run; a .json with the raw numbers next to it); "
                        "logs and traces go to its folder")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    p.add_argument("--mlm", default=str(REPO / ".mlm"), help="folder with Megatron-LM's pretrain_gpt.py (default .mlm)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--dry-run", action="store_true", help="print the commands and the FLOP count, run nothing")
    p.add_argument("--cpu-check", action="store_true",
                   help="no GPU: run the client's check_args_cpu.py on each variant's flags instead")
    p.add_argument("--scale-down", action="store_true",
                   help="debug: hidden 1024, FFN 2048, q_lora 256, top-k 256, expert widths 256 (same structure)")
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or not args.variant_list:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.profile_list = (args.variant_list if args.profile_variants is None
                         else [v.strip() for v in args.profile_variants.split(",") if v.strip()])
    if not set(args.profile_list) <= set(args.variant_list):
        p.error(f"--profile-variants {args.profile_list} must be among --variants {args.variant_list}")
    if args.seq is None:
        args.seq = 512 if args.cpu_check else 8192
    if not 0 <= args.skip < args.iters:
        p.error("--skip must be in [0, --iters)")
    args.extra = shlex.split(args.extra_args)
    args.mlm = Path(args.mlm).resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    log_dir = out.parent
    results = []
    for name in args.variant_list:
        v = VARIANTS[name]
        vargv = pretrain_argv(v, seq=args.seq, iters=args.iters, scale_down=args.scale_down, extra=args.extra)
        results.append(VariantResult(v, vargv, shape_from_argv(vargv)))
    flops = flop_count(results[0].shape)

    if args.dry_run:
        print(f"# slice: {results[0].shape.summary()}")
        print(f"# FLOP per iteration, our count: {sum(flops.values()) / 1e12:.2f} T: "
              + ", ".join(f"{k} {x / 1e12:.2f}" for k, x in flops.items()))
        print(f"# env: PYTHONPATH={REPO}:{args.mlm}:$PYTHONPATH CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1, "
              f"a `make` stand-in first on PATH (see _MAKE_SHIM); cwd {REPO}; logs in {log_dir}")
        for r in results:
            print(f"\n# {r.variant.name}: {r.variant.description}")
            print(shlex.join(torchrun_cmd(args.python, args.mlm, 29500, r.argv)))
            if not args.no_profile and r.variant.name in args.profile_list:
                pargv = pretrain_argv(r.variant, seq=args.seq, iters=args.iters, scale_down=args.scale_down,
                                      extra=args.extra, profile_step=args.profile_step,
                                      tb_dir=log_dir / f"bench_step_{r.variant.name}_prof" / "tb")
                print(shlex.join(torchrun_cmd(args.python, args.mlm, 29501, pargv)))
        return 0

    for f in (("pretrain_gpt.py",) if not args.cpu_check else ("pretrain_gpt.py", "check_args_cpu.py")):
        if not (args.mlm / f).exists():
            print(f"bench_step: {args.mlm / f} is missing: copy Megatron-LM's client there first "
                  f"(cp -r ../shared/clients/megatron_lm {REPO / '.mlm'}), or pass --mlm", file=sys.stderr)
            return 2
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    shim = make_shim()
    env = run_env(args.mlm, shim)
    if args.cpu_check:
        env.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit_fuser is torch.compile: slow on CPU
    failures: list[str] = []
    try:
        if args.cpu_check:
            for r in results:
                res = cpu_check(r, args, env, log_dir)
                if not res.ok:
                    failures.append(res.error)
        else:
            probe = environment(args.python, env)
            meta = {
                "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": git_commit(),
                "gpu": probe.get("gpu", "?"), "iters": args.iters, "profile_step": args.profile_step,
                "command": "python3 scripts/bench/bench_step.py "
                + shlex.join(argv if argv is not None else sys.argv[1:]),
                "versions": ", ".join(f"{k} {v}" for k, v in probe.items() if k != "gpu")
                + "".join(f", {k}={os.environ[k]}" for k in ("TORCHDYNAMO_DISABLE",) if k in os.environ),
                "extra": f", extra flags `{shlex.join(args.extra)}`" if args.extra else "",
            }

            def write():
                out.write_text(render_report(results, skip=args.skip, meta=meta))
                raw = [{"variant": r.variant.name, "argv": r.argv, "stats": r.stats(args.skip),
                        "main": asdict(r.main) if r.main else None, "profile": asdict(r.profile) if r.profile else None,
                        "breakdown": asdict(r.breakdown) if r.breakdown else None, "trace": r.trace_path}
                       for r in results]
                out.with_suffix(".json").write_text(json.dumps({"meta": meta, "flops": flops, "runs": raw}, indent=1,
                                                               default=str))

            for r in results:  # the timed runs first: a time limit from outside then costs profiles, not numbers
                run_variant_main(r, args, env, log_dir)
                write()
            if not args.no_profile:
                for r in results:
                    if r.variant.name not in args.profile_list:
                        continue
                    if r.main is not None and r.main.ok:  # a failed timed run would fail its profile too
                        run_variant_profile(r, args, env, log_dir)
                        write()
            for r in results:
                for run in (r.main, r.profile):
                    if run is not None and not run.ok:
                        failures.append(run.error)
            print(out.read_text())
            print("\n".join(summary_lines(results, args.skip)))
            print(f"[bench_step] report: {out}")
    finally:
        shutil.rmtree(shim, ignore_errors=True)
    for msg in failures:
        print(f"bench_step: FAILED: {msg}", file=sys.stderr)
    for r in results:  # the root cause of each failed run, else the end of its log
        for run in (r.main, r.profile):
            if run is None or run.ok:
                continue
            shown = run.log.traceback or Path(run.log_path).read_text(errors="replace").splitlines()[-25:]
            print(f"--- {r.variant.name}, {run.kind} run ({run.log_path}):\n" + "\n".join(shown), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
