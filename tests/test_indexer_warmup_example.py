"""``examples/indexer_warmup_tiny.py`` really teaches the indexer: re-initialised indexers of a tiny checkpoint with
peaked attention, warmed up (dense attention, indexers only), capture clearly more of the attention mass afterwards,
and the exported HF checkpoint differs from the input in indexer tensors only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _example():
    path = Path(__file__).resolve().parents[1] / "examples" / "indexer_warmup_tiny.py"
    spec = importlib.util.spec_from_file_location("indexer_warmup_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_warmup_raises_recall(tmp_path):
    result = _example().main(["--out", str(tmp_path), "--steps", "120"])
    recalls, losses = result["recalls"], result["losses"]
    first, last = sum(recalls[:10]) / 10, sum(recalls[-10:]) / 10
    assert last - first > 0.06, f"recall {first:.3f} -> {last:.3f}"  # measured: 0.60 -> 0.72
    assert sum(losses[-10:]) < sum(losses[:10])
    assert result["changed"] and all(".indexer." in n for n in result["changed"])
