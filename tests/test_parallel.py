"""2-process gloo runs at TP=2 + sequence parallel, EP=2 and PP=2 (valid IndexShare split) give the single-process
loss (1e-6 relative) and gradients, on the tiny GLM-5.2 fixture (IndexShare + MTP + MoE, sequence > index_topk).
The ``tilelang`` backend (torch path on CPU: its SP gathers of the indexer outputs, absorption and de-absorption) is
checked at TP=2 + SP and at CP=2 (zigzag split, keys all-gathered) against the single-process ``megatron`` backend."""

from __future__ import annotations

import pytest

from megatron_glm5.testing import tiny_glm52_config
from tests.distributed import run_torchrun
from tests.parallel_workers import grad_errors, load_sharded_grads, reference_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process weights (saved as a megatron dist checkpoint), loss and gradients."""
    raw = tiny_glm52_config()
    weights = str(tmp_path_factory.mktemp("ref_weights"))
    loss, grads = reference_run(raw, weights)
    return raw, weights, loss, grads


@pytest.fixture(scope="module")
def reference_no_mtp(tmp_path_factory):
    """As ``reference`` without the MTP layer: megatron-core normalises the MTP loss by each CP rank's own count of
    rolled tokens (the rank holding a sequence's last chunk has one fewer), so with MTP a CP run is not the same loss
    as one process; without it the CP comparison isolates our attention."""
    raw = tiny_glm52_config(num_nextn_predict_layers=0)
    weights = str(tmp_path_factory.mktemp("ref_weights_no_mtp"))
    loss, grads = reference_run(raw, weights)
    return raw, weights, loss, grads


@pytest.mark.parametrize(
    "tp,pp,ep,cp,backend",
    [(2, 1, 1, 1, "megatron"), (1, 1, 2, 1, "megatron"), (1, 2, 1, 1, "megatron"), (2, 1, 1, 1, "tilelang"),
     (1, 1, 1, 2, "tilelang")],
    ids=["tp2-sp", "ep2", "pp2", "tp2-sp-tilelang", "cp2-tilelang"],
)
def test_parallel_matches_single_process(reference, reference_no_mtp, gloo_world, tmp_path, tp, pp, ep, cp, backend):
    raw, weights, ref_loss, ref_grads = reference_no_mtp if cp > 1 else reference
    grads_dir = tmp_path / "grads"
    grads_dir.mkdir()
    results = run_torchrun(
        "tests.parallel_workers:parallel_case", tmp_path, nproc=2,
        raw=raw, weights=weights, grads_out=str(grads_dir), tp=tp, pp=pp, ep=ep, vocab=raw["vocab_size"],
        backend=backend, cp=cp,
    )
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    if cp > 1:  # each CP rank averages its own half of every sequence
        losses = [sum(losses) / len(losses)]
    for loss in losses:
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"loss {loss} vs single-process {ref_loss}"
    if pp == 2:
        assert [r["layers"] for r in results] == [2, 2], "PP=2 splits the 4 layers 2+2 (both stages start full)"
    errors = grad_errors(load_sharded_grads(raw, str(grads_dir)), ref_grads)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if e > 1e-5}
    assert not bad, f"max |grad diff| / max |grad| above 1e-5: {bad}"


SPARSE_LOSS = dict(dsa_indexer_loss_coeff=0.1, dsa_indexer_use_sparse_loss=True)


def _reference_loss(tmp_path_factory, mtp: int):
    raw = tiny_glm52_config(num_nextn_predict_layers=mtp)
    weights = str(tmp_path_factory.mktemp(f"ref_weights_loss_mtp{mtp}"))
    loss, grads, logged = reference_run(raw, weights, SPARSE_LOSS)
    return raw, weights, loss, grads, logged


@pytest.fixture(scope="module")
def reference_loss(tmp_path_factory):
    """Single process with the sparse indexer loss on (with MTP: its layer has a loss slot of its own)."""
    return _reference_loss(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def reference_loss_no_mtp(tmp_path_factory):
    """As ``reference_loss`` without MTP, for CP (see ``reference_no_mtp``)."""
    return _reference_loss(tmp_path_factory, 0)


@pytest.mark.parametrize(
    "tp,pp,cp,backend",
    [(2, 1, 1, "megatron"), (2, 1, 1, "tilelang"), (2, 1, 1, "tilelang-after"), (1, 2, 1, "megatron"),
     (1, 2, 1, "tilelang-after"), (1, 1, 2, "tilelang"), (1, 1, 2, "tilelang-after")],
    ids=["tp2-sp", "tp2-sp-tilelang", "tp2-sp-tilelang-loss-after-attention", "pp2", "pp2-tilelang-loss-after-attention",
         "cp2-tilelang", "cp2-tilelang-loss-after-attention"],
)
def test_indexer_loss_parallel_matches_single_process(reference_loss, reference_loss_no_mtp, gloo_world, tmp_path,
                                                      tp, pp, cp, backend):
    """The sparse indexer loss under TP=2 + SP (target summed over both ranks' heads; also computed in the backward,
    after the attention, as the ``tilelang`` backend does on the GPU), PP=2 (tracker slots of both stages) and CP=2:
    the logged loss and every gradient, indexer parameters included, equal one process."""
    backend, _, after = backend.partition("-")
    raw, weights, ref_loss, ref_grads, ref_logged = reference_loss_no_mtp if cp > 1 else reference_loss
    grads_dir = tmp_path / "grads"
    grads_dir.mkdir()
    results = run_torchrun(
        "tests.parallel_workers:parallel_case", tmp_path, nproc=2,
        raw=raw, weights=weights, grads_out=str(grads_dir), tp=tp, pp=pp, ep=1, vocab=raw["vocab_size"],
        backend=backend, cp=cp, policy_overrides=SPARSE_LOSS, timeout=240,
        loss_after_attention=True if after else None,
    )
    assert ref_logged and all(v > 0 for v in ref_logged)
    for r in results:
        assert r["indexer_loss"] == pytest.approx(ref_logged, rel=1e-5)
    if after:  # every full layer's loss (per micro-batch) of this rank's stage ran in the backward
        assert all(r["losses_after_attention"] > 0 for r in results)
    errors = grad_errors(load_sharded_grads(raw, str(grads_dir)), ref_grads)
    assert any(".indexer." in n for n in errors)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if e > 1e-5}
    assert not bad, f"max |grad diff| / max |grad| above 1e-5: {bad}"


def test_loss_after_attention_sums_the_target_over_tensor_parallel_ranks(tmp_path):
    """Two ranks, each attention backward leaving its own heads' partial target: the loss after the attention
    all-reduces before normalising, so every rank's gradients equal the loss on the full target (a rank's own
    partial target alone would differ)."""
    results = run_torchrun("tests.parallel_workers:loss_after_box_tp", tmp_path, nproc=2, timeout=120)
    for r in results:
        assert r["grad_err"] <= 1e-12 and r["loss_err"] <= 1e-12, r
        assert r["single_rank_err"] > 1e-3, "the test needs partial targets that differ from the full one"
