"""``verify`` for GLM-5.3-Flash: our megatron-core model against transformers' ``Glm5NextForConditionalGeneration``
on the same weights (what :func:`bridge.parity.verify` dispatches to for a ``glm5_next`` checkpoint).

Same inputs, outputs and tolerances as GLM-5's check (:mod:`bridge.parity`), with what differs:

* top-k: both sides' KPool selections are token rows of width ``index_topk + P - 1`` (pools expanded, the tail
  appended); they are compared as sets per query row (``topk_overlap``, ``topk_rows_differing``) for every full DSA
  layer. transformers' selection is read with a forward hook on ``self_attn.indexer``;
* HF's choices replayed: its KPool rows (full DSA layers; shared ones reuse them) and its experts (megatron-core's
  ``RouterReplay``) are forced into our forward, which tests everything but the choices, while our indexers and
  routers still run on the replayed activations so their own choices on HF-equivalent inputs are compared too;
* ``ok`` in fp32: ``max_rel_logit_diff <= tol``, or - when our own choices differ from HF's on some rows (a pool
  score or router score at a near-tie, flipped by rounding) - the replayed logits within ``tol`` and at most
  :data:`FP32_MAX_FLIPPED_ROWS` of the rows choosing differently on HF's activations (no tie analysis of pool
  scores here: a bug changes far more rows). bf16: as GLM-5 (replayed mean relative difference and >= 95 %
  agreement of choices).
* per-layer differences compare the mHC streams after each decoder layer (``[b, s, hc_mult, h]``).

The vision tower is not run (text only).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from .errors import BridgeError
from .metrics import logit_cosine
from .parity import (
    BF16_MIN_CHOICE_AGREEMENT,
    SEQ_MARGIN,
    TOLERANCES,
    _batch_major,
    _batch_major_ids,
    _build_ours,
    _rel,
    _replay_forward,
    _routing_differences,
    _seq_major,
    parse_verify_dtype,
    resolve_device,
)
from .preflight import hf_checkpoint_dir, read_hf_config

FP32_MAX_FLIPPED_ROWS = 0.01
"""fp32: largest fraction of (layer, query row) selections or token routings allowed to differ from HF's on HF's own
activations when the check falls back to the replayed logits."""


def default_seq_len(arch) -> int:
    """``index_topk + 256`` rounded up to a multiple of 64 (as GLM-5): the indexer really selects on the last rows."""
    return -(-(arch.index_topk + SEQ_MARGIN) // 64) * 64


def load_hf_model(hf_path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu",
                  num_layers: int | None = None):
    """transformers' ``Glm5NextForConditionalGeneration``; with ``num_layers`` its text config is cut to the first N
    layers so that the loader reads only theirs. Every parameter of the kept text model must come from the
    checkpoint."""
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
        str(hf_path), config=config, dtype=dtype, output_loading_info=True, experts_implementation="eager", **kwargs)
    missing = sorted(k for k in info.get("missing_keys") or () if "visual" not in k)
    if missing:
        raise BridgeError(f"{hf_path}: transformers found no checkpoint tensor for {len(missing)} text parameters, "
                          f"e.g. {missing[:5]}")
    return model.eval()


def _hf_rows(hf_topk: torch.Tensor) -> torch.Tensor:
    """HF's ``[B, S, W]`` per-row token positions (-1 padded) -> our ``[B * S, W]`` global key rows (int32)."""
    b, s, _ = hf_topk.shape
    offset = torch.arange(b)[:, None, None] * s
    return torch.where(hf_topk >= 0, hf_topk + offset, hf_topk).to(torch.int32).reshape(b * s, -1)


def _set_differences(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(mean over rows of |a & b| / |b|, rows whose sets differ) of two ``[T, W]`` -1-padded index tensors."""
    fractions, differing = [], 0
    for x, y in zip(a.tolist(), b.tolist()):
        sx, sy = {v for v in x if v >= 0}, {v for v in y if v >= 0}
        fractions.append(len(sx & sy) / max(len(sy), 1))
        differing += sx != sy
    return sum(fractions) / max(len(fractions), 1), differing


@torch.no_grad()
def verify_glm5_next(*, hf_path, megatron_path=None, seq_len=None, batch_size: int = 1, seed: int = 0, tol=None,
                     model=None, num_layers=None, dtype="fp32", device=None) -> dict:
    """GLM-5.3-Flash parity check (module docstring); arguments as :func:`bridge.parity.verify`."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.architectures import parse_architecture
    from megatron_glm5.parallel import initialize_model_parallel

    t0 = time.perf_counter()
    hf_checkpoint_dir(hf_path, flag="--hf-path")
    raw = read_hf_config(hf_path)
    arch = parse_architecture(raw)
    if arch.is_fp8:
        raise BridgeError(f"--hf-path {hf_path}: verify needs an unquantised HF checkpoint (this one is FP8)")
    torch_dtype = parse_verify_dtype(dtype)
    dev = resolve_device(device)
    if num_layers is not None:
        from .source import check_num_layers

        check_num_layers(num_layers, arch, source=f"{hf_path}/config.json")
        if model is not None and model.config.num_layers != num_layers:
            raise BridgeError(f"verify(model=..., num_layers={num_layers}): the given model has "
                              f"{model.config.num_layers} decoder layers")
    kept = arch.num_hidden_layers if num_layers is None else num_layers
    seq_len = default_seq_len(arch) if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= arch.index_topk:
        raise BridgeError(f"--seq-len {seq_len} must exceed index_topk ({arch.index_topk}); otherwise DSA keeps every "
                          f"key and the indexer is not exercised (default: {default_seq_len(arch)})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BridgeError(f"--batch-size: expected an integer >= 1, got {batch_size!r}")
    tol = TOLERANCES[torch_dtype] if tol is None else tol
    if not (isinstance(tol, (int, float)) and tol > 0 and math.isfinite(tol)):
        raise BridgeError(f"--tol: expected a positive number, got {tol!r}")
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel()
    if model is None:
        model = _build_ours(hf_path, megatron_path, dtype=torch_dtype, cuda=dev.type == "cuda", num_layers=num_layers)
    model.eval()
    device = next(model.parameters()).device
    hf = load_hf_model(hf_path, dtype=torch_dtype, device=device, num_layers=num_layers)
    text = hf.model.language_model

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch_size, seq_len), generator=gen)
    pos = torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len)
    ours_topk, ours_hidden, ours_experts, hf_topk, hf_hidden, hf_experts = {}, {}, {}, {}, {}, {}
    hooks = []
    n, h = arch.hc_mult, arch.hidden_size
    for layer in model.decoder.layers:
        gi = layer.layer_number - 1
        hooks.append(layer.register_forward_hook(lambda mod, a, out, gi=gi: ours_hidden.__setitem__(
            gi, out[0].transpose(0, 1).float().cpu().unflatten(-1, (n, h)))))
        if getattr(layer.self_attention, "computes_topk", False):
            hooks.append(layer.self_attention.register_forward_hook(
                lambda mod, a, out, gi=gi: ours_topk.__setitem__(gi, out[2].cpu())))
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            hooks.append(router.register_forward_hook(lambda mod, a, out, gi=gi: ours_experts.__setitem__(
                gi, _batch_major(out[1].cpu(), batch_size, seq_len))))
    for i, layer in enumerate(text.layers):
        hooks.append(layer.register_forward_hook(
            lambda mod, a, out, i=i: hf_hidden.__setitem__(i, out[0].float().cpu())))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            hooks.append(gate.register_forward_hook(lambda mod, a, out, i=i: hf_experts.__setitem__(i, out[2].cpu())))
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(
                lambda mod, a, out, i=i: hf_topk.__setitem__(i, _hf_rows(out.cpu()))))
    hf_device = next(hf.parameters()).device
    try:
        ours = model(ids.to(device), pos.to(device), None).float().cpu()
        theirs = hf(input_ids=ids.to(hf_device)).logits.float().cpu()
    finally:
        for hk in hooks:
            hk.remove()

    overlap, differing = {}, 0
    for i, want in sorted(hf_topk.items()):
        if i in ours_topk:
            overlap[str(i)], d = _set_differences(ours_topk[i], want)
            differing += d
    routing_differs = {str(i): int(_routing_differences(want, ours_experts[i]).sum())
                       for i, want in sorted(hf_experts.items()) if i in ours_experts}

    replayed, replay_topk, replay_experts = _replay_forward(
        model, ids.to(device), pos.to(device), device=device,
        dsa_topk={i: t.to(device) for i, t in hf_topk.items()},
        experts={i: _seq_major(idx, batch_size, seq_len) for i, idx in hf_experts.items()})
    replay_overlap, replay_differing = {}, 0
    for i, mine in sorted(replay_topk.items()):
        replay_overlap[str(i)], d = _set_differences(mine, hf_topk[i])
        replay_differing += d
    routing_replay_differs = {}
    for i, natural in sorted(replay_experts.items()):
        rows = (torch.zeros(len(natural), arch.n_routed_experts, dtype=torch.bool)
                .scatter_(1, _batch_major_ids(natural, batch_size, seq_len), True))
        routing_replay_differs[str(i)] = int(_routing_differences(hf_experts[i], rows).sum())
    tokens = batch_size * seq_len
    agreement = min([*replay_overlap.values(), *(1 - c / tokens for c in routing_replay_differs.values())],
                    default=1.0)
    choices = tokens * (len(replay_topk) + len(replay_experts))
    flipped = (replay_differing + sum(routing_replay_differs.values())) / max(choices, 1)

    diff, replay_diff = (ours - theirs).abs(), (replayed - theirs).abs()
    max_rel, mean_rel = _rel(diff, theirs)
    replay_max_rel, replay_mean_rel = _rel(replay_diff, theirs)
    layers = [i for i in sorted(ours_hidden) if i in hf_hidden]
    layer_rel = [_rel((ours_hidden[i] - hf_hidden[i]).abs(), hf_hidden[i]) for i in layers]
    bf16 = torch_dtype == torch.bfloat16
    first_bad = next((i for i, r in zip(layers, layer_rel) if not r[1 if bf16 else 0] <= tol), None)
    max_diff = diff.max().item()
    if bf16:
        ok = math.isfinite(max_diff) and replay_mean_rel <= tol and agreement >= BF16_MIN_CHOICE_AGREEMENT
    else:
        replay_ok = replay_max_rel <= tol and flipped <= FP32_MAX_FLIPPED_ROWS
        ok = math.isfinite(max_diff) and (max_rel <= tol or replay_ok)
    return {
        "model_type": arch.model_type,
        "max_abs_logit_diff": max_diff,
        "mean_abs_logit_diff": diff.mean().item(),
        "max_rel_logit_diff": max_rel,
        "mean_rel_logit_diff": mean_rel,
        "logit_scale": theirs.abs().max().item(),
        "logit_cosine": logit_cosine(ours, theirs),
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "topk_overlap": overlap,
        "topk_rows_differing": differing,
        "topk_rows_differing_on_hf_inputs": replay_differing,
        "topk_overlap_on_hf_inputs": replay_overlap,
        "moe_rows_routed_differently": routing_differs,
        "moe_rows_routed_differently_on_hf_inputs": routing_replay_differs,
        "choices_flipped_on_hf_inputs": flipped,
        "min_choice_agreement_on_hf_inputs": agreement,
        "max_abs_logit_diff_with_hf_topk": replay_diff.max().item(),
        "max_rel_logit_diff_with_hf_topk": replay_max_rel,
        "mean_rel_logit_diff_with_hf_topk": replay_mean_rel,
        "layer_max_rel_diff": [r[0] for r in layer_rel],
        "layer_mean_rel_diff": [r[1] for r in layer_rel],
        "first_divergent_layer": first_bad,
        "layers_checked": layers,
        "num_layers": kept,
        "num_hidden_layers": arch.num_hidden_layers,
        "mtp_loaded": bool(getattr(model, "mtp_process", False)),
        "dtype": "bf16" if bf16 else "fp32",
        "device": str(device),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "index_topk": arch.index_topk,
        "seed": seed,
        "tol": tol,
        "tol_metric": "mean_rel_logit_diff_with_hf_topk" if bf16 else "max_rel_logit_diff",
        "ok": bool(ok),
        "seconds": time.perf_counter() - t0,
        "source": str(megatron_path) if megatron_path is not None else str(hf_path),
    }
