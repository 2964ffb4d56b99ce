"""CPU mode is scoped: a library call (building a model, ``from_hf_pretrained``, running it) leaves ``Tensor.cuda`` and
TorchDynamo as they were; only megatron-core's CUDA queries, which would raise on this machine, answer for the CPU.
``enable_cpu_mode`` remains the explicit process-wide switch for CPU-only programs (the test session uses it, so the
library check runs in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_glm5.cpu import cpu_mode, cpu_mode_needed

pytestmark = pytest.mark.skipif(not cpu_mode_needed(), reason="CPU mode is a no-op with CUDA")
REPO = Path(__file__).resolve().parent.parent

_LIBRARY_USER = r'''
import sys, torch, torch._dynamo
from megatron_glm5 import from_hf_pretrained
from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint
cuda = torch.Tensor.cuda
model = from_hf_pretrained(write_hf_checkpoint(sys.argv[1], tiny_glm52_config(), seed=0))
assert next(model.parameters()).dtype == torch.float32, "CPU default dtype"
seen = []
model.decoder.register_forward_pre_hook(lambda *a: seen.append(torch._dynamo.config.disable))
ids = torch.randint(0, 512, (1, 40))
model.train()
model(ids, torch.arange(40)[None], None, labels=ids).sum().backward()
assert seen == [True], "megatron-core's torch.compile'd helpers must not compile on CPU inside our forward"
assert torch.Tensor.cuda is cuda and torch._dynamo.config.disable is False
try:
    torch.ones(1).cuda()
except (RuntimeError, AssertionError):
    print("LIBRARY-SCOPED OK")
'''


def test_library_calls_leave_user_cuda_and_compile_alone(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TORCHDYNAMO_DISABLE", None)
    proc = subprocess.run([sys.executable, "-c", _LIBRARY_USER, str(tmp_path / "hf")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "LIBRARY-SCOPED OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_cpu_mode_scope_restores_what_it_changed():
    import torch._dynamo

    from megatron_glm5.cpu import disable_cpu_mode, enable_cpu_mode

    disable_cpu_mode()  # the session's process-wide switch, put back below
    try:
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
    finally:
        enable_cpu_mode()
