"""The ``megatron-glm5`` command line: frozen flags, convert / verify output, locally spawned ranks, the demo, and
the exit-status contract (one ``error:`` line and status 2 for user errors) checked on the real process."""

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
    "demo": ["--keep", "--model", "--out", "--steps", "--verbose"],
    "convert import": ["--dtype", "--ep", "--hf-path", "--iteration", "--megatron-layout", "--megatron-path",
                       "--no-progress", "--overwrite", "--pp", "--tp", "--verbose"],
    "convert export": ["--dtype", "--expert-layout", "--hf-config", "--hf-path", "--max-shard-size",
                       "--megatron-path", "--no-progress", "--overwrite", "--verbose"],
    "convert roundtrip": ["--ep", "--hf-path", "--keep", "--megatron-layout", "--no-progress", "--pp", "--tp",
                          "--verbose", "--work-dir"],
    "clean": ["--dry-run", "--verbose"],
    "verify": ["--batch-size", "--device", "--dtype", "--hf-path", "--megatron-path", "--num-layers", "--seed",
               "--seq-len", "--tol", "--verbose"],
    "lora export": ["--adapter-path", "--hf-config", "--megatron-path", "--overwrite", "--verbose"],
    "lora import": ["--adapter-path", "--hf-config", "--megatron-path", "--overwrite", "--verbose"],
    "lora merge": ["--adapter-path", "--hf-path", "--max-shard-size", "--no-progress", "--out", "--overwrite",
                   "--verbose"],
    "rollout-parity": ["--backend", "--batch", "--device", "--dtype", "--hf-path", "--max-kl", "--plot",
                       "--verbose"],
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
    assert report["max_abs_logit_diff"] <= 1e-4 and 0.999999 < report["logit_cosine"] <= 1.0
    assert set(report["topk_overlap"]) == {"0", "2"}
    # a failed check: exit 1, the report on stdout, one `failed:` line on stderr naming the limit
    assert cli.main(["verify", "--hf-path", str(tmp_path / "hf"), "--seq-len", "64", "--tol", "1e-12"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out.strip())["ok"] is False
    assert err.count("\n") == 1 and err.startswith("failed: verify: max_rel_logit_diff ") and "> tol 1e-12" in err


def test_roundtrip_with_locally_spawned_ranks(fixtures, capsys):
    src = make_fixture(fixtures, "glm5")
    assert cli.main(["convert", "roundtrip", "--hf-path", str(src), "--tp", "2", "--no-progress"]) == 0
    assert "(TP=2 PP=1 EP=1) -> HF: BITWISE IDENTICAL" in capsys.readouterr().out


def test_convert_checkpoint_script_is_the_convert_command():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "import", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--megatron-path" in proc.stdout


def test_demo_console_script(tmp_path):
    """The README's first command: offline, end to end (no wall-clock assertion: CI machines vary; the subprocess
    timeout only stops a hang)."""
    exe = Path(sys.executable).parent / "megatron-glm5"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "bridge.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*cmd, "demo", "--out", str(tmp_path / "demo"), "--steps", "3"], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "bitwise identical" in out and "-> OK" in out and " 3 | " in out, out
    assert (tmp_path / "demo" / "hf_trained" / "model.safetensors.index.json").is_file()


# --------------------------------------------------------------------------------------------------------------------
# The exit-status contract, on the real process: user error -> exactly one "error:" line on stderr, status 2
# --------------------------------------------------------------------------------------------------------------------

# Runs cli.main in a fresh interpreter with process start-up disabled (a spawned rank exits the CLI with status 99)
# and reports on stdout whether megatron-core was imported.
_GUARDED_CLI = """
import sys
import multiprocessing.process

def _no_ranks(self):
    print("SPAWNED A PROCESS", flush=True)
    raise SystemExit(99)

multiprocessing.process.BaseProcess.start = _no_ranks
from bridge.cli import main
code = main(sys.argv[1:])
print("megatron.core imported:", "megatron.core" in sys.modules, flush=True)
sys.exit(code)
"""


def _cli(*argv: str, guarded: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _GUARDED_CLI] if guarded else [sys.executable, "-m", "bridge.cli"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_verify_with_a_missing_checkpoint_is_a_user_error():
    """Was: FileNotFoundError traceback and status 1 (the code of a failed parity check)."""
    _assert_user_error(_cli("verify", "--hf-path", "/nonexistent/GLM-5"), "--hf-path /nonexistent/GLM-5",
                       "no such directory")


def test_bad_tensor_parallel_size_fails_before_any_rank_or_megatron_import(fixtures, tmp_path):
    """Was: 16 s of rank start-up, then megatron-core's ValueError as a nested traceback. Now the layout is checked
    against config.json up front: no process is started (the guard would exit 99) and megatron-core is not even
    imported."""
    src = make_fixture(fixtures, "glm52")
    for flags, fragment in ((["--tp", "3"], "--tp 3 must divide num_attention_heads (4)"),
                            (["--ep", "3"], "--ep 3 must divide n_routed_experts (8)"),
                            (["--pp", "4"], "--pp 4: cannot split 4 layers")):
        t0 = time.monotonic()
        proc = _cli("convert", "import", "--hf-path", str(src), "--megatron-path", str(tmp_path / "out"), *flags,
                    guarded=True)
        seconds = time.monotonic() - t0
        line = _assert_user_error(proc, fragment, "valid --")
        assert "SPAWNED" not in proc.stdout and "megatron.core imported: False" in proc.stdout, (proc.stdout, line)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*")), seconds


def test_import_into_an_uncreatable_location_is_a_user_error(fixtures, tmp_path):
    """Was: a PermissionError traceback. The output's parent must be a writable directory."""
    src = make_fixture(fixtures, "glm5")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _assert_user_error(_cli("convert", "import", "--hf-path", str(src), "--megatron-path", str(blocker / "out"),
                            "--no-progress"), f"--megatron-path {blocker / 'out'}", "is a file, not a directory")


def test_import_into_a_read_only_location_is_a_user_error(fixtures, tmp_path):
    """A directory the process cannot write (as root too: /proc is read-only for everyone) is one error line."""
    src = make_fixture(fixtures, "glm5")
    target = Path("/proc") / "megatron-glm5-out" if os.geteuid() == 0 else tmp_path / "ro" / "out"
    if os.geteuid() != 0:
        target.parent.mkdir()
        target.parent.chmod(0o555)
    try:
        _assert_user_error(_cli("convert", "import", "--hf-path", str(src), "--megatron-path", str(target),
                                "--no-progress"), f"--megatron-path {target}", "not writable")
    finally:
        if os.geteuid() != 0:
            target.parent.chmod(0o755)


def test_verbose_is_accepted_after_the_subcommand(tmp_path):
    """Was: `megatron-glm5 convert import ... --verbose` -> "unrecognized arguments: --verbose"."""
    parser = cli.build_parser()
    for argv, want in ((["convert", "import", "--hf-path", "a", "--megatron-path", "b", "--verbose"], True),
                       (["--verbose", "lora", "merge", "--hf-path", "a", "--adapter-path", "b", "--out", "c"], True),
                       (["demo", "--verbose"], True), (["verify", "--hf-path", "a"], False)):
        assert parser.parse_args(argv).verbose is want, argv
    proc = _cli("convert", "import", "--hf-path", "/nonexistent/GLM-5", "--megatron-path", str(tmp_path / "o"),
                "--verbose", guarded=True)
    _assert_user_error(proc, "--hf-path /nonexistent/GLM-5: no such directory")
