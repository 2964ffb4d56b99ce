"""The KPool indexer as a megatron-core module, and its selection over a :class:`~.layout.TokenLayout`.

:class:`KPoolIndexer` is megatron-core's ``DSAIndexer`` (same projections and parameter names: ``linear_wq_b``,
``linear_wk``, ``k_norm`` LayerNorm with bias, ``linear_weights_proj``) plus the two KPool parameters of
transformers' ``Glm5NextTextIndexer``:

* ``compress_gate`` ``[index_head_dim, hidden]`` (HF ``index_kpool_compress_gate``): pooling logits ``x @ gate.T``;
* ``compress_ape`` ``[P, index_head_dim]`` (HF ``index_kpool_compress_ape``): added to the logits of pool slot ``j``.

It has no RoPE (GLM-5.3-Flash is NoPE) and never calls the parent's RoPE / top-k forward: :meth:`KPoolIndexer.project`
gives ``q, k, gate, weights`` for the rows it is handed (each backend decides what to all-gather under sequence
parallelism), and :func:`kpool_select` turns them into int32 top-k rows of width ``index_topk + P - 1`` with
:mod:`.kpool` (the torch reference), or on CUDA with bf16 inputs and TileLang installed with
:func:`megatron_glm5.kernels.kpool_indexer_topk` (the same selection on the indexer + top-k kernels).

Numerics follow transformers 5.24, not GLM-5's indexer: ``weights_proj`` runs in the model dtype (GLM-5 keeps it in
fp32), ``k_norm`` in the model dtype, scores and the pool softmax in fp32 (inside :mod:`.kpool`).

Documents: KPool anchors pools at each document's first row, so the selection needs document boundaries, which a
:class:`~.layout.TokenLayout` only holds as per-row causal ranges. :func:`layout_documents` recovers them from the
ranges (bshd, THD, dense masks with padding or documents, zigzag context parallelism alike).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAIndexerSubmodules

from .kpool import kpool_topk, pool_keys
from .layout import TokenLayout


class KPoolIndexer(DSAIndexer):
    """megatron-core ``DSAIndexer`` projections + KPool's ``compress_gate`` / ``compress_ape`` (module docstring).
    Reads ``config.dsa_indexer_kpool`` (:class:`~megatron_glm5.glm5_next.mcore_config.GLM5NextTransformerConfig`)."""

    def __init__(self, config, submodules: DSAIndexerSubmodules, pg_collection=None) -> None:
        if config.qk_pos_emb_head_dim != 0:
            raise ValueError(
                f"KPoolIndexer is the NoPE (GLM-5.3-Flash) indexer: qk_pos_emb_head_dim must be 0, found "
                f"{config.qk_pos_emb_head_dim}"
            )
        if config.dsa_indexer_rotate_activation:
            raise ValueError("KPoolIndexer has no Hadamard rotation: set dsa_indexer_rotate_activation=False")
        pool = getattr(config, "dsa_indexer_kpool", None)
        if not pool or pool < 1:
            raise ValueError(
                f"KPoolIndexer needs config.dsa_indexer_kpool >= 1 (GLM5NextTransformerConfig), found {pool!r}"
            )
        super().__init__(config, submodules, pg_collection)
        self.pool_size = pool
        self.select_tail = bool(config.dsa_indexer_kpool_select_tail)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        # transformers initialises both at zero (a plain mean over each pool); so do we
        self.compress_gate = torch.nn.Parameter(torch.zeros(self.index_head_dim, self.hidden_size, device=device,
                                                            dtype=dtype))
        self.compress_ape = torch.nn.Parameter(torch.zeros(pool, self.index_head_dim, device=device, dtype=dtype))
        for p in (self.compress_gate, self.compress_ape):  # replicated over TP like the parent's projections
            setattr(p, "average_gradients_across_tp_domain", True)

    def forward_before_topk(self, *args, **kwargs):
        raise NotImplementedError("KPoolIndexer scores pools: use project() and kpool_select()")

    def project(self, x: torch.Tensor, qr: torch.Tensor):
        """``x [s, b, hidden]``, normalised q latent ``qr [s, b, q_lora]`` (any rows, e.g. an SP shard) ->
        ``q [s, b, H, D]``, ``k [s, b, D]``, ``gate [s, b, D]`` in the model dtype and fp32 head weights
        ``[s, b, H]`` with ``H**-0.5 * D**-0.5`` folded in (equal to transformers' ``D**-0.5`` inside the ReLU by
        positive homogeneity)."""
        s, b = x.shape[:2]
        q, _ = self.linear_wq_b(qr)
        q = q.view(s, b, self.index_n_heads, self.index_head_dim)
        k, _ = self.linear_wk(x)
        k = self.k_norm(k)
        gate = F.linear(x, self.compress_gate)
        w, _ = self.linear_weights_proj(x)
        w = w.float() * (self.index_n_heads**-0.5 * self.softmax_scale)
        return q, k, gate, w


def layout_documents(layout: TokenLayout) -> torch.Tensor:
    """int64 ``[n + 1]`` boundaries of the key axis (``[0, num_key_rows]``) whose segments are the documents the
    query rows attend within, plus gaps (padding) that no query sees.

    A document is the set of key rows ``[start, end)`` where ``start`` is a live query row's range start and ``end``
    the largest range end among the rows sharing it. Under zigzag context parallelism a rank may not hold a
    document's last rows; ``end`` is then where this rank's queries stop, and a pool crossing it is visible to none
    of them, so the selection is the one of the whole document. Raises ``ValueError`` (one host sync) if two
    documents overlap: KPool has no meaning for such masks."""
    live = layout.ends > layout.starts
    starts = layout.starts[live].to(torch.int64)
    ends = layout.ends[live].to(torch.int64)
    total = layout.num_key_rows
    device = layout.starts.device
    if starts.numel() == 0:
        return torch.tensor([0, total], dtype=torch.int64, device=device)
    doc_starts, inverse = torch.unique(starts, return_inverse=True)
    doc_ends = torch.zeros_like(doc_starts).scatter_reduce_(0, inverse, ends, "amax", include_self=False)
    if bool((doc_ends[:-1] > doc_starts[1:]).any()):
        bad = int(torch.nonzero(doc_ends[:-1] > doc_starts[1:])[0])
        raise ValueError(
            f"KPool indexer: the key ranges starting at rows {int(doc_starts[bad])} and {int(doc_starts[bad + 1])} "
            "overlap; pools are anchored per document, so every query row's range must start at its own document's "
            "first row (causal, padding or block-diagonal masks; THD packing)"
        )
    ends_all = torch.tensor([0, total], dtype=torch.int64, device=device)
    return torch.unique(torch.cat([ends_all, doc_starts, doc_ends]))


@functools.cache
def _tilelang_available() -> bool:
    return importlib.util.find_spec("tilelang") is not None


def _kernel_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """:func:`megatron_glm5.kernels.kpool_indexer_topk` runs on CUDA bf16 inputs when TileLang is installed (and the
    indexer shape suits its GEMM); anything else takes the torch reference."""
    if not (q.is_cuda and _tilelang_available()):
        return False
    from megatron_glm5.kernels.kpool_topk import kernel_supports

    return kernel_supports(q, k)


@torch.no_grad()
def kpool_select(
    q: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    layout: TokenLayout,
    *,
    index_topk: int,
    select_tail: bool,
    documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """KPool top-k over flattened rows: ``q [T_q, H, D]``, ``weights [T_q, H]`` (query rows), ``k, gate [T_k, D]``
    (key rows), ``ape [P, D]`` -> int32 ``[T_q, index_topk + P - 1]`` (``[T_q, index_topk]`` without the tail) key
    rows, -1 padded; semantics in :mod:`.kpool`. ``documents`` defaults to :func:`layout_documents`."""
    cu = layout_documents(layout) if documents is None else documents
    if _kernel_applies(q, k):  # CUDA, bf16, TileLang: the kernel path (same result up to fp32 near-ties)
        from megatron_glm5 import kernels

        return kernels.kpool_indexer_topk(q, k, gate, ape, weights, cu, index_topk=index_topk,
                                          select_tail=select_tail, starts=layout.starts, ends=layout.ends)
    pools = pool_keys(k, gate, ape, cu)
    return kpool_topk(q, weights, pools, layout.starts, layout.ends, index_topk=index_topk, select_tail=select_tail)
