"""``python -m megatron_glm5.pretrain --lora-*``: the flags parse into a LoraConfig and the model provider's hook adds
the adapters after the model is built and before Megatron-LM loads a checkpoint; a base checkpoint without adapters
loads only through ``--lora-base-checkpoint`` (checkpoints are then adapter-only). The training loop needs CUDA
(tests/gpu/lora_train.py runs LoRA training on the GPU machine)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from megatron_glm5.config import parse_hf_config
from megatron_glm5.lora import lora_parameters
from megatron_glm5.lora_checkpoint import AdapterOnlyCheckpoint
from megatron_glm5.pretrain import add_glm5_args, apply_lora_args, lora_config_from_args
from megatron_glm5.testing import tiny_glm52_config


def _parse(monkeypatch, argv):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    return parse_args(extra_args_provider=add_glm5_args)


@pytest.fixture
def hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_glm52_config()))
    return tmp_path


def _model(seed=0):
    from megatron_glm5.model import build_model, default_cpu_policy

    torch.manual_seed(seed)
    return build_model(parse_hf_config(tiny_glm52_config()), default_cpu_policy())


def test_lora_flags(monkeypatch, hf_dir):
    args = _parse(monkeypatch, ["--hf-config", str(hf_dir), "--lora-rank", "8", "--lora-target-modules", "q_a_proj",
                                "kv_b_proj", "gate_proj", "up_proj", "--lora-exclude-modules", "mtp"])
    cfg = lora_config_from_args(args)
    assert (cfg.r, cfg.alpha, cfg.targets) == (8, 16.0, ("linear_q_down_proj", "linear_kv_up_proj", "linear_fc1"))
    assert cfg.exclude_modules == ("mtp",)
    assert lora_config_from_args(_parse(monkeypatch, ["--hf-config", str(hf_dir)])) is None
    with pytest.raises(SystemExit, match="--lora-alpha without --lora-rank"):
        lora_config_from_args(_parse(monkeypatch, ["--hf-config", str(hf_dir), "--lora-alpha", "4"]))
    with pytest.raises(SystemExit, match=r"unknown LoRA target\(s\) \['q_proj'\]"):
        lora_config_from_args(_parse(monkeypatch, ["--hf-config", str(hf_dir), "--lora-rank", "4",
                                                   "--lora-target-modules", "q_proj"]))


def test_provider_hook_base_checkpoint_and_refusal(monkeypatch, hf_dir, tmp_path, model_parallel):
    from megatron.core import dist_checkpointing

    base = _model()
    ckpt = tmp_path / "base" / "iter_0000000"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(base.sharded_state_dict(), str(ckpt))
    (tmp_path / "base" / "latest_checkpointed_iteration.txt").write_text("0\n")

    args = _parse(monkeypatch, ["--hf-config", str(hf_dir), "--lora-rank", "4", "--lora-base-checkpoint",
                                str(tmp_path / "base")])
    model = apply_lora_args(_model(seed=1), args)  # other random base: replaced by the checkpoint's
    assert isinstance(model, AdapterOnlyCheckpoint) and lora_parameters(model)
    want = dict(base.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert all(".lora_" in k for k in model.sharded_state_dict())

    args = _parse(monkeypatch, ["--hf-config", str(hf_dir), "--lora-rank", "4", "--load", str(tmp_path / "base")])
    with pytest.raises(SystemExit, match=r"--load .* holds no LoRA adapters: pass it as --lora-base-checkpoint"):
        apply_lora_args(_model(), args)
