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


def test_the_hooks_cover_the_design_list():
    assert len(compat.HOOKS) == 27
    assert compat.check_all() == []


def test_probes_pass_with_every_route_installed():
    """A probe looks at megatron-core's own code even after a route of ours replaced it (routes stay for the
    process: any earlier spec build installs them)."""
    from megatron_glm5 import fusions

    fusions.install_fusions()
    assert compat.dispatch_postprocess_routed() and compat.moe_permute_routed()
    assert compat.check_all() == []


def test_probe_fails_when_the_dispatcher_keeps_its_state_elsewhere(monkeypatch):
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    def dispatch_postprocess(self, hidden_states, probs):  # the permutation's state under other names
        self.permutation_state = (hidden_states, probs)
        return hidden_states, None, probs

    # megatron-core's own method, as a new release would ship it (the probe looks past our route)
    compat.remove_patches(((MoEAllGatherTokenDispatcher, "dispatch_postprocess", None),))
    monkeypatch.setattr(MoEAllGatherTokenDispatcher, "dispatch_postprocess", dispatch_postprocess)
    assert any("dispatch_postprocess" in f for f in compat.check_all())


def test_probe_fails_when_the_rerun_state_machine_stops_raising_in_disabled_mode(monkeypatch):
    """megatron-core's ``validate_result`` as a release could ship it: the same rejection and message in mode
    ``disabled``, but only a warning instead of the raise (the deferred loss check's replay relies on the raise)."""
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    def validate_result(self, result, rejection_func, message, comparison_func=None, tolerance=0.0, fatal=True):
        if self.mode == RerunMode.DISABLED:
            result_rejected: bool = rejection_func(result)
            if result_rejected:
                self._log_validation_error_to_file(status=None, result=result, message=message)
                full_message = f"iteration {self.current_iteration + 1}: Unexpected result {result}"
                print(full_message)
            return
        if comparison_func is None:
            return

    compat.remove_patches(((RerunStateMachine, "validate_result", None),))
    monkeypatch.setattr(RerunStateMachine, "validate_result", validate_result)
    failed = compat.check_all()
    assert any("validate_result" in f and "raise RuntimeError(full_message)" in f for f in failed), failed


def test_probe_fails_when_the_linear_layers_stop_using_apex_by_name(monkeypatch):
    from megatron.core.tensor_parallel import layers

    # megatron-core's own module, as a new release would ship it (the probe looks past our route)
    compat.remove_patches(((layers, "fused_weight_gradient_mlp_cuda", None),
                           (layers, "_grad_accum_fusion_available", None)))
    monkeypatch.delattr(layers, "_grad_accum_fusion_available")
    assert any("_grad_accum_fusion_available" in f for f in compat.check_all())


def test_probe_fails_when_the_optimizer_builder_moves(monkeypatch):
    from megatron.core import optimizer as mcore_optimizer

    monkeypatch.delattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER")
    assert any("USING_PYTORCH_OPTIMIZER" in f for f in compat.check_all())


def test_probe_fails_when_the_mlp_half_changes(monkeypatch):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def renamed(self, output, packed_seq_params, micro_batches):
        return output

    monkeypatch.setattr(TransformerLayer, "_maybe_reflatten_from_moe", renamed)
    assert any("_maybe_reflatten_from_moe" in f for f in compat.check_all())


def test_a_patch_that_added_an_attribute_removes_it_again():
    import types

    owner = types.SimpleNamespace()
    compat.install_patches(((owner, "added", 1),))
    assert owner.added == 1 and compat.is_patched(owner, "added")
    compat.remove_patches(((owner, "added", None),))
    assert not hasattr(owner, "added") and not compat.is_patched(owner, "added")


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


def test_probe_fails_when_the_schedule_stops_asking_get_tensor_shapes(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    def inline_shapes(*, config, seq_length, micro_batch_size, **kwargs):  # shapes computed inline: no hook point
        return [[seq_length, micro_batch_size, config.hidden_size]]

    monkeypatch.setattr(schedules, "forward_backward_pipelining_without_interleaving", inline_shapes)
    assert any("get_tensor_shapes" in f for f in compat.check_all())


def test_pipeline_shape_hook_widens_only_configs_that_ask():
    """The wrapper sends ``config.pipeline_hidden_size`` (GLM-5.3-Flash's mHC streams) and leaves every other config
    (GLM-5.x, a variable-length run) with megatron-core's own shapes."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import schedules

    compat.send_pipeline_hidden_size()
    compat.send_pipeline_hidden_size()  # once: the wrapper is not wrapped again
    assert compat.is_patched(schedules, "get_tensor_shapes")
    one = SimpleNamespace(size=lambda: 2)
    base = dict(variable_seq_lengths=False, sequence_parallel=True, hidden_size=8)

    def shapes(**cfg):
        return [tuple(s) for s in schedules.get_tensor_shapes(seq_length=16, micro_batch_size=3,
                                                                decoder_seq_length=None, config=SimpleNamespace(**cfg),
                                                                tp_group=one, cp_group=one)]

    assert shapes(**base) == [(4, 3, 8)]  # s / CP / TP (sequence parallel)
    assert shapes(**base, pipeline_hidden_size=32) == [(4, 3, 32)]
    assert shapes(**{**base, "variable_seq_lengths": True}, pipeline_hidden_size=32) == [()]
    assert getattr(schedules.get_tensor_shapes, compat._WRAPPED) is compat._mcore_get_tensor_shapes()


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


def test_probe_fails_when_the_dispatcher_becomes_a_module(monkeypatch):
    """release_dispatcher_graph reads the dispatcher's state with vars(): a module would keep tensors elsewhere."""
    from megatron.core.transformer.moe import token_dispatcher

    class ModuleDispatcher(torch.nn.Module):
        pass

    monkeypatch.setattr(token_dispatcher, "MoETokenDispatcher", ModuleDispatcher)
    assert any("token_dispatcher" in f for f in compat.check_all())


def test_release_dispatcher_graph_detaches_only_graph_tensors():
    class Dispatcher:  # megatron-core's dispatchers are plain objects
        pass

    layer = torch.nn.Module()
    layer.token_dispatcher = d = Dispatcher()
    w = torch.ones(3, requires_grad=True)
    d.local_probs, d.mapping, d.leaf = w * 2, torch.arange(3), w
    assert compat.release_dispatcher_graph(layer) == 1
    assert d.local_probs.grad_fn is None and torch.equal(d.local_probs, torch.full((3,), 2.0))
    assert d.leaf is w and d.mapping.grad_fn is None  # a leaf holds no graph: left as it is
    assert compat.release_dispatcher_graph(torch.nn.Linear(2, 2)) == 0
