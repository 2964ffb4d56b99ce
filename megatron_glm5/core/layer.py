"""The DSA decoder-layer base of every family (:class:`DSADecoderLayer`): megatron-core's ``TransformerLayer``
whose DSA attention consumes and produces the top-k through the layer's ``context`` slot, with the recompute replay
of that top-k and the activation-offload window. GLM-5.x's layer (:mod:`megatron_glm5.glm5.layer`) and
GLM-5.3-Flash's (:mod:`megatron_glm5.glm5_next.layer`) are its subclasses; a mixer without DSA (Flash's KDA)
passes the incoming top-k on unchanged.

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
keep the indexer out of that re-run, a full layer stores the top-k it computed in the checkpoint's first (no-grad)
pass *on that checkpoint's autograd node* (the ``ctx`` of megatron-core's ``CheckpointFunction``), keyed by the
layer, and the recompute of the same node takes it back (:func:`stash_topk` / :func:`replayed_topk`). So:

* an entry belongs to exactly one micro-batch and layer by construction (each checkpoint call is its own node),
  whatever the schedule's order of forwards and backwards (1F1B, interleaved VPP);
* it lives exactly as long as the graph that can replay it: a training-mode forward without a backward (an RL
  log-prob pass under ``torch.no_grad()``, an aborted step) frees its entries with its graph, so nothing goes stale,
  no step has to "start clean" and there is nothing to reset;
* each entry carries a fingerprint of the attention input, compared within a tolerance on device
  (``torch._assert_async``) when it is replayed: recomputed inputs may differ in the last bits (MoE's
  ``scatter_add_`` is not bitwise deterministic on GPU) but another micro-batch's input fails the check;
* with activation offload on (:mod:`megatron_glm5.offload`) the kept top-k is held through the layer's offload window:
  it waits on the host (each TP rank keeping its share) and comes back when the recompute replays it.

megatron-core gives a checkpointed function no handle on its node, so the node is found as the ``ctx`` local of the
innermost ``CheckpointFunction.forward`` / ``.backward`` frame on this thread's stack (a read-only lookup of a few
frames). Under another checkpoint implementation (no such frame), the recompute runs the indexer again: correct, only
slower.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

import torch
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import deprecate_inference_params

from .. import compat, fusions, offload
from ..compat import checkpoint_node as _checkpoint_node
from ..device_check import check_on_device
from . import split_recompute
from .mlp_chunks import check_chunkable, forward_mlp_in_chunks, random_modules

_STASH = "_glm5_dsa_topk"  # attribute of the checkpoint node: {layer module: (topk, fingerprint)}
# (layer, its stash entry) while a split recompute (core/split_recompute.py) re-runs that layer's attention half in
# the backward: the split takes the entry off the node in the recompute's forward (the frame walk finds the node
# there, as in every recompute), so the deferred attention half is handed it explicitly
_SPLIT_REPLAY: ContextVar[Optional[tuple]] = ContextVar("glm5_split_topk_replay", default=None)
FINGERPRINT_GROUPS = 64
FINGERPRINT_RTOL = 2e-2  # per group, relative to the group's sum of |x|


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[2, FINGERPRINT_GROUPS]``: sums and sums of ``|x|`` of a strided subsample of ``x`` split into groups.
    Last-bit differences move each group's sum by far less than ``FINGERPRINT_RTOL`` of its ``|x|`` sum; another
    micro-batch's input moves every group by about ``1 / sqrt(group size)`` of it."""
    flat = x.detach().reshape(-1)
    n = FINGERPRINT_GROUPS * 64
    step = max(1, flat.numel() // n)
    sample = flat[::step][:n].float()
    if sample.numel() < n:
        sample = torch.cat([sample, sample.new_zeros(n - sample.numel())])
    groups = sample.view(FINGERPRINT_GROUPS, -1)
    return torch.stack([groups.sum(-1), groups.abs().sum(-1)])


def fingerprints_match(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Device bool: every group of ``a`` within ``FINGERPRINT_RTOL`` of ``b``'s."""
    return ((a[0] - b[0]).abs() <= FINGERPRINT_RTOL * b[1] + 1e-6).all()


def in_first_pass(training: bool) -> bool:
    """Inside the no-grad first pass of a megatron-core activation checkpoint."""
    return training and is_checkpointing() and not torch.is_grad_enabled()


def in_recompute(training: bool) -> bool:
    """Inside the recompute of a megatron-core activation checkpoint (its backward)."""
    return training and is_checkpointing() and torch.is_grad_enabled()


def stash_topk(layer: torch.nn.Module, topk: torch.Tensor, attn_input: torch.Tensor) -> bool:
    """Keep ``topk`` on the running checkpoint's node for its recompute; False when there is no such node."""
    node = _checkpoint_node()
    if node is None:
        return False
    stash = getattr(node, _STASH, None)
    if stash is None:
        stash = {}
        setattr(node, _STASH, stash)
    stash[layer] = (offload.hold(topk), fingerprint(attn_input))
    return True


def take_topk_entry(layer: torch.nn.Module) -> Optional[tuple]:
    """The ``(held top-k, fingerprint)`` this layer stashed in the first pass of the checkpoint being recomputed, or
    None."""
    node = _checkpoint_node()
    return getattr(node, _STASH, {}).pop(layer, None) if node is not None else None


def replayed_topk(layer: torch.nn.Module, attn_input: torch.Tensor, layer_number: int) -> Optional[torch.Tensor]:
    """The top-k this layer stashed in the first pass of the checkpoint being recomputed (None if there is none:
    the caller then runs the indexer again)."""
    split = _SPLIT_REPLAY.get()
    entry = split[1] if split is not None and split[0] is layer else take_topk_entry(layer)
    if entry is None:
        return None
    held, fp = entry
    topk = offload.release(held)
    check_on_device(
        fingerprints_match(fingerprint(attn_input), fp),
        f"layer {layer_number}: the recomputed attention input does not match the one whose DSA top-k is being "
        "replayed (beyond last-bit differences)",
    )
    return topk


def dsa_attention(layer, x: torch.Tensor, context: Optional[torch.Tensor], attention_mask, packed_seq_params, *,
                  build_hint: str):
    """``layer.self_attention`` on the normalised input ``x`` with the top-k dataflow of this module's docstring: a
    full layer computes its top-k (or takes back the one it stashed, in a recompute) and stashes it in a checkpoint's
    first pass; a shared layer uses the incoming ``context``. Returns ``(out, bias, topk to pass on)``."""
    attention = layer.self_attention
    if attention.computes_topk:
        topk_in = replayed_topk(layer, x, layer.layer_number) if in_recompute(layer.training) else None
    else:
        if context is None:
            raise RuntimeError(
                f"layer {layer.layer_number} is an IndexShare 'shared' layer but received no top-k: an earlier "
                f"'full' layer must run in the same pipeline stage and pass it through the layer 'context' (build the "
                f"model with {build_hint})"
            )
        topk_in = context
    out, bias, topk = attention(
        x,
        attention_mask=attention_mask,
        packed_seq_params=packed_seq_params,
        dsa_topk=topk_in,
        dsa_topk_trusted=True,  # this model's own: the previous full layer's, or this layer's first pass
    )
    if attention.computes_topk and in_first_pass(layer.training):
        stash_topk(layer, topk, x)
    return out, bias, topk


_LAYER_ARGS = ("hidden_states", "attention_mask", "context")  # TransformerLayer.forward's leading parameters


def _layer_arg(name: str, args: tuple, kwargs: dict):
    if name in kwargs:
        return kwargs[name]
    i = _LAYER_ARGS.index(name)
    return args[i] if len(args) > i else None


class DSADecoderLayer(TransformerLayer):
    """``TransformerLayer`` with the DSA top-k routed through ``context`` (module docstring), a mixer that may be DSA
    attention or not, and optionally an activation-offload window around each call (``activation_offload``,
    :mod:`megatron_glm5.offload`). Subclasses set :attr:`family_title` and :attr:`build_hint` (for errors) and may
    override :meth:`_attention_residual` (how the mixer's output joins the residual stream)."""

    family_title = "DSA"
    build_hint = "megatron_glm5.model.build_model"

    def __init__(self, *args, activation_offload: Optional[offload.ActivationOffload] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation_offload = activation_offload
        self.is_dsa = hasattr(self.self_attention, "computes_topk")
        # the recompute split at the attention / MLP boundary (core/split_recompute.py), with mlp_chunks_for_training
        self.split_recompute = fusions.enabled(fusions.SPLIT_RECOMPUTE_ENV)
        # the split's chunk count from each call's length (split_recompute.split_chunks; on by default)
        self.chunks_by_length = fusions.enabled(fusions.MLP_CHUNKS_BY_LENGTH_ENV)
        if self.recompute_input_layernorm or self.config.cpu_offloading:
            raise NotImplementedError(
                f"{self.family_title} layers do not support recompute of the input layernorm or CPU offloading yet"
            )
        if self.config.mlp_chunks_for_training > 1:
            check_chunkable(self.config)
        # the MoE dispatcher's per-call tensors would keep this call's graph (and, in a recompute, this layer's input
        # and its gradient) alive until the next step
        compat.release_dispatcher_graph_after_experts(self.mlp)
        if activation_offload is not None and getattr(self.config, "cuda_graph_impl", "none") not in (None, "none"):
            raise NotImplementedError("activation offload moves tensors at run time and cannot be captured in a CUDA "
                                      "graph: use cuda_graph_impl='none' with it")

    def forward(self, *args, **kwargs):
        """megatron-core's layer forward, inside this call's offload window when offload is on: a window of its own
        in a forward that builds a graph, the checkpoint chunk's window in the first pass of full recompute (what
        the checkpoint keeps: the chunk's layer input and incoming top-k, plus the top-k kept for the replay), none
        in the recompute (what it saves is used at once) or without gradients. In the recompute of a layer whose
        first pass kept its MLP input, the split recompute instead (:mod:`megatron_glm5.core.split_recompute`)."""
        if not args and in_recompute(self.training) and self.split_recompute:
            kept = split_recompute.take_mlp_input(self)  # kept by this layer's first pass on this checkpoint
            if kept is not None:
                return self._split_recompute(kept, kwargs)
        settings = self.activation_offload
        if settings is None or not self.training or in_recompute(True):
            return super().forward(*args, **kwargs)
        offload.warn_if_unscoped()
        hidden_states = _layer_arg("hidden_states", args, kwargs)
        context = _layer_arg("context", args, kwargs)
        if in_first_pass(True):
            window = offload.chunk_window(settings, _checkpoint_node(), name=f"chunk from layer {self.layer_number}",
                                          inputs=(hidden_states, context))
        elif torch.is_grad_enabled():
            # the layer's other inputs (mask, RoPE, padding mask) stay: the caller keeps them alive anyway
            keep = [v for k, v in kwargs.items() if k not in ("hidden_states", "context")]
            keep += [a for i, a in enumerate(args) if i >= len(_LAYER_ARGS) or _LAYER_ARGS[i] == "attention_mask"]
            window = offload.window(settings, name=f"layer {self.layer_number}", module=self, keep=tuple(keep))
        else:
            return super().forward(*args, **kwargs)
        with window:
            return super().forward(*args, **kwargs)

    def _split_recompute(self, kept: "split_recompute.Kept", kwargs: dict):
        """This layer's recompute split at the attention / MLP boundary (:mod:`megatron_glm5.core.split_recompute`):
        ``(placeholder output, incoming context)``: the output is only backpropagated from (its value is never
        read); the int top-k context is filtered out by megatron-core's checkpoint backward."""
        entry = take_topk_entry(self) if self.is_dsa and self.self_attention.computes_topk else None

        def attention(x: torch.Tensor) -> torch.Tensor:
            token = _SPLIT_REPLAY.set((self, entry))
            try:
                return self._forward_attention(**{**kwargs, "hidden_states": x})[0]
            finally:
                _SPLIT_REPLAY.reset(token)

        out = split_recompute.split_layer_recompute(self, kept, kwargs, attention, self._mlp_half)
        return out, kwargs.get("context")

    def _keep_for_split(self, hidden_states: torch.Tensor, inference_context, packed_seq_params) -> bool:
        """In a checkpoint's first pass, keep the MLP half's input where the recompute will be split (True then)."""
        if not (self.split_recompute and inference_context is None and in_first_pass(self.training)):
            return False
        node = _checkpoint_node()
        if node is None or not split_recompute.split_applies(self, node, packed_seq_params):
            return False
        split_recompute.keep_mlp_input(self, node, hidden_states)
        return True

    def _chunks_in_recompute(self, inference_context) -> bool:
        """Run the MLP in chunks recomputed again in the backward (:mod:`megatron_glm5.core.mlp_chunks`): in a
        layer's recompute with ``mlp_chunks_for_training > 1``, unless the MLP draws random numbers."""
        return (self.config.mlp_chunks_for_training > 1 and inference_context is None
                and in_recompute(self.training) and not random_modules(self.mlp))

    def mlp_half_modules(self) -> list[torch.nn.Module]:
        """The modules of the MLP half (their parameters' gradients come from it in a split recompute)."""
        return [self.pre_mlp_layernorm, self.mlp]

    def _mlp_half(self, hidden_states: torch.Tensor, padding_mask) -> torch.Tensor:
        """The MLP half, unchunked, on a sequence chunk of its input (a split recompute's backward)."""
        return forward_mlp_in_chunks(self, hidden_states, padding_mask, None, chunks=1)

    def _forward_mlp(self, hidden_states: torch.Tensor, inference_context=None, padding_mask=None,
                     packed_seq_params=None):
        """megatron-core's MLP half; in the recompute of a layer with ``mlp_chunks_for_training > 1``, the MLP
        in sequence chunks recomputed again in the backward (:mod:`megatron_glm5.core.mlp_chunks`)."""
        if self._keep_for_split(hidden_states, inference_context, packed_seq_params) and self.chunks_by_length:
            # the first pass in the split's own chunk count (megatron-core's branch would run mlp_chunks_for_training)
            return forward_mlp_in_chunks(self, hidden_states, padding_mask, packed_seq_params,
                                         chunks=split_recompute.split_chunks(self, hidden_states))
        if self._chunks_in_recompute(inference_context):
            return forward_mlp_in_chunks(self, hidden_states, padding_mask, packed_seq_params)
        return super()._forward_mlp(hidden_states, inference_context=inference_context, padding_mask=padding_mask,
                                    packed_seq_params=packed_seq_params)

    def _mix(self, x: torch.Tensor, attention_mask, context: Optional[torch.Tensor], packed_seq_params):
        """The mixer on the normalised input ``x``: ``(out, bias, context to pass on)``. DSA attention takes and
        gives the top-k (:func:`dsa_attention`); any other mixer passes the incoming ``context`` on unchanged."""
        if not self.is_dsa:
            out, bias = self.self_attention(x, attention_mask=attention_mask, packed_seq_params=packed_seq_params)
            return out, bias, context
        return dsa_attention(self, x, context, attention_mask, packed_seq_params, build_hint=self.build_hint)

    def _attention_residual(self, hidden_states: torch.Tensor, attention_mask, context, packed_seq_params):
        """Pre-norm residual: input norm -> mixer -> bias-dropout-add. Returns ``(hidden_states, context)``."""
        residual = hidden_states
        out, bias, context = self._mix(self.input_layernorm(hidden_states), attention_mask, context,
                                       packed_seq_params)
        with self.bias_dropout_add_exec_handler():
            hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                (out, bias), residual, self.hidden_dropout
            )
        return hidden_states, context

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
        """megatron-core's attention half, with the top-k in through ``context`` and out as the returned context."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None:
            raise NotImplementedError(f"{self.family_title} layers support training and forward only, not an "
                                      "inference cache")
        return self._attention_residual(hidden_states, attention_mask, context, packed_seq_params)
