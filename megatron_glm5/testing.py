"""Tiny offline GLM-5.x HF checkpoints for tests, benchmarks and the demo (no network, deterministic).

Three flavours, all written in the on-disk layout of the real releases (sharded safetensors + index + config.json):

* :func:`tiny_glm5_config` - GLM-5-like: dense first layer, MoE layers, every layer with an indexer, one MTP layer.
* :func:`tiny_glm52_config` - GLM-5.2-like IndexShare: explicit ``indexer_types`` with shared layers (no indexer
  tensors on disk), rope_theta 8e6, fp32 router dtype, ``head_dim`` set to a misleading value like the real file.
* ``write_hf_checkpoint(..., fp8=True)`` - like the ``-FP8`` releases: e4m3 weights with fp32 ``weight_scale_inv``
  per 128x128 block and a ``quantization_config``; norms, embeddings, the router and the indexer ``weights_proj``
  stay unquantised.

Sizes keep ``index_topk`` (16) well below test sequence lengths (48-128) so DSA is really sparse, and use 8 indexer
heads so top-k boundaries do not fall into the exact-zero ReLU plateau: with few heads many keys score exactly 0
and which tied key is kept depends on the top-k implementation, not on the math.

Tensor names come from transformers' own ``GlmMoeDsaForCausalLM`` (instantiated on the meta device); MTP tensors,
which transformers neither builds nor saves, are added with the names the real checkpoints use
(``model.layers.{N+k}.{enorm,hnorm,eh_proj,shared_head.norm}`` plus a full decoder layer with its own indexer).
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from .core.hf_config import natural_key

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_BASE: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 48,
    "v_head_dim": 32,
    "head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": [1, 2],
    "pad_token_id": 1,
    "dtype": "float32",
    "use_cache": True,
}


def tiny_glm5_config(**overrides: Any) -> dict[str, Any]:
    """A GLM-5-shaped config.json dict at toy size (3 layers: 1 dense + 2 MoE, all with indexers, 1 MTP)."""
    cfg = copy.deepcopy(_BASE)
    cfg.update(overrides)
    return cfg


def tiny_glm52_config(**overrides: Any) -> dict[str, Any]:
    """A GLM-5.2-shaped config at toy size: 4 layers, IndexShare ``[full, shared, full, shared]`` (a PP=2 split
    2+2 starts both stages on a full layer), rope_theta 8e6, fp32 router, and the misleading ``head_dim``
    (GLM-5.2 ships ``head_dim: 192`` while its rope width is 64) set to 48 here."""
    cfg = copy.deepcopy(_BASE)
    cfg.update(
        num_hidden_layers=4,
        head_dim=48,
        rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
        index_topk_freq=2,
        index_skip_topk_offset=1,
        index_topk_pattern=None,
        indexer_types=["full", "shared", "full", "shared"],
        index_share_for_mtp_iteration=True,
        moe_router_dtype="float32",
        max_position_embeddings=1048576,
    )
    cfg.update(overrides)
    return cfg


def small_glm52_config(**overrides: Any) -> dict[str, Any]:
    """A GPU-sized GLM-5.2 toy with the real MLA latent geometry (kv_lora_rank 512 + rope 64 = 576, so fused
    sparse-MLA kernels apply; qk 192 + 64 so the softmax scale is GLM-5's 1/16) and ``index_topk`` 256 (a multiple
    of 64): 4 layers [full, shared, full, shared],
    hidden 1024, 16 heads, 8 experts top-2, MTP 1, vocab 4096. Used by the examples and GPU checks."""
    cfg = tiny_glm52_config(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        qk_head_dim=256,
        v_head_dim=128,
        head_dim=192,
        index_n_heads=8,
        index_head_dim=128,
        index_topk=256,
        dtype="bfloat16",
    )
    cfg.update(overrides)
    return cfg


# --------------------------------------------------------------------------------------------------------------------
# Tensor names and random values
# --------------------------------------------------------------------------------------------------------------------


def _hf_model_shapes(raw: Mapping[str, Any]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Names/shapes of transformers' in-memory GlmMoeDsaForCausalLM (fused 3D experts), built on meta."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg_kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "dtype", "model_type")}
    hf_cfg = GlmMoeDsaConfig(**cfg_kwargs)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(hf_cfg)
    out = {n: (p.shape, p.dtype) for n, p in model.state_dict().items()}
    return out


def _mtp_shapes(raw: Mapping[str, Any], shapes: Mapping[str, tuple[torch.Size, torch.dtype]]):
    """MTP layer k is stored as ``model.layers.{N+k}``: a full MoE decoder layer with its own indexer (copied from
    the last layer's shapes, indexer added from a full layer) plus enorm / hnorm / eh_proj / shared_head.norm."""
    n = raw["num_hidden_layers"]
    h = raw["hidden_size"]
    last = f"model.layers.{n - 1}."
    full_layer = next(
        i for i, t in enumerate(_indexer_types(raw)) if t == "full"
    )
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for k in range(raw.get("num_nextn_predict_layers", 0) or 0):
        pre = f"model.layers.{n + k}."
        for name, sd in shapes.items():
            if name.startswith(last) and ".indexer." not in name:
                out[pre + name[len(last):]] = sd
            full_pre = f"model.layers.{full_layer}.self_attn.indexer."
            if name.startswith(full_pre):
                out[pre + "self_attn.indexer." + name[len(full_pre):]] = sd
        out[pre + "enorm.weight"] = (torch.Size([h]), torch.float32)
        out[pre + "hnorm.weight"] = (torch.Size([h]), torch.float32)
        out[pre + "eh_proj.weight"] = (torch.Size([h, 2 * h]), torch.float32)
        out[pre + "shared_head.norm.weight"] = (torch.Size([h]), torch.float32)
    return out


def _indexer_types(raw: Mapping[str, Any]) -> list[str]:
    from .glm5.config import resolve_indexer_types

    return list(resolve_indexer_types(raw, raw["num_hidden_layers"]))


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Values at a scale where activations stay O(1): linear weights ~ N(0, 1/fan_in), norm weights ~ 1 +- 0.1,
    biases small, the expert-score bias positive and offset like the real GLM-5.2 values (~7)."""
    if name.endswith("e_score_correction_bias"):
        return 7.0 + 0.05 * torch.rand(shape, generator=gen)
    if name.endswith("k_norm.bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if len(shape) == 1:  # RMSNorm / LayerNorm weights
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def make_hf_state_dict(
    raw: Mapping[str, Any],
    *,
    seed: int = 0,
    expert_layout: Literal["per_expert", "fused"] = "per_expert",
) -> dict[str, torch.Tensor]:
    """Random fp32 weights under HF checkpoint names, MTP included. ``per_expert`` is the released safetensors
    layout (``mlp.experts.{e}.{gate,up,down}_proj.weight``); ``fused`` is transformers v5's in-memory one
    (``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I])."""
    shapes = _hf_model_shapes(raw)
    shapes.update(_mtp_shapes(raw, shapes))
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name in sorted(shapes, key=natural_key):
        shape, _ = shapes[name]
        sd[name] = _random_tensor(name, shape, gen).to(torch.float32).contiguous()
    if expert_layout == "per_expert":
        sd = fused_to_per_expert(sd)
    elif expert_layout != "fused":
        raise ValueError(f"expert_layout: expected 'per_expert' or 'fused', got {expert_layout!r}")
    return sd


_FUSED_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def fused_to_per_expert(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split transformers-v5 fused expert tensors into the per-expert names of the released checkpoints."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = _FUSED_RE.match(name)
        if m is None:
            out[name] = t
            continue
        pre = m["pre"]
        for e in range(t.shape[0]):
            if m["kind"] == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{pre}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{pre}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{pre}.{e}.down_proj.weight"] = t[e].contiguous()
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


# --------------------------------------------------------------------------------------------------------------------
# Block FP8 (e4m3 + weight_scale_inv per 128x128 block)
# --------------------------------------------------------------------------------------------------------------------

_FP8_SKIP = re.compile(
    r"(embed_tokens|lm_head|norm|\.gate\.weight|e_score_correction_bias|weights_proj|eh_proj|layernorm|k_norm)"
)


def is_fp8_quantized_name(name: str) -> bool:
    """Which weights the -FP8 releases store in e4m3: the 2D linear weights of attention, indexer (wq_b, wk) and
    MLPs/experts. Embeddings, norms, the router, the indexer ``weights_proj`` and the MTP ``eh_proj`` stay bf16."""
    return name.endswith(".weight") and _FP8_SKIP.search(name) is None


def quantize_block_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax quantisation to float8_e4m3fn; returns (q, scale_inv) with ``w ~= q * scale_inv``."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(br * block, bc * block, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(br, block, bc, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX  # [br, bc]
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(br * block, bc * block)[:rows, :cols].contiguous()
    return q, scale_inv.to(torch.float32).contiguous()


def to_block_fp8_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if t.ndim == 2 and is_fp8_quantized_name(name):
            q, s = quantize_block_fp8(t)
            out[name] = q
            out[name[: -len("weight")] + "weight_scale_inv"] = s
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.to(torch.float32)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


# --------------------------------------------------------------------------------------------------------------------
# Writing a checkpoint directory
# --------------------------------------------------------------------------------------------------------------------


def write_hf_checkpoint(
    out_dir: str | Path,
    raw_config: Mapping[str, Any],
    *,
    seed: int = 0,
    expert_layout: Literal["per_expert", "fused"] = "per_expert",
    fp8: bool = False,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 1 << 20,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a random GLM-5.x HF checkpoint: ``config.json``, ``generation_config.json``, a few
    ``model-0000X-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` and ``model.safetensors.index.json``.
    ``dtype`` applies to non-FP8 tensors; ``e_score_correction_bias`` is always fp32 (as released)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(raw_config)
    sd = dict(state_dict) if state_dict is not None else make_hf_state_dict(raw, seed=seed, expert_layout=expert_layout)
    if fp8:
        sd = to_block_fp8_state_dict(sd)
        raw["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        raw["dtype"] = "bfloat16"
    else:
        sd = {n: (t if n.endswith("e_score_correction_bias") else t.to(dtype)) for n, t in sd.items()}
        raw["dtype"] = str(dtype).removeprefix("torch.")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"_from_model_config": True, "bos_token_id": raw.get("bos_token_id"), "eos_token_id": raw.get("eos_token_id"),
               "pad_token_id": raw.get("pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


def load_hf_reference_model(hf_dir: str | Path, *, dtype: torch.dtype = torch.float32):
    """transformers' ``GlmMoeDsaForCausalLM`` from a checkpoint written here (MTP tensors are ignored by HF)."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, experts_implementation="eager")
    model.eval()
    return model


def match_norm_eps(hf_model) -> None:
    """Give transformers' ``q_a_layernorm`` / ``kv_a_layernorm`` the config's ``rms_norm_eps``: transformers hard-codes
    1e-6 there while megatron-core, sglang and vLLM use ``rms_norm_eps`` (1e-5). With matched eps the two
    implementations agree to ~1e-6 in fp32, so parity tests can bound differences near 1e-5."""
    eps = hf_model.config.rms_norm_eps
    for layer in hf_model.model.layers:
        layer.self_attn.q_a_layernorm.variance_epsilon = eps
        layer.self_attn.kv_a_layernorm.variance_epsilon = eps


def write_transformers_checkpoint(
    out_dir: str | Path,
    raw_config: Mapping[str, Any],
    *,
    seed: int = 0,
    max_shard_size: str = "400KB",
) -> Path:
    """A GLM-5.x checkpoint written by the installed transformers itself: ``GlmMoeDsaConfig`` from the config's
    fields that transformers knows (plus ``num_nextn_predict_layers``, which it keeps from a loaded release),
    ``GlmMoeDsaForCausalLM.save_pretrained`` of a model holding :func:`make_hf_state_dict`'s values, and then the MTP
    layer's tensors, which transformers neither builds nor saves, added as one more shard listed in the index, the
    way the releases ship them. So ``config.json`` lacks ``rope_interleave`` / ``indexer_rope_interleave`` and has
    ``layer_types`` / ``mlp_layer_types`` / ``head_dim``, exactly as transformers writes it."""
    from safetensors.torch import save_file
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    out = Path(out_dir)
    known = set(GlmMoeDsaConfig().to_dict())
    kwargs = {k: v for k, v in raw_config.items() if k in known and k not in ("architectures", "dtype", "model_type")}
    mtp = raw_config.get("num_nextn_predict_layers", 0) or 0
    config = GlmMoeDsaConfig(**kwargs, num_nextn_predict_layers=mtp)
    sd = make_hf_state_dict(raw_config, seed=seed, expert_layout="fused")
    n = raw_config["num_hidden_layers"]
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config)
    in_model = set(model.state_dict())
    model.load_state_dict({k: v for k, v in sd.items() if k in in_model}, strict=True, assign=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    extra = fused_to_per_expert({k: v for k, v in sd.items() if k not in in_model})
    assert all(int(k.split(".")[2]) >= n for k in extra), "only MTP tensors are outside transformers' model"
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # a single model.safetensors: becomes shard 1 of 2
        (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
        index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors"
                                               for k in in_model}}
    files = sorted(set(index["weight_map"].values()))
    total = len(files) + (1 if extra else 0)
    renamed = {f: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    weight_map = {k: renamed[f] for k, f in index["weight_map"].items()}
    if extra:
        name = f"model-{total:05d}-of-{total:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in extra.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in extra})
    index["weight_map"] = dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return out
