"""Streaming HF <-> Megatron checkpoint conversion: :func:`convert_hf_to_megatron`, :func:`convert_megatron_to_hf`,
:func:`roundtrip` (keyword-only; the CLI is a thin layer over them).

Import, per rank: validate the HF source (:mod:`bridge.source`) -> build this rank's model skeleton on the meta
device and take the boxes its ``sharded_state_dict`` declares (:mod:`bridge.boxes`; the same boxes
``dist_checkpointing.save`` would write) -> for each box, in the order the HF shards store their tensors, read what
it needs (a background thread reads ahead), transform, write it and drop it. Memory stays at a few tensors.

Export (one process): read ``.metadata``, map every stored key to logical tensors and account for all of them,
plan the HF shards (header first), then read each HF tensor's box (read ahead in the background), write it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Mapping

import torch

from megatron_glm5.architectures import mcore_kwargs, parse_architecture
from megatron_glm5.config import load_hf_config, natural_key

from . import hf_io, naming
from .boxes import apply_layout, build_skeleton, sharded_boxes, verify_written
from .errors import BridgeError, CheckpointFormatError, ShapeMismatchError, TensorSetError, format_names
from .launch import (
    all_ok,
    barrier,
    broadcast_object,
    check_parallel_layout,
    launched_world_size,
    model_parallel,
    run_local_ranks,
    world,
)
from .mapping import Expansion, TensorMap
from .megatron_layout import (
    DEFAULT_LAYOUT,
    LogicalSource,
    Resolved,
    get_layout,
    no_mtp_hint,
    resolve_checkpoint,
)
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
from .glm5_next_mapping import passthrough_names
from .passthrough import PASSTHROUGH_DIR, passthrough_dir, write_passthrough
from .output import (
    atomic_output_dir,
    check_output_dir,
    commit_dir,
    discard_partial,
    make_partial_dir,
    partial_dir,
    register_writer,
)
from .prefetch import Prefetcher
from .progress import Progress
from .source import Materializer, dtype_name, open_hf_source, parse_dtype
from .tables import HFLayout, expand_for, megatron_layout_for, megatron_layouts_for
from .transforms import dequantize_block_fp8


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
    megatron_layout: str = DEFAULT_LAYOUT,
) -> dict:
    """HF checkpoint -> megatron-core ``torch_dist`` checkpoint in Megatron-LM's layout
    (``<megatron_path>/iter_XXXXXXX/`` + ``latest_checkpointed_iteration.txt``), loadable at any TP/PP/EP.

    ``megatron_layout`` names the tensors as the modules that will load it do (:mod:`bridge.megatron_layout`):
    ``local`` (ours), ``te`` (megatron-core's DSA spec with Transformer Engine, as NVIDIA Megatron-Bridge builds
    GLM-5) or ``te-fused-qk`` (megatron-core's MLA spec with TE, as slime's and miles' GLM-5 specs).

    ``tp``/``pp``/``ep`` choose how the *conversion* is sharded over ranks (``tp*pp*ep`` ranks: under ``torchrun``
    the launched ones, otherwise spawned locally); the result does not depend on them. ``dtype`` None keeps each
    tensor's source dtype (FP8 sources become bf16); the router's ``e_score_correction_bias`` stays fp32.
    ``sync_files`` fsyncs the data before the rename that publishes the checkpoint (crash safety).
    """
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if int(v) < 1:
            raise BridgeError(f"--{name}: expected >= 1, got {v}")
    if int(iteration) < 0:
        raise BridgeError(f"--iteration: expected >= 0, got {iteration}")
    parse_dtype(dtype)
    get_layout(megatron_layout)
    final = check_output_dir(megatron_path, overwrite=overwrite, sources=[hf_path])
    nranks = tp * pp * ep
    size = launched_world_size()
    kwargs = dict(hf_path=str(hf_path), tp=tp, pp=pp, ep=ep, dtype=None if dtype is None else dtype_name(parse_dtype(dtype)),
                  iteration=iteration, progress=progress, sync_files=sync_files, megatron_layout=megatron_layout)
    if size == 1 and nranks > 1:
        src = open_hf_source(hf_path)  # fail on bad input and on a layout megatron-core refuses before starting ranks
        check_parallel_layout(src.arch, tp, pp, ep, source=str(src.path / "config.json"))
        megatron_layout_for(src.arch, megatron_layout, source=str(src.path / "config.json"))
        tmp = make_partial_dir(final)
        try:
            reports = run_local_ranks(_import_rank, nranks, out=str(tmp), **kwargs)
            commit_dir(tmp, final, overwrite=overwrite, kind="megatron", source=hf_path)
        except BaseException:
            discard_partial(tmp)
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
        make_partial_dir(final, tmp)
    barrier()
    try:
        report = _import_rank(out=str(tmp), **kwargs)
        barrier()
        if rank == 0:
            commit_dir(tmp, final, overwrite=overwrite, kind="megatron", source=hf_path)
        barrier()
    except BaseException:
        if rank == 0:
            discard_partial(tmp)
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
                 progress: bool | None, sync_files: bool, megatron_layout: str) -> dict:
    t0 = time.perf_counter()
    rank, _ = world()
    register_writer(out)  # every rank: the partial directory is live while any of its writers is
    # the bar from the start: reading the headers and planning the boxes takes seconds on a real model
    bar = Progress(desc=f"import{f' rank {rank}' if rank else ''}", enabled=progress if rank == 0 else False)
    try:
        try:
            src = open_hf_source(hf_path)
            layout = megatron_layout_for(src.arch, megatron_layout, source=str(src.path / "config.json"))
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
        apply_layout(plan, src.expansion, layout, extra_state_here=rank == 0)
        plan.chunks.sort(key=lambda c: (*mat.source_order(plan.pieces[(c.key, c.offsets)].logical), c.key,
                                        c.offsets))
        ckpt_dir = iteration_dir(Path(out), iteration)
        if rank == 0:
            meta = {"format_version": FORMAT_VERSION, "hf_config": src.raw, **src.layout.meta(),
                    "source_fp8": bool(src.fp8_names), "hf_source": str(src.path),
                    "passthrough": len(src.passthrough), "megatron_layout": layout.name}
            args = megatron_args(mcore_kwargs(src.arch), tp=tp, pp=pp, ep=ep)
            plan.objects[COMMON_STATE_KEY] = common_state(args=args, iteration=iteration, bridge_meta=meta)

        bar.start(len(plan.chunks), sum(c.nbytes for c in plan.chunks))

        mat.prefetch([(p.logical, p.offsets, p.sizes)
                      for p in (plan.pieces[(c.key, c.offsets)] for c in plan.chunks)])

        def resolve(chunk: Chunk) -> torch.Tensor:
            piece = plan.pieces[(chunk.key, chunk.offsets)]
            return mat.box(piece.logical, piece.offsets, piece.sizes).reshape(chunk.sizes).to(chunk.dtype)

        try:
            write_dist_checkpoint(ckpt_dir, plan.chunks, plan.objects, resolve,
                                  on_written=lambda c: bar.update(c.nbytes), sync_files=sync_files)
        finally:
            mat.close()
    except BaseException:
        bar.abort()
        raise
    bar.close()
    src.reader.close()
    if rank == 0:
        verify_written(ckpt_dir, src.expansion, layout=layout, layouts=megatron_layouts_for(src.arch))
        assets = Path(out) / HF_ASSETS_DIR
        assets.mkdir(exist_ok=True)
        hf_io.copy_assets(src.path, assets)
        if src.passthrough:  # GLM-5.3-Flash's vision tower, carried through untouched
            write_passthrough(src.reader, src.passthrough, assets / PASSTHROUGH_DIR, sync=sync_files)
            src.reader.close()
        write_tracker(Path(out), iteration)
    seconds = time.perf_counter() - t0
    nbytes = sum(c.nbytes for c in plan.chunks)
    return {
        "tensors": len(src.expansion.maps), "hf_tensors": len(src.reader.names), "chunks": len(plan.chunks),
        "bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9,
        "expert_layout": src.expansion.expert_layout, "fp8_dequantized": len(src.fp8_names),
        "ignored": src.ignored, "tp": tp, "pp": pp, "ep": ep, "iteration": iteration, "megatron_layout": layout.name,
    }


# --------------------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------------------


def _export_config(raw: Mapping, weights_dtype: torch.dtype) -> dict:
    """config.json for the exported weights: an FP8 source's ``quantization_config`` is dropped (the export holds
    dequantised weights), and ``dtype`` (and ``torch_dtype`` where present) name the dtype the weights really have
    whenever the source config says otherwise - after ``import --dtype bf16`` of an fp32 checkpoint, or an export
    with ``--dtype`` - since transformers loads the weights in the dtype the config names. Otherwise the source
    config is kept verbatim."""
    cfg = dict(raw)
    name = dtype_name(weights_dtype)
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg]
    if cfg.pop("quantization_config", None) is not None and not keys:
        keys = ["dtype"]
    if any(cfg.get(k) != name for k in keys):
        for k in keys:
            cfg[k] = name
    return cfg


def _parse_config(raw: Mapping, hf_config, ckpt_dir: Path):
    """``parse_architecture`` with a field error prefixed by where the config came from."""
    from .preflight import parse_config

    if hf_config is None:
        where = f"{ckpt_dir} (its stored HF config.json)"
    elif isinstance(hf_config, Mapping):
        return parse_architecture(raw)
    else:
        where = hf_config
    return parse_config(dict(raw), where)


def _resolve_sources(ckpt: DistCheckpoint, arch, expansion: Expansion, recorded: str | None) -> Resolved:
    """The checkpoint's Megatron layout and expert form, detected from its weight keys, and where each logical
    tensor is stored (:func:`bridge.megatron_layout.resolve_checkpoint`); non-weights are ignored by name."""
    shapes = {}
    for key in ckpt.tensors:
        if naming.ignored_megatron_reason(key) is not None:
            continue
        if naming.is_layer_stacked(key):
            raise CheckpointFormatError(f"{ckpt.path}: key '{key}' is stacked along a layer axis; only per-layer keys "
                                        "(heterogeneous layers, as megatron-core writes GLM-5.x) are supported")
        shapes[key] = ckpt.shape(key)
    return resolve_checkpoint(shapes, expansion.by_mcore, layouts=megatron_layouts_for(arch), source=str(ckpt.path),
                              recorded=recorded)


def _read_parts(ahead: Prefetcher, boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                source: LogicalSource) -> torch.Tensor:
    """One box of a logical tensor from its stored boxes (:meth:`LogicalSource.boxes`, concatenated in row order)."""
    stacked = source.pieces[0].row is not None
    parts = [ahead.get(b).reshape(b[2][1:] if stacked else b[2]) for b in boxes]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    passthrough_from: str | Path | None = None,
) -> dict:
    """megatron-core ``torch_dist`` checkpoint -> HF sharded safetensors + index + config.json (+ the source's
    generation config and tokenizer files). ``hf_config`` is needed only for checkpoints not written by this
    bridge (it stores the source config.json in the checkpoint). ``expert_layout`` defaults to the source's (and
    GLM-5.3-Flash's naming and prefix are the source's). Tensors carried through the import untouched (a vision
    tower, :mod:`bridge.passthrough`) are written back from ``hf_assets/passthrough``, or from the HF-style directory
    ``passthrough_from``."""
    t0 = time.perf_counter()
    out_dtype = parse_dtype(dtype)
    ckpt_dir = resolve_checkpoint_dir(megatron_path)
    assets_dir = next((d for d in (ckpt_dir.parent / HF_ASSETS_DIR, ckpt_dir / HF_ASSETS_DIR) if d.is_dir()), None)
    final = check_output_dir(hf_path, overwrite=overwrite, sources=[megatron_path, ckpt_dir, assets_dir])
    bar = Progress(desc="export", enabled=progress)  # from the start: .metadata and the plan take seconds
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
    arch = _parse_config(raw, hf_config, ckpt_dir)
    hf_layout = HFLayout.from_meta(meta, expert_layout=expert_layout)
    layout = hf_layout.expert_layout
    expansion = expand_for(arch, hf_layout)
    assets_dir = next((d for d in (ckpt_dir.parent / HF_ASSETS_DIR, ckpt_dir / HF_ASSETS_DIR) if d.is_dir()), None)
    extra_dir = Path(passthrough_from) if passthrough_from is not None else passthrough_dir(assets_dir)
    if meta.get("passthrough") and extra_dir is None:
        raise CheckpointFormatError(f"{ckpt_dir}: the checkpoint was imported with {meta['passthrough']} vision "
                                    f"tensors carried in {HF_ASSETS_DIR}/{PASSTHROUGH_DIR}, which is missing")
    extra = hf_io.HFCheckpointReader(extra_dir) if extra_dir is not None else None
    extra_names = passthrough_names(extra.names) if extra is not None else []

    resolved = _resolve_sources(ckpt, arch, expansion, meta.get("megatron_layout"))
    sources = resolved.sources
    missing = set(expansion.by_mcore) - set(sources)
    if missing:
        raise TensorSetError(f"{ckpt_dir}: the checkpoint's tensors do not match config.json ({resolved.layout.name} "
                             f"Megatron layout): {len(missing)} missing: {format_names(missing)}"
                             + no_mtp_hint(missing), missing=missing)
    bad = [f"{n}: expected {list(m.mcore_shape)}, found {list(sources[n].shape)}"
           for n, m in expansion.by_mcore.items() if tuple(sources[n].shape) != tuple(m.mcore_shape)]
    if bad:
        raise ShapeMismatchError(f"{ckpt_dir}: tensor shapes do not match config.json: " + "; ".join(bad[:10]))

    def dtype_of(m: TensorMap) -> torch.dtype:
        return torch.float32 if m.fp32 else (out_dtype or ckpt.dtype(sources[m.mcore].pieces[0].key))

    planned: dict[str, hf_io.PlannedTensor] = {}
    for m in expansion.maps:
        for ref, shape in zip(m.hf, m.transform.hf_shapes(m.mcore_shape)):
            full = tuple(shape) if ref.row is None else (ref.stack, *shape)
            planned[ref.name] = hf_io.PlannedTensor(ref.name, full, dtype_of(m))
    for name in extra_names:  # carried through: dtype and bytes unchanged
        planned[name] = hf_io.PlannedTensor(name, extra.info(name).shape, extra.info(name).dtype)
    order = sorted(planned, key=natural_key)
    maps = sorted(expansion.maps, key=lambda m: (natural_key(m.hf[0].name), m.hf[0].row or 0))
    total = sum(int(torch.Size(p.shape).numel()) * torch.empty((), dtype=p.dtype).element_size()
                for p in planned.values())
    bar.start(len(maps), total)
    reads: list[list[list[tuple]]] = []  # per map, per box it reads, the stored boxes that make it up
    for m in maps:
        shape = sources[m.mcore].shape
        boxes = m.transform.hf_boxes(shape) or [((0,) * len(shape), tuple(shape))]
        reads.append([sources[m.mcore].boxes(off, size) for off, size in boxes])
    itemsize = {k: torch.empty((), dtype=ckpt.dtype(k)).element_size() for k in ckpt.tensors}
    ahead = Prefetcher(lambda box: ckpt.read(*box),
                       [(b, int(torch.Size(b[2]).numel()) * itemsize[b[0]]) for r in reads for box in r for b in box])
    with atomic_output_dir(final, overwrite=overwrite, kind="hf", source=megatron_path) as tmp:
        writer = hf_io.HFShardWriter(tmp, [planned[n] for n in order], max_shard_bytes=max_shard_bytes,
                                     sync=sync_files)
        try:
            for m, boxes in zip(maps, reads):
                src = sources[m.mcore]
                # each box is one HF tensor (usually one stored chunk: no copy), or the whole tensor to transform
                values = [_read_parts(ahead, b, src).to(dtype_of(m)) for b in boxes]
                parts = m.transform.to_hf(values[0]) if m.transform.hf_boxes(src.shape) is None else values
                for ref, part in zip(m.hf, parts):
                    writer.write(ref.name, part, row=ref.row)
                bar.update(sum(p.numel() * p.element_size() for p in parts))
                del parts
            for name in extra_names:
                writer.write(name, extra.read(name))
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            ahead.close()
            if extra is not None:
                extra.close()
        bar.close()
        copied = hf_io.copy_assets(assets_dir, tmp, skip={"config.json"}) if assets_dir else []
        weights_dtype = dtype_of(expansion.by_mcore["embedding.word_embeddings.weight"])
        cfg = _export_config(raw, weights_dtype)
        original = assets_dir / "config.json" if assets_dir else None
        if original is not None and original.is_file() and cfg == json.loads(original.read_text()):
            shutil.copy2(original, tmp / "config.json")  # unchanged: keep the source's bytes
        else:
            hf_io.write_json(tmp / "config.json", cfg)
    seconds = time.perf_counter() - t0
    return {"tensors": len(planned), "bytes": total, "seconds": seconds, "gb_per_s": total / max(seconds, 1e-9) / 1e9,
            "expert_layout": layout, "assets": copied, "path": str(final), "megatron_layout": resolved.layout.name,
            "megatron_experts": resolved.form}


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
    for name in sorted(src.reader.names, key=natural_key):
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
    megatron_layout: str = DEFAULT_LAYOUT,
) -> dict:
    """HF -> Megatron (in ``megatron_layout``) -> HF, then :func:`compare_hf_checkpoints`. Returns the comparison
    with timings."""
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="glm5-roundtrip-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        imp = convert_hf_to_megatron(hf_path=hf_path, megatron_path=work / "megatron", tp=tp, pp=pp, ep=ep,
                                     overwrite=True, progress=progress, megatron_layout=megatron_layout)
        exp = convert_megatron_to_hf(megatron_path=work / "megatron", hf_path=work / "hf", overwrite=True,
                                     progress=progress)
        report = compare_hf_checkpoints(hf_path, work / "hf")
    finally:
        if not keep and work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report.update(import_seconds=imp["seconds"], export_seconds=exp["seconds"], bytes=imp["bytes"], tp=tp, pp=pp,
                  ep=ep, megatron_layout=exp["megatron_layout"],
                  work_dir=str(work) if keep or work_dir is not None else None)
    return report
