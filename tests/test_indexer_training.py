"""Indexer training in the model (``megatron_glm5.dsa.indexer_training``), both backends: the sparse and dense losses
reach exactly the indexer parameters and leave every other gradient unchanged, the loss is logged per loss-computing
layer (full layers + MTP) in megatron-core's tracker and scaled by its auto-scaler, activation recompute computes it
once per full layer and micro-batch with unchanged gradients, and the warm-up trains only the indexers with dense
main attention."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerLossAutoScaler,
    DSAIndexerLossLoggingHelper,
)

from megatron_glm5.config import GLM5ConfigError, parse_hf_config
from megatron_glm5.dsa import indexer_parameters
from megatron_glm5.dsa.indexer_training import RECALL, loss_slots
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config

SEQ = 48  # > index_topk (16): DSA is sparse
BACKENDS = ["megatron", "tilelang"]
SPARSE = dict(dsa_indexer_loss_coeff=0.1, dsa_indexer_use_sparse_loss=True)
DENSE = dict(dsa_indexer_loss_coeff=0.1)


@pytest.fixture(autouse=True)
def clean_tracker():
    DSAIndexerLossLoggingHelper.tracker.clear()
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    RECALL.take()
    yield
    DSAIndexerLossLoggingHelper.tracker.clear()
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None


def _model(backend, **policy):
    raw = tiny_glm52_config()  # IndexShare [full, shared, full, shared] + 1 MTP layer (full)
    arch = parse_hf_config(raw)
    torch.manual_seed(0)
    return raw, arch, build_model(arch, default_cpu_policy(**policy), backend=backend)


def _batches(raw, n=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, raw["vocab_size"], (2, SEQ), generator=gen) for _ in range(n)]


def _run(model, batches, interleaved=False):
    model.train()
    model.zero_grad(set_to_none=True)
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    if interleaved:
        losses = [model(ids, pos, attention_mask=None, labels=ids).sum() for ids in batches]
        for loss in losses:
            loss.backward()
    else:
        for ids in batches:
            model(ids, pos, attention_mask=None, labels=ids).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", [SPARSE, DENSE], ids=["sparse", "dense"])
def test_loss_trains_only_the_indexer(model_parallel, indexer_loss_calls, backend, loss):
    raw, arch, frozen = _model(backend)
    _, _, model = _model(backend, **loss)
    model.load_state_dict(frozen.state_dict())
    batches = _batches(raw)
    base = _run(frozen, batches)
    got = _run(model, batches)
    indexer = {n for n in got if ".indexer." in n}
    n_full = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert indexer_loss_calls[0] == n_full * len(batches)
    assert len(indexer) == 5 * n_full  # wq_b, wk, k_norm weight + bias, weights_proj of each full layer and MTP
    assert all(got[n].abs().max() > 0 for n in indexer)
    assert set(got) - indexer == set(base)
    for n in base:  # the LM loss's gradients are untouched (the auto-scaler is an identity in forward)
        assert torch.equal(got[n], base[n]), n
    values = DSAIndexerLossLoggingHelper.tracker["values"]
    assert values.shape == (n_full,) and (values > 0).all()
    assert {p for p in indexer_parameters(model)} == {p for n, p in model.named_parameters() if ".indexer." in n}


@pytest.mark.parametrize("loss", [SPARSE, DENSE], ids=["sparse", "dense"])
def test_backends_agree(model_parallel, loss):
    """Same parameters, fp32: both backends' torch paths give the same indexer loss and gradients."""
    raw, _, meg = _model("megatron", **loss)
    _, _, til = _model("tilelang", **loss)
    til.load_state_dict(meg.state_dict())
    batches = _batches(raw, n=1)
    g_meg = _run(meg, batches)
    v_meg = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    g_til = _run(til, batches)
    torch.testing.assert_close(DSAIndexerLossLoggingHelper.tracker["values"], v_meg, rtol=1e-5, atol=0)
    for n in (n for n in g_meg if ".indexer." in n):
        scale = g_meg[n].abs().max()
        assert (g_til[n] - g_meg[n]).abs().max() <= 1e-4 * scale, n


def test_autoscaler_scales_the_indexer_gradient(model_parallel):
    """The schedules' main-loss scale multiplies the indexer loss's gradient (and nothing else)."""
    raw, _, model = _model("megatron", **SPARSE)
    batches = _batches(raw, n=1)
    g1 = _run(model, batches)
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    g2 = _run(model, batches)
    for n in g1:
        if ".indexer." in n:
            torch.testing.assert_close(g2[n], 0.25 * g1[n], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "recompute",
    [dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     dict(recompute_granularity="selective", recompute_modules=["core_attn"])],
    ids=["full-uniform", "selective-core_attn"],
)
def test_recompute_computes_the_loss_once(model_parallel, indexer_loss_calls, backend, recompute):
    raw, arch, reference = _model(backend, **SPARSE)
    _, _, model = _model(backend, **SPARSE, **recompute)
    model.load_state_dict(reference.state_dict())
    batches = _batches(raw)
    expected = _run(reference, batches)
    expected_values = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    indexer_loss_calls[0] = 0
    got = _run(model, batches, interleaved=True)
    n_full = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert indexer_loss_calls[0] == n_full * len(batches), "the loss is computed once per full layer and micro-batch"
    torch.testing.assert_close(DSAIndexerLossLoggingHelper.tracker["values"], expected_values, rtol=1e-6, atol=0)
    assert set(got) == set(expected)
    for n in expected:
        scale = expected[n].abs().max().clamp_min(1e-12)
        assert (got[n] - expected[n]).abs().max() <= 1e-6 * scale, n


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_trains_only_indexers_with_dense_attention(model_parallel, backend):
    raw, arch, model = _model(backend, dsa_indexer_warmup=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".indexer." in n for n in trainable)
    grads = _run(model, _batches(raw, n=1))
    assert set(grads) == trainable and all(g.abs().max() > 0 for g in grads.values())
    recall = RECALL.take()
    n_full = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert sorted(recall) == list(range(n_full))
    assert all(0 < c <= b <= 1 for c, b in recall.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_attention_is_dense(model_parallel, backend):
    """With index_topk >= the sequence, sparse attention selects every causal key: the warm-up's dense attention
    must give the same logits as the sparse model (same parameters)."""
    raw = tiny_glm52_config(index_topk=64)
    arch = parse_hf_config(raw)
    torch.manual_seed(0)
    sparse = build_model(arch, default_cpu_policy(), backend=backend)
    warm = build_model(arch, default_cpu_policy(dsa_indexer_warmup=True), backend=backend)
    warm.load_state_dict(sparse.state_dict())
    ids = _batches(raw, n=1)[0]
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    with torch.no_grad():
        a = sparse.eval()(ids, pos, attention_mask=None)
        b = warm.eval()(ids, pos, attention_mask=None)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_loss_slots_cover_full_layers_and_mtp():
    slots, mtp = loss_slots(("full", "shared", "full", "full", "shared"), 2)
    assert {k: (v.index, v.count) for k, v in slots.items()} == {0: (0, 5), 2: (1, 5), 3: (2, 5)}
    assert [(s.index, s.count) for s in mtp] == [(3, 5), (4, 5)]


def test_bad_settings_are_refused(model_parallel):
    from megatron_glm5.config import RuntimePolicy

    with pytest.raises(ValueError, match="dense loss"):
        RuntimePolicy(dsa_indexer_warmup=True, dsa_indexer_use_sparse_loss=True)
    raw = tiny_glm52_config()
    arch = parse_hf_config(raw)
    from megatron_glm5.config import build_transformer_config
    from megatron_glm5.spec import get_glm5_warmup_spec

    config = build_transformer_config(arch, default_cpu_policy())  # no loss coefficient
    with pytest.raises(GLM5ConfigError, match="--dsa-indexer-loss-coeff"):
        get_glm5_warmup_spec(config)


def test_glm5_next_refuses_the_loss(model_parallel):
    from megatron_glm5.architectures import parse_architecture
    from megatron_glm5.glm5_next.testing import tiny_flash_config

    arch = parse_architecture({"model_type": "glm5_next", **tiny_flash_config()["text_config"]})
    with pytest.raises(NotImplementedError, match="indexer loss"):
        build_model(arch, default_cpu_policy(**SPARSE))


def test_warmup_spec_freezes_a_model_built_by_someone_else(model_parallel, capsys):
    """Megatron-LM's ``pretrain_gpt.py --spec ... get_glm5_warmup_spec`` builds the GPTModel itself: parameters
    registered after the spec call are frozen except the indexers', until the first warm-up forward disarms it."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_glm5.config import build_transformer_config, gpt_model_kwargs
    from megatron_glm5.cpu import cpu_mode
    from megatron_glm5.dsa.indexer_training import warmup_freeze
    from megatron_glm5.spec import get_glm5_warmup_spec

    raw = tiny_glm52_config(num_nextn_predict_layers=0)
    arch = parse_hf_config(raw)
    config = build_transformer_config(arch, default_cpu_policy(dsa_indexer_loss_coeff=1.0))
    spec = get_glm5_warmup_spec(config)
    assert warmup_freeze.armed
    try:
        with cpu_mode():
            model = GPTModel(config=config, transformer_layer_spec=spec, **gpt_model_kwargs(arch))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {n for n, _ in model.named_parameters() if ".indexer." in n} and trainable
        _run(model, _batches(raw, n=1))
        assert not warmup_freeze.armed
        assert "parameter tensors train (the indexers)" in capsys.readouterr().out
        torch.nn.Linear(2, 2)  # disarmed: later modules are left alone
        assert all(p.requires_grad for p in torch.nn.Linear(2, 2).parameters())
    finally:
        warmup_freeze.disarm()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", [SPARSE, DENSE], ids=["sparse", "dense"])
def test_thd_packed_loss_is_the_row_weighted_mean_of_the_sequences(model_parallel, backend, loss):
    """THD packing (documents never see each other): the logged loss of a packed batch is the mean over all its rows,
    i.e. the row-weighted mean of the sequences' own losses."""
    from megatron.core.packed_seq_params import PackedSeqParams

    raw, arch, model = _model(backend, **loss)
    model.train()
    lens = [40, 9, 31]  # one sequence shorter than index_topk (16)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, raw["vocab_size"], (n,), generator=gen) for n in lens]
    n_full = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers

    def logged(ids, psp=None):
        DSAIndexerLossLoggingHelper.tracker.clear()
        pos = torch.cat([torch.arange(len(s)) for s in ids]) if psp else torch.arange(ids[0].numel())
        model(torch.cat(ids)[None], pos[None], None, labels=torch.cat(ids)[None], packed_seq_params=psp).sum().backward()
        return DSAIndexerLossLoggingHelper.tracker["values"].clone()

    cu = torch.tensor([0, 40, 49, 80], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40, max_seqlen_kv=40)
    packed = logged(seqs, psp)
    alone = [logged([s]) for s in seqs]
    expected = sum(n * v for n, v in zip(lens, alone)) / sum(lens)
    assert packed.shape == (n_full,)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-9)


@pytest.fixture
def loss_after_attention(monkeypatch):
    """Force the tilelang backend's sparse loss into the backward (``loss_after_attention``) on CPU too."""
    from megatron_glm5.dsa.tilelang_attention import TileLangSparseAttention

    def force(on: bool):
        monkeypatch.setattr(TileLangSparseAttention, "loss_after_attention", on)

    return force


@pytest.mark.parametrize("recompute", [{}, dict(recompute_granularity="full", recompute_method="uniform",
                                                 recompute_num_layers=1)], ids=["plain", "full-recompute"])
def test_loss_after_attention_equals_the_loss_in_forward(model_parallel, monkeypatch, loss_after_attention, recompute):
    """The sparse loss computed in the backward (target from the attention's backward, here its torch fallback) gives
    the same logged values and the same gradients of every parameter as the loss attached in the forward, the
    schedules' loss scale included; under full recompute it is logged once per full layer and micro-batch."""
    raw, arch, reference = _model("tilelang", **SPARSE)
    _, _, model = _model("tilelang", **SPARSE, **recompute)
    model.load_state_dict(reference.state_dict())
    batches = _batches(raw)
    loss_after_attention(False)
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    expected = _run(reference, batches)
    expected_values = DSAIndexerLossLoggingHelper.tracker["values"].clone()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    loss_after_attention(True)
    from megatron_glm5.dsa.attention import DSACoreAttention
    from tests.instrument import count_calls

    logged_in_backward = [0]
    count_calls(monkeypatch, logged_in_backward, DSACoreAttention, "log_loss")
    got = _run(model, batches, interleaved=True)
    n_full = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert logged_in_backward[0] == n_full * len(batches), "computed in the backward, once per layer and micro-batch"
    assert expected_values.shape == (n_full,) and (expected_values > 0).all()
    torch.testing.assert_close(DSAIndexerLossLoggingHelper.tracker["values"], expected_values, rtol=1e-6, atol=0)
    assert set(got) == set(expected)
    for n in expected:
        scale = expected[n].abs().max().clamp_min(1e-12)
        assert (got[n] - expected[n]).abs().max() <= 1e-6 * scale, n
