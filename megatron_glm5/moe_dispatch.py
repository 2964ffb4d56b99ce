"""megatron-core's all-gather token dispatcher's ``dispatch_postprocess`` without its two host syncs.

Why: megatron-core reads ``tokens_per_expert`` to the host (``.cpu()``) to size the permutation, and builds the
permuted routing probabilities with ``masked_select`` (a second sync). Each MoE layer and micro-batch stops the host
twice; the GPU then idles while the host launches the next kernels: 12 syncs, and about 14 ms of idle GPU per step
of the GLM-5 slice (issue 23's round-3 profile).

Where every expert is local (no TP / EP in the dispatcher) and every token goes to exactly ``topk`` experts (no
capacity, no padding), the permuted row count is ``tokens * topk``, known on the host. :func:`dispatch_postprocess`
then permutes with the gather-sum permutation (:mod:`megatron_glm5.kernels.moe_permute`), gathers the probabilities
in the same expert-major order with a scatter, and returns ``tokens_per_expert`` on the device. Where the routing
breaks that promise, a device-side assert stops the run instead of permuting garbage. Elsewhere, megatron-core's own
method runs.

Same results as megatron-core's method: the same permuted rows, ``reversed_local_input_permutation_mapping`` and
probabilities (bitwise), the same counts, on the device (``SequentialMLP`` reads them with ``tolist()``;
:class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP` takes them as they are). Routed through
:func:`megatron_glm5.compat.route_dispatch_postprocess` by :mod:`megatron_glm5.fusions`
(``MEGATRON_GLM5_MOE_DEVICE_COUNTS``). CPU test: ``tests/test_moe_dispatch.py``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .kernels.moe_permute import expert_rows, moe_permute_supported, permute_tokens, sorted_token_indices


def sync_free_applies(dispatcher, hidden_states: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the dispatcher's permuted row count is ``tokens * topk`` and the gather-sum permutation takes these
    tensors (else megatron-core's method runs)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from . import compat

    cfg = dispatcher.config
    routing_map = dispatcher.routing_map
    return (type(dispatcher) is MoEAllGatherTokenDispatcher and dispatcher.tp_size == 1 and dispatcher.ep_size == 1
            and routing_map is not None and routing_map.dim() == 2
            and dispatcher.num_local_experts == routing_map.shape[1]
            and hidden_states.dim() == 2 and hidden_states.shape[0] == routing_map.shape[0]
            and probs.shape == routing_map.shape
            and cfg.moe_expert_capacity_factor is None and not cfg.moe_pad_expert_input_to_capacity
            and not getattr(cfg, "moe_router_padding_for_quantization", False)
            and not getattr(cfg, "moe_router_padding_for_fp8", False)
            and not cfg.moe_permute_fusion and not cfg.deterministic_mode
            and compat.moe_permute_routed() and moe_permute_supported(hidden_states))


def dispatch_postprocess(dispatcher, hidden_states: torch.Tensor, probs: torch.Tensor,
                         original: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``MoEAllGatherTokenDispatcher.dispatch_postprocess`` (same state left on the dispatcher, same results), with
    ``tokens_per_expert`` on the device and no host sync where :func:`sync_free_applies`; else ``original``."""
    if not sync_free_applies(dispatcher, hidden_states, probs):
        return original(dispatcher, hidden_states, probs)
    dispatcher.hidden_shape_before_permute = hidden_states.shape
    local_map = dispatcher.routing_map.contiguous()
    dispatcher.local_map = local_map
    n = local_map.shape[0] * dispatcher.router_topk
    tokens_per_expert = local_map.sum(dim=0).long()
    # the promise n rests on, checked on the device (a wrong count would leave rows of the permutation unwritten)
    torch._assert_async(tokens_per_expert.sum() == n, "routing map: not exactly topk experts per token")
    # the routed permutation's own steps (fusions.permute), with the rows computed once for tokens and probabilities
    rows = expert_rows(local_map)
    sorted_indices = sorted_token_indices(rows, n)
    permuted = permute_tokens(hidden_states, sorted_indices, rows)
    dispatcher.reversed_local_input_permutation_mapping = sorted_indices
    # megatron-core's probs.T.masked_select(map.T): each routed pair's probability at its permuted row
    slot = torch.where(rows >= 0, rows.long(), n).reshape(-1)  # unrouted pairs land in a spare slot, dropped
    dispatcher.local_probs = probs.new_zeros(n + 1).scatter(0, slot, probs.reshape(-1))[:n]
    dispatcher.routing_map = None
    return permuted, tokens_per_expert, dispatcher.local_probs
