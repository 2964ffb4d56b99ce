"""The mapping table, its expansion and the transforms (pure, no checkpoints)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bridge import naming
from bridge import transforms as T
from bridge.errors import TensorSetError
from bridge.mapping import account_hf_names, detect_expert_layout, expand, layer_kinds
from megatron_glm5.config import parse_hf_config
from megatron_glm5.testing import quantize_block_fp8, tiny_glm52_config, tiny_glm5_config

DATA = Path(__file__).parent / "data"


def _arch(name):
    return parse_hf_config(json.loads((DATA / name).read_text()))


@pytest.mark.parametrize("config, hf_tensors", [
    # shared/notes/glm5_model.md §2.4: GLM-5 has 59,079 tensors for the 78-layer graph + 791 in the MTP layer;
    # GLM-5.2 (IndexShare: 57 of 78 layers without indexer) has 59,585 including MTP.
    ("glm5_config.json", 59_079 + 791),
    ("glm5_1_config.json", 59_079 + 791),
    ("glm5_2_config.json", 59_585),
])
def test_table_covers_released_tensor_counts(config, hf_tensors):
    import torch

    arch = _arch(config)
    exp = expand(arch)
    assert len(exp.hf_shapes()) == hf_tensors
    # element counts of NVIDIA's verification cards: transformers' parameters (no MTP layer, no router-bias
    # buffers) 743,911,199,232 for GLM-5 and 743,377,000,704 for GLM-5.2; all GLM-5.2 tensors 753,329,940,480
    numel = {n: int(torch.Size(s).numel()) for n, s in exp.hf_shapes().items()}
    mtp = f"model.layers.{arch.num_hidden_layers}."
    params = sum(v for n, v in numel.items() if not n.startswith(mtp) and not n.endswith("e_score_correction_bias"))
    if config == "glm5_2_config.json":
        assert sum(numel.values()) == 753_329_940_480
        assert params == 743_377_000_704
    else:
        assert params == 743_911_199_232
    # every megatron name is unique and every HF name is produced exactly once
    names = [r.name for m in exp.maps for r in m.hf]
    assert len(names) == len(set(names))


def test_glm52_shared_layers_have_no_indexer_and_mtp_has_one():
    arch = _arch("glm5_2_config.json")
    exp = expand(arch)
    shapes = exp.hf_shapes()
    for i, kind in enumerate(arch.indexer_types):
        has = f"model.layers.{i}.self_attn.indexer.wq_b.weight" in shapes
        assert has == (kind == "full"), i
    mtp = arch.num_hidden_layers
    assert f"model.layers.{mtp}.self_attn.indexer.wq_b.weight" in shapes
    assert "mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.linear_wq_b.weight" in exp.by_mcore
    assert sum(1 for t in arch.indexer_types if t == "full") == 21
    # GLM-5.2: wq_b [32*128, 2048], router bias fp32, MTP extras
    assert shapes["model.layers.0.self_attn.indexer.wq_b.weight"] == (4096, 2048)
    assert exp.by_mcore["decoder.layers.5.mlp.router.expert_bias"].fp32
    assert exp.by_mcore["mtp.layers.0.final_layernorm.weight"].hf[0].name == f"model.layers.{mtp}.shared_head.norm.weight"
    assert shapes[f"model.layers.{mtp}.eh_proj.weight"] == (6144, 12288)


def test_mtp_layer_kind_and_prefixes():
    arch = parse_hf_config(tiny_glm52_config())
    kinds = layer_kinds(arch)
    assert [k.indexer for k in kinds] == ["full", "shared", "full", "shared", "full"]
    exp = expand(arch)
    m = exp.by_mcore["mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert m.hf[0].name == "model.layers.4.mlp.experts.3.down_proj.weight"
    # megatron-core's dist-checkpoint key for the inner layer is transformer_layer: both spellings map here
    for inner in ("transformer_layer", "mtp_model_layer"):
        assert naming.canonical(f"mtp.layers.0.{inner}.input_layernorm.weight") in exp.by_mcore


def test_fused_layout_reads_expert_rows():
    exp = expand(parse_hf_config(tiny_glm5_config()), expert_layout="fused")
    m = exp.by_mcore["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"]
    (ref,) = m.hf
    assert (ref.name, ref.row, ref.stack, ref.shape) == ("model.layers.2.mlp.experts.gate_up_proj", 5, 8, (128, 128))
    assert exp.hf_shapes()["model.layers.2.mlp.experts.down_proj"] == (8, 128, 64)


def test_fp8_weights_consume_their_scales():
    arch = parse_hf_config(tiny_glm5_config())
    fp8 = {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight"}
    exp = expand(arch, fp8_names=fp8)
    shapes = exp.hf_shapes()
    assert shapes["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] == (1, 1)
    m = exp.by_mcore["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert m.hf[0].scale is None and m.hf[1].scale.name == "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"


def test_dist_checkpoint_keys_map_to_logical_names():
    piece = naming.logical_piece("decoder.layers.3.mlp.experts.experts.linear_fc1.weight", (6, 64, 0), (1, 64, 128))
    assert piece == naming.LogicalPiece("decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight", (64, 0), (64, 128))
    names = naming.logical_tensors("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight", (2, 4, 3))
    assert [n for n, _, _ in names] == [f"mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.{e}.linear_fc2.weight"
                                        for e in range(2)]
    # TE grouped-GEMM parameter names
    assert naming.canonical("decoder.layers.1.mlp.experts.linear_fc2.weight7") == \
        "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"
    assert naming.ignored_megatron_reason("optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight")
    assert naming.ignored_megatron_reason("decoder.layers.0.self_attention.linear_proj._extra_state/shard_0_1")
    assert naming.ignored_megatron_reason("decoder.layers.0.input_layernorm.weight") is None


def _names(raw):
    return set(expand(parse_hf_config(raw)).hf_shapes())


def test_accounting_lists_missing_and_unexpected():
    raw = tiny_glm5_config()
    arch = parse_hf_config(raw)
    exp = expand(arch)
    names = _names(raw) - {"model.layers.2.mlp.gate.weight"} | {"model.layers.2.mlp.bogus.weight"}
    with pytest.raises(TensorSetError, match=r"1 missing: model\.layers\.2\.mlp\.gate\.weight; 1 unexpected.*"
                                             r"model\.layers\.2\.mlp\.bogus\.weight") as e:
        account_hf_names(arch, exp, names, source="ckpt")
    assert e.value.missing == ["model.layers.2.mlp.gate.weight"]
    ignored = account_hf_names(arch, exp, _names(raw) | {"model.layers.0.self_attn.rotary_emb.inv_freq"}, source="x")
    assert list(ignored) == ["model.layers.0.self_attn.rotary_emb.inv_freq"]


def test_accounting_indexshare_mismatch_messages():
    raw = tiny_glm52_config()
    arch = parse_hf_config(raw)
    exp = expand(arch)
    extra = _names(raw) | {"model.layers.1.self_attn.indexer.wk.weight"}
    with pytest.raises(TensorSetError, match=r"layer\(s\) \[1\] are 'shared'.*must have no indexer tensors.*"
                                             r"model\.layers\.1\.self_attn\.indexer\.wk\.weight"):
        account_hf_names(arch, exp, extra, source="ckpt")
    lacking = _names(raw) - {"model.layers.2.self_attn.indexer.k_norm.bias"}
    with pytest.raises(TensorSetError, match=r"layer\(s\) \[2\] are 'full'.*lacks model\.layers\.2\.self_attn\."
                                             r"indexer\.k_norm\.bias"):
        account_hf_names(arch, exp, lacking, source="ckpt")


def test_detect_expert_layout():
    assert detect_expert_layout(["model.layers.1.mlp.experts.0.gate_proj.weight"]) == "per_expert"
    assert detect_expert_layout(["model.layers.1.mlp.experts.gate_up_proj"]) == "fused"
    assert detect_expert_layout(["model.layers.0.mlp.gate_proj.weight"]) == "per_expert"
    with pytest.raises(TensorSetError, match="mixes per-expert"):
        detect_expert_layout(["model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.2.mlp.experts.down_proj"])


# --------------------------------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------------------------------


def test_gated_is_gate_then_up_and_inverts():
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    fc1 = T.GATED.to_mcore([gate, up])
    assert torch.equal(fc1[:3], gate) and torch.equal(fc1[3:], up)
    g2, u2 = T.GATED.to_hf(fc1)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    assert T.GATED.hf_shapes((6, 5)) == [(3, 5), (3, 5)]


def test_block_fp8_dequant_matches_reference_exactly():
    torch.manual_seed(0)
    for shape in [(256, 384), (200, 130), (2, 256, 128)]:
        w = torch.randn(*shape)
        if w.ndim == 2:
            q, s = quantize_block_fp8(w)
        else:
            qs = [quantize_block_fp8(x) for x in w]
            q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
        ours = T.dequantize_block_fp8(q, s, (128, 128), torch.bfloat16)
        rows, cols = shape[-2:]
        ref = q.to(torch.float32).clone()
        for idx in torch.cartesian_prod(torch.arange(s.shape[-2]), torch.arange(s.shape[-1])).tolist():
            i, j = idx
            ref[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= s[..., i:i + 1, j:j + 1]
        assert torch.equal(ours, ref.to(torch.bfloat16)), shape
        assert (ours.float() - w).abs().max() < 0.1 * w.abs().max()
        del rows, cols


# --------------------------------------------------------------------------------------------------------------------
# megatron-core's indexer layout: the table maps indexer rows unchanged
# --------------------------------------------------------------------------------------------------------------------


def test_installed_megatron_core_applies_indexer_rope_to_the_first_dims():
    """HF stores each indexer head as [rope | nope]; the table copies wq_b / wk / k_norm unchanged, which is right only
    if megatron-core's DSAIndexer rotates the *first* rope dims too (early versions rotated the last ones). A probe with
    rotary angle pi (cos -1, sin 0) negates exactly the rotated dims, whatever the pairing."""
    import types

    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert "dsa_indexer_rope_interleaved" in {f.name for f in dataclasses.fields(TransformerConfig)}
    rope, head = 4, 8
    config = types.SimpleNamespace(apply_rope_fusion=False, multi_latent_attention=True, rotary_interleaved=False,
                                   dsa_indexer_rope_interleaved=True, mrope_section=None, context_parallel_size=1)
    cp = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    fake = types.SimpleNamespace(qk_pos_emb_head_dim=rope, index_head_dim=head, config=config,
                                 pg_collection=types.SimpleNamespace(cp=cp))
    out = DSAIndexer._apply_rope(fake, torch.ones(1, 1, 1, head), torch.full((1, 1, 1, rope), torch.pi), 1.0)
    assert (out.reshape(head) < 0).tolist() == [True] * rope + [False] * (head - rope)
    assert expand(parse_hf_config(tiny_glm5_config())).by_mcore[
        "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight"].transform is T.COPY


def test_full_size_glm52_model_and_table_agree(model_parallel):
    """The 744B GLM-5.2 model built on the meta device (78 layers, 256 experts, MTP) declares exactly the table's
    tensors with the table's shapes: every checkpoint box of the real model maps to one table row."""
    import torch

    from bridge.boxes import build_skeleton, sharded_boxes

    arch = _arch("glm5_2_config.json")
    exp = expand(arch)
    model = build_skeleton(arch, 1, 1, 1)
    plan = sharded_boxes(model, exp, lambda m: torch.float32 if m.fp32 else torch.bfloat16)  # raises on mismatch
    assert {p.logical for p in plan.pieces.values()} == set(exp.by_mcore)
    biases = 76 * 256  # 75 MoE layers + the MTP layer, fp32
    assert sum(c.nbytes for c in plan.chunks) == 2 * (753_329_940_480 - biases) + 4 * biases
