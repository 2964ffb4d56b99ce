"""torchrun bodies for ``tests/test_rl_parallel.py``: :func:`megatron_glm5.rl.compute_logprobs` and
:func:`~megatron_glm5.rl.logprobs_forward_step` with and without replay under TP = 2 + SP, CP = 2 (tilelang, bshd) and
PP = 2 (a hand-written two-stage forward, since megatron-core's schedules allocate on ``device="cuda"``).

Each body returns, per batch, the log-probs / entropies of the full packed batch as lists (identical on every rank that
has them) and the replay statistics."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _batches(choices_path: str):
    """[(ids, cu, choices)]: the batches the parent captured choices for (see test_rl_parallel.py)."""
    return torch.load(choices_path)


def _run_batches(model, batches, *, replay_mtp: bool = True) -> list[dict]:
    from megatron_glm5.rl import ReplayStats, compute_logprobs

    out = []
    with torch.no_grad():
        for ids, cu, choices in batches:
            lp, ent = compute_logprobs(model, ids, cu, return_entropy=True)
            stats = ReplayStats()
            topk = choices["indexer_topk"] if replay_mtp else choices["indexer_topk"][:-1]
            lp_r = compute_logprobs(model, ids, cu, topk_replay=topk, routing_replay=choices["routed_experts"],
                                    replay_stats=stats)
            summary = stats.summary()
            out.append(dict(lp=lp.tolist(), ent=ent.tolist(), lp_replay=lp_r.tolist(),
                            overlap={str(k): v["mean"] for k, v in summary["indexer_overlap"].items()},
                            mismatch={str(k): v["fraction"] for k, v in summary["routing_mismatch"].items()}))
    return out


def tp_sp_case(rank: int, world: int, *, path: str, choices_path: str, backend: str) -> dict:
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_hf_pretrained(path, backend=backend)
    assert model.config.sequence_parallel
    return {"batches": _run_batches(model, _batches(choices_path))}


def cp_case(rank: int, world: int, *, path: str, choices_path: str) -> dict:
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel(context_parallel_size=2)
    policy = RuntimePolicy(context_parallel_size=2, params_dtype=torch.float32, use_cpu_initialization=True,
                           perform_initialization=False, dsa_kernel_backend="none")
    model = from_hf_pretrained(path, backend="tilelang", policy=policy)
    result = {"batches": _run_batches(model, _batches(choices_path))}
    # gradients: each CP rank's partial gradients sum to the single-process gradient
    ids, cu, _ = _batches(choices_path)[0]
    from megatron_glm5.rl import compute_logprobs

    model.zero_grad(set_to_none=True)
    w = torch.randn(ids.numel(), generator=torch.Generator().manual_seed(9))
    (compute_logprobs(model, ids, cu) * w).sum().backward()
    g = model.get_parameter("decoder.layers.2.self_attention.linear_proj.weight").grad.clone()
    dist.all_reduce(g)
    result["grad"] = g.reshape(-1)[:64].tolist()
    return result


def pp_case(rank: int, world: int, *, path: str, choices_path: str) -> dict:
    """Two stages, forward only: stage 0 sends its hidden states, stage 1 returns the log-probs from its loss_func."""
    from megatron.core import parallel_state as ps

    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.parallel import initialize_model_parallel
    from megatron_glm5.rl import ReplayStats, RolloutMicroBatch, logprobs_forward_step

    initialize_model_parallel(pipeline_model_parallel_size=2)
    model = from_hf_pretrained(path)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    group = ps.get_pipeline_model_parallel_group()
    out = []
    with torch.no_grad():
        for ids, cu, choices in _batches(choices_path):
            row = {}
            for name, mb in (("lp", RolloutMicroBatch(input_ids=ids, cu_seqlens=cu)),
                             ("lp_replay", RolloutMicroBatch(input_ids=ids, cu_seqlens=cu,
                                                             topk_replay=choices["indexer_topk"],
                                                             routing_replay=choices["routed_experts"]))):
                stats = ReplayStats()
                if not first:
                    inp = torch.empty(ids.numel(), 1, model.config.hidden_size)
                    dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
                    model.set_input_tensor(inp)
                output, loss_func = logprobs_forward_step(iter([mb]), model, return_entropy=True, replay_stats=stats)
                if not last:
                    dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=group)
                else:
                    data = loss_func(output, non_loss_data=True)
                    row[name] = data["logprobs"].tolist()
                    if name == "lp":
                        row["ent"] = data["entropy"].tolist()
                summary = stats.summary()
                row.setdefault("overlap", {}).update({str(k): v["mean"] for k, v in summary["indexer_overlap"].items()})
                row.setdefault("mismatch", {}).update(
                    {str(k): v["fraction"] for k, v in summary["routing_mismatch"].items()})
            out.append(row)
    return {"batches": out, "layers": [layer.layer_number - 1 for layer in model.decoder.layers], "last": last}


def flash_tp_sp_case(rank: int, world: int, *, path: str, payload: str, ids: list, cu: list) -> dict:
    """GLM-5.3-Flash at TP = 2 + SP: log-probs with transformers' recorded choices replayed (tests/test_rl_flash.py)."""
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.parallel import initialize_model_parallel
    from megatron_glm5.rl import ReplayStats, compute_logprobs

    initialize_model_parallel(tensor_model_parallel_size=2)
    model = from_hf_pretrained(path)
    assert model.config.sequence_parallel
    data = torch.load(payload)
    stats = ReplayStats()
    with torch.no_grad():
        lp = compute_logprobs(model, torch.tensor(ids), torch.tensor(cu, dtype=torch.int32),
                              topk_replay=data["topk"], routing_replay=data["experts"], replay_stats=stats)
    summary = stats.summary()
    return dict(lp_replay=lp.tolist(), overlap={str(k): v["mean"] for k, v in summary["indexer_overlap"].items()},
                mismatch={str(k): v["fraction"] for k, v in summary["routing_mismatch"].items()})
