"""Bad input: a clear message (file / tensor / shape / expected vs found), exit status 2 and nothing left behind.
Interrupted runs (SIGKILL) leave nothing at the output path and nothing that looks like a complete checkpoint."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bridge.errors import BridgeError, CheckpointFormatError
from bridge.megatron_io import resolve_checkpoint_dir
from bridge.output import find_partials, find_stale_partials, remove_stale_partials
from bridge import cli
from megatron_glm5 import testing
from tests.bridge_workers import make_fixture


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    return {name: make_fixture(root, name) for name in ("glm5", "glm52")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(src: Path, dst: Path, *, drop=(), add=None, config=None) -> Path:
    """A copy of ``src`` with tensors dropped / added / replaced (and optionally another config)."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    sd = {}
    for f in sorted(set(index["weight_map"].values())):
        sd.update(load_file(src / f))
    for n in drop:
        del sd[n]
    sd.update(add or {})
    raw = config or json.loads((src / "config.json").read_text())
    testing.write_hf_checkpoint(dst, raw, state_dict=sd, max_shard_bytes=1 << 20)
    return dst


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


def _assert_import_fails(capsys, hf: Path, tmp_path: Path, *patterns: str) -> None:
    code, err = _run(capsys, "convert", "import", "--hf-path", str(hf), "--megatron-path", str(tmp_path / "out"),
                     "--no-progress")
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for p in patterns:
        assert p in err, (p, err)
    assert _leftovers(tmp_path, "out") == []


def test_missing_tensor(base, tmp_path, capsys):
    hf = _rewrite(base["glm5"], tmp_path / "hf", drop=["model.layers.2.mlp.gate.weight"])
    _assert_import_fails(capsys, hf, tmp_path, "1 missing: model.layers.2.mlp.gate.weight", str(hf))


def test_extra_tensor(base, tmp_path, capsys):
    hf = _rewrite(base["glm5"], tmp_path / "hf", add={"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})
    _assert_import_fails(capsys, hf, tmp_path, "1 unexpected", "model.layers.0.mlp.extra_proj.weight")


def test_shape_mismatch(base, tmp_path, capsys):
    name = "model.layers.0.self_attn.q_b_proj.weight"
    hf = _rewrite(base["glm5"], tmp_path / "hf", add={name: torch.zeros(190, 64)})
    _assert_import_fails(capsys, hf, tmp_path, f"{name}: expected [192, 64], found [190, 64]")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_non_float_weight_is_refused(base, tmp_path, capsys, model_parallel, dtype):
    """Was: an int32 (or any integer / bool) weight was accepted with exit 0 and cast to the model dtype. Now import
    and from_hf_pretrained refuse it, naming the tensor, its dtype and shape."""
    from bridge.pretrained import from_hf_pretrained

    from safetensors.torch import save_file

    name = "model.layers.0.self_attn.q_b_proj.weight"
    hf = _copy(base["glm5"], tmp_path / "hf")
    shard = hf / json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = torch.ones(192, 64, dtype=dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    want = f"{name}: {str(dtype).removeprefix('torch.')}[192, 64]"
    with pytest.raises(CheckpointFormatError, match=re.escape(want)):
        from_hf_pretrained(hf)
    capsys.readouterr()  # import-time chatter of a fresh process
    _assert_import_fails(capsys, hf, tmp_path, "1 weight tensor(s) are not floating point", want)


def test_indexer_on_a_shared_layer(base, tmp_path, capsys):
    add = {f"model.layers.1.self_attn.indexer.{n}": torch.zeros(32, 128) for n in ("wk.weight",)}
    hf = _rewrite(base["glm52"], tmp_path / "hf", add=add)
    _assert_import_fails(capsys, hf, tmp_path, "layer(s) [1] are 'shared'", "model.layers.1.self_attn.indexer.wk.weight")


def test_indexer_missing_on_a_full_layer(base, tmp_path, capsys):
    hf = _rewrite(base["glm52"], tmp_path / "hf", drop=["model.layers.2.self_attn.indexer.wk.weight"])
    _assert_import_fails(capsys, hf, tmp_path, "layer(s) [2] are 'full'", "model.layers.2.self_attn.indexer.wk.weight")


def test_truncated_shard(base, tmp_path, capsys):
    hf = _copy(base["glm5"], tmp_path / "hf")
    shard = sorted(hf.glob("*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    _assert_import_fails(capsys, hf, tmp_path, str(shard), "truncated")


def test_corrupt_header(base, tmp_path, capsys):
    hf = _copy(base["glm5"], tmp_path / "hf")
    shard = sorted(hf.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\xff" * 8  # header bytes that are not JSON
    shard.write_bytes(bytes(data))
    _assert_import_fails(capsys, hf, tmp_path, str(shard), "corrupt safetensors header")


def test_missing_index(base, tmp_path, capsys):
    hf = _copy(base["glm5"], tmp_path / "hf")
    (hf / "model.safetensors.index.json").unlink()
    _assert_import_fails(capsys, hf, tmp_path, "missing model.safetensors.index.json", "found shards")


def test_unsupported_model_type(base, tmp_path, capsys):
    hf = _copy(base["glm5"], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (hf / "config.json").write_text(json.dumps(cfg))
    _assert_import_fails(capsys, hf, tmp_path, "model_type", "glm_moe_dsa", "deepseek_v3")


def test_existing_output_needs_overwrite(base, tmp_path, capsys):
    """--overwrite replaces only an earlier output of this tool (tests/test_bridge_output.py has the details)."""
    out = tmp_path / "out"
    code, err = _run(capsys, "convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out),
                     "--no-progress")
    assert code == 0, err
    (out / "old.txt").write_text("x")
    code, err = _run(capsys, "convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out))
    assert code == 2 and "already exists; pass --overwrite" in err and (out / "old.txt").is_file()
    code, err = _run(capsys, "convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out),
                     "--overwrite", "--no-progress")
    assert code == 2 and "did not write (old.txt;" in err and (out / "old.txt").read_text() == "x", err  # kept
    (out / "old.txt").unlink()
    code, err = _run(capsys, "convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out),
                     "--overwrite", "--no-progress")
    assert code == 0, err
    assert (out / "latest_checkpointed_iteration.txt").is_file()
    assert _leftovers(tmp_path, "out") == ["out"]


def test_export_rejects_incomplete_or_corrupt_megatron_checkpoints(base, tmp_path, capsys):
    mc = tmp_path / "mc"
    assert cli.main(["convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(mc),
                     "--no-progress"]) == 0
    broken = _copy(mc, tmp_path / "no_tracker")
    (broken / "latest_checkpointed_iteration.txt").unlink()
    code, err = _run(capsys, "convert", "export", "--megatron-path", str(broken), "--hf-path", str(tmp_path / "o1"))
    assert code == 2 and "not a Megatron checkpoint" in err and _leftovers(tmp_path, "o1") == []
    corrupt = _copy(mc, tmp_path / "truncated")
    data = next((corrupt / "iter_0000000").glob("*.distcp"))
    os.truncate(data, data.stat().st_size // 2)
    code, err = _run(capsys, "convert", "export", "--megatron-path", str(corrupt), "--hf-path", str(tmp_path / "o2"))
    assert code == 2 and "truncated or corrupt data file" in err and _leftovers(tmp_path, "o2") == []


def test_export_rejects_layer_stacked_keys():
    """A dist checkpoint saved with homogeneous layers stacked on a layer axis names the key instead of guessing."""
    from types import SimpleNamespace

    from bridge.convert import _resolve_sources

    key = "decoder.layers.self_attention.linear_proj.weight"
    ckpt = SimpleNamespace(path=Path("/ckpt/iter_0000001"), tensors={key: None}, shape=lambda k: (2, 8, 8))
    with pytest.raises(CheckpointFormatError, match=r"/ckpt/iter_0000001: key 'decoder\.layers\.self_attention.*stacked"):
        _resolve_sources(ckpt, None, None, None)


@pytest.mark.parametrize("kind", ["import", "export"])
def test_kill_9_leaves_no_complete_looking_checkpoint(base, tmp_path, kind):
    from tests.bridge_workers import stalled_conversion

    if kind == "import":
        src = base["glm52"]
    else:
        src = tmp_path / "mc"
        assert cli.main(["convert", "import", "--hf-path", str(base["glm52"]), "--megatron-path", str(src),
                         "--no-progress"]) == 0
    out, marker = tmp_path / "out", tmp_path / "stalled"
    proc = mp.get_context("spawn").Process(target=stalled_conversion, args=(kind, str(src), str(out), str(marker), 20))
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.is_alive() and time.monotonic() < deadline, "the conversion did not reach the stall point"
            time.sleep(0.1)
        (live,) = find_partials(out)
        assert not live.stale and "still running" in live.reason  # a live writer's directory is never touched
        assert remove_stale_partials(out) == [] and live.path.is_dir()
    finally:  # also when an assertion failed: a stalled child would keep the test session from exiting
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert not out.exists()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert len(partial) == 1  # the hidden work directory, with data written up to the kill
    if kind == "import":
        assert not (partial[0] / "latest_checkpointed_iteration.txt").exists()
        with pytest.raises(CheckpointFormatError):
            resolve_checkpoint_dir(partial[0])
    else:
        assert not (partial[0] / "model.safetensors.index.json").exists()
        assert not (partial[0] / "config.json").exists()
    # its writer is dead: a stale leftover, which `megatron-glm5 clean` removes
    assert [p.path for p in find_stale_partials(out)] == partial
    assert cli.main(["clean", str(out)]) == 0
    assert not partial[0].exists() and _leftovers(tmp_path, "out") == []


class _RunsCode:
    """Pickles as a call of ``fn(*args)``: what a crafted ``.metadata`` does to run code when unpickled."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.fixture(scope="module")
def imported(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "mc"
    assert cli.main(["convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out),
                     "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "subprocess.call"])
def test_crafted_metadata_pickle_runs_no_code(imported, tmp_path, capsys, payload):
    """Every reader of a Megatron checkpoint refuses a .metadata whose pickle would run code, naming the file and
    the refused global, before anything (torch's reader, megatron-core's loader) unpickles it."""
    import pickle
    import subprocess
    import sys

    import bridge
    from bridge.megatron_io import load_into_model

    mc = _copy(imported, tmp_path / "mc")
    pwned = tmp_path / "pwned"
    fn, args, refused = {
        "os.system": (os.system, (f"touch {pwned}",), f"'{os.system.__module__}.system'"),
        "builtins.exec": (exec, (f"open({str(pwned)!r}, 'w').close()",), "'builtins.exec'"),
        "subprocess.call": (subprocess.call, ([sys.executable, "-c", f"open({str(pwned)!r}, 'w').close()"],),
                            "'subprocess.call'"),
    }[payload]
    metadata = mc / "iter_0000000" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsCode(fn, *args)))

    code, err = _run(capsys, "convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / "hf"))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert f"{metadata}: refused to unpickle global {refused}" in err, err
    assert _leftovers(tmp_path, "hf") == []
    with pytest.raises(CheckpointFormatError, match="refused to unpickle global"):
        bridge.load_megatron_checkpoint(mc)
    with pytest.raises(CheckpointFormatError, match="refused to unpickle global"):
        bridge.load_megatron_checkpoint(mc, hf_config=imported / "hf_assets" / "config.json")
    with pytest.raises(CheckpointFormatError, match="refused to unpickle global"):
        load_into_model(None, mc)  # our check comes before megatron-core's dist_checkpointing.load
    assert not pwned.exists()


def test_corrupt_or_foreign_metadata_pickle(imported, tmp_path, capsys):
    import pickle

    mc = _copy(imported, tmp_path / "mc")
    metadata = mc / "iter_0000000" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    code, err = _run(capsys, "convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / "hf"))
    assert code == 2 and f"{metadata}: corrupt" in err and err.count("\n") == 1, err
    metadata.write_bytes(pickle.dumps({"not": "metadata"}))
    code, err = _run(capsys, "convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / "hf"))
    assert code == 2 and f"{metadata}: not torch distributed-checkpoint metadata (found a dict)" in err, err
    metadata.unlink()
    code, err = _run(capsys, "convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / "hf"))
    assert code == 2 and "missing .metadata" in err, err


# --------------------------------------------------------------------------------------------------------------------
# Every subcommand: bad paths, flags and sizes are one "error:" line and status 2 (checked before any model work)
# --------------------------------------------------------------------------------------------------------------------


def _assert_usage_error(capsys, argv: list[str], *fragments: str) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


@pytest.fixture
def paths(base, tmp_path):
    """A file, an empty directory, an HF directory without weights, a config that is not JSON / not an object, a
    Megatron-LM save directory whose tracker names a missing iteration."""
    out = {"glm5": base["glm5"], "glm52": base["glm52"], "tmp": tmp_path}
    out["file"] = tmp_path / "a_file"
    out["file"].write_text("x")
    out["empty"] = tmp_path / "empty"
    out["empty"].mkdir()
    out["no_weights"] = tmp_path / "no_weights"
    out["no_weights"].mkdir()
    shutil.copy(base["glm5"] / "config.json", out["no_weights"] / "config.json")
    for name, text in (("bad_json", "{not json"), ("list_json", "[1, 2]")):
        d = _copy(base["glm5"], tmp_path / name)
        (d / "config.json").write_text(text)
        out[name] = d
    out["stale_tracker"] = tmp_path / "stale_tracker"
    out["stale_tracker"].mkdir()
    (out["stale_tracker"] / "latest_checkpointed_iteration.txt").write_text("7\n")
    return out


CASES = [
    # (argv with {placeholders}, fragments of the one error line)
    (["verify", "--hf-path", "{file}"], ["--hf-path {file}: is a file, not a directory"]),
    (["verify", "--hf-path", "{tmp}/missing"], ["--hf-path {tmp}/missing: no such directory"]),
    (["verify", "--hf-path", "{empty}"], ["--hf-path {empty}: missing config.json"]),
    (["verify", "--hf-path", "{no_weights}"], ["missing model.safetensors.index.json", "found no safetensors"]),
    (["verify", "--hf-path", "{bad_json}"], ["{bad_json}/config.json: not valid JSON"]),
    (["verify", "--hf-path", "{list_json}"], ["{list_json}/config.json: expected a JSON object, found list"]),
    (["verify", "--hf-path", "{glm52}", "--num-layers", "5"],
     ["--num-layers 5: expected 1 <= N <= num_hidden_layers (4"]),
    (["verify", "--hf-path", "{glm52}", "--num-layers", "0"],
     ["argument --num-layers: expected an integer >= 1, got 0"]),
    (["verify", "--hf-path", "{glm52}", "--dtype", "fp16"], ["argument --dtype: invalid choice: 'fp16'"]),
    (["verify", "--hf-path", "{glm52}", "--seq-len", "16"], ["--seq-len 16 must exceed index_topk (16)"]),
    (["verify", "--hf-path", "{glm52}", "--batch-size", "0"], ["argument --batch-size: expected an integer >= 1"]),
    (["verify", "--hf-path", "{glm52}", "--tol", "-1"], ["argument --tol: expected a positive number"]),
    (["verify", "--hf-path", "{glm52}", "--megatron-path", "{empty}"],
     ["--megatron-path: {empty}: not a Megatron checkpoint"]),
    (["convert", "import", "--hf-path", "{tmp}/missing", "--megatron-path", "{tmp}/o"],
     ["--hf-path {tmp}/missing: no such"]),
    (["convert", "import", "--hf-path", "{glm5}", "--megatron-path", "{file}"],
     ["--megatron-path {file}: exists and is a file"]),
    (["convert", "import", "--hf-path", "{glm5}", "--megatron-path", "{file}/sub/out"],
     ["{file} is a file, not a directory"]),
    (["convert", "import", "--hf-path", "{glm5}", "--megatron-path", "{tmp}/o", "--tp", "0"],
     ["argument --tp: expected an integer >= 1"]),
    (["convert", "import", "--hf-path", "{glm5}", "--megatron-path", "{tmp}/o", "--iteration", "-1"],
     ["argument --iteration"]),
    (["convert", "import", "--hf-path", "{glm5}", "--megatron-path", "{tmp}/o", "--dtype", "int8"],
     ["argument --dtype"]),
    (["convert", "export", "--megatron-path", "{tmp}/missing", "--hf-path", "{tmp}/o"],
     ["--megatron-path {tmp}/missing: no such directory"]),
    (["convert", "export", "--megatron-path", "{file}", "--hf-path", "{tmp}/o"],
     ["--megatron-path {file}: is a file, not a directory"]),
    (["convert", "export", "--megatron-path", "{empty}", "--hf-path", "{tmp}/o"], ["not a Megatron checkpoint"]),
    (["convert", "export", "--megatron-path", "{stale_tracker}", "--hf-path", "{tmp}/o"],
     ["names iter_0000007, which does not exist"]),
    (["convert", "export", "--megatron-path", "{empty}", "--hf-path", "{tmp}/o", "--max-shard-size", "0"],
     ["--max-shard-size: expected a positive size"]),
    (["convert", "export", "--megatron-path", "{empty}", "--hf-path", "{tmp}/o", "--max-shard-size", "5XB"],
     ["--max-shard-size: expected a size like 5GB"]),
    (["convert", "roundtrip", "--hf-path", "{glm5}", "--work-dir", "{file}"],
     ["--work-dir {file}: exists and is a file"]),
    (["convert", "roundtrip", "--hf-path", "{no_weights}"], ["missing model.safetensors.index.json"]),
    (["demo", "--out", "{file}"], ["--out {file}: exists and is a file"]),
    (["demo", "--steps", "0"], ["argument --steps: expected an integer >= 1"]),
    (["convert", "import", "--hf-path", "{glm5}"], ["the following arguments are required: --megatron-path"]),
]


@pytest.mark.parametrize("argv,fragments", CASES, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(CASES)])
def test_user_errors_are_one_line_with_status_2(paths, capsys, argv, fragments):
    fill = {k: str(v) for k, v in paths.items()}
    _assert_usage_error(capsys, [a.format(**fill) for a in argv], *(f.format(**fill) for f in fragments))


def test_export_with_a_missing_hf_config(base, tmp_path, capsys):
    mc = tmp_path / "mc"
    assert cli.main(["convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(mc),
                     "--no-progress"]) == 0
    _assert_usage_error(capsys, ["convert", "export", "--megatron-path", str(mc), "--hf-path", str(tmp_path / "o"),
                                 "--hf-config", str(tmp_path / "nope.json")],
                        f"--hf-config {tmp_path / 'nope.json'}: {tmp_path / 'nope.json'} not found")
    assert not (tmp_path / "o").exists()


def test_verify_refuses_an_fp8_checkpoint_and_a_missing_gpu(base, tmp_path, capsys):
    fp8 = make_fixture(tmp_path, "glm52_fp8")
    _assert_usage_error(capsys, ["verify", "--hf-path", str(fp8)], "needs an unquantised HF checkpoint")
    if not torch.cuda.is_available():
        _assert_usage_error(capsys, ["verify", "--hf-path", str(base["glm52"]), "--device", "cuda"],
                            "--device cuda: CUDA is not available")


def test_read_only_output_directory(base, tmp_path, capsys):
    """An output whose parent is not writable fails up front: a mode-555 directory, or (as root, who may write there)
    the read-only /proc."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    parent = Path("/proc") if os.geteuid() == 0 else ro
    try:
        _assert_usage_error(capsys, ["convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path",
                                     str(parent / "out"), "--no-progress"],
                            f"--megatron-path {parent / 'out'}: cannot create it: {parent} is not writable")
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_os_error_while_writing_the_output_is_one_line(base, tmp_path, capsys, monkeypatch):
    """What the up-front check cannot see - the location turns read-only or the disk fills while converting - is
    reported as one line naming the flag and the file, not a traceback."""
    import bridge.convert

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(bridge.convert.Path, "mkdir", refuse)
    err = _assert_usage_error(capsys, ["convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path",
                                       str(tmp_path / "out"), "--no-progress"],
                              f"--megatron-path {tmp_path / 'out'}: {tmp_path}/.out.partial-", "Permission denied")
    assert _leftovers(tmp_path, "out") == [], err


def test_os_error_elsewhere_keeps_its_traceback(base, tmp_path, monkeypatch):
    """An OSError about a file the user did not name is a bug (or the environment) and is not disguised."""
    import bridge.convert

    def boom(**kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/etc/some-internal-file")

    monkeypatch.setattr(bridge.convert, "convert_hf_to_megatron", boom)
    with pytest.raises(PermissionError):
        cli.main(["convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(tmp_path / "out")])


def test_parallel_layout_is_checked_against_the_released_configs():
    """The up-front layout check on the real GLM-5.x geometries: the layouts people use pass, impossible ones name
    the field and the valid values."""
    from bridge.launch import check_parallel_layout
    from megatron_glm5.config import load_hf_config, parse_hf_config

    data = Path(__file__).parent / "data"
    for name in ("glm5_config.json", "glm5_2_config.json"):
        arch = parse_hf_config(load_hf_config(data / name))
        for tp, ep in ((1, 1), (8, 8), (4, 64), (2, 256)):
            check_parallel_layout(arch, tp, 1, ep)
        with pytest.raises(BridgeError, match=r"--tp 3 must divide num_attention_heads \(64\).*valid --tp: 1, 2, 4, 8"):
            check_parallel_layout(arch, 3, 1, 1)
        with pytest.raises(BridgeError, match=r"--ep 3 must divide n_routed_experts \(256\)"):
            check_parallel_layout(arch, 1, 1, 3)
        with pytest.raises(BridgeError, match=r"--pp 5: cannot split 78 layers"):
            check_parallel_layout(arch, 1, 5, 1)


# --------------------------------------------------------------------------------------------------------------------
# A full disk while the Megatron-side writers run, on the real process (ranks included)
# --------------------------------------------------------------------------------------------------------------------


def _cli_proc(*argv: str, env: dict | None = None, cwd: Path | None = None):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "bridge.cli", *argv], capture_output=True, text=True, timeout=600,
                          cwd=cwd or repo, env=env or {**os.environ, "PYTHONPATH": str(repo)})


def _assert_one_line(proc, code: int, *fragments: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_disk_full_during_import_and_roundtrip_is_one_line(base, tmp_path, tp):
    """Was: exit 1 and a 48-71 line `[rank0]` traceback ending in `OSError: [Errno 28] No space left on device`
    (torch's checkpoint writer wraps every failure in a CheckpointException, a BaseException). Now the failure is
    the OSError itself: one line naming the output, exit 2, nothing left behind - also from spawned ranks (TP=2)."""
    from tests.bridge_workers import full_disk_env

    env = full_disk_env(tmp_path / "site")
    out = tmp_path / "out"
    proc = _cli_proc("convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out),
                     "--tp", str(tp), "--no-progress", env=env)
    _assert_one_line(proc, 2, f"error: --megatron-path {out}", "No space left on device")
    assert _leftovers(tmp_path, "out") == []
    work = tmp_path / "work"
    work.mkdir()
    proc = _cli_proc("convert", "roundtrip", "--hf-path", str(base["glm5"]), "--work-dir", str(work),
                     "--tp", str(tp), "--no-progress", env=env)
    _assert_one_line(proc, 2, f"error: --work-dir {work}", "No space left on device")
    assert list(work.iterdir()) == []


def test_disk_full_on_a_real_small_file_system(base, tmp_path):
    """The same on a real 1 MB tmpfs (root only; the fixture needs about 6 MB)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out = mnt / "out"
        proc = _cli_proc("convert", "import", "--hf-path", str(base["glm5"]), "--megatron-path", str(out),
                         "--no-progress")
        _assert_one_line(proc, 2, f"error: --megatron-path {out}", "No space left on device")
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --------------------------------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM: one line, 130 / 143, nothing left behind
# --------------------------------------------------------------------------------------------------------------------

# The CLI with every checkpoint box slowed down, announcing on stdout when it starts writing boxes.
_SLOW_CLI = """
import sys, time
import bridge.megatron_io as mio

resolve = mio._BoxPlanner.resolve_data
started = []

def slow(self, item):
    if not started:
        started.append(1)
        print("WRITING", flush=True)
    time.sleep(0.2)
    return resolve(self, item)

mio._BoxPlanner.resolve_data = slow
from bridge.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_conversion_is_one_line_and_leaves_nothing(base, tmp_path, sig, code):
    """Was: Ctrl-C printed a ~49-line KeyboardInterrupt traceback, SIGTERM exited 143 silently (leaving the staged
    checkpoint behind). Now both print one line and remove what they staged; an output being replaced with
    --overwrite is left exactly as it was."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    for overwrite in (False, True):
        if overwrite:
            assert cli.main(["convert", "import", "--hf-path", str(base["glm52"]), "--megatron-path", str(out),
                             "--no-progress"]) == 0
        before = sorted((p.relative_to(out).as_posix(), p.stat().st_mtime_ns) for p in out.rglob("*")) \
            if out.exists() else None
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_CLI, "convert", "import", "--hf-path",
                                 str(base["glm5"]), "--megatron-path", str(out), "--no-progress",
                                 *(["--overwrite"] if overwrite else [])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo,
                                env={**os.environ, "PYTHONPATH": str(repo)})
        assert proc.stdout.readline().strip() == "WRITING"
        assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]  # mid-way, really
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == code, (proc.returncode, stdout, stderr)
        assert stderr.splitlines() == [f"error: interrupted; nothing was written at {out}"], stderr
        assert _leftovers(tmp_path, "out") == (["out"] if overwrite else [])
        after = sorted((p.relative_to(out).as_posix(), p.stat().st_mtime_ns) for p in out.rglob("*")) \
            if out.exists() else None
        assert after == before


def test_config_field_errors_name_the_file(base, tmp_path, capsys):
    """Was: `error: config field 'model_type': expected one of ...` without the file. Every path that reads a
    config.json - the CLI's checks and the library's own - now puts the file in front."""
    from bridge.source import open_hf_source
    from megatron_glm5.config import GLM5ConfigError

    bad = _copy(base["glm52"], tmp_path / "bad")
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    field = "config field 'model_type': expected one of"
    cfg = bad / "config.json"
    for argv, flag in ((["convert", "import", "--hf-path", bad, "--megatron-path", tmp_path / "o"], "--hf-path"),
                       (["verify", "--hf-path", bad], "--hf-path"),
                       (["convert", "export", "--megatron-path", tmp_path, "--hf-path", tmp_path / "o",
                         "--hf-config", cfg], None),
                       (["lora", "import", "--adapter-path", tmp_path / "a", "--megatron-path", tmp_path / "o",
                         "--hf-config", cfg], None)):
        if argv[0] == "lora":
            (tmp_path / "a").mkdir(exist_ok=True)
            (tmp_path / "a" / "adapter_config.json").write_text("{}")
        if argv[1] == "export":
            continue  # needs a Megatron checkpoint first: below
        code, err = _run(capsys, *map(str, argv))
        assert code == 2 and err.count("\n") == 1, err
        assert f"{flag or '--hf-config'} {cfg}: {field}" in err, err
    with pytest.raises(GLM5ConfigError, match=f"^{cfg}: {field}"):
        open_hf_source(bad)
    assert cli.main(["convert", "import", "--hf-path", str(base["glm52"]), "--megatron-path", str(tmp_path / "mc"),
                     "--no-progress"]) == 0
    code, err = _run(capsys, "convert", "export", "--megatron-path", str(tmp_path / "mc"), "--hf-path",
                     str(tmp_path / "o"), "--hf-config", str(cfg))
    assert code == 2 and f"--hf-config {cfg}: {field}" in err, err


def test_ctrl_c_during_a_conversion_over_spawned_ranks(base, tmp_path):
    """Ctrl-C in a terminal reaches the whole process group: the parent and the TP=2 ranks it spawned. One line, 130,
    no rank left running, nothing left at the output or beside it."""
    import subprocess
    import sys

    from tests.bridge_workers import slow_disk_env

    env, writing = slow_disk_env(tmp_path / "site")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "bridge.cli", "convert", "import", "--hf-path", str(base["glm5"]),
                             "--megatron-path", str(out), "--tp", "2", "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while not writing.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert writing.exists(), proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, stdout, stderr)
    assert stderr.splitlines() == [f"error: interrupted; nothing was written at {out}"], stderr
    assert _leftovers(tmp_path, "out") == []
    for _ in range(100):  # multiprocessing's resource tracker notices its parent is gone within a moment
        ps = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(proc.pid)], capture_output=True, text=True)
        if not ps.stdout.strip():
            break
        time.sleep(0.1)
    assert ps.stdout.strip() == "", f"processes of the session still running: {ps.stdout}"
