"""The same table, driven in memory: fill a built megatron-core model from HF safetensors, export a model to HF.

* :func:`load_hf_weights` walks this rank's ``model.sharded_state_dict()`` (every box, replicas included: each
  rank needs its data) and copies each box from the HF tensors through :class:`bridge.convert.Materializer`.
* :func:`export_hf` writes this rank's main-replica boxes into a temporary ``torch_dist`` checkpoint (all ranks
  together; that is the TP/PP/EP gather) and rank 0 streams it to HF with
  :func:`bridge.convert.convert_megatron_to_hf`. Memory stays bounded and the result is the same as converting
  a checkpoint saved by Megatron-LM.
* :func:`load_megatron_checkpoint` builds the model a bridge-written checkpoint describes and loads it with
  megatron-core's own ``dist_checkpointing.load`` (any Megatron layout: our model's keys are renamed to the
  checkpoint's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from megatron_glm5.architectures import mcore_kwargs, parse_architecture
from megatron_glm5.config import load_hf_config

from .boxes import sharded_boxes
from .convert import convert_megatron_to_hf
from .source import Materializer, open_hf_source, parse_dtype, truncate_hf_config
from .errors import BridgeError
from .launch import all_ok, barrier, broadcast_object, world
from .passthrough import SOURCE_ATTR, passthrough_dir
from .families import bridge_family
from .tables import HFLayout, expand_for
from .megatron_io import (
    BRIDGE_KEY,
    COMMON_STATE_KEY,
    FORMAT_VERSION,
    HF_ASSETS_DIR,
    DistCheckpoint,
    common_state,
    iteration_dir,
    load_into_model,
    megatron_args,
    resolve_checkpoint_dir,
    write_dist_checkpoint,
    write_tracker,
)
from .output import discard_partial, register_writer, staging_dir, write_marker
from .progress import Progress

HF_CONFIG_ATTR = "glm5_hf_config"  # raw config.json kept on models built by from_hf_pretrained, for export_hf


def shared_staging_dir(final: Path, *, overwrite: bool, work_dir: str | Path | None) -> Path:
    """Rank 0 checks ``final`` and makes its hidden staging directory (:func:`~bridge.output.staging_dir`); every
    rank gets the path, or the same error (no rank is left waiting in a later collective)."""
    rank, _ = world()
    tmp, error = None, None
    if rank == 0:
        try:
            tmp = staging_dir(final, overwrite=overwrite, work_dir=work_dir)
        except BridgeError as e:
            error = e
    all_ok(error is None, str(error))
    if error is not None:
        raise error
    return Path(broadcast_object(str(tmp) if rank == 0 else None))


@torch.no_grad()
def load_hf_weights(model, hf_path: str | Path, *, progress: bool | None = False,
                    num_layers: int | None = None) -> dict:
    """Copy an HF checkpoint into ``model`` (this rank's shards). Every model tensor must be filled and every HF
    tensor accounted for, else :class:`~bridge.errors.BridgeError`.

    ``num_layers``: ``model`` is the layer-truncated model of :func:`bridge.source.truncate_hf_config` (the first N
    decoder layers, no MTP); the checkpoint is validated whole, only the kept layers' tensors are read, and the
    report's ``skipped`` counts the HF tensors left out on purpose."""
    from megatron_glm5.lora import base_only

    src = open_hf_source(hf_path, num_layers=num_layers)
    mat = Materializer(src)
    with base_only():  # a LoRA model's adapters are not HF weights: they keep their values
        plan = sharded_boxes(model, src.expansion, mat.target_dtype, main_replicas_only=False, keep_data=True)
    plan.chunks.sort(key=lambda c: (*mat.source_order(plan.pieces[(c.key, c.offsets)].logical), c.key, c.offsets))
    bar = Progress(desc="load", enabled=progress)
    bar.start(len(plan.chunks), sum(c.nbytes for c in plan.chunks))
    pieces = [plan.pieces[(c.key, c.offsets)] for c in plan.chunks]
    mat.prefetch([(p.logical, p.offsets, p.sizes) for p in pieces])
    try:
        for c, piece in zip(plan.chunks, pieces):
            dest = plan.tensors[(c.key, c.offsets)]
            dest.copy_(mat.box(piece.logical, piece.offsets, piece.sizes).reshape(dest.shape))
            bar.update(c.nbytes)
    finally:
        mat.close()
    bar.close()
    src.reader.close()
    setattr(model, HF_CONFIG_ATTR, src.raw)
    if src.passthrough:
        setattr(model, SOURCE_ATTR, str(src.path))  # export_hf writes the vision tower back from here
    return {"tensors": len(plan.chunks), "bytes": bar.bytes, "expert_layout": src.expansion.expert_layout,
            "skipped": len(src.skipped)}


def export_hf(
    model,
    hf_path: str | Path,
    *,
    hf_config: Mapping | str | Path | None = None,
    expert_layout: str = "per_expert",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool | None = False,
    work_dir: str | Path | None = None,
    merge_lora: bool = False,
    passthrough_from: str | Path | None = None,
) -> dict | None:
    """Write ``model`` (collectively, from all ranks) as an HF checkpoint. ``hf_config`` is the model's HF
    ``config.json`` (a dict or path); it defaults to the one recorded by ``from_hf_pretrained``. ``dtype`` defaults
    to the config's ``dtype`` (the router bias stays fp32). Returns rank 0's report (None on other ranks).
    A model with LoRA adapters (:mod:`megatron_glm5.lora`) needs ``merge_lora=True``: every adapted weight is
    written as ``W + alpha/r * B @ A`` (computed in fp32, one checkpoint box at a time).

    The output path is checked (free, or with ``overwrite`` an earlier output of this tool or empty) before the
    temporary checkpoint ``.<name>.export-<id>`` is written next to it (or in ``work_dir``, which must not be the
    output or inside it); a process that dies leaves only that directory, which ``megatron-glm5 clean`` finds.

    GLM-5.3-Flash: the text model is written with transformers' on-disk names (or its in-memory ones with
    ``expert_layout="fused"``); the vision tower, which the model does not hold, is copied from ``passthrough_from``
    (an HF checkpoint or a bridge ``hf_assets/passthrough`` directory), by default the one the model was loaded
    from (``from_hf_pretrained`` / ``load_megatron_checkpoint`` record it)."""
    from megatron_glm5.lora import MergedWeights, base_only, lora_modules

    adapted = bool(lora_modules(model))
    if adapted and not merge_lora:
        raise BridgeError("the model has LoRA adapters: export_hf(..., merge_lora=True) writes base + adapter "
                          "merged; bridge.export_peft_adapter writes the adapter alone")
    raw = hf_config if hf_config is not None else getattr(model, HF_CONFIG_ATTR, None)
    if raw is None:
        raise BridgeError("export_hf needs the model's HF config.json: pass hf_config=... (a dict or a path); "
                          "models from megatron_glm5.from_hf_pretrained carry it")
    if not isinstance(raw, Mapping):
        raw = load_hf_config(raw)
    raw = dict(raw)
    arch = parse_architecture(raw)
    out_dtype = parse_dtype(dtype) or _config_dtype(raw)
    expansion = expand_for(arch, HFLayout(expert_layout))
    passthrough_from = passthrough_from or getattr(model, SOURCE_ATTR, None)
    if bridge_family(arch).needs_passthrough(arch) and passthrough_from is None:
        raise BridgeError("export_hf: this GLM-5.3-Flash config has a vision tower, which the Megatron model does not "
                          "hold; pass passthrough_from=<the HF checkpoint it came from> (models loaded with "
                          "from_hf_pretrained or load_megatron_checkpoint remember it)")

    def dtype_of(m):
        return torch.float32 if m.fp32 else (out_dtype or torch.float32)

    with base_only():
        plan = sharded_boxes(model, expansion, dtype_of, keep_data=True)
    merged = MergedWeights(model) if adapted else (lambda t: t)
    rank, _ = world()
    # the output checks before the (large) temporary checkpoint is written, not after
    tmp = shared_staging_dir(Path(hf_path), overwrite=overwrite, work_dir=work_dir)
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "hf_config": raw, "expert_layout": expert_layout,
                "source_fp8": False, "hf_source": "in-memory model"}
        args = megatron_args(mcore_kwargs(arch), tp=1, pp=1, ep=1)
        plan.objects[COMMON_STATE_KEY] = common_state(args=args, iteration=0, bridge_meta=meta)

    def resolve(chunk):
        t = merged(plan.tensors[(chunk.key, chunk.offsets)])
        return t.detach().reshape(chunk.sizes).to(chunk.dtype)

    report = None
    try:
        barrier()
        if rank != 0:
            register_writer(tmp)
        write_dist_checkpoint(iteration_dir(tmp, 0), plan.chunks, plan.objects, resolve, sync_files=False)
        if rank == 0:
            write_tracker(tmp, 0)
            final = Path(hf_path).expanduser().absolute()
            report = convert_megatron_to_hf(megatron_path=tmp, hf_path=hf_path, hf_config=raw,
                                            expert_layout=expert_layout, overwrite=overwrite, progress=progress,
                                            passthrough_from=passthrough_from)
            write_marker(final, kind="hf", source="in-memory model (export_hf)")
        barrier()
    finally:
        if rank == 0:
            discard_partial(tmp)
    return report


def _config_dtype(raw: Mapping[str, Any]) -> torch.dtype | None:
    name = raw.get("dtype") or raw.get("torch_dtype")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)


def load_megatron_checkpoint(megatron_path: str | Path, *, policy=None, backend: str = "megatron",
                             hf_config: Mapping | str | Path | None = None, num_layers: int | None = None):
    """Build the GPTModel a checkpoint describes (this rank's stage; parallel state must be initialised) and load
    it with megatron-core's ``dist_checkpointing.load``, in whatever Megatron layout it was written (ours or a
    Transformer Engine one, :mod:`bridge.megatron_layout`). The architecture comes from the HF config.json the bridge
    stored in the checkpoint, or ``hf_config``. ``num_layers``: build and load only the first N decoder layers
    (no MTP; :func:`bridge.source.truncate_hf_config`); ``dist_checkpointing.load`` reads only the keys the
    truncated model asks for."""
    from megatron_glm5.model import build_model, default_cpu_policy

    ckpt_dir = resolve_checkpoint_dir(megatron_path)
    ckpt = DistCheckpoint(ckpt_dir)  # reads .metadata safely and fails on a bad checkpoint before anything is built
    if hf_config is None:
        raw = ckpt.common_state().get(BRIDGE_KEY, {}).get("hf_config")
        if raw is None:
            raise BridgeError(f"{ckpt_dir}: no HF config recorded in the checkpoint; pass hf_config=")
    elif isinstance(hf_config, Mapping):
        raw = dict(hf_config)
    else:
        raw = load_hf_config(hf_config)
    if num_layers is not None:
        raw = truncate_hf_config(raw, num_layers, source=f"{ckpt_dir} (stored HF config)")
    arch = parse_architecture(raw)
    model = build_model(arch, policy or default_cpu_policy(), backend=backend)
    load_into_model(model, ckpt_dir)
    setattr(model, HF_CONFIG_ATTR, raw)
    candidates = (passthrough_dir(ckpt_dir.parent / HF_ASSETS_DIR), passthrough_dir(ckpt_dir / HF_ASSETS_DIR))
    extra = next((d for d in candidates if d is not None), None)
    if extra is not None:
        setattr(model, SOURCE_ATTR, str(extra))
    return model


__all__ = ["export_hf", "load_hf_weights", "load_megatron_checkpoint", "HF_CONFIG_ATTR"]
