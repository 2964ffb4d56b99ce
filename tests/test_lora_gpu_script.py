"""The CPU-runnable parts of tests/gpu/lora_train.py (the GPU LoRA training script): the tiny fixture in fp32 on the
``tilelang`` backend's torch path with torch AdamW: losses per step, optimizer state with and without LoRA, base
weights untouched."""

from __future__ import annotations


def test_lora_train_script_on_cpu(model_parallel, capsys):
    from tests.gpu.lora_train import run

    result = run(["--cpu", "--steps", "3", "--rank", "4", "--alpha", "8"])
    out = capsys.readouterr().out
    assert "step  3 loss" in out and out.strip().splitlines()[-1].startswith("RESULT {")
    assert len(result["lora_losses"]) == 3 and all(l == l for l in result["lora_losses"])
    assert result["base_unchanged"] and result["adapters_finite"] and result["kv_up_lora_B_trained"]
    full, lora = result["full_finetune"], result["lora"]
    assert full["trainable_params"] == full["total_params"]
    assert lora["adam_moment_bytes"] == 8 * lora["trainable_params"]  # fp32 exp_avg + exp_avg_sq
    # full fine-tuning: every parameter that gets a gradient (the indexer gets none: no state)
    assert 0.9 * 8 * full["total_params"] < full["adam_moment_bytes"] <= 8 * full["total_params"]
    assert result["optimizer_state_ratio"] < 0.1
