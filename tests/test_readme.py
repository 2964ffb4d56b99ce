"""Every fenced ```python block of README.md runs as written, in order, in one fresh process, on the tiny GLM-5.2
fixture standing in for the local checkpoint directory ``GLM-5.2`` (so the README cannot drift again: the LoRA
quick-start once raised on ``export_peft_adapter``).

A block may only use names it defines, except what comes from a rollout engine, which the RL block says it takes
from outside: ``seqs`` (each rollout's token ids) and ``outs`` (the engine's results, sglang's format: base64 int32
``meta_info["indexer_topk"]`` / ``["routed_experts"]``, token-major, no row for the last token), made here from our
own model's choices."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)

_RUNNER = r'''
import base64, json, sys, time
import torch

blocks = json.load(open(sys.argv[1]))
engine = {}


def rollout_engine():
    """seqs / outs as a rollout engine returns them (sglang's base64 meta_info), from our own model's choices."""
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.parallel import initialize_model_parallel
    from megatron_glm5.rl.replay import capture_choices
    from tests.test_rl_logprobs import packed_batch

    initialize_model_parallel()
    model = from_hf_pretrained("GLM-5.2")
    seqs, ids, cu = packed_batch(model.vocab_size)
    choices = capture_choices(model, ids, cu)
    cu = cu.tolist()

    def enc(x, a, b):
        return base64.b64encode(x[:, a:b - 1].permute(1, 0, 2).contiguous().numpy().tobytes()).decode()

    outs = [{"meta_info": {"indexer_topk": enc(choices["indexer_topk"], a, b),
                           "routed_experts": enc(choices["routed_experts"], a, b)}} for a, b in zip(cu, cu[1:])]
    return {"seqs": [s.tolist() for s in seqs], "outs": outs}


for line, code in blocks:
    namespace = {"__name__": "__readme__"}
    if "outs" in code:
        engine = engine or rollout_engine()
        namespace.update(engine)
    t0 = time.perf_counter()
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    print(f"README.md:{line} ok in {time.perf_counter() - t0:.1f} s", flush=True)
'''


def readme_blocks() -> list[tuple[int, str]]:
    text = (REPO / "README.md").read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_readme_has_python_blocks_that_use_local_directories():
    blocks = readme_blocks()
    assert len(blocks) >= 4, [line for line, _ in blocks]
    for line, code in blocks:
        statements = "\n".join(row.split("#")[0] for row in code.splitlines())  # comments may elide
        assert "/path/to" not in code and "..." not in statements, f"README.md:{line}: a placeholder"


def test_every_readme_python_block_runs(tmp_path):
    from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint

    write_hf_checkpoint(tmp_path / "GLM-5.2", tiny_glm52_config(), seed=0)
    blocks = readme_blocks()
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    done = [line for line in proc.stdout.splitlines() if line.startswith("README.md:")]
    assert len(done) == len(blocks), proc.stdout
    print("\n" + "\n".join(done))
    # what the blocks promise: a PEFT adapter peft can read, merged and converted checkpoints, all marked outputs
    from bridge.adapters import read_peft_dir
    from bridge.output import read_marker

    tensors, config = read_peft_dir(tmp_path / "adapter")
    assert tensors and config["target_parameters"] == ["gate_up_proj", "down_proj"]
    for out in ("adapter", "GLM-5.2-lora", "GLM-5.2-trained", "glm52_mcore", "GLM-5.2-out"):
        assert read_marker(tmp_path / out) is not None, out
