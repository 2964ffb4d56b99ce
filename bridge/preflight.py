"""Checks of user input that run before anything expensive: before megatron-core or transformers is imported,
before ranks are spawned, before any output exists.

Why a separate pass: the command line promises that every user error is one ``error:`` line and exit status 2.
Without these checks a wrong path surfaces as a ``FileNotFoundError`` traceback from deep inside a loader, a bad
``--tp`` as megatron-core's assertion inside a spawned rank after seconds of start-up, and an unwritable output as a
``PermissionError`` from ``mkdir``. Each function here raises :class:`~bridge.errors.BridgeError` naming the flag, the
path, what was expected and what was found; they import nothing heavy (``megatron_glm5.config`` only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import BridgeError, CheckpointFormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker file (bridge.megatron_io.TRACKER_FILE)


def _where(flag: str | None, path: str | Path) -> str:
    return f"{flag} {path}" if flag else str(path)


def hf_checkpoint_dir(path: str | Path, *, flag: str | None = "--hf-path") -> Path:
    """``path`` is a readable directory with ``config.json`` and safetensors weights (an index or one file)."""
    p = Path(path)
    where = _where(flag, path)
    expected = f"expected an HF checkpoint directory ({'config.json'} + {INDEX_FILE} + *.safetensors)"
    if not p.exists():
        raise CheckpointFormatError(f"{where}: no such directory; {expected}")
    if not p.is_dir():
        raise CheckpointFormatError(f"{where}: is a file, not a directory; {expected}")
    if not os.access(p, os.R_OK | os.X_OK):
        raise CheckpointFormatError(f"{where}: directory is not readable (permission denied)")
    if not (p / "config.json").is_file():
        raise CheckpointFormatError(f"{where}: missing config.json; {expected}")
    if not (p / INDEX_FILE).is_file() and not (p / SINGLE_FILE).is_file():
        found = sorted(q.name for q in p.glob("*.safetensors"))[:3]
        raise CheckpointFormatError(
            f"{where}: missing {INDEX_FILE} (and no single {SINGLE_FILE}); "
            + (f"found shards {', '.join(found)} but no index" if found else "found no safetensors files")
        )
    return p


def read_hf_config(path: str | Path, *, flag: str | None = "--hf-path") -> dict[str, Any]:
    """The raw ``config.json`` (of a directory, or the file itself) as a dict; unreadable, non-JSON and non-object
    files are errors naming the file (``megatron_glm5.config.load_hf_config`` raises ``FileNotFoundError``)."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    where = _where(flag, path)
    if not cfg.exists():
        raise CheckpointFormatError(f"{where}: {cfg} not found; expected a GLM-5.x config.json")
    if not cfg.is_file():
        raise CheckpointFormatError(f"{where}: {cfg} is a directory; expected a config.json file")
    try:
        text = cfg.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{where}: cannot read {cfg} ({e})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{cfg}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{cfg}: expected a JSON object, found {type(raw).__name__}")
    return raw


def parse_config(raw: dict[str, Any], path: str | Path, *, flag: str | None = None, parse=None):
    """The architecture of a raw ``config.json`` read from ``path`` (a checkpoint directory or the file) by
    ``parse`` (default :func:`~megatron_glm5.architectures.parse_architecture`): a field error
    (:class:`~megatron_glm5.config.GLM5ConfigError`, "config field 'model_type': expected ...") is prefixed with the
    file it is in, as every other error names its file."""
    from megatron_glm5.config import GLM5ConfigError

    if parse is None:
        from megatron_glm5.architectures import parse_architecture as parse
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    try:
        return parse(raw)
    except GLM5ConfigError as e:
        if str(e).startswith(str(cfg)):
            raise
        raise GLM5ConfigError(f"{_where(flag, cfg)}: {e}") from None


def megatron_checkpoint_dir(path: str | Path, *, flag: str | None = "--megatron-path") -> Path:
    """``path`` is a Megatron-LM save directory (tracker file) or one ``iter_XXXXXXX`` / ``release`` directory
    whose ``.metadata`` exists. Returns the iteration directory."""
    p = Path(path)
    where = _where(flag, path)
    expected = f"expected a Megatron-LM save directory (with {TRACKER_FILE}) or one iter_XXXXXXX directory"
    if not p.exists():
        raise CheckpointFormatError(f"{where}: no such directory; {expected}")
    if not p.is_dir():
        raise CheckpointFormatError(f"{where}: is a file, not a directory; {expected}")
    if not os.access(p, os.R_OK | os.X_OK):
        raise CheckpointFormatError(f"{where}: directory is not readable (permission denied)")
    from .megatron_io import resolve_checkpoint_dir  # torch.distributed.checkpoint only, no megatron-core

    try:
        ckpt = resolve_checkpoint_dir(p)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{flag}: {e}" if flag else str(e)) from None
    if not ckpt.is_dir():
        raise CheckpointFormatError(f"{where}: {p / TRACKER_FILE} names {ckpt.name}, which does not exist")
    if not (ckpt / ".metadata").is_file():
        raise CheckpointFormatError(f"{_where(flag, ckpt)}: missing .metadata (an incomplete torch_dist checkpoint)")
    return ckpt


ADAPTER_CONFIG = "adapter_config.json"  # bridge.adapters.ADAPTER_CONFIG
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_dir(path: str | Path, *, flag: str | None = "--adapter-path", megatron_ok: bool = False) -> Path:
    """``path`` is an HF PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) or, with
    ``megatron_ok`` (``lora merge``), a Megatron checkpoint holding adapters. The error names the missing file."""
    p = Path(path)
    where = _where(flag, path)
    expected = f"expected a PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})" + (
        f" or a Megatron checkpoint with LoRA adapters ({TRACKER_FILE} or an iter_XXXXXXX directory)"
        if megatron_ok else "")
    if not p.exists():
        raise CheckpointFormatError(f"{where}: no such directory; {expected}")
    if not p.is_dir():
        raise CheckpointFormatError(f"{where}: is a file, not a directory; {expected}")
    if (p / ADAPTER_CONFIG).is_file():
        return p
    if megatron_ok and any((p / f).is_file() for f in (TRACKER_FILE, "metadata.json", ".metadata")):
        return p
    found = sorted(q.name for q in p.iterdir())[:5]
    raise CheckpointFormatError(
        f"{where}: missing {ADAPTER_CONFIG}" + (f" (and no {TRACKER_FILE} or metadata.json)" if megatron_ok else "")
        + f"; {expected}" + (f"; found {', '.join(found)}" if found else "; the directory is empty"))


def output_dir(path: str | Path, *, flag: str | None) -> Path:
    """The output can be created: it is not an existing file, and its nearest existing ancestor is a writable
    directory (outputs are written to a hidden sibling and renamed, so the parent must be writable). Whether an
    existing directory may be replaced (``--overwrite``) is checked by the converters."""
    p = Path(path).absolute()
    where = _where(flag, path)
    if p.exists() and not p.is_dir():
        raise BridgeError(f"{where}: exists and is a file; expected a directory to create (or an existing one with "
                          "--overwrite)")
    if p.is_dir():
        from .output import check_renameable

        try:
            check_renameable(p)
        except BridgeError as e:
            raise BridgeError(f"{flag}: {e}" if flag else str(e)) from None
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise BridgeError(f"{where}: cannot create it: {parent} is a file, not a directory")
    if not _writable(parent):
        raise BridgeError(f"{where}: cannot create it: {parent} is not writable (read-only file system or "
                          "permission denied)")
    return p


def _writable(directory: Path) -> bool:
    """Whether a directory can be created in ``directory``: tried, not inferred from permission bits (root passes
    ``os.access`` on read-only file systems such as /proc)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatron-glm5-probe-", dir=directory))
    except OSError:
        return False
    return True


def work_dir(path: str | Path, *, flag: str | None) -> Path:
    """A directory to work in that may already exist (``--work-dir``, ``demo --out``): an existing one must be a
    writable directory, a new one must be creatable."""
    p = Path(path).absolute()
    where = _where(flag, path)
    if p.exists():
        if not p.is_dir():
            raise BridgeError(f"{where}: exists and is a file; expected a directory")
        if not _writable(p):
            raise BridgeError(f"{where}: directory is not writable (read-only file system or permission denied)")
        return p
    return output_dir(p, flag=flag)



DEMO_OUTPUTS = ("hf", "megatron", "hf_roundtrip", "hf_trained")  # what `megatron-glm5 demo` writes into --out


def demo_outputs(work: str | Path, *, flag: str | None = "--out") -> Path:
    """The demo writes :data:`DEMO_OUTPUTS` into its work directory with the output rules of ``convert`` (never an
    ``rmtree``): each must be absent, an empty directory, or an earlier output of this tool that holds only what
    its marker lists. Anything else (a user's ``hf/mydata.txt``) is refused here, before the demo starts."""
    from .output import check_output_dir

    w = Path(work).absolute()
    for sub in DEMO_OUTPUTS:
        try:
            check_output_dir(w / sub, overwrite=True, how="(the demo replaces only its own earlier outputs)")
        except BridgeError as e:
            raise BridgeError(f"{_where(flag, work)}: {e}") from None
    return w
