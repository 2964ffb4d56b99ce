"""Rollout-engine payloads: per-sample indexer top-k and routed experts, decoded, checked and kept per layer.

Formats accepted (per sample ``i`` of ``L_i`` tokens; ``N`` = ``num_hidden_layers``):

* **sglang** (``meta_info["indexer_topk"]`` with ``return_indexer_topk``, ``meta_info["routed_experts"]`` with
  ``return_routed_experts``): a base64 ``str`` of little-endian int32 in *token-major* order ``[rows, layers, k]``
  with ``rows = L_i - 1`` (sglang never runs the last sampled token) and ``layers = N`` (every decoder layer; an
  IndexShare "shared" layer repeats its source layer's indices; dense layers' routing slots are meaningless).
  Indexer values are sequence-relative key positions, -1 padded; routing values are expert ids. We decode it in
  chunks straight into the per-layer buffers (never a whole copy of the sample's payload).
* **arrays** (numpy or torch, any int dtype): ``[layers, rows, k]`` *layer-major*, same value conventions.
* **packed**: one array ``[layers, T, k]`` over the whole packed batch (rows follow ``cu_seqlens``; values still
  sequence-relative).

``rows`` may be ``L_i - 1`` or ``L_i``; ``layers`` may also include the MTP layer(s) after the decoder layers
(``N + mtp``; for routing also "MoE layers only"). A row of all -1 means "no data for this token" (sglang's missing
last token is such a row). For a base64 payload whose size fits several of these shapes, sglang's own
(``L_i - 1`` rows, ``N`` layers) wins.

Validation (host side, before anything reaches a kernel; every error names the sample, the layer and the token):
indexer indices must be -1 or a key position ``0 <= v <= t`` for the token at position ``t`` (no future key, nothing
outside the sequence); expert ids must be in ``[0, num_experts)`` and distinct within a token. When the payload carries
a shared layer, it must repeat its source layer (else the engine runs a different IndexShare pattern).
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

DECODE_CHUNK_BYTES = 32 << 20  # base64 decoded per step (a multiple of 3 bytes and of one token row)


class ReplayPayloadError(ValueError):
    """A rollout payload (indexer top-k or routed experts) is malformed or inconsistent with the model."""


@dataclass(frozen=True, slots=True)
class LayerSelection:
    """Which payload layers to keep and what they mean.

    ``keep``: payload layer index -> model layer key (decoder layer ``i`` or ``N + k`` for MTP layer ``k``).
    ``shares``: payload layer of a shared layer -> payload layer of its source (checked for equality)."""

    keep: dict[int, int]
    shares: dict[int, int]


def _to_numpy(x: Any) -> np.ndarray:
    if torch.is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _b64_token_rows(payload: str, row_values: int):
    """Yield ``(first_row, int32 [rows, row_values])`` chunks of a base64 token-major payload."""
    row_bytes = row_values * 4
    rows_per_chunk = max(1, DECODE_CHUNK_BYTES // row_bytes)
    rows_per_chunk = max(3, rows_per_chunk - rows_per_chunk % 3)  # 3 rows = a whole number of base64 quanta
    step_bytes = rows_per_chunk * row_bytes
    step_chars = step_bytes // 3 * 4
    total = len(payload)
    row = 0
    for c0 in range(0, total, step_chars):
        raw = binascii.a2b_base64(payload[c0:c0 + step_chars])
        if len(raw) % row_bytes:
            raise ReplayPayloadError("base64 payload does not hold whole token rows")
        block = np.frombuffer(raw, dtype="<i4").reshape(-1, row_values)
        yield row, block
        row += block.shape[0]


def _b64_num_bytes(payload: str) -> int:
    pad = len(payload) - len(payload.rstrip("="))
    return len(payload) // 4 * 3 - pad


def _infer_shape(total_values: int, length: int, k: int, layer_options: Sequence[int], *, what: str,
                 sample: int) -> tuple[int, int]:
    """``(rows, layers)`` with ``rows * layers * k == total_values``; sglang's (``L - 1``, first option) first."""
    for rows in (length - 1, length):
        for layers in layer_options:
            if rows >= 0 and rows * layers * k == total_values:
                return rows, layers
    raise ReplayPayloadError(
        f"{what}: sample {sample} ({length} tokens) has {total_values} values, which is not "
        f"rows x layers x {k} for rows in ({length - 1}, {length}) and layers in {tuple(layer_options)}"
    )


def decode_sample(
    payload: Any,
    *,
    length: int,
    k: int,
    layer_options: Sequence[int],
    select: Callable[[int], LayerSelection],
    sample: int,
    what: str,
    check: Callable[[np.ndarray, np.ndarray, int], None],
    dest: dict[int, np.ndarray],
    slot_of: np.ndarray,
) -> None:
    """Decode one sample's payload, check every kept row, and copy the rows the caller keeps.

    ``select(num_payload_layers) -> LayerSelection``; ``check(values [r, k], positions [r], payload_layer)`` raises
    naming the offending position; ``slot_of`` int64 ``[length]``: destination row of each position (-1: not kept,
    e.g. another rank's shard); ``dest[model_layer]``: int32 ``[rows, k]`` destinations (views are fine), left
    untouched on rows the payload lacks (the caller pre-fills them with -1: "no data")."""
    if isinstance(payload, (bytes, str)):
        text = payload.decode("ascii") if isinstance(payload, bytes) else payload
        total = _b64_num_bytes(text)
        if total % 4:
            raise ReplayPayloadError(f"{what}: sample {sample}: base64 payload of {total} bytes is not int32 data")
        rows, layers = _infer_shape(total // 4, length, k, layer_options, what=what, sample=sample)
        sel = select(layers)
        for first, block in _b64_token_rows(text, layers * k):
            _consume(block.reshape(-1, layers, k), first, sel, check, dest, slot_of, sample)
        return
    arr = _to_numpy(payload)
    if arr.ndim != 3 or arr.shape[2] != k:
        raise ReplayPayloadError(f"{what}: sample {sample}: expected an int array [layers, rows, {k}] (layer-major), "
                                 f"got shape {arr.shape}")
    layers, rows = arr.shape[:2]
    if rows not in (length - 1, length) or layers not in layer_options:
        raise ReplayPayloadError(f"{what}: sample {sample} ({length} tokens): array shape {arr.shape} must be "
                                 f"[layers in {tuple(dict.fromkeys(layer_options))}, rows in ({length - 1}, {length}), "
                                 f"{k}]")
    sel = select(layers)
    step = max(1, DECODE_CHUNK_BYTES // max(1, layers * k * 4))
    for first in range(0, rows, step):
        block = np.ascontiguousarray(arr[:, first:first + step].transpose(1, 0, 2))  # [r, layers, k]
        _consume(block.astype(np.int32, copy=False), first, sel, check, dest, slot_of, sample)


def _consume(block: np.ndarray, first: int, sel: LayerSelection, check, dest, slot_of, sample: int) -> None:
    """One chunk ``[r, layers, k]`` of token rows ``first..``: check the kept layers' rows, then that shared layers
    repeat their source, then copy the rows the caller keeps."""
    positions = np.arange(first, first + block.shape[0])
    for p_layer in sel.keep:
        check(block[:, p_layer], positions, p_layer)
    for shared, source in sel.shares.items():
        a, b = block[:, shared], block[:, source]
        diff = (a != -1).any(-1) & (a != b).any(-1)
        if diff.any():
            t = int(positions[np.argmax(diff)])
            raise ReplayPayloadError(
                f"indexer top-k replay: sample {sample}, layer {shared}, token {t}: layer {shared} is an IndexShare "
                f"'shared' layer here (it reuses layer {source}'s top-k) but the payload's indices for it differ from "
                f"layer {source}'s: the rollout engine runs a different indexer pattern than this checkpoint's "
                "indexer_types"
            )
    slots = slot_of[positions]
    keep = slots >= 0
    if keep.any():
        for p_layer, m_layer in sel.keep.items():
            dest[m_layer][slots[keep]] = block[keep, p_layer]


# ------------------------------------------------------------------------------------------------------------------
# Row checks
# ------------------------------------------------------------------------------------------------------------------


def indexer_row_check(sample: int, layer_name):
    """``check(values [r, k], positions [r], payload_layer)`` for indexer top-k (see module docstring)."""

    def check(vals: np.ndarray, positions: np.ndarray, p_layer: int) -> None:
        bad = (vals < -1) | (vals > positions[:, None])
        if bad.any():
            r, c = np.argwhere(bad)[0]
            v, t = int(vals[r, c]), int(positions[r])
            why = "is in the future (keys must be <= the token's own position)" if v > t else "is negative"
            raise ReplayPayloadError(
                f"indexer top-k replay: sample {sample}, layer {layer_name(p_layer)}, token {t}: index {v} {why}; "
                "indices are sequence-relative key positions, -1 for an unused slot"
            )

    return check


def routing_row_check(sample: int, layer_name, num_experts: int):
    """``check`` for routed experts: ids in ``[0, num_experts)``, distinct within a token; all -1 = no data."""

    def check(vals: np.ndarray, positions: np.ndarray, p_layer: int) -> None:
        missing = (vals == -1).all(-1)
        bad = ~missing[:, None] & ((vals < 0) | (vals >= num_experts))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise ReplayPayloadError(
                f"routing replay: sample {sample}, layer {layer_name(p_layer)}, token {int(positions[r])}: expert id "
                f"{int(vals[r, c])} is outside [0, {num_experts})"
            )
        srt = np.sort(vals, axis=-1)
        dup = ~missing & (srt[:, 1:] == srt[:, :-1]).any(-1)
        if dup.any():
            r = int(np.argmax(dup))
            raise ReplayPayloadError(
                f"routing replay: sample {sample}, layer {layer_name(p_layer)}, token {int(positions[r])}: expert ids "
                f"{vals[r].tolist()} repeat an expert"
            )

    return check


def split_packed(packed: Any, cu_seqlens: Sequence[int]) -> list[np.ndarray]:
    """A packed ``[layers, T, k]`` array as per-sample ``[layers, L_i, k]`` views."""
    arr = _to_numpy(packed)
    if arr.ndim != 3 or arr.shape[1] != cu_seqlens[-1]:
        raise ReplayPayloadError(f"a packed payload must be [layers, T={cu_seqlens[-1]}, k], got shape {arr.shape}")
    return [arr[:, a:b] for a, b in zip(cu_seqlens, cu_seqlens[1:])]
