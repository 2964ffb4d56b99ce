"""Helpers shared by the kernels: lazy TileLang import, small integer math, argument checks, where Triton runs.

Nothing here imports TileLang at module load, so ``import megatron_glm5.kernels`` works on machines without it.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Callable, TypeVar

import torch

T_ = TypeVar("T_")

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# sm90 bulk reduction (PTX ``cp.reduce.async.bulk ... add.f32``): the copy engine adds ``bytes`` of fp32 from shared
# memory into global memory at L2, in one operation per row instead of one atomic per element pair. A kernel declares
# it with ``T.import_source(BULK_ADD_F32_SRC)`` and calls ``glm5_bulk_add_f32(smem, gmem, bytes)`` (16 B aligned
# addresses, ``bytes`` a multiple of 16); the writes into ``smem`` need ``fence.proxy.async`` and a barrier first,
# and ``smem`` may be rewritten only after ``cp.async.bulk.wait_group.read`` in the issuing thread.
BULK_ADD_F32_SRC = r"""
__device__ __forceinline__ void glm5_bulk_add_f32(float* smem, float* gmem, int bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
"""

# Named hardware barriers (PTX ``bar.arrive`` / ``bar.sync`` with a thread count): one side arrives without waiting,
# the other waits until ``count`` threads (both sides together) have arrived; ordering like ``__syncthreads`` among
# the participants. A kernel declares them with ``T.import_source(NAMED_BARRIER_SRC)`` and calls
# ``glm5_bar_arrive(id, count)`` / ``glm5_bar_sync(id, count)``; id 0 is ``__syncthreads``'s.
NAMED_BARRIER_SRC = r"""
__device__ __forceinline__ void glm5_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void glm5_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
"""

# OUT_IDX_NOTE: factories give ``out_idx`` as non-negative positions. With tilelang 0.1.15: after a
# factory's first kernel ran, later kernels of the same factory missed TileLang's disk cache when ``out_idx`` was
# negative (the logged ``out_idx`` had been normalised to positions), so each further shape recompiled (~10 s);
# factories without ``out_idx`` always hit. Positive positions keep the cache key independent of that.


@functools.cache
def tilelang_modules() -> tuple[ModuleType, ModuleType]:
    """``(tilelang, tilelang.language)``, imported on first use; a clear error when TileLang is missing."""
    try:
        import tilelang
        import tilelang.language as T
    except (ImportError, OSError) as err:  # OSError: a broken CUDA/TVM shared library
        raise ImportError(
            "megatron_glm5.kernels needs TileLang (pip install 'megatron-glm5[tilelang]', pinned tilelang==0.1.15); "
            "use megatron_glm5.dsa.reference for the pure-PyTorch path"
        ) from err
    return tilelang, T


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def triton_kernels(build: Callable[[], T_]) -> Callable[[], T_ | None]:
    """Decorator for a Triton kernel module's builder (which imports Triton and defines its ``@triton.jit``
    kernels): the kernels are built once, on first use, and are None where Triton is not installed, so importing
    the module never needs Triton."""

    @functools.cache
    def kernels() -> T_ | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        return build()

    kernels.__doc__ = build.__doc__
    return kernels


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take this tensor: a CUDA tensor, or any tensor under Triton's interpreter
    (``TRITON_INTERPRET=1``, how the CPU tests run the Triton kernels)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype,
    ndim: int,
    device: torch.device | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument, the expected and the found value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (like the first argument), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def row_valid_len(indices: torch.Tensor, *, chunk: int = 16384) -> torch.Tensor:
    """``int32 [T]``: one past the last slot holding a valid (>= 0) index in each row, 0 for an all -1 row.

    The kernels loop only over ``ceil(valid_len / block)`` blocks of a row, so tail padding (-1, the layout
    produced by the indexer) costs nothing; -1 slots before the last valid one are masked inside the block.
    Chunked so the int32 temporary stays at ``chunk x K``.
    """
    rows, width = indices.shape
    out = torch.empty(rows, dtype=torch.int32, device=indices.device)
    if width == 0:
        return out.zero_()
    pos = torch.arange(1, width + 1, dtype=torch.int32, device=indices.device)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        out[r0:r1] = torch.where(indices[r0:r1] >= 0, pos, 0).amax(dim=-1)
    return out


def check_index_rows(indices: torch.Tensor, t_kv: int) -> None:
    """Top-k ``indices`` as the index-set passes take them: an int32 ``[T, K]`` tensor over ``t_kv >= 0`` keys."""
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or indices.dim() != 2:
        raise TypeError(f"indices must be an int32 [T, K] tensor, got "
                        f"{getattr(indices, 'dtype', type(indices))} {tuple(getattr(indices, 'shape', ()))}")
    if t_kv < 0:
        raise ValueError(f"t_kv must be >= 0, got {t_kv}")


def env_switch(name: str, allowed: tuple[str, ...], default: str) -> str:
    """The value of a kernel option's environment switch: ``default`` when the variable is unset or empty, else its
    stripped value, which must be one of ``allowed`` (a ``ValueError`` names the variable and the value). The kernels'
    experimental switches (``MEGATRON_GLM5_PP_OPTIONS``, ``MEGATRON_GLM5_LOGITS_OVERLAP``,
    ``MEGATRON_GLM5_INDEXER_FUSED_HIST``) are read through it at each call, so a benchmark variant can set them."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in allowed:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(repr(a) for a in allowed)}")
    return raw


def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


class HostValues:
    """A few device values (integers, or the gradient norms of ``deferred_grad_checks``) read on the host later
    without a sync: copied to pinned host memory behind an event recorded on the copy's stream when made (in a
    forward), read by :meth:`get` (in its backward), by when the copy has normally long finished. Under a recompute
    that re-runs the forward inside the backward, :meth:`get` waits for the GPU to reach the just-queued copy. CPU
    values are kept as they are. Not capturable into a CUDA graph."""

    def __init__(self, values: torch.Tensor):
        values = values.reshape(-1)
        self.event: torch.cuda.Event | None = None
        if values.is_cuda:
            self.host = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(values.device))  # the copy's stream, whatever device is current
        else:
            self.host = values

    def get(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
