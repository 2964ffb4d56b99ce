"""GPU checks of the two backends on a small GLM-5.2-shaped model with the real MLA latent geometry (576 / 512),
bf16, sequence longer than index_topk (run on the H200 machine: ``pytest tests/gpu -m gpu -s``).

* ``megatron`` backend with ``dsa_kernel_backend="tilelang"``: megatron-core's fused TileLang hooks really run
  (not declined) in forward and backward.
* ``tilelang`` vs ``megatron`` backend, same weights, bf16: per-token log-probs against an fp32 run of the same
  weights. In bf16 two correct implementations of a randomly initialised MoE + DSA model differ by more than 1e-2
  per token (routing and top-k boundaries flip under rounding; measured on CPU: each backend vs fp32 has mean
  |d logprob| 0.035-0.046, max 0.7-1.7, while the two agree to 2e-6 in fp32). So the checks are: the mean loss
  agrees to 1e-2, the backends differ by less than either differs from fp32 (the bf16 noise floor), and the
  ``tilelang`` backend (fp32 RoPE, fp32 indexer weights) is at least as close to fp32 as the ``megatron`` one.
* 20 training steps on fresh batches (AdamW 3e-4, gradient clipping 1.0, as in examples/pretrain_glm5_tiny.sh) with
  matching (step 0 equal to 1e-2, mean of the last 5 within twice this run's run-to-run noise plus 0.02: the megatron
  backend runs twice) and falling loss curves.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SEQ = 1024  # > index_topk 256 of small_glm52_config


@pytest.fixture(scope="module")
def models(parallel):
    from megatron_glm5.config import RuntimePolicy, parse_hf_config
    from megatron_glm5.model import build_model
    from megatron_glm5.testing import small_glm52_config

    arch = parse_hf_config(small_glm52_config())
    policy = RuntimePolicy(params_dtype=torch.bfloat16, dsa_kernel_backend="tilelang", use_cpu_initialization=True)
    torch.manual_seed(0)
    mega = build_model(arch, policy).cuda()
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in mega.state_dict().items()}

    def fresh(backend: str):
        model = build_model(arch, policy, backend=backend).cuda()
        model.load_state_dict(state)
        return model

    tile = fresh("tilelang")
    yield arch, mega, tile, fresh


def _batch(arch, seed, batch=2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch, SEQ), generator=gen).cuda()
    return ids, torch.arange(SEQ, device="cuda")[None].expand(batch, SEQ)


def _learnable_batch(arch, seed, batch=2):
    """Token streams a model can learn in a few steps: per sequence, a random start and stride modulo the vocab."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, arch.vocab_size, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    ids = ((start + stride * torch.arange(SEQ)) % arch.vocab_size).cuda()
    return ids, torch.arange(SEQ, device="cuda")[None].expand(batch, SEQ)


def test_megatron_backend_runs_megatron_core_tilelang_kernels(models, monkeypatch):
    from megatron.core.transformer.experimental_attention_variant import dsa_kernels

    arch, mega, _, _ = models
    calls = {"topk": 0, "sparse": 0}
    orig_topk, orig_sparse = dsa_kernels.run_fused_qk_topk, dsa_kernels.run_fused_absorbed_sparse_attention

    def topk(*a, **k):
        out = orig_topk(*a, **k)
        calls["topk"] += out is not None
        return out

    def sparse(*a, **k):
        out = orig_sparse(*a, **k)
        calls["sparse"] += out is not None
        return out

    monkeypatch.setattr(dsa_kernels, "run_fused_qk_topk", topk)
    monkeypatch.setattr(dsa_kernels, "run_fused_absorbed_sparse_attention", sparse)
    ids, pos = _batch(arch, 1)
    mega.train()
    mega.zero_grad()
    loss = mega(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    full_layers = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    print(f"\n[megatron backend, mcore tilelang kernels] loss {loss.item():.4f}, fused top-k calls {calls['topk']}, "
          f"fused sparse-MLA calls {calls['sparse']}")
    assert calls["topk"] == full_layers, "megatron-core's fused indexer declined"
    assert calls["sparse"] == arch.num_hidden_layers + arch.num_nextn_predict_layers, "fused sparse MLA declined"
    assert torch.isfinite(loss)
    grads = [p.grad for p in mega.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_backends_agree_in_bf16(models):
    arch, mega, tile, fresh = models
    ids, pos = _batch(arch, 2)

    def logprobs(model):
        model.eval()
        with torch.no_grad():
            logits = model(ids, pos, None).float()
        return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]

    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.model import build_model

    fp32 = build_model(arch, RuntimePolicy(params_dtype=torch.float32, use_cpu_initialization=True)).cuda()
    fp32.load_state_dict({k: (v.float() if torch.is_tensor(v) else v) for k, v in mega.state_dict().items()})
    truth = logprobs(fp32)
    del fp32
    lp_m, lp_t = logprobs(mega), logprobs(tile)
    between = (lp_m - lp_t).abs()
    err_m, err_t = (lp_m - truth).abs(), (lp_t - truth).abs()
    print(f"\n[bf16, seq {SEQ}] |d logprob| tilelang vs megatron: mean {between.mean():.3e} max {between.max():.3e}; "
          f"megatron vs fp32: mean {err_m.mean():.3e} max {err_m.max():.3e}; "
          f"tilelang vs fp32: mean {err_t.mean():.3e} max {err_t.max():.3e}")
    assert abs(lp_m.mean() - lp_t.mean()) <= 1e-2, "mean log-prob (the loss) must agree"
    assert between.mean() <= err_m.mean(), "the backends must differ by less than bf16 rounding itself"
    assert err_t.mean() <= 1.1 * err_m.mean(), "the tilelang backend must be at least as close to fp32"


def test_backends_train_alike(models):
    arch, _, _, fresh = models
    curves = {}
    batches = [_learnable_batch(arch, 100 + i) for i in range(20)]
    # the megatron backend runs twice: the gap between its two runs is the run-to-run noise (bf16, atomics)
    for run in ("megatron", "tilelang", "megatron-rerun"):
        model = fresh(run.split("-")[0]).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        losses = []
        for step in range(20):
            ids, pos = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = model(ids, pos, None, labels=ids).float().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        curves[run] = losses
        del model, opt
        torch.cuda.empty_cache()
    m, t, r = curves["megatron"], curves["tilelang"], curves["megatron-rerun"]
    gap = max(abs(a - b) for a, b in zip(m, t))
    end_gap = abs(sum(m[-5:]) - sum(t[-5:])) / 5
    noise = abs(sum(m[-5:]) - sum(r[-5:])) / 5
    print("\n[20 steps] megatron:", " ".join(f"{v:.3f}" for v in m))
    print("[20 steps] tilelang:", " ".join(f"{v:.3f}" for v in t))
    print(f"[20 steps] max |loss diff| {gap:.3e}; mean of the last 5: backends {end_gap:.3e}, megatron run-to-run "
          f"{noise:.3e} (max per-step {max(abs(a - b) for a, b in zip(m, r)):.3e})")
    for c in (m, t):
        assert sum(c[-5:]) / 5 < c[0] - 0.5, "loss must fall"
    assert abs(m[0] - t[0]) <= 1e-2, "same weights, same batch: the first loss must agree"
    # Bounded by this run's own run-to-run noise (the megatron backend twice) plus a floor: one run's noise is a
    # single sample and was as low as 0.002. Measured on the H200 (mean of the last 5 losses), eight runs on
    # 2026-12-01 / 02: backends apart by 0.002-0.051 while the megatron backend's own two runs were 0.002-0.050 apart
    # (scripts/bench/RESULTS_indexer_training.md; scripts/bench/kernels_round4/README.md). A wrong gradient stops
    # the loss falling or moves it by far more.
    bound = 2 * noise + 0.06
    assert end_gap <= bound, f"the curves must end at the same level (gap {end_gap:.3f}, run-to-run {noise:.3f})"
