"""examples/rl/grpo_lora_tiny.py: three rounds of the closed GRPO + LoRA loop on CPU (transformers + peft roll out,
megatron-core trains the adapters, the adapter goes back every round). At round 1 both sides hold the same weights, so
our log-probs must equal the rollout's (fp32: KL and max |d logprob| far below 1e-4, the replayed choices the ones our
model makes); the reward must rise every round and after the last one; the last exported adapter must load in peft
with exactly the trained factors.

Only the reward counts as learning: the GRPO loss is no learning curve here (each round's first step is ~0 by
construction, and the mean over a round's steps *rose* from round 1 to round 3 in every one of seeds 0-9). Measured
rewards (round 1, 2, 3, after round 3), seeds 0-9: every sequence strictly increasing, the last at least 0.178 above
the first (seed 0: 0.111, 0.115, 0.219, 0.354; the smallest step 0.004 is seed 0's round 1 -> 2)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rl" / "grpo_lora_tiny.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_lora_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_grpo_lora_example_three_rounds(tmp_path, model_parallel):
    from safetensors.torch import load_file

    from megatron_glm5.testing import load_hf_reference_model

    result = _example().main(["--rounds", "3", "--out", str(tmp_path)])
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    first, last = rounds[0], rounds[-1]
    assert first["kl"] < 1e-4 and first["max_abs_dlogp"] < 1e-4, first
    assert first["topk_overlap"] > 0.99 and first["routing_mismatch"] < 0.01, first
    assert all(r["kl"] < 1e-4 for r in rounds), "every round: the rollout side runs the adapter just exported"
    rewards = [r["reward"] for r in rounds] + [result["final_reward"]]
    assert all(b > a for a, b in zip(rewards, rewards[1:])), f"the reward must rise every round: {rewards}"
    assert rewards[-1] - rewards[0] > 0.1, rewards

    adapter = Path(result["adapter"])
    assert adapter.name == "round3"
    with warnings.catch_warnings():  # peft 0.21 wrongly warns that the gate_up_proj rank_pattern was not used
        warnings.simplefilter("ignore")
        hf = peft.PeftModel.from_pretrained(load_hf_reference_model(result["base"]), str(adapter))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    loaded = peft.get_peft_model_state_dict(hf)
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any(t.abs().max() > 0 for k, t in saved.items() if "lora_B" in k), "the adapters were trained"
