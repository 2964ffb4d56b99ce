"""transformers' side of ``verify``, per model family: how to load the reference model, where its decoder layers are,
what its indexer returns, and how to recompute the indexer scores that decide it (for telling ties from bugs).

:mod:`bridge.parity` is the one family-neutral harness; it asks :func:`reference_for` for the family of the
checkpoint (:mod:`megatron_glm5.families`) and never tests for a family itself. A new family adds one
:class:`HFReference` subclass to :data:`REFERENCES`.

Conventions shared by both families (so the harness compares them alike):

* **choices** are recorded with forward hooks: a full DSA layer's ``self_attn.indexer`` output and an MoE layer's
  ``mlp.gate`` output ``(router_logits, weights, expert ids [b * s, k])``;
* :meth:`HFReference.sequence_rows` turns an indexer output into the rollout-payload form: int ``[B, S, W]``
  sequence-relative key positions, -1 padded (what :mod:`megatron_glm5.rl.payload` takes, and, offset by
  ``b * s``, what our attention takes);
* :meth:`HFReference.candidate_scores` recomputes the indexer's scores ``[B, S, C]`` over its candidates (tokens for
  GLM-5.x, KPool pools for GLM-5.3-Flash), ``-inf`` where a candidate is not selectable (future, incomplete pool),
  and :meth:`HFReference.selected` says how many candidates a row keeps: a row whose last kept and first dropped
  candidates score equal (or nearly) is a tie, where ``torch.topk``'s order, not the math, decides.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_glm5.families import family_of_architecture

from .errors import BridgeError
from .preflight import read_hf_config

_GLM5_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class HFReference:
    """The transformers reference of one family (module docstring)."""

    family: str = ""

    def load(self, hf_path: str | Path, *, dtype: torch.dtype, device, num_layers: int | None):
        raise NotImplementedError

    def decoder_layers(self, hf) -> list[torch.nn.Module]:
        raise NotImplementedError

    def sequence_rows(self, indexer_out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def candidate_scores(self, indexer, args: tuple, kwargs: dict) -> torch.Tensor:
        raise NotImplementedError

    def selected(self, arch) -> int:
        raise NotImplementedError


class GLM5Reference(HFReference):
    """``GlmMoeDsaForCausalLM`` (GLM-5.x): the indexer scores every causal token and returns ``index_topk`` of them;
    rows with fewer causal keys pick masked (future) keys too, which are dropped here."""

    family = "glm5"

    def load(self, hf_path, *, dtype, device, num_layers):
        """Every parameter must come from the checkpoint; with ``num_layers`` the config is cut to the first N layers
        (no MTP) and the checkpoint keys the model does not take must all be of layers >= N (and MTP)."""
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        raw = read_hf_config(hf_path)
        if raw.get("quantization_config"):
            raise BridgeError(f"{hf_path}: verify needs an unquantised HF checkpoint (this one is FP8); export one "
                              "with `megatron-glm5 convert import` + `convert export` first")
        config = GlmMoeDsaConfig.from_pretrained(str(hf_path))
        full = config.num_hidden_layers
        kept = full if num_layers is None else num_layers
        if num_layers is not None:
            for name in ("indexer_types", "mlp_layer_types", "layer_types"):
                value = getattr(config, name, None)
                if isinstance(value, (list, tuple)) and len(value) == full:
                    setattr(config, name, list(value[:num_layers]))
            config.num_hidden_layers = num_layers
            config.num_nextn_predict_layers = 0
        kwargs = {} if torch.device(device).type == "cpu" else {"device_map": str(device)}
        model, info = GlmMoeDsaForCausalLM.from_pretrained(str(hf_path), config=config, dtype=dtype,
                                                           output_loading_info=True, **kwargs)
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise BridgeError(f"{hf_path}: transformers found no checkpoint tensor for {len(missing)} parameters of "
                              f"the {kept}-layer model, e.g. {missing[:5]}")
        stray = sorted(k for k in info.get("unexpected_keys") or ()
                       if not ((m := _GLM5_LAYER.match(k)) and int(m.group(1)) >= kept))
        if stray:
            raise BridgeError(f"{hf_path}: transformers did not use {len(stray)} checkpoint tensors of the kept "
                              f"layers 0..{kept - 1} or the embeddings / final norm / LM head, e.g. {stray[:5]}")
        return model.eval()

    def decoder_layers(self, hf):
        return list(hf.model.layers)

    def sequence_rows(self, indexer_out):
        """HF's ``[B, S, index_topk]`` picks -> the causal ones (``0 <= k <= q``), ascending, -1 padded."""
        b, s, k = indexer_out.shape
        q = torch.arange(s)[None, :, None]
        rows = torch.where((indexer_out >= 0) & (indexer_out <= q), indexer_out.long(), s)
        rows = rows.sort(-1).values
        return torch.where(rows < s, rows, -1).to(torch.int32)

    def candidate_scores(self, indexer, args, kwargs):
        """``GlmMoeDsaIndexer.forward``'s scores (transformers 5.x) ``[B, S, T]``, future keys ``-inf``."""
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

        names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
        a = {**dict(zip(names, args)), **kwargs}
        hs, qr = a["hidden_states"], a["q_resid"]
        cos, sin = a["position_embeddings"]
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
        scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
        future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
        return scores.masked_fill(future, float("-inf"))

    def selected(self, arch):
        return arch.index_topk


class GLM5NextReference(HFReference):
    """``Glm5NextForConditionalGeneration`` (GLM-5.3-Flash), text only: the KPool indexer scores complete pools of
    ``index_kpool`` tokens, keeps ``index_topk // P`` of them (expanded to tokens) and appends the tail pool; its
    output is already -1 padded and sequence-relative."""

    family = "glm5_next"

    def load(self, hf_path, *, dtype, device, num_layers):
        """With ``num_layers`` the text config is cut to the first N layers, so the loader reads only theirs. Every
        parameter of the kept text model must come from the checkpoint."""
        from transformers import Glm5NextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

        config = Glm5NextConfig.from_pretrained(str(hf_path))
        text = config.text_config
        if num_layers is not None:
            for name in ("layer_types", "mlp_layer_types", "indexer_types"):
                value = getattr(text, name, None)
                if isinstance(value, (list, tuple)):
                    setattr(text, name, list(value[:num_layers]))
            text.num_hidden_layers = num_layers
        kwargs = {} if torch.device(device).type == "cpu" else {"device_map": str(device)}
        model, info = Glm5NextForConditionalGeneration.from_pretrained(
            str(hf_path), config=config, dtype=dtype, output_loading_info=True, experts_implementation="eager",
            **kwargs)
        missing = sorted(k for k in info.get("missing_keys") or () if "visual" not in k)
        if missing:
            raise BridgeError(f"{hf_path}: transformers found no checkpoint tensor for {len(missing)} text "
                              f"parameters, e.g. {missing[:5]}")
        return model.eval()

    def decoder_layers(self, hf):
        return list(hf.model.language_model.layers)

    def sequence_rows(self, indexer_out):
        return indexer_out.to(torch.int32)

    def candidate_scores(self, indexer, args, kwargs):
        """``Glm5NextTextIndexer.forward``'s pool scores (transformers 5.24) ``[B, S, pools]``, pools a query may not
        select (incomplete, or ending after it) ``-inf``."""
        names = ("hidden_states", "q_resid", "attention_mask", "cache")
        a = {**dict(zip(names, args)), **kwargs}
        hs, qr, mask = a["hidden_states"], a["q_resid"], a["attention_mask"]
        b, s = hs.shape[:2]
        q = indexer.wq_b(qr).view(b, s, -1, indexer.head_dim)  # [B, S, H, D]
        k = indexer.k_norm(indexer.wk(hs))  # [B, S, D]
        gate = F.linear(hs, indexer.index_kpool_compress_gate)
        packed = torch.cat([k, gate, mask.to(k.dtype)[..., None]], dim=-1)
        visible = indexer.get_visible_tokens(valid_keys=packed[..., -1].bool(), q_length=s, current_length=s)
        pool_keys, pool_indices, pool_valid = indexer.get_pooled_states(packed_states=packed)
        scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))
                        * indexer.softmax_scale)  # [B, S, H, pools]
        weights = indexer.weights_proj(hs.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads**-0.5
        scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, pools]
        pool_end = pool_indices[..., -1].clamp(0, s - 1)
        selectable = visible.gather(-1, pool_end[:, None, :].expand(b, s, -1)) & pool_valid[:, None]
        return scores.masked_fill(~selectable, float("-inf"))

    def selected(self, arch):
        return arch.index_topk // arch.index_kpool


REFERENCES: dict[str, HFReference] = {r.family: r for r in (GLM5Reference(), GLM5NextReference())}


def reference_for(arch) -> HFReference:
    """The transformers reference of ``arch``'s family."""
    family = family_of_architecture(arch)
    if family.name not in REFERENCES:
        raise BridgeError(f"verify: no transformers reference is registered for {family.title} "
                          "(bridge.parity_reference.REFERENCES)")
    return REFERENCES[family.name]


def boundary_ties(scores: torch.Tensor, k: int, rel_eps: float = 0.0) -> set[tuple[int, int]]:
    """Rows ``(batch, query)`` of candidate scores ``[B, S, C]`` (``-inf``: not selectable) with more than ``k``
    candidates whose ``k``-th and next-best scores are equal, or - with ``rel_eps`` - closer than ``rel_eps`` times
    the row's best score (a gap that rounding can close)."""
    v = scores.float().sort(dim=-1, descending=True).values
    if v.shape[-1] <= k:
        return set()
    enough = torch.isfinite(v[..., k])
    gap = v[..., k - 1] - v[..., k]
    tied = enough & (gap <= rel_eps * v[..., 0].abs())
    return {(int(b), int(q)) for b, q in torch.nonzero(tied).tolist()}
