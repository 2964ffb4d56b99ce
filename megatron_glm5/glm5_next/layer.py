"""GLM-5.3-Flash decoder layer on megatron-core: a KDA or NoPE-DSA mixer and a dense or MoE MLP, each either behind a
plain pre-norm residual or wrapped in mHC residual streams (:mod:`.mhc`).

* ``hyper_connections=False``: megatron-core's pre-norm layer (``x + mixer(norm(x))``, ``x + mlp(norm(x))``). The MTP
  layer is one (transformers has no MTP; the released one is reported as a plain NoPE-DSA + MoE block), as are the
  single-layer parity fixtures.
* ``hyper_connections=True``: the decoder layers of the real model. The hidden states are the ``[s, b, hc_mult * h]``
  streams; the layer built with ``expand_streams=True`` (global layer 0) turns the embedding into streams first.

DSA top-k travels through the layer ``context`` as for GLM-5 (:mod:`megatron_glm5.layer`: replay under activation
recompute, IndexShare); a KDA layer returns the ``context`` it received unchanged, so a "shared" DSA layer gets the
top-k of the nearest earlier full DSA layer across KDA layers. The MLP's SwiGLU clamp is checked on the built modules.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import deprecate_inference_params, make_viewless_tensor

from megatron_glm5.layer import dsa_attention

from .mhc import HyperConnection, expand_streams
from .swiglu import check_clamped_swiglu_modules


class GLM5NextTransformerLayer(TransformerLayer):
    """One GLM-5.3-Flash layer (module docstring)."""

    def __init__(self, config, *args, hyper_connections: bool = False, expand_streams: bool = False, **kwargs):
        super().__init__(config, *args, **kwargs)
        check_clamped_swiglu_modules(self.mlp, config.activation_func_clamp_value)
        self.is_dsa = hasattr(self.self_attention, "computes_topk")
        if self.recompute_input_layernorm or self.config.cpu_offloading:
            raise NotImplementedError(
                "GLM-5.3-Flash layers do not support recompute of the input layernorm or CPU offloading yet"
            )
        self.attn_hc = self.mlp_hc = None
        self.expand_streams = expand_streams
        if hyper_connections:
            if self.recompute_pre_mlp_layernorm or config.fine_grained_activation_offloading:
                raise NotImplementedError(
                    "mHC layers do not support recompute_modules 'layernorm' or fine-grained activation offloading "
                    "yet (use full recompute, or selective 'mlp' / 'moe' / 'core_attn')"
                )
            self.attn_hc = HyperConnection(config)
            self.mlp_hc = HyperConnection(config)
        elif expand_streams:
            raise ValueError("expand_streams needs hyper_connections=True")

    # ---- mixer ----

    def _mix(self, x, attention_mask, context, packed_seq_params):
        """Mixer on the normalised input ``x``: ``(out, bias, context to pass on)``."""
        attention = self.self_attention
        if not self.is_dsa:  # KDA: the top-k passes through
            out, bias = attention(x, attention_mask=attention_mask, packed_seq_params=packed_seq_params)
            return out, bias, context
        return dsa_attention(self, x, context, attention_mask, packed_seq_params,
                             build_hint="megatron_glm5.glm5_next.spec.build_glm5_next_block_spec")

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
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None:
            raise NotImplementedError("GLM-5.3-Flash layers support training and forward only, not an inference cache")
        if self.attn_hc is None:
            residual = hidden_states
            out, bias, context = self._mix(self.input_layernorm(hidden_states), attention_mask, context,
                                           packed_seq_params)
            with self.bias_dropout_add_exec_handler():
                hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                    (out, bias), residual, self.hidden_dropout
                )
            return hidden_states, context
        streams = expand_streams(hidden_states, self.attn_hc.n) if self.expand_streams else hidden_states
        if streams.shape[-1] != self.attn_hc.n * self.config.hidden_size:
            raise ValueError(f"layer {self.layer_number}: expected mHC streams of width hc_mult * hidden = "
                             f"{self.attn_hc.n * self.config.hidden_size}, got {tuple(streams.shape)}")
        post, comb, u = self.attn_hc(streams)
        out, bias, context = self._mix(self.input_layernorm(u), attention_mask, context, packed_seq_params)
        if bias is not None:
            out = out + bias
        return self.attn_hc.merge(out, post, comb, streams), context

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        if self.mlp_hc is None:
            return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask,
                                        packed_seq_params=packed_seq_params)
        post, comb, u = self.mlp_hc(hidden_states)
        x = self.pre_mlp_layernorm(u)
        x, padding_mask, mbs = self._maybe_unflatten_for_moe(x, padding_mask, packed_seq_params)
        if self.recompute_mlp:
            out, bias = tensor_parallel.checkpoint(functools.partial(self.mlp, padding_mask=padding_mask), False, x)
        else:
            out, bias = self.mlp(x, padding_mask=padding_mask)
        out = self._maybe_reflatten_from_moe(out, packed_seq_params, mbs)
        if bias is not None:
            out = out + bias
        streams = self.mlp_hc.merge(out, post, comb, hidden_states)
        return make_viewless_tensor(inp=streams, requires_grad=streams.requires_grad, keep_graph=True)
