"""torchrun body for the TP test of activation offload (``tests/test_offload.py``): the DSA top-k is replicated over
TP, so its host copy keeps each rank's share and the reload all-gathers them; gradients must not change."""

from __future__ import annotations

import torch

from tests.parallel_workers import make_batches, train_step_grads


def tp_offload_case(rank: int, world: int, *, raw: dict, recompute: dict) -> dict:
    from megatron_glm5 import offload
    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    arch = parse_hf_config(raw)
    common = dict(tensor_model_parallel_size=world, **recompute)
    torch.manual_seed(0)
    reference = build_model(arch, default_cpu_policy(**common))
    model = build_model(arch, default_cpu_policy(activation_offload=True, activation_offload_min_numel=0, **common))
    model.load_state_dict(reference.state_dict())
    batches = make_batches(raw["vocab_size"])
    loss_ref, grads_ref = train_step_grads(reference, batches, vocab=raw["vocab_size"])
    with offload.recording() as log:
        loss, grads = train_step_grads(model, batches, vocab=raw["vocab_size"])
    topk_bytes = raw["index_topk"] * 4 * batches[0].numel()  # int32 [T, index_topk]
    sharded = [c for c in log.copies if c["sharded"]]
    return {
        "loss_equal": loss == loss_ref,
        "grads_equal": set(grads) == set(grads_ref) and all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref),
        "sharded_copies": len(sharded),
        "sharded_topk_share": [c["host_bytes"] / c["nbytes"] for c in sharded if c["nbytes"] == topk_bytes],
        "loads": log.loads,
        "copies": len(log.copies),
    }
