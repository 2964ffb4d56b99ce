"""Package dependencies are one-way.

* The layers, lowest first (:data:`RANKS`): kernels and the floor (``compat``, ``device_check``, ``version``, the
  fusions and routes into megatron-core: ``fusions``, ``optim_fusions``, ``moe_dispatch``, ``finalize_walks``,
  ``deferred_grad_checks``, ``adam_model_copy``) <-
  ``dsa`` (and ``moe``) <- ``core`` (with the mechanisms its layer base carries: ``offload``, ``cpu``, ``providers``)
  <- the families (``families.py``, ``glm5/``, ``glm5_next/``) <- model / pretrain / rl / LoRA (and the public
  re-export modules) <- ``bridge`` <- the command line (``bridge/cli.py``, ``bridge/demo.py``). A file imports only
  files of its own layer or below, counting every import (module level and inside functions, as ``farm-studio
  look`` draws them); the one allowed upward edge is the documented lazy ``megatron_glm5.from_hf_pretrained`` alias.
* Kernels import no model code. No file imports a private (``_``) name from another package (folder). Code inside
  ``megatron_glm5`` never imports the public re-export modules kept for users (``megatron_glm5.config``,
  ``megatron_glm5.spec``).
* No import circles between the files of either package. Circles removed in issue 21 are named so that a regression
  says which one is back: ``bridge/adapters.py`` <-> ``bridge/lora_convert.py``, ``bridge/parity.py`` <->
  ``bridge/parity_next.py``, ``megatron_glm5/rl/logprobs.py`` <-> ``rl/replay.py``, ``megatron_glm5/dsa/attention.py``
  <-> ``dsa/indexer_training.py``.
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
    ("megatron_glm5/dsa/attention.py", "megatron_glm5/dsa/indexer_training.py"),
)

# (layer, path prefixes): the longest matching prefix places a file; a file may import its own layer or lower ones
RANKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("floor", ("megatron_glm5/kernels/", "megatron_glm5/compat.py", "megatron_glm5/device_check.py",
               "megatron_glm5/version.py", "megatron_glm5/fusions.py", "megatron_glm5/optim_fusions.py",
               "megatron_glm5/moe_dispatch.py", "megatron_glm5/finalize_walks.py",
               "megatron_glm5/deferred_grad_checks.py", "megatron_glm5/adam_model_copy.py",
               "megatron_glm5/__init__.py")),
    ("dsa", ("megatron_glm5/dsa/", "megatron_glm5/moe/")),
    ("core", ("megatron_glm5/core/", "megatron_glm5/offload.py", "megatron_glm5/cpu.py", "megatron_glm5/providers.py",
              "megatron_glm5/parallel.py")),
    ("families", ("megatron_glm5/families.py", "megatron_glm5/glm5/", "megatron_glm5/glm5_next/")),
    ("features", ("megatron_glm5/",)),  # model, pretrain, rl, lora*, inventory, architectures, testing, re-exports
    ("bridge", ("bridge/",)),
    ("cli", ("bridge/cli.py", "bridge/demo.py", "bridge/__init__.py")),
)
SHIMS = ("megatron_glm5/config.py", "megatron_glm5/spec.py")  # public re-export modules, for users only


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


def _rank(rel: str) -> int:
    best, rank = "", None
    for i, (_, prefixes) in enumerate(RANKS):
        for prefix in prefixes:
            if rel.startswith(prefix) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank is not None, f"{rel} is in no layer of RANKS"
    return rank


def test_imports_point_down_the_layers():
    upward = []
    for rel, targets in _graph().items():
        for target in targets:
            if _rank(target) > _rank(rel):
                upward.append(f"{rel} ({RANKS[_rank(rel)][0]}) imports {target} ({RANKS[_rank(target)][0]})")
    assert not upward, upward


def test_kernels_import_no_model_code():
    graph = _graph()
    bad = [f"{rel} imports {t}" for rel in graph if rel.startswith("megatron_glm5/kernels/")
           for t in graph[rel] if not t.startswith("megatron_glm5/kernels/")]
    assert not bad, bad


def test_package_code_does_not_import_the_public_reexports():
    graph = _graph()
    bad = [f"{rel} imports {t}" for rel in graph if rel.startswith("megatron_glm5/") and rel not in SHIMS
           for t in graph[rel] if t in SHIMS]
    assert not bad, bad


def _private_imports(rel: str) -> list[tuple[str, str]]:
    """``(imported file, name)`` for every ``from x import _name`` of file ``rel``."""
    out = []
    here = _package_of(rel)
    for node in ast.walk(ast.parse((REPO / rel).read_text(), rel)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = here[: len(here) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        target = _module_file(module)
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__") and target is not None:
                out.append((target, alias.name))
    return out


def test_no_private_name_imported_across_packages():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for target, name in _private_imports(rel):
                if target.rsplit("/", 1)[0] != rel.rsplit("/", 1)[0]:
                    bad.append(f"{rel} imports {name} from {target}")
    assert not bad, bad


def test_rank_table_places_files_where_the_design_says():
    assert RANKS[_rank("megatron_glm5/kernels/bounds.py")][0] == "floor"
    assert RANKS[_rank("megatron_glm5/dsa/tilelang_attention.py")][0] == "dsa"
    assert RANKS[_rank("megatron_glm5/core/layer.py")][0] == "core"
    assert RANKS[_rank("megatron_glm5/glm5/spec.py")][0] == "families"
    assert RANKS[_rank("megatron_glm5/model.py")][0] == "features"
    assert RANKS[_rank("bridge/tables.py")][0] == "bridge"
    assert RANKS[_rank("bridge/cli.py")][0] == "cli"


def test_alias_resolves_to_the_bridge_function():
    import bridge
    import megatron_glm5

    assert bridge.from_hf_pretrained.__module__ == "bridge.pretrained"
    assert callable(megatron_glm5.from_hf_pretrained)
