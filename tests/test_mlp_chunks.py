"""The MLP recomputed in sequence chunks inside full-layer recompute (megatron_glm5.core.mlp_chunks), with and without
the recompute split at the attention / MLP boundary (megatron_glm5.core.split_recompute): gradients and the
expert-bias token counts equal the unchunked recompute's, each parameter's gradient is accumulated once per backward
(megatron-core DDP's hook contract), the MLP and the attention run the expected number of times with and without a
graph and in the expected order, the split is used only where the recomputed output is never read, and settings whose
math depends on the whole sequence are refused."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import fusions
from megatron_glm5.config import parse_hf_config
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config

SEQ = 48
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.fixture(params=["split", "unsplit"])
def split(request, monkeypatch):
    """MEGATRON_GLM5_SPLIT_RECOMPUTE on (the default) and off; read when the layers are built."""
    monkeypatch.setenv(fusions.SPLIT_RECOMPUTE_ENV, "1" if request.param == "split" else "0")
    return request.param == "split"


def _build(chunks: int, backend: str = "tilelang", **policy):
    arch = parse_hf_config(tiny_glm52_config())  # dense first layer, MoE after it, 1 MTP layer
    torch.manual_seed(0)
    return arch, build_model(arch, default_cpu_policy(**{**FULL, **policy}, mlp_chunks_for_training=chunks),
                             backend=backend)


def _step(model, seed: int, seq: int = SEQ):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, seq), generator=gen)
    pos = torch.arange(seq)[None].expand(2, seq)
    loss = model(ids, pos, attention_mask=None, labels=ids).sum()
    loss.backward()
    return loss.detach()


def _assert_grads_close(model, reference, rtol: float = 1e-5) -> None:
    """Every gradient of ``model`` within ``rtol`` (of its largest element) of ``reference``'s."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            err = (p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)
            assert err <= rtol, f"{name}: {err:.2e}"


def _routers(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.router")]


@pytest.mark.parametrize("chunks,seq", [(2, SEQ), (3, SEQ), (4, 47)], ids=["2", "3", "4-uneven"])
@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_chunked_recompute_matches_unchunked(model_parallel, split, chunks, seq, backend):
    _, reference = _build(1, backend)
    _, model = _build(chunks, backend)
    model.load_state_dict(reference.state_dict())
    for m in (reference, model):
        m.train()
        m.zero_grad(set_to_none=True)
    assert torch.equal(_step(reference, 1, seq), _step(model, 1, seq))
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and any(".mlp.experts." in n for n in got)
    for name, g in expected.items():
        err = (got[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err <= 1e-5, f"{name}: {err:.2e}"
    counts = [(r.local_tokens_per_expert.clone(), m.local_tokens_per_expert)
              for r, m in zip(_routers(reference), _routers(model))]
    assert counts and all(torch.equal(a, b) for a, b in counts), "expert-bias token counts differ"
    assert all(int(a.sum()) > 0 for a, _ in counts)


def test_block_recompute_method(model_parallel, split):
    """recompute_method="block" checkpoints one layer per chunk too: same gradients with chunks (split or not)."""
    _, reference = _build(1, recompute_method="block", recompute_num_layers=4)
    _, model = _build(2, recompute_method="block", recompute_num_layers=4)
    model.load_state_dict(reference.state_dict())
    for m in (reference, model):
        m.train()
    torch.testing.assert_close(_step(model, 8), _step(reference, 8), rtol=1e-6, atol=0)
    _assert_grads_close(model, reference)


@pytest.mark.parametrize("chunks,seq,sizes", [(3, SEQ, [16, 16, 16]), (4, 46, [12, 12, 12, 10])])
def test_each_gradient_accumulated_once_and_mlp_call_count(model_parallel, split, chunks, seq, sizes):
    """The recompute runs torch.chunk's pieces, the ones megatron-core's own branch ran in the first pass."""
    arch, model = _build(chunks)
    model.train()
    accumulated: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.__setitem__(
            name, accumulated.get(name, 0) + 1))
    layer = model.decoder.layers[1]  # an MoE layer
    mtp_layer = model.mtp.layers[0].mtp_model_layer
    calls, mtp_calls = [], []
    layer.mlp.register_forward_pre_hook(lambda mod, args: calls.append(("mlp", args[0].shape[0],
                                                                        torch.is_grad_enabled())))
    layer.self_attention.register_forward_pre_hook(lambda mod, args: calls.append(("attn", torch.is_grad_enabled())))
    mtp_layer.mlp.register_forward_pre_hook(lambda mod, args: mtp_calls.append((args[0].shape[0],
                                                                                torch.is_grad_enabled())))
    _step(model, 2, seq)
    assert accumulated and set(accumulated.values()) == {1}, "a parameter's gradient was accumulated twice"
    first_pass = [("attn", False)] + [("mlp", s, False) for s in sizes]  # megatron-core's chunks, no graph
    if split:
        # recompute: no graph and no MLP run; backward: every chunk with gradients, then the attention half
        assert calls == first_pass + [("mlp", s, True) for s in sizes] + [("attn", True)]
    else:
        # recompute: the attention, n - 1 chunks without a graph, the last with one; backward: the n - 1 first
        # chunks again with gradients
        assert calls == first_pass + [("attn", True)] + [("mlp", s, False) for s in sizes[:-1]] \
            + [("mlp", sizes[-1], True)] + [("mlp", s, True) for s in sizes[:-1]]
    # the MTP layer's checkpoint is not a block chunk: never split
    assert mtp_calls == [(s, False) for s in sizes] + [(s, False) for s in sizes[:-1]] + [(sizes[-1], True)] \
        + [(s, True) for s in sizes[:-1]]


def test_split_only_for_the_last_layer_of_a_checkpoint_chunk(model_parallel, split):
    """With two layers per checkpoint the first layer's recomputed output feeds the second: it is recomputed as
    without the split, and only the chunk's last layer is split. Gradients equal the unchunked recompute's."""
    raw = tiny_glm52_config(num_nextn_predict_layers=0)  # megatron-core requires recompute_num_layers=1 with MTP
    arch = parse_hf_config(raw)
    models = []
    for chunks in (1, 3):
        torch.manual_seed(0)
        models.append(build_model(arch, default_cpu_policy(**{**FULL, "recompute_num_layers": 2},
                                                           mlp_chunks_for_training=chunks), backend="tilelang"))
    reference, model = models
    model.load_state_dict(reference.state_dict())
    assert len(model.decoder.layers) == 4
    runs: dict[int, list] = {}
    for layer in model.decoder.layers:
        layer.mlp.register_forward_pre_hook(
            lambda mod, args, n=layer.layer_number: runs.setdefault(n, []).append(torch.is_grad_enabled()))
    for m in (reference, model):
        m.train()
    # the first pass's MLP GEMMs run in chunks here (megatron-core's branch): the loss may move in the last bit
    torch.testing.assert_close(_step(model, 4), _step(reference, 4), rtol=1e-6, atol=0)
    _assert_grads_close(model, reference)
    # chunk's first layer (1, 3): 3 first-pass chunks, 2 without a graph and 1 with one in the recompute, 2 again
    # in the backward; the chunk's last layer (2, 4), split: 3 first-pass chunks, 3 with gradients in the backward
    unsplit = [False] * 3 + [False, False, True] + [True] * 2
    for number in (1, 3):
        assert runs[number] == unsplit, number
    for number in (2, 4):
        assert runs[number] == ([False] * 3 + [True] * 3 if split else unsplit), number


def test_chunks_by_length_is_the_default(model_parallel, monkeypatch):
    """Without the switch in the environment the layers count chunks by length (the test session forces it off)."""
    monkeypatch.delenv(fusions.MLP_CHUNKS_BY_LENGTH_ENV)
    _, model = _build(4)
    assert all(layer.chunks_by_length for layer in model.decoder.layers)


@pytest.mark.parametrize("min_tokens,sizes", [(32, [16, 16, 16]), (1000, [48])], ids=["3-of-4", "1-of-4"])
def test_chunks_by_length(model_parallel, monkeypatch, min_tokens, sizes):
    """MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH: at most one chunk per MIN_CHUNK_TOKENS tokens (2 x 48 here), in the first
    pass and in the split's backward alike; gradients unchanged."""
    from megatron_glm5.core import split_recompute

    monkeypatch.setenv(fusions.MLP_CHUNKS_BY_LENGTH_ENV, "1")
    monkeypatch.setattr(split_recompute, "MIN_CHUNK_TOKENS", min_tokens)
    _, reference = _build(1)
    _, model = _build(4)
    model.load_state_dict(reference.state_dict())
    calls = []
    model.decoder.layers[1].mlp.register_forward_pre_hook(
        lambda mod, args: calls.append((args[0].shape[0], torch.is_grad_enabled())))
    for m in (reference, model):
        m.train()
    torch.testing.assert_close(_step(model, 6), _step(reference, 6), rtol=1e-6, atol=0)
    assert calls == [(s, False) for s in sizes] + [(s, True) for s in sizes]
    _assert_grads_close(model, reference)


@pytest.mark.parametrize("where", ["hidden_dropout", "mlp_dropout"])
def test_no_split_with_dropout(model_parallel, split, where):
    """Dropout's random streams would move between the halves and the chunks recomputed in the backward (outside the
    checkpoint's RNG restore): a layer with hidden dropout recomputes unsplit; one with a dropout inside its MLP (as
    LoRA attaches after the build) runs megatron-core's branch, every chunk with its graph in the recompute."""
    _, model = _build(2)
    layer = model.decoder.layers[1]
    if where == "hidden_dropout":
        layer.hidden_dropout = 0.1  # the bias-dropout-add's probability (the config's was read at the build)
    else:
        layer.mlp.lora_like_dropout = torch.nn.Dropout(0.1)  # registered, never called: only its presence counts
    calls = []
    layer.mlp.register_forward_pre_hook(lambda mod, args: calls.append(("mlp", torch.is_grad_enabled())))
    layer.self_attention.register_forward_pre_hook(lambda mod, args: calls.append(("attn", torch.is_grad_enabled())))
    model.train()
    _step(model, 5)
    first = [("attn", False), ("mlp", False), ("mlp", False)]
    if where == "hidden_dropout":  # round 4's chunked recompute
        assert calls == first + [("attn", True), ("mlp", False), ("mlp", True), ("mlp", True)]
    else:
        assert calls == first + [("attn", True), ("mlp", True), ("mlp", True)]


def test_mlp_gradients_reach_ddp_before_the_attention_half_is_recomputed(model_parallel):
    """The split's MLP half hands its parameter gradients on (DDP's hooks run) and frees them before the attention
    half's recompute starts."""
    _, model = _build(2)
    layer = model.decoder.layers[1]
    events = []
    layer.pre_mlp_layernorm.weight.register_post_accumulate_grad_hook(lambda p: events.append("mlp grad"))
    layer.input_layernorm.weight.register_post_accumulate_grad_hook(lambda p: events.append("attention grad"))
    layer.self_attention.register_forward_pre_hook(
        lambda mod, args: events.append("attention recompute") if torch.is_grad_enabled() else None)
    model.train()
    _step(model, 7)
    assert events == ["mlp grad", "attention recompute", "attention grad"]


@pytest.mark.parametrize("setting,match", [
    (dict(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss"), "moe_aux_loss_coeff"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
])
def test_refused_where_chunks_change_the_math(model_parallel, setting, match):
    with pytest.raises(ValueError, match=f"mlp_chunks_for_training=2 .*{match}"):
        _build(2, **setting)


def test_check_chunkable_names_every_refused_setting():
    from types import SimpleNamespace

    from megatron_glm5.core.mlp_chunks import check_chunkable

    base = dict(mlp_chunks_for_training=2, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    check_chunkable(SimpleNamespace(**base))  # GLM-5's own settings pass
    for name, value in (("moe_z_loss_coeff", 1e-3), ("moe_input_jitter_eps", 0.01),
                        ("moe_expert_capacity_factor", 1.0), ("moe_router_force_biased", 0.5),
                        ("moe_router_force_load_balancing", True), ("add_bias_linear", True),
                        ("moe_router_load_balancing_type", ["none", "quantile_balancing"])):
        with pytest.raises(ValueError, match=name if name != "moe_router_load_balancing_type" else "quantile"):
            check_chunkable(SimpleNamespace(**{**base, name: value}))


def test_policy_rejects_zero_chunks():
    with pytest.raises(ValueError, match="mlp_chunks_for_training"):
        default_cpu_policy(mlp_chunks_for_training=0)


def _graph_state(model) -> list[str]:
    """Tensors with an autograd graph kept as attributes of a module or of a plain object a module holds (the token
    dispatcher is not a module)."""
    found, seen = [], set()
    for name, module in model.named_modules():
        holders = [(name, module)] + [(f"{name}.{k}", v) for k, v in vars(module).items()
                                      if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor))]
        for where, obj in holders:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            for k, v in vars(obj).items():
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                        found.append(f"{where}.{k}")
    return found


def _leaves_alive(ptrs: set[int]) -> list[tuple]:
    """Python tensors, and leaves of autograd graphs reachable from Python objects, whose storage is in ``ptrs``."""
    import gc

    found, seen = [], set()
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        if obj.untyped_storage().data_ptr() in ptrs:
            found.append(("tensor", tuple(obj.shape)))
        stack = [obj.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            leaf = getattr(node, "variable", None)  # AccumulateGrad
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() in ptrs:
                found.append((node.name(), tuple(leaf.shape)))
            stack.extend(fn for fn, _ in node.next_functions)
    return found


_SELECTIVE_MOE = dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
                      recompute_modules=["moe"])


@pytest.mark.parametrize("chunks,policy", [(1, {}), (2, {}), (1, _SELECTIVE_MOE)],
                         ids=["full", "full-2-chunks", "selective-moe"])
def test_step_leaves_no_graph_behind(model_parallel, chunks, policy):
    """After a step under full (or the MoE's selective) recompute no module keeps an autograd graph: megatron-core's
    dispatcher kept the probabilities of the last call with their graph, whose leaves were the recompute's detached
    input (and its gradient) or, with chunks, a chunk of the norm output (compat.release_dispatcher_graph). The
    layers' inputs and norm outputs are gone once the step ends."""
    import gc

    _, model = _build(chunks, **policy)  # the all-gather dispatcher (the all-to-all one needs CUDA streams)
    model.train()
    ptrs: set[int] = set()
    record = lambda mod, args, out: ptrs.add((out[0] if isinstance(out, tuple) else out)  # noqa: E731
                                             .untyped_storage().data_ptr())
    hooks = [model.embedding.register_forward_hook(record)]
    hooks += [m.register_forward_hook(record) for n, m in model.named_modules() if n.endswith("pre_mlp_layernorm")]
    _step(model, 3)
    for h in hooks:
        h.remove()
    assert ptrs
    assert _graph_state(model) == []
    gc.collect()
    assert _leaves_alive(ptrs) == []
