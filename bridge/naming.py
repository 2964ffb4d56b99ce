"""megatron-core dist-checkpoint keys and parameter names <-> the bridge's logical megatron names.

Logical names (those of :mod:`bridge.mapping`) are the state-dict names of a TP=PP=EP=1 model. megatron-core
0.19.2 stores a model under different *keys* (read off ``GPTModel.sharded_state_dict``):

* routed experts of a layer are one stacked tensor: ``...mlp.experts.experts.linear_fc1.weight`` with global shape
  ``[E, 2I, H]`` (SequentialMLP and TEGroupedMLP write the same key), row ``e`` = expert ``e`` =
  logical ``...mlp.experts.local_experts.{e}.linear_fc1.weight``;
* the MTP inner layer is ``mtp.layers.{k}.transformer_layer.*`` (the module is ``mtp_model_layer``); both
  spellings are accepted everywhere;
* decoder layers keep their global index (GLM-5.x layers are heterogeneous - dense/MoE, full/shared indexer - so
  megatron-core never stacks them along a layer axis);
* TE grouped-GEMM *parameter* names ``...mlp.experts.linear_fc1.weight{e}`` (model state dict, not checkpoint
  keys) are the local expert ``e``.

Everything in a Megatron-LM checkpoint that is not a model weight is ignored by name, with the reason, in
:data:`IGNORED_MEGATRON_KEYS`. These are the keys of our (``local``) Megatron layout in megatron-core's default
expert form; the Transformer Engine layouts' names and the ``singleton_local_shards`` form map onto them in
:mod:`bridge.megatron_layout`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MTP_INNER = "mtp_model_layer"  # logical name of the MTP inner layer (dist-checkpoint key: "transformer_layer")

_EXPERT_STACK = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.experts\.(?P<lin>linear_fc[12])\.weight$")
_MTP_INNER = re.compile(r"^(?P<pre>mtp\.layers\.\d+\.)(?:transformer_layer|mtp_model_layer)\.")
_GROUPED_PARAM = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.(?P<lin>linear_fc[12])\.weight(?P<e>\d+)$")
_LAYER_STACKED = re.compile(r"^(decoder|mtp)\.layers\.[^\d]")

IGNORED_MEGATRON_KEYS: tuple[tuple[str, str], ...] = (
    (r"^common_state(/|$)", "megatron-core's non-tensor common state (args, iteration), not a weight"),
    (r"^optimizer\.", "optimizer state (Adam moments, step), not a weight"),
    (r"^rng_state(/|$)", "RNG state"),
    (r"^rerun_state_machine", "rerun state machine bookkeeping"),
    (r"\._extra_state(/|$)", "module extra state (Transformer Engine FP8 metadata), not a weight"),
)
_IGNORED = tuple((re.compile(p), r) for p, r in IGNORED_MEGATRON_KEYS)


def ignored_megatron_reason(key: str) -> str | None:
    for pattern, reason in _IGNORED:
        if pattern.search(key):
            return reason
    return None


def canonical(name: str) -> str:
    """Logical name of a megatron parameter name or dist-checkpoint key without a stacked axis."""
    name = _MTP_INNER.sub(lambda m: f"{m['pre']}{MTP_INNER}.", name)
    m = _GROUPED_PARAM.match(name)
    if m:
        name = f"{m['pre']}.local_experts.{m['e']}.{m['lin']}.weight"
    return name


_LOCAL_EXPERT = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.local_experts\.(?P<e>\d+)\.(?P<lin>linear_fc[12])\.weight$")
_MTP_LOGICAL = re.compile(rf"^(?P<pre>mtp\.layers\.\d+\.){MTP_INNER}\.")


def stored_key(logical: str) -> tuple[str, int | None]:
    """``(dist-checkpoint key, row in its stacked expert axis or None)`` of a logical name, as megatron-core 0.19.2
    stores it by default (the inverse of :func:`logical_tensors`)."""
    name = _MTP_LOGICAL.sub(lambda m: f"{m['pre']}transformer_layer.", logical)
    m = _LOCAL_EXPERT.match(name)
    if m is None:
        return name, None
    return f"{m['pre']}.experts.{m['lin']}.weight", int(m["e"])


def is_layer_stacked(key: str) -> bool:
    """A key of a checkpoint saved with homogeneous layers stacked along a layer axis (not produced for GLM-5.x)."""
    return _LAYER_STACKED.match(key) is not None


@dataclass(frozen=True, slots=True)
class LogicalPiece:
    """The part of a logical tensor that a dist-checkpoint box covers."""

    logical: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def expert_stack(key: str) -> tuple[str, str] | None:
    """``(prefix, linear)`` if ``key`` is a stacked routed-experts key."""
    m = _EXPERT_STACK.match(key)
    return (m["pre"], m["lin"]) if m else None


def logical_tensors(key: str, global_shape: tuple[int, ...]) -> list[tuple[str, int | None, tuple[int, ...]]]:
    """The logical tensors stored under ``key``: ``(logical name, row in the stacked axis or None, shape)``."""
    stack = expert_stack(key)
    if stack is None:
        return [(canonical(key), None, tuple(global_shape))]
    pre, lin = stack
    return [
        (canonical(f"{pre}.local_experts.{e}.{lin}.weight"), e, tuple(global_shape[1:]))
        for e in range(global_shape[0])
    ]


def logical_piece(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> LogicalPiece:
    """Map one box of a dist-checkpoint tensor (as megatron-core writes it: one expert per box for stacked keys)
    to a box of one logical tensor."""
    stack = expert_stack(key)
    if stack is None:
        return LogicalPiece(canonical(key), tuple(offsets), tuple(sizes))
    if sizes[0] != 1:
        raise ValueError(f"{key}: a box spanning experts {offsets[0]}..{offsets[0] + sizes[0] - 1} (expected one)")
    pre, lin = stack
    return LogicalPiece(
        canonical(f"{pre}.local_experts.{offsets[0]}.{lin}.weight"), tuple(offsets[1:]), tuple(sizes[1:])
    )
