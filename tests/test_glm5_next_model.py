"""GLM-5.3-Flash end to end on CPU (fp32) against transformers 5.24 on the same weights.

* mHC: our ``HyperConnection`` gives transformers' ``post`` / ``comb`` / collapsed input (Sinkhorn with the config's
  iterations: columns sum to 1) and mixes its output back the same way; a whole mHC decoder layer (KDA + dense MLP,
  and full-indexer DSA + MoE) equals ``Glm5NextTextDecoderLayer`` on random streams, outputs and gradients.
* The model: a checkpoint written by transformers' own ``save_pretrained`` (tiny, 4 layers: KDA / full DSA / shared
  DSA / KDA, dense and MoE, MTP layer added, vision tower present), loaded with ``from_hf_pretrained`` on both
  attention backends, gives transformers' logits within 1e-5 (relative to max(1, max |logit|); the q_a / kv_a norms
  already share ``rms_norm_eps`` in glm5_next, so no eps matching is needed) at 80 tokens (> ``index_topk`` 16, two
  KDA chunks); every parameter gradient of a linear function of the logits equals transformers' autograd within
  1e-4 relative (measured 4e-5; every single layer within 1e-5, see ``GRAD_RTOL``).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_glm5.glm5_next.config import parse_glm5_next_config
from tests.glm5_next_fixtures import CANCELLING, CANCELLING_RTOL, HIDDEN, hf_grads_as_mcore, hf_layer_state, \
    hf_text_config, load_from_hf, mcore_config, randomize, rel_diff, tiny_raw

TOL = 1e-5
# Whole-model gradients: both sides are fp32 with different summation orders through 4 layers x 2 mHC sublayers
# (logits agree to 3e-6); measured max 4.1e-5, median 2.0e-5 per parameter (about half of it from the KDA chunk's
# triangular solve vs transformers' forward substitution: 2.3e-5 with transformers' own chunk function). Each layer
# alone agrees within TOL (test_mhc_decoder_layer_matches_transformers, tests/test_glm5_next_kda.py). For scale:
# transformers' own fp32 gradients differ from its fp64 ones by up to 4e-4 on this model.
GRAD_RTOL = 1e-4
SEQ = 80
KDA, DSA = "linear_attention", "indexed_attention"
RAW = tiny_raw(layer_types=[KDA, DSA, DSA, KDA], indexer_types=["full", "full", "shared", "full"],
               mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


def _streams(b, s, seed):
    gen = torch.Generator().manual_seed(seed)
    n = 4
    return torch.randn(b, s, n, HIDDEN, generator=gen), torch.randn(b, s, n, HIDDEN, generator=gen)


def test_hyper_connection_matches_transformers(model_parallel):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    from megatron_glm5.glm5_next.mhc import HyperConnection

    hf = Glm5NextTextHyperConnection(hf_text_config(RAW))
    randomize(hf, 0)
    ours = HyperConnection(mcore_config(RAW))
    ours.load_state_dict(hf.state_dict())
    x, _ = _streams(2, 9, seed=1)
    post_w, comb_w, u_w = hf(x)
    post, comb, u = ours(x.flatten(-2))
    assert rel_diff(post, post_w) <= 1e-6 and rel_diff(comb, comb_w) <= 1e-6 and rel_diff(u, u_w) <= 1e-6
    assert (comb.sum(-2) - 1).abs().max() <= 1e-5  # Sinkhorn ends on the columns
    y = torch.randn(2, 9, HIDDEN)
    want = post_w.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_w.transpose(-1, -2), x)
    assert rel_diff(ours.merge(y, post, comb, x.flatten(-2)), want.flatten(-2)) <= 1e-6


@pytest.mark.parametrize("layer_idx,mlp", [(0, "dense"), (1, "sparse")], ids=["kda-dense", "dsa-moe"])
def test_mhc_decoder_layer_matches_transformers(model_parallel, layer_idx, mlp):
    from megatron.core.transformer.spec_utils import build_module
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

    from megatron_glm5.glm5_next.spec import build_glm5_next_layer_spec

    arch = parse_glm5_next_config(RAW)
    hf = Glm5NextTextDecoderLayer(hf_text_config(RAW), layer_idx)
    randomize(hf, 10 + layer_idx)
    if mlp == "sparse":
        with torch.no_grad():
            hf.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    config = mcore_config(RAW)
    spec = build_glm5_next_layer_spec(config, arch.layer_types[layer_idx], mlp, "full", hyper_connections=True)
    layer = build_module(spec, config=config, layer_number=layer_idx + 1)
    state = hf_layer_state(hf, "")
    filled = load_from_hf(layer, state, arch, layer_idx)
    assert set(filled) == {n for n, _ in layer.named_parameters()} | ({"mlp.router.expert_bias"} if mlp == "sparse"
                                                                     else set())
    x, g = _streams(2, 40, seed=2)
    x_hf = x.clone().requires_grad_()
    want, _ = hf(x_hf, attention_mask=torch.ones(2, 40, dtype=torch.bool))
    x_ours = x.transpose(0, 1).flatten(-2).clone().requires_grad_()
    got, _ = layer(x_ours, attention_mask=None)
    got = got.unflatten(-1, (4, HIDDEN)).transpose(0, 1)
    assert rel_diff(got, want) <= TOL
    (want * g).sum().backward()
    (got * g).sum().backward()
    assert rel_diff(x_ours.grad.unflatten(-1, (4, HIDDEN)).transpose(0, 1), x_hf.grad) <= TOL
    want_g = hf_grads_as_mcore(hf, "", arch, layer_idx)
    for name, p in layer.named_parameters():
        w = want_g[name]
        if w is None or not w.abs().max():  # the indexer has no gradient on either side
            assert p.grad is None or not p.grad.abs().max(), name
            continue
        assert ((p.grad - w).abs().max() / w.abs().max()).item() <= TOL, name


# --------------------------------------------------------------------------------------------------------------------
# the whole model from a transformers-written checkpoint
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flash_checkpoint(tmp_path_factory):
    from megatron_glm5.glm5_next.testing import write_transformers_checkpoint

    return write_transformers_checkpoint(tmp_path_factory.mktemp("flash") / "hf")


@pytest.fixture(scope="module")
def hf_model(flash_checkpoint):
    from megatron_glm5.glm5_next.testing import load_hf_reference_model

    return load_hf_reference_model(flash_checkpoint)


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, SEQ), generator=gen)
    return ids, torch.arange(SEQ)[None].expand(2, SEQ)


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_from_hf_pretrained_matches_transformers_logits(model_parallel, flash_checkpoint, hf_model, backend):
    import bridge

    raw = json.loads((flash_checkpoint / "config.json").read_text())
    arch = parse_glm5_next_config(raw)
    assert arch.num_nextn_predict_layers == 1 and arch.index_topk < SEQ and arch.vision_config is not None
    model = bridge.from_hf_pretrained(flash_checkpoint, backend=backend)
    assert model.mtp_process and len(model.decoder.layers) == 4
    ids, pos = _batch()
    with torch.no_grad():
        ours = model(ids, pos, None)
        want = hf_model(input_ids=ids).logits
    assert rel_diff(ours, want) <= TOL, f"{backend}: {rel_diff(ours, want):.2e}"


def test_gradients_match_transformers(model_parallel, flash_checkpoint, hf_model):
    """A random linear function of the logits (no MTP loss: transformers has no MTP) backpropagated on both sides: every
    parameter gradient within GRAD_RTOL of transformers' (max |diff| / max |grad|); the indexers get none on either. One
    known difference: transformers' embedding has ``padding_idx = pad_token_id``, whose row never gets a gradient;
    megatron-core's embedding has no such row (compared on the other rows)."""
    import bridge
    from bridge.glm5_next_mapping import expand_glm5_next

    raw = json.loads((flash_checkpoint / "config.json").read_text())
    arch = parse_glm5_next_config(raw)
    # megatron-core attaches the MTP loss in training even without labels: the layer-truncated load (all 4 decoder
    # layers, no MTP) compares the main model alone
    model = bridge.from_hf_pretrained(flash_checkpoint, num_layers=arch.num_hidden_layers)
    assert not model.mtp_process
    model.train()
    hf_model.zero_grad(set_to_none=True)
    ids, pos = _batch()
    ids, pos = ids[:1], pos[:1]
    weight = torch.randn(1, SEQ, arch.vocab_size, generator=torch.Generator().manual_seed(7))
    (model(ids, pos, None) * weight).sum().backward()
    (hf_model(input_ids=ids).logits * weight).sum().backward()
    hf_grads = {n: p.grad for n, p in hf_model.named_parameters()}
    exp = expand_glm5_next(arch, expert_layout="fused", mtp=False)
    checked, worst = 0, 0.0
    params = dict(model.named_parameters())
    for m in exp.maps:
        if m.mcore not in params:  # buffers (router expert bias)
            continue
        parts = [hf_grads.get(r.name) for r in m.hf]
        got = params[m.mcore].grad
        if any(p is None for p in parts):
            assert ".indexer." in m.mcore and (got is None or not got.abs().max()), m.mcore
            continue
        w = m.transform.to_mcore([p if r.row is None else p[r.row] for p, r in zip(parts, m.hf)])
        if m.mcore == "embedding.word_embeddings.weight":  # transformers' nn.Embedding(padding_idx) freezes that row
            pad = arch.pad_token_id
            assert not w[pad].abs().max() and got[pad].abs().max() > 0 and (ids == pad).any()
            keep = torch.arange(w.shape[0]) != pad
            w, got = w[keep], got[keep]
        if not w.abs().max():  # an expert no token was routed to
            assert got is None or not got.abs().max(), m.mcore
            continue
        err = ((got - w).abs().max() / w.abs().max()).item()
        assert err <= GRAD_RTOL, f"{m.mcore}: {err:.2e}"
        worst = max(worst, err)
        checked += 1
    assert checked > 100
    print(f"model gradients vs transformers: max relative error {worst:.2e} over {checked} parameters")


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1, mlp_chunks_for_training=3),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1, mlp_chunks_for_training=3, split="0"),
                                       dict(recompute_granularity="selective", recompute_modules=["mlp", "moe"])],
                         ids=["full-uniform-1", "full-mlp-chunks-3-split", "full-mlp-chunks-3-unsplit",
                              "selective-mlp-moe"])
def test_recompute_gives_the_same_gradients(model_parallel, monkeypatch, recompute):
    """Activation recompute over mHC layers (streams through megatron-core's checkpoint; KDA recomputed, DSA top-k
    replayed) gives the no-recompute gradients, with MLP chunks with and without the split recompute
    (core/split_recompute.py); recomputing the input norms is refused with the remedy."""
    from megatron_glm5 import fusions
    from megatron_glm5.model import build_model
    from megatron_glm5.glm5_next.testing import tiny_flash_config
    from megatron_glm5.model import default_cpu_policy

    recompute = dict(recompute)
    split = recompute.pop("split", "1")
    monkeypatch.setenv(fusions.SPLIT_RECOMPUTE_ENV, split)

    arch = parse_glm5_next_config({"model_type": "glm5_next", **tiny_flash_config()["text_config"]})
    torch.manual_seed(0)
    base = build_model(arch, default_cpu_policy())
    other = build_model(arch, default_cpu_policy(**recompute))
    other.load_state_dict(base.state_dict())
    ids, pos = _batch()
    grads, calls = [], []
    chunks = recompute.get("mlp_chunks_for_training", 1)
    if chunks > 1:  # every mHC layer's MLP runs its chunks in the recompute (2 of 3 with a graph only in backward)
        for layer in other.decoder.layers:
            layer.mlp.register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    for model in (base, other):
        model.train()
        model(ids, pos, None, labels=ids).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1])
    # the split runs the whole mHC MLP half in chunks: the few-element mHC / KDA parameters' gradients (scale, base,
    # A_log, dt_bias) are sums over tokens that cancel, in another order (fp64 copies: both within 6e-7), so their
    # fp32 difference relative to their own small max is noise: with torch 2.14.1 up to 1.8e-5 (an mHC scale, 3
    # elements: 2.3e-8 on a max of 1.3e-3) even unsplit (A_log: 1.4e-6); CANCELLING_RTOL covers those four, every
    # other gradient keeps its bound. Chunks without the split reorder the weight-gradient sums too (megatron-core
    # chunks the recomputed MLP): 1.2e-6 of the max for an mHC fn [4, 256] with torch 2.14.1.
    bound = 1e-5 if chunks > 1 else 1e-6
    for n, g in grads[0].items():
        limit = max(bound, CANCELLING_RTOL) if n.endswith(CANCELLING) else bound
        assert ((grads[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() <= limit, n
    if chunks > 1:  # the first pass runs each mHC layer's MLP whole (no graph); then, layer by layer in backward
        n_layers = len(other.decoder.layers)  # order: split, the 3 chunks with gradients; unsplit, the recompute's
        assert any(".mlp_hc." in n for n in grads[0])  # 2 + 1 chunks and the 2 recomputed again
        per_layer = [True, True, True] if split == "1" else [False, False, True, True, True]
        assert calls == [False] * n_layers + per_layer * n_layers, str(calls)
    with pytest.raises(NotImplementedError, match="recompute of the input layernorm"):
        build_model(arch, default_cpu_policy(recompute_granularity="selective", recompute_modules=["layernorm"]))
