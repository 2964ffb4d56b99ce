"""Package dependencies are one-way: ``bridge`` builds on ``megatron_glm5``; ``megatron_glm5`` imports nothing from
``bridge`` (except the documented lazy ``megatron_glm5.from_hf_pretrained`` alias)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {("megatron_glm5/__init__.py", "bridge.pretrained")}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_model_package_does_not_import_bridge():
    offending = []
    for path in sorted((REPO / "megatron_glm5").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name in _imports(path):
            if (name == "bridge" or name.startswith("bridge.")) and (rel, name) not in ALLOWED:
                offending.append(f"{rel} imports {name}")
    assert not offending, offending


def test_alias_resolves_to_the_bridge_function():
    import bridge
    import megatron_glm5

    assert bridge.from_hf_pretrained.__module__ == "bridge.pretrained"
    assert callable(megatron_glm5.from_hf_pretrained)
