"""CPU mode is scoped: building and running a model on CPU leaves ``Tensor.cuda`` and TorchDynamo as they were; only
megatron-core's CUDA queries (which would raise on this machine) answer for the CPU."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.cpu import cpu_mode, cpu_mode_needed

pytestmark = pytest.mark.skipif(not cpu_mode_needed(), reason="CPU mode is a no-op with CUDA")


def test_cpu_mode_scope_restores_tensor_cuda_and_dynamo():
    import torch._dynamo

    cuda, dynamo = torch.Tensor.cuda, torch._dynamo.config.disable
    with cpu_mode():
        assert torch.ones(1).cuda().device.type == "cpu"  # megatron-core's PP embedding sync while building
        assert torch._dynamo.config.disable
        with cpu_mode():  # re-entrant
            pass
        assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.Tensor.cuda is cuda and torch._dynamo.config.disable == dynamo
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(1).cuda()


def test_from_hf_pretrained_leaves_user_cuda_and_compile_alone(tmp_path, model_parallel):
    import torch._dynamo

    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint

    cuda, dynamo = torch.Tensor.cuda, torch._dynamo.config.disable
    model = from_hf_pretrained(write_hf_checkpoint(tmp_path, tiny_glm52_config(), seed=0))
    assert next(model.parameters()).dtype == torch.float32  # CPU default
    ids = torch.randint(0, 512, (1, 40))
    seen = []
    model.decoder.register_forward_pre_hook(lambda *a: seen.append(torch._dynamo.config.disable))
    with torch.no_grad():
        assert model(ids, torch.arange(40)[None], None).shape == (1, 40, 512)
    assert seen == [True], "megatron-core's torch.compile'd helpers must not compile on CPU inside our forward"
    assert torch.Tensor.cuda is cuda and torch._dynamo.config.disable == dynamo
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(1).cuda()
