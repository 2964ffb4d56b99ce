"""verify's numbers and the files outputs are made of: a cosine never above 1, adapter files with the same mode as
every other output, and scripts/setup.sh naming the installed megatron-core release."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def test_logit_cosine_is_fp64_and_never_above_one():
    """Was: verify's logit_cosine printed 1.0000019 (fp32 norms over millions of logits). Now accumulated in float64
    block by block and clamped."""
    from bridge.metrics import logit_cosine

    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 4096, generator=g) * 8
    b = a + 1e-6 * torch.randn(a.shape, generator=g)
    fp32 = F.cosine_similarity(a.reshape(1, -1), b.reshape(1, -1)).item()
    assert fp32 > 1.0  # the old computation
    exact = F.cosine_similarity(a.reshape(1, -1).double(), b.reshape(1, -1).double()).item()
    got = logit_cosine(a, b, rows=100)
    assert got <= 1.0 and abs(got - exact) < 1e-12
    assert logit_cosine(a, a) == 1.0 and logit_cosine(a, -a) == -1.0
    assert logit_cosine(a.bfloat16(), b.bfloat16()) <= 1.0


def test_adapter_weights_have_the_mode_of_every_other_output(tmp_path):
    """Was: adapter_model.safetensors 0600 (safetensors' save_file) while config.json and checkpoints are 0644."""
    from bridge.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft_dir, write_peft_dir

    old = os.umask(0o022)
    try:
        out = write_peft_dir(tmp_path / "adapter", {"a.lora_A.weight": torch.ones(2, 3)}, {"r": 2, "lora_alpha": 4})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if not p.name.startswith(".")}
    assert modes == {ADAPTER_WEIGHTS: 0o644, ADAPTER_CONFIG: 0o644}, {k: oct(v) for k, v in modes.items()}
    tensors, _ = read_peft_dir(out)
    assert torch.equal(tensors["a.lora_A.weight"], torch.ones(2, 3))
    old = os.umask(0o077)  # the umask is respected, as for the other files
    try:
        out = write_peft_dir(tmp_path / "private", {"a.lora_A.weight": torch.ones(2, 3)}, {"r": 2, "lora_alpha": 4})
    finally:
        os.umask(old)
    assert stat.S_IMODE((out / ADAPTER_WEIGHTS).stat().st_mode) == 0o600


def test_setup_script_prints_the_installed_megatron_core_release():
    """Was: `megatron-core 0.19.2+684862f` (megatron-core appends the git hash of the checkout it is imported from).
    The version line of scripts/setup.sh, run in this checkout's .venv, prints the installed distribution's version."""
    from importlib.metadata import version

    lines = [line for line in (REPO / "scripts" / "setup.sh").read_text().splitlines() if "megatron-glm5 ready" in line]
    assert len(lines) == 1, lines
    proc = subprocess.run(["bash", "-c", lines[0]], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()[-1]
    assert f"megatron-core {version('megatron-core')} |" in out and "+" not in out, out
