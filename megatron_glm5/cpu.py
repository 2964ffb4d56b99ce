"""CPU mode for megatron-core: the one explicit switch that lets its DSA / MoE / checkpoint code run without CUDA.

megatron-core 0.19.2 calls CUDA directly in a few places that its torch (non-fused) paths still reach:

* ``torch.cuda.current_device()``: ``RotaryEmbedding`` construction and ``get_emb`` (the DSA indexer and AbsorbedMLA
  build their own rotary embedding without ``use_cpu_initialization``), the MoE ``TopKRouter`` buffers and
  ``gating()``, the DSA indexer-loss tracker. Answering ``cpu`` is enough for all of them.
* ``torch.cuda.random.get_rng_state()``: activation checkpointing (``tensor_parallel.checkpoint``) saves and restores
  the CUDA RNG state around the recompute. Without CUDA there is no such state; a placeholder is returned (the
  matching restore is queued by torch and never runs, which is what "no CUDA RNG" means).
* ``torch.cuda.synchronize()``: ``dist_checkpointing`` save synchronises after its device-to-host copies; on CPU
  there is nothing to wait for.
* ``Tensor.cuda()``: with pipeline parallelism the shared word embedding is moved to "the" device before its
  first/last-stage all-reduce (``LanguageModule.setup_embeddings_and_output_layer``); on CPU it stays where it is.

On a machine without CUDA each of these raises "Found no NVIDIA driver".

Nothing here runs at import. Call :func:`enable_cpu_mode` from a program's ``main()`` (the CLI and ``demo`` do) or
from a test fixture. It is a no-op when CUDA is available, and idempotent; :func:`disable_cpu_mode` undoes it.
"""

from __future__ import annotations

import os

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
_SHIMS = (
    (torch.cuda, "current_device", _cpu_current_device),
    (torch.cuda.random, "get_rng_state", _placeholder_cuda_rng_state),
    (torch.cuda, "synchronize", _no_synchronize),
    (torch.Tensor, "cuda", _stay_on_cpu),
)
_originals: dict[tuple[int, str], object] = {}


def cpu_mode_needed() -> bool:
    return not torch.cuda.is_available()


def enable_cpu_mode() -> bool:
    """Route megatron-core's direct CUDA calls (listed in the module docstring) to CPU answers when there is no GPU.

    Also disables TorchDynamo: megatron-core's ``jit_fuser`` is ``torch.compile``, whose first call costs 15-20 s
    of compilation on CPU for no benefit at the sizes the CPU paths run. Returns True if the shims are active.
    """
    if not cpu_mode_needed():
        return False
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    try:
        import torch._dynamo

        torch._dynamo.config.disable = True
    except Exception:  # pragma: no cover - dynamo missing in exotic builds
        pass
    for module, name, replacement in _SHIMS:
        key = (id(module), name)
        if key not in _originals:
            _originals[key] = getattr(module, name)
            setattr(module, name, replacement)
    return True


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (tests use it to leave the process as they found it)."""
    for module, name, _ in _SHIMS:
        original = _originals.pop((id(module), name), None)
        if original is not None:
            setattr(module, name, original)
