"""Single-process conversion: bitwise round trips, FP8 dequantisation, dtypes, the Megatron-LM layout, the
in-memory drivers (from_hf_pretrained / export_hf) and megatron-core's own loader on our checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

import bridge
from bridge import hf_io
from bridge.megatron_io import BRIDGE_KEY, DistCheckpoint, resolve_checkpoint_dir
from tests.bridge_workers import make_fixture


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.mark.parametrize("name", ["glm5", "glm5_fused", "glm52", "glm52_fused"])
def test_roundtrip_is_bitwise(fixtures, tmp_path, name):
    src = make_fixture(fixtures, name)
    report = bridge.roundtrip(hf_path=src, work_dir=tmp_path)
    assert report["ok"], report["mismatches"]
    n = len(hf_io.HFCheckpointReader(src).names)
    assert report["tensors"] == report["bitwise_equal"] == n
    # MTP tensors made the trip (model.layers.{N}.* with N = num_hidden_layers)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    out = hf_io.HFCheckpointReader(tmp_path / "hf")
    assert f"model.layers.{layers}.eh_proj.weight" in out.names
    assert f"model.layers.{layers}.self_attn.indexer.wq_b.weight" in out.names
    # non-weight files are copied through
    assert (tmp_path / "hf" / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    assert (tmp_path / "hf" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_fp8_source_is_dequantised_exactly(fixtures, tmp_path):
    src = make_fixture(fixtures, "glm52_fp8")
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc")
    bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mc", hf_path=tmp_path / "hf")
    reader, out = hf_io.HFCheckpointReader(src), hf_io.HFCheckpointReader(tmp_path / "hf")
    fp8 = [n for n in reader.names if reader.info(n).dtype == torch.float8_e4m3fn]
    assert fp8 and not any(n.endswith("_scale_inv") for n in out.names)
    for name in fp8:
        q, s = reader.read(name), reader.read(name + "_scale_inv")
        rows, cols = q.shape
        scale = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        reference = (q.float() * scale).to(torch.bfloat16)  # independent reference dequantisation
        assert torch.equal(out.read(name), reference), name
    for name in reader.names:  # everything else is bit-identical, the router bias stays fp32
        if name not in fp8 and not name.endswith("_scale_inv"):
            assert torch.equal(out.read(name), reader.read(name)), name
    assert out.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    report = bridge.compare_hf_checkpoints(src, tmp_path / "hf")
    assert report["ok"] and report["fp8_dequantized"] == len(fp8)


def test_import_dtype_and_fp32_router_bias(fixtures, tmp_path):
    src = make_fixture(fixtures, "glm5")
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc", dtype="bf16")
    ckpt = DistCheckpoint(resolve_checkpoint_dir(tmp_path / "mc"))
    assert ckpt.dtype("decoder.layers.1.mlp.router.expert_bias") == torch.float32
    assert ckpt.dtype("decoder.layers.1.mlp.experts.experts.linear_fc1.weight") == torch.bfloat16
    bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mc", hf_path=tmp_path / "hf")
    out, reader = hf_io.HFCheckpointReader(tmp_path / "hf"), hf_io.HFCheckpointReader(src)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(out.read(name), reader.read(name).to(torch.bfloat16))
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(out.read(bias), reader.read(bias))
    # config.json names the dtype the exported weights have (the fp32 source's config said float32)
    src_cfg = json.loads((src / "config.json").read_text())
    assert src_cfg["dtype"] == "float32"
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and {k: v for k, v in cfg.items() if k != "dtype"} == {
        k: v for k, v in src_cfg.items() if k != "dtype"}
    # back to fp32 on export: the config agrees with the source again and is copied byte for byte
    bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mc", hf_path=tmp_path / "hf32", dtype="fp32")
    assert (tmp_path / "hf32" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_export_config_names_the_weights_dtype():
    from bridge.convert import _export_config

    raw = {"dtype": "float32", "torch_dtype": "float32", "hidden_size": 8}
    assert _export_config(raw, torch.bfloat16) == {"dtype": "bfloat16", "torch_dtype": "bfloat16", "hidden_size": 8}
    assert _export_config(raw, torch.float32) == raw
    assert _export_config({"torch_dtype": "bfloat16"}, torch.float32) == {"torch_dtype": "float32"}
    assert _export_config({"hidden_size": 8}, torch.bfloat16) == {"hidden_size": 8}  # says nothing: kept as is
    fp8 = {"dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}}
    assert _export_config(fp8, torch.bfloat16) == {"dtype": "bfloat16"}
    assert _export_config({"quantization_config": {}}, torch.bfloat16) == {"dtype": "bfloat16"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_megatron_lm_layout_and_common_state(fixtures, tmp_path):
    src = make_fixture(fixtures, "glm52")
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc", iteration=7)
    root = tmp_path / "mc"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    ckpt_dir = root / "iter_0000007"
    assert json.loads((ckpt_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))  # megatron-core's own reader
    args = common["args"]
    assert common["iteration"] == 7 and common["checkpoint_version"] == 3.0
    assert args.no_save_optim and args.no_save_rng and args.tensor_model_parallel_size == 1
    assert args.num_layers == 4 and args.num_experts == 8 and args.q_lora_rank == 64
    assert common[BRIDGE_KEY]["hf_config"] == json.loads((src / "config.json").read_text())
    assert (root / "hf_assets" / "tokenizer_config.json").is_file()
    # every stored expert key is one stacked tensor [E, ...] and the shared layer has no indexer
    ckpt = DistCheckpoint(ckpt_dir)
    assert ckpt.shape("decoder.layers.1.mlp.experts.experts.linear_fc1.weight") == (8, 128, 128)
    assert not any(k.startswith("decoder.layers.1.self_attention.core_attention.indexer") for k in ckpt.tensors)
    assert "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wq_b.weight" in ckpt.tensors


def test_megatron_core_loads_our_checkpoint_and_export_hf_roundtrips(fixtures, tmp_path, model_parallel):
    """dist_checkpointing.load fills a model whose weights equal the HF tensors; export_hf of that model (the
    in-memory driver) gives back the source bitwise; from_hf_pretrained builds the same weights."""
    src = make_fixture(fixtures, "glm52")
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc")
    model = bridge.load_megatron_checkpoint(tmp_path / "mc")
    reader = hf_io.HFCheckpointReader(src)
    sd = model.state_dict()
    assert torch.equal(sd["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"],
                       reader.read("model.layers.2.mlp.experts.3.down_proj.weight"))
    assert torch.equal(sd["mtp.layers.0.eh_proj.weight"], reader.read("model.layers.4.eh_proj.weight"))
    bridge.export_hf(model, tmp_path / "hf")
    assert bridge.compare_hf_checkpoints(src, tmp_path / "hf")["ok"]

    from megatron_glm5 import from_hf_pretrained

    direct = from_hf_pretrained(src)
    for k, v in direct.state_dict().items():
        if v is not None and not k.endswith("_extra_state"):
            assert torch.equal(v, sd[k]), k
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(48).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(direct(ids, pos, None), model.eval()(ids, pos, None))


def test_export_to_the_other_expert_layout(fixtures, tmp_path):
    per = make_fixture(fixtures, "glm5")
    fused = make_fixture(fixtures, "glm5_fused")
    bridge.convert_hf_to_megatron(hf_path=per, megatron_path=tmp_path / "mc")
    bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mc", hf_path=tmp_path / "hf", expert_layout="fused")
    out, ref = hf_io.HFCheckpointReader(tmp_path / "hf"), hf_io.HFCheckpointReader(fused)
    assert sorted(out.names) == sorted(ref.names)  # same seed: identical weights in the other layout
    for n in ref.names:
        assert torch.equal(out.read(n), ref.read(n)), n


def test_export_a_checkpoint_saved_by_megatron_core(fixtures, tmp_path, model_parallel):
    """A checkpoint written by megatron-core's own dist_checkpointing.save, as Megatron-LM training writes it
    (model weights + optimizer state + args, no bridge metadata), exports with --hf-config back to the source."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bridge.errors import BridgeError
    from megatron_glm5 import from_hf_pretrained

    src = make_fixture(fixtures, "glm52")
    model = from_hf_pretrained(src)
    exp_avg = ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.decoder.final_layernorm.weight",
                                              torch.zeros(128), replica_id=0)
    state = {"model": model.sharded_state_dict(), "optimizer": {"exp_avg": exp_avg},
             "args": Namespace(tensor_model_parallel_size=1), "iteration": 5, "checkpoint_version": 3.0}
    ckpt = tmp_path / "mlm" / "iter_0000005"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(state, str(ckpt))
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("5")

    with pytest.raises(BridgeError, match="does not record its HF config.json"):
        bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mlm", hf_path=tmp_path / "hf")
    bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mlm", hf_path=tmp_path / "hf",
                                  hf_config=src / "config.json")
    report = bridge.compare_hf_checkpoints(src, tmp_path / "hf")
    assert report["ok"], report["mismatches"]

    # our import writes the same keys, global shapes and chunk boxes as megatron-core's own save
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "ours")
    theirs, ours = DistCheckpoint(ckpt), DistCheckpoint(resolve_checkpoint_dir(tmp_path / "ours"))
    model_keys = {k for k in theirs.tensors if not k.startswith("optimizer.")}
    assert model_keys == set(ours.tensors)
    for k in model_keys:
        assert theirs.shape(k) == ours.shape(k), k
        boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in theirs.tensors[k].chunks)
        assert boxes == sorted((tuple(c.offsets), tuple(c.sizes)) for c in ours.tensors[k].chunks), k
    assert set(theirs.objects) == set(ours.objects)
