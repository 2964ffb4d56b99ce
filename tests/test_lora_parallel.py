"""LoRA at TP=2 + sequence parallel and EP=2 (gloo, 2 processes) against one process, both backends, on the tiny
GLM-5.2 fixture (IndexShare + MTP + dense, shared and routed experts; sequence > index_topk):

* every adapter factor's finalised gradient (kv_b_proj's LoRA-A through the absorbed weight included) = the
  single-process one within 1e-5 relative, and every factor gets one;
* after one SGD step the adapters (gathered by the bridge) = the single-process ones within 1e-6, replicated
  factors are identical on every TP rank, base weights are bitwise unchanged; expert adapters carry
  ``allreduce=False`` under EP (expert-DP reduction in megatron-core's DDP), the others ``True``;
* a peft-made adapter loaded on every rank (each keeps its shards) gives the single-process loss.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_glm5.testing import load_hf_reference_model, tiny_glm52_config, write_hf_checkpoint
from tests.distributed import run_torchrun
from tests.lora_workers import load_adapter_grads, load_adapters_single_process, lora_case, save_reference_weights

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gloo_world):
    raw = tiny_glm52_config()
    weights = str(tmp_path_factory.mktemp("lora_base"))
    save_reference_weights(raw, weights)
    hf_dir = write_hf_checkpoint(tmp_path_factory.mktemp("lora_hf"), raw, seed=2)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(load_hf_reference_model(hf_dir), peft.LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
                "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj"]))
    adapter = tmp_path_factory.mktemp("peft_made")
    pm.save_pretrained(adapter)
    refs = {}
    for backend in ("megatron", "tilelang"):
        out = tmp_path_factory.mktemp(f"lora_ref_{backend}")
        result = lora_case(0, 1, raw=raw, weights=weights, out=str(out), tp=1, ep=1, backend=backend,
                           peft_adapter=str(adapter))
        refs[backend] = (result, load_adapter_grads(raw, str(out / "grads")), str(out))
    return raw, weights, str(adapter), refs


@pytest.mark.parametrize("tp,ep,pp,backend", [(2, 1, 1, "megatron"), (1, 2, 1, "megatron"), (2, 1, 1, "tilelang"),
                                               (1, 2, 1, "tilelang"), (1, 1, 2, "megatron")],
                         ids=["tp2-sp-megatron", "ep2-megatron", "tp2-sp-tilelang", "ep2-tilelang", "pp2-megatron"])
def test_lora_parallel_matches_single_process(setup, tmp_path, tp, ep, pp, backend):
    from bridge.lora_convert import adapters_from_checkpoint

    raw, weights, adapter, refs = setup
    ref, ref_grads, ref_dir = refs[backend]
    results = run_torchrun("tests.lora_workers:lora_case", tmp_path, nproc=2, raw=raw, weights=weights,
                           out=str(tmp_path), tp=tp, ep=ep, backend=backend, peft_adapter=adapter, pp=pp)
    losses = [r["loss"] for r in results if r["loss"] is not None]  # the last pipeline stage reports it
    assert losses
    for loss in losses:
        assert abs(loss - ref["loss"]) <= 1e-6 * abs(ref["loss"]), (loss, ref["loss"])
    for r in results:
        if pp == 1:
            assert abs(r["peft_loss"] - ref["peft_loss"]) <= 1e-6 * abs(ref["peft_loss"]), "peft-made adapter"
        assert r["base_unchanged"], "base weights changed"
        assert r["replicas_equal"], "a replicated adapter factor differs between TP ranks"
        assert r["dense_allreduce"] == [True]
        assert r["expert_allreduce"] == ([False] if ep > 1 else [True])
    if tp > 1:
        # 5 attention layers (4 + MTP) x 7 (q_a, kv_a: A and B; q_b, kv_b: A; o_proj: B), dense fc1 A + fc2 B,
        # 4 shared-expert MLPs x 2
        assert results[0]["replicated_checked"] == 45

    grads = load_adapter_grads(raw, str(tmp_path / "grads"))
    assert set(grads) == set(ref_grads)
    worst, dead = 0.0, []
    for name, want in ref_grads.items():
        if not want.abs().max() > 0:
            dead.append(name)
            continue
        err = ((grads[name] - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"
    assert not dead, f"factors without gradient: {dead}"
    kv = [n for n in ref_grads if "linear_kv_up_proj.lora_A" in n]
    assert kv and all(grads[n].abs().max() > 0 for n in kv)

    mine, _ = adapters_from_checkpoint(tmp_path / "adapters")
    theirs, _ = adapters_from_checkpoint(ref_dir + "/adapters")
    assert set(mine) == set(theirs)
    step_err = max(max((mine[k].a - theirs[k].a).abs().max().item(), (mine[k].b - theirs[k].b).abs().max().item())
                   for k in theirs)
    print(f"\n[{backend} TP={tp} EP={ep} PP={pp}] {len(ref_grads)} factors: worst relative gradient error "
          f"{worst:.2e}; adapters after one SGD step: max |diff| {step_err:.2e}")
    assert step_err <= 1e-6
    # the same adapters saved by megatron-core's dist_checkpointing at this layout load into one process

    resharded = load_adapters_single_process(raw, str(tmp_path / "ckpt"), backend)
    expected = {f"{m}.lora_{f}.weight": getattr(theirs[m], f.lower()) for m in theirs for f in ("A", "B")}
    assert set(resharded) == set(expected)
    assert max((resharded[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
