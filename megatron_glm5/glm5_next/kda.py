"""KDA (Kimi Delta Attention), GLM-5.3-Flash's linear-attention mixer, as a megatron-core module with TP-sharded heads.

Parameters (HF ``Glm5NextTextLinearAttention`` in brackets; ``D = kda_num_heads * kda_head_dim``):

==========================  ====================================  ==========================================
ours                        transformers                          tensor parallelism
==========================  ====================================  ==========================================
``linear_q/k/v``            ``q_proj / k_proj / v_proj``          column-parallel (heads)
``conv1d.weight [3, D, K]`` ``conv1d.weight [3D, 1, K]`` (fp32)   dim 1 (heads); q, k, v blocks kept apart
``linear_f_down``           ``forget_gate.f_a_proj`` (-> d)       replicated, on this rank's (SP) tokens
``linear_f_up``             ``forget_gate.f_b_proj`` (d -> D)     column-parallel
``A_log [H]``, ``dt_bias``  ``forget_gate.A_log / dt_bias`` fp32  dim 0 (heads)
``linear_beta``             ``b_proj`` (-> H)                     column-parallel
``linear_g_down / _up``     ``g_a_proj / g_b_proj``               replicated / column-parallel
``out_norm.weight [d]``     ``o_norm.weight`` (shared by heads)   replicated, gradient summed over TP
``linear_proj``             ``o_proj``                            row-parallel (reduce-scatter under SP)
==========================  ====================================  ==========================================

Under sequence parallelism the column-parallel projections all-gather the sequence (each its own, as megatron-core's
MLA up-projections do); the two low-rank down-projections run on this rank's tokens and their (and ``out_norm``'s)
weight gradients are summed over TP through their ``sequence_parallel`` tag, so TP > 1 requires sequence parallelism
(which megatron-core's AbsorbedMLA requires anyway). The recurrence runs on this rank's heads over the whole sequence.

Sequences: a bshd batch (every row one sequence), THD packing (``packed_seq_params``, ``cu_seqlens_q_padded`` when
given, as megatron-core's attention does) or a dense ``attention_mask`` whose rows allow contiguous causal ranges
(padding, documents): the convolution and the recurrence restart at every document (the boundaries come from the
layout, as for KPool: :func:`~megatron_glm5.dsa.kpool_indexer.layout_documents`). Left padding equals transformers',
which zeroes pad inputs so that the state stays zero until the first real token.

Kernel (``config.kda_kernel``): ``torch`` is :func:`~.kda_reference.chunk_kda` (fp32, autograd; CPU and the oracle);
``fla`` is flash-linear-attention's ``chunk_kda`` (``pip install flash-linear-attention``; an optional dependency,
imported on first use), called with transformers' arguments: the gate precomputed in fp32 (lower bound applied
here, not in the kernel), ``beta`` after the sigmoid, the q/k L2 norm in the kernel and ``scale = d**-0.5``. Its
Triton matmuls run in TF32 for fp32 inputs (fla forces ``tf32`` in the intra-chunk solve on sm80+), so an fp32 run
differs from the torch path at about 1e-3 relative; bf16 runs differ at bf16 rounding. ``auto`` uses fla for CUDA
tensors when it imports, else torch. The convolution, gate and output norm are always the torch code here.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ..core.hf_config import GLM5ConfigError
from megatron_glm5.dsa.kpool_indexer import layout_documents
from megatron_glm5.dsa.layout import TokenLayout

from . import kda_reference as ref

_log = logging.getLogger("megatron_glm5")


@dataclass
class KDASubmodules:
    linear_q: ModuleSpec | type
    linear_k: ModuleSpec | type
    linear_v: ModuleSpec | type
    linear_f_down: ModuleSpec | type
    linear_f_up: ModuleSpec | type
    linear_beta: ModuleSpec | type
    linear_g_down: ModuleSpec | type
    linear_g_up: ModuleSpec | type
    linear_proj: ModuleSpec | type


@functools.cache
def fla_chunk_kda():
    """flash-linear-attention's ``chunk_kda``, or None when it is not installed."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def _param_device(config):
    """Where new parameters go: the ambient device under meta initialisation (``torch.device("meta")``), else the
    CPU or the current GPU as megatron-core's own modules choose."""
    if config.init_model_with_meta_device:
        return None
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def _tp_tag(p: torch.nn.Parameter, dim: int) -> None:
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_stride = 1


class ShortConvolution(torch.nn.Module):
    """KDA's causal depthwise convolution over ``[q; k; v]``: ``weight [3, D_local, K]`` fp32 (transformers keeps
    it fp32), sharded over TP along the channel dim of each of q, k and v."""

    def __init__(self, config, channels_local: int, kernel: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3, channels_local, kernel, dtype=torch.float32,
                                                     device=_param_device(config)))
        _tp_tag(self.weight, 1)
        if config.perform_initialization and not self.weight.is_meta:
            with torch.no_grad():  # nn.Conv1d's default for a depthwise conv: U(-1/sqrt(K), 1/sqrt(K))
                self.weight.uniform_(-(kernel**-0.5), kernel**-0.5)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """``x [B, T, 3 * D_local]`` -> SiLU(conv(x)), same shape and dtype (:func:`~.kda_reference.causal_conv`)."""
        return ref.causal_conv(x, self.weight.reshape(-1, self.weight.shape[-1]), positions)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state as ps

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 1}, sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True),
        )


class GatedRMSNorm(torch.nn.Module):
    """KDA's output norm ``RMSNorm_w(o) * sigmoid(gate)`` per head (one weight shared by all heads, fp32 math:
    :func:`~.kda_reference.gated_rms_norm`). Its input is this rank's heads over the whole sequence, so under TP
    each rank holds part of the weight gradient: tagged ``sequence_parallel`` to be summed over TP."""

    def __init__(self, config, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(head_dim, dtype=config.params_dtype, device=_param_device(config)))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ref.gated_rms_norm(o, gate, self.weight, self.eps)


class KimiDeltaAttention(MegatronModule):
    """KDA mixer (module docstring). ``forward(x [s, b, h]) -> (out [s, b, h], bias)``; no cross-layer state."""

    def __init__(self, config, submodules: KDASubmodules, layer_number: int = 1, pg_collection=None, **_):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        self.layer_number = layer_number
        tp = pg_collection.tp.size() if pg_collection is not None else ps.get_tensor_model_parallel_world_size()
        cp = config.context_parallel_size
        h, d = config.kda_num_heads, config.kda_head_dim
        if h < 1 or d < 1:
            raise GLM5ConfigError(f"KDA layer {layer_number}: kda_num_heads / kda_head_dim must be positive, found "
                                  f"{h} / {d} (HF linear_num_heads / linear_head_dim)")
        if h % tp:
            raise GLM5ConfigError(f"KDA layer {layer_number}: tensor parallelism {tp} must divide kda_num_heads {h} "
                                  "(HF linear_num_heads)")
        if tp > 1 and not config.sequence_parallel:
            raise GLM5ConfigError("KDA layers under tensor parallelism need sequence_parallel=True (the shared "
                                  "down-projection and output-norm gradients are summed over TP as SP parameters)")
        if cp > 1:
            raise NotImplementedError("KDA layers do not support context parallelism yet (context_parallel_size="
                                      f"{cp}): the recurrence would need the state passed between CP ranks")
        self.heads_local = h // tp
        self.head_dim = d
        self.lower_bound = config.kda_lower_bound
        self.l2norm_eps = config.kda_qk_l2norm_eps
        self.kernel = config.kda_kernel
        dim, dim_local, hidden = h * d, self.heads_local * d, config.hidden_size
        tp_group = pg_collection.tp if pg_collection is not None else None

        def column(spec, n_in, n_out, name):
            return build_module(spec, n_in, n_out, config=config, init_method=config.init_method, gather_output=False,
                                bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=name,
                                tp_group=tp_group)

        def duplicated(spec, n_in, n_out):
            return build_module(spec, n_in, n_out, config=config, init_method=config.init_method, bias=False,
                                skip_bias_add=False, parallel_mode="duplicated")

        self.linear_q = column(submodules.linear_q, hidden, dim, "kda_q")
        self.linear_k = column(submodules.linear_k, hidden, dim, "kda_k")
        self.linear_v = column(submodules.linear_v, hidden, dim, "kda_v")
        self.conv1d = ShortConvolution(config, dim_local, config.kda_conv_kernel_dim)
        self.linear_f_down = duplicated(submodules.linear_f_down, hidden, d)
        self.linear_f_up = column(submodules.linear_f_up, d, dim, "kda_f_up")
        device = _param_device(config)
        self.A_log = torch.nn.Parameter(torch.empty(self.heads_local, dtype=torch.float32, device=device))
        self.dt_bias = torch.nn.Parameter(torch.empty(dim_local, dtype=torch.float32, device=device))
        _tp_tag(self.A_log, 0)
        _tp_tag(self.dt_bias, 0)
        self.linear_beta = column(submodules.linear_beta, hidden, h, "kda_beta")
        self.linear_g_down = duplicated(submodules.linear_g_down, hidden, d)
        self.linear_g_up = column(submodules.linear_g_up, d, dim, "kda_g_up")
        self.out_norm = GatedRMSNorm(config, d, config.layernorm_epsilon)
        self.linear_proj = build_module(submodules.linear_proj, dim, hidden, config=config,
                                        init_method=config.output_layer_init_method, bias=False,
                                        input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                        tp_comm_buffer_name="kda_proj", tp_group=tp_group)
        if config.perform_initialization and not self.A_log.is_meta:
            self._init_gate()

    @torch.no_grad()
    def _init_gate(self) -> None:
        """transformers' (fla's) initialisation: ``A_log = 0`` with the safe gate (else ``log U(1, 16)``), and
        ``dt_bias`` the inverse softplus of a log-uniform ``dt`` in ``[1e-3, 1e-1]``."""
        if self.lower_bound is not None:
            self.A_log.zero_()
        else:
            self.A_log.uniform_(1.0, 16.0).log_()
        dt = torch.empty_like(self.dt_bias).uniform_(-6.907755, -2.302585).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state as ps

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {n: p for n, p in self.named_parameters(recurse=False)}  # A_log, dt_bias: heads over TP
        dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, {n: 0 for n in own}, sharded_offsets,
                                                       tp_group=ps.get_tensor_model_parallel_group(),
                                                       dp_cp_group=dp_cp))
        return out

    # ---- forward ----

    def _recurrence(self, q, k, v, g, beta, cu_seqlens):
        """``[B, T, H_local, d]`` -> ``o [B, T, H_local, d]`` in ``q``'s dtype."""
        scale = self.head_dim**-0.5
        use_fla = self.kernel == "fla" or (self.kernel == "auto" and q.is_cuda and fla_chunk_kda() is not None)
        if not use_fla:
            return ref.chunk_kda(q, k, v, g, beta, scale=scale, l2norm_eps=self.l2norm_eps, cu_seqlens=cu_seqlens)
        kernel = fla_chunk_kda()
        if kernel is None:
            raise ImportError("kda_kernel='fla' needs flash-linear-attention (pip install flash-linear-attention)")
        if not q.is_cuda:
            raise ValueError("kda_kernel='fla' runs on CUDA tensors only; use kda_kernel='torch' (or 'auto') on CPU")
        if self.l2norm_eps != 1e-6:
            raise ValueError(f"fla's in-kernel q/k L2 norm has eps 1e-6, the config says {self.l2norm_eps}")
        o, _ = kernel(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int32))
        return o

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                packed_seq_params=None, inference_context=None, **unused):
        """``hidden_states [s, b, h]`` (``[s / tp, b, h]`` under SP; THD ``[t, 1, h]``) -> ``(output, bias)``."""
        if inference_context is not None:
            raise NotImplementedError("KDA layers support training and forward only, not an inference cache")
        x = hidden_states
        q, _ = self.linear_q(x)  # [s, b, D_local] (full sequence under SP)
        k, _ = self.linear_k(x)
        v, _ = self.linear_v(x)
        f, _ = self.linear_f_up(self.linear_f_down(x)[0])
        gate, _ = self.linear_g_up(self.linear_g_down(x)[0])
        beta, _ = self.linear_beta(x)
        s, b = q.shape[:2]
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd or attention_mask is not None:  # documents: flatten batch-major into one packed sequence
            layout = TokenLayout.build(s, b, q.device, packed_seq_params, attention_mask)
            cu = layout_documents(layout)
            positions = ref.segment_positions(cu, s * b)

            def seq(t):
                return layout.flatten(t)[None]
        else:
            cu = positions = None

            def seq(t):
                return t.transpose(0, 1)

        hl, d = self.heads_local, self.head_dim
        qkv = self.conv1d(seq(torch.cat([q, k, v], dim=-1)), positions)  # [B, T, 3 D_local]
        q, k, v = (t.unflatten(-1, (hl, d)) for t in qkv.chunk(3, dim=-1))
        g = ref.kda_gate(seq(f), self.A_log, self.dt_bias, self.lower_bound)  # fp32 [B, T, H_local, d]
        o = self._recurrence(q, k, v, g, torch.sigmoid(seq(beta)), cu)
        o = self.out_norm(o, seq(gate).unflatten(-1, (hl, d))).flatten(-2)  # [B, T, D_local]
        o = layout.unflatten(o[0]) if cu is not None else o.transpose(0, 1)
        return self.linear_proj(o)
