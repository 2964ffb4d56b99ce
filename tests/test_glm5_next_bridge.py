"""GLM-5.3-Flash conversion (single process, CPU): checkpoints written by transformers itself.

* ``save_pretrained`` files (on-disk names: ``hc_attn_fn``, ``q/k/v_conv1d``, ``f_a_proj``, per-expert tensors) and a
  ``state_dict()`` dump (in-memory names: ``attn_hc.fn``, one ``conv1d``, ``forget_gate.*``, fused 3-D experts): HF ->
  Megatron -> HF is bitwise for every tensor, MTP and the vision tower included, config.json byte for byte; the
  vision tower travels in ``hf_assets/passthrough``.
* ``--dtype bf16`` import keeps transformers' fp32 islands fp32 (router, KDA conv / A_log / dt_bias, mHC base /
  scale) on both sides of the trip.
* In memory: ``from_hf_pretrained`` -> ``export_hf`` is bitwise (the vision tower comes from the source the model
  remembers); ``load_megatron_checkpoint`` -> ``export_hf`` too; ``verify`` passes in fp32 (full and
  layer-truncated).
* Refusals naming the fix: MTP tensors without ``num_nextn_predict_layers``, mixed namings, a ``--pp`` whose stages
  cannot all start before a full DSA layer (``--pp 2`` splits 1 + 3: layer 2 is shared), an export of a vision model
  without its vision tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

import bridge
from bridge import hf_io
from bridge.errors import BridgeError, TensorSetError
from bridge.megatron_io import BRIDGE_KEY, DistCheckpoint, resolve_checkpoint_dir


@pytest.fixture(scope="module")
def disk_checkpoint(tmp_path_factory):
    from megatron_glm5.glm5_next.testing import write_transformers_checkpoint

    return write_transformers_checkpoint(tmp_path_factory.mktemp("flash_disk") / "hf")


@pytest.fixture(scope="module")
def memory_checkpoint(tmp_path_factory):
    from megatron_glm5.glm5_next.testing import write_transformers_checkpoint

    return write_transformers_checkpoint(tmp_path_factory.mktemp("flash_memory") / "hf", naming="memory", seed=1)


def _names(path):
    return set(hf_io.HFCheckpointReader(path).names)


@pytest.mark.parametrize("which", ["disk", "memory"])
def test_roundtrip_is_bitwise_with_mtp_and_vision(disk_checkpoint, memory_checkpoint, tmp_path, which):
    src = disk_checkpoint if which == "disk" else memory_checkpoint
    names = _names(src)
    mtp = {n for n in names if n.startswith("model.language_model.layers.4.")}
    vision = {n for n in names if n.startswith("model.visual.")}
    assert mtp and vision and "model.language_model.layers.4.eh_proj.weight" in mtp
    marker = "hc_attn_fn" if which == "disk" else "attn_hc.fn"
    assert "model.language_model.layers.0." + marker in names
    report = bridge.roundtrip(hf_path=src, work_dir=tmp_path, keep=True)
    assert report["ok"], report["mismatches"]
    assert report["tensors"] == report["bitwise_equal"] == len(names)
    assert _names(tmp_path / "hf") == names
    assert (tmp_path / "hf" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert _names(tmp_path / "megatron" / "hf_assets" / "passthrough") == vision
    meta = DistCheckpoint(resolve_checkpoint_dir(tmp_path / "megatron")).common_state()[BRIDGE_KEY]
    assert meta["hf_naming"] == which and meta["passthrough"] == len(vision)
    assert meta["expert_layout"] == ("per_expert" if which == "disk" else "fused")


def test_bf16_import_keeps_fp32_islands(disk_checkpoint, tmp_path):
    bridge.convert_hf_to_megatron(hf_path=disk_checkpoint, megatron_path=tmp_path / "mc", dtype="bf16")
    ckpt = DistCheckpoint(resolve_checkpoint_dir(tmp_path / "mc"))
    p = "decoder.layers.0."
    for key in ("self_attention.conv1d.weight", "self_attention.A_log", "self_attention.dt_bias", "attn_hc.base",
                "attn_hc.scale", "mlp_hc.scale"):
        assert ckpt.dtype(p + key) == torch.float32, key
    assert ckpt.dtype("decoder.layers.1.mlp.router.weight") == torch.float32
    assert ckpt.dtype(p + "attn_hc.fn") == ckpt.dtype(p + "self_attention.linear_q.weight") == torch.bfloat16
    bridge.convert_megatron_to_hf(megatron_path=tmp_path / "mc", hf_path=tmp_path / "hf")
    out = hf_io.HFCheckpointReader(tmp_path / "hf")
    assert out.info("model.language_model.layers.0.self_attn.q_conv1d.weight").dtype == torch.float32
    assert out.info("model.language_model.layers.0.hc_ffn_base").dtype == torch.float32
    assert out.info("model.language_model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    src = hf_io.HFCheckpointReader(disk_checkpoint)
    for name in src.names:  # vision untouched (fp32 here), fp32 islands exact
        if name.startswith("model.visual.") or out.info(name).dtype == torch.float32:
            assert torch.equal(out.read(name), src.read(name)), name


def test_in_memory_drivers_and_verify(disk_checkpoint, tmp_path, model_parallel):
    model = bridge.from_hf_pretrained(disk_checkpoint)
    bridge.export_hf(model, tmp_path / "exported")
    report = bridge.compare_hf_checkpoints(disk_checkpoint, tmp_path / "exported")
    assert report["ok"], report["mismatches"]
    par = bridge.verify(hf_path=disk_checkpoint, model=model, seq_len=80)
    # 2e-5: fp32 summation orders differ (e.g. the torch KDA solves each chunk's triangular system with
    # torch.linalg.solve_triangular, transformers by forward substitution); measured 1.04e-5 on some CPUs
    assert par["ok"] and par["max_rel_logit_diff"] <= 2e-5 and par["topk_rows_differing"] == 0
    assert set(par["topk_overlap"]) == {"1"}  # the full DSA layer (layer 2 shares its top-k)
    short = bridge.verify(hf_path=disk_checkpoint, seq_len=48, num_layers=2)
    assert short["ok"] and short["num_layers"] == 2 and not short["mtp_loaded"]
    # a bridge-written Megatron checkpoint, loaded with megatron-core's loader, exports the same files
    bridge.convert_hf_to_megatron(hf_path=disk_checkpoint, megatron_path=tmp_path / "mc")
    loaded = bridge.load_megatron_checkpoint(tmp_path / "mc")
    bridge.export_hf(loaded, tmp_path / "exported2")
    assert bridge.compare_hf_checkpoints(disk_checkpoint, tmp_path / "exported2")["ok"]


def test_refusals(disk_checkpoint, tmp_path, model_parallel):
    import shutil

    # MTP tensors but no MTP layer announced
    src = tmp_path / "no_mtp_field"
    shutil.copytree(disk_checkpoint, src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["num_nextn_predict_layers"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BridgeError, match=r"layer\(s\) \[4\] after the 4 decoder layers .* \"num_nextn_predict_"
                                             r"layers\": 1"):
        bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "x")
    from bridge.launch import check_parallel_layout
    from megatron_glm5.architectures import parse_architecture

    arch = parse_architecture(json.loads((disk_checkpoint / "config.json").read_text()))  # KDA, full, shared, KDA
    assert check_parallel_layout(arch, 1, 2, 1) == {"num_layers_in_first_pipeline_stage": 1,
                                                    "num_layers_in_last_pipeline_stage": 3}
    with pytest.raises(BridgeError, match=r"--pp 4: cannot split 4 layers .* \(valid stage starts: layers "
                                          r"\[0, 1, 3\]\); valid --pp: 1, 2"):
        bridge.convert_hf_to_megatron(hf_path=disk_checkpoint, megatron_path=tmp_path / "y", pp=4)
    from bridge.glm5_next_mapping import detect_naming

    with pytest.raises(TensorSetError, match="mixes transformers' on-disk names"):
        detect_naming(["m.layers.0.hc_attn_fn", "m.layers.1.attn_hc.fn"])
    model = bridge.from_hf_pretrained(disk_checkpoint, num_layers=1)  # a truncated model keeps no vision source
    assert not hasattr(model, "glm5_passthrough_source")
    with pytest.raises(BridgeError, match="vision tower, which the Megatron model does not hold"):
        bridge.export_hf(model, tmp_path / "z", hf_config=json.loads((disk_checkpoint / "config.json").read_text()))


def test_demo_glm53_flash(tmp_path, model_parallel):
    """``megatron-glm5 demo --model glm5.3-flash``: import, bitwise round trip (vision carried), a few training steps
    with falling loss, export, verify against transformers. The CLI offers exactly the demo's models."""
    from bridge import cli
    from bridge.demo import MODELS, run_demo

    demo = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["demo"]._actions
                if "--model" in a.option_strings)
    assert tuple(demo.choices) == MODELS and demo.default == "glm5.2"
    lines = []
    result = run_demo(out_dir=tmp_path / "demo", steps=3, model_name="glm5.3-flash", print_fn=lines.append)
    assert result["ok"], "\n".join(lines)
    assert result["losses"][-1] < result["losses"][0]
    assert result["roundtrip"]["bitwise_equal"] == result["roundtrip"]["tensors"] == 250
    assert "GLM-5.3-Flash" in lines[0] and any("bitwise identical" in ln for ln in lines)
