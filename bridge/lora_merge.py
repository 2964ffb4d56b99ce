"""Merge a LoRA adapter into an HF checkpoint, streaming (``megatron-glm5 lora merge``).

The adapter is an HF PEFT directory or a Megatron checkpoint holding adapters (adapter-only from
:func:`megatron_glm5.lora_checkpoint.save_lora_checkpoint` / the ``pretrain`` LoRA hook, or a full LoRA checkpoint);
the latter may also adapt the dense MLP and shared experts, which PEFT files cannot hold. Every base tensor is read,
has the deltas of the adapters that touch it added in fp32 (``W + alpha/r * B @ A``; a fused expert tensor one
expert row at a time) and is written in the source dtype; everything else is copied. Memory stays at one tensor (one
expert row of a fused expert tensor). Block-FP8 sources are refused: merge into a dequantised copy
(``megatron-glm5 convert import`` then ``export --dtype bf16``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping

import torch

from megatron_glm5.config import natural_key

from . import hf_io
from .adapters import ADAPTER_CONFIG, AdapterSet, adapter_table, adapters_from_checkpoint, from_peft, read_peft_dir
from .errors import BridgeError
from .output import atomic_output_dir, check_output_dir
from .progress import Progress
from .source import open_hf_source

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
    path = Path(adapter_path)
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
    final = check_output_dir(out_path, overwrite=overwrite)
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
    bar = Progress(total=len(names), total_bytes=reader.total_bytes(), desc="merge", enabled=progress)
    deltas: dict[str, torch.Tensor] = {}

    def delta(module: str) -> torch.Tensor:
        if module not in deltas:
            deltas.clear()  # a module's delta serves its consecutive HF tensors (gate, up; one expert row)
            deltas[module] = adapters[module].delta()
        return deltas[module]

    merged = 0
    with atomic_output_dir(final, overwrite=overwrite) as tmp:
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


__all__ = ["hf_delta_plan", "merge_adapter_into_hf", "merged_reference", "read_adapter"]
