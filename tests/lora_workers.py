"""torchrun bodies for the LoRA parallel tests (``tests/test_lora_parallel.py``); also run in-process at TP=1 as
the reference. Gradients and adapters cross layouts through megatron-core's ``dist_checkpointing`` and the bridge's
adapter-checkpoint gather (``bridge.adapters.write_adapter_checkpoint``), as in ``tests/parallel_workers.py``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.parallel_workers import load_weights, make_batches, tensor_sharded_state_dict, train_step_grads
from megatron_glm5.parallel import destroy_model_parallel

# B random: A gets a gradient on step 1; every adaptable linear, the merge-only dense MLP / shared experts included
LORA = dict(r=4, alpha=8, init_lora_weights=False, seed=3,
            target_modules=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                            "up_proj", "down_proj", "dense_mlp", "shared_experts"))


def _lora_only(sharded: dict) -> dict:
    return {k: v for k, v in sharded.items() if ".lora_A." in k or ".lora_B." in k}


def save_reference_weights(raw: dict, weights_dir: str) -> None:
    """A random base model saved as a dist checkpoint (1-rank model-parallel state, torn down after)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = build_model(parse_hf_config(raw), default_cpu_policy())
        dist_checkpointing.save(model.sharded_state_dict(), weights_dir)
    finally:
        destroy_model_parallel()


def _build(raw, weights, tp, ep, backend, pp=1):
    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.model import build_model, default_cpu_policy

    policy = default_cpu_policy(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                pipeline_model_parallel_size=pp)
    model = build_model(parse_hf_config(raw), policy, backend=backend)
    load_weights(model, weights)
    return model


def lora_case(rank: int, world: int, *, raw: dict, weights: str, out: str, tp: int, ep: int, backend: str,
              peft_adapter: str, pp: int = 1) -> dict:
    """One training step of LoRA (default targets: attention incl. kv_b_proj, dense MLP, shared and routed experts,
    MTP) at (TP, EP): finalised adapter gradients -> ``{out}/grads``; SGD step; adapters -> ``{out}/adapters``
    (bridge gather). Then a fresh model loads ``peft_adapter`` (a peft-made file) and reports its loss."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from bridge.adapters import load_peft_adapter, write_adapter_checkpoint
    from megatron_glm5.lora import LoraConfig, add_lora, lora_parameters
    from megatron_glm5.lora_checkpoint import save_lora_checkpoint
    from megatron_glm5.parallel import initialize_model_parallel

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                              pipeline_model_parallel_size=pp)
    try:
        model = _build(raw, weights, tp, ep, backend, pp)
        add_lora(model, LoraConfig(**LORA))
        base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
        batches = make_batches(raw["vocab_size"])
        loss, grads = train_step_grads(model, batches, vocab=raw["vocab_size"])
        Path(f"{out}/grads").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(_lora_only(tensor_sharded_state_dict(model, grads)), f"{out}/grads")
        params = [p for _, p in lora_parameters(model)]
        # SGD: Adam's first step, lr * g / (|g| + eps), turns the last-bit differences of different reduction orders
        # into lr-sized differences for the elements whose gradient is near eps; SGD compares the step itself.
        opt = torch.optim.SGD(params, lr=0.1, weight_decay=0.01)
        opt.step()
        write_adapter_checkpoint(model, f"{out}/adapters", hf_config=raw)  # the bridge's gather (PEFT export path)
        save_lora_checkpoint(model, f"{out}/ckpt")  # megatron-core's dist_checkpointing (resharded on load)
        unchanged = all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)
        replicas_equal, replicated = True, 0
        if tp > 1:  # replicated factors must be identical on every TP rank (their gradients were reduced)
            group = ps.get_tensor_model_parallel_group()
            for n, p in lora_parameters(model):
                if getattr(p, "tensor_model_parallel", False) or ".local_experts." in n:
                    continue  # sharded, or expert factors (replicated over expert-TP: checked through the gather)
                copies = [torch.empty_like(p) for _ in range(tp)]
                dist.all_gather(copies, p.detach().contiguous(), group=group)
                replicas_equal &= all(torch.equal(c, copies[0]) for c in copies)
                replicated += 1
        expert_flags = sorted({bool(getattr(p, "allreduce", True)) for n, p in lora_parameters(model)
                               if ".local_experts." in n})
        dense_flags = sorted({bool(getattr(p, "allreduce", True)) for n, p in lora_parameters(model)
                              if ".local_experts." not in n})

        peft_loss = None
        if pp == 1:  # (a pipeline needs the schedule; train_step_grads has one, this plain forward has not)
            fresh = _build(raw, weights, tp, ep, backend)
            load_peft_adapter(fresh, peft_adapter, hf_config=raw)
            fresh.eval()
            with torch.no_grad():
                ids = batches[0]
                pos = torch.arange(ids.shape[1])[None].expand_as(ids)
                peft_loss = fresh(ids, pos, None, labels=ids).float().mean().item()
        return {"loss": loss, "base_unchanged": unchanged, "replicas_equal": replicas_equal,
                "replicated_checked": replicated, "expert_allreduce": expert_flags, "dense_allreduce": dense_flags,
                "peft_loss": peft_loss}
    finally:
        destroy_model_parallel()


def load_adapter_grads(raw: dict, grads_dir: str) -> dict[str, torch.Tensor]:
    """A gradient checkpoint written by :func:`lora_case` (any layout) as TP=1 tensors by parameter name."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.lora import LoraConfig, add_lora
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel()
    try:
        model = add_lora(build_model(parse_hf_config(raw), default_cpu_policy()), LoraConfig(**LORA))
        values = {n: torch.empty_like(p) for n, p in model.named_parameters()}
        sharded = _lora_only(tensor_sharded_state_dict(model, values))
        return dict(dist_checkpointing.load(sharded, grads_dir))
    finally:
        destroy_model_parallel()


def load_adapters_single_process(raw: dict, ckpt_dir: str, backend: str) -> dict[str, torch.Tensor]:
    """An adapter checkpoint of :func:`lora_case` (any layout) loaded into a TP=1 LoRA model with
    ``load_lora_checkpoint``; returns ``{logical module.lora_X.weight: tensor}``."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.lora import LoraConfig, add_lora, lora_modules
    from megatron_glm5.lora_checkpoint import load_lora_checkpoint
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel()
    try:
        model = add_lora(build_model(parse_hf_config(raw), default_cpu_policy(), backend=backend),
                         LoraConfig(**{**LORA, "seed": 99}))
        load_lora_checkpoint(model, ckpt_dir)
        return {f"{m.lora_name}.lora_{f}.weight": getattr(m, f"lora_{f}").weight.detach().clone()
                for m in lora_modules(model) for f in ("A", "B")}
    finally:
        destroy_model_parallel()
