"""HF tensors a conversion carries through untouched (GLM-5.3-Flash's vision tower: the Megatron text model has no
place for them).

Import writes them, bytes and dtypes unchanged, as an HF-style safetensors set in ``<megatron>/hf_assets/passthrough/``
next to the copied tokenizer and config files; export (and ``export_hf`` of a model that remembers where it was
loaded from) writes them back into the HF shards. Nothing else reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from . import hf_io

PASSTHROUGH_DIR = "passthrough"
SOURCE_ATTR = "glm5_passthrough_source"  # on models: an HF-style directory holding the passthrough tensors


def write_passthrough(reader: hf_io.HFCheckpointReader, names: Sequence[str], out_dir: Path, *,
                      sync: bool = True, max_shard_bytes: int = 5 << 30) -> int:
    """Copy ``names`` from ``reader`` into ``out_dir`` (created) as safetensors shards + index; returns the bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = [hf_io.PlannedTensor(n, reader.info(n).shape, reader.info(n).dtype) for n in names]
    writer = hf_io.HFShardWriter(out_dir, plan, max_shard_bytes=max_shard_bytes, sync=sync)
    try:
        for n in names:
            writer.write(n, reader.read(n))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return writer.total_bytes


def passthrough_dir(assets_dir: Path | None) -> Path | None:
    """The passthrough set under a Megatron checkpoint's ``hf_assets`` directory, if there is one."""
    if assets_dir is None:
        return None
    d = Path(assets_dir) / PASSTHROUGH_DIR
    return d if (d / hf_io.INDEX_FILE).is_file() else None
