"""GLM-5.x transformer layer: megatron-core's ``TransformerLayer`` whose attention consumes and produces the DSA
top-k through the layer's ``context`` slot.

Why the ``context`` slot: megatron-core's ``TransformerBlock`` (and its activation-checkpointing loop) already threads
``context`` from each layer's return value into the next layer's call, as a tensor, and saves it with the
checkpointed inputs. A decoder-only GPT never uses it for cross-attention. Carrying the top-k there makes it an
explicit return value / argument between layers with per-micro-batch lifetime, that works in megatron-core's own
block (so ``pretrain_gpt.py --spec`` keeps working), survives interleaved micro-batches and recompute, and needs no
state on the config, the mask or ``packed_seq_params``:

* a "full" layer computes its top-k (or replays one, below) and returns it as ``context``;
* a "shared" layer (IndexShare) attends with the incoming ``context`` and passes it on;
* a pipeline stage starts with ``context=None``, which is why every stage must start on a full layer (checked when
  the spec is built).

Full-layer recompute: under ``recompute_granularity="full"`` megatron-core re-runs the whole layer in backward. To
keep the indexer out of that re-run, a full layer keeps the top-k it computed in the checkpoint's first (no-grad)
pass in :class:`TopKReplay` and the recompute takes it back instead of running the indexer again. Megatron's
schedules run a model chunk's backward passes in the order of its forward passes, so this is a FIFO; each entry
carries a fingerprint of the attention input that the recompute checks on device (``torch._assert_async``), so a
mismatched replay fails loudly instead of training on wrong indices.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import deprecate_inference_params


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A cheap, deterministic summary of a tensor (a strided subsample summed in fp32)."""
    flat = x.reshape(-1)
    step = max(1, flat.numel() // 4096)
    return flat[::step].float().sum()


class TopKReplay:
    """FIFO of top-k indices computed in the first pass of an activation checkpoint, consumed by its recompute."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    @staticmethod
    def in_first_pass(training: bool) -> bool:
        return training and is_checkpointing() and not torch.is_grad_enabled()

    @staticmethod
    def in_recompute(training: bool) -> bool:
        return training and is_checkpointing() and torch.is_grad_enabled()

    def push(self, topk: torch.Tensor, attn_input: torch.Tensor) -> None:
        self._pending.append((topk, _fingerprint(attn_input)))

    def pop(self, attn_input: torch.Tensor, layer_number: int) -> torch.Tensor:
        if not self._pending:
            raise RuntimeError(
                f"layer {layer_number}: activation recompute found no top-k from the forward pass to replay "
                "(a checkpointed forward ran without its first pass being recorded)"
            )
        topk, fp = self._pending.popleft()
        torch._assert_async(
            _fingerprint(attn_input) == fp,
            f"layer {layer_number}: replayed DSA top-k belongs to another micro-batch (backward order differs "
            "from forward order, or a training-mode forward ran without backward)",
        )
        return topk

    def __len__(self) -> int:
        return len(self._pending)


class GLMTransformerLayer(TransformerLayer):
    """``TransformerLayer`` with DSA top-k routed through ``context`` (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self.self_attention, "computes_topk"):
            raise TypeError(f"GLMTransformerLayer needs a GLM DSA attention, got {type(self.self_attention).__name__}")
        if self.recompute_input_layernorm or self.config.cpu_offloading:
            raise NotImplementedError(
                "GLM-5.x layers do not support recompute of the input layernorm or CPU offloading yet"
            )
        self._topk_replay = TopKReplay()

    def _forward_attention(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        rotary_pos_cos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        *,
        inference_params=None,
    ):
        """Input norm -> DSA attention (top-k in via ``context``, out as the returned context) -> residual add."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None:
            raise NotImplementedError("GLM-5.x DSA layers support training and forward only, not an inference cache")
        attention = self.self_attention
        residual = hidden_states
        x = self.input_layernorm(hidden_states)

        if attention.computes_topk:
            topk_in = self._topk_replay.pop(x, self.layer_number) if TopKReplay.in_recompute(self.training) else None
        else:
            if context is None:
                raise RuntimeError(
                    f"layer {self.layer_number} is an IndexShare 'shared' layer but received no top-k: the previous "
                    "'full' layer must run earlier in the same pipeline stage and pass it through the layer "
                    "'context' (build the model with megatron_glm5.spec.get_glm5_spec)"
                )
            topk_in = context

        out, bias, topk = attention(
            x,
            attention_mask=attention_mask,
            packed_seq_params=packed_seq_params,
            dsa_topk=topk_in,
        )
        if attention.computes_topk and TopKReplay.in_first_pass(self.training):
            self._topk_replay.push(topk, x)

        with self.bias_dropout_add_exec_handler():
            hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                (out, bias), residual, self.hidden_dropout
            )
        return hidden_states, topk
