"""CPU mode for megatron-core: what lets its DSA / MoE / checkpoint code run on a machine without CUDA.

megatron-core 0.19.2 calls CUDA directly in a few places that its torch (non-fused) paths still reach; on a machine
without CUDA each raises "Found no NVIDIA driver":

* ``torch.cuda.current_device()``: ``RotaryEmbedding`` construction and ``get_emb`` (every forward), the MoE
  ``TopKRouter`` buffers and ``gating()``, the DSA indexer-loss tracker. Answering ``cpu`` is enough for all of them.
* ``torch.cuda.random.get_rng_state()``: activation checkpointing (``tensor_parallel.checkpoint``) saves and restores
  the CUDA RNG state around the recompute, in forward *and in backward*. Without CUDA there is no such state; a
  placeholder is returned (the matching restore is queued by torch and never runs, which is what "no CUDA RNG" means).
* ``torch.cuda.synchronize()``: ``dist_checkpointing`` save synchronises after its device-to-host copies.
* ``Tensor.cuda()``: with pipeline parallelism the shared word embedding is moved to "the" device before its
  first/last-stage all-reduce, once, while the model is built.

Two scopes, so that nothing a user's own code relies on changes behind its back:

* the three CUDA *queries* above answer for the CPU instead of raising (:func:`enable_cpu_mode`, process-wide and
  idempotent: they run in forward and backward, outside any scope we control). Code that works on such a machine
  keeps working; only calls that would have raised now answer.
* ``Tensor.cuda`` as identity and TorchDynamo switched off (megatron-core's ``jit_fuser`` is ``torch.compile``,
  whose first call costs 15-20 s of compilation on CPU for nothing) hold only inside :func:`cpu_mode` - model
  construction - and, for dynamo, inside the forward of models built here (:func:`attach_cpu_mode`). A user's
  ``.cuda()`` afterwards raises as it always would, and their ``torch.compile`` is untouched.

Nothing here runs at import, and everything is a no-op when CUDA is available.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _placeholder_cuda_rng_state(device="cuda") -> torch.Tensor:
    return torch.zeros(16, dtype=torch.uint8)


def _no_synchronize(device=None) -> None:
    return None


def _stay_on_cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self


# (module, attribute, CPU replacement)
_QUERY_SHIMS = (
    (torch.cuda, "current_device", _cpu_current_device),
    (torch.cuda.random, "get_rng_state", _placeholder_cuda_rng_state),
    (torch.cuda, "synchronize", _no_synchronize),
)
_BUILD_SHIMS = ((torch.Tensor, "cuda", _stay_on_cpu),)
_originals: dict[tuple[int, str], object] = {}
_lock = threading.RLock()
_depth = 0  # nesting depth of cpu_mode() scopes (any thread)
_dynamo_before: bool | None = None


def cpu_mode_needed() -> bool:
    return not torch.cuda.is_available()


def _install(shims) -> None:
    for module, name, replacement in shims:
        key = (id(module), name)
        if key not in _originals:
            _originals[key] = getattr(module, name)
            setattr(module, name, replacement)


def _remove(shims) -> None:
    for module, name, _ in shims:
        original = _originals.pop((id(module), name), None)
        if original is not None:
            setattr(module, name, original)


def enable_cpu_mode() -> bool:
    """Make megatron-core's CUDA queries (``current_device``, CUDA ``get_rng_state``, ``synchronize``) answer for the
    CPU on a machine without CUDA, process-wide. Returns True if they are active (False with CUDA)."""
    if not cpu_mode_needed():
        return False
    with _lock:
        _install(_QUERY_SHIMS)
    return True


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (tests use it to leave the process as they found it)."""
    with _lock:
        _remove(_QUERY_SHIMS)


@contextmanager
def cpu_mode() -> Iterator[bool]:
    """Everything megatron-core needs on CPU for the duration of the block (re-entrant): the query shims
    (:func:`enable_cpu_mode`), ``Tensor.cuda`` as identity and TorchDynamo off. On exit ``Tensor.cuda`` and dynamo
    are restored; the query shims stay (backward passes need them later). Yields False (and does nothing) with CUDA."""
    global _depth, _dynamo_before
    if not cpu_mode_needed():
        yield False
        return
    import torch._dynamo

    with _lock:
        _install(_QUERY_SHIMS)
        if _depth == 0:
            _install(_BUILD_SHIMS)
            _dynamo_before = torch._dynamo.config.disable
            torch._dynamo.config.disable = True
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _remove(_BUILD_SHIMS)
                torch._dynamo.config.disable = _dynamo_before


@contextmanager
def _no_dynamo() -> Iterator[None]:
    import torch._dynamo

    with _lock:
        before = torch._dynamo.config.disable
        torch._dynamo.config.disable = True
    try:
        yield
    finally:
        with _lock:
            torch._dynamo.config.disable = before


def attach_cpu_mode(model: torch.nn.Module) -> torch.nn.Module:
    """On a machine without CUDA, run ``model``'s forward with TorchDynamo off (hooks that undo themselves, also
    when the forward raises) and make sure the query shims are on. A no-op with CUDA; returns ``model``."""
    if not cpu_mode_needed() or getattr(model, "_glm5_cpu_mode_hooks", None):
        return model
    enable_cpu_mode()
    scopes: list = []

    def enter(module, args):
        scope = _no_dynamo()
        scope.__enter__()
        scopes.append(scope)

    def leave(module, args, output):
        if scopes:
            scopes.pop().__exit__(None, None, None)

    model._glm5_cpu_mode_hooks = (model.register_forward_pre_hook(enter),
                                  model.register_forward_hook(leave, always_call=True))
    return model
