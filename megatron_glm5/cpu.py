"""CPU mode for megatron-core: the one explicit switch that lets its DSA / MoE code run without CUDA.

megatron-core 0.19.2 calls ``torch.cuda.current_device()`` directly in a few places that the torch (non-fused)
paths still reach: ``RotaryEmbedding`` construction and ``get_emb`` (DSA indexer and AbsorbedMLA build their own
rotary embedding without ``use_cpu_initialization``), the MoE ``TopKRouter`` buffers and ``gating()``, and the DSA
indexer-loss tracker. On a machine without CUDA each of these raises "Found no NVIDIA driver". Making
``current_device()`` answer ``cpu`` is enough for all of them (measured: see ``shared/notes/cpu_environment.md``).

Nothing here runs at import. Call :func:`enable_cpu_mode` from a program's ``main()`` (the ``demo`` does) or from a
test fixture. It is a no-op when CUDA is available, and idempotent.
"""

from __future__ import annotations

import os

import torch

_original_current_device = None


def cpu_mode_needed() -> bool:
    return not torch.cuda.is_available()


def enable_cpu_mode() -> bool:
    """Route megatron-core's ``torch.cuda.current_device()`` calls to the CPU when there is no GPU.

    Also disables TorchDynamo: megatron-core's ``jit_fuser`` is ``torch.compile``, whose first call costs 15-20 s
    of compilation on CPU for no benefit at the sizes the CPU paths run. Returns True if the shim is active.
    """
    global _original_current_device
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
    return True


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (tests use it to leave the process as they found it)."""
    global _original_current_device
    if _original_current_device is not None:
        torch.cuda.current_device = _original_current_device  # type: ignore[assignment]
        _original_current_device = None


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")
