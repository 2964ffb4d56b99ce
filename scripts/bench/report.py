"""The benchmarks' markdown output: print the table and append it to ``--out`` (a device call's runs add up)."""

from __future__ import annotations


def emit(lines: list[str], out: str | None) -> str:
    """Print ``lines`` as one markdown block and append it (plus a blank line) to ``out`` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
    return text
