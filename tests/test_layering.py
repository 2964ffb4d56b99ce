"""Package dependencies are one-way.

* ``bridge`` builds on ``megatron_glm5``; ``megatron_glm5`` imports nothing from ``bridge`` (except the documented
  lazy ``megatron_glm5.from_hf_pretrained`` alias).
* No import circles between the files of either package, counting every import (module level and inside
  functions, as ``farm-studio look`` draws them), except through that alias. Circles removed in issue 21 (phase 1)
  are named so that a regression says which one is back: ``bridge/adapters.py`` <-> ``bridge/lora_convert.py``,
  ``bridge/parity.py`` <-> ``bridge/parity_next.py``, ``megatron_glm5/rl/logprobs.py`` <-> ``rl/replay.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("megatron_glm5", "bridge")
ALLOWED = {("megatron_glm5/__init__.py", "bridge.pretrained")}
REMOVED_CIRCLES = (
    ("bridge/adapters.py", "bridge/lora_convert.py"),
    ("bridge/parity.py", "bridge/parity_next.py"),
    ("megatron_glm5/rl/logprobs.py", "megatron_glm5/rl/replay.py"),
)


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


def _module_file(module: str) -> str | None:
    """``a.b.c`` -> ``a/b/c.py`` or ``a/b/c/__init__.py`` (repository-relative), None outside the packages."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    for cand in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
        if (REPO / cand).is_file():
            return cand
    return None


def _package_of(rel: str) -> list[str]:
    parts = rel[:-3].split("/")
    return parts[:-1] if parts[-1] == "__init__" else parts[:-1]


def _edges(rel: str) -> set[tuple[str, str]]:
    """``(imported file, imported module name)`` for every import of repository file ``rel``."""
    out = set()
    here = _package_of(rel)
    for node in ast.walk(ast.parse((REPO / rel).read_text(), rel)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # "from pkg import sub" imports the submodule when there is one
            targets = [f"{module}.{a.name}" if _module_file(f"{module}.{a.name}") else module for a in node.names]
        else:
            continue
        for name in targets:
            target = _module_file(name)
            if target is not None and target != rel:
                out.add((target, name))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            graph[rel] = {t for t, name in _edges(rel) if (rel, name) not in ALLOWED}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = _graph()
    for a, b in REMOVED_CIRCLES:
        assert not (b in graph[a] and a in graph[b]), f"the circle {a} <-> {b} is back"
    assert not _cycles(graph), f"import circles (file -> file, any import): {_cycles(graph)}"


def test_cycle_detection_sees_function_level_imports():
    """The graph counts an import inside a function as an edge (a lazy import still ties two files)."""
    graph = _graph()
    assert "bridge/parity.py" in graph["bridge/parity_next.py"]  # module level
    assert "bridge/pretrained.py" not in graph["megatron_glm5/__init__.py"]  # the allowed alias (in a function)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_alias_resolves_to_the_bridge_function():
    import bridge
    import megatron_glm5

    assert bridge.from_hf_pretrained.__module__ == "bridge.pretrained"
    assert callable(megatron_glm5.from_hf_pretrained)
