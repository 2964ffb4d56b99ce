"""Indexer top-k replay and MoE routing replay (R3), single process, on the tiny GLM-5.2 fixture (IndexShare
[full, shared, full, shared] + MTP, index_topk 16, sequences of 40 / 9 / 31 tokens).

Replaying the model's own choices reproduces its forward in every accepted payload form (sglang base64 token-major
without the last token, layer-major arrays, one packed array; bitwise when every row is given); replayed indices
reach the sparse attention exactly, on full layers and MTP, with IndexShare layers following their source; perturbing one layer's
replay changes that layer and nothing before it; routing replay recomputes the weights from our router and reports
the mismatch; malformed payloads fail with errors naming sample, layer and token; the replay buffers hold only the
full / MoE layers of the rank's rows and at most two layers are staged at a time; runs with replay are bitwise
reproducible, also under full activation recompute (where the router's replayed ids travel on the checkpoint)."""

from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest
import torch

from megatron_glm5 import from_hf_pretrained
from megatron_glm5.dsa import reference
from megatron_glm5.rl import ReplayOverlapWarning, ReplayPayloadError, ReplayStats, compute_logprobs, topk_overlap
from megatron_glm5.rl import payload as payload_mod
from megatron_glm5.rl.packing import PackedBatch, ParallelSizes, RankPlan
from megatron_glm5.rl.replay import (ModelLayers, ReplayLayerError, capture_choices, prepare_indexer_replay,
                                    prepare_routing_replay)
from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint
from tests.test_rl_logprobs import packed_batch

N_LAYERS = 4  # tiny_glm52_config: full, shared, full, shared; MTP is payload layer 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    raw = tiny_glm52_config()
    return raw, write_hf_checkpoint(tmp_path_factory.mktemp("rl_replay"), raw, seed=11)


@pytest.fixture
def setup(checkpoint, model_parallel):
    raw, path = checkpoint
    model = from_hf_pretrained(path)
    seqs, ids, cu = packed_batch(raw["vocab_size"])
    choices = capture_choices(model, ids, cu, include_mtp=True)
    return raw, model, seqs, ids, cu, choices


def sglang_payload(packed: torch.Tensor, cu, layers: int = N_LAYERS) -> list[str]:
    """What sglang returns per sample: base64 int32, token-major [L - 1, layers, k] (no row for the last token)."""
    cu = cu.tolist()
    return [base64.b64encode(packed[:layers, a:b - 1].permute(1, 0, 2).contiguous().numpy().tobytes()).decode()
            for a, b in zip(cu, cu[1:])]


def per_sample_arrays(packed: torch.Tensor, cu, *, drop_last: bool) -> list[np.ndarray]:
    cu = cu.tolist()
    return [packed[:, a:b - 1 if drop_last else b].numpy() for a, b in zip(cu, cu[1:])]


def perturbed(topk: torch.Tensor, cu, layer: int) -> tuple[torch.Tensor, int]:
    """``topk`` with, on every sparse row (all slots used) of full ``layer``, its lowest-scored key swapped for a
    causal key it did not pick, and copied to the shared layer after it (as an engine reports IndexShare). Returns
    the payload and the number of rows changed."""
    out = topk.clone()
    starts = torch.repeat_interleave(cu[:-1].long(), torch.diff(cu).long())
    changed = 0
    for t in range(topk.shape[1]):
        row = out[layer, t]
        if (row < 0).any():
            continue
        pos = t - int(starts[t])
        free = sorted(set(range(pos + 1)) - set(row.tolist()))
        if free:
            row[-1] = free[0]
            changed += 1
    out[layer + 1] = out[layer]  # tiny_glm52_config: layers 1 and 3 share layers 0 and 2
    return out, changed


# ------------------------------------------------------------------------------------------------------------------


def test_own_choices_replay_bitwise_in_every_payload_form(setup, monkeypatch):
    raw, model, _, ids, cu, choices = setup
    topk, experts = choices["indexer_topk"], choices["routed_experts"]
    assert topk.shape == (N_LAYERS + 1, ids.numel(), raw["index_topk"]) and experts.shape[-1] == 2
    assert torch.equal(topk[1], topk[0]) and torch.equal(topk[3], topk[2]), "shared layers repeat their source"
    assert torch.all(experts[0] == -1), "dense layer 0 has no routing"
    monkeypatch.setattr(payload_mod, "DECODE_CHUNK_BYTES", 1000)  # several decode chunks per sample
    with torch.no_grad():
        base = compute_logprobs(model, ids, cu)
        forms = {
            "packed": (topk, experts),
            "arrays, every row": (per_sample_arrays(topk, cu, drop_last=False),
                                  per_sample_arrays(experts, cu, drop_last=False)),
            "arrays, no last row": (per_sample_arrays(topk, cu, drop_last=True),
                                    per_sample_arrays(experts, cu, drop_last=True)),
            "sglang base64": (sglang_payload(topk, cu), sglang_payload(experts, cu)),
            # MoE layers only; + MTP it would have N = 4 layers here, which reads as sglang's every-layer form
            "moe layers only": (topk, experts[1:4]),
        }
        for name, (t, e) in forms.items():
            stats = ReplayStats()
            out = compute_logprobs(model, ids, cu, topk_replay=t, routing_replay=e, replay_stats=stats)
            if name in ("arrays, no last row", "sglang base64"):
                # each sequence's last token has no replay row: it attends to itself only. That changes no log-prob
                # mathematically (nothing attends to a sequence's last token), but its new hidden state may route
                # it to other experts in later layers, and other expert GEMM shapes move other tokens' last bits.
                assert (out - base).abs().max() < 1e-5, name
            else:
                assert torch.equal(out, base), name
            summary = stats.summary()
            assert all(v["mean"] == 1.0 and v["min"] == 1.0 for v in summary["indexer_overlap"].values()), name
            assert all(v["fraction"] == 0.0 for v in summary["routing_mismatch"].values()), name
        mtp = "packed", "arrays, every row", "arrays, no last row", "moe layers only"
        assert set(summary["indexer_overlap"]) == ({0, 2, 4} if name in mtp else {0, 2})


def test_replayed_indices_reach_the_kernels_exactly(setup, monkeypatch):
    """Perturb full layer 2's replay: the sparse attention of layer 0 gets layer 0's rows, layers 2 and 3 (shared,
    source 2) get the perturbed rows, MTP its own; layers 0-1 are bitwise unchanged, layer 2's output changes."""
    raw, model, _, ids, cu, choices = setup
    topk, changed = perturbed(choices["indexer_topk"], cu, 2)
    assert changed > 30
    fed, outputs = [], {}
    original = reference.sparse_mla
    monkeypatch.setattr(reference, "sparse_mla", lambda q, kv, idx, *a, **k: (fed.append(idx.clone()),
                                                                               original(q, kv, idx, *a, **k))[1])
    hooks = [layer.self_attention.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0].clone()))
             for i, layer in enumerate(model.decoder.layers)]
    with torch.no_grad():
        compute_logprobs(model, ids, cu, topk_replay=choices["indexer_topk"])
        clean, fed_clean = dict(outputs), list(fed)
        fed.clear()
        compute_logprobs(model, ids, cu, topk_replay=topk)
    for h in hooks:
        h.remove()
    starts = torch.repeat_interleave(cu[:-1], torch.diff(cu))[:, None]
    rows = lambda layer: torch.where(topk[layer] >= 0, topk[layer] + starts, -1)  # noqa: E731  packed key rows
    assert len(fed) == 5  # layers 0-3 and MTP, in order
    assert torch.equal(fed[0], rows(0)) and torch.equal(fed[2], rows(2)) and torch.equal(fed[3], rows(2))
    assert torch.equal(fed[1], fed[0]), "shared layer 1 follows layer 0"
    assert torch.equal(fed[4], fed_clean[4]) and torch.equal(fed_clean[4], rows(4)), "MTP replays its own rows"
    assert not torch.equal(fed[2], fed_clean[2])
    assert torch.equal(outputs[0], clean[0]) and torch.equal(outputs[1], clean[1])
    assert not torch.equal(outputs[2], clean[2])


def test_overlap_statistics_and_warning(setup):
    raw, model, _, ids, cu, choices = setup
    topk, changed = perturbed(choices["indexer_topk"], cu, 2)
    stats = ReplayStats(warn_below=0.99)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compute_logprobs(model, ids, cu, topk_replay=topk, replay_stats=stats)
        summary = stats.summary()
    k = raw["index_topk"]
    t = ids.numel()
    expect = 1 - changed / k / t  # one slot of k differs on each changed row
    layer2 = summary["indexer_overlap"][2]
    assert layer2["rows"] == t and abs(layer2["mean"] - expect) < 1e-6 and abs(layer2["min"] - (k - 1) / k) < 1e-6
    # layer 0 is untouched; MTP (4) may drift too: its input went through the perturbed layer 2
    assert summary["indexer_overlap"][0]["mean"] == 1.0 and summary["low_overlap_layers"][0] == 2
    assert any(issubclass(w.category, ReplayOverlapWarning) and "layer 2" in str(w.message) for w in caught)


def test_routing_replay_recomputes_weights_and_reports_mismatch(setup):
    raw, model, _, ids, cu, choices = setup
    experts = choices["routed_experts"].clone()
    e = raw["n_routed_experts"]
    experts[2] = (experts[2] + 1) % e  # a different set on (almost) every token
    own = choices["routed_experts"][2].long()
    target = experts[2].long()
    differing = sum(len(set(a) - set(b)) for a, b in zip(target.tolist(), own.tolist()))
    router = model.decoder.layers[2].mlp.router
    seen = {}
    hook_in = router.register_forward_hook(lambda m, a, out: seen.update(x=a[0].detach().clone(), out=out))
    stats = ReplayStats()
    with torch.no_grad():
        compute_logprobs(model, ids, cu, routing_replay=experts, replay_stats=stats)
        scores = torch.sigmoid(router.gating(seen["x"]).view(-1, e).float())
    hook_in.remove()
    probs, routing_map = seen["out"]
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, target, True))
    want = scores.gather(1, target)
    want = want / want.sum(-1, keepdim=True) * raw["routed_scaling_factor"]
    assert torch.allclose(probs.gather(1, target), want, rtol=1e-6, atol=1e-7)
    summary = stats.summary()["routing_mismatch"]
    assert summary[2]["choices"] == target.numel() and abs(summary[2]["fraction"] - differing / target.numel()) < 1e-9
    assert summary[1]["fraction"] == 0.0, "layer 1 has no replay: its own choice"


def test_payload_errors_name_sample_layer_and_token(setup):
    raw, model, _, ids, cu, choices = setup
    topk, experts = choices["indexer_topk"].clone(), choices["routed_experts"].clone()
    bad = topk.clone()
    bad[2, 40 + 5, 0] = 7  # sample 1 (starts at 40), token 5, layer 2: a future key
    with pytest.raises(ReplayPayloadError, match=r"sample 1, layer 2, token 5: index 7 is in the future"):
        compute_logprobs(model, ids, cu, topk_replay=bad)
    bad = topk.clone()
    bad[0, 3, 1] = -4
    with pytest.raises(ReplayPayloadError, match=r"sample 0, layer 0, token 3: index -4 is negative"):
        compute_logprobs(model, ids, cu, topk_replay=bad)
    bad = topk.clone()
    bad[3, 60, 0] = (bad[3, 60, 0] + 1) % 11
    with pytest.raises(ReplayPayloadError, match=r"sample 2, layer 3, token 11: layer 3 is an IndexShare 'shared'"):
        compute_logprobs(model, ids, cu, topk_replay=bad)
    bad = experts.clone()
    bad[1, 45, 1] = 8
    with pytest.raises(ReplayPayloadError, match=r"sample 1, layer 1, token 5: expert id 8 is outside \[0, 8\)"):
        compute_logprobs(model, ids, cu, routing_replay=bad)
    bad = experts.clone()
    bad[3, 2, 1] = bad[3, 2, 0]
    with pytest.raises(ReplayPayloadError, match=r"sample 0, layer 3, token 2: expert ids .* repeat"):
        compute_logprobs(model, ids, cu, routing_replay=bad)
    with pytest.raises(ReplayPayloadError, match="3 sequences"):
        compute_logprobs(model, ids, cu, topk_replay=sglang_payload(topk, cu)[:2])
    with pytest.raises(ReplayPayloadError, match=r"sample 2 \(31 tokens\) has"):
        compute_logprobs(model, ids, cu, topk_replay=sglang_payload(topk, cu)[:2] + ["A" * 16])


def test_replay_buffers_hold_only_the_rank_rows_of_replayed_layers(setup):
    """Host bytes = (full layers + MTP) x rows x index_topk x 4 for the indexer and MoE layers (+ MTP) x rows x
    router_topk x 4 for routing, rows being this rank's share of the tokens (under TP = 2 with sequence parallelism:
    half the padded tokens, without running any collective); at most two layers are staged on the device."""
    raw, model, _, ids, cu, choices = setup
    layers = ModelLayers.of(model)
    assert sorted(layers.full) == [0, 2, 4] and sorted(layers.routers) == [1, 2, 3, 4]
    batch = PackedBatch.build(ids, cu)
    k, kr = raw["index_topk"], raw["num_experts_per_tok"]
    for sizes, rows in ((ParallelSizes(), 80), (ParallelSizes(tp=2, tp_rank=1, sp=True), 40),
                        (ParallelSizes(tp=3, tp_rank=2, sp=True), 27)):
        plan = RankPlan.build(batch, sizes)
        idx = prepare_indexer_replay(choices["indexer_topk"], plan, layers)
        rt = prepare_routing_replay(choices["routed_experts"], plan, layers)
        assert idx.host_bytes == 3 * rows * k * 4 and rt.host_bytes == 4 * rows * kr * 4
        assert all(t.shape == (rows, 1, k) for t in idx.host.values())
        if sizes.tp == 2:  # rank 1 holds packed tokens 40..79, rebased to key rows
            assert torch.equal(idx.host[2][:, 0], torch.where(choices["indexer_topk"][2][40:] >= 0,
                                                              choices["indexer_topk"][2][40:] + torch.where(
                                                                  torch.arange(40, 80) < 49, 40, 49)[:, None], -1))
    # sglang payloads carry no MTP layer: MTP then runs its own indexer and router
    plan = RankPlan.build(batch, ParallelSizes())
    assert sorted(prepare_indexer_replay(sglang_payload(choices["indexer_topk"], cu), plan, layers).host) == [0, 2]
    # staging during a forward
    staged = []
    from megatron_glm5.rl import logprobs as lp_mod

    original = lp_mod._run

    def spy(model_, prep, stats):
        staged.extend([prep.indexer, prep.routing])
        return original(model_, prep, stats)

    lp_mod._run = spy
    try:
        with torch.no_grad():
            compute_logprobs(model, ids, cu, topk_replay=choices["indexer_topk"],
                             routing_replay=choices["routed_experts"])
    finally:
        lp_mod._run = original
    assert [s.max_staged for s in staged] == [2, 2]


def test_two_runs_with_replay_are_bitwise_equal_with_and_without_recompute(checkpoint, model_parallel):
    """Deterministic mode on CPU: forward + backward twice with replay (perturbed, so that the model's own choices
    would differ) gives identical log-probs and gradients; with full activation recompute the gradients are the same
    as without it (the routers' replayed ids come back from the checkpoint in the recompute)."""
    from megatron_glm5.config import RuntimePolicy

    raw, path = checkpoint
    seqs, ids, cu = packed_batch(raw["vocab_size"])
    base_kw = dict(params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
                   dsa_kernel_backend="none", deterministic_mode=True)
    plain = from_hf_pretrained(path, policy=RuntimePolicy(**base_kw))
    choices = capture_choices(plain, ids, cu, include_mtp=True)
    topk, _ = perturbed(choices["indexer_topk"], cu, 2)
    experts = choices["routed_experts"].clone()
    experts[1:4] = (experts[1:4] + 3) % raw["n_routed_experts"]
    w = torch.randn(ids.numel(), generator=torch.Generator().manual_seed(1))

    def run(model):
        model.train()
        model.zero_grad(set_to_none=True)
        lp = compute_logprobs(model, ids, cu, topk_replay=topk, routing_replay=experts)
        (lp * w).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp1, g1 = run(plain)
    lp2, g2 = run(plain)
    assert torch.equal(lp1, lp2) and g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1)
    with torch.no_grad():
        own = compute_logprobs(plain, ids, cu)
    assert not torch.equal(own, lp1), "the replay changes the result (so the recompute check below means something)"

    recompute = from_hf_pretrained(path, policy=RuntimePolicy(**base_kw, recompute_granularity="full",
                                                              recompute_method="uniform", recompute_num_layers=1))
    lp3, g3 = run(recompute)
    assert torch.equal(lp3, lp1)
    worst = max(((g3[n] - g1[n]).abs().max() / g1[n].abs().max().clamp_min(1e-30)).item() for n in g1)
    assert worst < 1e-6, f"recompute changes gradients by {worst:.2e} (relative)"


def test_topk_overlap_is_a_set_overlap():
    a = torch.tensor([[3, 1, 2, -1], [5, 6, 7, 8], [-1, -1, -1, -1]], dtype=torch.int32)
    b = torch.tensor([[1, 2, 3, -1], [8, 9, 5, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    assert topk_overlap(a, b, chunk=2).tolist() == [1.0, 0.5, 1.0]


def test_routing_replay_refused_with_mlp_chunks(setup):
    """Routers that see chunks of a micro-batch cannot take its routing rows: refused by name (the indexer's replay
    is per attention layer and unaffected)."""
    import dataclasses

    _, model, _, ids, cu, choices = setup
    layers = dataclasses.replace(ModelLayers.of(model), mlp_chunks=2)
    plan = RankPlan.build(PackedBatch.build(ids, cu), ParallelSizes())
    with pytest.raises(ReplayLayerError, match="mlp_chunks_for_training=2"):
        prepare_routing_replay(choices["routed_experts"], plan, layers)
    assert prepare_indexer_replay(choices["indexer_topk"], plan, layers) is not None
