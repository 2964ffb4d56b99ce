"""RL log-probs with replay on GLM-5.3-Flash (fp32, CPU) against transformers, on the tie-prone 8-layer fixture
(``tie_prone_flash_config``: KDA / full / shared / full DSA twice, MoE, ``index_topk`` 8 with pools of 4, 4 indexer
heads) and 12 random 64-token sequences packed THD.

* Without replay most sequences' log-probs differ from transformers' by O(0.1-1): a KPool boundary tie (pools
  scoring exactly 0) that ``torch.topk`` and our stable sort break differently (``tests/test_glm5_next_parity.py``
  proves every differing row is a tie). With transformers' own choices replayed (its KPool rows of width
  ``index_topk + P - 1`` and routed experts, recorded by forward hooks) every sequence matches within 2e-5 (see
  ``TOL``), the statistics count every replayed layer and row, and a mangled payload changes the result.
* The layer inventory replay works from: the KDA layers take nothing, the width is the layers' own; a payload no
  layer can take, or a layer of no registered family, raises a named error.
* TP = 2 + sequence parallelism (torchrun, 2 gloo ranks): the same log-probs within 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import from_hf_pretrained
from megatron_glm5.rl import ReplayPayloadError, ReplayStats, compute_logprobs
from megatron_glm5.rl.replay import ModelLayers, ReplayLayerError
from tests.distributed import run_torchrun

N_SEQ, SEQ = 12, 64
# fp32 rounding, not a tolerance for choices (a flipped pool moves a log-prob by 1e-1..3): measured max 9.5e-6 on this
# fixture, 1.0e-5 and 1.05e-5 with weight seeds 1 and 2 (the logits themselves agree within 8e-6 relative, see
# test_glm5_next_parity.py); 8 random layers with KDA and mHC put |d logprob| at the 1e-5 level.
TOL = 2e-5
FULL, SHARED, MOE = [1, 3, 5, 7], {2: 1, 6: 5}, [1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """The checkpoint, 12 sequences (packed), transformers' per-sequence log-probs and its recorded choices."""
    from megatron_glm5.glm5_next.testing import (load_hf_reference_model, tie_prone_flash_config,
                                                 transformers_choices, write_transformers_checkpoint)

    path = write_transformers_checkpoint(tmp_path_factory.mktemp("rl_flash") / "hf", tie_prone_flash_config())
    hf = load_hf_reference_model(path)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 128, (SEQ,), generator=gen) for _ in range(N_SEQ)]
    lps, topk, experts = [], [], []
    for s in seqs:
        logits, choices = transformers_choices(hf, s)
        logp = torch.log_softmax(logits[0].float(), -1)
        lps.append(torch.cat([logp[:-1].gather(1, s[1:, None])[:, 0], logp.new_zeros(1)]))
        topk.append(choices["indexer_topk"])
        experts.append(choices["routed_experts"])
    cu = torch.arange(N_SEQ + 1, dtype=torch.int32) * SEQ
    return dict(path=str(path), ids=torch.cat(seqs), cu=cu, ref=torch.cat(lps), topk=topk, experts=experts)


def _per_sequence(diff: torch.Tensor) -> list[float]:
    return diff.abs().view(N_SEQ, SEQ).amax(-1).tolist()


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_replayed_transformers_choices_give_its_logprobs(flash, backend, model_parallel):
    model = from_hf_pretrained(flash["path"], backend=backend)
    ids, cu, ref = flash["ids"], flash["cu"], flash["ref"]
    assert flash["topk"][0].shape == (8, SEQ, 8 + 4 - 1)
    stats = ReplayStats()
    with torch.no_grad():
        free = compute_logprobs(model, ids, cu)
        replayed = compute_logprobs(model, ids, cu, topk_replay=flash["topk"], routing_replay=flash["experts"],
                                    replay_stats=stats)
    free_d, replay_d = _per_sequence(free - ref), _per_sequence(replayed - ref)
    print(f"\n[{backend}] max |d logprob| per sequence, free-running: {[f'{d:.1e}' for d in free_d]}\n"
          f"[{backend}] with transformers' choices replayed:        {[f'{d:.1e}' for d in replay_d]}")
    assert sum(d > 1e-2 for d in free_d) >= 6, "the fixture must have tie-broken sequences (else this tests nothing)"
    assert max(replay_d) <= TOL
    summary = stats.summary()
    assert sorted(summary["indexer_overlap"]) == FULL and sorted(summary["routing_mismatch"]) == MOE
    assert all(v["rows"] == ids.numel() for v in summary["indexer_overlap"].values())
    assert all(v["choices"] == ids.numel() * 2 for v in summary["routing_mismatch"].values())
    # our indexer, run on transformers-equivalent activations, breaks some ties the other way
    assert min(v["min"] for v in summary["indexer_overlap"].values()) < 1.0


def test_mangled_payload_changes_the_result(flash, model_parallel):
    """Swap one selected pool for an unselected complete one on layer 5 (and its shared layer 6) of one sequence,
    and route one token of layer 7 to other experts: that sequence's log-probs move, the others do not."""
    model = from_hf_pretrained(flash["path"])
    topk = [t.clone() for t in flash["topk"]]
    experts = [e.clone() for e in flash["experts"]]
    row = topk[3][5, 40]  # 40 + 1 visible tokens: 10 complete pools, 2 selected
    chosen = {int(row[0]) // 4, int(row[4]) // 4}
    other = next(p for p in range(10) if p not in chosen)
    row[4:8] = torch.arange(other * 4, other * 4 + 4, dtype=torch.int32)
    topk[3][6, 40] = row
    experts[8][7, 30] = torch.tensor([e for e in range(8) if e not in experts[8][7, 30].tolist()][:2],
                                     dtype=torch.int32)
    with torch.no_grad():
        base = compute_logprobs(model, flash["ids"], flash["cu"], topk_replay=flash["topk"],
                                routing_replay=flash["experts"])
        mangled = compute_logprobs(model, flash["ids"], flash["cu"], topk_replay=topk, routing_replay=experts)
    d = _per_sequence(mangled - base)
    # other sequences: at most last bits (other expert GEMM shapes)
    assert d[3] > 1e-4 and d[8] > 1e-4 and all(x <= 1e-6 for i, x in enumerate(d) if i not in (3, 8)), d


def test_inventory_widths_and_named_errors(flash, tmp_path, model_parallel):
    from megatron_glm5.glm5_next.testing import tie_prone_flash_config, write_transformers_checkpoint
    from megatron_glm5.inventory import LayerInventory, UnknownLayerError

    model = from_hf_pretrained(flash["path"])
    layers = ModelLayers.of(model)
    assert sorted(layers.full) == FULL + [8] and layers.topk_width == 11  # 8 + P - 1; MTP is layer 8
    assert {k: v for k, v in layers.shared_source.items()} == SHARED
    assert sorted(layers.routers) == MOE + [8] and layers.moe_layers == tuple(MOE)
    inv = LayerInventory.of(model)
    assert [e.key for e in inv if not e.is_dsa] == [0, 4] and {e.family for e in inv} == {"glm5_next"}
    ids, cu = flash["ids"][:SEQ], flash["cu"][:2]
    with pytest.raises(ReplayPayloadError, match=r"\[layers, rows, 11\]"):  # GLM-5's width index_topk is wrong here
        compute_logprobs(model, ids, cu, topk_replay=[flash["topk"][0][..., :8].numpy()])

    # a model without any full DSA layer (KDA only, dense) takes no indexer replay and no routing replay
    kda = write_transformers_checkpoint(tmp_path / "kda", tie_prone_flash_config(
        num_hidden_layers=2, layer_types=["linear_attention"] * 2, mlp_layer_types=["dense"] * 2,
        indexer_types=["full"] * 2, num_nextn_predict_layers=0))
    plain = from_hf_pretrained(kda)
    none = torch.full((2, SEQ, 11), -1, dtype=torch.int32)
    with pytest.raises(ReplayLayerError, match="no full DSA"):
        compute_logprobs(plain, ids, cu, topk_replay=[none.numpy()])
    with pytest.raises(ReplayLayerError, match="no MoE router"):
        compute_logprobs(plain, ids, cu, routing_replay=[torch.zeros(2, SEQ, 2, dtype=torch.int32).numpy()])

    # a decoder layer of no registered family is named, not skipped
    class Foreign(torch.nn.Module):
        layer_number = 1

    model.decoder.layers[0] = Foreign()
    with pytest.raises(UnknownLayerError, match="decoder.layers.0 is a .*Foreign"):
        LayerInventory.of(model)


@pytest.mark.slow
def test_tp2_sp_replay_matches_transformers(flash, tmp_path):
    torch.save({"topk": flash["topk"], "experts": flash["experts"]}, tmp_path / "payload.pt")
    results = run_torchrun("tests.rl_workers:flash_tp_sp_case", tmp_path, path=flash["path"],
                           payload=str(tmp_path / "payload.pt"), ids=flash["ids"].tolist(), cu=flash["cu"].tolist())
    assert results[0] == results[1], "TP ranks agree"
    got = torch.tensor(results[0]["lp_replay"])
    d = _per_sequence(got - flash["ref"])
    print(f"\n[TP2+SP] max |d logprob| per sequence with transformers' choices replayed: {[f'{x:.1e}' for x in d]}")
    assert max(d) <= TOL
    assert sorted(int(k) for k in results[0]["overlap"]) == FULL
    assert sorted(int(k) for k in results[0]["mismatch"]) == MOE
