"""This rank's share of a megatron-core model as checkpoint boxes, mapped onto the table's logical tensors.

The boxes are exactly those of ``model.sharded_state_dict()`` (main replicas when writing), so a conversion writes
what ``dist_checkpointing.save`` would write for the same model at the same TP/PP/EP; :func:`apply_layout` renames
them to another Megatron layout's keys (:mod:`bridge.megatron_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_glm5.config import GLM5Architecture

from . import naming
from .errors import BridgeError, ShapeMismatchError, TensorSetError, format_names
from .launch import check_parallel_layout
from .mapping import Expansion
from .megatron_io import Chunk, DistCheckpoint
from .megatron_layout import MegatronLayout, resolve_checkpoint, stored_layout_keys, te_extra_state, to_layout


def build_skeleton(arch: GLM5Architecture, tp: int, pp: int, ep: int):
    """This rank's GPTModel on the meta device (shapes and sharding only, no memory).

    The layout is checked first (:func:`~bridge.launch.check_parallel_layout`, which callers also run before
    spawning ranks); should megatron-core still refuse it (a constraint of a newer megatron-core that the check does
    not know), its ``ValueError`` / ``AssertionError`` becomes a :class:`BridgeError` naming the layout, so the
    command line reports one line instead of a traceback from inside a rank."""
    from megatron_glm5.model import build_model, default_cpu_policy

    policy = default_cpu_policy(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        use_cpu_initialization=False, perform_initialization=False, init_model_with_meta_device=True,
        **check_parallel_layout(arch, tp, pp, ep),
    )
    try:
        with torch.device("meta"):
            return build_model(arch, policy)
    except (ValueError, AssertionError) as e:
        raise BridgeError(f"--tp {tp} --pp {pp} --ep {ep}: megatron-core cannot build this model with that layout: "
                          f"{e}") from e


@dataclass
class BoxPlan:
    chunks: list[Chunk] = field(default_factory=list)
    pieces: dict[tuple[str, tuple[int, ...]], naming.LogicalPiece] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)  # in-memory data


def sharded_boxes(model, expansion: Expansion, dtype_of, *, main_replicas_only: bool = True,
                  keep_data: bool = False) -> BoxPlan:
    """The boxes of ``model.sharded_state_dict()`` mapped onto the table's logical tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )

    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    plan = BoxPlan()
    for sh in nested_values(ssd):
        if isinstance(sh, ShardedObject):
            if is_main_replica(sh.replica_id) or not main_replicas_only:
                plan.objects[sh.unique_key] = None  # module extra state (TE FP8 metadata); nothing to carry over
            continue
        if not isinstance(sh, ShardedTensor):
            raise AssertionError(f"unexpected sharded state dict entry {type(sh).__name__}")
        if main_replicas_only and not is_main_replica(sh.replica_id):
            continue
        if sh.flattened_range is not None:
            raise BridgeError(f"{sh.key}: flattened (distributed-optimizer) shards are not model weights")
        if naming.is_layer_stacked(sh.key):
            raise BridgeError(f"{sh.key}: layer-stacked checkpoint keys are not supported (GLM-5.x layers are "
                              "heterogeneous; megatron-core should not stack them)")
        sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        offsets = tuple(sh.global_offset)
        piece = naming.logical_piece(sh.key, offsets, sizes)
        m = expansion.by_mcore.get(piece.logical)
        if m is None:
            raise BridgeError(f"the model has a parameter '{sh.key}' (logical '{piece.logical}') that the mapping "
                              "table does not know; the table in bridge/mapping.py needs a row for it")
        logical_shape = tuple(sh.global_shape[1:]) if naming.expert_stack(sh.key) else tuple(sh.global_shape)
        if logical_shape != tuple(m.mcore_shape):
            raise ShapeMismatchError(f"'{piece.logical}': the model built from config.json has shape "
                                     f"{list(logical_shape)}, the table expects {list(m.mcore_shape)} from the HF shapes")
        chunk = Chunk(sh.key, offsets, sizes, tuple(sh.global_shape), dtype_of(m))
        plan.chunks.append(chunk)
        plan.pieces[(chunk.key, offsets)] = piece
        if keep_data:
            plan.tensors[(chunk.key, offsets)] = sh.data
    return plan


def apply_layout(plan: BoxPlan, expansion: Expansion, layout: MegatronLayout, *, extra_state_here: bool) -> None:
    """Rename ``plan``'s chunks to ``layout``'s keys (norm fusion, decided over the whole table so every rank agrees)
    and, for a TE layout, replace the model's extra-state objects by TE's, written by the one rank that has
    ``extra_state_here`` (objects are not sharded: one writer each)."""
    renamed = to_layout({naming.stored_key(n)[0] for n in expansion.by_mcore}, layout)
    if renamed:
        chunks = [replace(c, key=renamed.get(c.key, c.key)) for c in plan.chunks]
        plan.pieces = {(n.key, n.offsets): plan.pieces[(c.key, c.offsets)] for c, n in zip(plan.chunks, chunks)}
        plan.tensors = {(n.key, n.offsets): plan.tensors[(c.key, c.offsets)] for c, n in zip(plan.chunks, chunks)
                        if (c.key, c.offsets) in plan.tensors}
        plan.chunks = chunks
    if layout.te_extra_state:
        plan.objects = {k: v for k, v in plan.objects.items() if "._extra_state/" not in k}
        if extra_state_here:
            plan.objects.update(te_extra_state(stored_layout_keys(expansion.by_mcore, layout)))


def verify_written(ckpt_dir: Path, expansion: Expansion, *, layout: MegatronLayout, layouts: Sequence[str]) -> None:
    """Every logical tensor of the table is in the written checkpoint, completely, nothing else is, and the keys
    read back as the layout they were written in."""
    ckpt = DistCheckpoint(ckpt_dir)
    for key, md in ckpt.tensors.items():
        volume = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
        if volume != int(md.size.numel()):
            raise AssertionError(f"{key}: written chunks cover {volume} of {int(md.size.numel())} elements")
    found = resolve_checkpoint({k: ckpt.shape(k) for k in ckpt.tensors}, expansion.by_mcore, layouts=layouts,
                               source=str(ckpt_dir), recorded=layout.name)
    if found.layout != layout or found.form != "stacked":
        raise AssertionError(f"{ckpt_dir}: written in the {layout.name} layout, read back as {found.layout.name} "
                             f"({found.form} experts)")
    expected = set(expansion.by_mcore)
    if set(found.sources) != expected:
        got = set(found.sources)
        raise TensorSetError(
            f"{ckpt_dir}: the written checkpoint does not hold the table's tensors (model and table disagree): "
            f"missing {format_names(expected - got)}; unexpected {format_names(got - expected)}",
            missing=expected - got, unexpected=got - expected,
        )
