"""HF checkpoint I/O with bounded memory: an index-aware, validating safetensors reader and a streaming writer.

Reading does not mmap: each tensor (or one row of a stacked tensor) is read with ``preadv`` straight into a fresh
tensor, so the process holds only the tensors in flight (mapped shard pages would count towards the resident set).
Every header is parsed and checked when the checkpoint is opened, so a truncated or corrupt shard, a missing
index, or an index that disagrees with its shards fails before anything is written.

Writing lays out each shard's header first (names, dtypes, shapes and offsets are planned from metadata), then
fills tensors - or single rows of stacked tensors - at their offsets in any order, and checks at the end that every
byte was written.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from .errors import CheckpointFormatError, format_names
from .output import MARKER_FILE

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 256 << 20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header; raise :class:`CheckpointFormatError` naming the problem."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointFormatError(
                    f"{path}: corrupt or truncated safetensors file (header length {n} bytes, file size {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header (expected a JSON object)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{path}: corrupt header entry for tensor '{name}': {entry!r} ({e!r})") from None
        nbytes = math.prod(shape) * _itemsize(dtype)
        if end - begin != nbytes or begin < 0:
            raise CheckpointFormatError(
                f"{path}: tensor '{name}' {entry['dtype']}{list(shape)} needs {nbytes} bytes but its data_offsets "
                f"[{begin}, {end}] span {end - begin}"
            )
        if base + end > size:
            raise CheckpointFormatError(
                f"{path}: truncated safetensors file: tensor '{name}' ends at byte {base + end}, the file has {size}"
            )
        out[name] = TensorInfo(path, dtype, shape, base + begin, nbytes)
    return out


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointFormatError(f"{path}: unexpected end of file at byte {offset + done} (truncated shard)")
        done += n


class HFCheckpointReader:
    """A sharded (or single-file) safetensors checkpoint: ``names``, ``info(name)``, ``read(name, row=None)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointFormatError(f"{self.path}: HF checkpoint directory not found")
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            try:
                index = json.loads(index_file.read_text(encoding="utf-8"))
                weight_map = dict(index["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise CheckpointFormatError(f"{index_file}: not a safetensors index ({e!r})") from None
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            raise CheckpointFormatError(
                f"{self.path}: missing {INDEX_FILE} (expected it next to the safetensors shards"
                + (f"; found shards {format_names(found, 5)} but no index" if found else "; found no safetensors files")
                + ")"
            )
        self.tensors: dict[str, TensorInfo] = {}
        missing_files = [f for f in files if not (self.path / f).is_file()]
        if missing_files:
            raise CheckpointFormatError(f"{index_file}: lists shard files that do not exist: {format_names(missing_files)}")
        for fname in files:
            for name, info in read_header(self.path / fname).items():
                if weight_map is not None and weight_map.get(name) != fname:
                    raise CheckpointFormatError(
                        f"{self.path / fname}: holds tensor '{name}', which {INDEX_FILE} "
                        + (f"places in {weight_map[name]}" if name in weight_map else "does not list")
                    )
                self.tensors[name] = info
        if weight_map is not None:
            absent = [n for n in weight_map if n not in self.tensors]
            if absent:
                raise CheckpointFormatError(
                    f"{index_file}: lists tensors that are not in their shard: "
                    + "; ".join(f"'{n}' (in {weight_map[n]})" for n in sorted(absent)[:10])
                )
        self._fds: dict[Path, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: i.shape for n, i in self.tensors.items()}

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    def read(self, name: str, row: int | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor; or row ``row`` of its first dimension; and/or the range ``rows = (start, stop)`` of the first
        remaining dimension. These are contiguous bytes: nothing else is read."""
        info = self.tensors[name]
        shape, start, nbytes = info.shape, info.start, info.nbytes
        if row is not None:
            if not 0 <= row < shape[0]:
                raise IndexError(f"{name}: row {row} out of range for shape {list(shape)}")
            nbytes //= shape[0]
            start += row * nbytes
            shape = shape[1:]
        if rows is not None:
            lo, hi = rows
            if not 0 <= lo <= hi <= shape[0]:
                raise IndexError(f"{name}: rows {rows} out of range for shape {list(shape)}")
            per_row = nbytes // shape[0] if shape[0] else 0
            start += lo * per_row
            nbytes = (hi - lo) * per_row
            shape = (hi - lo, *shape[1:])
        buf = torch.empty(nbytes, dtype=torch.uint8)
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        if nbytes:
            _pread_into(fd, memoryview(buf.numpy()), start, info.file)
        return buf.view(info.dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class HFShardWriter:
    """Writes planned tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes`` (a
    tensor larger than that gets a shard of its own) plus the index. Tensors or rows arrive in any order."""

    def __init__(self, out_dir: Path, plan: Sequence[PlannedTensor], *, max_shard_bytes: int, sync: bool = True):
        self.out_dir = Path(out_dir)
        self.sync = sync
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in plan:
            nbytes = math.prod(t.shape) * _itemsize(t.dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += nbytes
        self._where: dict[str, tuple[int, int, PlannedTensor]] = {}  # name -> (fd, absolute offset, planned)
        self._todo: dict[str, int] = {}  # name -> bytes still to write
        self.weight_map: dict[str, str] = {}
        self._fds: list[int] = []
        self.total_bytes = 0
        n = len(shards)
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for t in shard:
                nbytes = math.prod(t.shape) * _itemsize(t.dtype)
                header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                                  "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            fd = os.open(self.out_dir / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
            base = 8 + len(raw)
            os.ftruncate(fd, base + offset)
            for t in shard:
                start = base + header[t.name]["data_offsets"][0]
                self._where[t.name] = (fd, start, t)
                nbytes = header[t.name]["data_offsets"][1] - header[t.name]["data_offsets"][0]
                self._todo[t.name] = nbytes
                self.weight_map[t.name] = fname
                self.total_bytes += nbytes

    def write(self, name: str, tensor: torch.Tensor, row: int | None = None) -> None:
        fd, start, planned = self._where[name]
        shape = planned.shape if row is None else planned.shape[1:]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != planned.dtype:
            raise AssertionError(f"{name}{'' if row is None else f'[{row}]'}: planned {planned.dtype}{list(shape)}, "
                                 f"got {tensor.dtype}{list(tensor.shape)}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if row is not None:
            start += row * data.nbytes
        mv = memoryview(data)
        done = 0
        while done < len(mv):
            done += os.pwrite(fd, mv[done:], start + done)
        self._todo[name] -= data.nbytes

    def finish(self) -> dict[str, str]:
        """Check completeness, write ``model.safetensors.index.json``; returns the weight map."""
        incomplete = [n for n, left in self._todo.items() if left != 0]
        if incomplete:
            raise AssertionError(f"tensors not fully written: {format_names(incomplete)}")
        for fd in self._fds:
            if self.sync:  # data on disk before the index that makes the checkpoint look complete
                os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return self.weight_map

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


# --------------------------------------------------------------------------------------------------------------------
# Non-weight files (config, generation config, tokenizer, chat template, ...)
# --------------------------------------------------------------------------------------------------------------------

_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|gguf|ckpt|h5|msgpack)$")


def asset_files(hf_dir: Path) -> list[Path]:
    """Top-level files of an HF checkpoint that are not weights (config.json, tokenizer files, templates, ...).
    Hidden files are not assets: in particular the output marker of this tool (``bridge.output.MARKER_FILE``) and
    its writer records describe one output directory and must not travel into the next one."""
    return sorted(
        p for p in Path(hf_dir).iterdir()
        if p.is_file() and not _WEIGHT_FILE.search(p.name) and p.name not in (INDEX_FILE, MARKER_FILE)
        and not p.name.startswith(".")
    )


def copy_assets(src_dir: Path, dst_dir: Path, *, skip: Iterable[str] = ()) -> list[str]:
    skip = set(skip)
    copied = []
    for p in asset_files(src_dir):
        if p.name in skip:
            continue
        shutil.copy2(p, Path(dst_dir) / p.name)
        copied.append(p.name)
    return copied


def write_json(path: Path, obj: Mapping) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
