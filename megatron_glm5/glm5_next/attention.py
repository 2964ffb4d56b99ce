"""GLM-5.3-Flash NoPE DSA core attentions: the GLM-5 ones with the KPool indexer, on both backends.

The attention modules themselves are GLM-5's, unchanged: ``GLMAbsorbedMLASelfAttention`` (megatron-core
AbsorbedMLA) and ``TileLangMLASelfAttention``. With ``qk_pos_emb_head_dim = 0`` their query and latent key are
``kv_lora_rank = 512`` wide (``[q_nope . W_kc | (empty rope part)]`` and ``[c | (empty)]``), values are the same 512
channels, and the softmax scale is megatron-core's ``1 / sqrt(qk_head_dim + 0) = 1/16`` (see
:mod:`megatron_glm5.glm5_next.mcore_config`). Only the core attention differs:

* "full" layers own a :class:`~megatron_glm5.dsa.kpool_indexer.KPoolIndexer` and select pools
  (:func:`~megatron_glm5.dsa.kpool_indexer.kpool_select`), giving int32 rows of width ``index_topk + P - 1``;
* "shared" layers own nothing and take the incoming rows, checked against that width.

Attention then runs over exactly the selected rows; there is no causal mask besides the selection, as in
transformers (a query whose own complete pool is not selected does not see itself).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from ..dsa.attention import GLMSparseAttention
from ..dsa.kpool_indexer import kpool_select
from ..dsa.layout import TokenLayout
from ..dsa.tilelang_attention import SequenceGather, TileLangSparseAttention


class _KPoolTopK:
    """What both backends' KPool core attentions share: the top-k width and the selection from projected rows."""

    supports_indexer_loss = False  # the KPool indexer's (pooled) KL loss is not implemented yet

    def _init_kpool(self, config) -> None:
        if config.qk_pos_emb_head_dim != 0:
            raise ValueError(
                f"GLM-5.3-Flash DSA is NoPE: qk_pos_emb_head_dim must be 0, found {config.qk_pos_emb_head_dim}"
            )
        self.topk_width = config.dsa_topk_width  # index_topk + P - 1 with the tail
        self.select_tail = bool(config.dsa_indexer_kpool_select_tail)

    def _select(self, q, k, gate, w, layout: TokenLayout) -> torch.Tensor:
        """Flattened rows (``q [T_q, H, D]``, ``w [T_q, H]``; ``k``, ``gate`` ``[T_k, D]``) -> int32 top-k."""
        return kpool_select(q, k, gate, self.indexer.compress_ape, w, layout, index_topk=self.index_topk,
                            select_tail=self.select_tail)


class GLM5NextSparseAttention(_KPoolTopK, GLMSparseAttention):
    """Core attention of the ``megatron`` backend for GLM-5.3-Flash.
    DIFF vs ``GLMSparseAttention``: the KPool indexer instead of megatron-core's per-token top-k."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._init_kpool(config)

    @torch.no_grad()
    def compute_topk(self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params, layout: TokenLayout) -> torch.Tensor:
        """``x`` / ``qr`` may be sequence-parallel shards: all-gathered first, as megatron-core's indexer does."""
        if self.indexer is None:
            raise RuntimeError(f"layer {self.layer_number} is an IndexShare 'shared' layer and has no indexer")
        x, qr = x.detach(), qr.detach()
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        q, k, gate, w = self.indexer.project(x, qr)
        return self._select(layout.flatten(q), layout.flatten_keys(k), layout.flatten_keys(gate), layout.flatten(w),
                            layout)


class TileLangGLM5NextSparseAttention(_KPoolTopK, TileLangSparseAttention):
    """Core attention of the ``tilelang`` backend for GLM-5.3-Flash. Under SP / CP the indexer's compact outputs are
    all-gathered (q and weights along this rank's query rows; k and the pooling logits along every key row).
    DIFF vs ``TileLangSparseAttention``: the KPool indexer, no indexer RoPE (``rope_q`` / ``rope_k`` unused)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._init_kpool(config)

    @torch.no_grad()
    def compute_topk(self, x: torch.Tensor, q_c: torch.Tensor, layout: TokenLayout, rope_q, rope_k,
                     gather: SequenceGather) -> torch.Tensor:
        q, k, gate, w = self.indexer.project(x, q_c)
        return self._select(layout.flatten(gather.rows(q)), layout.flatten_keys(gather.keys(k)),
                            layout.flatten_keys(gather.keys(gate)), layout.flatten(gather.rows(w)), layout)
