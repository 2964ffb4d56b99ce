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

Scopes, so that a library call never changes what a user's own code does:

* :func:`cpu_mode` (a context manager, re-entrant) holds all of them, plus TorchDynamo switched off (megatron-core's
  ``jit_fuser`` is ``torch.compile``, whose first call costs 15-20 s of compilation on CPU for nothing), and restores
  ``Tensor.cuda`` and dynamo on exit. :func:`~megatron_glm5.model.build_model` builds models inside it.
* :func:`attach_cpu_mode` is what models built here carry: the three CUDA *queries* answer for the CPU (installed
  once, process-wide: they also run in backward, outside any scope we control; on a machine without CUDA they would
  only have raised) and each forward runs with dynamo off (hooks that undo themselves). A user's ``.cuda()`` still
  raises as it always would, and their ``torch.compile`` is untouched.
* :func:`enable_cpu_mode` is the explicit process-wide switch of everything, for a CPU-only *program's* ``main``
  (the CLI, test sessions, CPU rehearsal scripts); library code never calls it. :func:`disable_cpu_mode` undoes it.

Nothing here runs at import, and everything is a no-op when CUDA is available. The patches go through
:func:`megatron_glm5.compat.install_patches`, which undoes any still installed when the interpreter exits.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from .compat import install_patches, remove_patches


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
_lock = threading.RLock()
_depth = 0  # nesting depth of cpu_mode() scopes (any thread)
_dynamo_before: bool | None = None
_dynamo_before_enable: bool | None = None


def cpu_mode_needed() -> bool:
    return not torch.cuda.is_available()


_install = install_patches  # remembered originals; compat undoes whatever is left at interpreter exit
_remove = remove_patches


def enable_cpu_mode() -> bool:
    """Process-wide CPU mode for a CPU-only program's ``main``: megatron-core's CUDA queries answer for the CPU,
    ``Tensor.cuda`` is the identity and TorchDynamo is off. Returns True if active (False with CUDA, a no-op)."""
    global _dynamo_before_enable
    if not cpu_mode_needed():
        return False
    import torch._dynamo

    with _lock:
        _install(_QUERY_SHIMS)
        _install(_BUILD_SHIMS)
        if _dynamo_before_enable is None:
            _dynamo_before_enable = torch._dynamo.config.disable
        torch._dynamo.config.disable = True
    return True


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (tests use it to leave the process as they found it)."""
    global _dynamo_before_enable
    import torch._dynamo

    with _lock:
        _remove(_QUERY_SHIMS)
        _remove(_BUILD_SHIMS)
        if _dynamo_before_enable is not None:
            torch._dynamo.config.disable = _dynamo_before_enable
            _dynamo_before_enable = None


def _enable_cuda_queries() -> None:
    with _lock:
        _install(_QUERY_SHIMS)


@contextmanager
def cpu_mode() -> Iterator[bool]:
    """Everything megatron-core needs on CPU for the duration of the block (re-entrant): the CUDA query shims,
    ``Tensor.cuda`` as identity and TorchDynamo off. On exit ``Tensor.cuda`` and dynamo are restored (unless
    :func:`enable_cpu_mode` holds them); the query shims stay (backward passes need them later). Yields False (and
    does nothing) with CUDA."""
    global _depth, _dynamo_before
    if not cpu_mode_needed():
        yield False
        return
    import torch._dynamo

    with _lock:
        _install(_QUERY_SHIMS)
        if _depth == 0:
            _install(_BUILD_SHIMS)  # a no-op when enable_cpu_mode already installed it
            _dynamo_before = torch._dynamo.config.disable
            torch._dynamo.config.disable = True
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _dynamo_before_enable is None:  # enable_cpu_mode (process-wide) keeps its own
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
    """On a machine without CUDA, make megatron-core's CUDA queries answer for the CPU and run ``model``'s forward
    with TorchDynamo off (hooks that undo themselves, also when the forward raises). A no-op with CUDA; returns
    ``model``."""
    if not cpu_mode_needed() or getattr(model, "_glm5_cpu_mode_hooks", None):
        return model
    _enable_cuda_queries()
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
