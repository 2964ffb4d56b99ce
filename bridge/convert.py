"""Streaming HF <-> Megatron checkpoint conversion: :func:`convert_hf_to_megatron`, :func:`convert_megatron_to_hf`,
:func:`roundtrip` (keyword-only; the CLI is a thin layer over them).

Import, per rank: validate the HF source (config, index, headers, exact key accounting, shapes) -> build this
rank's model skeleton on the meta device -> take the boxes its ``sharded_state_dict`` declares (main replicas
only; the same boxes ``dist_checkpointing.save`` would write) -> for each box, in the order the HF shards store
their tensors, read the HF tensors, apply the table's transform and cut the box -> write it and drop it. Memory
stays at about one logical tensor (plus a cached one, so the two halves of a swiglu ``linear_fc1`` share a read).

Export (one process): read ``.metadata``, map every stored key to logical tensors and account for all of them,
plan the HF shards (header first), then read one logical tensor (one expert row) at a time, transform, write.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from megatron_glm5.config import GLM5Architecture, load_hf_config, mcore_kwargs, parse_hf_config

from . import hf_io, naming
from .compat import needs_indexer_rope_swap
from .errors import BridgeError, CheckpointFormatError, ShapeMismatchError, TensorSetError, format_names
from .launch import (
    all_ok,
    barrier,
    broadcast_object,
    launched_world_size,
    model_parallel,
    pipeline_split,
    run_local_ranks,
    world,
)
from .mapping import Expansion, TensorMap, account_hf_names, check_hf_shapes, detect_expert_layout, expand
from .megatron_io import (
    BRIDGE_KEY,
    COMMON_STATE_KEY,
    FORMAT_VERSION,
    HF_ASSETS_DIR,
    Chunk,
    DistCheckpoint,
    common_state,
    iteration_dir,
    megatron_args,
    resolve_checkpoint_dir,
    write_dist_checkpoint,
    write_tracker,
)
from .output import atomic_output_dir, check_output_dir, commit_dir, partial_dir
from .progress import Progress
from .transforms import dequantize_block_fp8

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise BridgeError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------------------------
# HF source
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class HFSource:
    """A validated HF checkpoint: every tensor accounted for, every shape checked."""

    path: Path
    raw: dict
    arch: GLM5Architecture
    reader: hf_io.HFCheckpointReader
    expansion: Expansion
    ignored: dict[str, str]
    fp8_names: frozenset[str]
    fp8_block: tuple[int, int]


def open_hf_source(hf_path: str | Path) -> HFSource:
    path = Path(hf_path)
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: HF checkpoint directory not found")
    if not (path / "config.json").is_file():
        raise CheckpointFormatError(f"{path}: missing config.json")
    raw = load_hf_config(path)
    arch = parse_hf_config(raw)
    reader = hf_io.HFCheckpointReader(path)
    layout = detect_expert_layout(reader.names)
    fp8 = frozenset(n for n, i in reader.tensors.items() if i.dtype in FP8_DTYPES)
    if fp8 and not arch.is_fp8:
        raise CheckpointFormatError(
            f"{path}: {len(fp8)} tensors are stored in FP8 (e.g. {sorted(fp8)[0]}) but config.json has no fp8 "
            "quantization_config; expected block-FP8 metadata ('quant_method': 'fp8', 'weight_block_size')"
        )
    block = tuple((arch.quantization or {}).get("weight_block_size") or (128, 128))
    expansion = expand(arch, expert_layout=layout, fp8_names=fp8, fp8_block=block,
                       indexer_rope_swap=needs_indexer_rope_swap())
    ignored = account_hf_names(arch, expansion, reader.names, source=str(path))
    check_hf_shapes(expansion, reader.shapes(), source=str(path))
    return HFSource(path, raw, arch, reader, expansion, ignored, fp8, block)


class Materializer:
    """Logical megatron tensors computed from an :class:`HFSource`, with a one-entry cache."""

    def __init__(self, src: HFSource, dtype: torch.dtype | None = None):
        self.src = src
        self.dtype = dtype
        self._cached: tuple[str, torch.Tensor] | None = None

    def target_dtype(self, m: TensorMap) -> torch.dtype:
        if m.fp32:
            return torch.float32
        if self.dtype is not None:
            return self.dtype
        first = m.hf[0]
        return torch.bfloat16 if first.scale is not None else self.src.reader.info(first.name).dtype

    def get(self, name: str) -> torch.Tensor:
        if self._cached is not None and self._cached[0] == name:
            return self._cached[1]
        self._cached = None
        m = self.src.expansion.by_mcore[name]
        dtype = self.target_dtype(m)
        parts = [self._read(r, dtype) for r in m.hf]
        t = m.transform.to_mcore(parts).to(dtype)
        self._cached = (name, t)
        return t

    def box(self, name: str, offsets, sizes) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of logical tensor ``name`` in its target dtype. When the box lies in
        one HF tensor (a TP slice, or the gate / up half that megatron-core's swiglu factory stores as its own
        chunk) only that tensor is read, with no concatenation or copy."""
        m = self.src.expansion.by_mcore[name]
        where = m.transform.locate(tuple(offsets), tuple(sizes), [r.shape for r in m.hf])
        if where is None:
            return _box(self.get(name), offsets, sizes)
        i, part_offsets = where
        ref, dtype = m.hf[i], self.target_dtype(m)
        whole_rows = all(o == 0 and n == d for o, n, d in zip(part_offsets[1:], sizes[1:], ref.shape[1:]))
        if ref.scale is None and whole_rows and sizes[0] != ref.shape[0]:  # a row range (TP slice): read only it
            return self.src.reader.read(ref.name, ref.row, rows=(part_offsets[0], part_offsets[0] + sizes[0])).to(dtype)
        key = f"{name}#{i}"
        if self._cached is not None and self._cached[0] == key:
            t = self._cached[1]
        else:
            self._cached = None
            t = self._read(ref, dtype).to(dtype)
            self._cached = (key, t)
        return _box(t, part_offsets, sizes)

    def _read(self, ref, dtype: torch.dtype) -> torch.Tensor:
        t = self.src.reader.read(ref.name, ref.row)
        if ref.scale is not None:
            s = self.src.reader.read(ref.scale.name, ref.scale.row)
            t = dequantize_block_fp8(t, s, self.src.fp8_block, dtype)
        return t

    def source_order(self, name: str) -> tuple[str, int]:
        """(file, byte offset) of the first HF tensor of ``name``: converting in this order reads shards in order."""
        ref = self.src.expansion.by_mcore[name].hf[0]
        info = self.src.reader.info(ref.name)
        return str(info.file), info.start


def _box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


# --------------------------------------------------------------------------------------------------------------------
# Model skeleton -> boxes
# --------------------------------------------------------------------------------------------------------------------


def build_skeleton(arch: GLM5Architecture, tp: int, pp: int, ep: int):
    """This rank's GPTModel on the meta device (shapes and sharding only, no memory)."""
    from megatron_glm5.model import build_model, default_cpu_policy

    policy = default_cpu_policy(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        use_cpu_initialization=False, perform_initialization=False, init_model_with_meta_device=True,
        **pipeline_split(arch.indexer_types, pp),
    )
    with torch.device("meta"):
        return build_model(arch, policy)


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


def verify_written(ckpt_dir: Path, expansion: Expansion) -> None:
    """Every logical tensor of the table is in the written checkpoint, completely, and nothing else is."""
    ckpt = DistCheckpoint(ckpt_dir)
    found: set[str] = set()
    for key, md in ckpt.tensors.items():
        volume = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
        if volume != int(md.size.numel()):
            raise AssertionError(f"{key}: written chunks cover {volume} of {int(md.size.numel())} elements")
        found.update(name for name, _, _ in naming.logical_tensors(key, tuple(md.size)))
    expected = set(expansion.by_mcore)
    if found != expected:
        raise TensorSetError(
            f"{ckpt_dir}: the written checkpoint does not hold the table's tensors (model and table disagree): "
            f"missing {format_names(expected - found)}; unexpected {format_names(found - expected)}",
            missing=expected - found, unexpected=found - expected,
        )


# --------------------------------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------------------------------


def convert_hf_to_megatron(
    *,
    hf_path: str | Path,
    megatron_path: str | Path,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: str | torch.dtype | None = None,
    iteration: int = 0,
    overwrite: bool = False,
    progress: bool | None = None,
    sync_files: bool = True,
) -> dict:
    """HF checkpoint -> megatron-core ``torch_dist`` checkpoint in Megatron-LM's layout
    (``<megatron_path>/iter_XXXXXXX/`` + ``latest_checkpointed_iteration.txt``), loadable at any TP/PP/EP.

    ``tp``/``pp``/``ep`` choose how the *conversion* is sharded over ranks (``tp*pp*ep`` ranks: under ``torchrun``
    the launched ones, otherwise spawned locally); the result does not depend on them. ``dtype`` None keeps each
    tensor's source dtype (FP8 sources become bf16); the router's ``e_score_correction_bias`` stays fp32.
    ``sync_files`` fsyncs the data before the rename that publishes the checkpoint (crash safety).
    """
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if int(v) < 1:
            raise BridgeError(f"--{name}: expected >= 1, got {v}")
    parse_dtype(dtype)
    final = check_output_dir(megatron_path, overwrite=overwrite)
    nranks = tp * pp * ep
    size = launched_world_size()
    kwargs = dict(hf_path=str(hf_path), tp=tp, pp=pp, ep=ep, dtype=None if dtype is None else dtype_name(parse_dtype(dtype)),
                  iteration=iteration, progress=progress, sync_files=sync_files)
    if size == 1 and nranks > 1:
        open_hf_source(hf_path)  # fail on bad input here, before starting ranks
        tmp = partial_dir(final)
        tmp.mkdir(parents=True)
        try:
            reports = run_local_ranks(_import_rank, nranks, out=str(tmp), **kwargs)
            commit_dir(tmp, final, overwrite=overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return _merge_reports(reports, final)
    if size != nranks:
        raise BridgeError(f"launched with {size} ranks but --tp {tp} --pp {pp} --ep {ep} needs {nranks}")
    if size > 1:
        from megatron_glm5.parallel import ensure_process_group

        ensure_process_group()
    rank, _ = world()
    tmp = Path(broadcast_object(str(partial_dir(final)) if rank == 0 else None))
    if rank == 0:
        tmp.mkdir(parents=True)
    barrier()
    try:
        report = _import_rank(out=str(tmp), **kwargs)
        barrier()
        if rank == 0:
            commit_dir(tmp, final, overwrite=overwrite)
        barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _merge_reports([report], final)


def _merge_reports(reports: list[dict], final: Path) -> dict:
    out = dict(reports[0])
    out["bytes"] = sum(r["bytes"] for r in reports)
    out["chunks"] = sum(r["chunks"] for r in reports)
    out["seconds"] = max(r["seconds"] for r in reports)
    out["gb_per_s"] = out["bytes"] / max(out["seconds"], 1e-9) / 1e9
    out["path"] = str(final)
    return out


def _import_rank(*, hf_path: str, out: str, tp: int, pp: int, ep: int, dtype: str | None, iteration: int,
                 progress: bool | None, sync_files: bool) -> dict:
    t0 = time.perf_counter()
    rank, _ = world()
    try:
        src = open_hf_source(hf_path)
        ok, msg = True, ""
    except (BridgeError, ValueError) as e:
        ok, msg, src = False, str(e), None
    all_ok(ok, msg)
    if src is None:
        raise BridgeError(msg)
    mat = Materializer(src, parse_dtype(dtype))
    with model_parallel(tp, pp, ep):
        model = build_skeleton(src.arch, tp, pp, ep)
        plan = sharded_boxes(model, src.expansion, mat.target_dtype)
        del model
    plan.chunks.sort(key=lambda c: (*mat.source_order(plan.pieces[(c.key, c.offsets)].logical), c.key, c.offsets))
    ckpt_dir = iteration_dir(Path(out), iteration)
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "hf_config": src.raw, "expert_layout": src.expansion.expert_layout,
                "source_fp8": bool(src.fp8_names), "hf_source": str(src.path)}
        args = megatron_args(mcore_kwargs(src.arch), tp=tp, pp=pp, ep=ep)
        plan.objects[COMMON_STATE_KEY] = common_state(args=args, iteration=iteration, bridge_meta=meta)

    bar = Progress(total=len(plan.chunks), total_bytes=sum(c.nbytes for c in plan.chunks),
                   desc=f"import{f' rank {rank}' if rank else ''}", enabled=progress if rank == 0 else False)

    def resolve(chunk: Chunk) -> torch.Tensor:
        piece = plan.pieces[(chunk.key, chunk.offsets)]
        return mat.box(piece.logical, piece.offsets, piece.sizes).reshape(chunk.sizes).to(chunk.dtype)

    write_dist_checkpoint(ckpt_dir, plan.chunks, plan.objects, resolve,
                          on_written=lambda c: bar.update(c.nbytes), sync_files=sync_files)
    bar.close()
    src.reader.close()
    if rank == 0:
        verify_written(ckpt_dir, src.expansion)
        assets = Path(out) / HF_ASSETS_DIR
        assets.mkdir(exist_ok=True)
        hf_io.copy_assets(src.path, assets)
        write_tracker(Path(out), iteration)
    seconds = time.perf_counter() - t0
    nbytes = sum(c.nbytes for c in plan.chunks)
    return {
        "tensors": len(src.expansion.maps), "hf_tensors": len(src.reader.names), "chunks": len(plan.chunks),
        "bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9,
        "expert_layout": src.expansion.expert_layout, "fp8_dequantized": len(src.fp8_names),
        "ignored": src.ignored, "tp": tp, "pp": pp, "ep": ep, "iteration": iteration,
    }


# --------------------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------------------


def _export_config(raw: Mapping, weights_dtype: torch.dtype, *, dtype_changed: bool) -> dict:
    """config.json for the exported weights: an FP8 source's ``quantization_config`` is dropped (the export holds
    dequantised weights) and ``dtype`` then names the exported dtype (also when ``--dtype`` changed it); otherwise
    the source config is kept verbatim."""
    cfg = dict(raw)
    if cfg.pop("quantization_config", None) is not None or dtype_changed:
        cfg["dtype"] = dtype_name(weights_dtype)
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = dtype_name(weights_dtype)
    return cfg


def _logical_sources(ckpt: DistCheckpoint) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
    out: dict[str, tuple[str, int | None, tuple[int, ...]]] = {}
    for key in ckpt.tensors:
        if naming.ignored_megatron_reason(key) is not None:
            continue
        if naming.is_layer_stacked(key):
            raise CheckpointFormatError(f"{ckpt.path}: key '{key}' is stacked along a layer axis; only per-layer keys "
                                        "(heterogeneous layers, as megatron-core writes GLM-5.x) are supported")
        for name, row, shape in naming.logical_tensors(key, ckpt.shape(key)):
            out[name] = (key, row, shape)
    return out


def _read_logical(ckpt: DistCheckpoint, key: str, row: int | None, offsets, sizes) -> torch.Tensor:
    """A box of a logical tensor: of key ``key`` itself, or of row ``row`` of a stacked (expert) key."""
    if row is None:
        return ckpt.read(key, tuple(offsets), tuple(sizes))
    return ckpt.read(key, (row, *offsets), (1, *sizes)).reshape(tuple(sizes))


def convert_megatron_to_hf(
    *,
    megatron_path: str | Path,
    hf_path: str | Path,
    hf_config: str | Path | Mapping | None = None,
    expert_layout: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool | None = None,
    sync_files: bool = True,
) -> dict:
    """megatron-core ``torch_dist`` checkpoint -> HF sharded safetensors + index + config.json (+ the source's
    generation config and tokenizer files). ``hf_config`` is needed only for checkpoints not written by this
    bridge (it stores the source config.json in the checkpoint). ``expert_layout`` defaults to the source's."""
    t0 = time.perf_counter()
    out_dtype = parse_dtype(dtype)
    final = check_output_dir(hf_path, overwrite=overwrite)
    ckpt_dir = resolve_checkpoint_dir(megatron_path)
    ckpt = DistCheckpoint(ckpt_dir)
    meta = ckpt.common_state().get(BRIDGE_KEY) or {}
    if hf_config is None:
        raw = meta.get("hf_config")
        if raw is None:
            raise BridgeError(f"{ckpt_dir}: the checkpoint does not record its HF config.json (not written by this "
                              "bridge); pass --hf-config with the model's config.json")
    elif isinstance(hf_config, Mapping):
        raw = dict(hf_config)
    else:
        raw = load_hf_config(hf_config)
    arch = parse_hf_config(raw)
    layout = expert_layout or meta.get("expert_layout") or "per_expert"
    expansion = expand(arch, expert_layout=layout, indexer_rope_swap=needs_indexer_rope_swap())

    sources = _logical_sources(ckpt)
    expected = set(expansion.by_mcore)
    missing, unexpected = expected - set(sources), set(sources) - expected
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {format_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {format_names(unexpected)}")
        raise TensorSetError(f"{ckpt_dir}: the checkpoint's tensors do not match config.json: " + "; ".join(parts),
                             missing=missing, unexpected=unexpected)
    bad = [f"{n}: expected {list(m.mcore_shape)}, found {list(sources[n][2])}"
           for n, m in expansion.by_mcore.items() if tuple(sources[n][2]) != tuple(m.mcore_shape)]
    if bad:
        raise ShapeMismatchError(f"{ckpt_dir}: tensor shapes do not match config.json: " + "; ".join(bad[:10]))

    def dtype_of(m: TensorMap) -> torch.dtype:
        return torch.float32 if m.fp32 else (out_dtype or ckpt.dtype(sources[m.mcore][0]))

    planned: dict[str, hf_io.PlannedTensor] = {}
    for m in expansion.maps:
        for ref, shape in zip(m.hf, m.transform.hf_shapes(m.mcore_shape)):
            full = tuple(shape) if ref.row is None else (ref.stack, *shape)
            planned[ref.name] = hf_io.PlannedTensor(ref.name, full, dtype_of(m))
    order = sorted(planned, key=hf_io.natural_key)
    maps = sorted(expansion.maps, key=lambda m: (hf_io.natural_key(m.hf[0].name), m.hf[0].row or 0))
    total = sum(int(torch.Size(p.shape).numel()) * torch.empty((), dtype=p.dtype).element_size()
                for p in planned.values())
    bar = Progress(total=len(maps), total_bytes=total, desc="export", enabled=progress)
    with atomic_output_dir(final, overwrite=overwrite) as tmp:
        writer = hf_io.HFShardWriter(tmp, [planned[n] for n in order], max_shard_bytes=max_shard_bytes,
                                     sync=sync_files)
        try:
            for m in maps:
                key, row, shape = sources[m.mcore]
                out_dtype_m = dtype_of(m)
                boxes = m.transform.hf_boxes(shape)
                if boxes is None:  # the transform mixes values: read the whole tensor, transform it
                    parts = m.transform.to_hf(_read_logical(ckpt, key, row, (0,) * len(shape), shape).to(out_dtype_m))
                else:  # each HF tensor is one box (for a checkpoint written at TP=1 one stored chunk): no copies
                    parts = [_read_logical(ckpt, key, row, off, size).to(out_dtype_m) for off, size in boxes]
                for ref, part in zip(m.hf, parts):
                    writer.write(ref.name, part, row=ref.row)
                bar.update(sum(p.numel() * p.element_size() for p in parts))
                del parts
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        bar.close()
        assets_dir = next((d for d in (ckpt_dir.parent / HF_ASSETS_DIR, ckpt_dir / HF_ASSETS_DIR) if d.is_dir()), None)
        copied = hf_io.copy_assets(assets_dir, tmp, skip={"config.json"}) if assets_dir else []
        weights_dtype = dtype_of(expansion.by_mcore["embedding.word_embeddings.weight"])
        cfg = _export_config(raw, weights_dtype, dtype_changed=out_dtype is not None)
        original = assets_dir / "config.json" if assets_dir else None
        if original is not None and original.is_file() and cfg == json.loads(original.read_text()):
            shutil.copy2(original, tmp / "config.json")  # unchanged: keep the source's bytes
        else:
            hf_io.write_json(tmp / "config.json", cfg)
    seconds = time.perf_counter() - t0
    return {"tensors": len(planned), "bytes": total, "seconds": seconds, "gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "expert_layout": layout, "assets": copied, "path": str(final)}


# --------------------------------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------------------------------


def compare_hf_checkpoints(source: str | Path, exported: str | Path) -> dict:
    """Tensor-by-tensor comparison of an exported checkpoint with its source: bitwise (same dtype, shape and bytes)
    for every source tensor; FP8 sources are compared with the block dequantisation of the source."""
    src = open_hf_source(source)
    out = hf_io.HFCheckpointReader(exported)
    mismatches: list[str] = []
    equal = dequantized = 0
    fp8_block = src.fp8_block
    scale_names = {r.scale.name for m in src.expansion.maps for r in m.hf if r.scale is not None}
    compared = set()
    for name in sorted(src.reader.names, key=hf_io.natural_key):
        if name in src.ignored or name in scale_names:
            continue
        compared.add(name)
        if name not in out.tensors:
            mismatches.append(f"{name}: missing from the export")
            continue
        got = out.read(name)
        want = src.reader.read(name)
        if name in src.fp8_names:
            want = dequantize_block_fp8(want, src.reader.read(name + "_scale_inv"), fp8_block, got.dtype)
            dequantized += 1
        if got.dtype != want.dtype or got.shape != want.shape:
            mismatches.append(f"{name}: {want.dtype}{list(want.shape)} became {got.dtype}{list(got.shape)}")
        elif not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            diff = (got.float() - want.float()).abs().max().item()
            mismatches.append(f"{name}: values differ (max |diff| {diff:.3g})")
        else:
            equal += 1
    extra = sorted(set(out.names) - compared)
    mismatches += [f"{n}: in the export but not in the source" for n in extra]
    src_cfg = dict(src.raw)
    out_cfg = json.loads((Path(exported) / "config.json").read_text())
    if not src.fp8_names and src_cfg != out_cfg:
        mismatches.append("config.json differs from the source")
    src.reader.close()
    out.close()
    return {"tensors": len(compared), "bitwise_equal": equal, "fp8_dequantized": dequantized,
            "mismatches": mismatches, "ignored": src.ignored, "ok": not mismatches}


def roundtrip(
    *,
    hf_path: str | Path,
    work_dir: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    keep: bool = False,
    progress: bool | None = None,
) -> dict:
    """HF -> Megatron -> HF, then :func:`compare_hf_checkpoints`. Returns the comparison with timings."""
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="glm5-roundtrip-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        imp = convert_hf_to_megatron(hf_path=hf_path, megatron_path=work / "megatron", tp=tp, pp=pp, ep=ep,
                                     overwrite=True, progress=progress)
        exp = convert_megatron_to_hf(megatron_path=work / "megatron", hf_path=work / "hf", overwrite=True,
                                     progress=progress)
        report = compare_hf_checkpoints(hf_path, work / "hf")
    finally:
        if not keep and work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report.update(import_seconds=imp["seconds"], export_seconds=exp["seconds"], bytes=imp["bytes"], tp=tp, pp=pp,
                  ep=ep, work_dir=str(work) if keep or work_dir is not None else None)
    return report
