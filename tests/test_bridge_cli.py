"""The ``megatron-glm5`` command line: frozen flags, convert / verify output, locally spawned ranks, the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge import cli
from tests.bridge_workers import make_fixture

REPO = Path(__file__).resolve().parent.parent

# Adding a flag is a deliberate change: update this table (torchtitan's test_no_new_cli_options idea).
FROZEN_FLAGS = {
    "demo": ["--keep", "--out", "--steps"],
    "convert import": ["--dtype", "--ep", "--hf-path", "--iteration", "--megatron-path", "--no-progress",
                       "--overwrite", "--pp", "--tp"],
    "convert export": ["--dtype", "--expert-layout", "--hf-config", "--hf-path", "--max-shard-size",
                       "--megatron-path", "--no-progress", "--overwrite"],
    "convert roundtrip": ["--ep", "--hf-path", "--keep", "--no-progress", "--pp", "--tp", "--work-dir"],
    "verify": ["--batch-size", "--hf-path", "--megatron-path", "--seed", "--seq-len", "--tol"],
    "lora export": ["--adapter-path", "--hf-config", "--megatron-path", "--overwrite"],
    "lora import": ["--adapter-path", "--hf-config", "--megatron-path", "--overwrite"],
    "lora merge": ["--adapter-path", "--hf-path", "--max-shard-size", "--no-progress", "--out", "--overwrite"],
}


def _flags(parser) -> dict[str, list[str]]:
    import argparse

    out = {}

    def walk(p, prefix):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
        opts = sorted(o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help")
        if prefix and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            out[prefix] = opts

    walk(parser, "")
    return out


def test_cli_flags_are_frozen():
    assert _flags(cli.build_parser()) == FROZEN_FLAGS


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


def test_convert_import_export_roundtrip_and_verify(fixtures, tmp_path, capsys, model_parallel):
    src = make_fixture(fixtures, "glm52")
    assert cli.main(["convert", "import", "--hf-path", str(src), "--megatron-path", str(tmp_path / "mc"),
                     "--no-progress"]) == 0
    assert "imported 186 HF tensors" in capsys.readouterr().out
    assert cli.main(["convert", "export", "--megatron-path", str(tmp_path / "mc" / "iter_0000000"),
                     "--hf-path", str(tmp_path / "hf"), "--max-shard-size", "2MB", "--no-progress"]) == 0
    assert "exported 186 HF tensors" in capsys.readouterr().out
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert cli.main(["convert", "roundtrip", "--hf-path", str(src)]) == 0
    out = capsys.readouterr().out
    assert "BITWISE IDENTICAL" in out and "tensors compared : 186  (bitwise equal: 186" in out
    assert cli.main(["verify", "--hf-path", str(tmp_path / "hf"), "--megatron-path", str(tmp_path / "mc"),
                     "--seq-len", "64", "--seed", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    report = json.loads(line)
    assert report["max_abs_logit_diff"] <= 1e-4 and report["logit_cosine"] > 0.999999
    assert set(report["topk_overlap"]) == {"0", "2"}


def test_roundtrip_with_locally_spawned_ranks(fixtures, capsys):
    src = make_fixture(fixtures, "glm5")
    assert cli.main(["convert", "roundtrip", "--hf-path", str(src), "--tp", "2", "--no-progress"]) == 0
    assert "(TP=2 PP=1 EP=1) -> HF: BITWISE IDENTICAL" in capsys.readouterr().out


def test_convert_checkpoint_script_is_the_convert_command():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "import", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--megatron-path" in proc.stdout


def test_demo_console_script(tmp_path):
    """The README's first command: offline, end to end, well under the 3-minute budget on 2 cores."""
    exe = Path(sys.executable).parent / "megatron-glm5"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "bridge.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, "demo", "--out", str(tmp_path / "demo"), "--steps", "3"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "bitwise identical" in out and "-> OK" in out and " 3 | " in out, out
    assert seconds < 180, seconds
    assert (tmp_path / "demo" / "hf_trained" / "model.safetensors.index.json").is_file()
