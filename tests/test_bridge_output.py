"""Output directories: --overwrite never deletes a source or files this tool did not write, replacing an output is
one atomic exchange (a crash never leaves nothing at the path), every output is marked, and leftovers of
interrupted runs are found and removed only when their writers are dead."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import bridge
from bridge import cli, output
from bridge.errors import BridgeError, OutputExistsError
from bridge.megatron_io import BRIDGE_KEY, DistCheckpoint, resolve_checkpoint_dir
from tests.bridge_workers import make_fixture


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def imported(fixtures, tmp_path_factory):
    """A Megatron checkpoint of the glm5 fixture, for export tests (read only)."""
    out = tmp_path_factory.mktemp("mc") / "mc"
    assert cli.main(["convert", "import", "--hf-path", str(make_fixture(fixtures, "glm5")), "--megatron-path",
                     str(out), "--no-progress"]) == 0
    return out


def _run(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _one_error(code: int, err: str, *patterns: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for p in patterns:
        assert p in err, (p, err)


def _hf_config_of(megatron_path: Path) -> dict:
    return DistCheckpoint(resolve_checkpoint_dir(megatron_path)).common_state()[BRIDGE_KEY]["hf_config"]


# --------------------------------------------------------------------------------------------------------------------
# The source is never the output
# --------------------------------------------------------------------------------------------------------------------


def test_import_output_that_is_contains_or_is_inside_the_source_is_refused(fixtures, tmp_path, capsys):
    """The reported case: `--hf-path proj/hf --megatron-path proj --overwrite` deleted proj/hf."""
    proj = tmp_path / "proj"
    hf = proj / "hf"
    hf.parent.mkdir()
    import shutil

    shutil.copytree(make_fixture(fixtures, "glm5"), hf)
    before = sorted(p.name for p in hf.iterdir())
    for out, relation in ((proj, "contains"), (hf, "is"), (hf / "mc", "is inside")):
        code, err = _run(capsys, "convert", "import", "--hf-path", hf, "--megatron-path", out, "--overwrite",
                         "--no-progress")
        _one_error(code, err, f"{out}: the output path {relation} the source {hf}")
        assert sorted(p.name for p in hf.iterdir()) == before
    assert sorted(p.name for p in proj.iterdir()) == ["hf"]


def test_export_output_that_overlaps_the_megatron_source_is_refused(imported, tmp_path, capsys):
    it = imported / "iter_0000000"
    before = sorted(p.name for p in imported.rglob("*"))
    for src, out, relation in ((imported, imported, "is"), (it, imported, "contains"), (imported, it, "is inside"),
                               (it, imported / "hf_assets", "is")):
        code, err = _run(capsys, "convert", "export", "--megatron-path", src, "--hf-path", out, "--overwrite",
                         "--no-progress")
        _one_error(code, err, f"{out}: the output path {relation} the source")
    assert sorted(p.name for p in imported.rglob("*")) == before


# --------------------------------------------------------------------------------------------------------------------
# --overwrite replaces only earlier outputs (marked) or empty directories
# --------------------------------------------------------------------------------------------------------------------


def test_overwrite_refuses_a_directory_this_tool_did_not_write(fixtures, tmp_path, capsys):
    src = make_fixture(fixtures, "glm5")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--overwrite",
                     "--no-progress")
    _one_error(code, err, f"{out}: not replacing it with --overwrite", output.MARKER_FILE, "notes.txt")
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    (out / "notes.txt").unlink()  # an empty directory may be replaced
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--overwrite",
                     "--no-progress")
    assert code == 0, err
    marker = output.read_marker(out)
    assert marker["kind"] == "megatron" and marker["source"] == str(src.resolve())
    assert marker["tool"] == "megatron-glm5" and marker["version"] and marker["created"]
    assert not [p for p in out.iterdir() if p.name.startswith(output.WRITER_PREFIX)]

    # an earlier output of this tool is replaced; an export of it is marked "hf" and does not carry the marker on
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--overwrite",
                     "--no-progress")
    assert code == 0, err
    hf = tmp_path / "hf"
    assert cli.main(["convert", "export", "--megatron-path", str(out), "--hf-path", str(hf), "--no-progress"]) == 0
    assert output.read_marker(hf)["kind"] == "hf" and output.read_marker(hf)["source"] == str(out.resolve())
    assert cli.main(["convert", "import", "--hf-path", str(hf), "--megatron-path", str(tmp_path / "mc2"),
                     "--no-progress"]) == 0
    assert not (tmp_path / "mc2" / "hf_assets" / output.MARKER_FILE).exists()
    assert output.read_marker(tmp_path / "mc2")["source"] == str(hf.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mc2", "out"]


def test_overwrite_refuses_a_file(fixtures, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("x")
    code, err = _run(capsys, "convert", "import", "--hf-path", make_fixture(fixtures, "glm5"), "--megatron-path",
                     out, "--overwrite", "--no-progress")
    _one_error(code, err, f"{out}: exists and is a file")  # the CLI's up-front check
    with pytest.raises(OutputExistsError, match="exists and is not a directory"):  # the library's own
        bridge.convert_hf_to_megatron(hf_path=make_fixture(fixtures, "glm5"), megatron_path=out, overwrite=True)
    assert out.read_text() == "x"


def _tree(path: Path) -> dict[str, bytes]:
    return {q.relative_to(path).as_posix(): q.read_bytes() for q in sorted(path.rglob("*")) if q.is_file()}


def test_overwrite_keeps_files_the_user_added_to_an_earlier_output(fixtures, tmp_path, capsys):
    """Was: `--overwrite` on a marked earlier output deleted notes.txt, a tokenizer file added to an HF export and
    Megatron-LM's iter_0000100/ saved into the imported folder, with exit 0. The marker lists what was written;
    anything else makes --overwrite refuse, naming it, and everything stays as it was."""
    src = make_fixture(fixtures, "glm5")
    out, hf = tmp_path / "out", tmp_path / "hf"
    assert cli.main(["convert", "import", "--hf-path", str(src), "--megatron-path", str(out), "--no-progress"]) == 0
    assert cli.main(["convert", "export", "--megatron-path", str(out), "--hf-path", str(hf), "--no-progress"]) == 0
    capsys.readouterr()
    (out / "notes.txt").write_text("my notes")
    (out / "iter_0000100").mkdir()
    (out / "iter_0000100" / "__0_0.distcp").write_bytes(b"a Megatron-LM save")
    (hf / "tokenizer.json").write_text("{}")
    before_out, before_hf = _tree(out), _tree(hf)
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--overwrite",
                     "--no-progress")
    _one_error(code, err, f"{out}: not replacing it with --overwrite", "2 file(s)", "iter_0000100/", "notes.txt")
    code, err = _run(capsys, "convert", "export", "--megatron-path", out, "--hf-path", hf, "--overwrite",
                     "--no-progress")
    _one_error(code, err, f"{hf}: not replacing it with --overwrite", "tokenizer.json")
    assert _tree(out) == before_out and _tree(hf) == before_hf
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]  # nothing staged was left behind

    # a file added inside one of our own directories counts too
    (out / "notes.txt").unlink()
    shutil.rmtree(out / "iter_0000100")
    (out / "hf_assets" / "mine.txt").write_text("x")
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--overwrite",
                     "--no-progress")
    _one_error(code, err, "hf_assets/mine.txt")
    assert (out / "hf_assets" / "mine.txt").read_text() == "x"

    # once only our own files are left, --overwrite replaces the output as before
    (out / "hf_assets" / "mine.txt").unlink()
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--overwrite",
                     "--no-progress")
    assert code == 0, err
    assert "iter_0000000/" in output.read_marker(out)["files"]


def test_an_existing_empty_directory_is_a_fine_output(fixtures, tmp_path, capsys):
    """Was: `mkdir out && megatron-glm5 convert import ... out` refused 'already exists; pass --overwrite'."""
    src = make_fixture(fixtures, "glm5")
    out, hf = tmp_path / "out", Path(tempfile.mkdtemp(dir=tmp_path))
    out.mkdir()
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--no-progress")
    assert code == 0, err
    code, err = _run(capsys, "convert", "export", "--megatron-path", out, "--hf-path", hf, "--no-progress")
    assert code == 0, err
    assert output.read_marker(out)["kind"] == "megatron" and output.read_marker(hf)["kind"] == "hf"
    assert (hf / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([hf.name, "out"])
    # not an empty one: still needs --overwrite
    code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", out, "--no-progress")
    _one_error(code, err, "already exists; pass --overwrite")


def test_demo_never_deletes_files_in_its_out_directory(tmp_path):
    """Was: `megatron-glm5 demo --out DIR` ran shutil.rmtree on DIR/hf, DIR/megatron, ... and deleted the user's
    DIR/hf/mydata.txt and DIR/megatron/run.txt with exit 0. Now the demo's outputs follow convert's rules, checked
    before it starts."""
    work = tmp_path / "demo"
    (work / "hf").mkdir(parents=True)
    (work / "megatron").mkdir()
    (work / "hf" / "mydata.txt").write_text("mine")
    (work / "megatron" / "run.txt").write_text("mine too")
    (work / "notes.txt").write_text("untouched")
    before = _tree(work)
    proc = subprocess.run([sys.executable, "-m", "bridge.cli", "demo", "--out", str(work), "--steps", "1"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {work}: {work / 'hf'}: not replacing it"), lines
    assert "mydata.txt" in lines[0] and "demo replaces only its own earlier outputs" in lines[0]
    assert _tree(work) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_demo_outputs_are_replaced_only_when_they_are_the_demos_own(tmp_path):
    """The check behind the demo: absent, empty or marked-and-unchanged outputs pass; an added file is refused."""
    from bridge.preflight import DEMO_OUTPUTS, demo_outputs

    work = tmp_path / "demo"
    work.mkdir()
    for sub in DEMO_OUTPUTS[:2]:
        _fake_output(work / sub, sub)
    (work / "hf_roundtrip").mkdir()
    assert demo_outputs(work) == work
    (work / "megatron" / "run.txt").write_text("mine")
    with pytest.raises(BridgeError, match=r"megatron: not replacing it .*1 file\(s\).*run\.txt"):
        demo_outputs(work)


def _mount_tmpfs(path: Path, size: str = "64m") -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_mount_point_output_is_refused_up_front(fixtures, tmp_path, capsys, monkeypatch):
    """Was: with --overwrite, the whole conversion ran, then the final rename failed with EBUSY (a 21-line
    traceback, exit 1) and left a .megatron-glm5-writer.*.json behind. Now the path is checked before anything is
    written: one error line naming it and suggesting a path inside it. A real tmpfs where this process may mount one
    (root), else a directory that os.path.ismount reports as a mount point."""
    src = make_fixture(fixtures, "glm5")
    mnt = tmp_path / "mnt"
    real = os.geteuid() == 0 and _mount_tmpfs(mnt)
    try:
        if not real:
            mnt.mkdir(exist_ok=True)
            is_mount = os.path.ismount
            monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt or is_mount(p))
        for extra in ([], ["--overwrite"]):
            code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", mnt, *extra,
                             "--no-progress")
            _one_error(code, err, f"--megatron-path: {mnt}: is a mount point", f"{mnt / 'out'}")
        with pytest.raises(OutputExistsError, match="is a mount point"):  # the library's own check
            bridge.convert_hf_to_megatron(hf_path=src, megatron_path=mnt, overwrite=True, progress=False)
        assert list(mnt.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]
        code, err = _run(capsys, "convert", "import", "--hf-path", src, "--megatron-path", mnt / "out",
                         "--no-progress")
        assert code == 0, err
    finally:
        if real:
            subprocess.run(["umount", str(mnt)], check=True)


def test_a_failed_final_rename_leaves_no_writer_record(tmp_path, monkeypatch):
    """Whatever makes the final rename fail (EBUSY on a mount point the check could not see), the old output is
    left exactly as it was: no writer record of this process stays in it."""
    final = _fake_output(tmp_path / "out", "old")
    tmp = output.make_partial_dir(final)
    (tmp / "data.txt").write_text("new")

    def busy(a, b):
        raise OSError(errno.EBUSY, "Device or resource busy", str(a), None, str(b))

    monkeypatch.setattr(output, "_exchange", busy)
    with pytest.raises(OSError, match="busy"):
        output.commit_dir(tmp, final, overwrite=True, kind="megatron", source=None)
    assert sorted(p.name for p in final.iterdir()) == sorted(["data.txt", output.MARKER_FILE])
    assert (final / "data.txt").read_text() == "old"


# --------------------------------------------------------------------------------------------------------------------
# Replacing is atomic
# --------------------------------------------------------------------------------------------------------------------


class _Crash(BaseException):
    """Stands for the process dying: nothing after it runs."""


def test_crash_after_the_exchange_leaves_the_complete_new_checkpoint(fixtures, tmp_path, monkeypatch):
    """Between the swap and the deletion of the old copy the path holds the complete new checkpoint."""
    import bridge

    out = tmp_path / "out"
    bridge.convert_hf_to_megatron(hf_path=make_fixture(fixtures, "glm5"), megatron_path=out, progress=False)
    new_src = make_fixture(fixtures, "glm52")

    def crash(path):
        raise _Crash(path)

    monkeypatch.setattr(output, "_remove_tree", crash)
    with pytest.raises(_Crash):
        bridge.convert_hf_to_megatron(hf_path=new_src, megatron_path=out, overwrite=True, progress=False)
    monkeypatch.undo()
    assert _hf_config_of(out) == json.loads((new_src / "config.json").read_text())  # complete and readable
    assert output.read_marker(out)["source"] == str(new_src.resolve())
    assert not [p for p in out.iterdir() if p.name.startswith(output.WRITER_PREFIX)]
    (old,) = output.find_partials(out)  # the old copy, still recorded as this (live) process's
    assert not old.stale and f"pid {os.getpid()}" in old.reason and "still running" in old.reason
    assert _hf_config_of(old.path)["num_hidden_layers"] and output.remove_stale_partials(out) == []
    assert old.path.is_dir()


def _fake_output(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "data.txt").write_text(content)
    output.write_marker(path, kind="megatron", source=None)
    return path


def test_commit_without_atomic_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    final = _fake_output(tmp_path / "out", "old")
    monkeypatch.setattr(output, "_exchange", lambda a, b: False)
    tmp = output.make_partial_dir(final)
    (tmp / "data.txt").write_text("new")
    output.commit_dir(tmp, final, overwrite=True, kind="megatron", source=None)
    assert (final / "data.txt").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]

    # the second rename fails: the old copy goes back to the path
    tmp = output.make_partial_dir(final)
    (tmp / "data.txt").write_text("newer")
    real_rename = Path.rename

    def rename(self, target):
        if self == tmp:
            raise OSError("simulated failure")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        output.commit_dir(tmp, final, overwrite=True, kind="megatron", source=None)
    assert (final / "data.txt").read_text() == "new"
    assert not [p for p in final.iterdir() if p.name.startswith(output.WRITER_PREFIX)]


def test_exchange_is_atomic_on_this_system(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not output._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) not available here (the two-rename fallback is used)")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_commit_rechecks_an_output_that_changed_meanwhile(tmp_path):
    final = tmp_path / "out"
    tmp = output.make_partial_dir(final)
    final.mkdir()
    (final / "user.txt").write_text("x")  # appeared during the conversion, not ours
    with pytest.raises(OutputExistsError, match="not replacing it"):
        output.commit_dir(tmp, final, overwrite=True, kind="hf", source=None)
    with pytest.raises(OutputExistsError, match="appeared while converting"):
        output.commit_dir(tmp, final, overwrite=False, kind="hf", source=None)
    assert (final / "user.txt").read_text() == "x"


def test_killed_after_the_exchange_leaves_the_new_checkpoint_and_a_stale_copy(fixtures, tmp_path, capsys):
    """A real SIGKILL between the swap and the deletion: the path holds the new checkpoint; the old copy is a stale
    leftover (its writer is dead) that `megatron-glm5 clean` lists and removes."""
    from tests.bridge_workers import killed_while_replacing

    out = tmp_path / "out"
    assert cli.main(["convert", "import", "--hf-path", str(make_fixture(fixtures, "glm5")), "--megatron-path",
                     str(out), "--no-progress"]) == 0
    new_src = make_fixture(fixtures, "glm52")
    proc = mp.get_context("spawn").Process(target=killed_while_replacing, args=(str(new_src), str(out)))
    proc.start()
    proc.join(300)
    assert proc.exitcode == -signal.SIGKILL
    assert _hf_config_of(out) == json.loads((new_src / "config.json").read_text())
    (old,) = output.find_partials(out)
    assert old.stale and f"writer pid {proc.pid}" in old.reason and "has exited" in old.reason
    capsys.readouterr()
    assert cli.main(["clean", str(out), "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert f"would remove {old.path}" in listed and old.path.is_dir()
    assert cli.main(["clean", str(out)]) == 0
    assert f"removed {old.path}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --------------------------------------------------------------------------------------------------------------------
# Leftovers of interrupted runs
# --------------------------------------------------------------------------------------------------------------------


def _leftover(final: Path, kind: str, writer: dict | None, nbytes: int = 1000) -> Path:
    d = final.parent / f".{final.name}.{kind}-{os.urandom(4).hex()}"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"\0" * nbytes)
    if writer is not None:
        me = output._this_writer()
        me.update(writer)
        path = output._writer_file(d, me["pid"], me["host"])
        path.write_text(json.dumps(me))
    return d


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_are_told_apart_from_live_and_foreign_ones(tmp_path, capsys):
    final = tmp_path / "out"
    me = os.getpid()
    dead = _leftover(final, "partial", {"pid": _dead_pid()}, nbytes=3 << 20)
    export = _leftover(final, "export", {"pid": _dead_pid()})
    reused = _leftover(final, "partial", {"pid": me, "start_ticks": (output._start_ticks(me) or 0) + 1})
    live = _leftover(final, "partial", {"pid": me})
    foreign = _leftover(final, "partial", {"pid": _dead_pid(), "host": socket.gethostname() + "-other"})
    unknown = _leftover(final, "partial", None)
    mixed = _leftover(final, "partial", {"pid": _dead_pid()})  # one rank dead, one still writing
    me_record = output._this_writer()
    output._writer_file(mixed, me, me_record["host"]).write_text(json.dumps(me_record))
    (tmp_path / ".outx.partial-0123abcd").mkdir()  # another output's directory: never considered
    other = tmp_path / ".out.partial-0123abcd.partial-0123abcd"
    other.mkdir()

    found = {p.path: p for p in output.find_partials(final)}
    assert set(found) == {dead, export, reused, live, foreign, unknown, mixed}
    if output._start_ticks(me) is not None:  # procfs: a reused pid is told from the original process
        assert found[reused].stale and "later process" in found[reused].reason
        stale = {dead, export, reused}
    else:  # pragma: no cover
        stale = {dead, export}
    assert {p.path for p in output.find_stale_partials(final)} == stale
    assert "has exited" in found[dead].reason and found[dead].nbytes >= 3 << 20
    assert found[live].state == "live" and "still running" in found[live].reason
    assert found[foreign].state == "foreign" and "another host" in found[foreign].reason
    assert found[unknown].state == "unknown" and "no writer record" in found[unknown].reason
    assert found[mixed].state == "live" and "still running" in found[mixed].reason

    assert {p.path for p in output.remove_stale_partials(final, dry_run=True)} == stale
    assert all(p.is_dir() for p in stale)
    capsys.readouterr()
    assert cli.main(["clean", str(final)]) == 0
    printed = capsys.readouterr().out
    assert all(f"removed {p}" in printed for p in stale) and f"kept {live}" in printed
    assert not any(p.exists() for p in stale)
    assert all(p.is_dir() for p in (live, foreign, unknown, mixed, other, tmp_path / ".outx.partial-0123abcd"))


def test_a_complete_output_with_nothing_at_the_path_is_never_removed(tmp_path):
    """A crash between the two renames of the fallback leaves the old copy (.old-) and the new output (.partial-),
    both complete, and nothing at the path: neither is deleted, the user is told to rename one."""
    final = tmp_path / "out"
    copies = [_leftover(final, kind, {"pid": _dead_pid()}) for kind in ("old", "partial")]
    for d in copies:
        output.write_marker(d, kind="megatron", source=None)
    found = output.find_partials(final)
    assert [p.path for p in found] == sorted(copies) and {p.state for p in found} == {"complete"}
    assert all(f"rename it to {final}" in p.reason for p in found)
    assert output.remove_stale_partials(final) == [] and all(d.is_dir() for d in copies)
    final.mkdir()  # once the path holds an output again, they are ordinary stale leftovers
    assert {p.path for p in output.remove_stale_partials(final)} == set(copies)


def test_a_new_run_reports_stale_leftovers_with_size_and_remedy(fixtures, tmp_path, caplog):
    final = tmp_path / "out"
    dead = _leftover(final, "partial", {"pid": _dead_pid()}, nbytes=5 << 20)
    with caplog.at_level(logging.WARNING, logger="bridge.output"):
        assert cli.main(["convert", "import", "--hf-path", str(make_fixture(fixtures, "glm5")), "--megatron-path",
                         str(final), "--no-progress"]) == 0
    text = caplog.text
    assert str(dead) in text and "5.0 MB" in text and f"megatron-glm5 clean {final}" in text
    assert dead.is_dir()  # reported, not removed behind the user's back


def test_clean_with_nothing_to_clean(tmp_path, capsys):
    assert cli.main(["clean", str(tmp_path / "nothing")]) == 0
    assert "no leftovers" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------------------
# export_hf (in memory)
# --------------------------------------------------------------------------------------------------------------------


def test_export_hf_checks_the_output_before_writing(fixtures, tmp_path, model_parallel):
    import bridge
    from bridge.pretrained import from_hf_pretrained

    model = from_hf_pretrained(make_fixture(fixtures, "glm5"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not replacing it with --overwrite"):
        bridge.export_hf(model, out, overwrite=True)
    with pytest.raises(BridgeError, match=r"work_dir .*: the output path .* contains it"):
        bridge.export_hf(model, tmp_path / "hf", work_dir=tmp_path / "hf" / "tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary checkpoint was written
    assert (out / "notes.txt").read_text() == "mine"

    bridge.export_hf(model, tmp_path / "hf")
    marker = output.read_marker(tmp_path / "hf")
    assert marker["kind"] == "hf" and marker["source"] == "in-memory model (export_hf)"
    bridge.export_hf(model, tmp_path / "hf", overwrite=True)  # its own earlier output
    empty = Path(tempfile.mkdtemp(dir=tmp_path))  # an existing empty directory needs no overwrite
    bridge.export_hf(model, empty)
    assert output.read_marker(empty)["kind"] == "hf" and (empty / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", "out", empty.name])
