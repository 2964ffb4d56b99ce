"""Extension points of the DSA attention: the features built above it (LoRA, activation offload) install their
behaviour here, so the attention reads a linear's weight and marks its top-k without importing either feature.

* :func:`linear_weight`: the weight a linear computes with. LoRA (:mod:`megatron_glm5.lora_layers`) installs a reader
  that adds the adapter's delta; without one it is ``module.weight``.
* :func:`mark_replicated`: declare a tensor identical on every rank of a process group (the DSA top-k over TP).
  Activation offload (:mod:`megatron_glm5.offload`) installs the marker that keeps one share per rank on the host;
  without one it does nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

WeightReader = Callable[[torch.nn.Module], Optional[torch.Tensor]]  # None: not mine, ask the next reader
ReplicatedMarker = Callable[[torch.Tensor, Any], None]

_weight_readers: list[WeightReader] = []
_replicated_markers: list[ReplicatedMarker] = []


def install_weight_reader(reader: WeightReader) -> None:
    if reader not in _weight_readers:
        _weight_readers.append(reader)


def install_replicated_marker(marker: ReplicatedMarker) -> None:
    if marker not in _replicated_markers:
        _replicated_markers.append(marker)


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight ``module`` computes with, for code that reads it instead of calling the module (absorbed MLA's
    ``W_kc`` / ``W_vc``, the ``tilelang`` indexer's fp32 ``weights_proj``)."""
    for reader in _weight_readers:
        weight = reader(module)
        if weight is not None:
            return weight
    return module.weight


def mark_replicated(tensor: torch.Tensor, group: Any) -> None:
    """``tensor`` is the same on every rank of ``group`` (called before anything saves it)."""
    for marker in _replicated_markers:
        marker(tensor, group)
