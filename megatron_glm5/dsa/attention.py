"""GLM-5.x DSA attention for the ``megatron`` backend: megatron-core's AbsorbedMLA projections and DSA indexer, with
the top-k passed explicitly between layers (IndexShare) instead of megatron-core's holder stashed on the config, the
mask or ``packed_seq_params``.

* :class:`GLMAbsorbedMLASelfAttention` is megatron-core's ``AbsorbedMLASelfAttention`` (same parameters, same
  q/kv/RoPE math via ``get_query_key_value_tensors``) whose ``forward`` takes the layer's incoming top-k
  (``dsa_topk``) and returns ``(output, bias, topk)``. The top-k is computed *before* the (optionally checkpointed)
  core attention, so selective ``core_attn`` recompute replays the saved indices and never re-runs the indexer.
* :class:`GLMSparseAttention` is the core attention: megatron-core's ``DSAIndexer`` on "full" layers (none on
  "shared" layers, so they own no indexer parameters), causal per-sequence top-k padded to a fixed width with -1, and
  sparse attention over the absorbed latent. With ``mcore_dsa_kernels != "none"`` both steps go through
  megatron-core's fused kernel hooks (TileLang / cuDNN); when a hook declines (or on CPU) the chunked pure-PyTorch
  path of :mod:`megatron_glm5.dsa.reference` runs, whose peak memory is O(chunk x S) instead of megatron-core's
  dense ``[b, heads, S, S]`` fallback.

Context parallelism is not supported here (a clear error); the ``tilelang`` backend implements it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa_kernels
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttentionSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from .. import compat
from ..device_check import check_on_device
from . import indexer_loss, reference
from .hooks import linear_weight, mark_replicated
from .indexer_training import RECALL, IndexerLossSettings, LossSlot, attach_loss, log_loss, warmup_freeze
from .layout import TokenLayout

IndexerType = str  # "full" | "shared"

FUSED_INDEXER_BLOCK = 8192  # megatron-core's query block for its TileLang indexer


def select_topk(
    config,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    layout: TokenLayout,
    topk: int,
) -> torch.Tensor:
    """Causal top-k over flattened rows: megatron-core's fused hook when configured and accepted, else the chunked
    torch reference. Always returns int32 ``[T, topk]`` (fixed width, -1 tail padding)."""
    idx = None
    if dsa_kernels.use_fused_dsa_kernels(config) and q.is_cuda:
        fused = dsa_kernels.run_fused_qk_topk(
            config,
            q.unsqueeze(1),
            k.unsqueeze(1),
            weights.unsqueeze(1),
            topk,
            layout.starts,
            layout.ends,
            block_size=FUSED_INDEXER_BLOCK,
            use_relu=True,
        )
        if fused is not None:
            idx = fused[0][0].to(torch.int32)  # [1, T, min(topk, T)] -> [T, k]
    if idx is None:
        idx = reference.indexer_topk(q, k, weights, layout.starts, layout.ends, topk)
    return reference.pad_topk(idx, topk)


def sparse_attention(
    config,
    query: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    softmax_scale: float,
    d_v: int,
) -> torch.Tensor:
    """Absorbed sparse MLA over flattened rows: ``query [T, H, D]``, ``kv [T, D]``, ``topk [T, K]`` ->
    ``[T, H, d_v]``. megatron-core's fused hook when configured and accepted, else the chunked torch path."""
    if dsa_kernels.use_fused_dsa_kernels(config) and query.is_cuda:
        out = dsa_kernels.run_fused_absorbed_sparse_attention(
            config, query.unsqueeze(1), kv[:, None, None, :], topk.unsqueeze(0), softmax_scale, d_v
        )
        if out is not None:
            return out[:, 0]
    out, _ = reference.sparse_mla(query, kv, topk, softmax_scale, d_v)
    return out


def topk_in_bounds(topk: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Device bool: every entry of ``topk [T, K]`` is -1 or in ``[starts[t], ends[t])``."""
    inside = (topk >= starts[:, None]) & (topk < ends[:, None])
    return (inside | (topk == -1)).all()


class DSACoreAttention(MegatronModule):
    """What both backends' core attentions share: megatron-core's core-attention constructor arguments (so the MLA
    modules build them like ``DSAttention``), the GLM-5.x checks, and the indexer (megatron-core ``DSAIndexer``
    parameters, so checkpoints interchange) on "full" layers only; ``indexer_type`` comes from the spec."""

    consumes_absorbed_v_up_projection = True
    requires_dsa_inputs = True
    supports_context_parallel = False
    supports_indexer_loss = True

    def __init__(
        self,
        config,
        submodules: DSAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: str = "p2p",
        pg_collection=None,
        *,
        indexer_type: IndexerType = "full",
        indexer_warmup: bool = False,
        loss_slot: Optional[LossSlot] = None,
    ):
        super().__init__(config=config)
        if indexer_type not in ("full", "shared"):
            raise ValueError(f"indexer_type: expected 'full' or 'shared', got {indexer_type!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"GLM-5.x DSA attention is causal; got attn_mask_type={attn_mask_type}")
        if config.context_parallel_size > 1 and not self.supports_context_parallel:
            raise NotImplementedError(
                f"{type(self).__name__} does not support context_parallel_size > 1; use the 'tilelang' backend "
                "(megatron-core's allgather context parallelism, bshd) or CP=1"
            )
        if not config.dsa_indexer_scoring_relu:
            raise ValueError("GLM-5.x indexer scores are ReLU'd: dsa_indexer_scoring_relu must be True")
        self.loss = IndexerLossSettings.from_config(config, indexer_warmup)
        if self.loss.enabled and not self.supports_indexer_loss:
            raise NotImplementedError(
                f"{type(self).__name__}: the indexer loss (dsa_indexer_loss_coeff > 0, or the warm-up) is not "
                "supported for this attention yet; set dsa_indexer_loss_coeff=0"
            )
        self.layer_number = layer_number
        # the tracker slot; a layer built outside our specs counts among all decoder layers
        self.loss_slot = loss_slot or LossSlot(layer_number - 1, config.num_layers + (config.mtp_num_layers or 0))
        self.index_topk = config.dsa_indexer_topk
        self.topk_width = config.dsa_indexer_topk  # columns of a top-k row; GLM-5.3-Flash's KPool adds P - 1
        self.softmax_scale = softmax_scale
        self.v_channels = v_channels
        self.pg_collection = pg_collection
        self.indexer = (
            build_module(submodules.indexer, config=config, pg_collection=pg_collection)
            if indexer_type == "full"
            else None
        )
        if self.loss.warmup and self.indexer is not None:
            for p in self.indexer.parameters():  # built frozen when warmup_freeze is armed: the indexer trains
                p.requires_grad_(True)

    @property
    def computes_topk(self) -> bool:
        return self.indexer is not None

    def loss_active(self) -> bool:
        """This call computes the indexer loss: a full layer, training with gradients on (not a no-grad pass such
        as the first pass of activation recompute, whose recompute computes it) and a positive coefficient."""
        if self.loss.warmup and warmup_freeze.armed:
            warmup_freeze.disarm()  # the model is built and wrapped by now
        return self.loss.enabled and self.indexer is not None and self.training and torch.is_grad_enabled()

    def indexer_loss(self, qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, query: torch.Tensor,
                     kv: torch.Tensor, topk: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The KL loss (:mod:`megatron_glm5.dsa.indexer_loss`) of flattened indexer rows (``qi [T, Hi, Di]``,
        ``ki [T_k, Di]``, ``w [T, Hi]``, with gradients) against the main attention (``query [T, H, D]``,
        ``kv [T_k, D]``: this rank's heads, summed over TP in the target): sparse over ``topk`` or, in the warm-up,
        dense. The warm-up also records the recall diagnostic."""
        tp = self.loss_tp_group()
        query, kv = query.detach(), kv.detach()
        if not self.loss.warmup:
            return indexer_loss.indexer_loss(
                qi, ki, w, query, kv, layout.starts, layout.ends, self.softmax_scale, coeff=self.loss.coeff,
                topk=topk if self.loss.sparse else None, per_token=self.loss.per_token, tp_group=tp,
            )
        rw = indexer_loss.row_weights(indexer_loss.valid_query_rows(layout.starts, layout.ends), self.loss.coeff,
                                      self.loss.per_token)
        loss, recall = indexer_loss.dense_indexer_loss(qi, ki, w, query, kv, layout.starts, layout.ends,
                                                       self.softmax_scale, rw, recall_topk=topk, tp_group=tp)
        RECALL.add(self.loss_slot, recall)  # measured on the loss's own dense targets
        return loss

    def record_recall(self, query: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, layout: TokenLayout,
                      loss_computed: bool) -> None:
        """Under ``RECALL.record()`` a full layer adds its recall (the warm-up's loss adds it already)."""
        if not RECALL.recording or self.indexer is None or (loss_computed and self.loss.warmup):
            return
        tp = self.loss_tp_group()
        RECALL.add(self.loss_slot, indexer_loss.attention_recall(
            query.detach(), kv.detach(), topk, layout.starts, layout.ends, self.softmax_scale, tp_group=tp))

    def attach_loss(self, output: torch.Tensor, loss: Optional[torch.Tensor]) -> torch.Tensor:
        """``output`` carrying this layer's indexer loss into the backward and the log (unchanged without one)."""
        if loss is None:
            return output
        return attach_loss(output, loss, self.loss_slot, cp_group=self.loss_cp_group(),
                           per_token=self.loss.per_token)

    def log_loss(self, loss: torch.Tensor) -> None:
        """Log this layer's indexer loss in its tracker slot (for a loss computed in the backward)."""
        log_loss(loss, self.loss_slot, cp_group=self.loss_cp_group(), per_token=self.loss.per_token)

    def loss_tp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The tensor-parallel group this layer's heads are split over (None at TP=1)."""
        return self.pg_collection.tp if self.config.tensor_model_parallel_size > 1 else None

    def loss_cp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The context-parallel group this layer's query rows are split over (None at CP=1)."""
        return self.pg_collection.cp if self.config.context_parallel_size > 1 else None

    def dense_latent(self, query: torch.Tensor, kv: torch.Tensor, layout: TokenLayout, d_v: int) -> torch.Tensor:
        """The warm-up's main attention: every causal key, no gradient (only the indexer trains), ``[T, H, d_v]``."""
        return reference.dense_mla(query.detach(), kv.detach(), layout.starts, layout.ends, self.softmax_scale, d_v)

    def check_topk(self, topk: torch.Tensor, layout: TokenLayout, *, bounds: bool) -> None:
        """A top-k given to a layer (IndexShare, recompute replay, or the caller) must be ``[rows, topk_width]``;
        with ``bounds`` (indices from outside the model, e.g. replayed from a rollout engine) every entry must also be
        -1 or a key row inside its query row's causal range, checked on device (no sync): a future index would
        leak information backwards and an out-of-range one would read another sequence."""
        if topk.shape != (layout.num_rows, self.topk_width):
            raise ValueError(
                f"layer {self.layer_number}: top-k indices must be [{layout.num_rows}, {self.topk_width}] (flattened "
                f"rows x top-k width), got {tuple(topk.shape)}"
            )
        if bounds:
            check_on_device(
                topk_in_bounds(topk, layout.starts, layout.ends),
                f"layer {self.layer_number}: a given DSA top-k index is neither -1 nor inside its query row's causal "
                "key range (a future key, another sequence's key, or out of range)",
            )


class GLMSparseAttention(DSACoreAttention):
    """Core attention of the ``megatron`` backend (module docstring)."""

    def indexer_rows(self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params,
                     layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """megatron-core's indexer on detached inputs (the LM loss never reaches it; gradients reach only its own
        parameters, through the indexer loss), flattened: ``(q [T, Hi, Di], k [T, Di], w [T, Hi])``. ``x``/``qr``
        may be sequence-parallel shards; megatron-core's indexer all-gathers them."""
        if self.indexer is None:
            raise RuntimeError(f"layer {self.layer_number} is an IndexShare 'shared' layer and has no indexer")
        q, k, weights = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
        return layout.flatten(q), layout.flatten(k), layout.flatten(weights)

    @torch.no_grad()
    def compute_topk(self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params, layout: TokenLayout) -> torch.Tensor:
        """Run the indexer (no gradient) and select the causal top-k."""
        q, k, w = self.indexer_rows(x, qr, packed_seq_params, layout)
        return select_topk(self.config, q, k, w, layout, self.index_topk)

    def topk_and_loss(self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params, layout: TokenLayout,
                      query: torch.Tensor, kv: torch.Tensor,
                      topk: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A training call with the indexer loss on: the top-k (selected here, or ``topk`` replayed by activation
        recompute) and the loss. megatron-core's fused TileLang top-k + sparse loss runs when configured and it
        accepts the call (not for a replayed top-k: it selects its own); otherwise :meth:`indexer_loss`."""
        q, k, w = self.indexer_rows(x, qr, packed_seq_params, layout)
        if topk is None and self.loss.sparse and dsa_kernels.use_fused_dsa_kernels(self.config) and q.is_cuda:
            fused = dsa_kernels.run_fused_qk_topk_with_loss(
                self.config, q.unsqueeze(1), k.unsqueeze(1), w.unsqueeze(1), self.index_topk, layout.starts,
                layout.ends, block_size=FUSED_INDEXER_BLOCK, query=query.detach().unsqueeze(1),
                key=kv.detach()[:, None, None, :], softmax_scale=self.softmax_scale, loss_coeff=self.loss.coeff,
                pg_collection=self.pg_collection, query_valid_rows=layout.ends > layout.starts,
                calculate_per_token_loss=self.loss.per_token, use_relu=True,
            )
            if fused is not None:
                return reference.pad_topk(fused[0][0].to(torch.int32), self.index_topk), fused[2]
        if topk is None:
            topk = select_topk(self.config, q.detach(), k.detach(), w.detach(), layout, self.index_topk)
        return topk, self.indexer_loss(q, k, w, query, kv, topk, layout)

    def forward(
        self, query: torch.Tensor, kv: torch.Tensor, up_v_weight: torch.Tensor, topk: torch.Tensor
    ) -> torch.Tensor:
        """``query [T, H, D]``, ``kv [T, D]``, ``up_v_weight [H, v_head_dim, kv_lora_rank]``, ``topk [T, K]`` ->
        ``[T, H * v_head_dim]`` (V up-projection applied)."""
        latent = sparse_attention(self.config, query, kv, topk, self.softmax_scale, self.v_channels)  # [T, H, r]
        out = torch.einsum("thc,hdc->thd", latent, up_v_weight.to(latent.dtype))
        return out.reshape(out.shape[0], -1)


def with_mcore_down_projections(submodules):
    """``(submodules for megatron-core's constructor, duplicated class to rebuild with or None)``.

    Without Transformer Engine megatron-core only accepts ``ColumnParallelLinear`` for ``linear_q_down_proj`` /
    ``linear_kv_down_proj``, and under TP + SP that path gives a wrong ``kv_down`` gradient: the rope part
    ``k_pos_emb`` is taken from the TP-gathered output at full sequence length, each rank's heads contribute only
    part of its gradient, and the gather's backward (a split) never sums them (our TP=2 parity test measured 1e-2
    relative error). So a replicated (duplicated) class that the whitelist does not know is swapped for
    ``ColumnParallelLinear`` during the parent constructor and rebuilt afterwards (:func:`rebuild_down_projections`),
    which then takes the same path as TE's duplicated ``TELinear``: SP-local output, ``k_pos_emb`` all-gathered with
    a reduce-scatter backward, weight gradients summed over TP through their ``sequence_parallel`` tag.
    """
    down = submodules.linear_q_down_proj
    if compat.mcore_accepts_down_projection(down):
        return submodules, None
    return (
        dataclasses.replace(submodules, linear_q_down_proj=compat.column_parallel_linear(),
                            linear_kv_down_proj=compat.column_parallel_linear()),
        down,
    )


def rebuild_down_projections(module, down) -> None:
    """Replace ``module``'s q/kv down-projections with duplicated ``down`` linears (see above)."""
    if down is None:
        return
    cfg = module.config
    common = dict(config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=False, parallel_mode="duplicated")
    module.linear_q_down_proj = build_module(down, cfg.hidden_size, cfg.q_lora_rank, **common)
    module.linear_kv_down_proj = build_module(down, cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, **common)


class GLMAbsorbedMLASelfAttention(AbsorbedMLASelfAttention):
    """megatron-core's AbsorbedMLA whose forward carries the DSA top-k explicitly (see module docstring).
    Down-projections are replicated over TP (see :func:`with_mcore_down_projections`)."""

    def __init__(self, config, submodules, *args, **kwargs):
        submodules, down = with_mcore_down_projections(submodules)
        super().__init__(config, submodules, *args, **kwargs)
        rebuild_down_projections(self, down)
        if not isinstance(self.core_attention, GLMSparseAttention):
            raise TypeError(
                f"GLMAbsorbedMLASelfAttention needs GLMSparseAttention as core_attention, got {type(self.core_attention)}"
            )

    @property
    def computes_topk(self) -> bool:
        return self.core_attention.computes_topk

    def _get_kv_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron-core's ``(W_kc, W_vc)`` per-head views, of ``linear_kv_up_proj``'s effective weight
        (:func:`megatron_glm5.dsa.hooks.linear_weight`: a LoRA delta included, with its gradients): absorbed attention
        reads this weight and never calls the module."""
        cfg = self.config
        w = linear_weight(self.linear_kv_up_proj).view(
            self.num_attention_heads_per_partition, cfg.qk_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_head_dim], w[:, cfg.qk_head_dim :]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        position_ids=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
        dsa_topk: Optional[torch.Tensor] = None,
        dsa_topk_trusted: bool = False,
    ):
        """Returns ``(output, bias, topk)``; ``dsa_topk`` must be given on a shared layer and is reused as-is on a
        full layer (replay: activation recompute, or indices provided by the caller). Indices are bounds-checked
        unless ``dsa_topk_trusted`` (the model's own, passed between its layers)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("GLM-5.x DSA attention supports training and forward only, not an inference cache")
        if rotary_pos_emb is not None or attention_bias is not None:
            raise ValueError("MLA applies its own RoPE; rotary_pos_emb and attention_bias must be None")

        q_absorbed, kv_compressed, q_compressed = self.get_query_key_value_tensors(
            hidden_states, key_value_states, packed_seq_params
        )
        _, v_up_weight = self._get_kv_up_weights()
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # q [t, H, D], kv [t, 1, D]
            layout = TokenLayout.build(q_absorbed.shape[0], 1, q_absorbed.device, packed_seq_params, attention_mask)
            query, kv = q_absorbed, kv_compressed[:, 0]
        else:  # q [s, b, H, D], kv [s, b, 1, D]
            s, b = q_absorbed.shape[:2]
            layout = TokenLayout.build(s, b, q_absorbed.device, attention_mask=attention_mask)
            query, kv = layout.flatten(q_absorbed), layout.flatten(kv_compressed)[:, 0]
        if attention_mask is not None and self.config.qk_pos_emb_head_dim > 0:
            # megatron-core's MLA and indexer apply RoPE at positions 0..s-1 of each sequence: a mask may shorten a
            # row's range at its end (padding) but not start it later (left padding, documents): those need the
            # tilelang backend (RoPE from the mask) or THD packing. Without RoPE (GLM-5.3-Flash) no position is
            # read, so any mask the layout accepts works.
            check_on_device(
                ((layout.starts.to(torch.int64) == layout.row_starts()) | (layout.ends <= layout.starts)).all(),
                "the megatron backend takes masks whose allowed keys start at the sequence start (causal, right "
                "padding); for left padding or documents use THD packing or backend='tilelang'",
            )

        core = self.core_attention
        topk, loss = dsa_topk, None
        if topk is not None:
            core.check_topk(topk, layout, bounds=not dsa_topk_trusted)
        if core.loss_active():
            topk, loss = core.topk_and_loss(hidden_states, q_compressed, packed_seq_params, layout, query, kv, topk)
        elif topk is None:
            topk = core.compute_topk(hidden_states, q_compressed, packed_seq_params, layout)
        if dsa_topk is None:
            mark_replicated(topk, self.pg_collection.tp)  # every TP rank ran the whole indexer
        core.record_recall(query, kv, topk, layout, loss is not None)

        if core.loss.warmup:  # dense main attention, frozen: only the indexer trains
            latent = core.dense_latent(query, kv, layout, self.config.kv_lora_rank)
            core_out = torch.einsum("thc,hdc->thd", latent, v_up_weight.to(latent.dtype)).reshape(layout.num_rows, -1)
        elif self.checkpoint_core_attention and self.training:
            core_out = tensor_parallel.checkpoint(core, False, query, kv, v_up_weight, topk)
        else:
            core_out = core(query, kv, v_up_weight, topk)
        core_out = layout.unflatten(core_out)  # [s, b, H * v_head_dim]

        if self.recompute_up_proj:
            self.qkv_up_checkpoint.discard_output_and_register_recompute(core_out)
            self.qkv_up_checkpoint = None
        output, bias = self.linear_proj(core_out)
        return core.attach_loss(output, loss), bias, topk
