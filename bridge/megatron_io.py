"""megatron-core ``torch_dist`` checkpoints written and read one tensor box at a time.

Format (what megatron-core 0.19.2's ``dist_checkpointing.save`` writes, checked by saving a model with it):
a PyTorch DCP directory - ``.metadata`` (tensor keys, global shapes, chunk boxes), ``__{rank}_{n}.distcp`` data
files with one ``torch.save`` record per chunk, ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) -
where a ``ShardedObject`` is a ``torch.save([obj])`` byte record under ``{key}/shard_{offset}_{shape}`` and the
non-tensor common state (args, iteration, ...) is the object ``common_state/shard_0_1``. Megatron-LM's ``--load``
expects it at ``<dir>/iter_XXXXXXX/`` next to ``latest_checkpointed_iteration.txt``.

Why not ``dist_checkpointing.save``: it needs every tensor materialised at once (and CUDA). Here a custom
``SavePlanner`` declares the boxes (the same ones megatron-core's sharded state dict declares on this rank) and a
``StorageWriter`` asks for each box's data only when it writes it, in plan order, so memory stays at one logical
tensor (torch's own ``FileSystemWriter`` keeps a reference to every tensor of a file until the file is closed).
Reading goes through torch's ``FileSystemReader`` with a cached ``.metadata`` and a planner that fills one
requested box, so any stored chunking (any TP/PP/EP of the writer) can be read back as any box.

``.metadata`` is a pickle, and torch's reader loads it with plain ``pickle.load``: a crafted checkpoint would run
code. :func:`read_dcp_metadata` parses it with an unpickler that admits only the globals torch_dist metadata
contains (:data:`METADATA_GLOBALS`) and hands the result to ``FileSystemReader``; every reader here - and
:func:`load_into_model`, before megatron-core's own loader - goes through it first. Everything else is read with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import pickle
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from megatron_glm5.compat import storage_info, torch_save_crc32  # the writer must produce the reader's records

from .errors import CheckpointFormatError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
HF_ASSETS_DIR = "hf_assets"  # non-weight HF files (config.json, tokenizer, ...) that export writes back
BRIDGE_KEY = "glm5_bridge"  # our entry in the common state
COMMON_STATE_KEY = "common_state/shard_0_1"
CHECKPOINT_VERSION = 3.0
FORMAT_VERSION = 1


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


@dataclass(frozen=True, slots=True)
class Chunk:
    """One box of a global checkpoint tensor written by this rank."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def object_bytes(obj: Any) -> io.BytesIO:
    """A ShardedObject record as megatron-core writes it."""
    buf = io.BytesIO()
    torch.save([obj], buf)
    return buf


# --------------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------------


class _BoxPlanner(DefaultSavePlanner):
    """Declares the given chunks and objects; resolves a chunk's data through ``resolve`` when it is written."""

    def __init__(self, chunks: Sequence[Chunk], objects: Mapping[str, Any], resolve: Callable[[Chunk], torch.Tensor],
                 on_written: Callable[[Chunk], None] | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, tuple(c.offsets)): c for c in chunks}
        if len(self._chunks) != len(chunks):
            raise AssertionError("duplicate chunk box in the write plan")
        self._order = list(chunks)
        self._objects = dict(objects)
        self._resolve = resolve
        self._on_written = on_written

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self._objects]
        for c in self._order:
            items.append(WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return object_bytes(self._objects[write_item.index.fqn])
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        t = self._resolve(chunk)
        if tuple(t.shape) != tuple(chunk.sizes) or t.dtype != chunk.dtype:
            raise AssertionError(f"{chunk.key} box {chunk.offsets}: planned {chunk.dtype}{list(chunk.sizes)}, "
                                 f"resolved {t.dtype}{list(t.shape)}")
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():  # torch.save writes the whole storage
            t = t.clone()
        return t

    def written(self, write_item: WriteItem) -> None:
        if self._on_written is not None and write_item.type != WriteItemType.BYTE_IO:
            self._on_written(self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))])


class _StreamingWriter(FileSystemWriter):
    """``FileSystemWriter`` that writes items in plan order and drops each tensor right after writing it."""

    def __init__(self, path: Path, *, max_file_bytes: int, sync_files: bool):
        super().__init__(str(path), single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=False)
        self.max_file_bytes = max_file_bytes

    def write_data(self, plan: SavePlan, planner: _BoxPlanner) -> Future:
        prefix = plan.storage_data.prefix
        results: list[WriteResult] = []
        file_no = 0
        stream = None
        name = ""

        def close(s):
            if s is None:
                return
            s.flush()
            if self.sync_files:
                os.fsync(s.fileno())
            s.close()

        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        try:
            for item in items:
                if stream is None or stream.tell() >= self.max_file_bytes:
                    close(stream)
                    name = f"{prefix}{file_no}.distcp"
                    file_no += 1
                    stream = open(Path(self.path) / name, "wb", buffering=8 << 20)
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    torch.save(data, stream)
                length = stream.tell() - offset
                del data
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=storage_info(name, offset, length)))
                planner.written(item)
        finally:
            close(stream)
        fut: Future = Future()
        fut.set_result(results)
        return fut


def _first_failure(e: CheckpointException) -> BaseException:
    """The exception a rank raised inside ``dcp.save`` (its lowest failing rank's). torch wraps every failure -
    a full disk (``OSError`` ENOSPC), a bad source tensor (:class:`~bridge.errors.BridgeError`), Ctrl-C - in a
    ``CheckpointException``, a ``BaseException`` whose message is a formatted traceback; re-raised as itself, the
    caller (the CLI) reports it like any other error of its kind."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        exc = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(exc, BaseException):
            return exc
    return e


@contextmanager
def _no_crc32():
    """``torch.save`` computes a CRC-32 of every record by default, at 1-2 GB/s: about a third of the conversion's
    time on fast storage. Nothing reads it back (``torch.load`` does not check it), so our records skip it."""
    with torch_save_crc32(False):
        yield


def write_dist_checkpoint(
    ckpt_dir: Path,
    chunks: Sequence[Chunk],
    objects: Mapping[str, Any],
    resolve: Callable[[Chunk], torch.Tensor],
    *,
    on_written: Callable[[Chunk], None] | None = None,
    max_file_bytes: int = 8 << 30,
    sync_files: bool = True,
) -> None:
    """Collective over the default process group (or a single process without one): each rank writes its chunks
    and objects; rank 0 writes ``.metadata`` and ``metadata.json``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    planner = _BoxPlanner(chunks, objects, resolve, on_written)
    writer = _StreamingWriter(ckpt_dir, max_file_bytes=max_file_bytes, sync_files=sync_files)
    with warnings.catch_warnings(), _no_crc32():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint")
        try:
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=not distributed)
        except CheckpointException as e:
            raise _first_failure(e) from None
    if not distributed or dist.get_rank() == 0:
        save_config(CheckpointingConfig("torch_dist", 1), str(ckpt_dir))
    if distributed:
        dist.barrier()


# --------------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------------


class _IntoBox(LoadPlanner):
    """Copies the read items of one requested box into ``dest`` (or keeps the bytes of an object)."""

    def __init__(self, dest: torch.Tensor | None = None):
        self.dest = dest
        self.value: io.BytesIO | None = None

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover - plans are built by DistCheckpoint
        raise NotImplementedError

    def create_global_plan(self, global_plan):  # pragma: no cover
        return global_plan

    def finish_plan(self, central_plan):  # pragma: no cover
        return central_plan

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.value = value

    def resolve_tensor(self, read_item) -> torch.Tensor:
        t = self.dest
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, off, length)
        return t

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class _FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream (one ``torch.save`` record)."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got


# The globals a torch_dist ``.metadata`` pickle refers to, found by listing the globals of the metadata written by
# this bridge (TP 1 and 2, fp32/bf16, FP8 sources) and by megatron-core's ``dist_checkpointing.save`` (1 and 2 ranks,
# with optimizer state and objects): torch DCP's metadata dataclasses, the per-rank save plans megatron-core stores
# in ``Metadata.all_local_plans``, ``_StorageInfo``, ``torch.Size``, dtypes and layouts, the memory-format enum, and
# the checkpoint id (a ``PosixPath`` when the writer was given one). Plus ``_StoragePrefix``/``BytesIOWriteData``
# (other fields of those plans) and megatron-core's two empty legacy classes kept "to load old checkpoints".
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}),
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles: _get_layout("torch.strided")
    "torch": frozenset({"Size"}),  # and every torch.dtype / torch.layout / torch.memory_format (below)
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),  # Python >= 3.13 pickles pathlib classes here
    "megatron.core.dist_checkpointing.strategies.torch": frozenset({"MCoreMetadata", "MCoreSavePlan"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only :data:`METADATA_GLOBALS`; any other global (``os.system``, ``builtins.exec``, ...) is refused
    before it is imported, so a crafted file cannot run code."""

    def __init__(self, f, path: Path):
        super().__init__(f)
        self._path = path

    def find_class(self, module: str, name: str):
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointFormatError(
            f"{self._path}: refused to unpickle global '{module}.{name}': torch_dist metadata holds only torch "
            "distributed-checkpoint metadata classes, sizes and dtypes (a crafted .metadata can run code when "
            "unpickled; nothing was executed)"
        )

    def persistent_load(self, pid):
        raise CheckpointFormatError(f"{self._path}: unexpected persistent id in torch_dist metadata; refused")


def read_dcp_metadata(ckpt_dir: str | Path) -> Metadata:
    """``<ckpt_dir>/.metadata`` parsed with :class:`_MetadataUnpickler` (what ``FileSystemReader.read_metadata``
    returns, without its plain ``pickle.load``)."""
    path = Path(ckpt_dir) / ".metadata"
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointFormatError(f"{Path(ckpt_dir)}: missing .metadata (incomplete checkpoint)") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read ({e})") from None
    with f:
        try:
            md = _MetadataUnpickler(f, path).load()
        except CheckpointFormatError:
            raise
        except Exception as e:  # a damaged pickle fails in many ways (EOF, bad opcodes, wrong arguments, ...)
            raise CheckpointFormatError(f"{path}: corrupt ({e!r})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointFormatError(f"{path}: not torch distributed-checkpoint metadata (found a "
                                    f"{type(md).__name__})")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


class DistCheckpoint:
    """Read access to one ``torch_dist`` checkpoint directory (an ``iter_XXXXXXX`` directory)."""

    def __init__(self, ckpt_dir: str | Path):
        self.path = Path(ckpt_dir)
        cfg = self.path / "metadata.json"
        if not cfg.is_file():
            raise CheckpointFormatError(
                f"{self.path}: not a megatron-core distributed checkpoint (no metadata.json; an interrupted or "
                "incomplete write leaves none)"
            )
        try:
            backend = json.loads(cfg.read_text()).get("sharded_backend")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointFormatError(f"{cfg}: corrupt ({e!r})") from None
        if backend != "torch_dist":
            raise CheckpointFormatError(f"{cfg}: sharded_backend is {backend!r}; expected 'torch_dist'")
        self.metadata = read_dcp_metadata(self.path)
        self._reader = FileSystemReader(str(self.path))
        self.metadata.storage_meta.load_id = self._reader.load_id
        self._reader.set_up_storage_reader(self.metadata, True)
        md = self.metadata.state_dict_metadata
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)
        }
        self.objects: list[str] = [k for k, v in md.items() if isinstance(v, BytesStorageMetadata)]
        self._chunk_index: dict[str, tuple[list[int], list[ChunkStorageMetadata], int]] = {}
        missing = sorted({i.relative_path for i in self.metadata.storage_data.values()
                          if not (self.path / i.relative_path).is_file()})
        if missing:
            raise CheckpointFormatError(f"{self.path}: data files listed in .metadata are missing: {missing}")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``key`` (the whole tensor by default)."""
        md = self.tensors[key]
        if offsets is None:
            offsets, sizes = (0,) * len(md.size), tuple(md.size)
        candidates = self._candidates(key, offsets, sizes)
        if out is None:  # a box that is exactly one stored chunk: load the record itself, no copy
            for c in candidates.chunks:
                if tuple(c.offsets) == tuple(offsets) and tuple(c.sizes) == tuple(sizes):
                    t = self._load_record(key, c)
                    if t is not None:
                        return t
        dest = out if out is not None else torch.empty(tuple(sizes), dtype=md.properties.dtype)
        box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, candidates, [box])
        self._run(items, _IntoBox(dest))
        return dest

    def _load_record(self, key: str, chunk: ChunkStorageMetadata) -> torch.Tensor | None:
        info = self.metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
        if info is None or info.transform_descriptors:
            return None
        try:
            with open(self.path / info.relative_path, "rb") as f:
                t = torch.load(_FileSlice(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
            raise CheckpointFormatError(f"{self.path}: cannot read {key} from {info.relative_path} (truncated or "
                                        f"corrupt data file: {e})") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(chunk.sizes) or t.storage_offset() != 0:
            return None
        return t

    def _candidates(self, key: str, offsets, sizes) -> TensorStorageMetadata:
        """``key``'s metadata restricted to the stored chunks that overlap the box along dim 0 (a stacked expert
        tensor has one chunk or more per expert; scanning them all for every expert read is quadratic)."""
        md = self.tensors[key]
        if len(md.chunks) < 8 or not md.size:
            return md
        index = self._chunk_index.get(key)
        if index is None:
            chunks = sorted(md.chunks, key=lambda c: c.offsets[0])
            index = self._chunk_index[key] = ([c.offsets[0] for c in chunks], chunks,
                                              max(c.sizes[0] for c in chunks))
        starts, chunks, longest = index
        lo = bisect.bisect_left(starts, offsets[0] - longest + 1)
        hi = bisect.bisect_left(starts, offsets[0] + sizes[0])
        picked = [c for c in chunks[lo:hi] if c.offsets[0] + c.sizes[0] > offsets[0]]
        return TensorStorageMetadata(properties=md.properties, size=md.size, chunks=picked)

    def read_object(self, unique_key: str) -> Any:
        read = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(unique_key), dest_offsets=torch.Size(()),
                        storage_index=MetadataIndex(unique_key), storage_offsets=torch.Size(()), lengths=torch.Size(()))
        planner = _IntoBox()
        self._run([read], planner)
        planner.value.seek(0)
        return torch.load(planner.value, weights_only=True)[0]

    def _run(self, items, planner: _IntoBox) -> None:
        try:
            self._reader.read_data(LoadPlan(items), planner).wait()
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
            files = sorted({self.metadata.storage_data[i.storage_index].relative_path for i in items})
            raise CheckpointFormatError(f"{self.path}: cannot read {items[0].storage_index.fqn} from {files} "
                                        f"(truncated or corrupt data file: {e})") from None

    def common_state(self) -> dict:
        """megatron-core's common state (the 0.19 in-checkpoint object, or a legacy ``common.pt``)."""
        import megatron.core  # noqa: F401  (registers megatron-core's safe globals, e.g. argparse.Namespace)

        if COMMON_STATE_KEY in self.objects:
            return self.read_object(COMMON_STATE_KEY)
        legacy = self.path / "common.pt"
        if legacy.is_file():
            return torch.load(legacy, map_location="cpu", weights_only=True)
        return {}


# --------------------------------------------------------------------------------------------------------------------
# Megatron-LM directory layout
# --------------------------------------------------------------------------------------------------------------------


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """``path`` may be a Megatron-LM save directory (with ``latest_checkpointed_iteration.txt``) or one
    ``iter_XXXXXXX`` / ``release`` directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: megatron checkpoint not found")
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return path / "release"
        try:
            return iteration_dir(path, int(text))
        except ValueError:
            raise CheckpointFormatError(f"{tracker}: expected an iteration number or 'release', found {text!r}") from None
    if (path / "metadata.json").is_file() or (path / ".metadata").is_file():
        return path
    raise CheckpointFormatError(
        f"{path}: not a Megatron checkpoint (no {TRACKER_FILE} and no metadata.json); an interrupted conversion "
        "leaves no tracker file"
    )


def megatron_args(arch_kwargs: Mapping[str, Any], *, tp: int, pp: int, ep: int) -> Any:
    """An ``argparse.Namespace`` for Megatron-LM's ``load_checkpoint`` (and ``--use-checkpoint-args``): the
    parallel sizes the checkpoint was written with, ``no_save_optim``/``no_save_rng`` so that ``--load`` skips
    optimizer and RNG state without ``--finetune``, and the architecture under Megatron-LM's flag names."""
    from argparse import Namespace

    simple = {k: v for k, v in arch_kwargs.items()
              if isinstance(v, (bool, int, float, str, type(None))) or (isinstance(v, list) and all(
                  isinstance(x, (int, float, str)) for x in v))}
    rename = {"num_moe_experts": "num_experts"}
    args = {rename.get(k, k): v for k, v in simple.items()}
    args.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=None, ckpt_format="torch_dist", no_save_optim=True, no_save_rng=True,
        use_dist_ckpt=True,
    )
    return Namespace(**args)


def common_state(*, args: Any, iteration: int, bridge_meta: Mapping[str, Any]) -> dict:
    return {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "distrib_optim_sharding_type": "dp_reshardable",
        },
        BRIDGE_KEY: dict(bridge_meta),
    }


def write_tracker(root: Path, iteration: int) -> None:
    (Path(root) / TRACKER_FILE).write_text(f"{iteration}\n")


def load_into_model(model, ckpt_dir: str | Path, *, strict: bool = True) -> str:
    """Load a ``torch_dist`` checkpoint into a built megatron-core model with megatron-core's own
    ``dist_checkpointing.load`` (any TP/PP/EP; collective over the model's process groups), whatever Megatron
    layout and expert form it was written in (:func:`bridge.megatron_layout.checkpoint_sharded_state_dict` renames
    the model's keys to the checkpoint's). Returns the layout's name.

    megatron-core reads ``.metadata`` with plain pickle: :class:`DistCheckpoint` parses it with the restricted
    unpickler first, so a crafted file is refused before megatron-core opens it (and a missing or incomplete
    directory gets a clear error instead of megatron-core's asserts)."""
    from megatron.core import dist_checkpointing

    from .megatron_layout import checkpoint_sharded_state_dict

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    ckpt = DistCheckpoint(ckpt_dir)
    sharded, layout, _ = checkpoint_sharded_state_dict(model, ckpt.tensors, ckpt.objects, source=str(ckpt_dir))
    with warnings.catch_warnings():  # torch DCP deprecation chatter from megatron-core's load path
        warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint")
        loaded = dist_checkpointing.load({"model": sharded}, str(ckpt_dir))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if strict and (missing or unexpected):
        raise CheckpointFormatError(f"{ckpt_dir}: loading left parameters unset: {missing}; unexpected: {unexpected}")
    return layout.name
