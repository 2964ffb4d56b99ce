"""LoRA adapter files: Megatron adapter checkpoints <-> HF PEFT (``megatron-glm5 lora export|import``) and a streaming
merge of an adapter into an HF checkpoint (``megatron-glm5 lora merge``).

Megatron side: a ``torch_dist`` checkpoint holding adapters - adapter-only (``save_lora_checkpoint``, the
``pretrain`` hook with ``--lora-base-checkpoint``, ``lora import``) or full (base + adapters, Megatron-LM ``--save``
of a LoRA model). Its common state records each adapter's rank and alpha (``glm5_lora``); keys are the adapters'
dist-checkpoint keys, so ``import`` writes what megatron-core itself would save (a skeleton model's sharded state
dict at TP=PP=EP=1; megatron-core reshards it on load).

Merge:

The adapter is an HF PEFT directory or a Megatron checkpoint holding adapters (adapter-only from
:func:`megatron_glm5.lora_checkpoint.save_lora_checkpoint` / the ``pretrain`` LoRA hook, or a full LoRA checkpoint);
the latter may also adapt the dense MLP and shared experts, which PEFT files cannot hold. Every base tensor is read,
has the deltas of the adapters that touch it added in fp32 (``W + alpha/r * B @ A``; a fused expert tensor one
expert row at a time) and is written in the source dtype; everything else is copied. Memory stays at one tensor (one
expert row of a fused expert tensor). Block-FP8 sources are refused: merge into a dequantised copy
(``megatron-glm5 convert import`` then ``export --dtype bf16``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Mapping

import torch

from megatron_glm5.config import load_hf_config, natural_key, parse_hf_config
from megatron_glm5.lora import LoraConfig

from . import hf_io
from . import naming
from .adapters import (
    ADAPTER_CONFIG,
    Adapter,
    AdapterSet,
    adapted_targets,
    adapter_table,
    from_peft,
    model_arch,
    read_peft_dir,
    to_peft,
    write_adapter_checkpoint,
    write_peft_dir,
)
from .errors import BridgeError, CheckpointFormatError
from .output import atomic_output_dir, check_output_dir
from .preflight import parse_config
from .progress import Progress
from .source import open_hf_source

# --------------------------------------------------------------------------------------------------------------------
# Megatron adapter checkpoints (adapter-only or full) -> adapter set
# --------------------------------------------------------------------------------------------------------------------

_LORA_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<f>[AB])\.weight$")


def adapters_from_checkpoint(ckpt_dir: str | Path) -> tuple[AdapterSet, dict]:
    """The adapter set stored in a ``torch_dist`` checkpoint (adapter-only from ``save_lora_checkpoint``, or a full
    Megatron-LM checkpoint of a LoRA model) and its common state. Reads one tensor at a time."""
    from megatron_glm5.lora_checkpoint import LORA_META_KEY

    from .megatron_io import DistCheckpoint, resolve_checkpoint_dir

    ckpt = DistCheckpoint(resolve_checkpoint_dir(ckpt_dir))
    common = ckpt.common_state()
    meta = common.get(LORA_META_KEY) or {}
    alphas = {k: float(v[1]) for k, v in (meta.get("modules") or {}).items()}
    args = common.get("args")  # a Megatron-LM --save of a LoRA model: its --lora-rank / --lora-alpha flags
    lora_rank = getattr(args, "lora_rank", None)
    scaling = None
    if not alphas and lora_rank:
        alpha = getattr(args, "lora_alpha", None)
        scaling = (alpha if alpha is not None else 2.0 * lora_rank) / lora_rank  # linear_fc1: 2r, 2 alpha
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(ckpt.tensors, key=natural_key):
        m = _LORA_KEY.match(key)
        if m is None:
            continue
        stack = re.match(r"^(?P<pre>.+\.mlp\.experts)\.experts\.(?P<lin>linear_fc[12])$", m["mod"])
        t = ckpt.read(key)
        if stack:
            for e in range(t.shape[0]):
                mod = naming.canonical(f"{stack['pre']}.local_experts.{e}.{stack['lin']}.weight")[: -len(".weight")]
                factors.setdefault(mod, {})[m["f"]] = t[e]
        else:
            mod = naming.canonical(m["mod"] + ".weight")[: -len(".weight")]
            factors.setdefault(mod, {})[m["f"]] = t
    if not factors:
        raise CheckpointFormatError(f"{ckpt.path}: holds no LoRA adapter tensors")
    if scaling is not None:
        alphas = {k: scaling * f["A"].shape[0] for k, f in factors.items()}
    missing_alpha = sorted(set(factors) - set(alphas))
    if missing_alpha:
        raise CheckpointFormatError(f"{ckpt.path}: no rank/alpha recorded for {missing_alpha[:5]} (neither a "
                                    "megatron_glm5 adapter checkpoint nor Megatron-LM args with --lora-rank)")
    return {k: Adapter(f["A"], f["B"], alphas[k]) for k, f in factors.items()}, common



def convert_checkpoint_to_peft(ckpt_dir: str | Path, out_dir: str | Path, *, hf_config=None,
                               overwrite: bool = False) -> dict:
    """An adapter-only (or full LoRA) Megatron checkpoint -> an HF PEFT adapter directory (one process)."""
    from megatron_glm5.lora_checkpoint import LORA_META_KEY

    from .megatron_io import BRIDGE_KEY

    adapters, common = adapters_from_checkpoint(ckpt_dir)
    raw = hf_config
    if raw is None:
        raw = (common.get(LORA_META_KEY) or {}).get("hf_config") or (common.get(BRIDGE_KEY) or {}).get("hf_config")
    if raw is None and getattr(common.get("args"), "hf_config", None):  # python -m megatron_glm5.pretrain's flag
        raw = getattr(common["args"], "hf_config")
    if raw is None:
        raise BridgeError(f"{ckpt_dir}: the checkpoint does not record the model's config.json; pass --hf-config")
    where = raw if not isinstance(raw, Mapping) else f"{ckpt_dir} (the HF config.json it records)"
    if not isinstance(raw, Mapping):
        raw = load_hf_config(raw)
    arch = parse_hf_config(raw) if isinstance(hf_config, Mapping) else parse_config(dict(raw), where,
                                                                                     parse=parse_hf_config)
    saved = (common.get(LORA_META_KEY) or {}).get("config")
    if saved is None:  # a Megatron-LM --save: the --lora-* flags
        args = common.get("args")
        r = getattr(args, "lora_rank", None) or min(ad.rank for ad in adapters.values())
        alpha = getattr(args, "lora_alpha", None)
        saved = {"r": int(r), "alpha": float(alpha if alpha is not None else 2.0 * r)}
    lcfg = LoraConfig.from_dict(saved)
    tensors, config = to_peft(adapters, adapter_table(arch), r=lcfg.r, alpha=lcfg.alpha, dropout=lcfg.dropout,
                              base_model=raw.get("_name_or_path"))
    write_peft_dir(out_dir, tensors, config, overwrite=overwrite, source=ckpt_dir)
    return {"path": str(out_dir), "adapters": len(adapters), "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "target_modules": config["target_modules"], "target_parameters": config["target_parameters"]}



def export_peft_adapter(model, out_dir: str | Path, *, hf_config: Mapping | str | Path | None = None,
                        overwrite: bool = False, work_dir: str | Path | None = None) -> dict | None:
    """Write ``model``'s LoRA adapters (collectively, from every rank) as an HF PEFT adapter directory: an
    adapter-only Megatron checkpoint in a staging directory (:func:`~bridge.adapters.write_adapter_checkpoint`),
    converted by rank 0 (:func:`convert_checkpoint_to_peft`). Returns rank 0's report (None on other ranks)."""
    from megatron_glm5.lora import lora_config

    from .inmemory import shared_staging_dir
    from .launch import barrier, world
    from .output import discard_partial

    raw, arch = model_arch(model, hf_config)
    config = lora_config(model)
    if config is None:
        raise BridgeError("the model has no LoRA adapters (megatron_glm5.lora.add_lora)")
    rank, _ = world()
    out = Path(out_dir)
    tmp = shared_staging_dir(out, overwrite=overwrite, work_dir=work_dir)
    report = None
    try:
        write_adapter_checkpoint(model, tmp, hf_config=raw)
        if rank == 0:
            report = convert_checkpoint_to_peft(tmp, out, hf_config=raw, overwrite=overwrite)
        barrier()
    finally:
        if rank == 0:
            discard_partial(tmp)
    return report


def convert_peft_to_checkpoint(*, adapter_path: str | Path, megatron_path: str | Path,
                               hf_config: str | Path | Mapping, overwrite: bool = False,
                               sync_files: bool = True) -> dict:
    """An HF PEFT adapter -> an adapter-only ``torch_dist`` checkpoint in Megatron-LM's layout
    (``iter_0000000/`` + tracker), with the keys megatron-core gives the adapters of a TP=PP=EP=1 model (reshardable
    on load: :func:`~megatron_glm5.lora_checkpoint.load_lora_checkpoint`, or Megatron-LM ``--load`` with
    ``--lora-base-checkpoint``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_glm5.config import mcore_kwargs
    from megatron_glm5.lora import add_lora
    from megatron_glm5.lora_checkpoint import FORMAT_VERSION, LORA_META_KEY, adapter_sharded_state_dict

    from .boxes import build_skeleton
    from .launch import model_parallel
    from .megatron_io import COMMON_STATE_KEY, Chunk, common_state, iteration_dir, megatron_args, \
        write_dist_checkpoint, write_tracker

    raw = dict(hf_config) if isinstance(hf_config, Mapping) else load_hf_config(hf_config)
    arch = parse_hf_config(raw) if isinstance(hf_config, Mapping) else parse_config(raw, hf_config,
                                                                                     parse=parse_hf_config)
    tensors, config = read_peft_dir(adapter_path)
    adapters = from_peft(tensors, config, adapter_table(arch), source=str(adapter_path))
    if not adapters:
        raise BridgeError(f"{adapter_path}: the adapter holds no LoRA factors")
    final = check_output_dir(megatron_path, overwrite=overwrite, sources=[adapter_path])
    lcfg = LoraConfig(int(config["r"]), float(config["lora_alpha"]), dropout=float(config.get("lora_dropout") or 0),
                      target_modules=adapted_targets(adapters))
    with model_parallel(1, 1, 1):
        skeleton = build_skeleton(arch, 1, 1, 1)
        add_lora(skeleton, lcfg, only={k: (ad.rank, ad.alpha) for k, ad in adapters.items()})
        sharded = adapter_sharded_state_dict(skeleton)
        apply_factories(sharded)
        boxes = [sh for sh in nested_values(sharded) if isinstance(sh, ShardedTensor)]
    chunks, sources = [], {}
    for sh in boxes:
        m = _LORA_KEY.match(sh.key)
        stack = re.match(r"^(?P<pre>.+\.mlp\.experts)\.experts\.(?P<lin>linear_fc[12])$", m["mod"])
        offsets, sizes = tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        if stack:
            name = f"{stack['pre']}.local_experts.{offsets[0]}.{stack['lin']}"
            box = (offsets[1:], sizes[1:])
        else:
            name, box = m["mod"], (offsets, sizes)
        module = naming.canonical(name + ".weight")[: -len(".weight")]
        t = adapters[module].a if m["f"] == "A" else adapters[module].b
        chunk = Chunk(sh.key, offsets, sizes, tuple(sh.global_shape), t.dtype)
        chunks.append(chunk)
        sources[(chunk.key, offsets)] = t[tuple(slice(o, o + s) for o, s in zip(*box))]
    meta = {"format_version": FORMAT_VERSION, "config": lcfg.to_dict(), "hf_config": raw,
            "modules": {k: [ad.rank, ad.alpha] for k, ad in adapters.items()}}
    state = common_state(args=megatron_args(mcore_kwargs(arch), tp=1, pp=1, ep=1), iteration=0,
                         bridge_meta={"format_version": 1, "hf_config": raw, "expert_layout": "per_expert",
                                      "source_fp8": False, "hf_source": f"PEFT adapter {adapter_path}"})
    state[LORA_META_KEY] = meta
    with atomic_output_dir(final, overwrite=overwrite, kind="megatron-lora", source=adapter_path,
                           sources=[adapter_path]) as tmp:
        write_dist_checkpoint(iteration_dir(tmp, 0), chunks, {COMMON_STATE_KEY: state},
                              lambda c: sources[(c.key, c.offsets)].reshape(c.sizes).contiguous(),
                              sync_files=sync_files)
        write_tracker(tmp, 0)
    return {"path": str(final), "adapters": len(adapters), "tensors": len(chunks),
            "bytes": sum(c.nbytes for c in chunks)}


# HF tensor -> [(row of a stacked tensor or None, logical adapter module, rows of the module's delta or None)]
DeltaPlan = dict[str, list[tuple[int | None, str, slice | None]]]


def hf_delta_plan(adapters: AdapterSet, expansion) -> DeltaPlan:
    """Where each adapter's delta lands among the HF tensors of ``expansion`` (either expert layout): the row of
    the mapping table that produced the adapted megatron weight, split like its transform splits the weight
    (``[gate; up]`` halves for a gated fc1)."""
    plan: DeltaPlan = {}
    missing = []
    for module in adapters:
        m = expansion.by_mcore.get(module + ".weight")
        if m is None:
            missing.append(module)
            continue
        boxes = m.transform.hf_boxes(m.mcore_shape)
        if boxes is None or len(boxes) != len(m.hf):
            raise AssertionError(f"{module}: transform {m.transform} does not split into row boxes")
        for ref, (offsets, sizes) in zip(m.hf, boxes):
            rows = None if len(m.hf) == 1 else slice(offsets[0], offsets[0] + sizes[0])
            plan.setdefault(ref.name, []).append((ref.row, module, rows))
    if missing:
        raise BridgeError(f"the adapter has {len(missing)} module(s) the checkpoint does not: {sorted(missing)[:8]}")
    return plan


def read_adapter(adapter_path: str | Path, table) -> tuple[AdapterSet, str]:
    """An adapter set from a PEFT directory or a Megatron checkpoint with adapters, and which kind it was."""
    from .preflight import adapter_dir

    path = adapter_dir(adapter_path, flag=None, megatron_ok=True)  # names the missing adapter_config.json
    if (path / ADAPTER_CONFIG).is_file():
        tensors, config = read_peft_dir(path)
        return from_peft(tensors, config, table, source=str(path)), "peft"
    adapters, _ = adapters_from_checkpoint(path)
    unknown = sorted(set(adapters) - set(table.rows), key=natural_key)
    if unknown:
        raise BridgeError(f"{path}: adapters for modules the HF checkpoint's model does not have: {unknown[:8]}")
    for name, ad in adapters.items():
        out, inp = table.shape(name)
        if tuple(ad.a.shape[1:]) != (inp,) or ad.b.shape[0] != out:
            raise BridgeError(f"{path}: {name}: lora_A {list(ad.a.shape)} / lora_B {list(ad.b.shape)} do not fit "
                              f"the HF checkpoint's weight [{out}, {inp}]")
    return adapters, "megatron"


def merge_adapter_into_hf(
    *,
    hf_path: str | Path,
    adapter_path: str | Path,
    out_path: str | Path,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool | None = None,
    sync_files: bool = True,
) -> dict:
    """``hf_path`` (base HF checkpoint) + ``adapter_path`` -> a merged HF checkpoint at ``out_path``, streaming."""
    t0 = time.perf_counter()
    final = check_output_dir(out_path, overwrite=overwrite, sources=[hf_path, adapter_path])
    bar = Progress(desc="merge", enabled=progress)  # from the start: the headers and the adapter take seconds
    src = open_hf_source(hf_path)
    if src.fp8_names:
        raise BridgeError(f"{hf_path}: block-FP8 weights: merging LoRA into FP8 would requantise them; convert to "
                          "bf16 first (megatron-glm5 convert import, then convert export --dtype bf16)")
    table = adapter_table(src.arch)
    adapters, kind = read_adapter(adapter_path, table)
    plan = hf_delta_plan(adapters, src.expansion)
    reader = src.reader
    names = sorted(reader.names, key=natural_key)
    planned = [hf_io.PlannedTensor(n, reader.info(n).shape, reader.info(n).dtype) for n in names]
    bar.start(len(names), reader.total_bytes())
    deltas: dict[str, torch.Tensor] = {}

    def delta(module: str) -> torch.Tensor:
        if module not in deltas:
            deltas.clear()  # a module's delta serves its consecutive HF tensors (gate, up; one expert row)
            deltas[module] = adapters[module].delta()
        return deltas[module]

    merged = 0
    with atomic_output_dir(final, overwrite=overwrite, kind="hf", source=hf_path,
                           sources=[hf_path, adapter_path]) as tmp:
        writer = hf_io.HFShardWriter(tmp, planned, max_shard_bytes=max_shard_bytes, sync=sync_files)
        try:
            for name in names:
                info = reader.info(name)
                todo = plan.get(name, [])
                if not todo:
                    writer.write(name, reader.read(name))
                elif todo[0][0] is None:  # a plain tensor
                    t = reader.read(name).float()
                    for _, module, rows in todo:
                        t += delta(module)[rows] if rows is not None else delta(module)
                    writer.write(name, t.to(info.dtype))
                    merged += 1
                else:  # a fused expert tensor: row by row
                    by_row = {}
                    for row, module, rows in todo:
                        by_row.setdefault(row, []).append((module, rows))
                    for row in range(info.shape[0]):
                        t = reader.read(name, row=row)
                        if row in by_row:
                            t = t.float()
                            for module, rows in by_row[row]:
                                t += delta(module)[rows] if rows is not None else delta(module)
                            t = t.to(info.dtype)
                        writer.write(name, t, row=row)
                    merged += 1
                bar.update(info.nbytes)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        hf_io.copy_assets(Path(hf_path), tmp)
    bar.close()
    reader.close()
    seconds = time.perf_counter() - t0
    return {"path": str(final), "adapter_kind": kind, "adapters": len(adapters), "merged_tensors": merged,
            "tensors": len(names), "bytes": reader.total_bytes(), "seconds": seconds}


def merged_reference(adapters: AdapterSet, expansion, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In memory, float64: every HF tensor of ``base`` plus its deltas (for tests)."""
    out = {k: v.double().clone() for k, v in base.items()}
    for name, todo in hf_delta_plan(adapters, expansion).items():
        for row, module, rows in todo:
            d = adapters[module].scaling * (adapters[module].b.double() @ adapters[module].a.double())
            d = d[rows] if rows is not None else d
            if row is None:
                out[name] += d
            else:
                out[name][row] += d
    return out


__all__ = ["adapters_from_checkpoint", "convert_checkpoint_to_peft", "convert_peft_to_checkpoint",
           "export_peft_adapter", "hf_delta_plan", "merge_adapter_into_hf", "merged_reference", "read_adapter"]
