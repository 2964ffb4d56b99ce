"""Tiny offline GLM-5.3-Flash checkpoints written by transformers itself (tests, the demo, GPU checks).

:func:`write_transformers_checkpoint` builds transformers 5.24's ``Glm5NextForConditionalGeneration`` (text model and
a tiny vision tower), gives every parameter a random value at an O(1)-activation scale (transformers' own init starts
the KPool gate / ape, ``A_log`` and the mHC ``base`` at constants, which would leave them untested), saves it with
``save_pretrained`` - so the files carry transformers' on-disk names (``hc_attn_fn``, ``q_conv1d``, ``f_a_proj``, per
expert tensors) and its ``config.json`` - and adds what transformers neither builds nor saves: the MTP layer
(``layers.{N}``: ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` and a plain NoPE-DSA + MoE layer) as one
more shard, and ``num_nextn_predict_layers`` in the text config.

:func:`tiny_flash_config` keeps ``index_topk`` (16, pools of 4) well below test sequence lengths, so DSA is sparse,
and puts every kind of layer in four: KDA + dense MLP, full DSA + MoE, shared DSA + MoE (right after a full one, the
only place transformers can run a shared layer), KDA + MoE.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch

TINY_TEXT: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=0,
    v_head_dim=12, index_topk=16, index_head_dim=16, index_n_heads=8, index_kpool=4, linear_head_dim=8,
    linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0,
    rms_norm_eps=1e-5, pad_token_id=0, num_nextn_predict_layers=1,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full", "full", "shared", "full"],
)
TINY_VISION: dict[str, Any] = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                                   projection_intermediate_size=48, patch_size=2, spatial_merge_size=2,
                                   temporal_patch_size=2)


def tiny_flash_config(**text_overrides: Any) -> dict[str, Any]:
    """``{"text_config": ..., "vision_config": ...}`` kwargs for transformers' ``Glm5NextConfig`` (not yet a
    ``config.json``: :func:`write_transformers_checkpoint` writes the one transformers makes of it)."""
    text = copy.deepcopy(TINY_TEXT)
    text.update(text_overrides)
    return {"text_config": text, "vision_config": copy.deepcopy(TINY_VISION)}


def small_flash_config(**text_overrides: Any) -> dict[str, Any]:
    """A GLM-5.3-Flash-shaped model for GPU runs: the real head geometry (q/k/v 256, latent 512, KDA heads 128 wide,
    ``index_topk`` 256 with pools of 4, ``hc_mult`` 4) at hidden 1024, 8 layers (6 KDA, 2 DSA), 16 experts, MTP 1."""
    text = dict(
        vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=256,
        qk_rope_head_dim=0, v_head_dim=256, index_topk=256, index_head_dim=128, index_n_heads=8, index_kpool=4,
        linear_head_dim=128, linear_num_heads=8, linear_conv_kernel_dim=4, hc_mult=4, swiglu_limit=10.0,
        pad_token_id=0, num_nextn_predict_layers=1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"] * 2,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
    )
    text.update(text_overrides)
    return {"text_config": text, "vision_config": copy.deepcopy(TINY_VISION)}


def tie_prone_flash_config(**text_overrides: Any) -> dict[str, Any]:
    """An 8-layer GLM-5.3-Flash for parity and replay tests whose indexers *tie* on many inputs: KDA / full DSA /
    shared DSA / full DSA twice (so shared layers follow full ones, and full layers follow KDA ones), dense then MoE,
    ``index_topk`` 8 with pools of 4 (2 pools + the tail), and only 4 indexer heads. A pool scores exactly 0 when
    every head's ReLU is 0; with 4 heads, rows whose 2nd and 3rd best pools both score 0 are common (measured: 11 of
    12 random 64-token inputs have at least one such row in some layer), and there ``torch.topk`` (transformers)
    and our stable sort keep different pools: the logits then differ by O(1) between two correct implementations,
    and only replaying transformers' choices makes a 1e-5 comparison possible.

    ``linear_lower_bound`` -1 (the released model: -5) keeps the fp32 noise floor of the comparison below 1e-5:
    KDA's chunked form with decays down to ``exp(-5)`` per token loses more accuracy in fp32 (our chunk against the
    fp64 recurrence on random inputs: 6e-7..1.2e-6 with -5, 1.5e-7..3e-7 with -1), which 8 random layers amplify: with
    -5 some inputs' replayed logits differ from transformers' by 2.6e-5 relative (no choice differing), with -1 every
    input stays below 8e-6."""
    kda, dsa = "linear_attention", "indexed_attention"
    text = dict(num_hidden_layers=8, index_topk=8, index_kpool=4, index_n_heads=4, linear_lower_bound=-1.0,
                layer_types=[kda, dsa, dsa, dsa] * 2, mlp_layer_types=["dense"] + ["sparse"] * 7,
                indexer_types=["full", "full", "shared", "full"] * 2)
    text.update(text_overrides)
    return tiny_flash_config(**text)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random: 2-D+ weights ~ N(0, 1/fan_in) (KPool gate / ape ~ N(0, 1)), norm weights 1 +- 0.1,
    other vectors (mHC ``base`` / ``scale``, ``A_log``, ``dt_bias``, biases) small around their init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "compress" in name:
                v = r
            elif p.ndim == 1:
                center = 1.0 if name.endswith(("weight", "scale")) else 0.0
                v = center + 0.1 * r
            else:
                v = r / math.sqrt(p.shape[-1])
            p.copy_(v.to(p.dtype))


def _mtp_tensors(text: Mapping[str, Any], dsa_layer: Mapping[str, torch.Tensor], gen: torch.Generator,
                 prefix: str) -> dict[str, torch.Tensor]:
    """MTP layer ``k`` (``layers.{N + k}``): the tensors of a full-indexer DSA + MoE layer without mHC (copied in
    shape from ``dsa_layer``, values fresh) plus ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``."""
    n, h = text["num_hidden_layers"], text["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for k in range(text.get("num_nextn_predict_layers", 0) or 0):
        pre = f"{prefix}layers.{n + k}."
        for rel, t in dsa_layer.items():
            if rel.startswith(("hc_", "attn_hc.", "ffn_hc.")):  # MTP layers have no mHC
                continue
            r = torch.randn(t.shape, generator=gen)
            if "compress" in rel:
                v = r
            elif t.ndim == 1:
                v = (1.0 if rel.endswith("weight") else 0.0) + 0.1 * r
            else:
                v = r / math.sqrt(t.shape[-1])
            out[pre + rel] = v.to(t.dtype)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[pre + f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        out[pre + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
    return out


def write_transformers_checkpoint(out_dir: str | Path, config: Mapping[str, Any] | None = None, *, seed: int = 0,
                                  dtype: torch.dtype = torch.float32, max_shard_size: str = "400KB",
                                  naming: str = "disk") -> Path:
    """A tiny GLM-5.3-Flash checkpoint written by transformers (module docstring), plus the MTP layer. ``config`` is
    :func:`tiny_flash_config`'s form (default: it). ``naming="disk"``: ``save_pretrained``'s files (transformers'
    on-disk names, per-expert tensors, sharded); ``"memory"``: the model's ``state_dict()`` as is (in-memory module
    names, fused 3-D experts), one shard, with the ``config.json`` transformers writes."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from ..core.hf_config import natural_key

    if naming not in ("disk", "memory"):
        raise ValueError(f"naming: expected 'disk' or 'memory', got {naming!r}")
    config = copy.deepcopy(dict(config or tiny_flash_config()))
    text = dict(config["text_config"])
    mtp = text.pop("num_nextn_predict_layers", 0) or 0
    hf_config = Glm5NextConfig(text_config=text, vision_config=config.get("vision_config"))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(hf_config)
    randomize(model, seed)
    model = model.to(dtype)
    out = Path(out_dir)
    index_path = out / "model.safetensors.index.json"
    if naming == "disk":
        model.save_pretrained(out, max_shard_size=max_shard_size)
        if not index_path.is_file():  # one file: becomes shard 1 of an index
            (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
            names = load_file(out / "model-00001-of-00001.safetensors").keys()
            index_path.write_text(json.dumps({"metadata": {}, "weight_map": {
                n: "model-00001-of-00001.safetensors" for n in names}}))
    else:
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
        shard = "model-00001-of-00001.safetensors"
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, str(out / shard), metadata={"format": "pt"})
        index_path.write_text(json.dumps({"metadata": {}, "weight_map": {n: shard for n in sd}}))
    cfg_path = out / "config.json"
    raw = json.loads(cfg_path.read_text())
    if not mtp:
        return out
    raw["text_config"]["num_nextn_predict_layers"] = mtp
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    index = json.loads(index_path.read_text())
    prefix = "model.language_model."
    kinds = text.get("indexer_types") or ["full"] * len(text["layer_types"])
    dsa = next(i for i, t in enumerate(text["layer_types"]) if t == "indexed_attention" and kinds[i] == "full"
               and text["mlp_layer_types"][i] == "sparse")
    layer_pre = f"{prefix}layers.{dsa}."
    files = sorted(set(index["weight_map"].values()))
    dsa_layer: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(out / f).items():
            if name.startswith(layer_pre):
                dsa_layer[name[len(layer_pre):]] = t
    extra = _mtp_tensors({**text, "num_nextn_predict_layers": mtp}, dsa_layer,
                         torch.Generator().manual_seed(seed + 1), prefix)
    extra = {k: v.to(dtype).contiguous() for k, v in extra.items()}
    total = len(files) + 1
    renamed = {f: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    weight_map = {k: renamed[f] for k, f in index["weight_map"].items()}
    last = f"model-{total:05d}-of-{total:05d}.safetensors"
    save_file(extra, str(out / last), metadata={"format": "pt"})
    weight_map.update({k: last for k in extra})
    index["weight_map"] = dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return out


@torch.no_grad()
def transformers_choices(hf, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits ``[1, S, V]`` for one sequence ``input_ids [S]`` and the choices it made, as a rollout
    engine reports them (:mod:`megatron_glm5.rl.payload`, layer-major arrays): ``indexer_topk`` int32
    ``[N, S, index_topk + P - 1]`` (full DSA layers: their KPool rows; shared layers: their source's; KDA layers: -1)
    and ``routed_experts`` int32 ``[N, S, num_experts_per_tok]`` (dense layers -1), recorded with forward hooks on
    each ``self_attn.indexer`` and ``mlp.gate``."""
    text = hf.model.language_model
    cfg = text.config
    n, s = cfg.num_hidden_layers, input_ids.shape[-1]
    width = cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail else 0)
    topk = torch.full((n, s, width), -1, dtype=torch.int32)
    experts = torch.full((n, s, cfg.num_experts_per_tok), -1, dtype=torch.int32)
    hooks = []
    for i, layer in enumerate(text.layers):
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(lambda m, a, out, i=i: topk.__setitem__(i, out[0].cpu())))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda m, a, out, i=i: experts.__setitem__(i, out[2].cpu())))
    try:
        logits = hf(input_ids=input_ids.reshape(1, -1)).logits
    finally:
        for h in hooks:
            h.remove()
    source = None
    for i, (kind, indexer) in enumerate(zip(cfg.layer_types, cfg.indexer_types)):
        if kind != "indexed_attention":
            continue
        if indexer == "full":
            source = i
        elif source is not None:
            topk[i] = topk[source]
    return logits, {"indexer_topk": topk, "routed_experts": experts}


def load_hf_reference_model(hf_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                            attn_implementation: str = "eager"):
    """transformers' ``Glm5NextForConditionalGeneration`` from ``hf_dir`` (its loader drops the MTP layer)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(str(hf_dir), dtype=dtype,
                                                             attn_implementation=attn_implementation,
                                                             experts_implementation="eager")
    return model.eval()
