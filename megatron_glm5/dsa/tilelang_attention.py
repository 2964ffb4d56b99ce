"""The ``tilelang`` backend: ``TileLangMLASelfAttention``, fused absorbed-latent DSA on our TileLang kernels.

Per layer (single-device math below; parallelism enters only through the marked collectives):

1. ``q_c = q_layernorm(q_down(x))``, ``[c | k_pe] = kv_down(x)``, ``c = kv_layernorm(c)`` on this rank's rows (the
   down-projections are replicated over TP, like TE's duplicated ``TELinear``).
2. ``q = q_up(q_c)`` for this rank's heads (column-parallel; under SP it all-gathers the rows itself); ``c`` and
   ``k_pe`` are all-gathered along the sequence under SP (reduce-scatter in backward).
3. RoPE, interleaved pairs, in fp32 with one cast (as sglang/vLLM apply it), on ``q_pe`` and ``k_pe``.
4. Absorption with ``W_kc``/``W_vc`` taken from ``linear_kv_up_proj.weight`` on every call (:meth:`kv_up_weights`;
   never a cached copy, so a LoRA delta folded in there reaches both with gradients): ``q = [q_nope . W_kc | q_pe]``
   and ``kv = [c | k_pe]`` (d = kv_lora_rank + rope = 576 for GLM-5; 512 for the NoPE GLM-5.3-Flash, whose rope
   parts are empty and skip step 3), softmax scale from megatron-core's MLA.
5. Top-k: a shared layer uses the incoming one; a full layer runs the indexer with GLM numerics (normalised q latent,
   fp32 LayerNorm k_norm eps 1e-6, fp32 head weights, ReLU, no Hadamard). Under SP the indexer's compact outputs
   (q_i, k_i, w: 4096 + 128 + 32 values per token for GLM-5) are all-gathered instead of the hidden states and q
   latent (8192 per token), with autograd-aware collectives.
6. Sparse MLA over the top-k (:func:`megatron_glm5.kernels.sparse_mla`), de-absorption with ``W_vc``, ``linear_proj``.

Context parallelism (megatron-core's load-balanced zigzag split, bshd): queries stay on their CP rank, the latent keys
and the indexer keys are all-gathered across the CP group and put back in sequence order (:class:`SequenceGather`),
and each query row's causal range and RoPE position come from its global position (``TokenLayout.build_zigzag_cp``).

On CPU, or for shapes our kernels do not cover, steps 5-6 run :mod:`megatron_glm5.dsa.reference` (the kernels'
oracle), so CI tests this module's logic against the ``megatron`` backend. Training and forward only; THD input with
context parallelism and YaRN RoPE are refused with a clear error.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules

from ..fusions import FUSED_ROPE_ENV, GROUPED_SPARSE_MLA_ENV, KEY_BLOCK_DKV_ENV, enabled, rope_cat
from . import reference
from .attention import DSACoreAttention, rebuild_down_projections, with_mcore_down_projections
from .hooks import linear_weight, mark_replicated
from .indexer_training import main_loss_backward_scale
from .layout import TokenLayout
from .loss_after_attention import LossAfterAttention
from .rope import rope_cos_sin

@functools.cache
def _tilelang_available() -> bool:
    return importlib.util.find_spec("tilelang") is not None


def _kernels_apply(t: torch.Tensor) -> bool:
    """Our kernels run on CUDA tensors in bf16 (their only dtype); an fp32 (or fp16) model on CUDA takes the exact
    torch path instead, with one warning, rather than failing or silently computing in lower precision."""
    if not (t.is_cuda and _tilelang_available()):
        return False
    if t.dtype != torch.bfloat16:
        _warn_kernel_dtype(t.dtype)
        return False
    return True


@functools.cache
def _warn_kernel_dtype(dtype: torch.dtype) -> None:
    warnings.warn(
        f"TileLangMLASelfAttention: the TileLang DSA kernels run in bf16 and the model is {dtype}; using the chunked "
        "torch path (exact, slower). Build the model with params_dtype=torch.bfloat16 to use the kernels.",
        stacklevel=3,
    )


@dataclass(frozen=True, slots=True)
class SequenceGather:
    """Autograd-aware all-gathers along the sequence (reduce-scatter in backward): within the TP group under sequence
    parallelism, and for key-side tensors also across the CP group, put back in sequence order."""

    tp_group: Optional[torch.distributed.ProcessGroup]  # None without sequence parallelism
    cp_group: Optional[torch.distributed.ProcessGroup]  # None without context parallelism
    key_order: Optional[torch.Tensor]  # TokenLayout.key_order under CP

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[s_l, b, ...]`` SP shard -> this CP rank's rows ``[s, b, ...]``."""
        return t if self.tp_group is None else gather_from_sequence_parallel_region(t, group=self.tp_group)

    def keys(self, t: torch.Tensor) -> torch.Tensor:
        """``[s_l, b, ...]`` -> every row of the sequence, in order."""
        t = self.rows(t)
        if self.cp_group is None:
            return t
        return gather_from_sequence_parallel_region(t, group=self.cp_group).index_select(0, self.key_order)


class TileLangSparseAttention(DSACoreAttention):
    """Core of the ``tilelang`` backend: top-k selection and sparse MLA on our kernels (module docstring)."""

    supports_context_parallel = True
    # The sparse indexer loss in the backward, with the target from the attention backward's P
    # (:mod:`megatron_glm5.dsa.loss_after_attention`): None = where our fused loss kernels run; True/False forces it.
    loss_after_attention: Optional[bool] = None

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.index_heads = config.dsa_indexer_n_heads
        self.index_dim = config.dsa_indexer_head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        self.fused_rope = enabled(FUSED_ROPE_ENV)
        self.grouped_sparse = enabled(GROUPED_SPARSE_MLA_ENV)
        self.key_block_dkv = enabled(KEY_BLOCK_DKV_ENV)

    def indexer_rows(self, x: torch.Tensor, q_c: torch.Tensor, layout: TokenLayout, rope_q, rope_k,
                     gather: "SequenceGather") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indexer on this rank's rows (``x [s_l, b, h]``, normalised ``q_c [s_l, b, q_lora]``, both detached: the LM
        loss never reaches the indexer), its compact outputs gathered along the sequence (autograd-aware) and
        flattened: ``(q [T_q, Hi, Di], k [T_k, Di], w [T_q, Hi] fp32)``, RoPE applied."""
        if self.indexer is None:
            raise RuntimeError(f"layer {self.layer_number} is an IndexShare 'shared' layer and has no indexer")
        idx = self.indexer
        x, q_c = x.detach(), q_c.detach()
        s_l, b = x.shape[:2]
        q, _ = idx.linear_wq_b(q_c)
        q = q.view(s_l, b, self.index_heads, self.index_dim)
        k, _ = idx.linear_wk(x)
        k = idx.k_norm(k.float())  # fp32 LayerNorm, eps 1e-6
        scale = self.index_heads**-0.5 * self.index_dim**-0.5
        w = F.linear(x.float(), linear_weight(idx.linear_weights_proj).float()) * scale  # fp32 head weights
        q, w, k = layout.flatten(gather.rows(q)), layout.flatten(gather.rows(w)), layout.flatten_keys(gather.keys(k))
        r, fused = self.rope_dim, self.fused_rope
        q = rope_cat(q[..., :r], q[..., r:], *rope_q, rope_first=True, fused=fused)  # [T_q, Hi, Di]
        k = rope_cat(k[..., :r], k[..., r:], *rope_k, rope_first=True, out_dtype=q.dtype, fused=fused)  # [T_k, Di]
        return q, k, w

    @torch.no_grad()
    def select(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """Causal top-k of flattened indexer rows: int32 ``[T_q, index_topk]`` key rows, -1 tail padding."""
        if _kernels_apply(q):
            from .. import kernels

            topk = kernels.indexer_topk(q.contiguous(), k.contiguous(), w.contiguous(), layout.starts, layout.ends,
                                        self.index_topk)
        else:
            topk = reference.indexer_topk(q, k, w, layout.starts, layout.ends, self.index_topk)
        return reference.pad_topk(topk, self.index_topk)

    @torch.no_grad()
    def compute_topk(self, x: torch.Tensor, q_c: torch.Tensor, layout: TokenLayout, rope_q, rope_k,
                     gather: "SequenceGather") -> torch.Tensor:
        """Indexer (no gradient) then causal top-k."""
        return self.select(*self.indexer_rows(x, q_c, layout, rope_q, rope_k, gather), layout)

    def indexer_loss(self, qi, ki, w, query, kv, topk, layout: TokenLayout, lse: Optional[torch.Tensor] = None):
        """The sparse loss on our fused kernels when they take the shapes (the target from the attention's own LSE
        ``lse [T, H]`` when given, else from a no-grad attention forward), otherwise the torch oracle
        (:meth:`DSACoreAttention.indexer_loss`: the dense warm-up loss, CPU, fp32)."""
        if not (self.loss.sparse and _fused_indexer_loss_applies(qi, query, topk)):
            return super().indexer_loss(qi, ki, w, query, kv, topk, layout)
        from .. import kernels
        from . import indexer_loss

        query, kv = query.detach().contiguous(), kv.detach().contiguous()
        if lse is None:
            with torch.no_grad():
                lse = kernels.sparse_mla_with_lse(query, kv, topk, self.softmax_scale, self.config.kv_lora_rank)[1]
        target = indexer_loss.finish_target_(kernels.sparse_attention_target(query, kv, topk, lse, self.softmax_scale),
                                             self.loss_tp_group())
        return self.fused_loss(qi, ki, w, topk, target, self.loss_rows(layout))

    def fused_loss(self, qi, ki, w, topk, target, rw) -> torch.Tensor:
        """The sparse loss on our fused kernels (the contract of ``indexer_loss.sparse_indexer_loss``)."""
        from .. import kernels

        return kernels.fused_sparse_indexer_loss(qi.contiguous(), ki.contiguous(), w.float().contiguous(), topk,
                                                 target, rw, deterministic=self.config.deterministic_mode)

    def loss_after(self, qi, ki, w, query, topk, d_v: int) -> Optional[LossAfterAttention]:
        """This forward's sparse loss computed in the backward from the attention backward's probabilities
        (:mod:`megatron_glm5.dsa.loss_after_attention`), or None where it is computed in the forward instead: not
        the sparse stage, a frozen indexer, or (by default) where our fused loss kernels or our sparse-MLA kernels
        (which leave the target) do not run."""
        if not self.loss.sparse or not (qi.requires_grad or ki.requires_grad or w.requires_grad):
            return None
        fused = _fused_indexer_loss_applies(qi, query, topk)
        default = fused and _attention_kernels_apply(query, d_v)
        if not (default if self.loss_after_attention is None else self.loss_after_attention):
            return None
        from . import indexer_loss

        loss_fn = self.fused_loss if fused else indexer_loss.sparse_indexer_loss
        return LossAfterAttention(loss_fn=loss_fn, scale_fn=main_loss_backward_scale, log_fn=self.log_loss,
                                  tp_group=self.loss_tp_group())

    def loss_rows(self, layout: TokenLayout) -> torch.Tensor:
        """Row weights of the loss: ``coeff / N`` on the ``N`` valid query rows (``coeff`` in per-token mode)."""
        from . import indexer_loss

        return indexer_loss.row_weights(indexer_loss.valid_query_rows(layout.starts, layout.ends), self.loss.coeff,
                                        self.loss.per_token)

    def bind_attention(self, plan: LossAfterAttention, query: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor,
                       d_v: int) -> None:
        """Where the attention ran in torch (its backward leaves no target), ``plan``'s target is formed from the
        attention's ``query``, ``kv`` and LSE instead. With our kernels nothing is bound, so the plan keeps no
        reference to the attention's tensors beyond what the kernels save (activation offload moves those)."""
        if _attention_kernels_apply(query, d_v):
            return
        from . import indexer_loss

        query, kv, lse, tp, scale = query.detach(), kv.detach(), lse.detach(), plan.tp_group, self.softmax_scale
        plan.target_fn = lambda topk: indexer_loss.sparse_target(query, kv, topk, scale, lse=lse, tp_group=tp)

    def forward(self, query: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, softmax_scale: float,
                d_v: int, *, with_lse: bool = False, target_box=None):
        """``query [T, H, D]``, ``kv [T, D]``, ``topk [T, K]`` -> latent output ``[T, H, d_v]`` (and, with
        ``with_lse``, the natural-log LSE ``[T, H]`` fp32 the sparse indexer loss's target reuses). With our kernels,
        ``target_box`` (``kernels.AttentionTargetBox``) receives the backward's head-summed probabilities."""
        if _attention_kernels_apply(query, d_v):
            from .. import kernels

            out, lse = kernels.sparse_mla_with_lse(query.contiguous(), kv.contiguous(), topk, softmax_scale, d_v,
                                                   deterministic=self.config.deterministic_mode, target_box=target_box,
                                                   grouped=self.grouped_sparse, key_blocks=self.key_block_dkv)
        else:
            out, lse = reference.sparse_mla(query, kv, topk, softmax_scale, d_v)
        return (out, lse.detach()) if with_lse else out


def _attention_kernels_apply(query: torch.Tensor, d_v: int) -> bool:
    """Our sparse-MLA kernels take this attention: bf16 on CUDA, GLM-5's d_qk 576 = 512 + 64 RoPE or GLM-5.3-Flash's
    NoPE d_qk = d_v = 512 (any top-k width, e.g. KPool's index_topk + P - 1)."""
    return _kernels_apply(query) and (query.shape[-1], d_v) in ((576, 512), (512, 512))


def _fused_indexer_loss_applies(qi: torch.Tensor, query: torch.Tensor, topk: torch.Tensor) -> bool:
    """Our fused sparse indexer-loss kernels take these tensors (CUDA, bf16, shapes they support)."""
    if not _kernels_apply(query):
        return False
    from .. import kernels

    supported = getattr(kernels, "indexer_loss_supported", None)
    return supported is not None and supported(qi, query, topk)


class TileLangMLASelfAttention(MLASelfAttention):
    """Fused absorbed-latent DSA attention (module docstring). Same parameters and names as the ``megatron`` backend;
    ``forward`` returns ``(output, bias, topk)`` with ``topk`` the int32 ``[T, index_topk]`` rows it attended to."""

    def __init__(self, config, submodules: MLASelfAttentionSubmodules, *args, **kwargs):
        if config.rope_type != "rope":
            raise NotImplementedError(f"the tilelang backend applies plain RoPE (GLM-5.x); got rope_type={config.rope_type!r}")
        submodules, down = with_mcore_down_projections(submodules)
        super().__init__(config, submodules, *args, **kwargs)
        rebuild_down_projections(self, down)
        if not isinstance(self.core_attention, TileLangSparseAttention):
            raise TypeError(f"TileLangMLASelfAttention needs TileLangSparseAttention, got {type(self.core_attention)}")
        self.fused_rope = enabled(FUSED_ROPE_ENV)

    @property
    def computes_topk(self) -> bool:
        return self.core_attention.computes_topk

    def kv_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_kc [H, qk_head_dim, kv_lora_rank], W_vc [H, v_head_dim, kv_lora_rank])`` viewed from
        ``linear_kv_up_proj``'s effective weight (per-head rows ``[k_nope | v]``; a LoRA delta included, see
        :func:`megatron_glm5.dsa.hooks.linear_weight`), recomputed on every call."""
        cfg = self.config
        w = linear_weight(self.linear_kv_up_proj).view(-1, cfg.qk_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_head_dim], w[:, cfg.qk_head_dim :]

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states=None, inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None, packed_seq_params=None,
                position_ids=None, sequence_len_offset=None, *, inference_params=None,
                dsa_topk: Optional[torch.Tensor] = None, dsa_topk_trusted: bool = False):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("TileLangMLASelfAttention supports training and forward only, not an inference cache")
        cfg = self.config
        sp = cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1
        x = hidden_states  # [s_l, b, h] (THD: [t_l, 1, h])
        q_c = self.q_layernorm(self.linear_q_down_proj(x)[0])
        kv, _ = self.linear_kv_down_proj(x)
        c, k_pe = torch.split(kv, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        c = self.kv_layernorm(c)
        q, _ = self.linear_q_up_proj(q_c)  # [s, b, H_l * (qk + rope)]: this rank's heads, all its CP rows
        s, b = q.shape[:2]
        cp_group = self.pg_collection.cp if cfg.context_parallel_size > 1 else None
        if cp_group is None:
            layout = TokenLayout.build(s, b, q.device, packed_seq_params, attention_mask)
            order = None
        elif packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            raise NotImplementedError("the tilelang backend supports context parallelism for bshd input, not THD yet")
        elif attention_mask is not None:
            raise NotImplementedError("the tilelang backend's context parallelism is causal: attention_mask must be "
                                      "None (give documents as THD packing without CP)")
        else:
            layout = TokenLayout.build_zigzag_cp(s, b, cp_group.rank(), cp_group.size(), q.device)
            order = TokenLayout.key_order(s, cp_group.size(), q.device)
        gather = SequenceGather(self.pg_collection.tp if sp else None, cp_group, order)
        c, k_pe = gather.keys(c), gather.keys(k_pe)  # [s_k, b, ...]: the whole sequence, in order
        heads = q.shape[-1] // self.q_head_dim
        q = layout.flatten(q).view(layout.num_rows, heads, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        if cfg.qk_pos_emb_head_dim:
            rope_q = rope_cos_sin(layout.positions, cfg.qk_pos_emb_head_dim, cfg.rotary_base)
            rope_k = rope_q if cp_group is None else rope_cos_sin(layout.key_positions, cfg.qk_pos_emb_head_dim,
                                                                  cfg.rotary_base)
        else:  # NoPE (GLM-5.3-Flash): the rope parts are empty, no position is read; d = kv_lora_rank = 512
            rope_q = rope_k = None
        w_kc, w_vc = self.kv_up_weights()
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_kc)
        if rope_q is not None:
            query = rope_cat(q_pe, q_latent, *rope_q, rope_first=False, fused=self.fused_rope)  # [T_q, H, 576]
            kv_full = rope_cat(layout.flatten_keys(k_pe), layout.flatten_keys(c), *rope_k, rope_first=False,
                               fused=self.fused_rope)  # [T_k, 576]
        else:
            query = torch.cat([q_latent, q_pe], dim=-1)
            kv_full = torch.cat([layout.flatten_keys(c), layout.flatten_keys(k_pe)], dim=-1)

        sparse = self.core_attention
        topk, indexer, lse = dsa_topk, None, None
        if topk is not None:
            sparse.check_topk(topk, layout, bounds=not dsa_topk_trusted)
        if sparse.loss_active():  # the indexer with gradients (its loss follows the attention: it reuses the LSE)
            indexer = sparse.indexer_rows(x, q_c, layout, rope_q, rope_k, gather)
            if topk is None:
                topk = sparse.select(*(t.detach() for t in indexer), layout)
        elif topk is None:
            topk = sparse.compute_topk(x, q_c, layout, rope_q, rope_k, gather)
        if dsa_topk is None:
            mark_replicated(topk, self.pg_collection.tp)  # every TP rank ran the whole indexer
        sparse.record_recall(query, kv_full, topk, layout, indexer is not None)

        core = (lambda q_, kv_, t_: sparse(q_, kv_, t_, self.softmax_scale, cfg.kv_lora_rank))
        if sparse.loss.warmup:  # dense main attention, frozen: only the indexer trains
            latent = sparse.dense_latent(query, kv_full, layout, cfg.kv_lora_rank)
        elif self.checkpoint_core_attention and self.training:
            latent = tensor_parallel.checkpoint(core, False, query, kv_full, topk)
        elif indexer is not None and (after := sparse.loss_after(*indexer, query, topk, cfg.kv_lora_rank)):
            # the loss in the backward, its target from the attention backward's P (loss_after_attention)
            token = after.token(*indexer, topk, sparse.loss_rows(layout))
            latent, lse = sparse(after.after(query, token), kv_full, topk, self.softmax_scale, cfg.kv_lora_rank,
                                 with_lse=True, target_box=after.box)
            sparse.bind_attention(after, query, kv_full, lse, cfg.kv_lora_rank)
            indexer = None  # no loss in the forward
        elif indexer is not None and sparse.loss.sparse:
            latent, lse = sparse(query, kv_full, topk, self.softmax_scale, cfg.kv_lora_rank, with_lse=True)
        else:
            latent = core(query, kv_full, topk)  # [T, H, kv_lora_rank]
        loss = None if indexer is None else sparse.indexer_loss(*indexer, query, kv_full, topk, layout, lse=lse)
        out = torch.einsum("thc,hdc->thd", latent, w_vc.to(latent.dtype)).reshape(layout.num_rows, -1)
        output, bias = self.linear_proj(layout.unflatten(out))
        return sparse.attach_loss(output, loss), bias, topk
