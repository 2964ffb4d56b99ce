"""``megatron-glm5 rollout-parity``: both batch formats, replay on and off, the plot, the CLI error contract.

The rollout stand-in is transformers with its own q/kv latent norm eps (1e-6, a real, small numerical difference from
ours), whose log-probs are the batch's ``rollout_logprobs``; its "engine" top-k and routed experts are our model's
own choices encoded the way sglang returns them (base64, token-major, no row for the last token)."""

from __future__ import annotations

import base64
import importlib.util
import json

import pytest
import torch

from bridge import cli
from bridge.errors import BridgeError
from bridge.rollout_parity import RolloutBatch, load_batch, rollout_parity, save_batch
from megatron_glm5 import from_hf_pretrained
from megatron_glm5.rl.replay import capture_choices
from megatron_glm5.testing import load_hf_reference_model, tiny_glm52_config, write_hf_checkpoint
from tests.test_rl_logprobs import packed_batch
from megatron_glm5.parallel import destroy_model_parallel

RESPONSE = (30, 8, 20)  # rollout log-probs for the last R tokens of each sample (the "response")


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, gloo_world):

    from megatron_glm5.parallel import initialize_model_parallel

    raw = tiny_glm52_config()
    tmp = tmp_path_factory.mktemp("rollout_parity")
    path = write_hf_checkpoint(tmp / "hf", raw, seed=11)
    hf = load_hf_reference_model(path)  # transformers' own eps: a rollout engine that is slightly different
    seqs, ids, cu = packed_batch(raw["vocab_size"])
    initialize_model_parallel()
    try:
        choices = capture_choices(from_hf_pretrained(path), ids, cu)
    finally:
        destroy_model_parallel()
    samples = []
    cu_l = cu.tolist()
    for i, (s, r) in enumerate(zip(seqs, RESPONSE)):
        with torch.no_grad():
            logp = torch.log_softmax(hf(s[None]).logits[0].float() / 0.8, -1)
        token_lp = logp[:-1].gather(1, s[1:, None])[:, 0]  # log p(token t | < t) for t >= 1
        a, b = cu_l[i], cu_l[i + 1]

        def enc(x, a=a, b=b):
            return base64.b64encode(x[:, a:b - 1].permute(1, 0, 2).contiguous().numpy().tobytes()).decode()

        samples.append({"input_ids": s.tolist(), "rollout_logprobs": token_lp[-r:].tolist(),
                        "indexer_topk": enc(choices["indexer_topk"]), "routed_experts": enc(choices["routed_experts"])})
    batch_json = tmp / "batch.json"
    batch_json.write_text(json.dumps({"temperature": 0.8, "samples": samples}))
    return raw, path, batch_json, choices, tmp


def test_report_replay_on_and_off(rollout, capsys, model_parallel):
    raw, path, batch_json, choices, tmp = rollout
    plot = tmp / "parity.svg"
    assert cli.main(["rollout-parity", "--hf-path", str(path), "--batch", str(batch_json), "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["tokens"] == 80 and report["temperature"] == 0.8
    for side in ("replay_off", "replay_on"):
        m = report[side]
        assert m["tokens"] == sum(RESPONSE) and 0 <= m["kl"] < 1e-3 and m["abs_diff_max"] < 0.2, m
    print(f"\nrollout-parity: {report['replay_off']} / {report['replay_on']}")
    assert report["replayed"] == ["indexer_topk", "routed_experts"]
    assert set(report["indexer_overlap"]) == {"0", "2"} and set(report["routing_mismatch"]) == {"1", "2", "3"}
    assert all(v["mean"] > 0.9 for v in report["indexer_overlap"].values())
    svg = plot.read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and "top-k overlap" in svg

    # the same batch as safetensors (packed payload arrays, token-indexed rollout log-probs) gives the same numbers
    data = load_batch(batch_json)
    packed = RolloutBatch(input_ids=data.input_ids, cu_seqlens=data.cu_seqlens,
                          rollout_logprobs=data.rollout_logprobs, indexer_topk=choices["indexer_topk"],
                          routed_experts=choices["routed_experts"], temperature=0.8)
    st = save_batch(tmp / "batch.safetensors", packed)
    again = rollout_parity(hf_path=path, batch=st)
    assert again["replay_off"] == report["replay_off"]
    assert abs(again["replay_on"]["kl"] - report["replay_on"]["kl"]) < 1e-9


def test_max_kl_fails_the_check(rollout, capsys, model_parallel):
    """Was: exit 1 with nothing on stderr. Now one line says which KL exceeded the limit and by how much."""
    _, path, batch_json, _, _ = rollout
    assert cli.main(["rollout-parity", "--hf-path", str(path), "--batch", str(batch_json), "--max-kl", "1e-30"]) == 1
    out, err = capsys.readouterr()
    kl = json.loads(out.strip().splitlines()[-1])["replay_on"]["kl"]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("failed: rollout-parity: KL (replay on) "), err
    assert f"{kl:.4g} exceeds --max-kl 1e-30 by {kl - 1e-30:.4g}" in lines[0], (kl, lines[0])
    assert cli.main(["rollout-parity", "--hf-path", str(path), "--batch", str(batch_json), "--max-kl", "1"]) == 0
    assert capsys.readouterr().err == ""


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_user_errors_are_one_line_exit_2(rollout, capsys, model_parallel):
    raw, path, batch_json, _, tmp = rollout
    base = ["rollout-parity", "--hf-path", str(path), "--batch"]
    assert cli.main(base + [str(tmp / "missing.json")]) == 2
    assert "no such file" in _one_error_line(capsys)
    bad = tmp / "bad.json"
    bad.write_text("{not json")
    assert cli.main(base + [str(bad)]) == 2
    assert "not valid JSON" in _one_error_line(capsys)
    if importlib.util.find_spec("matplotlib") is None:
        assert cli.main(base + [str(batch_json), "--plot", str(tmp / "p.png")]) == 2
        assert "pip install matplotlib" in _one_error_line(capsys)
    assert cli.main(base + [str(batch_json), "--plot", str(tmp / "no" / "p.svg")]) == 2
    assert "does not exist" in _one_error_line(capsys)
    data = json.loads(batch_json.read_text())
    arr = torch.tensor(list(base64.b64decode(data["samples"][1]["indexer_topk"])), dtype=torch.uint8)
    topk = arr.view(torch.int32).view(8, 4, raw["index_topk"]).clone()  # [L - 1, layers, k]
    topk[3, 0, 0] = 6  # token 3 may not see position 6
    data["samples"][1]["indexer_topk"] = base64.b64encode(topk.numpy().tobytes()).decode()
    future = tmp / "future.json"
    future.write_text(json.dumps(data))
    assert cli.main(base + [str(future)]) == 2
    line = _one_error_line(capsys)
    assert "sample 1, layer 0, token 3: index 6 is in the future" in line


def test_log_probs_above_zero_or_nan_are_refused(rollout, capsys, model_parallel):
    """Was: a rollout log-prob of +5.0 (a probability > 1) was accepted and the KL computed from it. Now a value
    > 0, an infinity and (in JSON, where absent tokens are simply not listed) a NaN are refused, naming the sample,
    the position and the token."""
    raw, path, batch_json, _, tmp = rollout
    data = json.loads(batch_json.read_text())
    ids = data["samples"][1]["input_ids"]
    r = len(data["samples"][1]["rollout_logprobs"])
    base = ["rollout-parity", "--hf-path", str(path), "--batch"]
    for value, fragment in ((5.0, "rollout log-prob 5 of token"), (float("inf"), "rollout log-prob inf of token"),
                            (float("nan"), "sample 1 rollout_logprobs[2] is NaN")):
        bad = json.loads(batch_json.read_text())
        bad["samples"][1]["rollout_logprobs"][2] = value
        f = tmp / "bad_logprob.json"
        f.write_text(json.dumps(bad))  # Python's json writes NaN / Infinity, as engines' dumps do
        assert cli.main(base + [str(f)]) == 2
        line = _one_error_line(capsys)
        pos = len(ids) - r + 2
        assert fragment in line and f"{ids[pos]}" in line and f"position {pos}" in line, line
    # the packed format: NaN means "no log-prob here" and passes; +5 is refused
    loaded = load_batch(batch_json)
    packed = RolloutBatch(input_ids=loaded.input_ids, cu_seqlens=loaded.cu_seqlens,
                          rollout_logprobs=loaded.rollout_logprobs.clone(), temperature=0.8)
    assert packed.rollout_logprobs.isnan().any()
    packed.rollout_logprobs[10] = 5.0
    st = save_batch(tmp / "bad_logprob.safetensors", packed)
    assert cli.main(base + [str(st)]) == 2
    assert "rollout log-prob 5 of token" in _one_error_line(capsys)
    with pytest.raises(BridgeError, match="is not a log-probability"):
        rollout_parity(hf_path=path, batch=packed)
