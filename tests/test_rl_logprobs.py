"""``megatron_glm5.rl.compute_logprobs`` against transformers (the HF reference), fp32, single process.

A packed batch of three sequences of different lengths (40, 9, 31 tokens; index_topk is 16, so two of them are really
sparse) on the tiny GLM-5.2 fixture (IndexShare + MoE + MTP), both backends: log-probs, entropies and temperature
against transformers' per-sequence log-softmax within 1e-5 (q/kv latent norm eps matched, see test_model_parity.py);
gradients of a log-prob objective against transformers' autograd (the MTP loss megatron-core attaches to every
forward with grad must contribute exactly nothing unless asked for); the forward-step function against the direct
call; the vocab-parallel log-prob / entropy function against autograd in fp64 (temperature, padded vocabulary)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import from_hf_pretrained
from megatron_glm5.rl import RolloutMicroBatch, compute_logprobs, logprobs_forward_step, vocab_parallel_logprobs
from megatron_glm5.testing import load_hf_reference_model, match_norm_eps, tiny_glm52_config, write_hf_checkpoint

LENGTHS = (40, 9, 31)
TOL = 1e-5
GRAD_RTOL = 1e-5


def packed_batch(vocab: int, lengths=LENGTHS, seed: int = 3):
    """Random sequences of ids >= 2: transformers' embedding has ``padding_idx = pad_token_id`` (1 in the fixture),
    whose row never gets a gradient there, unlike megatron-core's."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(2, vocab, (n,), generator=gen) for n in lengths]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return seqs, torch.cat(seqs), torch.tensor(cu, dtype=torch.int32)


def reference_logprobs(hf, seqs, temperature: float = 1.0):
    """transformers: per sequence, log p(next token) at every position but the last (0 there) and the entropy."""
    lps, ents = [], []
    for s in seqs:
        logp = torch.log_softmax(hf(s[None]).logits[0].float() / temperature, -1)
        lp = torch.cat([logp[:-1].gather(1, s[1:, None])[:, 0], logp.new_zeros(1)])
        ent = -(logp.exp() * logp).sum(-1)
        ent[-1] = 0
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    raw = tiny_glm52_config()
    path = write_hf_checkpoint(tmp_path_factory.mktemp("rl_glm52"), raw, seed=11)
    hf = load_hf_reference_model(path)
    match_norm_eps(hf)
    return raw, path, hf


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_packed_logprobs_and_entropy_match_transformers(checkpoint, backend, model_parallel):
    raw, path, hf = checkpoint
    seqs, ids, cu = packed_batch(raw["vocab_size"])
    model = from_hf_pretrained(path, backend=backend)
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            lp, ent = compute_logprobs(model, ids, cu, temperature=temperature, return_entropy=True)
            ref_lp, ref_ent = reference_logprobs(hf, seqs, temperature)
            assert lp.shape == ent.shape == (ids.numel(),) and lp.dtype == torch.float32
            d_lp, d_ent = (lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item()
            print(f"\n[{backend} T={temperature}] max |d logprob| {d_lp:.2e}, max |d entropy| {d_ent:.2e}")
            assert d_lp <= TOL and d_ent <= TOL
            last = cu[1:].long() - 1
            assert torch.all(lp[last] == 0) and torch.all(ent[last] == 0), "each sequence's last position is 0"
        assert compute_logprobs(model, ids, cu).requires_grad is False


def _objective_weights(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_logprob_gradients_match_transformers_and_mtp_stays_out(checkpoint, backend, model_parallel):
    """d/dparams of sum_t w_t logprob_t, ours (a model with an MTP block, in train mode) against transformers' autograd
    for every parameter transformers has; the MTP block's parameters get exactly zero gradient (megatron-core's MTP
    loss is attached with a zero mask). With ``mtp_loss_mask`` the MTP loss is added: the MTP block gets gradients, and
    so does the trunk (the MTP layer reads the decoder's hidden states, as in DeepSeek-V3)."""
    from bridge.mapping import expand

    from megatron_glm5.config import parse_hf_config

    raw, path, hf = checkpoint
    seqs, ids, cu = packed_batch(raw["vocab_size"])
    w = _objective_weights(ids.numel())
    hf.zero_grad(set_to_none=True)
    start = 0
    for s in seqs:  # the same objective, per sequence on the HF side
        logp = torch.log_softmax(hf(s[None]).logits[0].float(), -1)
        lp = logp[:-1].gather(1, s[1:, None])[:, 0]
        (lp * w[start:start + s.numel() - 1]).sum().backward()
        start += s.numel()
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)

    model = from_hf_pretrained(path, backend=backend)
    model.train()
    model.zero_grad(set_to_none=True)
    (compute_logprobs(model, ids, cu) * w).sum().backward()
    ours = {n: p.grad for n, p in model.named_parameters()}

    mtp = [n for n in ours if n.startswith("mtp.")]
    assert mtp and all(ours[n] is None or torch.count_nonzero(ours[n]) == 0 for n in mtp), "MTP must get no gradient"
    compared = 0
    for m in expand(parse_hf_config(raw), expert_layout="fused").maps:
        if m.mcore.startswith("mtp.") or ".indexer." in m.mcore or m.mcore.endswith("expert_bias"):
            continue
        parts = [theirs[r.name] if r.row is None else theirs[r.name][r.row] for r in m.hf]
        want = m.transform.to_mcore(parts)
        got = ours[m.mcore]
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        assert err <= GRAD_RTOL, f"{backend} {m.mcore}: relative gradient error {err:.2e}"
        compared += 1
    assert compared > 50

    model.zero_grad(set_to_none=True)
    (compute_logprobs(model, ids, cu, mtp_loss_mask=torch.ones(ids.numel())) * w).sum().backward()
    assert any(torch.count_nonzero(p.grad) for n, p in model.named_parameters() if n.startswith("mtp.")
               and p.grad is not None), "mtp_loss_mask trains MTP"
    decoder = "decoder.layers.0.self_attention.linear_proj.weight"
    assert not torch.equal(model.get_parameter(decoder).grad, ours[decoder]), "the MTP loss also trains the trunk"


def test_forward_step_returns_what_compute_logprobs_does(checkpoint, model_parallel):
    """``logprobs_forward_step`` as megatron-core's schedules call it (forward-only, collect_non_loss_data) and with a
    launcher loss function."""
    raw, path, _ = checkpoint
    _, ids, cu = packed_batch(raw["vocab_size"])
    model = from_hf_pretrained(path)
    with torch.no_grad():
        lp, ent = compute_logprobs(model, ids, cu, return_entropy=True)
        output, loss_func = logprobs_forward_step(iter([RolloutMicroBatch(input_ids=ids, cu_seqlens=cu)]), model,
                                                  return_entropy=True)
        data = loss_func(output, non_loss_data=True)
    assert torch.equal(data["logprobs"], lp) and torch.equal(data["entropy"], ent)
    assert data["mask"].tolist() == [i not in (39, 48, 79) for i in range(80)]

    def loss_fn(result, mb):
        tokens = result.mask.sum()
        return -(result.logprobs * mb.extra["advantages"]).sum(), tokens, {"tokens": tokens}

    adv = torch.randn(ids.numel())
    output, loss_func = logprobs_forward_step(iter([dict(input_ids=ids, cu_seqlens=cu, extra={"advantages": adv})]),
                                              model, loss_fn=loss_fn)
    loss, tokens, report = loss_func(output)
    assert tokens == 77 and torch.allclose(loss, -(lp * adv).sum(), rtol=1e-6, atol=1e-6) and loss.requires_grad


def test_vocab_parallel_logprobs_against_autograd():
    """Forward and the hand-written backward against torch's log_softmax autograd in fp64, with a temperature and a
    padded vocabulary (the padding columns take no part)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, dtype=torch.float64, generator=gen, requires_grad=True)
    target = torch.randint(0, 45, (37,), generator=gen)
    g_lp = torch.randn(37, dtype=torch.float64, generator=gen)
    g_ent = torch.randn(37, dtype=torch.float64, generator=gen)
    lp, ent = vocab_parallel_logprobs(logits, target, temperature=0.8, vocab_size=45, chunk=8)
    (lp * g_lp + ent * g_ent).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits[:, :45] / 0.8, -1)
    ref_lp = logp.gather(1, target[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    assert torch.allclose(ours, logits.grad, atol=1e-12)
    assert torch.all(ours[:, 45:] == 0)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, target, temperature=0.0)
