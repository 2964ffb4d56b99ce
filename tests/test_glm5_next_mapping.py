"""The GLM-5.3-Flash bridge table (``bridge.glm5_next_mapping``) against both sides' real parameter sets.

* HF in memory: transformers' own ``Glm5NextForConditionalGeneration`` built on the meta device (tiny hybrid config:
  KDA and DSA layers, full and shared indexers, dense and MoE MLPs; and the full-size released geometry): the table's
  names and shapes (``fused`` experts, ``memory`` naming) are exactly the model's text tensors, plus the MTP layer,
  which transformers does not build.
* HF on disk: what ``save_pretrained`` writes (per-expert tensors, ``hc_attn_fn``, ``q_conv1d``, ``f_a_proj``) is
  exactly the ``per_expert`` / ``disk`` table plus the vision tower (carried through) and nothing else.
* Megatron: a ``GPTModel`` built from our specs (decoder layers of all kinds in mHC streams, MTP) has exactly the
  table's megatron names and shapes; the per-expert (released) layout reads one tensor per expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bridge.glm5_next_mapping import (
    detect_naming,
    detect_prefix,
    expand_glm5_next,
    passthrough_names,
)
from megatron_glm5.glm5_next.config import parse_glm5_next_config
from tests.glm5_next_fixtures import tiny_raw

RELEASED = json.loads((Path(__file__).parent / "data" / "glm5_3_flash_config.json").read_text())
HYBRID = tiny_raw(
    num_hidden_layers=8,
    layer_types=None,  # transformers' default: DSA at layers 3 and 7, KDA elsewhere
    mlp_layer_types=None,  # 3 dense, then MoE
    indexer_types=["full"] * 7 + ["shared"],  # layer 7 shares layer 3's top-k across KDA layers 4-6
    num_nextn_predict_layers=1,
)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)


def hf_meta_tensors(raw) -> dict[str, tuple[int, ...]]:
    """Text-model tensors of transformers' Glm5NextForConditionalGeneration (in-memory names, fused experts)."""
    from transformers import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    text = {k: v for k, v in raw.items() if k not in ("model_type",) and v is not None and k != "text_config"}
    if "text_config" in raw:
        text = {k: v for k, v in raw["text_config"].items() if k != "model_type"}
    text.pop("num_nextn_predict_layers", None)
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=TINY_VISION))
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.startswith("model.visual.")}


@pytest.mark.parametrize("raw", [HYBRID, RELEASED], ids=["tiny-hybrid", "released-geometry"])
def test_table_covers_transformers_tensors(raw):
    arch = parse_glm5_next_config(raw)
    assert arch.num_nextn_predict_layers == 1
    hf = hf_meta_tensors(raw)
    exp = expand_glm5_next(arch, expert_layout="fused")
    table = exp.hf_shapes()
    mtp = {n for n in table if n.startswith(f"model.language_model.layers.{arch.num_hidden_layers}.")}
    assert set(table) - mtp == set(hf), (sorted(set(hf) - set(table))[:10], sorted(set(table) - mtp - set(hf))[:10])
    bad = {n: (table[n], hf[n]) for n in hf if tuple(table[n]) != hf[n]}
    assert not bad, bad
    # the MTP layer: a plain (no mHC) full-indexer DSA + MoE layer and the MTP projections
    rel = {n.split(".", 4)[4] for n in mtp}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "self_attn.indexer.index_kpool_compress_ape", "mlp.gate.weight"} <= rel
    assert not any("hc" in r for r in rel)
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
        p = "model.language_model.layers.0."
        assert table[p + "self_attn.conv1d.weight"] == (3 * 8192, 1, 4)
        assert table[p + "attn_hc.fn"] == (24, 4 * 4096)


def test_fp32_rows_are_transformers_fp32_islands():
    """The rows kept in fp32 whatever the requested dtype are exactly transformers' ``_keep_in_fp32_modules_strict``
    tensors (router weight and bias, KDA conv / A_log / dt_bias, mHC base / scale)."""
    arch = parse_glm5_next_config(HYBRID)
    exp = expand_glm5_next(arch, expert_layout="fused", mtp=False)
    fp32 = {r.name.split(".", 4)[4] for m in exp.maps if m.fp32 for r in m.hf}
    assert fp32 == {"mlp.gate.weight", "mlp.gate.e_score_correction_bias", "self_attn.conv1d.weight",
                    "self_attn.forget_gate.A_log", "self_attn.forget_gate.dt_bias", "attn_hc.base", "attn_hc.scale",
                    "ffn_hc.base", "ffn_hc.scale"}


def test_save_pretrained_names_are_the_disk_table(tmp_path):
    """A checkpoint written by transformers' save_pretrained holds exactly the per-expert / disk table's tensors
    (MTP included: our writer adds it) and the vision tower, which is carried through."""
    from bridge.hf_io import HFCheckpointReader
    from megatron_glm5.glm5_next.testing import write_transformers_checkpoint

    hf_dir = write_transformers_checkpoint(tmp_path / "hf")
    reader = HFCheckpointReader(hf_dir)
    names = set(reader.names)
    raw = json.loads((hf_dir / "config.json").read_text())
    arch = parse_glm5_next_config(raw)
    assert detect_naming(names) == "disk" and detect_prefix(names) == "model.language_model."
    table = expand_glm5_next(arch, expert_layout="per_expert", naming="disk").hf_shapes()
    vision = set(passthrough_names(names))
    assert vision and all(n.startswith("model.visual.") for n in vision)
    assert set(table) == names - vision, (sorted(set(table) - names)[:5], sorted(names - vision - set(table))[:5])
    assert {n: tuple(s) for n, s in table.items()} == {n: reader.shapes()[n] for n in table}


def test_per_expert_layout_reads_one_tensor_per_expert():
    arch = parse_glm5_next_config(HYBRID)
    per = expand_glm5_next(arch, expert_layout="per_expert").hf_shapes()
    fused = expand_glm5_next(arch, expert_layout="fused", naming="disk").hf_shapes()
    p = "model.language_model.layers.3.mlp.experts."
    assert fused[p + "gate_up_proj"] == (8, 64, 64) and p + "0.gate_proj.weight" not in fused
    for e in range(arch.n_routed_experts):
        assert per[p + f"{e}.gate_proj.weight"] == per[p + f"{e}.up_proj.weight"] == (32, 64)
        assert per[p + f"{e}.down_proj.weight"] == (64, 32)
    assert set(per) - {n for n in per if ".experts." in n} == set(fused) - {n for n in fused if ".experts." in n}


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_table_covers_our_model_parameters(model_parallel, backend):
    """Our GPTModel (KDA and DSA layers, full and shared indexers, dense and MoE MLPs, mHC, MTP): names and shapes
    are the table's, in both namings."""
    from megatron_glm5.model import build_model
    from megatron_glm5.model import default_cpu_policy

    raw = tiny_raw(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                   indexer_types=["full", "full", "shared", "full"], num_nextn_predict_layers=1)
    arch = parse_glm5_next_config(raw)
    model = build_model(arch, default_cpu_policy(), backend=backend)
    # megatron-core's parallel linears add an `_extra_state` entry (None here: no fp8 metadata), not a weight
    ours = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("._extra_state")}
    for layout in ("per_expert", "fused"):
        exp = expand_glm5_next(arch, expert_layout=layout)
        assert {m.mcore: tuple(m.mcore_shape) for m in exp.maps} == ours
