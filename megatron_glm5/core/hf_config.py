"""Reading a raw HF ``config.json``, for every family: the file, typed fields with errors that name them, and the
constants transformers hard-codes for MLA + DSA.

The raw JSON dict is read, never an in-memory transformers config (transformers rewrites geometry fields such as
``head_dim`` and may shadow ``n_routed_experts`` with ``num_experts``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

INDEXER_K_NORM_EPS = 1e-6  # hard-coded LayerNorm eps of the indexer k_norm in HF, sglang and vLLM

MISSING: Any = object()  # "no default": the field is required


class GLM5ConfigError(ValueError):
    """A ``config.json`` (or a megatron-core config) that cannot be translated; the message names the field."""


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` (or the directory holding it) as a raw dict."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF config not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise GLM5ConfigError(f"{path}: not valid JSON ({e})") from e


def natural_key(name: str) -> list[Any]:
    """Sort key that orders HF tensor names as checkpoints store them (``layers.9`` before ``layers.10``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def get_field(raw: Mapping[str, Any], name: str, typ: type | tuple[type, ...], default: Any = MISSING, *,
              family: str) -> Any:
    """``raw[name]`` checked to be a ``typ`` (an int is accepted as a float; a bool never as a number); absent or
    null gives ``default``, or an error naming the field and ``family`` when it is required."""
    value = raw.get(name, MISSING)
    if value is MISSING or value is None:
        if default is MISSING:
            raise GLM5ConfigError(f"config field '{name}' is required for a {family} config but is missing")
        return default
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and typ in (int, float):
        raise GLM5ConfigError(f"config field '{name}': expected {typ.__name__}, found bool {value!r}")
    if not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise GLM5ConfigError(f"config field '{name}': expected {names}, found {type(value).__name__} {value!r}")
    return value


def require_positive(name: str, value: int) -> int:
    if value <= 0:
        raise GLM5ConfigError(f"config field '{name}': expected a positive integer, found {value}")
    return value


class MLAGeometry:
    """Properties every MLA architecture derives the same way (mixed into each family's frozen architecture)."""

    __slots__ = ()

    @property
    def qk_head_dim(self) -> int:
        """HF ``qk_head_dim`` = nope + rope (megatron-core calls the nope part ``qk_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_fp8(self) -> bool:
        """A block-FP8 checkpoint (``quantization_config.quant_method == "fp8"``)."""
        return bool(self.quantization) and self.quantization.get("quant_method") == "fp8"
