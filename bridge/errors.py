"""Errors raised by the bridge. Every message names the file / tensor, what was expected and what was found.

The CLI turns a :class:`BridgeError` (or a :class:`~megatron_glm5.config.GLM5ConfigError`) into one ``error:`` line
and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Iterable

_MAX_LISTED = 20


class BridgeError(Exception):
    """Bad input or an unusable output location; the message says what and where."""


class CheckpointFormatError(BridgeError):
    """A file that is missing, truncated or not in the expected format."""


class TensorSetError(BridgeError):
    """The set of tensors differs from what the config and the mapping table require."""

    def __init__(self, message: str, *, missing: Iterable[str] = (), unexpected: Iterable[str] = ()):
        super().__init__(message)
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)


class ShapeMismatchError(BridgeError):
    """A tensor whose shape (or dtype) differs from what the config implies."""


class OutputExistsError(BridgeError):
    """The output directory exists and ``overwrite`` was not requested."""


def format_names(names: Iterable[str], limit: int = _MAX_LISTED) -> str:
    """``a, b, c`` (sorted), or the first ``limit`` names and a count of the rest."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
