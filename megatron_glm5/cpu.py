"""CPU mode for megatron-core: the one explicit switch that lets its DSA / MoE code run without CUDA.

megatron-core 0.19.2 calls CUDA directly in a few places that its torch (non-fused) paths still reach:

* ``torch.cuda.current_device()``: ``RotaryEmbedding`` construction and ``get_emb`` (the DSA indexer and AbsorbedMLA
  build their own rotary embedding without ``use_cpu_initialization``), the MoE ``TopKRouter`` buffers and
  ``gating()``, the DSA indexer-loss tracker. Answering ``cpu`` is enough for all of them.
* ``torch.cuda.random.get_rng_state()``: activation checkpointing (``tensor_parallel.checkpoint``) saves and restores
  the CUDA RNG state around the recompute. Without CUDA there is no such state; a placeholder is returned (the
  matching restore is queued by torch and never runs, which is what "no CUDA RNG" means).

On a machine without CUDA each of these raises "Found no NVIDIA driver" (see ``shared/notes/cpu_environment.md``).

Nothing here runs at import. Call :func:`enable_cpu_mode` from a program's ``main()`` (the ``demo`` does) or from a
test fixture. It is a no-op when CUDA is available, and idempotent.
"""

from __future__ import annotations

import os

import torch

_original_current_device = None
_original_get_rng_state = None


def cpu_mode_needed() -> bool:
    return not torch.cuda.is_available()


def enable_cpu_mode() -> bool:
    """Route megatron-core's ``torch.cuda.current_device()`` calls to the CPU when there is no GPU.

    Also disables TorchDynamo: megatron-core's ``jit_fuser`` is ``torch.compile``, whose first call costs 15-20 s
    of compilation on CPU for no benefit at the sizes the CPU paths run. Returns True if the shim is active.
    """
    global _original_current_device, _original_get_rng_state
    if not cpu_mode_needed():
        return False
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    try:
        import torch._dynamo

        torch._dynamo.config.disable = True
    except Exception:  # pragma: no cover - dynamo missing in exotic builds
        pass
    if _original_current_device is None:
        _original_current_device = torch.cuda.current_device
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    if _original_get_rng_state is None:
        _original_get_rng_state = torch.cuda.random.get_rng_state
        torch.cuda.random.get_rng_state = _placeholder_cuda_rng_state  # type: ignore[assignment]
    return True


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (tests use it to leave the process as they found it)."""
    global _original_current_device, _original_get_rng_state
    if _original_current_device is not None:
        torch.cuda.current_device = _original_current_device  # type: ignore[assignment]
        _original_current_device = None
    if _original_get_rng_state is not None:
        torch.cuda.random.get_rng_state = _original_get_rng_state  # type: ignore[assignment]
        _original_get_rng_state = None
_original_get_rng_state = None


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _placeholder_cuda_rng_state(device="cuda") -> torch.Tensor:
    return torch.zeros(16, dtype=torch.uint8)
