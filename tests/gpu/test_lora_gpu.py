"""LoRA training on the GPU (``pytest tests/gpu/test_lora_gpu.py -s``): 20 steps of the small GLM-5.2 on the
``tilelang`` backend with our TileLang kernels, megatron-core's DDP and optimizer (see tests/gpu/lora_train.py)."""

from __future__ import annotations

import pytest
from megatron_glm5.parallel import destroy_model_parallel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-adam"])
def test_lora_trains_on_tilelang_backend(distributed):
    from megatron.core import parallel_state as ps

    from tests.gpu.lora_train import run

    try:
        result = run(["--steps", "20"] + (["--distributed-optimizer"] if distributed else []))
    finally:
        if ps.model_parallel_is_initialized():
            destroy_model_parallel()
    losses = result["lora_losses"]
    assert result["base_unchanged"] and result["adapters_finite"] and result["kv_up_lora_B_trained"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.1, f"LoRA loss must fall: {losses}"
    full, lora = result["full_finetune"], result["lora"]
    assert lora["optimizer_state_bytes"] < 0.2 * full["optimizer_state_bytes"]
    # fp32 master + two Adam moments per trainable parameter (DistributedOptimizer: the same on one rank)
    assert lora["optimizer_state_bytes"] == 12 * lora["trainable_params"]
