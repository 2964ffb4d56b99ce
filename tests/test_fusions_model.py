"""The fused SwiGLU and the gather-sum MoE permutation inside a whole GLM-5.2 model (tiny, fp32, CPU, Triton's
interpreter in a subprocess): logits, loss and every parameter gradient equal the model with megatron-core's own
functions within 1e-5 of their scale, with ``SequentialMLP`` experts (``moe_grouped_gemm="off"``: megatron-core's
``MLP`` reaches the kernels through the routed functions) and with ``TorchGroupedMLP`` (``"on"``: it calls them
itself), and the kernels ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    from megatron_glm5.cpu import enable_cpu_mode
    enable_cpu_mode()
    from megatron_glm5.parallel import ensure_process_group, initialize_model_parallel
    ensure_process_group()
    initialize_model_parallel()
    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.kernels import moe_permute, swiglu
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.testing import tiny_glm52_config

    grouped = sys.argv[1]
    calls = {"swiglu": 0, "permute": 0}
    for mod, name, key in ((swiglu, "_forward", "swiglu"), (moe_permute, "gather_sum", "permute")):
        real = getattr(mod, name)
        setattr(mod, name, (lambda real, key: lambda *a: (calls.__setitem__(key, calls[key] + 1), real(*a))[1])(real, key))

    def run():
        torch.manual_seed(0)
        model = build_model(parse_hf_config(tiny_glm52_config()),
                            default_cpu_policy(fusions=True, moe_grouped_gemm=grouped))
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(24)[None].expand(2, 24)
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        with torch.no_grad():
            logits = model(ids, pos, None)
        return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    os.environ.update(MEGATRON_GLM5_FUSED_SWIGLU="0", MEGATRON_GLM5_FUSED_MOE_PERMUTE="0")
    ref = run()
    assert calls == {"swiglu": 0, "permute": 0}, calls
    os.environ.update(MEGATRON_GLM5_FUSED_SWIGLU="1", MEGATRON_GLM5_FUSED_MOE_PERMUTE="1")
    out = run()
    print(grouped, calls)
    assert calls["swiglu"] > 0 and calls["permute"] > 0, calls
    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    assert rel(out[0], ref[0]) < 1e-5 and rel(out[1], ref[1]) < 1e-5, (rel(out[0], ref[0]), rel(out[1], ref[1]))
    assert out[2].keys() == ref[2].keys() and len(ref[2]) > 20
    worst = max((rel(out[2][n], ref[2][n]), n) for n in ref[2])
    print("logits", rel(out[0], ref[0]), "worst gradient", worst)
    assert worst[0] < 1e-5, worst
    print("OK")
''')


@pytest.mark.parametrize("grouped", ["off", "on"])
def test_fusions_inside_the_model_match_megatron_core(grouped):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, grouped], env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK")
