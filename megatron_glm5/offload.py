"""Activation offload for the DSA decoder layers of every family: one saved-tensor window per decoder-layer call
(:class:`megatron_glm5.core.layer.DSADecoderLayer`) moves what autograd keeps for the backward (the layer input,
attention and MoE activations, the DSA top-k) to host memory, and brings it back when the backward needs it.

Turned on by ``RuntimePolicy.activation_offload`` or megatron-core's ``--fine-grained-activation-offloading`` with an
attention-side ``--offload-modules`` name (:func:`activation_offload_for`). Storage-matched host copies (views of one
storage share one copy), D2H / H2D on side streams with prefetch of the previous window, the top-k kept for the
recompute replay held through the window (:func:`hold` / :func:`release`), and each TP rank keeping its share of the
TP-replicated top-k (:func:`mark_replicated`, installed into :mod:`megatron_glm5.dsa.hooks`). Why megatron-core's
own offload manager is not reused, and how the window works in detail: ``docs/design/offload.md``.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from .device_check import check_on_device
from .dsa.hooks import install_replicated_marker

# megatron-core offload_modules names whose activations live in the attention half of the layer: megatron-core cannot
# offload them for DSA attention, so any of them turns on this window (which covers the whole layer call).
ATTENTION_OFFLOAD_MODULES = frozenset({"attn_norm", "qkv_linear", "core_attn", "attn_proj"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationOffload:
    """Settings of the per-layer offload window (module docstring).

    ``min_numel``: storages with fewer elements stay on the device (megatron-core's ``min_offloaded_tensor_size``).
    ``shard_replicated``: TP ranks keep only their share of TP-replicated tensors (the DSA top-k).
    ``prefetch``: reload the previous layer's window on a side stream when a layer's backward starts."""

    min_numel: int = 1 << 20
    shard_replicated: bool = True
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.min_numel < 0:
            raise ValueError(f"ActivationOffload.min_numel: expected >= 0, got {self.min_numel}")


def activation_offload_for(config, policy=None) -> Optional[ActivationOffload]:
    """The offload settings of a model, in one place: :class:`~megatron_glm5.config.RuntimePolicy`'s
    ``activation_offload`` (our Python API), else megatron-core's ``fine_grained_activation_offloading`` with an
    attention-side name in ``offload_modules`` (Megatron-LM's ``--fine-grained-activation-offloading
    --offload-modules core_attn``), with ``min_offloaded_tensor_size`` as the threshold. None: no window."""
    if policy is not None and policy.activation_offload:
        return ActivationOffload(min_numel=policy.activation_offload_min_numel,
                                 shard_replicated=policy.activation_offload_shard_topk)
    if getattr(config, "fine_grained_activation_offloading", False):
        names = set(getattr(config, "offload_modules", None) or ())
        if names & ATTENTION_OFFLOAD_MODULES:
            return ActivationOffload(min_numel=int(getattr(config, "min_offloaded_tensor_size", 1 << 20)))
    return None


# --------------------------------------------------------------------------------------------------------------------
# Bookkeeping shared by windows and scopes
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class OffloadLog:
    """What was offloaded while :func:`recording` was active (diagnostics, tests, benchmarks)."""

    copies: list[dict[str, Any]] = field(default_factory=list)  # one per host copy: window, bytes, dtype, shape, ...
    reused: int = 0  # packs served by an existing copy (views of one storage, the top-k saved again)
    loads: int = 0  # H2D reloads (synchronous or prefetched)
    prefetches: int = 0  # reloads started ahead, on the side stream, for the next window of the backward

    @property
    def bytes_offloaded(self) -> int:
        return sum(c["host_bytes"] for c in self.copies)


_logs: list[OffloadLog] = []
_logs_lock = threading.Lock()


@contextmanager
def recording() -> Iterator[OffloadLog]:
    """Collect an :class:`OffloadLog` of every window (all threads) for the duration of the block."""
    log = OffloadLog()
    with _logs_lock:
        _logs.append(log)
    try:
        yield log
    finally:
        with _logs_lock:
            _logs.remove(log)


def _note(kind: str, **info) -> None:
    if not _logs:
        return
    with _logs_lock:
        for log in _logs:
            if kind == "copy":
                log.copies.append(dict(info))
            else:
                setattr(log, kind, getattr(log, kind) + 1)


class _Local(threading.local):
    def __init__(self):
        # (device, storage data_ptr) -> (weakref to the storage, weakref to its host copy, version at pack time)
        self.copies: dict[tuple, tuple] = {}
        # (device, storage data_ptr) -> (weakref to the storage, TP process group)
        self.replicated: dict[tuple, tuple] = {}
        self.window: Optional[_Window] = None
        self.scopes: list[Optional[_Scope]] = []


_tls = _Local()
_streams: dict[int, tuple] = {}  # CUDA device index -> (d2h stream, h2d stream)


def _side_streams(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index))
    return _streams[index]


def _prune(table: dict) -> None:
    for key in [k for k, v in table.items() if v[0]() is None]:
        del table[key]


def _host_device_type() -> str:
    """The device type whose tensors move: CUDA when there is one, else the CPU (copied to a separate buffer)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def mark_replicated(tensor: torch.Tensor, group) -> None:
    """Declare ``tensor``'s storage identical on every rank of the process group ``group`` (the DSA top-k over TP),
    before anything saves it: a host copy of it then keeps only this rank's share of the bytes. No-op outside an
    offload window or for a group of one rank."""
    if _tls.window is None or group is None or torch.distributed.get_world_size(group) <= 1:
        return
    storage = tensor.untyped_storage()
    _tls.replicated[(tensor.device, storage.data_ptr())] = (weakref.ref(storage), group)


install_replicated_marker(mark_replicated)  # the DSA attention marks its top-k through megatron_glm5.dsa.hooks


def _replicated_group(device: torch.device, storage: torch.UntypedStorage):
    entry = _tls.replicated.get((device, storage.data_ptr()))
    if entry is None or entry[0]() is not storage:
        return None
    return entry[1]


# --------------------------------------------------------------------------------------------------------------------
# Host copies
# --------------------------------------------------------------------------------------------------------------------


class _HostCopy:
    """The bytes of one device storage in host memory (whole storage: every view of it shares this copy), or this
    rank's share of them for a TP-replicated storage. Every view of it unpacks from one reloaded storage."""

    __slots__ = ("device", "nbytes", "host", "ready", "lo", "hi", "group", "checksum", "prefetched",
                 "prefetch_ready", "loaded", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, group=None):
        self.device = device
        self.nbytes = n = storage.nbytes()
        self.group = group
        self.prefetched = self.prefetch_ready = self.loaded = None
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.lo, self.hi = 0, n
        self.checksum = None
        if group is not None:
            world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            self.lo, self.hi = rank * n // world, (rank + 1) * n // world
            # per-share sums of the local bytes (as int32 words): the reload checks the gathered shares against them
            self.checksum = src.view(torch.int32).view(world, -1).sum(1, dtype=torch.int64)
        part = src[self.lo:self.hi]
        if device.type == "cuda":
            d2h, _ = _side_streams(device)
            self.host = torch.empty(part.numel(), dtype=torch.uint8, pin_memory=True)
            d2h.wait_stream(torch.cuda.current_stream(device))  # the producer's kernels come first
            with torch.cuda.stream(d2h):
                self.host.copy_(part, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(d2h)
            src.record_stream(d2h)  # the allocator may not reuse the block before the copy ends
        else:
            self.host = part.clone()  # no CUDA: a separate CPU buffer, so pack / unpack really round-trip
            self.ready = None

    @property
    def host_bytes(self) -> int:
        return self.hi - self.lo

    def prefetch(self) -> None:
        """Start the H2D copy on the side stream (the TP gather, if any, waits for the first use). Without CUDA the
        copy is made at once, so CPU tests run the prefetch path too."""
        if self.prefetched is not None or self.loaded is not None:
            return
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)  # allocated on the consumer stream
        if self.device.type == "cuda":
            _, h2d = _side_streams(self.device)
            h2d.wait_stream(torch.cuda.current_stream(self.device))
            h2d.wait_event(self.ready)
            with torch.cuda.stream(h2d):
                buffer[self.lo:self.hi].copy_(self.host, non_blocking=True)
                self.prefetch_ready = torch.cuda.Event()
                self.prefetch_ready.record(h2d)
            buffer.record_stream(h2d)
        else:
            buffer[self.lo:self.hi].copy_(self.host)
        self.prefetched = buffer
        _note("prefetches")

    def load(self) -> torch.UntypedStorage:
        """The storage back on the device: the one reloaded before (kept while this copy lives, i.e. until the last
        node that saved a view of it has run its backward: the lifetime the tensor has without offload), else the
        prefetched buffer, else a synchronous copy on the current stream."""
        if self.loaded is not None:
            return self.loaded
        if self.prefetched is not None:
            buffer, self.prefetched = self.prefetched, None
            if self.prefetch_ready is not None:
                torch.cuda.current_stream(self.device).wait_event(self.prefetch_ready)
        elif self.device.type == "cuda":
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            buffer[self.lo:self.hi].copy_(self.host, non_blocking=True)
        else:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            buffer[self.lo:self.hi].copy_(self.host)
        if self.group is not None:
            torch.distributed.all_gather_into_tensor(buffer, buffer[self.lo:self.hi], group=self.group)
            world = self.checksum.numel()
            check_on_device(
                (buffer.view(torch.int32).view(world, -1).sum(1, dtype=torch.int64) == self.checksum).all(),
                "activation offload: a TP-replicated tensor (DSA top-k) differs across TP ranks; its shares cannot "
                "be combined (set RuntimePolicy.activation_offload_shard_topk=False)",
            )
        _note("loads")
        self.loaded = buffer.untyped_storage()
        return self.loaded


class _Saved:
    """What autograd keeps instead of a tensor: its host copy and its view geometry."""

    __slots__ = ("copy", "dtype", "size", "stride", "offset", "window")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor, window: "_Window"):
        self.copy = copy
        self.dtype, self.size, self.stride, self.offset = (tensor.dtype, tensor.shape, tensor.stride(),
                                                           tensor.storage_offset())
        self.window = window

    def get(self) -> torch.Tensor:
        self.window.started()
        storage = self.copy.load()
        with torch.no_grad():
            return torch.empty(0, dtype=self.dtype, device=storage.device).set_(storage, self.offset, self.size,
                                                                                 self.stride)


def _kept(t: torch.Tensor) -> torch.Tensor:
    """What a pack hook returns for a tensor that stays on the device: never ``t`` itself, which for a saved *output*
    of a node would close a reference cycle through that node (output -> grad_fn -> saved copy -> output) that
    Python's garbage collector cannot see, and leak the tensor."""
    return t.detach()


def _unpack(saved: Any) -> Any:
    return saved.get() if isinstance(saved, _Saved) else saved


def _is_weight(t: torch.Tensor) -> bool:
    if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
        return True
    base = t._base
    return base is not None and (isinstance(base, torch.nn.Parameter) or (base.requires_grad and base.is_leaf))


# --------------------------------------------------------------------------------------------------------------------
# Windows and block scopes
# --------------------------------------------------------------------------------------------------------------------


class _Window:
    """The saved tensors of one layer call (or of one full-recompute chunk): their host copies, and the previous
    window of the same block call (prefetched when this one's backward starts)."""

    __slots__ = ("name", "settings", "prev", "copies", "is_started", "params", "excluded", "expected", "__weakref__")

    def __init__(self, name: str, settings: ActivationOffload, prev: Optional["_Window"]):
        self.name = name
        self.settings = settings
        self.prev = prev
        self.copies: list[weakref.ref] = []  # host copies this window's tensors use (own or shared)
        self.is_started = False
        self.params: set[int] = set()  # storage data_ptrs of the layer's parameters
        self.excluded: list[weakref.ref] = []  # storages of layer inputs that stay (masks, RoPE, ...)
        self.expected: list[weakref.ref] = []  # full recompute: storages of the chunk inputs the block scope files

    def _add(self, copy: _HostCopy) -> None:
        if not any(r() is copy for r in self.copies):
            self.copies.append(weakref.ref(copy))

    def started(self) -> None:
        """First unpack of this window in the backward: prefetch the previous window that holds anything."""
        if self.is_started:
            return
        self.is_started = True
        if not self.settings.prefetch:
            return
        prev = self.prev
        while prev is not None and not any(r() is not None for r in prev.copies):
            prev = prev.prev
        if prev is not None:
            for ref in prev.copies:
                copy = ref()
                if copy is not None:
                    copy.prefetch()

    def offloadable(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.device.type != _host_device_type():
            return False
        if t.is_conj() or t.is_neg():  # lazy views whose bit a storage copy would drop
            return False
        if _is_weight(t) or getattr(t, "_do_not_offload", False) or getattr(t, "_TE_do_not_offload", False):
            return False
        storage = t.untyped_storage()
        if any(ref() is storage for ref in self.excluded):
            return False
        if not storage.nbytes() or storage.data_ptr() in self.params or storage.nbytes() % t.element_size():
            return False
        return storage.nbytes() // t.element_size() >= self.settings.min_numel

    def pack(self, t: torch.Tensor) -> Any:
        """A :class:`_Saved` (one host copy per storage), or ``t`` detached when it stays on the device."""
        if not isinstance(t, torch.Tensor):
            return t
        if not self.offloadable(t):
            return _kept(t)
        with torch.no_grad():
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            entry = _tls.copies.get(key)
            copy = entry[1]() if entry is not None and entry[0]() is storage and entry[2] == t._version else None
            if copy is None:
                group = _replicated_group(t.device, storage) if self.settings.shard_replicated else None
                if group is not None and storage.nbytes() % (4 * torch.distributed.get_world_size(group)):
                    group = None  # shares must be whole int32 words
                copy = _HostCopy(storage, t.device, group)
                _tls.copies[key] = (weakref.ref(storage), weakref.ref(copy), t._version)
                _note("copy", window=self.name, host_bytes=copy.host_bytes, nbytes=copy.nbytes, dtype=t.dtype,
                      shape=tuple(t.shape), data_ptr=storage.data_ptr(), sharded=group is not None)
            else:
                _note("reused")
            self._add(copy)
            return _Saved(copy, t, self)

    def expects(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        return any(ref() is storage for ref in self.expected)


class _Scope:
    """One forward call of a decoder / MTP block: orders its windows (for the prefetch) and, under full recompute,
    files the checkpoint inputs that are a chunk's layer input or top-k with that chunk's window."""

    def __init__(self):
        self.last: Optional[_Window] = None
        self.pending: Optional[_Window] = None  # the chunk whose checkpoint inputs are being saved
        self.hooks = saved_tensors_hooks(self._pack, _unpack)

    def new_window(self, name: str, settings: ActivationOffload) -> _Window:
        window = _Window(name, settings, self.last)
        self.last = window
        return window

    def _pack(self, t: torch.Tensor) -> Any:
        pending = self.pending
        if not isinstance(t, torch.Tensor):
            return t
        if pending is not None and pending.expects(t):
            return pending.pack(t)
        return _kept(t)


def _current_scope() -> Optional[_Scope]:
    return _tls.scopes[-1] if _tls.scopes else None


_warned_unscoped = False


def warn_if_unscoped() -> None:
    """Warn once when a layer opens its window outside any block scope (a model not built by ``build_model``)."""
    global _warned_unscoped
    if not _tls.scopes and not _warned_unscoped:
        _warned_unscoped = True
        warnings.warn("activation offload: a GLM layer runs outside a block scope, so its reloads are not prefetched "
                      "and full-recompute checkpoint inputs stay on the device; call megatron_glm5.offload.attach("
                      "model) on models not built by megatron_glm5.model.build_model", stacklevel=3)


def _enter_scope(module, args) -> None:
    scope = _Scope() if (module.training and torch.is_grad_enabled()) else None
    _tls.scopes.append(scope)
    if scope is not None:
        scope.hooks.__enter__()


def _exit_scope(module, args, output) -> None:
    if not _tls.scopes:
        return
    scope = _tls.scopes.pop()
    if scope is not None:
        scope.hooks.__exit__(None, None, None)


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model``'s decoder and MTP blocks a block scope (forward pre-hook / hook): orders the layer windows
    of each block call for the prefetch and, under full recompute, offloads the checkpoint inputs (each chunk's layer
    input and top-k). Layers with offload settings work without it, with synchronous reloads and, under full
    recompute, only the kept top-k offloaded. Idempotent; returns ``model``."""
    for name in ("decoder", "mtp"):
        block = getattr(model, name, None)
        if block is None or getattr(block, "_glm5_offload_scope", None):
            continue
        block._glm5_offload_scope = (block.register_forward_pre_hook(_enter_scope),
                                     block.register_forward_hook(_exit_scope, always_call=True))
    return model


@contextmanager
def window(settings: ActivationOffload, *, name: str = "window", module: Optional[torch.nn.Module] = None,
           keep: tuple = ()) -> Iterator[Optional[_Window]]:
    """Offload what autograd saves inside the block (a layer call, or any code in tests). ``module``'s parameters
    and the tensors in ``keep`` stay on the device. Nested windows: the innermost one takes the tensors."""
    scope = _current_scope()
    win = scope.new_window(name, settings) if scope is not None else _Window(name, settings, None)
    _prune(_tls.copies)
    _prune(_tls.replicated)
    if module is not None:
        win.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    win.excluded = [weakref.ref(t.untyped_storage()) for t in keep if isinstance(t, torch.Tensor)]
    previous, _tls.window = _tls.window, win
    try:
        with saved_tensors_hooks(win.pack, _unpack):
            yield win
    finally:
        _tls.window = previous


@contextmanager
def chunk_window(settings: ActivationOffload, node: Any, *, name: str, inputs: tuple) -> Iterator[Optional[_Window]]:
    """The first (no-grad) pass of a full-recompute checkpoint: one window per checkpoint ``node`` (the autograd node
    of megatron-core's ``CheckpointFunction``), shared by the layers of the chunk. It installs no hooks (nothing is
    saved under no_grad); :func:`hold` files the kept top-k here, and the block scope files the chunk's ``inputs``
    (layer input, incoming top-k) that the checkpoint saves when it returns. Inside a block call without gradients
    (a train-mode forward under ``no_grad``: megatron-core still checkpoints, but no graph will keep anything) it does
    nothing."""
    if _tls.scopes and _tls.scopes[-1] is None:
        yield None
        return
    scope = _current_scope()
    win = getattr(node, "_glm5_offload_window", None) if node is not None else None
    if win is None:
        win = scope.new_window(name, settings) if scope is not None else _Window(name, settings, None)
        _prune(_tls.copies)
        _prune(_tls.replicated)
        win.expected = [weakref.ref(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)]
        if node is not None:
            node._glm5_offload_window = win
        if scope is not None:
            scope.pending = win
    previous, _tls.window = _tls.window, win
    try:
        yield win
    finally:
        _tls.window = previous


def hold(t: torch.Tensor) -> Any:
    """Keep ``t`` past the forward through the active window (a host copy, like a saved tensor); ``t`` itself when
    no window is active or it stays on the device. Undo with :func:`release`."""
    win = _tls.window
    return win.pack(t) if win is not None else t


def release(held: Any) -> Any:
    """The tensor behind a :func:`hold` result (reloaded to the device if it was offloaded)."""
    return _unpack(held)
