"""Forward parity of our megatron-core model against transformers' ``GlmMoeDsaForCausalLM`` on the same weights.

:func:`verify` runs both models in fp32 on the same random tokens and returns one JSON-able dict:

* ``max_abs_logit_diff``, ``mean_abs_logit_diff``, ``logit_cosine``, ``argmax_agreement``;
* ``topk_overlap``: per IndexShare "full" layer, the mean over query rows of |ours & HF| / |HF| of the selected
  causal keys (HF's indexer output is captured with a forward hook on ``self_attn.indexer``, ours from each
  layer's attention output ``(out, bias, topk)``; rows are ``b * s + pos``, -1 padding and HF's masked picks for
  rows with fewer than ``index_topk`` causal keys are dropped);
* ``topk_boundary_ties``: query rows whose ``index_topk``-th and next-best HF indexer scores are *equal*. There
  the reference's ``torch.topk`` tie order, not the math, decides which key is kept, and logits may differ by
  O(0.1) between two correct implementations;
* ``topk_rows_differing`` / ``topk_differences_only_at_ties``, and ``max_abs_logit_diff_with_hf_topk``: the logits
  of our model when HF's top-k indices are fed to our full layers (through the attention's explicit ``dsa_topk``
  input), which tests everything but the selection itself;
* ``ok``: ``max_abs_logit_diff <= tol``, or - when our selection differs from HF's only on tied rows -
  ``max_abs_logit_diff_with_hf_topk <= tol``. A difference on an untied row, or a replayed diff above ``tol``, is
  a bug;
* ``layer_max_rel_diff`` (per decoder layer output: max |diff| / max(1, max |HF|)) and ``first_divergent_layer``
  (the first layer above ``tol``), to point at the layer to debug.

The sequence must be longer than ``index_topk``, otherwise DSA selects every key and the indexer is not tested.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_glm5.config import load_hf_config, parse_hf_config

from .errors import BridgeError


def _hf_index_scores(indexer, kwargs: dict) -> torch.Tensor:
    """HF's index scores ``[B, S, T]`` (before masking) recomputed from the indexer's own modules and inputs,
    following ``GlmMoeDsaIndexer.forward`` (transformers 5.x); used only to detect top-k boundary ties."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    hs, qr = kwargs["hidden_states"], kwargs["q_resid"]
    cos, sin = kwargs["position_embeddings"]
    b, s, _ = hs.shape
    rope, d = indexer.qk_rope_head_dim, indexer.head_dim
    q = indexer.wq_b(qr).view(b, s, indexer.n_heads, d)  # [B, S, H, D]
    q_rot, q_pass = torch.split(q, [rope, d - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hs)).unsqueeze(2)  # [B, S, 1, D]
    k_rot, k_pass = torch.split(k, [rope, d - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, D]
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hs).float() * indexer.n_heads**-0.5  # [B, S, H]
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]


def _boundary_ties(scores: torch.Tensor, topk: int) -> set[tuple[int, int]]:
    """Rows ``(batch, query)`` with more than ``topk`` causal keys whose ``topk``-th and next-best scores are equal."""
    b, s, _ = scores.shape
    ties = set()
    for bi in range(b):
        for q in range(topk, s):  # rows with more than topk causal keys
            v = scores[bi, q, : q + 1].sort(descending=True).values
            if v[topk - 1] == v[topk]:
                ties.add((bi, q))
    return ties


def _hf_rows(hf_topk: torch.Tensor, topk: int) -> list[list[int]]:
    """HF's ``[B, S, topk]`` indices as per-row lists of valid causal key positions (HF's picks among masked keys
    for rows with fewer than ``topk`` causal keys are dropped)."""
    b, s, _ = hf_topk.shape
    return [[int(k) for k in hf_topk[bi, q].tolist() if 0 <= k <= q] for bi in range(b) for q in range(s)]


def _as_replay(rows: list[list[int]], seq_len: int, topk: int, device) -> torch.Tensor:
    """Per-row key positions -> our format: int32 ``[b * s, topk]`` global key rows, -1 tail padding."""
    out = torch.full((len(rows), topk), -1, dtype=torch.int32)
    for r, keys in enumerate(rows):
        base = (r // seq_len) * seq_len
        out[r, : len(keys)] = torch.tensor(sorted(keys), dtype=torch.int32) + base
    return out.to(device)


def load_hf_model(hf_path: str | Path):
    from transformers import GlmMoeDsaForCausalLM

    raw = load_hf_config(hf_path)
    if raw.get("quantization_config"):
        raise BridgeError(f"{hf_path}: verify needs an unquantised HF checkpoint (this one is FP8); export one with "
                          "`megatron-glm5 convert import` + `convert export` first")
    model = GlmMoeDsaForCausalLM.from_pretrained(str(hf_path), dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def verify(
    *,
    hf_path: str | Path,
    megatron_path: str | Path | None = None,
    seq_len: int = 64,
    batch_size: int = 1,
    seed: int = 0,
    tol: float = 1e-4,
    model=None,
) -> dict:
    """Compare logits of our model (from ``megatron_path``, or ``model``, or loaded from ``hf_path``) with
    transformers on ``hf_path``. Single process (TP=PP=EP=1), fp32."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.parallel import initialize_model_parallel

    raw = load_hf_config(hf_path)
    arch = parse_hf_config(raw)
    if seq_len <= arch.index_topk:
        raise BridgeError(f"--seq-len {seq_len} must exceed index_topk ({arch.index_topk}); otherwise DSA keeps every "
                          "key and the indexer is not exercised")
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel()
    if model is None:
        if megatron_path is not None:
            from .inmemory import load_megatron_checkpoint

            model = load_megatron_checkpoint(megatron_path)
        else:
            from bridge.pretrained import from_hf_pretrained

            model = from_hf_pretrained(hf_path)
    model.eval()
    hf = load_hf_model(hf_path)

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch_size, seq_len), generator=gen)
    pos = torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len)

    ours_topk: dict[int, torch.Tensor] = {}
    ours_hidden: dict[int, torch.Tensor] = {}
    hf_topk: dict[int, torch.Tensor] = {}
    hf_hidden: dict[int, torch.Tensor] = {}
    hf_scores: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.decoder.layers):
        gi = layer.layer_number - 1
        hooks.append(layer.register_forward_hook(
            lambda mod, a, out, gi=gi: ours_hidden.__setitem__(
                gi, (out[0] if isinstance(out, tuple) else out).transpose(0, 1).float().cpu())))
        if getattr(layer.self_attention, "computes_topk", False):
            hooks.append(layer.self_attention.register_forward_hook(
                lambda mod, a, out, gi=gi: ours_topk.__setitem__(gi, out[2].cpu())))
    names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda mod, a, out, i=i: hf_hidden.__setitem__(i, out[0] if isinstance(out, tuple) else out)))
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(lambda mod, a, out, i=i: hf_topk.__setitem__(i, out)))

            def pre(mod, args, kwargs, i=i):
                hf_scores[i] = _hf_index_scores(mod, {**dict(zip(names, args)), **kwargs})

            hooks.append(indexer.register_forward_pre_hook(pre, with_kwargs=True))
    device = next(model.parameters()).device
    try:
        ours = model(ids.to(device), pos.to(device), None).float().cpu()
        theirs = hf(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()

    topk = arch.index_topk
    tie_rows = {(i, bi * seq_len + q) for i, sc in hf_scores.items() for bi, q in _boundary_ties(sc, topk)}
    overlap: dict[str, float] = {}
    differing: set[tuple[int, int]] = set()
    hf_rows: dict[int, list[list[int]]] = {}
    for i, hk in sorted(hf_topk.items()):
        if i not in ours_topk:
            continue
        hf_rows[i] = _hf_rows(hk, topk)
        mine = ours_topk[i].reshape(batch_size * seq_len, -1)
        fractions = []
        for row, want in enumerate(hf_rows[i]):
            base = (row // seq_len) * seq_len  # ours are global key rows (batch-major)
            got = {int(x) - base for x in mine[row].tolist() if x >= 0}
            fractions.append(len(set(want) & got) / max(len(want), 1))
            if set(want) != got:
                differing.add((i, row))
        overlap[str(i)] = sum(fractions) / len(fractions)

    # The same forward with HF's top-k fed to our full layers: isolates everything but the selection itself.
    replay_hooks = []
    for layer in model.decoder.layers:
        gi = layer.layer_number - 1
        if gi in hf_rows:
            indices = _as_replay(hf_rows[gi], seq_len, topk, device)

            def inject(mod, args, kwargs, indices=indices):
                return args, {**kwargs, "dsa_topk": indices}

            replay_hooks.append(layer.self_attention.register_forward_pre_hook(inject, with_kwargs=True))
    try:
        replayed = model(ids.to(device), pos.to(device), None).float().cpu()
    finally:
        for h in replay_hooks:
            h.remove()

    diff = (ours - theirs).abs()
    replay_diff = (replayed - theirs).abs().max().item()
    cosine = F.cosine_similarity(ours.reshape(1, -1), theirs.reshape(1, -1)).item()
    layer_diff = [((ours_hidden[i] - hf_hidden[i]).abs().max() / hf_hidden[i].abs().max().clamp(min=1.0)).item()
                  for i in sorted(ours_hidden) if i in hf_hidden]
    first_bad = next((i for i, d in enumerate(layer_diff) if d > tol), None)
    max_diff = diff.max().item()
    only_ties = differing <= tie_rows
    ok = math.isfinite(max_diff) and (max_diff <= tol or (bool(differing) and only_ties and replay_diff <= tol))
    return {
        "max_abs_logit_diff": max_diff,
        "mean_abs_logit_diff": diff.mean().item(),
        "logit_cosine": cosine,
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "topk_overlap": overlap,
        "topk_boundary_ties": len(tie_rows),
        "topk_rows_differing": len(differing),
        "topk_differences_only_at_ties": only_ties,
        "max_abs_logit_diff_with_hf_topk": replay_diff,
        "layer_max_rel_diff": layer_diff,
        "first_divergent_layer": first_bad,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "index_topk": arch.index_topk,
        "seed": seed,
        "tol": tol,
        "ok": bool(ok),
        "source": str(megatron_path) if megatron_path is not None else str(hf_path),
    }
