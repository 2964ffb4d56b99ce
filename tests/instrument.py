"""Test-only instrumentation: count calls of a method (fixtures in conftest.py and the test modules use it)."""

from __future__ import annotations

from typing import Callable, Optional


def count_calls(monkeypatch, calls: list[int], cls, name: str,
                when: Optional[Callable[..., bool]] = None) -> None:
    """Patch ``cls.name`` so that each call adds 1 to ``calls[0]`` (only those where ``when(*args, **kwargs)``)."""
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        if when is None or when(*args, **kwargs):
            calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
