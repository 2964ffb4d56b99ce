"""``verify``: our megatron-core model against transformers on the tiny fixtures (fp32 and bf16, whole and
layer-truncated), sequence > index_topk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import bridge
import bridge.source
from bridge.errors import BridgeError
from bridge.parity import _boundary_ties
from tests.bridge_workers import make_fixture

SEQ_LEN = 64  # > index_topk (16): the indexer really selects
SEED = 1  # a token draw with no top-k boundary ties on these fixtures (asserted below)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.mark.parametrize("name", ["glm5", "glm52", "glm52_fused"])
def test_logits_match_transformers(fixtures, name, model_parallel):
    src = make_fixture(fixtures, name)
    r = bridge.verify(hf_path=src, seq_len=SEQ_LEN, seed=SEED)
    assert r["topk_boundary_ties"] == 0, "fixture/seed has tied top-k boundaries; pick another seed"
    assert r["max_abs_logit_diff"] <= 1e-4, r
    assert r["logit_cosine"] > 1 - 1e-6 and r["argmax_agreement"] == 1.0
    assert r["first_divergent_layer"] is None, r["layer_max_rel_diff"]
    full = [str(i) for i, t in enumerate(bridge.mapping.layer_kinds(
        bridge.source.open_hf_source(src).arch)) if t.indexer == "full" and i < len(r["layer_max_rel_diff"])]
    assert sorted(r["topk_overlap"]) == full and all(v == 1.0 for v in r["topk_overlap"].values())
    # the indexer recall diagnostic: one (captured, best) pair per full layer (+ MTP), 0 < captured <= best <= 1
    assert len(r["indexer_recall"]) >= len(full)
    assert all(0 < c <= b + 1e-6 <= 1 + 1e-6 for c, b in r["indexer_recall"]), r["indexer_recall"]


def test_verify_from_megatron_checkpoint(fixtures, tmp_path, model_parallel):
    src = make_fixture(fixtures, "glm52")
    bridge.convert_hf_to_megatron(hf_path=src, megatron_path=tmp_path / "mc")
    r = bridge.verify(hf_path=src, megatron_path=tmp_path / "mc", seq_len=SEQ_LEN, seed=SEED, batch_size=2)
    assert r["ok"] and r["max_abs_logit_diff"] <= 1e-4 and r["batch_size"] == 2
    # the replay reorders HF's [b, s] rows into megatron-core's [s, b] ones: with two sequences a mix-up would show
    assert r["max_abs_logit_diff_with_hf_topk"] <= 1e-4 and r["min_choice_agreement_on_hf_inputs"] == 1.0
    assert r["topk_rows_differing"] == 0 and all(v == 1.0 for v in r["topk_overlap"].values())
    # layer-truncated from the Megatron checkpoint: dist_checkpointing.load reads only the kept layers' keys
    r = bridge.verify(hf_path=src, megatron_path=tmp_path / "mc", num_layers=3, seq_len=SEQ_LEN, seed=SEED)
    assert r["ok"] and r["layers_checked"] == [0, 1, 2] and r["max_abs_logit_diff"] <= 1e-4, r


def test_tied_topk_rows_are_told_apart_from_bugs(tmp_path, model_parallel):
    """A checkpoint built so that layer 0's indexer scores every key exactly 0 (``wk`` and the ``k_norm`` bias zero:
    every indexer key is the zero vector): every row with more than index_topk keys has its top-k boundary on a tie,
    our selection (ties to the lower index) and torch.topk's keep different keys and the logits differ by O(1).
    verify must see that the difference is confined to tied rows and that with HF's selection fed to our layers the
    logits agree."""
    from megatron_glm5.testing import make_hf_state_dict, tiny_glm52_config, write_hf_checkpoint

    raw = tiny_glm52_config()
    sd = make_hf_state_dict(raw, seed=3)
    for name in ("model.layers.0.self_attn.indexer.wk.weight", "model.layers.0.self_attn.indexer.k_norm.bias"):
        sd[name] = torch.zeros_like(sd[name])
    src = write_hf_checkpoint(tmp_path / "tied", raw, state_dict=sd)
    r = bridge.verify(hf_path=src, seq_len=SEQ_LEN, seed=0)
    assert r["topk_boundary_ties"] >= SEQ_LEN - raw["index_topk"], "every row past index_topk is tied in layer 0"
    assert r["topk_rows_differing"] > 0 and r["max_abs_logit_diff"] > 1e-2, "the tie order must matter here"
    assert r["topk_differences_only_at_ties"]
    assert r["max_abs_logit_diff_with_hf_topk"] <= 1e-4 and r["ok"]


def test_verify_needs_a_sequence_longer_than_topk(fixtures):
    with pytest.raises(BridgeError, match="must exceed index_topk"):
        bridge.verify(hf_path=make_fixture(fixtures, "glm5"), seq_len=16)


def test_boundary_tie_detection():
    scores = torch.arange(36.0).reshape(1, 6, 6)  # distinct scores: no ties
    assert _boundary_ties(scores, 3) == set()
    scores[0, 5] = torch.tensor([3.0, 2.0, 1.0, 1.0, 0.5, 0.2])  # row 5, topk 3: third and fourth best are equal
    assert _boundary_ties(scores, 3) == {(0, 5)}
    scores[0, 4, :5] = 0.0  # an all-zero (ReLU plateau) row is a tie too
    assert _boundary_ties(scores, 3) == {(0, 4), (0, 5)}


# --------------------------------------------------------------------------------------------------------------------
# Layer-truncated verify (--num-layers): only the kept layers are read, on both sides; fp32 and bf16
# --------------------------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class _RecordingSafeOpen:
    """Wraps transformers' ``safe_open`` handle: records the names of the tensors its loader materialises (reading
    happens when a ``get_slice`` result is indexed)."""

    def __init__(self, handle, read: list):
        self._handle, self._read = handle, read

    def get_slice(self, name):
        handle, read = self._handle.get_slice(name), self._read

        class Slice:
            def __getitem__(self, item):
                read.append(name)
                return handle[item]

            def __getattr__(self, attr):
                return getattr(handle, attr)

        return Slice()

    def __getattr__(self, attr):
        return getattr(self._handle, attr)


@pytest.fixture
def read_names(monkeypatch):
    """{"ours": [...], "hf": [...]}: every HF tensor read by our reader and by transformers' loader."""
    import transformers.modeling_utils

    from bridge import hf_io

    names = {"ours": [], "hf": []}
    real_read, real_open = hf_io.HFCheckpointReader.read, transformers.modeling_utils.safe_open

    def read(self, name, *args, **kwargs):
        names["ours"].append(name)
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(hf_io.HFCheckpointReader, "read", read)
    monkeypatch.setattr(transformers.modeling_utils, "safe_open",
                        lambda *a, **k: _RecordingSafeOpen(real_open(*a, **k), names["hf"]))
    return names


def _layers(names) -> set[int]:
    return {int(m.group(1)) for n in names if (m := _LAYER.match(n))}


@pytest.fixture(scope="module")
def glm52_bf16(tmp_path_factory):
    """The tiny GLM-5.2 stored in bf16, like the released checkpoints (bf16 runs are meant for those: an fp32
    checkpoint would keep HF's fp32-pinned router and indexer weights more precise than ours)."""
    from megatron_glm5 import testing

    return testing.write_hf_checkpoint(tmp_path_factory.mktemp("bf16") / "glm52", testing.tiny_glm52_config(),
                                       dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_layer_truncated_verify_reads_only_the_kept_layers(fixtures, glm52_bf16, read_names, capsys, dtype,
                                                            model_parallel):
    """--num-layers 2 of the 4-layer GLM-5.2 ([full, shared | full, shared], 1 dense + 3 MoE, 1 MTP): both sides
    read tensors of layers 0 and 1 only (plus embeddings, final norm, LM head), the report names the checked and
    skipped layers, and it passes in fp32 and in bf16 at the default sequence length (index_topk + 256 -> 320)."""
    from bridge import cli

    src = make_fixture(fixtures, "glm52") if dtype == "fp32" else glm52_bf16
    assert cli.main(["verify", "--hf-path", str(src), "--num-layers", "2", "--dtype", dtype, "--seed", str(SEED)]) == 0
    report = json.loads(capsys.readouterr().out.strip())
    assert report["ok"], report
    assert report["layers_checked"] == [0, 1] and report["num_layers"] == 2 and report["num_hidden_layers"] == 4
    assert report["layers_skipped"] == [2, 3] and report["mtp_layers_skipped"] == [0] and not report["mtp_loaded"]
    assert report["seq_len"] == 320 and report["dtype"] == dtype and report["device"] == "cpu"
    assert set(report["topk_overlap"]) == {"0"}  # layer 1 is 'shared': indexer_types[:2] = [full, shared]
    for side in ("ours", "hf"):
        assert _layers(read_names[side]) == {0, 1}, (side, sorted(_layers(read_names[side])))
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(read_names[side]), side
    source = bridge.source.open_hf_source(src, num_layers=2)
    assert report["hf_tensors_skipped"] == len(source.skipped) == sum(
        1 for n in source.reader.names if _LAYER.match(n) and int(_LAYER.match(n).group(1)) >= 2)
    if dtype == "fp32":
        assert report["max_abs_logit_diff"] <= 1e-4 and report["first_divergent_layer"] is None
    else:  # bf16: the replayed mean within tol, choices agree on HF's activations; the reasons are in parity.py
        assert report["mean_rel_logit_diff_with_hf_topk"] <= report["tol"] == 2e-2
        assert report["min_choice_agreement_on_hf_inputs"] >= 0.95 and report["logit_cosine"] > 0.99


def test_bf16_verify_fails_a_wrong_expert_order(glm52_bf16, model_parallel):
    """bf16 is not a rubber stamp: two experts swapped in layer 1 fail it (the mean difference and the choices)."""
    model = bridge.from_hf_pretrained(glm52_bf16, params_dtype=torch.bfloat16, num_layers=2)
    with torch.no_grad():
        experts = model.decoder.layers[1].mlp.experts.local_experts
        a, b = experts[0].linear_fc2.weight, experts[1].linear_fc2.weight
        a_copy = a.clone()
        a.copy_(b)
        b.copy_(a_copy)
    r = bridge.verify(hf_path=glm52_bf16, model=model, num_layers=2, dtype="bf16", seed=SEED)
    assert not r["ok"] and r["mean_rel_logit_diff_with_hf_topk"] > 5 * r["tol"], r


def test_layer_subset_source_lists_what_it_skips(fixtures, tmp_path):
    """Strict accounting in layer-subset mode: the whole checkpoint is checked, the tensors of layers >= N and of
    MTP are listed with a reason (never silently dropped), and a missing tensor in a skipped layer is still an
    error."""
    from bridge.errors import TensorSetError
    from bridge.source import open_hf_source, truncate_hf_config
    from megatron_glm5.config import load_hf_config, parse_hf_config

    src_dir = make_fixture(fixtures, "glm52")
    full = open_hf_source(src_dir)
    sub = open_hf_source(src_dir, num_layers=3)
    kept = set(sub.expansion.hf_shapes())
    assert kept | set(sub.skipped) == set(full.expansion.hf_shapes()) and not kept & set(sub.skipped)
    assert _layers(kept) == {0, 1, 2} and _layers(sub.skipped) == {3, 4}
    assert sub.skipped["model.layers.3.input_layernorm.weight"] == \
        "decoder layer 3 >= num_layers 3: not part of the layer-truncated model"
    assert sub.skipped["model.layers.4.eh_proj.weight"] == "MTP layer 0: not part of a layer-truncated model"
    assert sub.arch.indexer_types == ("full", "shared", "full") and sub.arch.num_nextn_predict_layers == 0
    raw = truncate_hf_config(load_hf_config(src_dir), 1)
    assert parse_hf_config(raw).mlp_layer_types == ("dense",) and raw["indexer_types"] == ["full"]

    from megatron_glm5 import testing

    cfg = testing.tiny_glm52_config()
    sd = testing.make_hf_state_dict(cfg)
    del sd["model.layers.3.mlp.gate.weight"]
    broken = testing.write_hf_checkpoint(tmp_path / "broken", cfg, state_dict=sd)
    with pytest.raises(TensorSetError, match=r"1 missing: model\.layers\.3\.mlp\.gate\.weight"):
        open_hf_source(broken, num_layers=2)


def test_num_layers_and_seq_len_bounds(fixtures):
    src = make_fixture(fixtures, "glm52")
    for n in (0, 5, -1):
        with pytest.raises(BridgeError, match=rf"--num-layers {n}: expected 1 <= N <= num_hidden_layers \(4"):
            bridge.verify(hf_path=src, num_layers=n)
    from bridge.parity import default_seq_len
    from megatron_glm5.config import load_hf_config, parse_hf_config

    assert default_seq_len(parse_hf_config(load_hf_config(src))) == 320
    real = parse_hf_config(load_hf_config(Path(__file__).parent / "data" / "glm5_2_config.json"))
    assert real.index_topk == 2048 and default_seq_len(real) == 2304
