"""``megatron-glm5 rollout-parity``: our log-probs against a rollout engine's, on the engine's own rollouts.

:func:`rollout_parity` loads the model from an HF checkpoint, reads a rollout batch file, computes our per-token
log-probs (:func:`megatron_glm5.rl.compute_logprobs`) with the engine's temperature, once with replay off and, when the
batch carries them, once with the engine's indexer top-k and routed experts replayed, and returns one JSON-able dict:

* ``replay_off`` / ``replay_on``: ``kl`` (the k3 estimator of KL(rollout || ours) per token, ``exp(d) - 1 - d`` with
  ``d = ours - rollout``: non-negative, unbiased under the rollout's samples), ``kl_k1`` (mean of ``rollout - ours``),
  ``abs_diff_mean``, ``abs_diff_max`` of the log-prob difference, over the tokens that have a rollout log-prob;
* ``indexer_overlap``: per replayed layer, the mean and min over tokens of |replayed ∩ ours| / k, our top-k being
  computed by our indexer on the replayed forward's activations (so it isolates each layer's indexer);
  ``routing_mismatch``: per MoE layer, the fraction of token-expert choices our router would have made differently;
* ``kl_reduction``: ``replay_off.kl / replay_on.kl``; each side also lists its ``worst_tokens``.

Batch file (``--batch``), either format; ``n`` sequences of ``L_i`` tokens (prompt + response), ``T = sum L_i``:

* JSON: ``{"temperature": 1.0, "samples": [{"input_ids": [...], "rollout_logprobs": [...], "indexer_topk": ...,
  "routed_experts": ...}, ...]}``. ``rollout_logprobs`` covers the *last* ``R <= L_i - 1`` tokens of the sample (the
  response, as sglang's ``output_token_logprobs``): entry ``j`` is ``log p(input_ids[L_i - R + j] | earlier tokens)``.
  ``indexer_topk`` / ``routed_experts`` (optional): sglang's ``meta_info`` strings as returned (base64 int32,
  token-major ``[L_i - 1, num_hidden_layers, k]``) or nested lists ``[layers][rows][k]`` (layer-major).
* safetensors: ``input_ids`` int ``[T]``, ``cu_seqlens`` int ``[n + 1]``, ``rollout_logprobs`` float ``[T]``
  (entry ``t`` = log p(token ``t`` | the tokens before it in its sequence), NaN where the engine has none),
  optional ``indexer_topk`` int32 ``[layers, T, index_topk]`` and ``routed_experts`` int32 ``[layers, T, topk]``
  (sequence-relative positions / expert ids, -1 padded); the temperature in the metadata (``{"temperature": "0.7"}``).

Payload conventions and checks: :mod:`megatron_glm5.rl.payload`. ``--plot FILE`` draws |d logprob| along the packed
tokens (replay off and on) and the per-layer overlap: an ``.svg`` is written directly, other suffixes (``.png``,
``.pdf``) need matplotlib.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BridgeError


@dataclass
class RolloutBatch:
    input_ids: Any  # int64 [T]
    cu_seqlens: list[int]
    rollout_logprobs: Any  # fp32 [T], NaN where absent (token-indexed)
    indexer_topk: Any = None
    routed_experts: Any = None
    temperature: float = 1.0


# --------------------------------------------------------------------------------------------------------------------
# Batch files
# --------------------------------------------------------------------------------------------------------------------


def check_batch_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise BridgeError(f"--batch {path}: no such file; expected a rollout batch (.json or .safetensors)")
    if p.suffix not in (".json", ".safetensors"):
        raise BridgeError(f"--batch {path}: unknown suffix {p.suffix!r}; expected .json or .safetensors")
    return p


def load_batch(path: str | Path) -> RolloutBatch:
    """Read a rollout batch file (module docstring); format errors are :class:`BridgeError` naming the file."""
    from megatron_glm5.rl.packing import PackedBatch

    p = check_batch_path(path)
    batch = _load_safetensors(p) if p.suffix == ".safetensors" else _load_json(p)
    try:
        PackedBatch.build(batch.input_ids, batch.cu_seqlens)
    except ValueError as e:
        raise BridgeError(f"--batch {p}: {e}") from None
    check_rollout_logprobs(batch, f"--batch {p}")
    return batch


def check_rollout_logprobs(batch: RolloutBatch, where: str = "--batch") -> None:
    """Every rollout log-prob is a log-probability: finite and <= 0 (NaN marks a token without one). A value above 0
    (a probability > 1, e.g. a logit or a sign error) or an infinity would make every KL below meaningless."""
    import torch

    lps = batch.rollout_logprobs
    bad = ((lps > 0) | torch.isinf(lps)).nonzero()[:, 0]
    if bad.numel() == 0:
        return
    t = int(bad[0])
    starts = torch.tensor(batch.cu_seqlens[:-1])
    seq = int(torch.searchsorted(starts, torch.tensor(t), right=True)) - 1
    raise BridgeError(f"{where}: rollout log-prob {float(lps[t]):g} of token {int(batch.input_ids[t])} (sample {seq}, "
                      f"position {t - int(starts[seq])}) is not a log-probability: expected a finite value <= 0"
                      + (f" ({bad.numel()} such values)" if bad.numel() > 1 else ""))


def _load_json(p: Path) -> RolloutBatch:
    import torch

    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BridgeError(f"--batch {p}: not valid JSON ({e})") from None
    samples = data.get("samples") if isinstance(data, dict) else None
    if not isinstance(samples, list) or not samples:
        raise BridgeError(f"--batch {p}: expected an object with a non-empty \"samples\" list")
    ids, lps, cu, topk, experts = [], [], [0], [], []
    for i, s in enumerate(samples):
        if not isinstance(s, dict) or "input_ids" not in s or "rollout_logprobs" not in s:
            raise BridgeError(f"--batch {p}: sample {i} needs \"input_ids\" and \"rollout_logprobs\"")
        tokens = _int_list(s["input_ids"], f"sample {i} input_ids", p)
        rollout = s["rollout_logprobs"]
        if not isinstance(rollout, list) or not all(isinstance(v, (int, float)) for v in rollout):
            raise BridgeError(f"--batch {p}: sample {i} rollout_logprobs must be a list of numbers")
        if len(tokens) < 2 or len(rollout) > len(tokens) - 1:
            raise BridgeError(f"--batch {p}: sample {i} has {len(tokens)} tokens and {len(rollout)} rollout log-probs; "
                              "expected at least 2 tokens and at most one log-prob per token after the first")
        nan = next((j for j, v in enumerate(rollout) if v != v), None)
        if nan is not None:
            pos = len(tokens) - len(rollout) + nan
            raise BridgeError(f"--batch {p}: sample {i} rollout_logprobs[{nan}] is NaN (token {tokens[pos]} at "
                              f"position {pos}): list only the tokens the engine scored (the last R tokens)")
        ids.extend(tokens)
        lps.extend([math.nan] * (len(tokens) - len(rollout)) + [float(v) for v in rollout])
        cu.append(cu[-1] + len(tokens))
        topk.append(_payload(s.get("indexer_topk"), f"sample {i} indexer_topk", p))
        experts.append(_payload(s.get("routed_experts"), f"sample {i} routed_experts", p))
    temperature = data.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise BridgeError(f"--batch {p}: temperature must be a positive number, got {temperature!r}")
    return RolloutBatch(input_ids=torch.tensor(ids, dtype=torch.int64), cu_seqlens=cu,
                        rollout_logprobs=torch.tensor(lps, dtype=torch.float32),
                        indexer_topk=_all_or_none(topk, "indexer_topk", p),
                        routed_experts=_all_or_none(experts, "routed_experts", p), temperature=float(temperature))


def _int_list(value, what: str, p: Path) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BridgeError(f"--batch {p}: {what} must be a list of integers")
    return value


def _payload(value, what: str, p: Path):
    import numpy as np

    if value is None or isinstance(value, str):
        return value
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (ValueError, TypeError):
        raise BridgeError(f"--batch {p}: {what} must be a base64 string or nested lists [layers][rows][k]") from None
    if arr.ndim != 3:
        raise BridgeError(f"--batch {p}: {what} must be [layers][rows][k], got {arr.ndim} dimensions")
    return arr.astype(np.int32)


def _all_or_none(values: list, what: str, p: Path):
    given = [v is not None for v in values]
    if any(given) and not all(given):
        raise BridgeError(f"--batch {p}: {what} is given for some samples but not for sample {given.index(False)}")
    return values if all(given) else None


def _load_safetensors(p: Path) -> RolloutBatch:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            names = set(f.keys())
            meta = f.metadata() or {}
            get = lambda n: f.get_tensor(n) if n in names else None  # noqa: E731
            ids, cu, lps = get("input_ids"), get("cu_seqlens"), get("rollout_logprobs")
            topk, experts = get("indexer_topk"), get("routed_experts")
    except (SafetensorError, OSError) as e:
        raise BridgeError(f"--batch {p}: not a readable safetensors file ({e})") from None
    missing = [n for n, t in (("input_ids", ids), ("cu_seqlens", cu), ("rollout_logprobs", lps)) if t is None]
    if missing:
        raise BridgeError(f"--batch {p}: missing tensors {missing}; expected input_ids, cu_seqlens, rollout_logprobs")
    if ids.dim() != 1 or lps.shape != ids.shape or cu.dim() != 1:
        raise BridgeError(f"--batch {p}: input_ids and rollout_logprobs must be [T] and cu_seqlens [n + 1], got "
                          f"{tuple(ids.shape)}, {tuple(lps.shape)}, {tuple(cu.shape)}")
    try:
        temperature = float(meta.get("temperature", 1.0))
    except ValueError:
        raise BridgeError(f"--batch {p}: metadata temperature {meta['temperature']!r} is not a number") from None
    if not temperature > 0:
        raise BridgeError(f"--batch {p}: temperature must be positive, got {temperature}")
    return RolloutBatch(input_ids=ids.long(), cu_seqlens=[int(c) for c in cu.tolist()],
                        rollout_logprobs=lps.float(), indexer_topk=topk, routed_experts=experts,
                        temperature=temperature)


def save_batch(path: str | Path, batch: RolloutBatch) -> Path:
    """Write ``batch`` in the safetensors format (packed payload arrays only)."""
    import torch
    from safetensors.torch import save_file

    tensors = {"input_ids": batch.input_ids.long(), "cu_seqlens": torch.tensor(batch.cu_seqlens, dtype=torch.int32),
               "rollout_logprobs": batch.rollout_logprobs.float()}
    for name in ("indexer_topk", "routed_experts"):
        value = getattr(batch, name)
        if value is not None:
            tensors[name] = torch.as_tensor(value).to(torch.int32).contiguous()
    save_file(tensors, str(path), metadata={"temperature": repr(float(batch.temperature))})
    return Path(path)


# --------------------------------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------------------------------


def token_logprobs(position_logprobs, cu_seqlens: list[int]):
    """Our position-indexed log-probs (``[t]`` = log p(token ``t + 1``)) as token-indexed (``[t]`` = log p(token
    ``t``)), NaN on each sequence's first token."""
    import torch

    out = torch.full_like(position_logprobs, math.nan)
    out[1:] = position_logprobs[:-1]
    out[torch.tensor(cu_seqlens[:-1])] = math.nan
    return out


def logprob_metrics(ours, rollout, cu_seqlens: list[int] | None = None, *, worst: int = 5) -> dict:
    """KL (k3 and k1) and |diff| over the tokens that have both log-probs, and the ``worst`` tokens (largest |diff|:
    packed index, sequence, position, ours, rollout)."""
    import torch

    ours, rollout = ours.double().cpu(), rollout.double().cpu()
    valid = torch.isfinite(rollout) & torch.isfinite(ours)
    d = (ours - rollout)[valid]
    if d.numel() == 0:
        raise BridgeError("--batch: no token has a rollout log-prob to compare against")
    out = {"tokens": int(d.numel()), "kl": float((d.exp() - 1 - d).mean()), "kl_k1": float((-d).mean()),
           "abs_diff_mean": float(d.abs().mean()), "abs_diff_max": float(d.abs().max())}
    if cu_seqlens is not None:
        where = valid.nonzero()[:, 0]
        top = d.abs().topk(min(worst, d.numel())).indices
        starts = torch.tensor(cu_seqlens[:-1])
        rows = []
        for i in top.tolist():
            t = int(where[i])
            seq = int(torch.searchsorted(starts, torch.tensor(t), right=True)) - 1
            rows.append({"token": t, "sequence": seq, "position": t - int(starts[seq]),
                         "ours": float(ours[t]), "rollout": float(rollout[t])})
        out["worst_tokens"] = rows
    return out


def rollout_parity(*, hf_path: str | Path, batch: str | Path | RolloutBatch, backend: str = "megatron",
                   dtype: str | None = None, device: str | None = None, plot: str | Path | None = None) -> dict:
    """See the module docstring. ``dtype`` ``"bf16"`` / ``"fp32"`` (default: bf16 on CUDA, fp32 on CPU)."""
    import torch

    from megatron_glm5.rl import ReplayPayloadError, ReplayStats, compute_logprobs

    from .pretrained import from_hf_pretrained

    if plot is not None:
        check_plot_path(plot)
    data = batch if isinstance(batch, RolloutBatch) else load_batch(batch)
    check_rollout_logprobs(data, "batch")
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    params_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[dtype]
    model = from_hf_pretrained(hf_path, backend=backend, params_dtype=params_dtype)
    if not cuda and next(model.parameters()).is_cuda:
        raise BridgeError("--device cpu: the model was built on CUDA; hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    if int(data.input_ids.max()) >= model.vocab_size or int(data.input_ids.min()) < 0:
        raise BridgeError(f"--batch: token ids must be in [0, {model.vocab_size}), got "
                          f"[{int(data.input_ids.min())}, {int(data.input_ids.max())}]")
    kw = dict(temperature=data.temperature)
    report: dict[str, Any] = {"hf_path": str(hf_path), "backend": backend, "temperature": data.temperature,
                              "sequences": len(data.cu_seqlens) - 1, "tokens": int(data.input_ids.numel())}
    series = {}
    with torch.no_grad():
        off = token_logprobs(compute_logprobs(model, data.input_ids, data.cu_seqlens, **kw).cpu(), data.cu_seqlens)
        report["replay_off"] = logprob_metrics(off, data.rollout_logprobs, data.cu_seqlens)
        series["replay off"] = (off - data.rollout_logprobs).abs()
        if data.indexer_topk is not None or data.routed_experts is not None:
            stats = ReplayStats()
            try:
                on = compute_logprobs(model, data.input_ids, data.cu_seqlens, topk_replay=data.indexer_topk,
                                      routing_replay=data.routed_experts, replay_stats=stats, **kw)
            except ReplayPayloadError as e:
                raise BridgeError(f"--batch: {e}") from None
            on = token_logprobs(on.cpu(), data.cu_seqlens)
            summary = stats.summary()
            report["replay_on"] = logprob_metrics(on, data.rollout_logprobs, data.cu_seqlens)
            report["replayed"] = [n for n, v in (("indexer_topk", data.indexer_topk),
                                                 ("routed_experts", data.routed_experts)) if v is not None]
            report["indexer_overlap"] = {str(k): {"mean": v["mean"], "min": v["min"]}
                                         for k, v in summary["indexer_overlap"].items()}
            report["routing_mismatch"] = {str(k): v["fraction"] for k, v in summary["routing_mismatch"].items()}
            report["low_overlap_layers"] = summary["low_overlap_layers"]
            on_kl = report["replay_on"]["kl"]
            report["kl_reduction"] = report["replay_off"]["kl"] / on_kl if on_kl > 0 else math.inf
            series["replay on"] = (on - data.rollout_logprobs).abs()
    if plot is not None:
        write_plot(plot, series, report.get("indexer_overlap", {}), data.cu_seqlens)
        report["plot"] = str(plot)
    return report


# --------------------------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------------------------


def check_plot_path(path: str | Path) -> None:
    """Before any work: the plot's directory exists and, for a non-SVG file, matplotlib is installed."""
    p = Path(path)
    if not p.parent.is_dir():
        raise BridgeError(f"--plot {path}: directory {p.parent} does not exist")
    if p.suffix.lower() != ".svg":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BridgeError(f"--plot {path}: writing {p.suffix or 'this format'} needs matplotlib "
                              "(pip install matplotlib), or give a .svg path (written without it)") from None


def write_plot(path: str | Path, series: dict, overlap: dict, cu_seqlens: list[int]) -> None:
    """|d logprob| along the packed tokens per series, and the indexer overlap per layer (mean and min)."""
    p = Path(path)
    if p.suffix.lower() == ".svg":
        p.write_text(_svg(series, overlap, cu_seqlens))
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    for name, values in series.items():
        ax1.plot(values.numpy(), lw=0.8, label=name)
    for c in cu_seqlens[1:-1]:
        ax1.axvline(c, color="0.8", lw=0.5)
    ax1.set(xlabel="packed token", ylabel="|d logprob|", title="ours vs rollout")
    ax1.legend()
    layers = list(overlap)
    ax2.bar([i - 0.2 for i in range(len(layers))], [overlap[k]["mean"] for k in layers], width=0.4, label="mean")
    ax2.bar([i + 0.2 for i in range(len(layers))], [overlap[k]["min"] for k in layers], width=0.4, label="min")
    ax2.set(xticks=range(len(layers)), xticklabels=layers, ylim=(0, 1), xlabel="layer", title="top-k overlap")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(p)
    plt.close(fig)


def _svg(series: dict, overlap: dict, cu_seqlens: list[int]) -> str:
    w, h, pad = 900, 300, 40
    colors = ["#1f77b4", "#d62728", "#2ca02c"]
    finite = [float(v) for s in series.values() for v in s.tolist() if math.isfinite(v)]
    top = max(finite + [1e-12])
    t = max(1, cu_seqlens[-1] - 1)
    x = lambda i: pad + (w - 2 * pad) * i / t  # noqa: E731
    y = lambda v: h - pad - (h - 2 * pad) * v / top  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 320}" height="{h}" font-family="sans-serif" '
             'font-size="11">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{pad}" y="16">|d logprob| (ours - rollout) along the packed tokens; max {top:.3g}</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>']
    for c in cu_seqlens[1:-1]:
        parts.append(f'<line x1="{x(c):.1f}" y1="{pad}" x2="{x(c):.1f}" y2="{h - pad}" stroke="#ccc"/>')
    for n, (name, values) in enumerate(series.items()):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values.tolist()) if math.isfinite(v))
        parts.append(f'<polyline fill="none" stroke="{colors[n % 3]}" stroke-width="1" points="{pts}"/>')
        parts.append(f'<text x="{w - pad - 90}" y="{pad + 14 * n}" fill="{colors[n % 3]}">{name}</text>')
    ox, ow = w + 10, 290
    parts.append(f'<text x="{ox}" y="16">indexer top-k overlap per layer (mean, min)</text>')
    layers = list(overlap)
    bw = (ow - 20) / max(1, len(layers))
    for i, k in enumerate(layers):
        for j, (field, color) in enumerate((("mean", colors[0]), ("min", colors[1]))):
            v = overlap[k][field]
            bh = (h - 2 * pad) * v
            parts.append(f'<rect x="{ox + i * bw + j * bw / 2:.1f}" y="{h - pad - bh:.1f}" width="{bw / 2 - 1:.1f}" '
                         f'height="{bh:.1f}" fill="{color}"/>')
        parts.append(f'<text x="{ox + i * bw:.1f}" y="{h - pad + 14}">{k}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
