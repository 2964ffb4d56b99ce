"""2-process gloo runs at TP=2 + sequence parallel, EP=2 and PP=2 (valid IndexShare split) give the single-process
loss (1e-6 relative) and gradients, on the tiny GLM-5.2 fixture (IndexShare + MTP + MoE, sequence > index_topk)."""

from __future__ import annotations

import pytest
import torch
from megatron.core import dist_checkpointing

from megatron_glm5.config import parse_hf_config
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config
from tests.distributed import run_torchrun
from tests.parallel_workers import make_batches, tensor_sharded_state_dict, train_step_grads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process weights (saved as a megatron dist checkpoint), loss and gradients."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.parallel import initialize_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    initialize_model_parallel()
    raw = tiny_glm52_config()
    torch.manual_seed(0)
    model = build_model(parse_hf_config(raw), default_cpu_policy())
    weights = tmp_path_factory.mktemp("ref_weights")
    dist_checkpointing.save(model.sharded_state_dict(), str(weights))
    loss, grads = train_step_grads(model, make_batches(raw["vocab_size"]), vocab=raw["vocab_size"])
    ps.destroy_model_parallel()
    return raw, str(weights), loss, grads


def _load_grads(raw, grads_dir) -> dict[str, torch.Tensor]:
    """Re-assemble a (TP/EP/PP-sharded) gradient checkpoint into single-process tensors."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel()
    try:
        model = build_model(parse_hf_config(raw), default_cpu_policy())
        params = dict(model.named_parameters())
        sharded = tensor_sharded_state_dict(model, {n: torch.empty_like(p) for n, p in params.items()})
        state = dist_checkpointing.load(sharded, str(grads_dir))
        return {n: state[n] for n in params}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "tp,pp,ep",
    [(2, 1, 1), (1, 1, 2), (1, 2, 1)],
    ids=["tp2-sp", "ep2", "pp2"],
)
def test_parallel_matches_single_process(reference, gloo_world, tmp_path, tp, pp, ep):
    raw, weights, ref_loss, ref_grads = reference
    grads_dir = tmp_path / "grads"
    grads_dir.mkdir()
    results = run_torchrun(
        "tests.parallel_workers:parallel_case", tmp_path, nproc=2,
        raw=raw, weights=weights, grads_out=str(grads_dir), tp=tp, pp=pp, ep=ep, vocab=raw["vocab_size"],
    )
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    for loss in losses:
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"loss {loss} vs single-process {ref_loss}"
    if pp == 2:
        assert [r["layers"] for r in results] == [2, 2], "PP=2 splits the 4 layers 2+2 (both stages start full)"
    grads = _load_grads(raw, grads_dir)
    assert set(grads) == set(ref_grads)
    errors = {}
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-12)
        errors[name] = ((grads[name] - ref).abs().max() / scale).item()
    bad = {n: f"{e:.2e}" for n, e in errors.items() if e > 1e-5}
    assert not bad, f"max |grad diff| / max |grad| above 1e-5: {bad}"
