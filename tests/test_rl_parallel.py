"""``compute_logprobs`` / ``logprobs_forward_step`` with 2 gloo processes, on the tiny GLM-5.2 fixture (IndexShare + MoE
+ MTP) and two packed batches of three sequences (40 / 9 / 31 tokens, and 40 / 9 / 30: an odd total that sequence
parallelism has to pad):

* TP = 2 + SP, both backends: log-probs and entropies equal transformers' per-sequence ones within 1e-5; replaying
  the single-process model's own choices (sharded over the sequence-parallel ranks, all-gathered per layer) gives the
  same, with overlap 1 and no routing mismatch.
* CP = 2 (``tilelang`` backend, bshd zigzag: THD + CP is not supported by the attention): the same, the replay rows
  re-mapped from the packing to the right-padded, zigzag-split batch; the CP ranks' partial gradients sum to the
  single-process gradient.
* PP = 2: the forward-step function on a hand-written two-stage forward: the last stage's ``loss_func`` returns the
  same log-probs; each stage replays its own layers (the first stage layers 0-1, the last 2-3 and MTP)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import from_hf_pretrained
from megatron_glm5.rl import compute_logprobs
from megatron_glm5.rl.replay import capture_choices
from megatron_glm5.testing import load_hf_reference_model, match_norm_eps, tiny_glm52_config, write_hf_checkpoint
from tests.distributed import run_torchrun
from tests.test_rl_logprobs import packed_batch, reference_logprobs
from megatron_glm5.parallel import destroy_model_parallel

pytestmark = pytest.mark.slow
TOL = 1e-5
BATCHES = ((40, 9, 31), (40, 9, 30))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gloo_world):
    """Checkpoint, per batch: transformers' log-probs / entropies and the single-process model's choices and
    log-probs (saved for the workers)."""

    from megatron_glm5.parallel import initialize_model_parallel

    raw = tiny_glm52_config()
    tmp = tmp_path_factory.mktemp("rl_parallel")
    path = write_hf_checkpoint(tmp / "hf", raw, seed=11)
    hf = load_hf_reference_model(path)
    match_norm_eps(hf)
    initialize_model_parallel()
    try:
        model = from_hf_pretrained(path)
        saved, refs = [], []
        for i, lengths in enumerate(BATCHES):
            seqs, ids, cu = packed_batch(raw["vocab_size"], lengths, seed=3 + i)
            choices = capture_choices(model, ids, cu, include_mtp=True)
            with torch.no_grad():
                ref_lp, ref_ent = reference_logprobs(hf, seqs)
                single = compute_logprobs(model, ids, cu, topk_replay=choices["indexer_topk"],
                                          routing_replay=choices["routed_experts"])
            saved.append((ids, cu, choices))
            refs.append(dict(lp=ref_lp, ent=ref_ent, replay=single))
    finally:
        destroy_model_parallel()
    choices_path = str(tmp / "choices.pt")
    torch.save(saved, choices_path)
    return str(path), choices_path, refs


def _check(batches, refs, *, entropy: bool = True, label: str):
    for b, (got, ref) in enumerate(zip(batches, refs)):
        lp, lp_r = torch.tensor(got["lp"]), torch.tensor(got["lp_replay"])
        d_lp = (lp - ref["lp"]).abs().max().item()
        d_r = (lp_r - ref["replay"]).abs().max().item()
        print(f"\n[{label} batch {b}] |d logprob| vs transformers {d_lp:.2e}, replayed vs single-process {d_r:.2e}")
        assert d_lp <= TOL and d_r <= TOL
        if entropy:
            assert (torch.tensor(got["ent"]) - ref["ent"]).abs().max() <= TOL
        assert all(v == 1.0 for v in got["overlap"].values()), got["overlap"]
        assert all(v == 0.0 for v in got["mismatch"].values()), got["mismatch"]


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_tp2_sp(setup, tmp_path, backend):
    path, choices_path, refs = setup
    results = run_torchrun("tests.rl_workers:tp_sp_case", tmp_path, path=path, choices_path=choices_path,
                           backend=backend)
    assert results[0] == results[1], "TP ranks agree"
    _check(results[0]["batches"], refs, label=f"TP2+SP {backend}")
    assert set(results[0]["batches"][0]["overlap"]) == {"0", "2", "4"}


def test_cp2_tilelang_bshd(setup, tmp_path, model_parallel):
    path, choices_path, refs = setup
    results = run_torchrun("tests.rl_workers:cp_case", tmp_path, path=path, choices_path=choices_path)
    assert results[0]["batches"] == results[1]["batches"], "CP ranks return the same full [T] result"
    _check(results[0]["batches"], refs, label="CP2 tilelang")
    # the CP ranks' partial gradients (summed in the worker) equal the single-process gradient
    ids, cu, _ = torch.load(choices_path)[0]
    model = from_hf_pretrained(path, backend="tilelang")
    w = torch.randn(ids.numel(), generator=torch.Generator().manual_seed(9))
    (compute_logprobs(model, ids, cu) * w).sum().backward()
    want = model.get_parameter("decoder.layers.2.self_attention.linear_proj.weight").grad.reshape(-1)[:64]
    got = torch.tensor(results[0]["grad"])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_pp2_forward_step(setup, tmp_path):
    path, choices_path, refs = setup
    results = run_torchrun("tests.rl_workers:pp_case", tmp_path, path=path, choices_path=choices_path)
    assert [r["layers"] for r in results] == [[0, 1], [2, 3]]
    last = next(r for r in results if r["last"])
    first = next(r for r in results if not r["last"])
    merged = [dict(l_, overlap={**f["overlap"], **l_["overlap"]}, mismatch={**f["mismatch"], **l_["mismatch"]})
              for f, l_ in zip(first["batches"], last["batches"])]
    _check(merged, refs, label="PP2")
    assert set(first["batches"][0]["overlap"]) == {"0"} and set(last["batches"][0]["overlap"]) == {"2", "4"}
