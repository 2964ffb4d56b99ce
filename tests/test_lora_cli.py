"""``megatron-glm5 lora export|import|merge``: a LoRA model's adapter-only Megatron checkpoint -> PEFT -> Megatron
checkpoint round trip (tensors unchanged, loadable into a model at the same values), a streaming merge into an HF
checkpoint from either adapter kind (= base + alpha/r * B @ A), and bad input as one ``error:`` line with exit 2."""

from __future__ import annotations

import pytest
import torch

from bridge import cli
from bridge.adapters import model_adapter_set, read_peft_dir
from bridge.hf_io import HFCheckpointReader
from bridge.lora_convert import adapters_from_checkpoint, merged_reference
from bridge.mapping import expand
from megatron_glm5 import from_hf_pretrained
from megatron_glm5.config import parse_hf_config
from megatron_glm5.lora import DEFAULT_TARGET_MODULES, LoraConfig, add_lora, lora_parameters
from megatron_glm5.lora_checkpoint import load_lora_checkpoint, save_lora_checkpoint
from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    raw = tiny_glm52_config()
    return raw, write_hf_checkpoint(tmp_path_factory.mktemp("hf"), raw, seed=3)


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_lora_export_import_round_trip(hf, tmp_path, capsys, model_parallel):
    raw, path = hf
    model = from_hf_pretrained(path)
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False))
    save_lora_checkpoint(model, tmp_path / "adapters")  # records the HF config (from_hf_pretrained keeps it)

    rc, out, _ = _run(capsys, "lora", "export", "--megatron-path", str(tmp_path / "adapters"), "--adapter-path",
                      str(tmp_path / "peft"))
    assert rc == 0 and "target_parameters ['gate_up_proj', 'down_proj']" in out, out
    rc, out, _ = _run(capsys, "lora", "import", "--adapter-path", str(tmp_path / "peft"), "--megatron-path",
                      str(tmp_path / "imported"), "--hf-config", str(path))
    assert rc == 0, out
    before, _ = adapters_from_checkpoint(tmp_path / "adapters")
    after, _ = adapters_from_checkpoint(tmp_path / "imported")
    assert set(before) == set(after)
    assert all(torch.equal(before[k].a, after[k].a) and torch.equal(before[k].b, after[k].b)
               and before[k].alpha == after[k].alpha for k in before)
    fresh = add_lora(from_hf_pretrained(path), LoraConfig(4, 8))
    load_lora_checkpoint(fresh, tmp_path / "imported" / "iter_0000000")
    want = dict(lora_parameters(model))
    assert all(torch.equal(p, want[n]) for n, p in lora_parameters(fresh))


@pytest.mark.parametrize("kind", ["peft", "megatron"])
def test_lora_merge(hf, tmp_path, capsys, model_parallel, kind):
    """Both adapter kinds; the Megatron one also adapts the dense MLP and shared experts (no PEFT form)."""
    raw, path = hf
    model = from_hf_pretrained(path)
    merge_only = [] if kind == "peft" else ["dense_mlp", "shared_experts"]
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False, target_modules=[*DEFAULT_TARGET_MODULES, *merge_only]))
    if kind == "peft":
        import bridge

        bridge.export_peft_adapter(model, tmp_path / "adapter")
    else:
        save_lora_checkpoint(model, tmp_path / "adapter")
    rc, out, _ = _run(capsys, "lora", "merge", "--hf-path", str(path), "--adapter-path", str(tmp_path / "adapter"),
                      "--out", str(tmp_path / "merged"), "--no-progress")
    assert rc == 0 and f"({kind})" in out, out
    src, merged = HFCheckpointReader(path), HFCheckpointReader(tmp_path / "merged")
    base = {n: src.read(n) for n in src.names}
    want = merged_reference(model_adapter_set(model), expand(parse_hf_config(raw)), base)
    assert sorted(merged.names) == sorted(src.names)
    for name in src.names:
        got = merged.read(name)
        assert got.dtype == base[name].dtype
        err = (got.double() - want[name]).abs().max().item()
        assert err <= 1e-6 * want[name].abs().max().item(), f"{name}: {err:.2e}"
    assert (tmp_path / "merged" / "config.json").read_text() == (path / "config.json").read_text()


def test_lora_cli_bad_input(hf, tmp_path, capsys, model_parallel):
    raw, path = hf
    rc, _, err = _run(capsys, "lora", "export", "--megatron-path", str(tmp_path / "nothing"), "--adapter-path",
                      str(tmp_path / "x"))
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "no such directory" in err, err
    rc, _, err = _run(capsys, "lora", "merge", "--hf-path", str(path), "--adapter-path", str(tmp_path),
                      "--out", str(tmp_path / "m"))
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    # a Megatron checkpoint without adapters
    rc, _, err = _run(capsys, "convert", "import", "--hf-path", str(path), "--megatron-path", str(tmp_path / "base"),
                      "--no-progress")
    assert rc == 0, err
    rc, _, err = _run(capsys, "lora", "export", "--megatron-path", str(tmp_path / "base"), "--adapter-path",
                      str(tmp_path / "peft"))
    assert rc == 2 and "holds no LoRA adapter tensors" in err, err
    # a PEFT adapter of another model
    other = tiny_glm52_config(hidden_size=96)
    other_path = write_hf_checkpoint(tmp_path / "other", other, seed=1)
    m = from_hf_pretrained(other_path)
    add_lora(m, LoraConfig(4, 8, target_modules=["o_proj"]))
    import bridge

    bridge.export_peft_adapter(m, tmp_path / "other_adapter")
    rc, _, err = _run(capsys, "lora", "import", "--adapter-path", str(tmp_path / "other_adapter"), "--megatron-path",
                      str(tmp_path / "imp"), "--hf-config", str(path))
    assert rc == 2 and "o_proj: lora_A [4, 128] / lora_B [96, 4] do not fit" in err and err.count("\n") == 1, err
    tensors, _ = read_peft_dir(tmp_path / "other_adapter")
    assert tensors


def test_lora_export_of_a_megatron_lm_full_checkpoint(hf, tmp_path, capsys, model_parallel):
    """What Megatron-LM's --save writes for a LoRA model (python -m megatron_glm5.pretrain --lora-rank 4 without
    --lora-base-checkpoint): base + adapters under their usual keys, and args with the --lora-* and --hf-config
    flags (no glm5_lora entry): `lora export` takes rank/alpha and the config from the args."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing

    raw, path = hf
    model = from_hf_pretrained(path)
    add_lora(model, LoraConfig(4, 8, init_lora_weights=False))
    ckpt = tmp_path / "save" / "iter_0000005"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 5,
                             "args": Namespace(lora_rank=4, lora_alpha=8.0, hf_config=str(path))}, str(ckpt))
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("5\n")
    rc, out, err = _run(capsys, "lora", "export", "--megatron-path", str(tmp_path / "save"), "--adapter-path",
                        str(tmp_path / "peft"))
    assert rc == 0, err
    tensors, cfg = read_peft_dir(tmp_path / "peft")
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["rank_pattern"] == {r".*\.gate_up_proj": 8}
    import bridge

    bridge.export_peft_adapter(model, tmp_path / "direct")
    direct, direct_cfg = read_peft_dir(tmp_path / "direct")
    assert set(tensors) == set(direct) and all(torch.equal(tensors[k], direct[k]) for k in direct)
    assert cfg["alpha_pattern"] == direct_cfg["alpha_pattern"]


def test_an_adapter_directory_without_adapter_config_is_named(hf, tmp_path, capsys):
    """Was (lora merge): "not a Megatron checkpoint ... an interrupted conversion leaves no tracker file" for a
    directory that simply lacks adapter_config.json. Both commands now name the missing file."""
    raw, path = hf
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    rc, _, err = _run(capsys, "lora", "import", "--adapter-path", str(adapter), "--megatron-path",
                      str(tmp_path / "o"), "--hf-config", str(path))
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--adapter-path {adapter}: missing adapter_config.json; expected a PEFT adapter directory" in err, err
    rc, _, err = _run(capsys, "lora", "merge", "--hf-path", str(path), "--adapter-path", str(adapter),
                      "--out", str(tmp_path / "m"))
    assert rc == 2 and err.count("\n") == 1 and "not a Megatron checkpoint" not in err, err
    assert f"--adapter-path {adapter}: missing adapter_config.json (and no latest_checkpointed_iteration.txt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_disk_full_during_lora_import_is_one_line(hf, tmp_path, model_parallel):
    """Was: exit 1 and a long `[rank0]` traceback ending in ENOSPC. Now one line, exit 2, nothing left behind."""
    import os
    import subprocess
    import sys

    import bridge
    from tests.bridge_workers import full_disk_env

    raw, path = hf
    model = from_hf_pretrained(path)
    add_lora(model, LoraConfig(4, 8))
    bridge.export_peft_adapter(model, tmp_path / "peft")
    out = tmp_path / "imported"
    proc = subprocess.run([sys.executable, "-m", "bridge.cli", "lora", "import", "--adapter-path",
                           str(tmp_path / "peft"), "--megatron-path", str(out), "--hf-config", str(path)],
                          capture_output=True, text=True, timeout=300, env=full_disk_env(tmp_path / "site"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [f"error: --megatron-path {out}: No space left on device"], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peft", "site"]
