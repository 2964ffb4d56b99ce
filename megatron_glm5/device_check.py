"""Checks of tensor contents that must not synchronise with the host (a sync per layer stalls the launch queue).

``torch._assert_async`` fails on the device; on CUDA its message must be shorter than 255 bytes (a longer one is
itself an error, raised only when the check runs on a GPU), so :func:`check_on_device` enforces the limit on every
device, and CPU tests catch an over-long message."""

from __future__ import annotations

import torch

MAX_MESSAGE_BYTES = 254


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail (asynchronously on CUDA, at once on CPU) with ``message`` unless the bool tensor ``condition`` is True."""
    if len(message.encode()) > MAX_MESSAGE_BYTES:
        raise ValueError(f"device-check message longer than {MAX_MESSAGE_BYTES} bytes: {message!r}")
    torch._assert_async(condition, message)
