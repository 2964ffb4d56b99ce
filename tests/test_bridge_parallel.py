"""Conversion and loading at TP/PP/EP = 2 in a 2-process gloo world (torchrun).

* The round-trip matrix: GLM-5 (MTP) and GLM-5.2 (IndexShare + MTP), both expert layouts, imported at
  TP/PP/EP = 2/1/1, 1/2/1, 1/1/2 by two ranks that each write only their shard, exported, compared bitwise with
  the source (1/1/1 is covered by test_bridge_roundtrip.py). The stored tensors equal a single-process import's.
* Resharding: a checkpoint written at TP=2 loads at TP=1 with logits identical to the TP=1 checkpoint's, and the
  TP=1 checkpoint loads at TP=2 (and at EP=2) with the same logits; from_hf_pretrained at TP=2 agrees;
  export_hf of a TP=2 model gives the source back bitwise.
* Megatron layouts (bridge/megatron_layout.py): TE-layout imports at TP/PP/EP = 2 store what a single-process one
  does; TE-layout checkpoints (ours, and megatron-core's own save in the singleton_local_shards form) load at TP=2,
  EP=2 and PP=2 exactly as the local-layout checkpoint does.
"""

from __future__ import annotations

import pytest
import torch

import bridge
from bridge.megatron_io import DistCheckpoint, resolve_checkpoint_dir
from tests.bridge_workers import make_fixture, save_with_megatron_core
from tests.distributed import run_torchrun

NAMES = ["glm5", "glm5_fused", "glm52", "glm52_fused"]
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    cases = []
    for name in NAMES:
        src = make_fixture(root / "hf", name)
        for tp, pp, ep in LAYOUTS:
            cases.append(dict(name=name, hf=str(src), out=str(root / f"mc_{name}_{tp}{pp}{ep}"), tp=tp, pp=pp, ep=ep))
    run_torchrun("tests.bridge_workers:import_cases", root, nproc=2,
                 cases=[{k: c[k] for k in ("hf", "out", "tp", "pp", "ep")} for c in cases])
    return root, cases


@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_matrix_at_two_ranks(matrix, tmp_path, name):
    root, cases = matrix
    src = root / "hf" / name
    reference = tmp_path / "mc_single"
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=reference)
    ref = DistCheckpoint(resolve_checkpoint_dir(reference))
    for c in (c for c in cases if c["name"] == name):
        tag = f"{name} TP/PP/EP={c['tp']}/{c['pp']}/{c['ep']}"
        ckpt = DistCheckpoint(resolve_checkpoint_dir(c["out"]))
        assert set(ckpt.tensors) == set(ref.tensors), tag
        for key in ref.tensors:
            assert torch.equal(ckpt.read(key), ref.read(key)), f"{tag}: {key}"
        out = tmp_path / f"hf_{c['tp']}{c['pp']}{c['ep']}"
        bridge.convert_megatron_to_hf(megatron_path=c["out"], hf_path=out)
        report = bridge.compare_hf_checkpoints(src, out)
        assert report["ok"] and report["bitwise_equal"] == report["tensors"], (tag, report["mismatches"])


def test_checkpoints_reshard_between_tp1_and_tp2(matrix, tmp_path, model_parallel):
    root, cases = matrix
    src = root / "hf" / "glm52"
    tp2_ckpt = next(c["out"] for c in cases if c["name"] == "glm52" and c["tp"] == 2)
    tp1_ckpt = tmp_path / "mc_tp1"
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tp1_ckpt)

    seq_len, seed = 64, 1
    ids = torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(seq_len).unsqueeze(0)
    with torch.no_grad():
        at_tp1 = [bridge.load_megatron_checkpoint(p).eval()(ids, pos, None) for p in (tp1_ckpt, tp2_ckpt)]
    assert torch.equal(at_tp1[0], at_tp1[1])  # the TP=2-written checkpoint loads at TP=1 to the same logits

    for tp, ep in ((2, 1), (1, 2)):
        out = tmp_path / f"logits_tp{tp}_ep{ep}.pt"
        export = tmp_path / f"hf_export_tp{tp}_ep{ep}"
        run_torchrun("tests.bridge_workers:load_and_run", tmp_path, nproc=2, ckpts=[str(tp1_ckpt), tp2_ckpt], tp=tp,
                     ep=ep, out=str(out), seq_len=seq_len, seed=seed, hf_path=str(src), export_to=str(export))
        got = torch.load(out)
        for key in ("ckpt0", "ckpt1", "from_hf"):
            torch.testing.assert_close(got[key], at_tp1[0], rtol=0, atol=1e-4, msg=f"TP={tp} EP={ep} {key}")
        assert torch.equal(got["ckpt0"], got["ckpt1"]) and torch.equal(got["ckpt0"], got["from_hf"])
        report = bridge.compare_hf_checkpoints(src, export)  # export_hf gathered the TP/EP shards
        assert report["ok"], report["mismatches"]


def test_te_layouts_at_two_ranks(matrix, tmp_path, model_parallel):
    """One 2-process world: TE-layout imports at TP/PP/EP = 2/1/1, 1/2/1, 1/1/2 (each rank renames its own shards,
    rank 0 writes TE's extra state) equal the single-process import, objects included, and export back bitwise;
    at TP=2, EP=2 and PP=2 the te checkpoint and a megatron-core-saved te-fused-qk singleton_local_shards one load
    exactly as the local-layout checkpoint does (logits bitwise; at PP=2 each stage's parameters)."""
    root, _ = matrix
    src = root / "hf" / "glm52"
    local = bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "local")["path"]
    single = {lay: bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / f"single_{lay}",
                                                 megatron_layout=lay)["path"] for lay in ("te", "te-fused-qk")}
    singleton = save_with_megatron_core(bridge.load_megatron_checkpoint(local), tmp_path / "singleton",
                                        layout="te-fused-qk", singleton=True)
    imports = [dict(hf=str(src), out=str(tmp_path / f"te_{tp}{pp}{ep}"), tp=tp, pp=pp, ep=ep, megatron_layout=lay)
               for (tp, pp, ep), lay in zip(LAYOUTS, ("te", "te-fused-qk", "te"))]
    ckpts = [local, single["te"], str(singleton)]
    loads = [dict(tp=tp, pp=pp, ep=ep, ckpts=ckpts) for tp, pp, ep in ((2, 1, 1), (1, 1, 2), (1, 2, 1))]
    out = tmp_path / "logits.pt"
    results = run_torchrun("tests.bridge_workers:te_layout_cases", tmp_path, nproc=2, imports=imports, loads=loads,
                           hf_config=str(src / "config.json"), out=str(out), seq_len=64, seed=1)

    for c in imports:
        tag = f"{c['megatron_layout']} TP/PP/EP={c['tp']}/{c['pp']}/{c['ep']}"
        ref = DistCheckpoint(resolve_checkpoint_dir(single[c["megatron_layout"]]))
        ckpt = DistCheckpoint(resolve_checkpoint_dir(c["out"]))
        assert set(ckpt.tensors) == set(ref.tensors) and set(ckpt.objects) == set(ref.objects), tag
        for key in ref.tensors:
            assert torch.equal(ckpt.read(key), ref.read(key)), f"{tag}: {key}"
        bridge.convert_megatron_to_hf(megatron_path=c["out"], hf_path=tmp_path / f"hf_{tag[-5:].replace('/', '')}")
        report = bridge.compare_hf_checkpoints(src, tmp_path / f"hf_{tag[-5:].replace('/', '')}")
        assert report["ok"] and report["bitwise_equal"] == report["tensors"], (tag, report["mismatches"])
    logits = torch.load(out)
    for tag in ("tp2_pp1_ep1", "tp1_pp1_ep2"):
        assert torch.equal(logits[f"{tag}_ckpt1"], logits[f"{tag}_ckpt0"]), tag
        assert torch.equal(logits[f"{tag}_ckpt2"], logits[f"{tag}_ckpt0"]), tag
    for r in results:
        assert r["same_stage"]["tp1_pp2_ep1"] and r["same_stage"]["tp1_pp2_ep1_tensors"] > 10, r
