"""Tensor transforms of the mapping table: pure functions of tensors (and shapes), no I/O.

A :class:`Transform` turns the HF tensors of one table row into the row's megatron tensor (``to_mcore``) and back
(``to_hf``), and does the same for shapes so that both converters can plan (and validate) without reading data.
Tensor parallelism is *not* a transform: the bridge always produces the *global* megatron tensor, and the
dist-checkpoint layout (or the model's sharded state dict) cuts it into each rank's piece.

* :data:`COPY` - one HF tensor is the megatron tensor.
* :data:`GATED` - HF ``gate_proj`` and ``up_proj`` are stacked into megatron's ``linear_fc1`` as ``[gate; up]``.
  That is the *global* layout: megatron-core's swiglu sharded factory stores the TP shards of gate and of up as
  separate halves, so a checkpoint's fc1 is ``[gate; up]`` at any TP and the per-rank ``[gate_r; up_r]``
  interleaving never reaches the file.
* :func:`dequantize_block_fp8` - block-FP8 ``(e4m3, weight_scale_inv)`` to a float tensor (import only).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

Shape = tuple[int, ...]


class Transform:
    """HF tensors of a row <-> the row's megatron tensor."""

    name = "transform"
    n_hf = 1

    def to_mcore(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, t: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def mcore_shape(self, hf_shapes: Sequence[Shape]) -> Shape:
        raise NotImplementedError

    def hf_shapes(self, mcore_shape: Shape) -> list[Shape]:
        raise NotImplementedError

    def hf_boxes(self, mcore_shape: Shape) -> list[tuple[Shape, Shape]] | None:
        """If each HF tensor is a box ``(offsets, sizes)`` of the megatron tensor, those boxes (export then reads
        each directly, usually one stored chunk, with no copy); None if the transform mixes values."""
        return None

    def locate(self, offsets: Shape, sizes: Shape, hf_shapes: Sequence[Shape]) -> tuple[int, Shape] | None:
        """If the megatron box ``[offsets, offsets + sizes)`` is a box of one HF tensor, ``(which, its offsets)``:
        the converter then reads just that tensor and skips building the whole megatron tensor. None otherwise."""
        return None

    def __repr__(self) -> str:
        return self.name


class _Copy(Transform):
    name = "copy"

    def to_mcore(self, parts):
        (t,) = parts
        return t

    def to_hf(self, t):
        return [t]

    def mcore_shape(self, hf_shapes):
        (s,) = hf_shapes
        return tuple(s)

    def hf_shapes(self, mcore_shape):
        return [tuple(mcore_shape)]

    def locate(self, offsets, sizes, hf_shapes):
        return 0, tuple(offsets)

    def hf_boxes(self, mcore_shape):
        return [((0,) * len(mcore_shape), tuple(mcore_shape))]


class _Gated(Transform):
    """``[gate; up]`` along dim 0."""

    name = "gated"
    n_hf = 2

    def to_mcore(self, parts):
        gate, up = parts
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
        return torch.cat([gate, up], dim=0)

    def to_hf(self, t):
        gate, up = t.chunk(2, dim=0)
        return [gate.contiguous(), up.contiguous()]

    def mcore_shape(self, hf_shapes):
        gate, up = hf_shapes
        return (gate[0] + up[0], *gate[1:])

    def hf_shapes(self, mcore_shape):
        if mcore_shape[0] % 2:
            raise ValueError(f"gated linear_fc1 must have an even number of rows, got shape {mcore_shape}")
        half = (mcore_shape[0] // 2, *mcore_shape[1:])
        return [half, half]

    def hf_boxes(self, mcore_shape):
        (gate, _), rest = self.hf_shapes(mcore_shape), (0,) * (len(mcore_shape) - 1)
        return [((0, *rest), gate), ((gate[0], *rest), gate)]

    def locate(self, offsets, sizes, hf_shapes):
        rows = hf_shapes[0][0]
        start, stop = offsets[0], offsets[0] + sizes[0]
        if stop <= rows:
            return 0, tuple(offsets)
        if start >= rows:
            return 1, (start - rows, *offsets[1:])
        return None  # the box spans gate and up


COPY: Transform = _Copy()
GATED: Transform = _Gated()


def fp8_scale_shape(shape: Shape, block: Sequence[int]) -> Shape:
    """Shape of ``weight_scale_inv`` for a block-FP8 weight of ``shape`` (last two dims are blocked)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_block_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``q [.., R, C]`` (float8) times ``scale_inv [.., ceil(R/br), ceil(C/bc)]`` broadcast over its block, computed
    in fp32 and cast to ``dtype``. Exactly ``(q.float() * scale_inv expanded).to(dtype)``."""
    br, bc = block
    *lead, rows, cols = q.shape
    expected = fp8_scale_shape(tuple(q.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
                         f"with {br}x{bc} blocks (expected {expected})")
    s = scale_inv.float()
    nbr, nbc = expected[-2:]
    w = q.float()
    if rows == nbr * br and cols == nbc * bc:  # whole blocks: broadcast without materialising the scales
        w = w.reshape(*lead, nbr, br, nbc, bc) * s.reshape(*lead, nbr, 1, nbc, 1)
        return w.reshape(q.shape).to(dtype)
    full = s.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return (w * full).to(dtype)
