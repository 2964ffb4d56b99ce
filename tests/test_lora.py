"""LoRA (megatron_glm5.lora, bridge.adapters) against transformers + peft 0.21, fp32 on CPU, sequences longer than
index_topk (DSA sparse), MTP present, both attention backends:

* logits: our LoRA model = transformers + ``peft.PeftModel`` with the same non-zero adapter, both directions (an
  adapter exported by us and loaded by peft; an adapter made and saved by peft and loaded by us), within 1e-5 with
  matched latent-norm eps; the indexer adapters too (forward only);
* ``export_hf(merge_lora=True)`` = base + LoRA (transformers on the merged checkpoint = our LoRA model), dense MLP
  and shared experts included;
* gradients of every adapter factor (kv_b_proj's through the absorbed weights on both backends) = peft's autograd;
* with full activation recompute the adapters of the first (checkpointed) layer still get their gradients;
* bad input: unknown targets, an adapter of another rank / target set / model, mismatched shapes - one clear error.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import bridge
from bridge.adapters import adapter_table, model_adapter_set, read_peft_dir, to_peft
from bridge.errors import BridgeError
from megatron_glm5 import from_hf_pretrained
from megatron_glm5.config import parse_hf_config
from megatron_glm5.lora import (
    DEFAULT_TARGET_MODULES,
    LoraConfig,
    add_lora,
    lora_modules,
    lora_parameters,
    resolve_targets,
)
from megatron_glm5.testing import load_hf_reference_model, match_norm_eps, tiny_glm52_config, write_hf_checkpoint

peft = pytest.importorskip("peft")

SEQ = 64  # index_topk is 16
LOGIT_TOL = 1e-5  # relative to max(1, max |reference logit|), as `verify` measures (fp32 rounding scales with it)


def within_logit_tol(diff: float, ref: torch.Tensor) -> bool:
    return diff <= LOGIT_TOL * max(1.0, ref.abs().max().item())
GRAD_RTOL = 1e-5
ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
ALL_TARGETS = (*DEFAULT_TARGET_MODULES, "dense_mlp", "shared_experts")  # + the merge-only groups peft cannot hold
BACKENDS = ["megatron", "tilelang"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    raw = tiny_glm52_config()  # IndexShare [full, shared, full, shared] + 1 MTP layer
    path = write_hf_checkpoint(tmp_path_factory.mktemp("glm52_lora"), raw, seed=11)
    return raw, path


@pytest.fixture(scope="module")
def checkpoint_without_mtp(tmp_path_factory):
    """For gradients: megatron-core adds an MTP loss to every forward with grad, transformers has no MTP."""
    raw = tiny_glm52_config(num_nextn_predict_layers=0)
    path = write_hf_checkpoint(tmp_path_factory.mktemp("glm52_lora_nomtp"), raw, seed=11)
    return raw, path


def _hf(path):
    model = load_hf_reference_model(path)
    match_norm_eps(model)
    return model


def _tokens(raw, batch=2, seq=SEQ, seed=5):
    return torch.randint(0, raw["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None)


def _peft_model(hf, adapter_dir):
    with warnings.catch_warnings():  # peft's "rank_pattern keys did not match" is wrong (they are applied)
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(hf, str(adapter_dir))


def _peft_made(path, targets, seed=3, **kw):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(_hf(path), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                              target_modules=targets, **kw))


# --------------------------------------------------------------------------------------------------------------------
# Targets and configuration
# --------------------------------------------------------------------------------------------------------------------


def test_targets_hf_and_megatron_names():
    hf = resolve_targets(["q_a_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj", "wk"])
    mc = resolve_targets(["linear_q_down_proj", "linear_kv_up_proj", "linear_fc1", "linear_fc2", "linear_wk"])
    assert hf == mc == ("linear_q_down_proj", "linear_kv_up_proj", "linear_fc1", "linear_fc2", "linear_wk")
    assert resolve_targets(["all-linear"]) == resolve_targets(LoraConfig(4, 8).target_modules)
    with pytest.raises(ValueError, match=r"unknown LoRA target\(s\) \['q_proj'\]; valid targets: .*kv_b_proj"):
        LoraConfig(4, 8, target_modules=["q_proj", "o_proj"])
    with pytest.raises(ValueError, match="'gate_proj' without 'up_proj'"):
        LoraConfig(4, 8, target_modules=["gate_proj"])
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoraConfig(0, 8)
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(4, 8, dropout=1.0)


def test_add_lora_wraps_targets_and_freezes_base(checkpoint, model_parallel):
    raw, path = checkpoint
    model = from_hf_pretrained(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    add_lora(model, LoraConfig(4, 8, target_modules=ALL_TARGETS, exclude_modules=["shared_experts", r"^mtp\."]))
    names = {m.lora_name for m in lora_modules(model)}
    arch = parse_hf_config(raw)
    n_moe = sum(t == "sparse" for t in arch.mlp_layer_types)
    per_layer_attention = 5
    expected = arch.num_hidden_layers * per_layer_attention + 2 * (arch.num_hidden_layers - n_moe) \
        + 2 * n_moe * arch.n_routed_experts
    assert len(names) == expected
    assert not any("shared_experts" in n or n.startswith("mtp.") or "indexer" in n for n in names)
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1" in names
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert set(before) <= {n for n, _ in model.named_parameters()}, "base parameter names must not change"
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert (fc1.lora_rank, fc1.lora_alpha, fc1.lora_scaling) == (8, 16, 2.0)  # gate + up: 2r, 2 alpha
    assert model.decoder.layers[0].self_attention.linear_proj.lora_rank == 4
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        add_lora(model, LoraConfig(4, 8))


def test_indexer_targets_warn_and_stay_frozen(checkpoint, model_parallel):
    _, path = checkpoint
    model = from_hf_pretrained(path)
    with pytest.warns(UserWarning, match="sends these adapters no gradient"):
        add_lora(model, LoraConfig(4, 8, target_modules=["wq_b", "wk", "weights_proj", "o_proj"]))
    idx = [(n, p) for n, p in lora_parameters(model) if ".indexer." in n]
    assert len(idx) == 2 * 3 * 3  # full layers 0, 2 and the MTP layer, 3 linears, A and B
    assert not any(p.requires_grad for _, p in idx)


def test_unmatched_exclude_warns_and_empty_selection_fails(checkpoint, model_parallel):
    _, path = checkpoint
    model = from_hf_pretrained(path)
    with pytest.raises(ValueError, match="no module of the model matches"):
        add_lora(model, LoraConfig(4, 8, target_modules=["o_proj"], exclude_modules=["attention"]))
    with pytest.warns(UserWarning, match=r"exclude_modules \['nothing_here'\] matched no targeted module"):
        add_lora(model, LoraConfig(4, 8, target_modules=["o_proj"], exclude_modules=["nothing_here"]))


def test_default_targets_are_what_a_peft_adapter_holds(checkpoint, model_parallel):
    """Was: the README's `add_lora(model, LoraConfig(r=16, alpha=32))` then `bridge.export_peft_adapter(model, dir)`
    raised, because the default targets included the dense MLP and shared experts, which peft 0.21 + transformers 5
    cannot represent. Now the defaults are attention + routed experts; the export goes into an existing empty
    directory, and peft loads every tensor of it onto transformers' model."""
    import tempfile

    from peft.utils import get_peft_model_state_dict

    from megatron_glm5.lora import scope_of

    _, path = checkpoint
    model = from_hf_pretrained(path)
    add_lora(model, LoraConfig(r=16, alpha=32))
    groups = {scope_of(m.lora_name)[1] for m in lora_modules(model)}
    assert groups == {"attention", "routed_experts"}
    out = Path(tempfile.mkdtemp())
    try:
        report = bridge.export_peft_adapter(model, out)
        assert report["target_parameters"] == ["gate_up_proj", "down_proj"]
        from bridge.adapters import read_peft_dir

        tensors, _ = read_peft_dir(out)
        loaded = get_peft_model_state_dict(_peft_model(_hf(path), out))
        in_model = {k for k in tensors if int(k.split(".layers.")[1].split(".")[0]) < 4}  # peft has no MTP layer
        assert {k.replace(".default", "") for k in loaded} >= in_model and len(in_model) > 0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    # the merge-only groups are there when named
    named = add_lora(from_hf_pretrained(path), LoraConfig(4, 8, target_modules=["o_proj", "dense_mlp"]))
    assert {scope_of(m.lora_name) for m in lora_modules(named)} == {
        ("linear_proj", "attention"), ("linear_fc1", "dense_mlp"), ("linear_fc2", "dense_mlp")}


def test_targets_that_match_nothing_are_refused(model_parallel):
    """A target_modules entry that reaches no linear of the model is an error naming what the model has (HF and
    megatron spellings, groups), not a silently smaller adapter: the merge-only groups on a model without them,
    and the MLP names, which reach the routed experts only, on a model without experts."""
    from megatron_glm5.model import build_model, default_cpu_policy

    all_moe = parse_hf_config(tiny_glm52_config(first_k_dense_replace=0, n_shared_experts=0))
    model = build_model(all_moe, default_cpu_policy())
    with pytest.raises(ValueError, match=r"target_modules \['dense_mlp', 'shared_experts'\] match no module of "
                                         r"this model; it has HF names \[.*'q_a_proj'.*\], megatron names "
                                         r"\[.*'linear_q_down_proj'.*\] and groups \['attention', 'indexer', "
                                         r"'routed_experts'\]"):
        add_lora(model, LoraConfig(4, 8, target_modules=["o_proj", "dense_mlp", "shared_experts"]))
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())  # nothing changed
    dense = parse_hf_config(tiny_glm52_config(first_k_dense_replace=4, num_nextn_predict_layers=0))
    model = build_model(dense, default_cpu_policy())
    with pytest.raises(ValueError, match=r"\['gate_proj', 'up_proj', 'down_proj'\] match no module.*the MLP names "
                                         r"reach the routed experts only: name 'dense_mlp'"):
        add_lora(model, LoraConfig(4, 8, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]))
    add_lora(model, LoraConfig(4, 8))  # the defaults never fail: a model without experts gets attention adapters
    assert {m.lora_name.rsplit(".", 1)[1] for m in lora_modules(model)} >= {"linear_proj", "linear_q_down_proj"}


# --------------------------------------------------------------------------------------------------------------------
# Logits against transformers + peft
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_exported_adapter_in_peft_matches(checkpoint, backend, model_parallel, tmp_path):
    """Our adapter (attention incl. kv_b_proj, routed experts, MTP layer) -> PEFT files -> peft on transformers."""
    raw, path = checkpoint
    model = from_hf_pretrained(path, backend=backend)
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False))
    report = bridge.export_peft_adapter(model, tmp_path / "adapter")
    assert report["target_parameters"] == ["gate_up_proj", "down_proj"]
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] == {r".*\.gate_up_proj": 8} and cfg["alpha_pattern"] == {r".*\.gate_up_proj": 16}
    ids = _tokens(raw)
    pm = _peft_model(_hf(path), tmp_path / "adapter")
    loaded = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    tensors, _ = read_peft_dir(tmp_path / "adapter")
    n_layers = raw["num_hidden_layers"]
    inside = {k: v for k, v in tensors.items() if f"model.layers.{n_layers}." not in k}  # MTP: no HF module
    assert set(inside) == set(loaded), "peft must load every non-MTP tensor of the file"
    assert all(torch.equal(loaded[k].detach(), v) for k, v in inside.items())
    with torch.no_grad():
        ours, ref = _logits(model, ids), pm(ids).logits
        with pm.disable_adapter():
            base = pm(ids).logits
    diff = (ours - ref).abs().max().item()
    print(f"\n[{backend}] exported adapter: max |logit diff| vs transformers+peft {diff:.2e} "
          f"(adapter moves logits by {(ref - base).abs().max().item():.2f})")
    assert within_logit_tol(diff, ref)
    assert (ref - base).abs().max() > 0.1, "the adapter must change the logits"


@pytest.mark.parametrize("backend", BACKENDS)
def test_peft_made_adapter_loads_and_matches(checkpoint, backend, model_parallel, tmp_path):
    """peft's own adapter (attention + gate_proj/up_proj/down_proj, which peft turns into the fused experts'
    gate_up_proj at rank 2r and down_proj) -> load_peft_adapter (adds the adapters) -> same logits."""
    raw, path = checkpoint
    pm = _peft_made(path, ATTENTION + ["gate_proj", "up_proj", "down_proj"])
    pm.save_pretrained(tmp_path / "peft_adapter")
    model = from_hf_pretrained(path, backend=backend)
    report = bridge.load_peft_adapter(model, tmp_path / "peft_adapter")
    arch = parse_hf_config(raw)
    n_moe = sum(t == "sparse" for t in arch.mlp_layer_types)
    assert report["adapters"] == 5 * arch.num_hidden_layers + 2 * n_moe * arch.n_routed_experts
    ids = _tokens(raw, seed=6)
    with torch.no_grad():
        ref = pm(ids).logits
        diff = (_logits(model, ids) - ref).abs().max().item()
    print(f"\n[{backend}] peft-made adapter: max |logit diff| {diff:.2e}")
    assert within_logit_tol(diff, ref)
    # and back out: the same tensors and (rank, alpha) as peft's file
    tensors, cfg = to_peft(model_adapter_set(model), adapter_table(arch), r=4, alpha=8)
    theirs, their_cfg = read_peft_dir(tmp_path / "peft_adapter")
    assert set(tensors) == set(theirs) and all(torch.equal(tensors[k], theirs[k]) for k in theirs)
    assert cfg["rank_pattern"] == their_cfg["rank_pattern"] and cfg["alpha_pattern"] == their_cfg["alpha_pattern"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_adapter_matches_peft(checkpoint, backend, model_parallel, tmp_path):
    """Indexer adapters change the top-k (forward only: no gradient reaches them, in transformers as here)."""
    raw, path = checkpoint
    pm = _peft_made(path, ["wq_b", "wk", "weights_proj", "o_proj"], seed=4)
    pm.save_pretrained(tmp_path / "idx")
    model = from_hf_pretrained(path, backend=backend)
    bridge.load_peft_adapter(model, tmp_path / "idx")
    ids = _tokens(raw, seed=7)
    with torch.no_grad():
        ref = pm(ids).logits
        diff = (_logits(model, ids) - ref).abs().max().item()
    print(f"\n[{backend}] indexer adapter: max |logit diff| {diff:.2e}")
    assert within_logit_tol(diff, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_export_equals_base_plus_lora(checkpoint, backend, model_parallel, tmp_path):
    """Every target (dense MLP, shared experts, MTP too) merged into the HF weights: each exported tensor is the
    source tensor + alpha/r * B @ A (float64 reference; untouched tensors bitwise), and transformers on the merged
    checkpoint gives our LoRA model's logits. Unmerged export and PEFT export of dense adapters are refused."""
    from bridge.hf_io import HFCheckpointReader
    from bridge.lora_convert import merged_reference
    from bridge.mapping import expand

    raw, path = checkpoint
    model = from_hf_pretrained(path, backend=backend)
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False, target_modules=ALL_TARGETS))
    with pytest.raises(BridgeError, match="merge_lora=True"):
        bridge.export_hf(model, tmp_path / "unmerged")
    with pytest.raises(BridgeError, match=r"dense MLP / shared experts \(decoder\.layers\.0\.mlp\.linear_fc1, .*"
                                          r"merge_lora=True.*default targets"):
        bridge.export_peft_adapter(model, tmp_path / "peft")
    bridge.export_hf(model, tmp_path / "merged", merge_lora=True)
    src, out = HFCheckpointReader(path), HFCheckpointReader(tmp_path / "merged")
    base = {n: src.read(n) for n in src.names}
    want = merged_reference(model_adapter_set(model), expand(parse_hf_config(raw)), base)
    changed = 0
    for name in src.names:
        got = out.read(name)
        if torch.equal(want[name], base[name].double()):
            assert torch.equal(got, base[name]), f"{name} has no adapter and must be copied bitwise"
            continue
        changed += 1
        err = (got.double() - want[name]).abs().max().item()
        assert err <= 1e-6 * want[name].abs().max().item(), f"{name}: {err:.2e}"
    n_adapted_hf = sum(len(expand(parse_hf_config(raw)).by_mcore[m.lora_name + ".weight"].hf)
                       for m in lora_modules(model))
    assert changed == n_adapted_hf
    ids = _tokens(raw, seed=8)
    with torch.no_grad():
        ours = _logits(model, ids)
        diff = (ours - _hf(tmp_path / "merged")(ids).logits).abs().max().item()
        moved = (ours - _hf(path)(ids).logits).abs().max().item()
    print(f"\n[{backend}] merged export ({changed} HF tensors changed): max |logit diff| transformers(merged) vs our "
          f"LoRA model {diff:.2e} (LoRA moves logits by {moved:.2f})")
    assert diff <= 2e-5 and moved > 0.1  # 1e-5 parity plus the fp32 rounding moved into the merged weights


@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_merged_export_equals_peft(checkpoint, model_parallel, tmp_path, experts):
    """A peft-representable adapter: transformers on our merged export = transformers + peft, within 1e-5 (relative);
    also with TorchGroupedMLP, whose experts' weights share one storage per linear (each expert's delta must reach
    its own rows)."""
    from megatron_glm5.model import default_cpu_policy

    raw, path = checkpoint
    policy = default_cpu_policy(moe_grouped_gemm="on") if experts == "grouped" else None
    model = from_hf_pretrained(path, policy=policy)
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False))
    bridge.export_peft_adapter(model, tmp_path / "adapter")
    bridge.export_hf(model, tmp_path / "merged", merge_lora=True)
    ids = _tokens(raw, seed=9)
    with torch.no_grad():
        ref = _peft_model(_hf(path), tmp_path / "adapter")(ids).logits
        diff = (_hf(tmp_path / "merged")(ids).logits - ref).abs().max().item()
    print(f"\n[merged vs peft] max |logit diff| {diff:.2e} (max |logit| {ref.abs().max().item():.2f})")
    assert within_logit_tol(diff, ref)


# --------------------------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapter_gradients_match_peft(checkpoint_without_mtp, backend, model_parallel, tmp_path):
    """d(sum(logits * w)) for every adapter factor - kv_b_proj's two factors through the absorbed W_kc / W_vc,
    routed experts through peft's fused ParamWrapper layout - against peft's autograd on transformers."""
    raw, path = checkpoint_without_mtp
    pm = _peft_made(path, ATTENTION + ["gate_proj", "up_proj", "down_proj"], seed=9)
    pm.save_pretrained(tmp_path / "a")
    model = from_hf_pretrained(path, backend=backend)
    bridge.load_peft_adapter(model, tmp_path / "a")
    ids = _tokens(raw, batch=1, seed=10)
    weight = torch.randn(1, SEQ, raw["vocab_size"], generator=torch.Generator().manual_seed(7))
    (pm(ids).logits * weight).sum().backward()
    theirs = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if "lora_" in n}
    (_logits(model, ids) * weight).sum().backward()
    from bridge.adapters import Adapter

    grads = {m.lora_name: Adapter(m.lora_A.weight.grad, m.lora_B.weight.grad, m.lora_alpha)
             for m in lora_modules(model)}
    ours, _ = to_peft(grads, adapter_table(parse_hf_config(raw)), r=4, alpha=8)
    assert set(ours) == set(theirs)
    worst = 0.0
    for key, want in theirs.items():
        err = ((ours[key] - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        assert want.abs().max() > 0, key
        assert err <= GRAD_RTOL, f"{backend} {key}: relative gradient error {err:.2e}"
    print(f"\n[{backend}] {len(theirs)} adapter gradients vs peft autograd: worst relative error {worst:.2e}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_factor_gets_gradient_with_mtp(checkpoint, backend, model_parallel):
    """Default targets (dense, shared and routed experts, MTP layer): both factors of every adapter get a non-zero
    gradient from the LM + MTP loss (B random at init so that A's gradient is not zero by construction)."""
    raw, path = checkpoint
    model = from_hf_pretrained(path, backend=backend)
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False, target_modules=ALL_TARGETS))
    model.train()
    ids = _tokens(raw, batch=4, seq=SEQ, seed=11)
    model(ids, torch.arange(SEQ)[None].expand_as(ids), None, labels=ids).sum().backward()
    dead = [n for n, p in lora_parameters(model) if p.grad is None or not p.grad.abs().max() > 0]
    assert not dead, f"adapter factors without gradient: {dead}"
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_recompute_keeps_first_layer_adapters_training(checkpoint, backend, model_parallel):
    """megatron-core's reentrant checkpoint gives no gradient to a chunk whose inputs do not require grad; with
    frozen embeddings that is layer 0. add_lora makes the embedding output require grad (HF's
    enable_input_require_grads): recompute gives the no-recompute gradients, and without that hook layer 0's
    adapters would get none."""
    from megatron_glm5.model import build_model, default_cpu_policy

    raw, path = checkpoint
    arch = parse_hf_config(raw)
    state = from_hf_pretrained(path, backend=backend).state_dict()
    grads = {}
    for name, policy in (("plain", default_cpu_policy()),
                         ("recompute", default_cpu_policy(recompute_granularity="full", recompute_method="uniform",
                                                          recompute_num_layers=1))):
        model = build_model(arch, policy, backend=backend)
        model.load_state_dict(state)
        add_lora(model, LoraConfig(4, 8, init_lora_weights=False, target_modules=ALL_TARGETS))
        model.train()
        ids = _tokens(raw, seed=12)
        model(ids, torch.arange(SEQ)[None].expand_as(ids), None, labels=ids).sum().backward()
        grads[name] = {n: p.grad for n, p in lora_parameters(model)}
        if name == "recompute":
            model.zero_grad(set_to_none=True)
            model.embedding._glm5_lora_hook.remove()
            model(ids, torch.arange(SEQ)[None].expand_as(ids), None, labels=ids).sum().backward()
            lost = [n for n, p in lora_parameters(model) if n.startswith("decoder.layers.0.") and p.grad is None]
            assert lost, "without the embedding hook layer 0's adapters get no gradient (the bug the hook fixes)"
    assert set(grads["plain"]) == set(grads["recompute"])
    for n, g in grads["plain"].items():
        got = grads["recompute"][n]
        assert got is not None, f"{n}: no gradient under full recompute"
        err = ((got - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        assert err <= 1e-6, f"{n}: {err:.2e}"


# --------------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------------


def test_bad_adapters_fail_with_one_clear_error(checkpoint, model_parallel, tmp_path):
    raw, path = checkpoint
    pm = _peft_made(path, ["q_a_proj", "o_proj"])
    pm.save_pretrained(tmp_path / "r4")

    model = from_hf_pretrained(path)  # different rank
    add_lora(model, LoraConfig(8, 16, target_modules=["q_a_proj", "o_proj"]))
    with pytest.raises(BridgeError, match=r"rank/alpha differ .*model rank 8 alpha 16, checkpoint rank 4 alpha 8"):
        bridge.load_peft_adapter(model, tmp_path / "r4")

    model = from_hf_pretrained(path)  # different target set
    add_lora(model, LoraConfig(4, 8, target_modules=["q_a_proj", "kv_b_proj"]))
    with pytest.raises(BridgeError, match=r"not in it: .*linear_kv_up_proj.*does not adapt: .*linear_proj"):
        bridge.load_peft_adapter(model, tmp_path / "r4")

    other = tiny_glm52_config(hidden_size=96)  # an adapter for another model
    other_path = write_hf_checkpoint(tmp_path / "other", other, seed=1)
    _peft_made(other_path, ["q_a_proj"]).save_pretrained(tmp_path / "other_adapter")
    with pytest.raises(BridgeError, match=r"q_a_proj: lora_A \[4, 96\] / lora_B \[64, 4\] do not fit the model's "
                                          r"weight \[64, 128\]"):
        bridge.load_peft_adapter(from_hf_pretrained(path), tmp_path / "other_adapter")

    deeper = tiny_glm52_config(num_hidden_layers=6, indexer_types=["full", "shared"] * 3)
    deeper_path = write_hf_checkpoint(tmp_path / "deeper", deeper, seed=1)
    _peft_made(deeper_path, ["o_proj"]).save_pretrained(tmp_path / "deeper_adapter")
    # (its layer 4 lands on our MTP layer, model.layers.4 in HF numbering; layer 5 has no counterpart)
    with pytest.raises(BridgeError, match=r"adapters for modules this model does not have \(1\): "
                                          r"\['model\.layers\.5\.self_attn\.o_proj'\]"):
        bridge.load_peft_adapter(from_hf_pretrained(path), tmp_path / "deeper_adapter")

    with pytest.raises(BridgeError, match="missing adapter_config.json"):
        bridge.load_peft_adapter(from_hf_pretrained(path), tmp_path)


def test_per_module_peft_layout_imports_as_fused_fc1():
    """Transformers-4-era / serving-engine PEFT files name gate_proj and up_proj per module (dense MLP, shared
    experts, each routed expert): a gate + up pair of rank r becomes one linear_fc1 adapter of rank 2r whose delta is
    exactly [gate delta; up delta]; a half pair is refused."""
    from bridge.adapters import from_peft

    arch = parse_hf_config(tiny_glm52_config())
    table = adapter_table(arch)
    gen = torch.Generator().manual_seed(0)
    h, i_dense, i_moe = arch.hidden_size, arch.intermediate_size, arch.moe_intermediate_size
    tensors = {}

    def pair(module, out_f, in_f):
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, in_f, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, 4, generator=gen)

    for proj in ("gate_proj", "up_proj"):
        pair(f"model.layers.0.mlp.{proj}", i_dense, h)
        pair(f"model.layers.1.mlp.shared_experts.{proj}", i_moe, h)
        pair(f"model.layers.2.mlp.experts.3.{proj}", i_moe, h)
    pair("model.layers.1.mlp.shared_experts.down_proj", h, i_moe)
    adapters = from_peft(tensors, {"r": 4, "lora_alpha": 8}, table, source="v4")
    assert sorted(adapters) == ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.shared_experts.linear_fc1",
                                "decoder.layers.1.mlp.shared_experts.linear_fc2",
                                "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1"]
    for module, hf, inter in (("decoder.layers.0.mlp.linear_fc1", "model.layers.0.mlp", i_dense),
                              ("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1", "model.layers.2.mlp.experts.3",
                               i_moe)):
        ad = adapters[module]
        assert (ad.rank, ad.alpha) == (8, 16.0)
        for rows, proj in ((slice(0, inter), "gate_proj"), (slice(inter, 2 * inter), "up_proj")):
            a, b = (tensors[f"base_model.model.{hf}.{proj}.lora_{f}.weight"] for f in "AB")
            assert torch.allclose(ad.delta()[rows], 2.0 * b @ a, atol=1e-5)
    del tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]
    del tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    with pytest.raises(BridgeError, match=r"linear_fc1: a gate_proj adapter without its up_proj partner"):
        from_peft(tensors, {"r": 4, "lora_alpha": 8}, table, source="v4")
