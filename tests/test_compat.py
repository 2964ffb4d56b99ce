"""megatron_glm5.compat: every reach into megatron-core / torch / transformers internals is registered with the
version it was checked against, its probe passes on the installed versions, and a probe fails when the internal
it guards moves (so an upgrade that moves one fails here, naming it, not deep inside a training step)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_glm5 import compat

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("hook", compat.HOOKS, ids=lambda h: h.name[:60])
def test_probe_passes_on_installed_versions(hook):
    assert hook.checked_against and hook.used_by
    hook.probe()


def test_ten_hooks_cover_the_design_list():
    assert len(compat.HOOKS) == 10
    assert compat.check_all() == []


def test_probe_fails_when_router_replay_list_moves(monkeypatch):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    monkeypatch.delattr(RouterReplay, "global_router_replay_instances")
    assert any("RouterReplay" in f for f in compat.check_all())


def test_probe_fails_when_checkpoint_function_changes(monkeypatch):
    from megatron.core.tensor_parallel import random as mcore_random

    class Moved(torch.autograd.Function):
        @staticmethod
        def forward(context, run_function, *args):  # the node no longer in a local named ctx
            return run_function(*args)

    monkeypatch.setattr(mcore_random, "CheckpointFunction", Moved)
    assert any("CheckpointFunction" in f for f in compat.check_all())


def test_probe_fails_when_whitelist_entry_moves(monkeypatch):
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    monkeypatch.delattr(absorbed_mla, "TEColumnParallelLinear")
    assert any("whitelist" in f for f in compat.check_all())


def test_checkpoint_node_is_the_running_checkpoint():
    from megatron.core.tensor_parallel.random import CheckpointFunction

    seen = []

    def run(x):
        seen.append(compat.checkpoint_node())
        return x * 2

    assert compat.checkpoint_node() is None
    x = torch.ones(2, requires_grad=True)
    CheckpointFunction.apply(run, False, x).sum().backward()
    assert seen[0] is not None and seen[1] is seen[0]  # the recompute sees the same node


def test_patches_are_remembered_and_undone():
    marker = object()

    class Owner:
        attr = marker

    compat.install_patches(((Owner, "attr", 1),))
    compat.install_patches(((Owner, "attr", 2),))  # once: the first original is kept
    assert Owner.attr == 1 and compat.is_patched(Owner, "attr")
    compat.remove_patches(((Owner, "attr", None),))
    assert Owner.attr is marker and not compat.is_patched(Owner, "attr")


def test_cpu_shims_are_undone_at_interpreter_exit(tmp_path):
    """attach_cpu_mode's process-wide CUDA-query shims are gone once the interpreter exits (compat's atexit)."""
    import subprocess
    import sys

    code = (  # registered before compat's own exit handler, so it runs after it (atexit is last-in first-out)
        "import atexit, torch\n"
        "original = torch.cuda.current_device\n"
        "atexit.register(lambda: print('restored', torch.cuda.current_device is original))\n"
        "from megatron_glm5 import cpu\n"
        "cpu._enable_cuda_queries()\n"
        "print('installed', torch.cuda.current_device is not original or torch.cuda.is_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)}).stdout
    assert "installed True" in out and "restored True" in out


def _internal_imports(path: Path) -> list[str]:
    """``from megatron.core... import _private`` / ``torch...`` private names imported by a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("megatron", "torch"):
            out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and a.name != "__future__"]
    return out


def test_no_internal_import_outside_compat():
    offending = {}
    for pkg in ("megatron_glm5", "bridge"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path.name == "compat.py":
                continue
            found = _internal_imports(path)
            if found:
                offending[path.relative_to(REPO).as_posix()] = found
    assert not offending, offending
