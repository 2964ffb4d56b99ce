"""``python -m megatron_glm5.pretrain --hf-config <GLM-5.3-Flash>`` up to the model (the training loop needs CUDA; the
GPU script runs it): Megatron-LM's arguments take what they can express from the config, the KPool / KDA / mHC fields
reach the model config directly, and the model provider builds the GLM-5.3-Flash GPTModel (KDA and DSA layers in mHC
streams, MTP)."""

from __future__ import annotations

import json

import pytest

from megatron_glm5.architectures import parse_architecture
from megatron_glm5.config import load_hf_config
from megatron_glm5.glm5_next.testing import tiny_flash_config
from megatron_glm5.pretrain import apply_architecture, disable_unavailable_fusions, model_provider
from tests.test_pretrain_entry import BASE, _parse


@pytest.fixture
def flash_dir(tmp_path):
    raw = {"model_type": "glm5_next", "text_config": tiny_flash_config()["text_config"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_glm53_flash_model_from_megatron_lm_arguments(monkeypatch, flash_dir, model_parallel):
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    from megatron_glm5.glm5_next.kda import KimiDeltaAttention
    from megatron_glm5.glm5_next.mcore_config import GLM5NextTransformerConfig

    argv = ["--hf-config", str(flash_dir), "--kda-kernel", "torch", *BASE]
    args = _parse(monkeypatch, argv)
    arch = parse_architecture(load_hf_config(flash_dir))
    changed = apply_architecture(args, arch, argv)
    assert {"num_layers", "hidden_size", "q_lora_rank", "num_experts", "dsa_indexer_topk"} <= set(changed)
    assert not hasattr(args, "hc_mult") and not hasattr(args, "kda_num_heads")
    assert args.position_embedding_type == "none" and args.qk_pos_emb_head_dim == 0
    disable_unavailable_fusions(args)
    validate_args(args, {})
    set_global_variables(args)
    try:
        model = model_provider(arch, "megatron")
    finally:
        unset_global_variables()
    cfg = model.config
    assert isinstance(cfg, GLM5NextTransformerConfig)
    assert (cfg.hc_mult, cfg.kda_num_heads, cfg.kda_head_dim, cfg.dsa_indexer_kpool) == (4, 4, 8, 4)
    assert cfg.activation_func_clamp_value == 10.0 and not cfg.bias_activation_fusion
    layers = model.decoder.layers
    assert [isinstance(la.self_attention, KimiDeltaAttention) for la in layers] == [True, False, False, True]
    assert cfg.kda_kernel == "torch" and layers[0].self_attention.kernel == "torch"  # --kda-kernel reaches the layers
    assert all(la.attn_hc is not None for la in layers) and layers[0].expand_streams and model.mtp_process


def test_glm53_flash_contradicting_flag_is_refused(monkeypatch, flash_dir):
    argv = ["--hf-config", str(flash_dir), "--hidden-size", "128", *BASE]
    args = _parse(monkeypatch, argv)
    with pytest.raises(SystemExit, match=r"--hidden-size 128 \(the HF config says 64\)"):
        apply_architecture(args, parse_architecture(load_hf_config(flash_dir)), argv)
