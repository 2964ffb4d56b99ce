"""Output directories that appear complete or not at all, that never replace what the tool did not write, and
whose leftovers from interrupted runs can be found and removed safely.

* Everything is written into a hidden sibling ``.<name>.partial-<id>`` and moved to the final path only after the
  last file (the Megatron tracker file / the HF index) is written. A run that fails cleans up after itself; a run
  that is killed (``kill -9``) leaves only the hidden partial directory, never anything at the requested path.
* Every committed output carries a marker file (:data:`MARKER_FILE`: tool, version, kind, source, time, and the
  list of every file and directory it wrote). ``overwrite`` replaces only a marked directory (an earlier output of
  this tool) that still holds nothing but what the marker lists, or an empty one: ``--overwrite`` with a mistyped
  path must not delete a source checkpoint or unrelated files, and files a user added to an earlier output (notes,
  a tokenizer, Megatron-LM's next ``iter_*``) are named and kept. An existing *empty* directory is a fine output even
  without ``overwrite`` (``mkdir out``, ``tempfile.mkdtemp()``). An output path that equals, contains or lies inside
  a source is refused outright, with or without ``overwrite``, and so is a mount point (the finished output is
  renamed into place, which a mount point cannot be).
* Replacing an existing output swaps the new directory in with one atomic ``renameat2(RENAME_EXCHANGE)`` (Linux),
  so at every instant the path holds either the complete old output or the complete new one; the old copy is
  deleted afterwards. Where the exchange is not available (another OS, a filesystem without it) two renames are
  used: a crash between them leaves nothing at the path, the complete old copy at ``.<name>.old-<id>`` and the
  complete new one at ``.<name>.partial-<id>`` (rename either back; ``clean`` reports them and deletes neither).
* Each partial directory holds one writer record per process writing into it (:data:`WRITER_PREFIX` files: pid,
  host, boot id, process start time). :func:`find_partials` classifies leftovers of a path; a partial is *stale*
  only when every writer ran on this host and has exited (pid gone, or the pid now belongs to a process started
  later). :func:`remove_stale_partials` removes only those; partials of live processes, of other hosts, without
  a writer record (older versions), and a complete output whose move was cut short while nothing is at the path
  (the fallback's crash window) are reported and left alone. A new run at the same path reports stale leftovers
  (size, how to remove them) through ``logging``; ``megatron-glm5 clean PATH`` removes them.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from .errors import BridgeError, OutputExistsError

MARKER_FILE = ".megatron-glm5-output.json"
WRITER_PREFIX = ".megatron-glm5-writer."
TOOL = "megatron-glm5"
# hidden siblings .<name>.<kind>-<id>: partial (conversions), export (export_hf's temporary checkpoint), old (replaced)
_LEFTOVER_KINDS = ("partial", "export", "old")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Checks before writing
# --------------------------------------------------------------------------------------------------------------------


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def path_relation(output: Path, source: Path) -> str | None:
    """How ``output`` relates to ``source`` after resolving symlinks: "is", "contains", "is inside" or None."""
    out, src = _real(output), _real(source)
    if out == src:
        return "is"
    if out in src.parents:
        return "contains"
    if src in out.parents:
        return "is inside"
    return None


def check_sources(final: str | Path, sources: Iterable[str | Path | None]) -> None:
    """Refuse an output path that is, contains or lies inside one of ``sources``: replacing it would destroy the
    source, and writing into a source directory mixes outputs with inputs."""
    for src in sources:
        if src is None:
            continue
        relation = path_relation(Path(final), Path(src))
        if relation is not None:
            raise OutputExistsError(f"{Path(final).absolute()}: the output path {relation} the source {src}; "
                                    "choose an output path outside the source checkpoint")


def read_marker(path: str | Path) -> dict | None:
    """The marker of an output directory written by this tool, or None."""
    try:
        data = json.loads((Path(path) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == TOOL else None


def _ours(relative: str) -> bool:
    """Bookkeeping files of this tool inside an output: the marker (and its temporary) and writer records."""
    name = relative.rsplit("/", 1)[-1]
    return "/" not in relative and (name.startswith(MARKER_FILE) or name.startswith(WRITER_PREFIX))


def list_entries(directory: Path) -> list[str]:
    """Every file and directory below ``directory`` as relative POSIX paths (directories end in ``/``), without
    this tool's bookkeeping files; symlinks are entries, never followed."""
    out = []
    for root, dirs, files in os.walk(directory):
        rel = Path(root).relative_to(directory)
        for d in dirs:
            out.append((rel / d).as_posix() + "/")
        out += [(rel / f).as_posix() for f in files]
    return sorted(e for e in out if not _ours(e))


def _shown(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def is_empty_dir(path: Path) -> bool:
    """A real directory (not a symlink to one) with nothing in it."""
    try:
        return path.is_dir() and not path.is_symlink() and next(os.scandir(path), None) is None
    except OSError:
        return False


def check_renameable(final: Path) -> None:
    """An existing output path is replaced by renaming a sibling onto it; a mount point (or anything on another
    file system than its parent) cannot be, and the rename would fail only after the whole conversion."""
    try:
        foreign = os.path.ismount(final) or final.stat().st_dev != final.parent.stat().st_dev
    except OSError:
        return
    if foreign:
        raise OutputExistsError(
            f"{final}: is a mount point; outputs are written next to the output path and renamed into place, which "
            f"a mount point cannot be: give a path inside it (e.g. {final / 'out'})")


def _replaceable(final: Path, how: str = "with --overwrite") -> None:
    """``final`` may be replaced only if it is empty, or if this tool wrote it (it has the marker) and it still
    holds nothing but what the marker lists. ``how``: the words after "not replacing it" in the error."""
    if not final.is_dir() or final.is_symlink():
        what = " (a symlink)" if final.is_symlink() else ""
        raise OutputExistsError(f"{final}: exists and is not a directory{what}; not replacing it")
    check_renameable(final)
    marker = read_marker(final)
    entries = list_entries(final)
    if marker is None:
        if entries:
            raise OutputExistsError(
                f"{final}: not replacing it {how}: a non-empty directory that {TOOL} did not write (no "
                f"{MARKER_FILE} marker; it holds {_shown(entries)}); remove it yourself or choose another output "
                "path")
        return
    written = marker.get("files")
    if not isinstance(written, list):
        raise OutputExistsError(
            f"{final}: not replacing it {how}: its {MARKER_FILE} marker (an older {TOOL}) does not list "
            "the files it wrote, so files added since cannot be told apart; remove it yourself or choose another "
            "output path")
    added = sorted(set(entries) - set(written))
    added = [e for e in added if not any(e.startswith(d) for d in added if d.endswith("/") and d != e)]  # top-most
    if added:
        raise OutputExistsError(
            f"{final}: not replacing it {how}: it holds {len(added)} file(s) or folder(s) that {TOOL} did not write "
            f"({_shown(added)}; {MARKER_FILE} lists what it wrote); move them out or choose another output path")


def check_output_dir(final: str | Path, *, overwrite: bool, sources: Iterable[str | Path | None] = (),
                     how: str = "with --overwrite") -> Path:
    """The absolute output path, after checking that it is not a source and that it is free (absent or an empty
    directory) or, with ``overwrite``, replaceable (``how`` words the refusal). Reports leftovers of interrupted
    runs at this path (see :func:`find_partials`)."""
    final = Path(final).expanduser().absolute()
    check_sources(final, sources)
    if final.exists() or final.is_symlink():
        if is_empty_dir(final):
            check_renameable(final)
        elif not overwrite:
            raise OutputExistsError(f"{final}: output directory already exists; pass --overwrite (overwrite=True) "
                                    "to replace it")
        else:
            _replaceable(final, how)
    warn_leftovers(final)
    return final


# --------------------------------------------------------------------------------------------------------------------
# Writer records
# --------------------------------------------------------------------------------------------------------------------


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22); None without procfs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _this_writer() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start_ticks": _start_ticks(pid),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[:8]}


def _writer_file(directory: Path, pid: int, host: str) -> Path:
    return directory / f"{WRITER_PREFIX}{re.sub(r'[^A-Za-z0-9._-]', '_', host)}.{pid}.json"


def register_writer(directory: str | Path) -> None:
    """Record this process as a writer of ``directory`` (a partial output): a later run can then tell whether the
    directory is a leftover of a dead process or work in progress."""
    me = _this_writer()
    path = _writer_file(Path(directory), me["pid"], me["host"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(me) + "\n")
    os.replace(tmp, path)


def _writers(directory: Path) -> list[dict]:
    out = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return out
    for p in entries:
        if p.name.startswith(WRITER_PREFIX) and p.name.endswith(".json"):
            try:
                w = json.loads(p.read_text())
            except (OSError, ValueError):
                w = None
            out.append(w if isinstance(w, dict) else {"unreadable": p.name})
    return out


def _drop_writer_records(directory: Path) -> None:
    for p in list(directory.iterdir()):
        if p.name.startswith(WRITER_PREFIX):
            p.unlink(missing_ok=True)


def unregister_writer(directory: str | Path) -> None:
    """Remove this process's writer record from ``directory`` (best effort)."""
    me = _this_writer()
    try:
        _writer_file(Path(directory), me["pid"], me["host"]).unlink(missing_ok=True)
    except OSError:
        pass


def _writer_state(w: dict) -> tuple[bool, str]:
    """(dead, why) for one writer record; anything uncertain counts as alive."""
    if "unreadable" in w or not isinstance(w.get("pid"), int) or w["pid"] <= 0:
        return False, f"unreadable writer record {w.get('unreadable', '')}".strip()
    pid, host = w["pid"], w.get("host")
    if host != socket.gethostname():
        return False, f"written by pid {pid} on another host ({host}); check there"
    boot = _boot_id()
    if w.get("boot_id") and boot and w["boot_id"] != boot:
        return True, f"writer pid {pid} ran before this host's last reboot"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True, f"writer pid {pid} on {host} has exited"
    except PermissionError:
        pass  # exists, owned by someone else
    ticks = _start_ticks(pid)
    if ticks is not None and w.get("start_ticks") is not None and ticks != w["start_ticks"]:
        return True, f"writer pid {pid} on {host} has exited (the pid now belongs to a later process)"
    return False, f"pid {pid} on {host} is still running"


# --------------------------------------------------------------------------------------------------------------------
# Leftovers of interrupted runs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leftover:
    """A hidden work directory of an output path. ``state``: "stale" (every writer ran on this host and has exited:
    safe to remove), "live" (a writer is running, or may be: unreadable record), "foreign" (written on another
    host), "unknown" (no writer record), "complete" (a finished output whose move was cut short while nothing is at
    the path: the only copy)."""

    path: Path
    nbytes: int
    state: str
    reason: str

    @property
    def stale(self) -> bool:
        return self.state == "stale"


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _classify(path: Path, final: Path) -> Leftover:
    size = _tree_bytes(path)
    writers = _writers(path)
    if not writers:
        return Leftover(path, size, "unknown", "no writer record (left by an older version, or still being "
                                               "created): remove it by hand if no conversion is running")
    states = [(dead, why, w) for w in writers for dead, why in [_writer_state(w)]]
    alive = [(why, w) for dead, why, w in states if not dead]
    if alive:
        foreign = all(w.get("host") not in (None, socket.gethostname()) for _, w in alive)
        return Leftover(path, size, "foreign" if foreign else "live", "; ".join(why for why, _ in alive))
    if read_marker(path) is not None and not (final.exists() or final.is_symlink()):
        # a complete output whose move was cut short (the two-rename fallback): the only copy, never deleted here
        return Leftover(path, size, "complete", f"a complete output whose move to {final} was interrupted and "
                                                f"nothing is at {final}: rename it to {final}")
    return Leftover(path, size, "stale", "; ".join(why for _, why, _ in states))


def find_partials(final: str | Path) -> list[Leftover]:
    """Hidden work directories of output path ``final`` (``.<name>.partial-<id>`` of conversions,
    ``.<name>.export-<id>`` of :func:`bridge.export_hf`, ``.<name>.old-<id>`` of a replaced output), classified."""
    final = Path(final).expanduser().absolute()
    pattern = re.compile(rf"\.{re.escape(final.name)}\.(?:{'|'.join(_LEFTOVER_KINDS)})-[0-9a-f]{{8}}")
    try:
        entries = sorted(final.parent.iterdir())
    except OSError:
        return []
    return [_classify(p, final) for p in entries if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]


def find_stale_partials(final: str | Path) -> list[Leftover]:
    """The leftovers of ``final`` whose writers all ran on this host and have exited: safe to remove."""
    return [p for p in find_partials(final) if p.stale]


def remove_stale_partials(final: str | Path, *, dry_run: bool = False) -> list[Leftover]:
    """Remove (or with ``dry_run`` only list) the stale leftovers of output path ``final``; each one is checked
    again right before it is removed. Returns the removed ones."""
    final = Path(final).expanduser().absolute()
    removed = []
    for item in find_stale_partials(final):
        again = _classify(item.path, final)
        if not again.stale:
            continue
        if not dry_run:
            _remove_tree(item.path)
        removed.append(again)
    return removed


_reported: set[Path] = set()


def warn_leftovers(final: Path) -> None:
    """Tell (logging, on stderr by default) about leftovers of earlier runs at ``final``: their size and how to
    remove them. Real models leave terabytes behind. Each one once per process, and only on rank 0 of a
    ``torchrun`` launch (every rank checks the output path)."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        items = find_partials(final)
    except OSError:  # pragma: no cover - an unreadable parent is reported by the write itself
        return
    for item in items:
        if item.path in _reported or item.state in ("live", "foreign"):
            continue
        _reported.add(item.path)
        if item.stale:
            log.warning("%s: leftover of an interrupted run (%s; %s); remove it with `%s clean %s` or "
                        "bridge.output.remove_stale_partials(%r)", item.path, format_bytes(item.nbytes), item.reason,
                        TOOL, final, str(final))
        else:
            log.warning("%s: leftover work directory (%s; %s)", item.path, format_bytes(item.nbytes), item.reason)


# --------------------------------------------------------------------------------------------------------------------
# Writing and committing
# --------------------------------------------------------------------------------------------------------------------


def partial_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"


def make_partial_dir(final: Path, tmp: Path | None = None) -> Path:
    """Create a fresh partial directory for ``final`` (``tmp``: a name from :func:`partial_dir` already shared with
    other ranks) and record this process as its writer."""
    tmp = partial_dir(final) if tmp is None else Path(tmp)
    tmp.mkdir(parents=True)
    register_writer(tmp)
    return tmp


def _remove_tree(path: Path) -> None:
    """Delete a work directory, its writer records last: an interrupted removal stays recognisable as stale."""
    path = Path(path)
    if not path.exists():
        return
    for p in list(path.iterdir()):
        if p.name.startswith(WRITER_PREFIX):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def discard_partial(tmp: Path) -> None:
    """Remove a partial directory after a failed run (best effort)."""
    try:
        _remove_tree(tmp)
    except OSError:  # pragma: no cover
        shutil.rmtree(tmp, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``; False where the call or the flag is not supported (then the caller falls back)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28 or another libc
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (True), or report that this system cannot (False)."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def write_marker(directory: Path, *, kind: str, source: str | Path | None) -> None:
    """The marker that lets a later ``--overwrite`` recognise this directory as ours. ``source``: a path (stored
    absolute) or a description (a str that is not an existing path, e.g. "in-memory model")."""
    from megatron_glm5.version import __version__

    if isinstance(source, Path) or (isinstance(source, str) and Path(source).exists()):
        source = str(_real(source))
    marker = {"tool": TOOL, "version": __version__, "kind": kind, "source": source,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": list_entries(Path(directory))}
    path = Path(directory) / MARKER_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def commit_dir(tmp: Path, final: Path, *, overwrite: bool, kind: str, source: str | Path | None) -> None:
    """Mark ``tmp`` as an output of this tool and move it to ``final``. An existing ``final`` is replaced only if it
    is an empty directory, or with ``overwrite`` if replaceable (checked again now), by an atomic exchange; the old
    copy, which then sits at ``tmp`` with this process's writer record, is deleted last."""
    write_marker(tmp, kind=kind, source=source)
    if is_empty_dir(final):
        overwrite = True  # nothing to lose; _replaceable below checks it again
    if not (final.exists() or final.is_symlink()):
        try:
            moved = _renameat2(tmp, final, _RENAME_NOREPLACE)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise OutputExistsError(f"{final}: appeared while converting; refusing to replace it") from None
            raise
        if not moved:
            tmp.rename(final)
        _drop_writer_records(final)
        return
    if not overwrite:
        raise OutputExistsError(f"{final}: appeared while converting; refusing to replace it")
    _replaceable(final)
    try:
        register_writer(final)  # the old copy is recognisable as this process's leftover once it moves away
    except OSError:
        pass  # then it is reported as a leftover without a writer record, should its deletion be cut short
    try:
        exchanged = _exchange(tmp, final)
    except BaseException:
        unregister_writer(final)  # still the old output: leave it as it was
        raise
    if exchanged:
        old = tmp
    else:  # no atomic exchange here: two renames, the old copy restored if the second one fails
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        try:
            final.rename(old)
        except BaseException:
            unregister_writer(final)
            raise
        try:
            tmp.rename(final)
        except BaseException:
            old.rename(final)
            _drop_writer_records(final)
            raise
    _drop_writer_records(final)
    _remove_tree(old)


@contextmanager
def atomic_output_dir(final: str | Path, *, overwrite: bool, kind: str, source: str | Path | None,
                      sources: Iterable[str | Path | None] = ()) -> Iterator[Path]:
    """Single-writer form: yields the partial directory, commits it on success, removes it on failure."""
    final = check_output_dir(final, overwrite=overwrite, sources=sources)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_partial_dir(final)
    try:
        yield tmp
        commit_dir(tmp, final, overwrite=overwrite, kind=kind, source=source)
    except BaseException:
        discard_partial(tmp)
        raise


__all__ = ["MARKER_FILE", "Leftover", "atomic_output_dir", "check_output_dir", "commit_dir", "find_partials",
           "find_stale_partials", "is_empty_dir", "list_entries", "make_partial_dir", "read_marker",
           "register_writer", "remove_stale_partials", "unregister_writer"]


def staging_dir(final: Path, *, overwrite: bool, work_dir: str | Path | None = None) -> Path:
    """A temporary directory ``.<name>.export-<id>`` (next to ``final``, or in ``work_dir``) for an in-memory
    export's intermediate checkpoint, created only after ``final`` passed :func:`check_output_dir` (so a bad output
    path fails before anything large is written). Registered with its writer, so a killed run's copy is found by
    :func:`find_stale_partials`."""
    final = Path(final).expanduser().absolute()
    base = Path(work_dir).expanduser().absolute() if work_dir is not None else final.parent
    relation = path_relation(final, base)
    if relation in ("is", "contains"):
        raise BridgeError(f"work_dir {base}: the output path {final} {relation} it; the temporary checkpoint must "
                          "live outside the output directory")
    check_output_dir(final, overwrite=overwrite)
    tmp = base / f".{final.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        register_writer(tmp)
    except OSError as e:
        raise BridgeError(f"{tmp}: cannot create the temporary checkpoint directory ({e})") from None
    return tmp
