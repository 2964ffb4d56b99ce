"""Output directories that appear complete or not at all.

Everything is written into a hidden sibling ``.<name>.partial-<id>`` and renamed to the final path only after the
last file (the Megatron tracker file / the HF index) is written. A run that fails cleans up after itself; a run that
is killed (``kill -9``) leaves only the hidden partial directory, never anything at the requested path.
"""

from __future__ import annotations

import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import OutputExistsError


def check_output_dir(final: str | Path, *, overwrite: bool) -> Path:
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise OutputExistsError(f"{final}: output directory already exists; pass --overwrite (overwrite=True) to "
                                "replace it")
    if final.exists() and not final.is_dir():
        raise OutputExistsError(f"{final}: exists and is not a directory")
    return final


def partial_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"


def commit_dir(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``final`` (replacing an existing ``final`` only when ``overwrite``)."""
    if final.exists():
        if not overwrite:
            raise OutputExistsError(f"{final}: appeared while converting; refusing to replace it")
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


@contextmanager
def atomic_output_dir(final: str | Path, *, overwrite: bool) -> Iterator[Path]:
    """Single-writer form: yields the partial directory, renames it on success, removes it on failure."""
    final = check_output_dir(final, overwrite=overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(final)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, final, overwrite=overwrite)
