"""examples/lora_finetune_tiny.py runs end to end (a few steps): train adapters, export PEFT, transformers + peft
give the same logits; and with --merged, transformers on the merged checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lora_finetune_tiny.py"


def _example():
    spec = importlib.util.spec_from_file_location("lora_finetune_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("merged", [False, True], ids=["peft", "merged"])
def test_lora_example(tmp_path, model_parallel, merged):
    result = _example().main(["--out", str(tmp_path), "--steps", "2"] + (["--merged"] if merged else []))
    assert len(result["losses"]) == 2
    assert result["max_logit_diff"] <= (2e-5 if merged else 1e-5)
