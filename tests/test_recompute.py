"""Activation recompute x IndexShare x MTP x interleaved micro-batches gives the no-recompute gradients, and the
indexer never runs again in backward (its top-k is replayed)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

from megatron_glm5.config import parse_hf_config
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config

SEQ = 48  # > index_topk (16): DSA is sparse


@pytest.fixture
def indexer_calls(monkeypatch):
    """Count indexer forwards (test-only instrumentation)."""
    calls = [0]
    original = DSAIndexer.forward_before_topk

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DSAIndexer, "forward_before_topk", counted)
    return calls


def _grads(model, microbatches, interleaved: bool) -> dict[str, torch.Tensor]:
    """Run micro-batches forward+backward. Interleaved = fwd mb0, fwd mb1, bwd mb0, bwd mb1 (the 1F1B/VPP order
    that broke megatron-core's config-carried IndexShare holder)."""
    model.train()
    model.zero_grad(set_to_none=True)
    pos = torch.arange(SEQ)[None].expand(microbatches[0].shape[0], SEQ)
    if interleaved:
        losses = [model(ids, pos, attention_mask=None, labels=ids).sum() for ids in microbatches]
        for loss in losses:
            loss.backward()
    else:
        for ids in microbatches:
            model(ids, pos, attention_mask=None, labels=ids).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    ],
    ids=["full-uniform", "full-block", "selective-core_attn"],
)
def test_recompute_matches_and_never_reruns_indexer(model_parallel, indexer_calls, recompute):
    raw = tiny_glm52_config()  # IndexShare [full, shared, full, shared] + 1 MTP layer (full indexer)
    arch = parse_hf_config(raw)
    torch.manual_seed(0)
    reference = build_model(arch, default_cpu_policy())
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, raw["vocab_size"], (2, SEQ), generator=gen) for _ in range(2)]
    expected = _grads(reference, mbs, interleaved=False)

    model = build_model(arch, default_cpu_policy(**recompute))
    model.load_state_dict(reference.state_dict())
    indexer_calls[0] = 0
    got = _grads(model, mbs, interleaved=True)

    full_layers = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert indexer_calls[0] == full_layers * len(mbs), "the indexer must run once per full layer and micro-batch"
    assert set(got) == set(expected)
    assert not any("indexer" in n for n in got), "the indexer is frozen: the LM loss never reaches it"
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for layer in model.decoder.layers:
        assert len(layer._topk_replay) == 0, "every replayed top-k must be consumed by its recompute"


def test_full_recompute_multi_layer_chunks(model_parallel, indexer_calls):
    """Chunks of 2 layers (a full and a shared one recomputed together); MTP off (megatron-core requires
    recompute_num_layers=1 with MTP)."""
    raw = tiny_glm52_config(num_nextn_predict_layers=0)
    arch = parse_hf_config(raw)
    torch.manual_seed(0)
    reference = build_model(arch, default_cpu_policy())
    gen = torch.Generator().manual_seed(2)
    mbs = [torch.randint(0, raw["vocab_size"], (1, SEQ), generator=gen) for _ in range(3)]
    expected = _grads(reference, mbs, interleaved=False)
    model = build_model(arch, default_cpu_policy(recompute_granularity="full", recompute_method="uniform",
                                                 recompute_num_layers=2))
    model.load_state_dict(reference.state_dict())
    indexer_calls[0] = 0
    got = _grads(model, mbs, interleaved=True)
    assert indexer_calls[0] == len(arch.full_indexer_layers) * len(mbs)
    # Multi-layer chunks reassociate fp32 gradient sums (the chunk's input gradient is accumulated inside the
    # checkpoint's own backward), so compare relative to each gradient's scale.
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        err = (got[name] - expected[name]).abs().max() / scale
        assert err <= 1e-6, f"{name}: max |diff| / max |grad| = {err:.3e} > 1e-6"


def test_replay_mismatch_fails_loudly(model_parallel):
    """A replayed top-k whose fingerprint does not match the recomputed attention input is refused."""
    from megatron_glm5.layer import TopKReplay

    replay = TopKReplay()
    replay.push(torch.zeros(4, 2, dtype=torch.int32), torch.ones(3, 5))
    with pytest.raises(RuntimeError, match="replayed DSA top-k belongs to another micro-batch"):
        replay.pop(torch.full((3, 5), 2.0), layer_number=3)
    with pytest.raises(RuntimeError, match="found no top-k from the forward pass"):
        replay.pop(torch.ones(3, 5), layer_number=3)
