"""Adapter checkpoints for LoRA models (:mod:`megatron_glm5.lora`) through megatron-core's ``dist_checkpointing``.

* :func:`save_lora_checkpoint` / :func:`load_lora_checkpoint`: an adapter-only ``torch_dist`` checkpoint (a few MB
  for attention adapters; resharded on load to any TP / PP / EP like any megatron-core checkpoint). Keys are the
  adapters' dist-checkpoint keys (``decoder.layers.3.self_attention.linear_proj.lora_A.weight``, routed experts
  stacked along an expert axis as megatron-core stacks their weights), the common state carries the LoRA config and
  each adapter's rank / alpha (:data:`LORA_META_KEY`).
* :func:`use_adapter_only_checkpoints`: make a model's ``sharded_state_dict`` / ``load_state_dict`` cover its
  adapters only, so that Megatron-LM's own ``--save`` / ``--load`` write and resume adapter-only checkpoints
  (adapters + their optimizer state; the frozen base has none) while the base comes from elsewhere
  (:func:`load_base_checkpoint`, ``python -m megatron_glm5.pretrain --lora-base-checkpoint``).
* :func:`load_base_checkpoint`: a base (adapter-free) checkpoint into a LoRA model - the one place where adapters
  are allowed to be missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from . import compat
from .lora import (
    LORA_CONFIG_ATTR,
    LoraConfig,
    _chunks,
    base_only,
    is_lora_parameter,
    lora_config,
    lora_modules,
)

LORA_META_KEY = "glm5_lora"
HF_CONFIG_ATTR = "glm5_hf_config"  # bridge.inmemory.HF_CONFIG_ATTR (this package does not import the bridge)
FORMAT_VERSION = 1


class LoraCheckpointError(ValueError):
    """An adapter checkpoint that does not fit the model (names the adapters that differ)."""


def lora_meta(model) -> dict:
    """What an adapter checkpoint records besides tensors: the config and every adapter's (rank, alpha)."""
    config = lora_config(model)
    if config is None:
        raise LoraCheckpointError("the model has no LoRA adapters (call megatron_glm5.lora.add_lora first)")
    meta = {"format_version": FORMAT_VERSION, "config": config.to_dict(),
            "modules": {m.lora_name: [m.lora_rank, m.lora_alpha] for m in lora_modules(model)}}
    hf_config = getattr(_chunks(model)[0], HF_CONFIG_ATTR, None)  # set by bridge.from_hf_pretrained
    if hf_config is not None:
        meta["hf_config"] = dict(hf_config)
    return meta


def adapter_sharded_state_dict(model) -> dict:
    """The adapter entries of ``model.sharded_state_dict()`` (one chunk; see :func:`save_lora_checkpoint`)."""
    (chunk,) = _chunks(model)
    return {k: v for k, v in chunk.sharded_state_dict().items() if is_lora_parameter("." + k)}


def save_lora_checkpoint(model, ckpt_dir: str | Path, *, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``model``'s adapters (collectively, every rank its shards) as a ``torch_dist`` checkpoint in
    ``ckpt_dir``. ``extra``: plain objects kept in the common state (e.g. ``{"iteration": 100}``). Every rank must
    gather the modules' adapters of all ranks in the default process group (``dist_checkpointing.save``)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    meta = all_ranks_meta(model)
    state: dict[str, Any] = {"model": adapter_sharded_state_dict(model), LORA_META_KEY: meta}
    for k, v in (extra or {}).items():
        state[k] = v
    dist_checkpointing.save(state, str(ckpt_dir))
    return ckpt_dir


def all_ranks_meta(model) -> dict:
    """:func:`lora_meta` with the modules of every rank (pipeline stages and expert ranks hold different ones)."""
    import torch.distributed as dist

    meta = lora_meta(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, meta["modules"])
        meta["modules"] = {k: v for p in parts for k, v in p.items()}
    return meta


def read_lora_meta(ckpt_dir: str | Path) -> dict:
    """The :data:`LORA_META_KEY` common-state entry of an adapter checkpoint (empty if there is none)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    common = load_common_state_dict(str(ckpt_dir))
    return dict(common.get(LORA_META_KEY) or {})


def load_lora_checkpoint(model, ckpt_dir: str | Path) -> dict:
    """Load adapters saved by :func:`save_lora_checkpoint` (any parallel layout) into ``model``, whose adapters
    (modules, ranks, alphas) must be the checkpoint's. Returns the checkpoint's common state."""
    from megatron.core import dist_checkpointing

    meta = read_lora_meta(ckpt_dir)
    if not meta:
        raise LoraCheckpointError(f"{ckpt_dir}: not a LoRA adapter checkpoint (no '{LORA_META_KEY}' entry)")
    mine = all_ranks_meta(model)["modules"]
    theirs = {k: list(v) for k, v in meta["modules"].items()}
    check_same_adapters(mine, theirs, source=str(ckpt_dir))
    loaded = dist_checkpointing.load({"model": adapter_sharded_state_dict(model)}, str(ckpt_dir))
    _load_adapter_state(model, loaded.pop("model"), source=str(ckpt_dir))
    return loaded


def check_same_adapters(mine: Mapping[str, list], theirs: Mapping[str, list], *, source: str) -> None:
    """Same adapted modules, ranks and alphas, or a :class:`LoraCheckpointError` naming the differences."""
    from .core.hf_config import natural_key

    def names(xs):
        xs = sorted(xs, key=natural_key)
        return ", ".join(xs[:8]) + (f", ... ({len(xs) - 8} more)" if len(xs) > 8 else "")

    missing, extra = set(mine) - set(theirs), set(theirs) - set(mine)
    problems = []
    if missing:
        problems.append(f"{len(missing)} adapted module(s) of the model are not in it: {names(missing)}")
    if extra:
        problems.append(f"{len(extra)} adapter(s) for modules the model does not adapt: {names(extra)}")
    shape = [f"{n}: model rank {mine[n][0]} alpha {float(mine[n][1]):g}, checkpoint rank {theirs[n][0]} alpha "
             f"{float(theirs[n][1]):g}"
             for n in sorted(set(mine) & set(theirs), key=natural_key)
             if int(mine[n][0]) != int(theirs[n][0]) or float(mine[n][1]) != float(theirs[n][1])]
    if shape:
        problems.append(f"rank/alpha differ for {len(shape)} adapter(s): " + "; ".join(shape[:5]))
    if problems:
        raise LoraCheckpointError(f"{source}: the adapters do not fit the model: " + "; ".join(problems))


def _load_adapter_state(model, state: Mapping[str, torch.Tensor], *, source: str) -> None:
    (chunk,) = _chunks(model)
    wanted = {n for n, _ in chunk.named_parameters() if is_lora_parameter(n)}
    got = set(state)
    if got != wanted:
        raise LoraCheckpointError(f"{source}: adapter tensors differ from the model's: missing "
                                  f"{sorted(wanted - got)[:5]}, unexpected {sorted(got - wanted)[:5]}")
    params = dict(chunk.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def load_base_checkpoint(model, ckpt_dir: str | Path) -> None:
    """Load a base (adapter-free) ``torch_dist`` checkpoint into a model with or without adapters: every base
    tensor must be in it; adapters keep their values. ``ckpt_dir``: an ``iter_XXXXXXX`` directory or a
    Megatron-LM save directory (its latest iteration)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = _resolve(ckpt_dir)
    (chunk,) = _chunks(model)
    with base_only():
        sharded = chunk.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sharded}, str(ckpt_dir))["model"]
    missing, unexpected = chunk.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not is_lora_parameter(k)]
    if missing or unexpected:
        raise LoraCheckpointError(f"{ckpt_dir}: loading the base left parameters unset: {missing[:5]}; "
                                  f"unexpected: {unexpected[:5]}")


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text().strip()
        return path / ("release" if text == "release" else f"iter_{int(text):07d}")
    return path


def checkpoint_has_adapters(ckpt_dir: str | Path) -> bool:
    """Whether a ``torch_dist`` checkpoint holds any LoRA adapter tensor (reads only its ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(_resolve(ckpt_dir))).read_metadata()
    return any(is_lora_parameter("." + k) for k in md.state_dict_metadata)


# --------------------------------------------------------------------------------------------------------------------
# Megatron-LM --save / --load of adapters only
# --------------------------------------------------------------------------------------------------------------------


class AdapterOnlyCheckpoint:
    """Mixin put in front of a ``GPTModel``'s class by :func:`use_adapter_only_checkpoints`."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        full = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {k: v for k, v in full.items() if is_lora_parameter("." + k)}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        _load_adapter_state(self, {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")},
                            source="adapter-only checkpoint")
        return compat.incompatible_keys([], [])


_ADAPTER_ONLY: dict[type, type] = {}


def use_adapter_only_checkpoints(model):
    """Make ``model`` (a LoRA ``GPTModel`` or a list of chunks) checkpoint its adapters only: Megatron-LM's
    ``save_checkpoint`` / ``load_checkpoint`` then write and resume adapter-only checkpoints. The base weights must
    come from elsewhere on every start (:func:`load_base_checkpoint`). Returns ``model``."""
    for chunk in _chunks(model):
        if getattr(chunk, LORA_CONFIG_ATTR, None) is None:
            raise LoraCheckpointError("use_adapter_only_checkpoints: the model has no LoRA adapters")
        cls = type(chunk)
        if issubclass(cls, AdapterOnlyCheckpoint):
            continue
        if cls not in _ADAPTER_ONLY:
            name = f"AdapterOnly{cls.__name__}"
            _ADAPTER_ONLY[cls] = type(name, (AdapterOnlyCheckpoint, cls), {"__module__": __name__,
                                                                          "__qualname__": name})
            globals()[name] = _ADAPTER_ONLY[cls]
        compat.swap_class(chunk, _ADAPTER_ONLY[cls])
    return model


__all__ = [
    "AdapterOnlyCheckpoint", "LORA_META_KEY", "LoraCheckpointError", "LoraConfig", "adapter_sharded_state_dict",
    "check_same_adapters", "checkpoint_has_adapters", "load_base_checkpoint", "load_lora_checkpoint", "lora_meta",
    "read_lora_meta", "save_lora_checkpoint", "use_adapter_only_checkpoints",
]
