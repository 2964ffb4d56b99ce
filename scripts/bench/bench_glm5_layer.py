"""Benchmark (c): one full GLM-5 attention layer (real dims, 16 heads per rank = GLM-5 at TP=4), 16K tokens, bf16,
forward + backward on one GPU: our ``tilelang`` backend vs our ``megatron`` backend (megatron-core modules with its
TileLang kernels, ``mcore_dsa_kernels="tilelang"``) vs megatron-core's own DSA layer as built by its spec (the
baseline of shared/baselines/glm5_layer_mcore.py). Each model is a 1-layer GPTModel with a small dense MLP and a
1024-token vocabulary, as in that baseline, so the attention layer dominates.

    python scripts/bench/bench_glm5_layer.py [--seq 16384] [--heads 16] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess

import torch
from report import emit


def _glm5_layer_config(heads: int) -> dict:
    from megatron_glm5.testing import tiny_glm5_config

    return tiny_glm5_config(
        vocab_size=1024, hidden_size=6144, intermediate_size=256, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256, v_head_dim=256, head_dim=64,
        index_n_heads=32, index_head_dim=128, index_topk=2048, num_nextn_predict_layers=0, dtype="bfloat16",
        max_position_embeddings=65536,
    )


def _ours(backend: str, heads: int):
    from megatron_glm5.config import RuntimePolicy, parse_hf_config
    from megatron_glm5.model import build_model

    policy = RuntimePolicy(params_dtype=torch.bfloat16, use_cpu_initialization=False,
                           mcore_dsa_kernels="tilelang" if backend == "megatron" and torch.cuda.is_available() else "none")
    return build_model(parse_hf_config(_glm5_layer_config(heads)), policy, backend=backend).cuda()


def _mcore_baseline(heads: int, **policy_overrides):
    """megatron-core's AbsorbedMLA + DSAttention from its own layer-spec builder (local modules, no TE)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.post_training.modelopt.layers import Linear as DupLinear
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_glm5.config import RuntimePolicy, build_transformer_config, parse_hf_config

    class Provider(LocalSpecProvider):
        def linear(self):
            return DupLinear

    if absorbed_mla.TELinear is None:  # benchmark-only: how megatron-core's own layer is built without TE
        absorbed_mla.TELinear = DupLinear
    arch = parse_hf_config(_glm5_layer_config(heads))
    kernels = "tilelang" if torch.cuda.is_available() else "none"
    cfg = build_transformer_config(arch, RuntimePolicy(params_dtype=torch.bfloat16, mcore_dsa_kernels=kernels,
                                                       **policy_overrides))
    cfg.transformer_impl = "local"
    prov = Provider()
    specs = get_transformer_layer_with_experimental_attention_variant_spec(config=cfg, backend=prov)
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=prov.layer_norm(rms_norm=True, for_qk=False))
    return GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=1024, max_sequence_length=65536,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False).cuda()


def measure(build, seq: int, heads: int) -> tuple[float, float]:
    import triton.testing as tt

    torch.manual_seed(0)
    model = build(heads)
    ids = torch.randint(0, 1024, (1, seq), device="cuda")
    pos = torch.arange(seq, device="cuda")[None]

    def step():
        model(ids, pos, None, labels=ids).float().mean().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = tt.do_bench(step, warmup=2, rep=10)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    del model
    torch.cuda.empty_cache()
    return ms, peak


def _ours_per_query(heads: int):
    """The ``tilelang`` backend with ``MEGATRON_GLM5_GROUPED_SPARSE_MLA=0``: the per-query sparse-MLA kernels only
    (the grouped route is the default; the variable is read when the attention is built)."""
    from megatron_glm5.fusions import GROUPED_SPARSE_MLA_ENV

    old = os.environ.get(GROUPED_SPARSE_MLA_ENV)
    os.environ[GROUPED_SPARSE_MLA_ENV] = "0"
    try:
        return _ours("tilelang", heads)
    finally:
        if old is None:
            del os.environ[GROUPED_SPARSE_MLA_ENV]
        else:
            os.environ[GROUPED_SPARSE_MLA_ENV] = old


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel()
    rows = []
    for name, build in (
        ("megatron-core 0.19.2 DSA layer (its spec, TileLang kernels)", _mcore_baseline),
        ("megatron-glm5 `megatron` backend (mcore TileLang kernels)", lambda h: _ours("megatron", h)),
        ("megatron-glm5 `tilelang` backend (our kernels, the default routes)", lambda h: _ours("tilelang", h)),
        ("megatron-glm5 `tilelang` backend, per-query sparse MLA only", _ours_per_query),
    ):
        try:
            ms, peak = measure(build, args.seq, args.heads)
            rows.append((name, f"{ms:.1f}", f"{peak:.2f}", ms))
        except Exception as e:  # keep going: report what failed
            rows.append((name, f"FAILED: {type(e).__name__}: {str(e)[:200]}", "-", None))
        print(rows[-1][:3], flush=True)
    base = rows[0][3]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"## One GLM-5 attention layer fwd+bwd ({datetime.date.today()}, commit {commit or 'n/a'}, "
        f"{torch.cuda.get_device_name(0)})",
        "",
        f"hidden 6144, {args.heads} heads per rank, q_lora 2048, kv_lora 512, rope 64, v 256, indexer 32x128, "
        f"top-k 2048, {args.seq} tokens, bf16, 1-layer GPTModel (dense MLP 256, vocab 1024).",
        "",
        "| implementation | fwd+bwd ms | peak extra GB | speed-up vs megatron-core |",
        "|---|---|---|---|",
    ]
    for name, ms_s, peak, ms in rows:
        ratio = f"{base / ms:.2f}x" if base and ms else "-"
        lines.append(f"| {name} | {ms_s} | {peak} | {ratio} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
