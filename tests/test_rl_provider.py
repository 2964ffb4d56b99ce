"""The slime / miles-shaped model provider: ``model_provider(pre_process, post_process, vp_stage)`` bound to
Megatron-LM-style arguments, architecture from ``--hf-checkpoint``, our spec and backend from
``--dsa-attention-backend``, megatron-core's routing replay switched on by ``--use-rollout-routing-replay`` (and our
replay taking its ``RouterReplay`` slots, so megatron-core's own API still reaches every router)."""

from __future__ import annotations

import argparse

import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_glm5.config import GLM5ConfigError
from megatron_glm5.glm5.layer import GLMTransformerLayer
from megatron_glm5.rl import add_rl_args, compute_logprobs
from megatron_glm5.rl.provider import get_model_provider, policy_from_args
from megatron_glm5.rl.replay import GLMRouterReplay, ReplayHooks
from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint
from megatron_glm5.dsa.tilelang_attention import TileLangMLASelfAttention
from tests.test_rl_logprobs import packed_batch


def test_args_and_policy():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-checkpoint")  # slime defines it already: left alone
    add_rl_args(parser)
    args = parser.parse_args(["--hf-checkpoint", "x", "--dsa-attention-backend", "tilelang",
                              "--use-rollout-routing-replay", "--use-rollout-indexer-replay"])
    assert args.dsa_attention_backend == "tilelang" and args.use_rollout_routing_replay
    ns = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, bf16=True,
                            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                            decoder_first_pipeline_num_layers=None, deterministic_mode=True)
    policy = policy_from_args(ns)
    assert policy.tensor_model_parallel_size == 2 and policy.params_dtype == torch.bfloat16
    assert policy.recompute_granularity == "full" and policy.deterministic_mode and policy.sequence_parallel is None


def test_provider_builds_our_model_with_routing_replay(tmp_path, model_parallel):
    raw = tiny_glm52_config()
    path = write_hf_checkpoint(tmp_path / "hf", raw, seed=11)
    args = argparse.Namespace(hf_checkpoint=str(path), dsa_attention_backend="tilelang",
                              use_rollout_routing_replay=True, params_dtype=torch.float32)
    before = len(RouterReplay.global_router_replay_instances)
    model = get_model_provider(args)(pre_process=True, post_process=True, vp_stage=None)
    layers = [m for m in model.modules() if isinstance(m, GLMTransformerLayer)]
    assert len(layers) == raw["num_hidden_layers"] + 1  # + MTP
    assert all(isinstance(layer.self_attention, TileLangMLASelfAttention) for layer in layers)
    assert model.config.moe_enable_routing_replay
    instances = RouterReplay.global_router_replay_instances[before:]
    assert len(instances) == 4  # MoE layers 1-3 + MTP
    ReplayHooks.of(model)
    assert all(isinstance(r, GLMRouterReplay) for r in RouterReplay.global_router_replay_instances[before:])
    _, ids, cu = packed_batch(raw["vocab_size"])
    with torch.no_grad():
        assert compute_logprobs(model, ids, cu).shape == (ids.numel(),)
    with pytest.raises(GLM5ConfigError, match="--hf-checkpoint"):
        get_model_provider(argparse.Namespace())()


def test_provider_builds_a_glm53_flash_model_from_its_checkpoint(tmp_path, model_parallel):
    """The provider dispatches through the family registry: a GLM-5.3-Flash checkpoint gives its own layers."""
    from megatron_glm5.glm5_next.layer import GLM5NextTransformerLayer
    from megatron_glm5.glm5_next.testing import write_transformers_checkpoint

    path = write_transformers_checkpoint(tmp_path / "hf", seed=3)
    args = argparse.Namespace(hf_checkpoint=str(path), use_rollout_routing_replay=True, params_dtype=torch.float32)
    model = get_model_provider(args)()
    layers = [m for m in model.modules() if isinstance(m, GLM5NextTransformerLayer)]
    assert len(layers) == 4 + 1 and model.config.moe_enable_routing_replay  # 4 decoder layers + MTP
    assert type(model.config).__name__ == "GLM5NextTransformerConfig"
