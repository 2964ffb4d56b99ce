"""``verify`` for GLM-5.3-Flash: kept for its public names. The check itself is the one family-neutral harness,
:func:`bridge.parity.verify` (GLM-5.3-Flash's transformers side: :class:`bridge.parity_reference.GLM5NextReference`);
its report and ``ok`` rule are GLM-5's, tie analysis of the KPool pool scores included."""

from __future__ import annotations

from pathlib import Path

import torch

from .parity import default_seq_len, verify
from .parity_reference import GLM5NextReference

__all__ = ["default_seq_len", "load_hf_model", "verify_glm5_next"]


def load_hf_model(hf_path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu",
                  num_layers: int | None = None):
    """transformers' ``Glm5NextForConditionalGeneration`` (:meth:`GLM5NextReference.load`)."""
    return GLM5NextReference().load(hf_path, dtype=dtype, device=device, num_layers=num_layers)


def verify_glm5_next(**kwargs) -> dict:
    """:func:`bridge.parity.verify` (which serves every family)."""
    return verify(**kwargs)
