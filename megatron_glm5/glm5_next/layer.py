"""GLM-5.3-Flash decoder layer on megatron-core: a KDA or NoPE-DSA mixer and a dense or MoE MLP, each either behind a
plain pre-norm residual or wrapped in mHC residual streams (:mod:`.mhc`).

* ``hyper_connections=False``: megatron-core's pre-norm layer (``x + mixer(norm(x))``, ``x + mlp(norm(x))``). The MTP
  layer is one (transformers has no MTP; the released one is reported as a plain NoPE-DSA + MoE block), as are the
  single-layer parity fixtures.
* ``hyper_connections=True``: the decoder layers of the real model. The hidden states are the ``[s, b, hc_mult * h]``
  streams; the layer built with ``expand_streams=True`` (global layer 0) turns the embedding into streams first.

The layer is the core's DSA decoder layer (:class:`~megatron_glm5.core.layer.DSADecoderLayer`): the DSA top-k travels
through the layer ``context`` as for GLM-5 (replay under activation recompute, IndexShare, the activation-offload
window); a KDA layer returns the ``context`` it received unchanged, so a "shared" DSA layer gets the top-k of the
nearest earlier full DSA layer across KDA layers. The MLP's SwiGLU clamp is checked on the built modules.
"""

from __future__ import annotations

import functools

from megatron.core import tensor_parallel
from megatron.core.utils import make_viewless_tensor

from ..core.layer import DSADecoderLayer
from ..core.mlp_chunks import chunked_mlp
from .mhc import HyperConnection, expand_streams
from .swiglu import check_clamped_swiglu_modules


class GLM5NextTransformerLayer(DSADecoderLayer):
    """One GLM-5.3-Flash layer (module docstring)."""

    family_title = "GLM-5.3-Flash"
    build_hint = "megatron_glm5.glm5_next.spec.build_glm5_next_block_spec"

    def __init__(self, config, *args, hyper_connections: bool = False, expand_streams: bool = False, **kwargs):
        super().__init__(config, *args, **kwargs)
        check_clamped_swiglu_modules(self.mlp, config.activation_func_clamp_value)
        self.attn_hc = self.mlp_hc = None
        self.expand_streams = expand_streams
        if hyper_connections:
            if self.recompute_pre_mlp_layernorm or config.fine_grained_activation_offloading:
                raise NotImplementedError(
                    "mHC layers do not support recompute_modules 'layernorm' or megatron-core's fine-grained "
                    "activation offloading (use full recompute, or selective 'mlp' / 'moe' / 'core_attn'; "
                    "RuntimePolicy.activation_offload offloads mHC layers)"
                )
            self.attn_hc = HyperConnection(config)
            self.mlp_hc = HyperConnection(config)
        elif expand_streams:
            raise ValueError("expand_streams needs hyper_connections=True")

    def _attention_residual(self, hidden_states, attention_mask, context, packed_seq_params):
        """Plain pre-norm residual, or the mixer inside the mHC streams."""
        if self.attn_hc is None:
            return super()._attention_residual(hidden_states, attention_mask, context, packed_seq_params)
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
        self._keep_for_split(hidden_states, inference_context, packed_seq_params)
        return self._mhc_mlp(hidden_states, padding_mask, packed_seq_params,
                             self._chunks_in_recompute(inference_context))

    def mlp_half_modules(self):
        return super().mlp_half_modules() + ([self.mlp_hc] if self.mlp_hc is not None else [])

    def _mlp_half(self, hidden_states, padding_mask):
        """The MLP half, unchunked, on a sequence chunk of its input (a split recompute's backward)."""
        if self.mlp_hc is None:
            return super()._mlp_half(hidden_states, padding_mask)
        return self._mhc_mlp(hidden_states, padding_mask, None, chunks=False)

    def _mhc_mlp(self, hidden_states, padding_mask, packed_seq_params, chunks: bool):
        """The MLP inside the mHC streams; ``chunks``: in sequence chunks (:mod:`megatron_glm5.core.mlp_chunks`)."""
        post, comb, u = self.mlp_hc(hidden_states)
        x = self.pre_mlp_layernorm(u)
        x, padding_mask, mbs = self._maybe_unflatten_for_moe(x, padding_mask, packed_seq_params)
        if self.recompute_mlp:
            out, bias = tensor_parallel.checkpoint(functools.partial(self.mlp, padding_mask=padding_mask), False, x)
        elif chunks:
            out, bias = chunked_mlp(self.mlp, x, self.config.mlp_chunks_for_training, padding_mask)
        else:
            out, bias = self.mlp(x, padding_mask=padding_mask)
        out = self._maybe_reflatten_from_moe(out, packed_seq_params, mbs)
        if bias is not None:
            out = out + bias
        streams = self.mlp_hc.merge(out, post, comb, hidden_states)
        return make_viewless_tensor(inp=streams, requires_grad=streams.requires_grad, keep_graph=True)
