"""The benchmarks' markdown output: print the report and write it to ``--out``."""

from __future__ import annotations


def emit(lines: list[str] | str, out: str | None, *, append: bool = True) -> str:
    """Print ``lines`` (or a finished text) as one markdown block and write it to ``out`` when given: appended plus a
    blank line (the runs of one device call add up), or with ``append=False`` as the whole file."""
    text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a" if append else "w") as f:
            f.write(text + "\n" if append else text)
    return text
