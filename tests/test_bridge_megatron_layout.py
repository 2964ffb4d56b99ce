"""Megatron layouts (bridge/megatron_layout.py): the table against its oracles, detection, and round trips.

* The table: ``te`` fuses exactly the norms megatron-core 0.19.2's DSA spec fuses with a fusing (TE-style) backend,
  ``te-fused-qk`` those of its MLA spec (both built with a recording backend, no TE needed). NVIDIA Megatron-Bridge
  0.6.2's own GLM-5 table (its ``glm5_bridge.py``, read from the installed wheel's source without importing it) is
  the outside oracle for the names: every name a layout writes maps there to the same HF tensors, and every name of
  it that applies to these GLM-5 / GLM-5.2 configs (MLA, MoE, MTP; not ``linear_qkv``) is written by one of our
  layouts, its TE spellings (fused norms, ``TEGroupedMLP``'s ``weight{e}``) by our TE layouts.
* Detection from the keys alone; an unknown layout is refused naming its first unmatched key; GLM-5.3-Flash reads
  and writes the local layout only.
* Round trips: HF -> TE-layout checkpoint -> HF bitwise, loaded into our (local-provider) model with logits equal
  to the local-layout load bitwise, TE extra state written; a checkpoint saved by megatron-core itself in the
  ``singleton_local_shards`` form (one key per expert, gated halves) in a TE layout reads and loads too. TP/PP/EP:
  tests/test_bridge_parallel.py.
"""

from __future__ import annotations

import ast
import pickle
import re
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import bridge
from bridge import cli, naming
from bridge.errors import BridgeError, TensorSetError
from bridge.megatron_io import DistCheckpoint, resolve_checkpoint_dir
from bridge.megatron_layout import (
    KV_NORM,
    LAYOUTS,
    PRE_MLP_NORM,
    Q_NORM,
    resolve_checkpoint,
    stored_layout_keys,
    to_layout,
)
from bridge.tables import HFLayout, expand_for, megatron_layout_for
from megatron_glm5 import testing
from megatron_glm5.config import parse_hf_config
from tests.bridge_workers import make_fixture, save_with_megatron_core

CONFIGS = {"glm5": testing.tiny_glm5_config, "glm52": testing.tiny_glm52_config}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


def _expansion(name: str):
    arch = parse_hf_config(CONFIGS[name]())
    return arch, expand_for(arch, HFLayout("per_expert"))


# --------------------------------------------------------------------------------------------------------------------
# The table against megatron-core's own specs
# --------------------------------------------------------------------------------------------------------------------


def _marker(name: str) -> type:
    return type(name, (), {})


_NORM, _LINEAR, _COLUMN, _ROW, _NORM_LINEAR = (_marker(n) for n in ("Norm", "Linear", "Column", "Row", "NormLinear"))


def _recording_backend():
    """A backend like TE's (it fuses a norm into the next column-parallel linear when the spec lets it) whose
    modules are markers: what megatron-core's spec functions chose is read off the spec."""
    from megatron.core.models.backends import BackendSpecProvider

    class Recording(BackendSpecProvider):
        def linear(self):
            return _LINEAR

        def column_parallel_linear(self):
            return _COLUMN

        def row_parallel_linear(self):
            return _ROW

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return _NORM_LINEAR

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return _NORM

        def core_attention(self):
            return _marker("Core")

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            return _marker("Experts")

        def activation_func(self):
            return None

    return Recording


def _fused(layer) -> set:
    """The norms a layer spec fuses: the norm is an IdentityOp and the linear it feeds is a norm+linear module."""
    from megatron.core.transformer.identity_op import IdentityOp

    attention = layer.self_attention.submodules
    mlp = getattr(getattr(layer.mlp, "keywords", {}).get("submodules"), "linear_fc1", None)
    pairs = {PRE_MLP_NORM: (layer.pre_mlp_layernorm, mlp), Q_NORM: (attention.q_layernorm, attention.linear_q_up_proj),
             KV_NORM: (attention.kv_layernorm, attention.linear_kv_up_proj)}
    return {f for f, (norm, linear) in pairs.items() if norm is IdentityOp and linear is _NORM_LINEAR}


def test_te_layouts_fuse_what_megatron_core_specs_fuse(monkeypatch):
    """``te``: megatron-core 0.19.2's DSA spec (what Megatron-Bridge's GLM5Bridge builds) fuses only a dense layer's
    pre-MLP norm (the indexer needs the normalised q); ``te-fused-qk``: its MLA TE spec also fuses the q/kv norms."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )

    from megatron_glm5.glm5.mcore_config import build_transformer_config

    arch = parse_hf_config(testing.tiny_glm52_config())
    specs = get_transformer_layer_with_experimental_attention_variant_spec(build_transformer_config(arch),
                                                                           backend=_recording_backend()())
    want = {"dense": set(LAYOUTS["te"].fused), "sparse": set()}
    assert [_fused(s.submodules) for s in specs] == [want[kind] for kind in arch.mlp_layer_types]
    assert "dense" in arch.mlp_layer_types and "sparse" in arch.mlp_layer_types

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _recording_backend())
    mla = {kind: _fused(gpt_layer_specs.get_gpt_layer_with_transformer_engine_submodules(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True, multi_latent_attention=True))
        for kind, experts in (("dense", None), ("sparse", 8))}
    assert mla == {"dense": set(LAYOUTS["te-fused-qk"].fused), "sparse": {Q_NORM, KV_NORM}}
    assert LAYOUTS["local"].fused == ()


# --------------------------------------------------------------------------------------------------------------------
# NVIDIA Megatron-Bridge 0.6.2's GLM-5 table as the outside oracle
# --------------------------------------------------------------------------------------------------------------------

MEGATRON_BRIDGE = "0.6.2"
# Entries of its table that name no tensor of a GLM-5.x model in megatron-core 0.19.2, with the reason.
NOT_GLM5 = {
    r"\.linear_qkv\.": "non-MLA attention (fused QKV); GLM-5.x is MLA",
    r"^mtp\.final_layernorm\.weight$": "its MTP loop rewrites the decoder's final-norm entry ('decoder' -> 'mtp'); "
                                       "megatron-core's MTP block has no final norm, each MTP layer has its own",
}


def _megatron_bridge_table(num_layers: int, mtp_layers: int) -> list[tuple[str, tuple[str, ...]]]:
    """``(megatron pattern, HF names in role order)`` of ``GLM5Bridge.mapping_registry``, run from the installed
    wheel's source with recording stand-ins for its mapping classes (importing the module would need Transformer
    Engine and the rest of Megatron-Bridge's dependencies)."""
    try:
        dist = metadata.distribution("megatron-bridge")
    except metadata.PackageNotFoundError:
        pytest.skip(f"megatron-bridge=={MEGATRON_BRIDGE} is not installed (scripts/setup.sh installs it, --no-deps)")
    if dist.version != MEGATRON_BRIDGE:
        pytest.skip(f"megatron-bridge {dist.version} installed; this oracle reads {MEGATRON_BRIDGE}'s table")
    source = Path(dist.locate_file("megatron/bridge/models/glm_moe_dsa/glm5_bridge.py")).read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "GLM5Bridge")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "mapping_registry")
    fn.returns = None
    namespace = {
        "AutoMapping": lambda megatron_param, hf_param: (megatron_param, (hf_param,)),
        "GatedMLPMapping": lambda megatron_param, gate, up: (megatron_param, (gate, up)),
        "QKVMapping": lambda megatron_param, q, k, v: (megatron_param, (q, k, v)),
        "MegatronMappingRegistry": lambda *mappings: list(mappings),
    }
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "glm5_bridge.py", "exec"), namespace)
    config = SimpleNamespace(num_hidden_layers=num_layers, num_nextn_predict_layers=mtp_layers)
    return namespace["mapping_registry"](SimpleNamespace(hf_config=config))


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\*\*", "(.*)").replace(r"\*", r"(\d+)") + "$")


def _resolve(template: str, captures: tuple[str, ...]) -> str:
    for c in captures:
        template = template.replace("*", c, 1)
    return template


def _in_memory_names(expansion, layout) -> dict[str, tuple[str, ...]]:
    """Megatron parameter names of a model that loads ``layout`` (what Megatron-Bridge's table is written against)
    -> the HF tensors of each. Stored keys are parameter names but for two cases: a stacked expert row is
    ``local_experts.{e}`` in ``SequentialMLP`` and, in a TE build with grouped GEMM, ``TEGroupedMLP``'s
    ``weight{e}``; the MTP inner layer stored as ``transformer_layer`` is megatron-core 0.19.2's module
    ``mtp_model_layer`` (other Megatron-LM versions and forks name the module ``transformer_layer``)."""
    stored = {naming.stored_key(n): tuple(r.name for r in m.hf) for n, m in expansion.by_mcore.items()}
    renamed = to_layout({k for k, _ in stored}, layout)
    out = {}
    for (key, row), hf in stored.items():
        key = renamed.get(key, key)
        stack = naming.expert_stack(key)
        if stack is None:
            names = [key]
        else:
            pre, lin = stack
            names = [f"{pre}.local_experts.{row}.{lin}.weight"] + ([f"{pre}.{lin}.weight{row}"]
                                                                     if layout.te_extra_state else [])
        for name in names:
            out[name] = hf
            out[name.replace(".transformer_layer.", f".{naming.MTP_INNER}.")] = hf
    return out


def _applicable(compiled, hf_names: set[str], num_layers: int) -> list[tuple[str, str]]:
    """``(entry, concrete Megatron name)`` for every entry of the table and wildcard values under which it names
    tensors of this model: its HF tensors exist, a decoder layer index is one of the decoder's (its ``decoder.layers.*``
    wildcard also matches the HF MTP layer ``model.layers.{N}``) and, for a TE-fused norm
    (``{linear}.layer_norm_weight``), the linear it is fused into exists there too (a MoE layer has no
    ``mlp.linear_fc1``). Entries of :data:`NOT_GLM5` never."""
    captures: dict[str, set[tuple[str, ...]]] = {}
    for pattern, megatron, hfs in compiled:
        first = _pattern(hfs[0])
        found = {m.groups() for n in hf_names if (m := first.match(n))}
        captures[megatron] = {c for c in found if all(_resolve(h, c) in hf_names for h in hfs)}
    out = []
    for pattern, megatron, hfs in compiled:
        if any(re.search(x, megatron) for x in NOT_GLM5):
            continue
        found = captures[megatron]
        if megatron.endswith(".layer_norm_weight"):
            found &= captures.get(megatron.removesuffix("layer_norm_weight") + "weight", set())
        if megatron.startswith("decoder.layers.*"):
            found = {c for c in found if int(c[0]) < num_layers}
        out += [(megatron, _resolve(megatron, c)) for c in sorted(found)]
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_bridge_glm5_table_is_the_oracle(name):
    arch, expansion = _expansion(name)
    table = _megatron_bridge_table(arch.num_hidden_layers, arch.num_nextn_predict_layers)
    compiled = [(_pattern(m), m, hf) for m, hf in table]
    written = {layout: _in_memory_names(expansion, LAYOUTS[layout]) for layout in LAYOUTS}
    # every name a layout writes is in its table, mapped to the same HF tensors (gate / up in order)
    for layout, names in written.items():
        for param, hf in names.items():
            resolved = {tuple(_resolve(h, m.groups()) for h in hfs) for p, _, hfs in compiled if (m := p.match(param))}
            assert resolved == {hf}, f"{layout}: {param} -> ours {hf}, Megatron-Bridge's {resolved or 'no entry'}"
    # every name of its table that applies to this model is written by one of our layouts, and its TE spellings
    # (fused norms, TEGroupedMLP's weight{e}) by our TE layouts; the table lists each tensor's alternatives
    applicable = _applicable(compiled, {r.name for m in expansion.maps for r in m.hf}, arch.num_hidden_layers)
    assert len({entry for entry, _ in applicable}) > 40
    unwritten = sorted(param for _, param in applicable if not any(param in names for names in written.values()))
    assert not unwritten, f"names of Megatron-Bridge's table that no layout writes: {unwritten}"
    te_only = {param for _, param in applicable if param not in written["local"]}
    assert te_only and te_only <= set(written["te"]) | set(written["te-fused-qk"])
    fused = {param for param in te_only if param.endswith("layer_norm_weight")}
    assert fused <= set(written["te-fused-qk"]) and {p for p in fused if ".mlp." in p} <= set(written["te"])
    assert any(re.search(r"\.linear_fc1\.weight\d+$", p) for p in te_only)


# --------------------------------------------------------------------------------------------------------------------
# Detection from keys
# --------------------------------------------------------------------------------------------------------------------


def _shapes(expansion, layout: str) -> dict[str, tuple[int, ...]]:
    """Stored keys of ``layout`` with stand-in shapes (the expert axis real: it says how many experts a key holds)."""
    return {k: (n, 1) if n else (1,) for k, n in stored_layout_keys(expansion.by_mcore, LAYOUTS[layout]).items()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_is_detected_from_its_keys(layout):
    arch, expansion = _expansion("glm52")
    found = resolve_checkpoint(_shapes(expansion, layout), expansion.by_mcore, layouts=tuple(LAYOUTS), source="ckpt")
    assert found.layout.name == layout and found.form == "stacked"
    assert set(found.sources) == set(expansion.by_mcore)


def test_a_mixed_or_unknown_layout_is_refused_naming_the_first_unmatched_key():
    arch, expansion = _expansion("glm52")
    shapes = _shapes(expansion, "te")
    # layer 1 spelled as te-fused-qk, the rest as te: no layout has both spellings
    shapes.pop("decoder.layers.1.self_attention.q_layernorm.weight")
    shapes["decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight"] = (1,)
    with pytest.raises(TensorSetError, match=r"ckpt: the checkpoint's tensor keys fit no Megatron layout .*first "
                                             r"unmatched key 'decoder\.layers\.1\.self_attention\.linear_q_up_proj"
                                             r"\.layer_norm_weight' \(closest: the te layout, 1 of"):
        resolve_checkpoint(shapes, expansion.by_mcore, layouts=tuple(LAYOUTS), source="ckpt")
    # a key no layout knows
    shapes = _shapes(expansion, "local")
    shapes["decoder.layers.0.mlp.linear_fc1.some_new_weight"] = (1,)
    with pytest.raises(TensorSetError, match=r"first unmatched key 'decoder\.layers\.0\.mlp\.linear_fc1\.some_new_"
                                             r"weight' \(closest: the local layout"):
        resolve_checkpoint(shapes, expansion.by_mcore, layouts=tuple(LAYOUTS), source="ckpt")


def test_glm5_next_has_the_local_layout_only(fixtures, tmp_path):
    """GLM-5.3-Flash (no TE build exists to match): --megatron-layout te is refused naming the family, before any
    output or rank exists; its local checkpoints keep being detected (tests/test_glm5_next_bridge.py round trips)."""
    from megatron_glm5.families import parse_architecture
    from tests.glm5_next_fixtures import tiny_raw

    arch = parse_architecture(tiny_raw())
    assert megatron_layout_for(arch, "local", source="c").name == "local"
    with pytest.raises(BridgeError, match=r"c: --megatron-layout te: GLM-5.3-Flash Megatron checkpoints come in "
                                          r"the local layout only"):
        megatron_layout_for(arch, "te", source="c")
    with pytest.raises(BridgeError, match=r"--megatron-layout 'tee': expected one of local, te, te-fused-qk"):
        megatron_layout_for(arch, "tee", source="c")


# --------------------------------------------------------------------------------------------------------------------
# Round trips (single process; TP / PP / EP in tests/test_bridge_parallel.py)
# --------------------------------------------------------------------------------------------------------------------


def _logits(model, seed: int = 3, seq_len: int = 48) -> torch.Tensor:
    ids = torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(ids, torch.arange(seq_len).unsqueeze(0), None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_te_layouts_roundtrip_and_load_like_the_local_one(fixtures, tmp_path, capsys, model_parallel, name):
    """HF -> TE-layout checkpoint -> HF is bitwise; the checkpoint loads into our local-provider model with the
    local-layout load's logits, bitwise; the CLI's export detects the layout without a flag."""
    src = make_fixture(fixtures, name)
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "local")
    local = _logits(bridge.load_megatron_checkpoint(tmp_path / "local"))
    local_tilelang = _logits(bridge.load_megatron_checkpoint(tmp_path / "local", backend="tilelang"))
    local_objects = set(DistCheckpoint(resolve_checkpoint_dir(tmp_path / "local")).objects)
    for layout in ("te", "te-fused-qk"):
        mc = tmp_path / layout
        assert cli.main(["convert", "import", "--hf-path", str(src), "--megatron-path", str(mc), "--megatron-layout",
                         layout, "--no-progress"]) == 0
        assert f"{layout} Megatron layout" in capsys.readouterr().out
        ckpt = DistCheckpoint(resolve_checkpoint_dir(mc))
        fused = {f.fused_key for f in LAYOUTS[layout].fused}
        layer = re.compile(r"^(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.")
        assert {layer.sub("", k) for k in ckpt.tensors if k.endswith("layer_norm_weight")} == fused
        assert "decoder.layers.0.pre_mlp_layernorm.weight" not in ckpt.tensors
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in ckpt.tensors  # MoE: the router takes no norm
        # TE's extra state for every TE module, a superset of what the local modules store; empty (no FP8)
        extra = {k for k in ckpt.objects if "._extra_state/" in k}
        assert local_objects - {"common_state/shard_0_1"} < extra
        assert "decoder.layers.0.input_layernorm._extra_state/shard_0_1" in extra
        assert "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_7_8" in extra
        assert not any(".router." in k or k.startswith(("embedding.", "output_layer.")) for k in extra)
        value = ckpt.read_object("decoder.layers.0.mlp.linear_fc1._extra_state/shard_0_1")
        assert value.dtype == torch.uint8 and value.numel() == 0

        assert cli.main(["convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / f"hf_{layout}"),
                         "--no-progress"]) == 0
        assert f"read as the {layout} Megatron layout, stacked expert keys" in capsys.readouterr().out
        report = bridge.compare_hf_checkpoints(src, tmp_path / f"hf_{layout}")
        assert report["ok"] and report["bitwise_equal"] == report["tensors"], report["mismatches"]
        assert torch.equal(_logits(bridge.load_megatron_checkpoint(mc)), local), layout
        assert torch.equal(_logits(bridge.load_megatron_checkpoint(mc, backend="tilelang")), local_tilelang), layout
    if name == "glm5":
        assert cli.main(["convert", "roundtrip", "--hf-path", str(src), "--megatron-layout", "te", "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert "-> HF: BITWISE IDENTICAL" in out and "megatron layout  : te\n" in out


def test_extra_state_the_checkpoint_lacks_is_not_asked_for(fixtures, tmp_path, monkeypatch, model_parallel):
    """A model built with Transformer Engine modules asks for extra state a checkpoint may not hold (a TE norm's, in
    a local-layout checkpoint): it is not asked for, so the load works with or without TE installed."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from bridge.megatron_io import load_into_model
    from megatron_glm5.model import build_model, default_cpu_policy

    src = make_fixture(fixtures, "glm52")
    mc = bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc")["path"]
    model = build_model(parse_hf_config(testing.tiny_glm52_config()), default_cpu_policy())
    own = model.sharded_state_dict
    key = "decoder.layers.0.input_layernorm._extra_state"

    def with_te_norm_state(*args, **kwargs):
        ssd = own(*args, **kwargs)
        ssd[key] = ShardedObject(key, torch.empty(0, dtype=torch.uint8), (1,), (0,), replica_id=(0, 0, 0))
        return ssd

    monkeypatch.setattr(model, "sharded_state_dict", with_te_norm_state)
    assert load_into_model(model, mc) == "local"
    assert torch.equal(_logits(model), _logits(bridge.load_megatron_checkpoint(mc)))


def test_singleton_local_shards_checkpoints_in_any_layout(fixtures, tmp_path, model_parallel):
    """megatron-core's own save in the singleton_local_shards form (``experts.experts.{e}.linear_fc1.weight_w/_v``,
    ``linear_fc1.weight_w/_v``), in the te-fused-qk layout and without bridge metadata, as another tool's run
    leaves it: export with --hf-config gives the source back bitwise, our model loads it to the same logits."""
    src = make_fixture(fixtures, "glm52")
    model = bridge.load_megatron_checkpoint(bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc")
                                            ["path"])
    local = _logits(model)
    mc = save_with_megatron_core(model, tmp_path / "single", layout="te-fused-qk", singleton=True)
    keys = set(DistCheckpoint(resolve_checkpoint_dir(mc)).tensors)
    assert {"decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w", "decoder.layers.0.mlp.linear_fc1.weight_v",
            "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight"} <= keys
    r = bridge.convert_megatron_to_hf(megatron_path=mc, hf_path=tmp_path / "hf", hf_config=src / "config.json")
    assert (r["megatron_layout"], r["megatron_experts"]) == ("te-fused-qk", "singleton")
    report = bridge.compare_hf_checkpoints(src, tmp_path / "hf")
    assert report["ok"] and report["bitwise_equal"] == report["tensors"], report["mismatches"]
    assert torch.equal(_logits(bridge.load_megatron_checkpoint(mc, hf_config=src / "config.json")), local)


def test_unknown_layout_is_refused_by_export_and_load(fixtures, tmp_path, capsys, model_parallel):
    """A checkpoint with a key no layout has: the CLI export and the in-memory load name it (first unmatched)."""
    src = make_fixture(fixtures, "glm52")
    model = bridge.load_megatron_checkpoint(bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc")
                                            ["path"])
    mc = save_with_megatron_core(model, tmp_path / "odd", layout="te", singleton=False)
    ckpt_dir = resolve_checkpoint_dir(mc)
    md = DistCheckpoint(ckpt_dir).metadata  # rename one stored key in .metadata (the data files stay as they are)
    old, new = "decoder.layers.2.input_layernorm.weight", "decoder.layers.2.input_norm.weight"
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md.storage_data = {(type(i)(new, i.offset, i.index) if i.fqn == old else i): v for i, v in md.storage_data.items()}
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(md))
    code = cli.main(["convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / "hf"),
                     "--hf-config", str(src / "config.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "first unmatched key 'decoder.layers.2.input_norm.weight'" in err, err
    with pytest.raises(TensorSetError, match=r"first key the model asks for and the checkpoint lacks "
                                             r"'decoder\.layers\.2\.input_layernorm\.weight'"):
        bridge.load_megatron_checkpoint(mc, hf_config=src / "config.json")


def test_a_checkpoint_without_mtp_names_the_fix(fixtures, tmp_path, model_parallel):
    """NVIDIA Megatron-Bridge trains GLM-5 without MTP by default: read with the released config.json (which has an
    MTP layer), export and load say how to read it without MTP."""
    src = make_fixture(fixtures, "glm52")
    no_mtp = make_fixture(tmp_path, "glm52", num_nextn_predict_layers=0)
    mc = bridge.convert_hf_to_megatron(hf_path=no_mtp, megatron_path=tmp_path / "mc", megatron_layout="te")["path"]
    fix = r"no MTP layer .*\"num_nextn_predict_layers\": 0"
    with pytest.raises(TensorSetError, match=r"\(te Megatron layout\): \d+ missing: mtp\.layers\.0\..*" + fix):
        bridge.convert_megatron_to_hf(megatron_path=mc, hf_path=tmp_path / "hf", hf_config=src / "config.json")
    with pytest.raises(TensorSetError, match=r"lacks 'mtp\.layers\.0\..*" + fix):
        bridge.load_megatron_checkpoint(mc, hf_config=src / "config.json")
