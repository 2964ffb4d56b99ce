"""Forward parity of our megatron-core model against transformers' ``GlmMoeDsaForCausalLM`` on the same weights.

:func:`verify` runs both models in fp32 on the same random tokens and returns one JSON-able dict:

* ``max_abs_logit_diff``, ``mean_abs_logit_diff``, ``logit_cosine``, ``argmax_agreement``;
* ``topk_overlap``: per IndexShare "full" layer, the mean over query rows of |ours & HF| / |HF| of the selected
  causal keys (HF's indexer output is captured with a forward hook on ``self_attn.indexer``, ours from each
  layer's attention output ``(out, bias, topk)``; rows are ``b * s + pos``, -1 padding and HF's masked picks for
  rows with fewer than ``index_topk`` causal keys are dropped);
* ``topk_boundary_ties``: query rows whose ``index_topk``-th and next-best HF indexer scores are *equal*. There
  the reference's ``torch.topk`` tie order, not the math, decides which key is kept, and logits may differ by
  O(0.1) between two correct implementations (shared/notes/testing.md). A parity failure with ties > 0 is not
  evidence of a bug; with ties == 0 it is;
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


def _boundary_ties(scores: torch.Tensor, topk: int) -> int:
    b, s, _ = scores.shape
    ties = 0
    for bi in range(b):
        for q in range(topk, s):  # rows with more than topk causal keys
            v = scores[bi, q, : q + 1].sort(descending=True).values
            ties += int(v[topk - 1] == v[topk])
    return ties


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
            from megatron_glm5.pretrained import from_hf_pretrained

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

    diff = (ours - theirs).abs()
    cosine = F.cosine_similarity(ours.reshape(1, -1), theirs.reshape(1, -1)).item()
    overlap: dict[str, float] = {}
    for i, hk in sorted(hf_topk.items()):
        if i not in ours_topk:
            continue
        hk = hk.reshape(batch_size * seq_len, -1)
        ok = ours_topk[i].reshape(batch_size * seq_len, -1)
        fractions = []
        for row in range(batch_size * seq_len):
            q = row % seq_len
            want = {int(x) for x in hk[row].tolist() if 0 <= x <= q}
            got = {int(x) for x in ok[row].tolist() if x >= 0}
            fractions.append(len(want & got) / max(len(want), 1))
        overlap[str(i)] = sum(fractions) / len(fractions)
    layer_diff = [((ours_hidden[i] - hf_hidden[i]).abs().max() / hf_hidden[i].abs().max().clamp(min=1.0)).item()
                  for i in sorted(ours_hidden) if i in hf_hidden]
    first_bad = next((i for i, d in enumerate(layer_diff) if d > tol), None)
    ties = sum(_boundary_ties(s, arch.index_topk) for s in hf_scores.values())
    max_diff = diff.max().item()
    return {
        "max_abs_logit_diff": max_diff,
        "mean_abs_logit_diff": diff.mean().item(),
        "logit_cosine": cosine,
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "topk_overlap": overlap,
        "topk_boundary_ties": ties,
        "layer_max_rel_diff": layer_diff,
        "first_divergent_layer": first_bad,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "index_topk": arch.index_topk,
        "seed": seed,
        "tol": tol,
        "ok": bool(math.isfinite(max_diff) and max_diff <= tol),
        "source": str(megatron_path) if megatron_path is not None else str(hf_path),
    }
