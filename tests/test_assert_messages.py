"""Every ``torch._assert_async`` message in the package fits CUDA's limit: on a CUDA tensor torch refuses messages of
255 characters or more (``RuntimeError: Message length must be smaller than 255``) before the check even runs, while
on CPU any length passes, so only a GPU run would notice."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_glm5"
LIMIT = 254


def _longest_rendering(node: ast.expr, src: str) -> int:
    """Length of the message with every ``{field}`` of an f-string rendered as 12 characters."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(len(v.value) if isinstance(v, ast.Constant) else 12 for v in node.values)
    raise AssertionError(f"unexpected message expression {ast.get_source_segment(src, node)!r}")


def test_assert_async_messages_fit_cuda():
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "_assert_async"
                    and len(node.args) > 1):
                n = _longest_rendering(node.args[1], src)
                assert n <= LIMIT, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: message of ~{n} characters"
                checked += 1
    assert checked >= 6
