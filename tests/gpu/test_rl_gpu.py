"""GPU checks of the RL path (the H200 machine: ``CUBLAS_WORKSPACE_CONFIG=:4096:8 pytest tests/gpu/test_rl_gpu.py -s``).

* Deterministic mode end to end: on the ``tilelang`` backend in bf16 with ``RuntimePolicy(deterministic_mode=True)``
  (deterministic sparse-MLA backward), deterministic top-k ties and
  :func:`megatron_glm5.rl.determinism.enable_deterministic_algorithms`, two runs of the same training step (log-probs
  of a packed batch longer than index_topk, a policy-gradient-like loss, backward, AdamW step, log-probs again) on
  two freshly loaded models are bitwise equal: log-probs, every gradient, every updated parameter; with and without
  indexer top-k + routing replay.
* Train-vs-rollout parity (``scripts/rl_rollout_parity_gpu.py``): a briefly trained GLM-5.2 toy, ``tilelang`` bf16 vs
  transformers bf16 as the rollout stand-in, 8K tokens: replaying the rollout's top-k and routing cuts the KL at
  least 2x. Takes about 2-3 minutes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS initialises (run the file on its own)

import pytest
import torch

pytestmark = pytest.mark.gpu
LENGTHS = (1100, 700, 300)  # index_topk of small_glm52_config is 256


def _step(path, ids, cu, adv, replay):
    from bridge import from_hf_pretrained
    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.rl import compute_logprobs

    policy = RuntimePolicy(params_dtype=torch.bfloat16, deterministic_mode=True, fusions=False,
                           perform_initialization=False)
    model = from_hf_pretrained(path, backend="tilelang", policy=policy)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kw = {} if replay is None else dict(topk_replay=replay["indexer_topk"], routing_replay=replay["routed_experts"])
    lp = compute_logprobs(model, ids, cu, **kw)
    (-(lp * adv).sum() / lp.numel()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    with torch.no_grad():
        after = compute_logprobs(model, ids, cu, **kw)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model, opt
    return lp.detach(), grads, after, params


def test_training_step_is_bitwise_reproducible(parallel, tmp_path):
    from bridge import from_hf_pretrained
    from megatron_glm5.rl.determinism import enable_deterministic_algorithms
    from megatron_glm5.rl.replay import capture_choices
    from megatron_glm5.testing import small_glm52_config, write_hf_checkpoint

    enable_deterministic_algorithms()
    raw = small_glm52_config()
    path = write_hf_checkpoint(tmp_path / "hf", raw, seed=0, dtype=torch.bfloat16, max_shard_bytes=64 << 20)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, raw["vocab_size"], (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    adv = torch.randn(ids.numel(), generator=gen).cuda()
    choices = capture_choices(from_hf_pretrained(path, backend="tilelang"), ids, cu, include_mtp=True)
    for replay in (None, choices):
        a, b = _step(path, ids, cu, adv, replay), _step(path, ids, cu, adv, replay)
        name = "replay" if replay is not None else "no replay"
        assert torch.equal(a[0], b[0]), f"{name}: log-probs differ"
        assert a[1].keys() == b[1].keys() and len(a[1]) > 50
        bad = [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]
        assert not bad, f"{name}: gradients differ: {bad[:5]}"
        assert torch.equal(a[2], b[2]), f"{name}: log-probs after the step differ"
        assert all(torch.equal(a[3][n], b[3][n]) for n in a[3]), f"{name}: updated parameters differ"
        print(f"\n[determinism {name}] {ids.numel()} tokens, {len(a[1])} gradients: bitwise equal")


def test_rollout_parity_replay_cuts_kl(parallel, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import rl_rollout_parity_gpu as script

    report = script.run(steps=300, train_seq=1024, train_batch=4, eval_tokens=8192, eval_seq=2048, lr=1e-3,
                        device="cuda", tiny=False, work=tmp_path)
    out = os.environ.get("RL_PARITY_OUT")
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print("\n[rollout parity]", json.dumps({k: report[k] for k in ("train", "replay_off", "replay_on",
                                                                  "topk_replay_only", "routing_replay_only",
                                                                  "kl_reduction", "indexer_overlap",
                                                                  "routing_mismatch", "seconds")}))
    assert report["train"]["loss_last"] < report["train"]["loss_first"] - 1.0, "the model learned the corpus"
    assert report["replay_on"]["kl"] * 2 <= report["replay_off"]["kl"], report
