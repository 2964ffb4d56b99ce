"""Megatron-LM's checks under its default rerun mode, ``validate_results`` (``deferred_grad_checks``: the NaN / Inf
``validate_result`` calls of an initial run queued and replayed when ``should_run_forward_backward`` starts). A
routed rerun state machine and megatron-core's own, fed the same calls, end every iteration in the same state: the
same re-run decision, failed call (message and sequence number), initial result, iteration and counts; and the
routed one makes no decision before ``should_run_forward_backward``. On the CPU: the state machine's CUDA-only pieces
(its RNG state save / restore, the all-reduce of one rank's flag) are replaced by their one-process equivalents."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from megatron_glm5 import compat, deferred_grad_checks

LOSS = ((torch.isnan, "found NaN in local forward loss calculation"),
        (torch.isinf, "found Inf in local forward loss calculation"))
GRADS = ((torch.isnan, "found NaN in local grad norm for bucket #0 in backward pass before data-parallel "
                       "communication collective"),
         (torch.isinf, "found Inf in local grad norm for bucket #0 in backward pass before data-parallel "
                       "communication collective"))


@pytest.fixture
def machines(monkeypatch):
    """(routed machine, megatron-core's machine) in ``validate_results``, with the route installed as
    ``install_fusions`` installs it under ``MEGATRON_GLM5_DEFERRED_GRAD_CHECKS=1``; taken out after the test."""
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    monkeypatch.setattr(RerunStateMachine, "_save_state", lambda self: None)
    monkeypatch.setattr(RerunStateMachine, "_restore_state", lambda self: None)
    monkeypatch.setattr(RerunStateMachine, "_reduce_any",
                        lambda self, v: tuple(v) if isinstance(v, list) else bool(v))
    deferred_grad_checks.reset()
    assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                             deferred_grad_checks.before_optimizer_step)
    assert compat.route_deferred_loss_checks(deferred_grad_checks.validate_result_deferred)
    assert compat.route_rerun_decision(deferred_grad_checks.before_rerun_decision)
    yield RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS), RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    deferred_grad_checks.reset()
    compat.remove_patches(((pgb._ParamAndGradBucketGroup, "check_grads", None),
                           (RerunStateMachine, "validate_result", None),
                           (RerunStateMachine, "should_run_forward_backward", None),
                           (OptimizerCudaGraphWrapper, "__init__", None)))
    assert not compat.rerun_decision_routed()


def _own(name: str):
    from megatron.core.rerun_state_machine import RerunStateMachine

    return compat.unpatched(RerunStateMachine, name)


def _state(machine) -> tuple:
    call = machine.failed_validation_call
    initial = machine.initial_result
    return (machine.state, machine.current_iteration, machine.rerun_requested,
            None if call is None else (call.caller.message, call.sequence),
            None if initial is None else float(initial), dict(machine.validation_counts))


def _run(routed, theirs, loss_value: float, norm_value: float, spiky: bool = False) -> list:
    """One forward-backward's checks on both machines (the loss twice, the bucket norm twice, as Megatron-LM's
    ``loss_func`` and DDP's ``check_grads``), then each machine's ``should_run_forward_backward``. Returns what was
    pending on the routed machine just before its decision and both decisions."""
    calls = []
    for value, checks in ((loss_value, LOSS), (norm_value, GRADS)):
        for reject, message in checks:
            calls.append((value, reject, message))
        if spiky and checks is LOSS:
            calls.append((value, partial(routed.is_unexpectedly_large, threshold=10.0, context="loss"), "Spiky loss"))
    for value, reject, message in calls:
        result = torch.tensor(value, requires_grad=True) * 1.0  # a 0-dim loss of the graph, as Megatron-LM's
        routed.validate_result(result=result, rejection_func=reject, message=message, tolerance=0.0, fatal=True)
        if getattr(reject, "func", None) is not None:  # the same stateful check on megatron-core's own machine
            reject = partial(theirs.is_unexpectedly_large, threshold=10.0, context="loss")
        _own("validate_result")(theirs, torch.tensor(value), reject, message, None, 0.0, True)
    pending = deferred_grad_checks.pending_checks()
    return [pending, routed.should_run_forward_backward(None), _own("should_run_forward_backward")(theirs, None)]


def test_initial_runs_decide_as_megatron_core_with_one_decision_point(machines):
    routed, theirs = machines
    assert routed.should_run_forward_backward(None) and _own("should_run_forward_backward")(theirs, None)
    # iteration 1: megatron-core validates nothing before the first iteration completes; nothing is queued either
    pending, mine, its = _run(routed, theirs, float("nan"), 1.0)
    assert pending == 0 and mine is its is False
    for m in machines:
        m.first_iteration_complete = True  # what should_checkpoint_and_exit sets after the first iteration
    for loss, norm, spiky, rerun in ((2.5, 1.0, False, False), (2.4, float("inf"), False, True)):
        assert routed.should_run_forward_backward(None) and _own("should_run_forward_backward")(theirs, None)
        pending, mine, its = _run(routed, theirs, loss, norm, spiky)
        assert pending == 4  # the loss and gradient checks wait for should_run_forward_backward
        assert mine is its is rerun
        assert _state(routed) == _state(theirs)
        assert deferred_grad_checks.pending_checks() == 0
        if rerun:
            assert routed.failed_validation_call.caller.message == GRADS[1][1]
            assert math.isinf(float(routed.initial_result))


def test_a_check_that_cannot_wait_decides_the_queue_first(machines):
    """A stateful check (the spiky-loss history) between queued ones: the queue is replayed first, so every call
    keeps its sequence number and the history sees the same values in the same order."""
    routed, theirs = machines
    for m in machines:
        assert _own("should_run_forward_backward")(m, None)
        m.first_iteration_complete = True
    pending, mine, its = _run(routed, theirs, 2.5, float("inf"), spiky=True)
    assert pending == 2  # the two gradient checks after the spiky check; the two loss checks were decided by it
    assert mine is its is True
    assert _state(routed) == _state(theirs)
    assert routed.failed_validation_call.caller.message == GRADS[1][1]
    # the re-run (state RERUNNING_IN_PLACE): nothing waits, both machines compare the same results
    pending, mine, its = _run(routed, theirs, 2.5, float("inf"))
    assert pending == 0 and mine is its and _state(routed) == _state(theirs)


def test_only_nan_inf_checks_of_zero_dim_tensors_in_an_initial_run_wait(machines):
    from megatron.core.rerun_state_machine import RerunMode

    routed, _ = machines
    assert _own("should_run_forward_backward")(routed, None)
    loss = torch.tensor(1.0)
    assert not deferred_grad_checks.validation_deferrable(routed, loss, torch.isnan)  # first iteration
    routed.first_iteration_complete = True
    assert deferred_grad_checks.validation_deferrable(routed, loss, torch.isnan)
    assert deferred_grad_checks.validation_deferrable(routed, loss, torch.isinf)
    assert not deferred_grad_checks.validation_deferrable(routed, torch.ones(2), torch.isnan)
    assert not deferred_grad_checks.validation_deferrable(routed, loss, lambda x: x > 1)
    routed.rerun_requested = True
    assert not deferred_grad_checks.validation_deferrable(routed, loss, torch.isnan)
    routed.rerun_requested = False
    routed.mode = RerunMode.REPORT_DETERMINISM_STATS
    assert not deferred_grad_checks.validation_deferrable(routed, loss, torch.isnan)


def test_route_needs_the_loss_check_route():
    from megatron.core.rerun_state_machine import RerunStateMachine

    compat.remove_patches(((RerunStateMachine, "validate_result", None),
                           (RerunStateMachine, "should_run_forward_backward", None)))
    assert not compat.route_rerun_decision(deferred_grad_checks.before_rerun_decision)
    assert not compat.rerun_decision_routed()
