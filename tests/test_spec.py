"""Block-spec builder: calling conventions, backend registry, IndexShare structure, pipeline-split validation."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_glm5.config import GLM5ConfigError, build_transformer_config, parse_hf_config
from megatron_glm5.glm5.layer import GLMTransformerLayer
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.spec import (
    BACKENDS,
    build_glm5_block_spec,
    get_backend,
    get_glm5_spec,
    indexer_types_from_config,
)
from megatron_glm5.testing import tiny_glm52_config, tiny_glm5_config


def _config(raw=None, **policy):
    arch = parse_hf_config(raw or tiny_glm52_config())
    return arch, build_transformer_config(arch, default_cpu_policy(**policy))


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown GLM-5.x attention backend 'flash'; valid backends: \['megatron', 'tilelang'\]"):
        get_backend("flash")
    assert set(BACKENDS) == {"megatron", "tilelang"}


def test_shared_layers_own_no_indexer_parameters(model_parallel):
    arch, _ = _config()
    model = build_model(arch, default_cpu_policy())
    names = [n for n, _ in model.named_parameters()]
    for i, kind in enumerate(arch.indexer_types):
        has = any(n.startswith(f"decoder.layers.{i}.self_attention.core_attention.indexer.") for n in names)
        assert has == (kind == "full"), f"layer {i} ({kind})"
    assert any(n.startswith("mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.") for n in names), \
        "the MTP layer always has its own full indexer"
    assert all(isinstance(layer, GLMTransformerLayer) for layer in model.decoder.layers)


def test_calling_conventions(tmp_path, model_parallel):
    arch, config = _config()
    # Python / Megatron-LM pretrain_gpt.py: fn(config, vp_stage=...) -> pattern from the config's freq/offset
    assert indexer_types_from_config(config) == arch.indexer_types
    block = get_glm5_spec(config, vp_stage=None)
    assert len(block.layer_specs) == arch.num_hidden_layers
    # slime/miles: fn(args, config, vp_stage) with the pattern read from args.hf_checkpoint
    irregular = tiny_glm52_config(indexer_types=["full", "full", "shared", "full"], index_topk_freq=None,
                                  index_skip_topk_offset=None)
    (tmp_path / "config.json").write_text(json.dumps(irregular))
    ns = argparse.Namespace(hf_checkpoint=str(tmp_path), dsa_attention_backend="megatron")
    block = get_glm5_spec(ns, config, None)
    kinds = [s.submodules.self_attention.submodules.core_attention.params["indexer_type"] for s in block.layer_specs]
    assert kinds == ["full", "full", "shared", "full"]
    with pytest.raises(TypeError, match="get_glm5_spec"):
        get_glm5_spec()


def test_pipeline_stage_starting_on_shared_layer_is_refused():
    arch, config = _config(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    # stage 1 would start at layer 1, a shared layer reusing layer 0's top-k from stage 0
    with pytest.raises(GLM5ConfigError, match=r"a stage starts on decoder layer 1 \(0-indexed\), a 'shared' layer "
                                              r"that reuses the top-k of layer 0.*A valid split: stage sizes \[2, 2\]"):
        build_glm5_block_spec(config, indexer_types=arch.indexer_types, pp_rank=1)
    # the first stage itself is fine, and an even split is valid for both stages
    build_glm5_block_spec(config, indexer_types=arch.indexer_types, pp_rank=0)
    _, even = _config(pipeline_model_parallel_size=2)
    for rank in (0, 1):
        assert len(build_glm5_block_spec(even, indexer_types=arch.indexer_types, pp_rank=rank).layer_specs) == 2


def test_glm52_real_layout_suggestion():
    """GLM-5.2 (21 full / 57 shared) at PP=8: an even split fails and the suggested one is valid."""
    from pathlib import Path

    from megatron_glm5.config import load_hf_config
    from megatron_glm5.spec import validate_stage_layers

    arch = parse_hf_config(load_hf_config(Path(__file__).parent / "data" / "glm5_2_config.json"))
    types = arch.indexer_types

    class Cfg:
        pipeline_model_parallel_size = 8
        virtual_pipeline_model_parallel_size = None

    with pytest.raises(GLM5ConfigError, match="stage sizes") as err:
        validate_stage_layers(types, list(range(11, 21)), Cfg)  # a stage starting on layer 11 (shared)
    sizes = json.loads(str(err.value).split("stage sizes ")[1].split(" (")[0])
    assert sum(sizes) == 78 and len(sizes) == 8
    start = 0
    for size in sizes:
        assert types[start] == "full", f"suggested stage starts on shared layer {start}"
        start += size


def test_non_glm_numerics_are_refused():
    _, config = _config()
    config.dsa_indexer_rope_interleaved = False
    config.dsa_indexer_rotate_activation = True
    with pytest.raises(GLM5ConfigError, match=r"dsa_indexer_rope_interleaved=False \(expected True; --dsa-indexer-rope-interleaved\).*"
                                              r"dsa_indexer_rotate_activation=True .*--no-dsa-indexer-rotate-activation"):
        build_glm5_block_spec(config)


def test_glm5_all_full_layers(model_parallel):
    arch, _ = _config(tiny_glm5_config())
    model = build_model(arch, default_cpu_policy())
    assert all(layer.self_attention.computes_topk for layer in model.decoder.layers)


def test_context_parallel_needs_the_tilelang_backend(model_parallel, monkeypatch):
    import megatron_glm5.model

    arch, _ = _config()
    monkeypatch.setattr(megatron_glm5.model, "check_parallel_state", lambda sizes: None)  # CP=2 needs 2 ranks
    with pytest.raises(NotImplementedError, match="GLMSparseAttention does not support context_parallel_size > 1; "
                                                  "use the 'tilelang' backend"):
        build_model(arch, default_cpu_policy(context_parallel_size=2))


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "expert_model_parallel_size", "context_parallel_size"])
def test_a_policy_that_does_not_match_the_parallel_state_is_refused(model_parallel, field):
    """Was: RuntimePolicy(tensor_model_parallel_size=4) in a TP=1 world built an unsharded model whose config said
    TP=4. build_model (and from_hf_pretrained, which calls it) now compares every parallel size with the initialised
    parallel state and names the mismatch."""
    from megatron_glm5.config import RuntimePolicy

    arch, _ = _config()
    policy = default_cpu_policy(**{field: 4})
    with pytest.raises(ValueError, match=f"RuntimePolicy: {field}=4 but the initialised parallel state has 1"):
        build_model(arch, policy)
    with pytest.raises(ValueError, match=f"MLATransformerConfig: {field}=4 but the initialised parallel state"):
        build_model(arch, config=build_transformer_config(arch, policy))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 but the initialised parallel state has 1"):
        build_model(arch, RuntimePolicy(expert_tensor_parallel_size=2, params_dtype=default_cpu_policy().params_dtype,
                                        use_cpu_initialization=True))
    build_model(arch, default_cpu_policy())  # a matching one builds


def test_from_hf_pretrained_refuses_a_policy_for_another_layout(model_parallel, tmp_path):
    from bridge.pretrained import from_hf_pretrained
    from megatron_glm5.testing import write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "hf", tiny_glm52_config(), seed=0)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 but the initialised parallel state has 1"):
        from_hf_pretrained(path, policy=default_cpu_policy(tensor_model_parallel_size=4))


def test_settings_without_their_implementation_are_refused_with_the_flag(model_parallel, monkeypatch):
    """Megatron-LM turns on Transformer Engine modules and apex's gradient-accumulation fusion by default; without
    them (and with megatron-glm5's own accumulation switched off) the spec names the flag to add instead of
    megatron-core failing inside the first linear."""
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.tensor_parallel import layers

    from megatron_glm5 import compat
    from megatron_glm5.core.mla_spec import apex_gradient_accumulation_fusion as _apex_gradient_accumulation_fusion

    if HAVE_TE or _apex_gradient_accumulation_fusion():
        pytest.skip("checks the refusal on a machine without Transformer Engine and apex")
    config = build_transformer_config(parse_hf_config(tiny_glm52_config()), default_cpu_policy())
    assert config.transformer_impl == "local" and not config.gradient_accumulation_fusion  # what we build
    config.transformer_impl = "transformer_engine"
    config.gradient_accumulation_fusion = True
    monkeypatch.setenv("MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION", "0")
    route = ((layers, "fused_weight_gradient_mlp_cuda", None), (layers, "_grad_accum_fusion_available", None))
    compat.remove_patches(route)
    with pytest.raises(GLM5ConfigError, match=r"add --transformer-impl local.*add --no-gradient-accumulation-fusion"):
        get_glm5_spec(config)
