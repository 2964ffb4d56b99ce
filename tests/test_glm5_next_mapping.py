"""The GLM-5.3-Flash bridge table (``bridge.glm5_next_mapping``) against both sides' real parameter sets.

* HF: transformers' own ``Glm5NextForConditionalGeneration`` built on the meta device (tiny hybrid config: KDA and
  DSA layers, full and shared indexers, dense and MoE MLPs; and the full-size released geometry): the table's HF
  names and shapes are exactly the model's text tensors minus the parts later steps add (KDA attention, mHC), and
  those parts are all that is left.
* Megatron: a ``GPTModel`` built from our block spec (DSA-only tiny config) has exactly the table's megatron names
  and shapes; the per-expert (released) layout reads one tensor per expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bridge.glm5_next_mapping import expand_glm5_next, is_unmapped, layer_kinds
from megatron_glm5.glm5_next.config import parse_glm5_next_config
from tests.glm5_next_fixtures import tiny_raw

RELEASED = json.loads((Path(__file__).parent / "data" / "glm5_3_flash_config.json").read_text())
HYBRID = tiny_raw(
    num_hidden_layers=8,
    layer_types=None,  # transformers' default: DSA at layers 3 and 7, KDA elsewhere
    mlp_layer_types=None,  # 3 dense, then MoE
    indexer_types=["full"] * 7 + ["shared"],  # layer 7 shares layer 3's top-k across KDA layers 4-6
)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)


def hf_meta_tensors(raw) -> dict[str, tuple[int, ...]]:
    """Text-model tensors of transformers' Glm5NextForConditionalGeneration (in-memory names, fused experts)."""
    from transformers import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    text = {k: v for k, v in raw.items() if k not in ("model_type",) and v is not None and k != "text_config"}
    if "text_config" in raw:
        text = {k: v for k, v in raw["text_config"].items() if k != "model_type"}
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=TINY_VISION))
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.startswith("model.visual.")}


def split_unmapped(arch, names, prefix: str = "model.language_model.layers."):
    kinds = layer_kinds(arch)
    left = set()
    for n in names:
        if n.startswith(prefix):
            i, rel = n[len(prefix):].split(".", 1)
            if is_unmapped(rel, kinds[int(i)]):
                left.add(n)
    return left


@pytest.mark.parametrize("raw", [HYBRID, RELEASED], ids=["tiny-hybrid", "released-geometry"])
def test_table_covers_transformers_tensors(raw):
    arch = parse_glm5_next_config(raw)
    hf = hf_meta_tensors(raw)
    exp = expand_glm5_next(arch, expert_layout="fused")
    table = exp.hf_shapes()
    unmapped = split_unmapped(arch, hf)
    assert set(table) == set(hf) - unmapped, (sorted(set(hf) - unmapped - set(table))[:10],
                                              sorted(set(table) - set(hf))[:10])
    bad = {n: (table[n], hf[n]) for n in table if tuple(table[n]) != hf[n]}
    assert not bad, bad
    # what is left for later steps: KDA attention and mHC, nothing else
    kda = [i for i, t in enumerate(arch.layer_types) if t == "linear_attention"]
    assert {n.split(".")[4] for n in unmapped} <= {"self_attn", "attn_hc", "ffn_hc"}
    assert {int(n.split(".")[3]) for n in unmapped if ".self_attn." in n} == set(kda)
    # DSA layers: the NoPE geometry and the KPool parameters on full layers only
    for i in arch.dsa_layers:
        p = f"model.language_model.layers.{i}.self_attn."
        assert table[p + "kv_a_proj_with_mqa.weight"] == (arch.kv_lora_rank, arch.hidden_size)
        assert table[p + "q_b_proj.weight"] == (arch.num_attention_heads * arch.qk_head_dim, arch.q_lora_rank)
        has = p + "indexer.index_kpool_compress_ape" in table
        assert has == (arch.indexer_types[i] == "full")
        if has:
            assert table[p + "indexer.index_kpool_compress_ape"] == (arch.index_kpool, arch.index_head_dim)
            assert table[p + "indexer.index_kpool_compress_gate"] == (arch.index_head_dim, arch.hidden_size)
    if raw is RELEASED:
        p = "model.language_model.layers.3.self_attn."
        assert table[p + "kv_b_proj.weight"] == (64 * (256 + 256), 512)
        assert table[p + "o_proj.weight"] == (4096, 64 * 256)
        assert table[p + "indexer.index_kpool_compress_ape"] == (4, 128)


def test_per_expert_layout_reads_one_tensor_per_expert():
    arch = parse_glm5_next_config(HYBRID)
    per = expand_glm5_next(arch, expert_layout="per_expert").hf_shapes()
    fused = expand_glm5_next(arch, expert_layout="fused").hf_shapes()
    p = "model.language_model.layers.3.mlp.experts."
    assert fused[p + "gate_up_proj"] == (8, 64, 64) and p + "0.gate_proj.weight" not in fused
    for e in range(arch.n_routed_experts):
        assert per[p + f"{e}.gate_proj.weight"] == per[p + f"{e}.up_proj.weight"] == (32, 64)
        assert per[p + f"{e}.down_proj.weight"] == (64, 32)
    assert set(per) - {n for n in per if ".experts." in n} == set(fused) - {n for n in fused if ".experts." in n}


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_table_covers_our_model_parameters(model_parallel, backend):
    """A GPTModel from our block spec (4 DSA layers: full/shared, dense/MoE): names and shapes are the table's."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_glm5.cpu import cpu_mode
    from megatron_glm5.glm5_next.spec import build_glm5_next_block_spec
    from tests.glm5_next_fixtures import mcore_config

    raw = tiny_raw()
    arch = parse_glm5_next_config(raw)
    config = mcore_config(raw)
    block = build_glm5_next_block_spec(config, layer_types=arch.layer_types, indexer_types=arch.indexer_types,
                                       backend=backend, pp_rank=0)
    with cpu_mode():
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=arch.vocab_size,
                         max_sequence_length=4096, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
    # megatron-core's parallel linears add an `_extra_state` entry (None here: no fp8 metadata), not a weight
    ours = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("._extra_state")}
    exp = expand_glm5_next(arch)
    table = {m.mcore: tuple(m.mcore_shape) for m in exp.maps}
    assert table == ours
