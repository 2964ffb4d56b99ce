"""Activation recompute x IndexShare x MTP x interleaved micro-batches gives the no-recompute gradients on both
backends, the indexer never runs again in backward (its top-k is replayed), and the replay state lives and dies with
the autograd graph: forwards without a backward (RL log-prob passes under no_grad in train mode, aborted steps) leave
nothing behind."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from megatron_glm5.config import parse_hf_config
from megatron_glm5.core.layer import fingerprint, fingerprints_match
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config

SEQ = 48  # > index_topk (16): DSA is sparse
BACKENDS = ["megatron", "tilelang"]


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


def _pair(backend, recompute, **config):
    raw = tiny_glm52_config(**config)  # IndexShare [full, shared, full, shared] (+ 1 MTP layer, full indexer)
    arch = parse_hf_config(raw)
    torch.manual_seed(0)
    reference = build_model(arch, default_cpu_policy(), backend=backend)
    model = build_model(arch, default_cpu_policy(**recompute), backend=backend)
    model.load_state_dict(reference.state_dict())
    return raw, arch, reference, model


def _assert_grads_equal(got, expected, rel=1e-6):
    assert set(got) == set(expected)
    assert not any("indexer" in n for n in got), "the indexer is frozen: the LM loss never reaches it"
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        err = (got[name] - expected[name]).abs().max() / scale
        assert err <= rel, f"{name}: max |diff| / max |grad| = {err:.3e} > {rel}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    ],
    ids=["full-uniform", "full-block", "selective-core_attn"],
)
def test_recompute_matches_and_never_reruns_indexer(model_parallel, indexer_calls, recompute, backend):
    raw, arch, reference, model = _pair(backend, recompute)
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, raw["vocab_size"], (2, SEQ), generator=gen) for _ in range(2)]
    expected = _grads(reference, mbs, interleaved=False)
    indexer_calls[0] = 0
    got = _grads(model, mbs, interleaved=True)
    full_layers = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert indexer_calls[0] == full_layers * len(mbs), "the indexer must run once per full layer and micro-batch"
    _assert_grads_equal(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_recompute_multi_layer_chunks(model_parallel, indexer_calls, backend):
    """Chunks of 2 layers (a full and a shared one recomputed together); MTP off (megatron-core requires
    recompute_num_layers=1 with MTP). Multi-layer chunks reassociate fp32 gradient sums (the chunk's input gradient
    is accumulated inside the checkpoint's own backward), so gradients are compared relative to their scale."""
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    raw, arch, reference, model = _pair(backend, recompute, num_nextn_predict_layers=0)
    gen = torch.Generator().manual_seed(2)
    mbs = [torch.randint(0, raw["vocab_size"], (1, SEQ), generator=gen) for _ in range(3)]
    expected = _grads(reference, mbs, interleaved=False)
    indexer_calls[0] = 0
    got = _grads(model, mbs, interleaved=True)
    assert indexer_calls[0] == len(arch.full_indexer_layers) * len(mbs)
    _assert_grads_equal(got, expected)


def _track_topk(model) -> tuple[list, list]:
    """Weak references to every top-k tensor the full layers produce (to see what stays alive)."""
    refs, hooks = [], []
    for layer in [*model.decoder.layers, *[m.mtp_model_layer for m in model.mtp.layers]]:
        if layer.self_attention.computes_topk:
            hooks.append(layer.self_attention.register_forward_hook(
                lambda mod, args, out: refs.append(weakref.ref(out[2]))))
    return refs, hooks


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_without_backward_leaves_nothing_behind(model_parallel, indexer_calls, backend):
    """A train-mode forward under no_grad (an RL log-prob pass) and an aborted step (forward with grad, no
    backward) keep no top-k alive, and the next real step is exact and runs the indexer once per layer."""
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raw, arch, reference, model = _pair(backend, recompute)
    gen = torch.Generator().manual_seed(3)
    mbs = [torch.randint(0, raw["vocab_size"], (2, SEQ), generator=gen) for _ in range(2)]
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    model.train()
    refs, hooks = _track_topk(model)
    with torch.no_grad():  # log-prob pass in train mode
        model(mbs[0], pos, None, labels=mbs[0])
    aborted = model(mbs[1], pos, None, labels=mbs[1]).sum()  # a step that never reaches backward
    assert refs and all(r() is None for r in refs[: len(refs) // 2]), "the no-grad pass left top-k alive"
    del aborted
    gc.collect()
    assert all(r() is None for r in refs), "an aborted step's top-k outlived its graph"
    for h in hooks:
        h.remove()
    expected = _grads(reference, mbs, interleaved=False)
    indexer_calls[0] = 0
    got = _grads(model, mbs, interleaved=True)
    assert indexer_calls[0] == (len(arch.full_indexer_layers) + arch.num_nextn_predict_layers) * len(mbs)
    _assert_grads_equal(got, expected)


def test_fingerprint_tolerates_last_bit_differences_but_not_another_input():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        x = torch.randn(4, 96, 128, generator=gen).to(torch.bfloat16)
        # one bf16 ulp up or down on half of the elements: what a non-deterministic scatter_add can do
        ulp = torch.where(torch.rand(x.shape, generator=gen) < 0.5, 2.0**-7, 0.0) * torch.sign(
            torch.randn(x.shape, generator=gen))
        noisy = (x.float() * (1 + ulp)).to(torch.bfloat16)
        assert not torch.equal(noisy, x)
        assert fingerprints_match(fingerprint(noisy), fingerprint(x)), trial
        other = torch.randn(4, 96, 128, generator=gen).to(torch.bfloat16)
        assert not fingerprints_match(fingerprint(other), fingerprint(x)), trial
    small = torch.randn(5, 3, generator=gen)  # fewer elements than the sample: padded, still exact on itself
    assert fingerprints_match(fingerprint(small), fingerprint(small.clone()))
