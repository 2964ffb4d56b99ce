"""The HF side of a conversion: a validated source checkpoint and the logical megatron tensors computed from it.

:func:`open_hf_source` checks everything before any output exists (config, index, headers, exact key accounting,
shapes). :class:`Materializer` turns table rows into megatron tensors - or just a box of one, reading only the HF
tensor (or rows) the box needs - optionally with a background read-ahead (:mod:`bridge.prefetch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_glm5.architectures import Architecture, parse_architecture
from megatron_glm5.config import load_hf_config

from . import hf_io
from .errors import BridgeError, CheckpointFormatError
from .mapping import Expansion, TensorMap, check_hf_shapes
from .prefetch import Prefetcher
from .preflight import parse_config
from .tables import HFLayout, account_for, detect_layout, expand_for, truncate_config
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
    """A validated HF checkpoint: every tensor accounted for, every shape checked.

    In layer-subset mode (``open_hf_source(..., num_layers=N)``) ``raw``, ``arch`` and ``expansion`` describe the
    first N decoder layers without MTP, and ``skipped`` lists every HF tensor left out on purpose, with the reason."""

    path: Path
    raw: dict
    arch: Architecture
    reader: hf_io.HFCheckpointReader
    expansion: Expansion
    ignored: dict[str, str]
    fp8_names: frozenset[str]
    fp8_block: tuple[int, int]
    skipped: dict[str, str] = field(default_factory=dict)
    layout: HFLayout = HFLayout()
    passthrough: tuple[str, ...] = ()  # HF tensors carried through conversion untouched (GLM-5.3-Flash's vision)


def check_num_layers(num_layers: int, arch: Architecture, *, source: str = "config.json") -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= arch.num_hidden_layers:
        raise BridgeError(f"--num-layers {num_layers}: expected 1 <= N <= num_hidden_layers ({arch.num_hidden_layers} "
                          f"in {source})")


def truncate_hf_config(raw: dict, num_layers: int, *, source: str = "config.json") -> dict:
    """``config.json`` of the model made of the first ``num_layers`` decoder layers, the final norm and the LM head,
    without MTP: what a layer-truncated check (``verify --num-layers``) builds. The IndexShare and dense/MoE
    patterns become explicit lists cut to ``num_layers`` (``indexer_types[:N]``, ``mlp_layer_types[:N]``), so they
    cannot be re-derived differently for the shorter model; everything else is unchanged."""
    arch = parse_architecture(raw)
    check_num_layers(num_layers, arch, source=source)
    return truncate_config(raw, num_layers)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _skip_reason(name: str, arch: Architecture, num_layers: int) -> str:
    m = _LAYER.match(name)
    i = int(m.group(1)) if m else None
    if i is not None and i >= arch.num_hidden_layers:
        return f"MTP layer {i - arch.num_hidden_layers}: not part of a layer-truncated model"
    if i is not None:
        return f"decoder layer {i} >= num_layers {num_layers}: not part of the layer-truncated model"
    return f"not part of the model of the first {num_layers} layers"  # pragma: no cover - global tensors are kept


def check_hf_dtypes(names, reader: hf_io.HFCheckpointReader, *, source: str) -> None:
    """Every mapped HF tensor is floating point (bf16 / fp16 / fp32, or FP8 with fp32 scales). An integer or bool
    tensor under a weight's name would be cast to the model dtype without a word and train garbage. GLM-5.x releases
    carry no integer buffers among the mapped tensors (``rotary_emb.inv_freq`` is ignored, vision tensors of
    GLM-5.3-Flash pass through untouched), so there is nothing to exempt."""
    bad = [f"{n}: {dtype_name(reader.tensors[n].dtype)}{list(reader.tensors[n].shape)}" for n in sorted(names)
           if not reader.tensors[n].dtype.is_floating_point]
    if bad:
        more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
        raise CheckpointFormatError(f"{source}: {len(bad)} weight tensor(s) are not floating point: "
                                    + "; ".join(bad[:10]) + more + "; expected bf16, fp16 or fp32 weights (or "
                                    "block-FP8 with fp32 scales)")


def open_hf_source(hf_path: str | Path, *, num_layers: int | None = None) -> HFSource:
    """Open and validate an HF checkpoint: config, index, headers, exact key accounting and shapes of *every*
    tensor (nothing is read beyond headers).

    ``num_layers``: layer-subset mode. The whole checkpoint is still validated as above, then the source describes
    only the first ``num_layers`` decoder layers plus embeddings, final norm and LM head; the tensors of later layers
    and of MTP are listed in ``skipped`` (name -> reason) and never read. This is explicit so that a truncated load
    cannot hide a tensor that is missing or unmapped."""
    path = Path(hf_path)
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: HF checkpoint directory not found")
    if not (path / "config.json").is_file():
        raise CheckpointFormatError(f"{path}: missing config.json")
    raw = load_hf_config(path)
    arch = parse_config(raw, path)
    if num_layers is not None:
        check_num_layers(num_layers, arch, source=str(path / "config.json"))
    reader = hf_io.HFCheckpointReader(path)
    layout = detect_layout(arch, reader.names)
    fp8 = frozenset(n for n, i in reader.tensors.items() if i.dtype in FP8_DTYPES)
    if fp8 and not arch.is_fp8:
        raise CheckpointFormatError(
            f"{path}: {len(fp8)} tensors are stored in FP8 (e.g. {sorted(fp8)[0]}) but config.json has no fp8 "
            "quantization_config; expected block-FP8 metadata ('quant_method': 'fp8', 'weight_block_size')"
        )
    block = tuple((arch.quantization or {}).get("weight_block_size") or (128, 128))
    expansion = expand_for(arch, layout, fp8_names=fp8, fp8_block=block)
    ignored, passthrough = account_for(arch, expansion, reader.names, source=str(path), layout=layout)
    check_hf_shapes(expansion, reader.shapes(), source=str(path))
    check_hf_dtypes(expansion.hf_shapes(), reader, source=str(path))
    if num_layers is None:
        return HFSource(path, raw, arch, reader, expansion, ignored, fp8, block, layout=layout, passthrough=passthrough)
    full_arch, full_names = arch, expansion.hf_shapes()
    raw = truncate_hf_config(raw, num_layers, source=str(path / "config.json"))
    arch = parse_architecture(raw)
    expansion = expand_for(arch, layout, fp8_names=fp8, fp8_block=block)
    kept = expansion.hf_shapes()
    skipped = {n: _skip_reason(n, full_arch, num_layers) for n in full_names if n not in kept}
    skipped.update({n: "vision tower: not part of the text model" for n in passthrough})
    return HFSource(path, raw, arch, reader, expansion, ignored, fp8, block, skipped, layout=layout)


class Materializer:
    """Logical megatron tensors (:meth:`get`) or boxes of them (:meth:`box`) computed from an :class:`HFSource`, in
    the target dtype, with a one-entry cache; :meth:`prefetch` reads ahead when the order of boxes is known."""

    def __init__(self, src: HFSource, dtype: torch.dtype | None = None):
        self.src = src
        self.dtype = dtype
        self._cached: tuple[str, torch.Tensor] | None = None
        self._prefetch: Prefetcher | None = None

    def prefetch(self, boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]], budget: int = 256 << 20) -> None:
        """Read ahead on a background thread for ``box()`` calls that will come in this order."""
        plan: list[tuple[tuple, int]] = []
        for name, offsets, sizes in boxes:
            for key in self._reads_for(name, offsets, sizes):
                if not plan or plan[-1][0] != key:  # consecutive repeats are served by the cache
                    plan.append((key, self._nbytes(key)))
        self._prefetch = Prefetcher(lambda k: self.src.reader.read(*k), plan, budget=budget)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None

    def _nbytes(self, key: tuple) -> int:
        name, row, rows = key
        info = self.src.reader.info(name)
        n = info.nbytes // (info.shape[0] if row is not None else 1)
        if rows is not None:
            shape = info.shape[1:] if row is not None else info.shape
            n = n // shape[0] * (rows[1] - rows[0])
        return n

    def _raw(self, name: str, row: int | None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if self._prefetch is not None:
            return self._prefetch.get((name, row, rows))
        return self.src.reader.read(name, row, rows)

    def _row_range(self, m: TensorMap, offsets, sizes):
        """(part index, its offsets, rows or None) for a box inside one HF tensor, else None."""
        where = m.transform.locate(tuple(offsets), tuple(sizes), [r.shape for r in m.hf])
        if where is None:
            return None
        i, part_offsets = where
        ref = m.hf[i]
        whole_rows = all(o == 0 and n == d for o, n, d in zip(part_offsets[1:], sizes[1:], ref.shape[1:]))
        if ref.scale is None and whole_rows and sizes[0] != ref.shape[0]:
            return i, part_offsets, (part_offsets[0], part_offsets[0] + sizes[0])
        return i, part_offsets, None

    def _reads_for(self, name: str, offsets, sizes) -> list[tuple]:
        m = self.src.expansion.by_mcore[name]
        where = self._row_range(m, offsets, sizes)
        refs = m.hf if where is None else (m.hf[where[0]],)
        keys = []
        for ref in refs:
            keys.append((ref.name, ref.row, None if where is None else where[2]))
            if ref.scale is not None:
                keys.append((ref.scale.name, ref.scale.row, None))
        return keys

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
        where = self._row_range(m, offsets, sizes)
        if where is None:
            return box_of(self.get(name), offsets, sizes)
        i, part_offsets, rows = where
        ref, dtype = m.hf[i], self.target_dtype(m)
        if rows is not None:  # a row range (TP slice): read only it
            return self._raw(ref.name, ref.row, rows).to(dtype)
        key = f"{name}#{i}"
        if self._cached is not None and self._cached[0] == key:
            t = self._cached[1]
        else:
            self._cached = None
            t = self._read(ref, dtype).to(dtype)
            self._cached = (key, t)
        return box_of(t, part_offsets, sizes)

    def _read(self, ref, dtype: torch.dtype) -> torch.Tensor:
        t = self._raw(ref.name, ref.row)
        if ref.scale is not None:
            s = self._raw(ref.scale.name, ref.scale.row)
            t = dequantize_block_fp8(t, s, self.src.fp8_block, dtype)
        return t

    def source_order(self, name: str) -> tuple[str, int]:
        """(file, byte offset) of the first HF tensor of ``name``: converting in this order reads shards in order."""
        ref = self.src.expansion.by_mcore[name].hf[0]
        info = self.src.reader.info(ref.name)
        return str(info.file), info.start


def box_of(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
