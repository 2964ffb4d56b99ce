"""LoRA checkpoints through megatron-core's dist_checkpointing (megatron_glm5.lora_checkpoint):

* adapter-only checkpoints: small, round-trip exactly, carry the config and every adapter's rank/alpha, and refuse
  a model with other adapters (rank, targets) with one clear error;
* a base (adapter-free) checkpoint loads into a LoRA model only through the explicit ``load_base_checkpoint``; a
  plain load of the model's full sharded state dict fails on the missing adapters;
* the Megatron-LM hook (``use_adapter_only_checkpoints``): the model's ``sharded_state_dict`` / ``load_state_dict``
  cover the adapters only, so Megatron-LM's own save/load write and resume adapter-only checkpoints;
* frozen base weights get no gradient buffer in megatron-core's DDP and no optimizer state (measured).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_glm5.config import parse_hf_config
from megatron_glm5.lora import DEFAULT_TARGET_MODULES, LoraConfig, add_lora, lora_parameters
from megatron_glm5.lora_checkpoint import (
    LoraCheckpointError,
    checkpoint_has_adapters,
    load_base_checkpoint,
    load_lora_checkpoint,
    read_lora_meta,
    save_lora_checkpoint,
    use_adapter_only_checkpoints,
)
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config

SEQ = 48
CONFIG = dict(r=4, alpha=8, init_lora_weights=False,
              target_modules=(*DEFAULT_TARGET_MODULES, "dense_mlp", "shared_experts"))  # every adaptable linear


def _model(seed=0, backend="megatron"):
    torch.manual_seed(seed)
    return build_model(parse_hf_config(tiny_glm52_config()), default_cpu_policy(), backend=backend)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _adapters(model):
    return {n: p.detach().clone() for n, p in lora_parameters(model)}


def _logits(model, seed=1):
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids, torch.arange(SEQ)[None].expand_as(ids), None)


def test_adapter_only_checkpoint_round_trip(model_parallel, tmp_path):
    model = add_lora(_model(), LoraConfig(seed=1, **CONFIG))
    save_lora_checkpoint(model, tmp_path / "adapters", extra={"iteration": 7})
    adapter_bytes = sum(p.numel() * p.element_size() for _, p in lora_parameters(model))
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    size = _dir_bytes(tmp_path / "adapters")
    print(f"\nadapter-only checkpoint: {size / 1e3:.0f} kB for {adapter_bytes / 1e3:.0f} kB of adapters "
          f"(base weights: {base_bytes / 1e6:.1f} MB)")
    assert size < 2 * adapter_bytes + 500_000 and size < base_bytes / 4  # per-record overhead: 198 small tensors
    meta = read_lora_meta(tmp_path / "adapters")
    assert meta["config"]["r"] == 4 and meta["modules"]["decoder.layers.0.mlp.linear_fc1"] == [8, 16]

    other = add_lora(_model(), LoraConfig(seed=2, **CONFIG))  # same base, different initial adapters
    assert not torch.equal(_logits(other), _logits(model))
    common = load_lora_checkpoint(other, tmp_path / "adapters")
    assert common["iteration"] == 7
    mine, theirs = _adapters(model), _adapters(other)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert torch.equal(_logits(other), _logits(model))


def test_adapter_checkpoint_refuses_other_adapters(model_parallel, tmp_path):
    save_lora_checkpoint(add_lora(_model(), LoraConfig(**CONFIG)), tmp_path / "a")
    with pytest.raises(LoraCheckpointError, match=r"rank/alpha differ for \d+ adapter\(s\): decoder\.layers\.0\..*"
                                                  r"model rank 8 alpha 16, checkpoint rank 4 alpha 8"):
        load_lora_checkpoint(add_lora(_model(), LoraConfig(8, 16)), tmp_path / "a")
    with pytest.raises(LoraCheckpointError, match=r"adapter\(s\) for modules the model does not adapt: .*linear_fc1"):
        load_lora_checkpoint(add_lora(_model(), LoraConfig(4, 8, target_modules=["o_proj"])), tmp_path / "a")
    with pytest.raises(LoraCheckpointError, match="not a LoRA adapter checkpoint"):
        from megatron.core import dist_checkpointing

        (tmp_path / "base").mkdir()
        dist_checkpointing.save(_model().sharded_state_dict(), str(tmp_path / "base"))
        load_lora_checkpoint(add_lora(_model(), LoraConfig(**CONFIG)), tmp_path / "base")


def test_base_checkpoint_loads_with_adapters_missing_only_when_allowed(model_parallel, tmp_path):
    from megatron.core import dist_checkpointing

    base = _model(seed=5)
    (tmp_path / "base").mkdir()
    dist_checkpointing.save(base.sharded_state_dict(), str(tmp_path / "base"))
    assert not checkpoint_has_adapters(tmp_path / "base")
    model = add_lora(_model(seed=6), LoraConfig(**CONFIG))
    adapters = _adapters(model)
    # megatron-core refuses keys that are requested but not in the checkpoint (torch's CheckpointException is a
    # BaseException)
    with pytest.raises(BaseException, match=r"lora_A\.weight from model not in state dict"):
        dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "base"))
    load_base_checkpoint(model, tmp_path / "base")
    want = dict(base.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert all(torch.equal(p, adapters[n]) for n, p in lora_parameters(model))


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_megatron_lm_adapter_only_hook(model_parallel, tmp_path, backend):
    """What Megatron-LM's save_checkpoint / load_checkpoint do with the model (``sharded_state_dict``, then
    ``dist_checkpointing.load`` and ``load_state_dict``), on a model behind use_adapter_only_checkpoints."""
    from megatron.core import dist_checkpointing

    trained = add_lora(_model(seed=7, backend=backend), LoraConfig(seed=3, **CONFIG))
    use_adapter_only_checkpoints(trained)
    sharded = trained.sharded_state_dict()
    assert sharded and all(".lora_A." in k or ".lora_B." in k for k in sharded)
    (tmp_path / "iter").mkdir()
    dist_checkpointing.save({"model": sharded, "iteration": 3}, str(tmp_path / "iter"))
    assert checkpoint_has_adapters(tmp_path / "iter")

    resumed = add_lora(_model(seed=7, backend=backend), LoraConfig(seed=4, **CONFIG))  # base from "elsewhere"
    use_adapter_only_checkpoints(resumed)
    state = dist_checkpointing.load({"model": resumed.sharded_state_dict()}, str(tmp_path / "iter"))
    resumed.load_state_dict(state["model"])
    assert torch.equal(_logits(resumed), _logits(trained))
    with pytest.raises(LoraCheckpointError, match="adapter tensors differ from the model's: missing"):
        resumed.load_state_dict({k: v for k, v in list(state["model"].items())[1:]})


def test_frozen_base_has_no_grad_buffers_or_optimizer_state(model_parallel):
    """megatron-core DDP (CPU, gloo) allocates gradient buffers for the adapters only; torch AdamW keeps state for
    the adapters only. (megatron-core's own optimizers, DistributedOptimizer included, need CUDA: the GPU script
    tests/gpu/lora_train.py measures them.)"""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = add_lora(_model(), LoraConfig(**CONFIG))
    adapter_numel = sum(p.numel() for _, p in lora_parameters(model))
    total_numel = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    buffer_numel = sum(b.grad_data.numel() for b in [*ddp.buffers, *ddp.expert_parallel_buffers])
    assert {p for p in model.parameters() if p.requires_grad} == set(ddp.param_to_bucket_group)
    assert buffer_numel == adapter_numel
    assert not any(hasattr(p, "main_grad") for n, p in model.named_parameters() if "lora_" not in n)

    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ddp(ids, torch.arange(SEQ)[None].expand_as(ids), None, labels=ids).sum().backward()
    # (one rank: the backward hooks already accumulated into main_grad; finish_grad_sync needs a CUDA stream)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = p.main_grad.to(p.dtype)
    opt.step()
    state_numel = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step")
    print(f"\nadapters {adapter_numel} of {total_numel} parameters ({adapter_numel / total_numel:.1%}); DDP grad "
          f"buffer {buffer_numel} elements; AdamW state {state_numel} elements (full fine-tuning: "
          f"{2 * total_numel})")
    assert state_numel == 2 * adapter_numel
