"""megatron-core's DDP gradient checks decided before the optimizer step (:mod:`megatron_glm5.deferred_grad_checks`,
issue 23): run through megatron-core's own ``DistributedDataParallel`` on the CPU (one gloo rank; two under
torchrun), its ``finish_grad_sync`` and a torch optimizer's ``step``. A NaN / Inf gradient raises megatron-core's own
error (the same text as without the route) before any parameter changes; where the route does not apply
megatron-core's check runs at once."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_glm5 import compat, deferred_grad_checks


@pytest.fixture
def ddp_model(model_parallel, monkeypatch):
    """A two-layer model in megatron-core's DDP with its gradient checks on (Megatron-LM's
    ``--check-for-nan-in-loss-and-grad``), one bucket group over a data-parallel group of one rank."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    # start_grad_sync asks for the current CUDA stream (CUDA-graph replays); there is none on the CPU
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a, **k: types.SimpleNamespace(wait_event=lambda event: None))
    deferred_grad_checks.reset()  # whatever an earlier test left
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=True), module)
    assert len(ddp.bucket_groups) == 1
    yield ddp
    deferred_grad_checks.reset()


@pytest.fixture
def routed(monkeypatch):
    """The route as ``install_fusions`` leaves it; taken out again after the test (the pre-hook stays: it is a no-op
    with nothing pending)."""
    assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                             deferred_grad_checks.before_optimizer_step)
    assert compat.route_deferred_loss_checks(deferred_grad_checks.validate_result_deferred)
    yield
    _unroute()
    assert not compat.deferred_grad_checks_routed() and not compat.deferred_loss_checks_routed()


def _unroute() -> None:
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper
    from megatron.core.rerun_state_machine import RerunStateMachine

    compat.remove_patches(((pgb._ParamAndGradBucketGroup, "check_grads", None),
                           (RerunStateMachine, "validate_result", None), (OptimizerCudaGraphWrapper, "__init__", None),
                           (RerunStateMachine, "should_run_forward_backward", None)))


def _backward(ddp, poison: float | None = None) -> None:
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    if poison is not None:
        with torch.no_grad():
            next(ddp.module.parameters()).main_grad[0, 0] = poison


def _sgd(ddp) -> torch.optim.Optimizer:
    params = list(ddp.module.parameters())
    return torch.optim.SGD(params, lr=0.1)


def _step(ddp, optimizer) -> None:
    for p in ddp.module.parameters():
        p.grad = p.main_grad
    try:
        optimizer.step()
    finally:
        for p in ddp.module.parameters():
            p.grad = None  # as megatron-core's optimizers leave them: DDP's hook would add a .grad in again


def _restart_without_the_route(ddp, start: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters the routed run ended with; the model back at ``start`` and the routes taken out, for the same
    run through megatron-core's own checks."""
    routed_params = [p.detach().clone() for p in ddp.module.parameters()]
    with torch.no_grad():
        for p, s in zip(ddp.module.parameters(), start):
            p.copy_(s)
    _unroute()
    return routed_params


def _megatron_cores_error(ddp, poison: float) -> str:
    """The error megatron-core's own check raises at ``finish_grad_sync`` for this gradient (the route off)."""
    _backward(ddp, poison)
    with pytest.raises(RuntimeError) as err:
        ddp.finish_grad_sync()
    return str(err.value)


@pytest.mark.parametrize("poison, what", [(float("nan"), "found NaN"), (float("inf"), "found Inf")])
def test_bad_gradient_raises_megatron_cores_error_before_the_step_changes_a_parameter(ddp_model, routed, poison,
                                                                                     what):
    ddp, opt = ddp_model, _sgd(ddp_model)
    _backward(ddp, poison)
    ddp.finish_grad_sync()  # decided later: no raise here
    assert deferred_grad_checks.pending_checks() == 1
    before = [p.detach().clone() for p in ddp.module.parameters()]
    with pytest.raises(RuntimeError) as err:
        _step(ddp, opt)
    assert what in str(err.value) and "bucket #0" in str(err.value)
    assert all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters())), "a parameter changed"
    assert deferred_grad_checks.pending_checks() == 0
    _unroute()
    assert str(err.value) == _megatron_cores_error(ddp, poison)  # word for word megatron-core's


def test_good_gradients_step_as_without_the_route(ddp_model, routed):
    ddp = ddp_model
    start = [p.detach().clone() for p in ddp.module.parameters()]
    opt = _sgd(ddp)
    for _ in range(2):
        _backward(ddp)
        ddp.finish_grad_sync()
        assert deferred_grad_checks.pending_checks() == 1
        _step(ddp, opt)
        assert deferred_grad_checks.pending_checks() == 0
    routed_params = _restart_without_the_route(ddp, start)
    opt = _sgd(ddp)
    for _ in range(2):
        _backward(ddp)
        ddp.finish_grad_sync()
        _step(ddp, opt)
    assert all(torch.equal(a, p) for a, p in zip(routed_params, ddp.module.parameters()))
    assert all(not torch.equal(a, s) for a, s in zip(routed_params, start))


def test_a_check_left_pending_is_decided_at_the_next_check_and_the_route_turns_off(ddp_model, routed, caplog):
    """A loop that steps no torch optimizer between two backwards (a custom loop, a skipped or graphed step): the
    NaN of one backward raises at the next backward's check, and from then on megatron-core's check runs at once."""
    ddp = ddp_model
    _backward(ddp, float("nan"))
    ddp.finish_grad_sync()
    _backward(ddp)  # clean gradients now
    with caplog.at_level("WARNING", logger="megatron_glm5"), pytest.raises(
            RuntimeError, match="found NaN in local grad norm for bucket #0"):
        ddp.finish_grad_sync()
    assert deferred_grad_checks.pending_checks() == 0
    assert not deferred_grad_checks.deferrable(ddp.bucket_groups[0])
    assert "no torch optimizer step between two backwards" in caplog.text
    _backward(ddp, float("inf"))
    with pytest.raises(RuntimeError, match="found Inf in local grad norm"):
        ddp.finish_grad_sync()  # synchronous now


def test_not_deferred_once_the_optimizer_step_is_a_cuda_graph(ddp_model, routed, monkeypatch):
    """megatron-core's optimizer CUDA graph wrapper (``--optimizer-cuda-graph``) replays the step without torch's
    pre-hooks: once it has stepped, the checks run at once."""
    from megatron.core.optimizer import optimizer_cuda_graph as ocg

    group = ddp_model.bucket_groups[0]
    assert deferred_grad_checks.deferrable(group)
    monkeypatch.setattr(ocg.OptimizerCudaGraphWrapper, "curr_iteration", 1)
    assert compat.optimizer_cuda_graph_used() and not deferred_grad_checks.deferrable(group)
    _backward(ddp_model, float("nan"))
    with pytest.raises(RuntimeError, match="found NaN"):
        ddp_model.finish_grad_sync()


def test_the_bucket_groups_of_one_backward_wait_for_the_step(model_parallel, monkeypatch):
    """Two bucket groups (dense and expert-parallel parameters): the second group's check does not decide the first
    one's (that would be a host sync in the middle of the backward); a NaN in either group raises at the step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a, **k: types.SimpleNamespace(wait_event=lambda event: None))
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for p in module[1].parameters():
        p.allreduce = False  # megatron-core's mark of expert-parallel parameters: a bucket group of their own
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=True), module)
    assert len(ddp.bucket_groups) == 1 and len(ddp.expert_parallel_bucket_groups) == 1
    assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                             deferred_grad_checks.before_optimizer_step)
    try:
        decided = []
        monkeypatch.setattr(deferred_grad_checks, "resolve_pending",
                            lambda real=deferred_grad_checks.resolve_pending: (decided.append(1), real())[1])
        opt = _sgd(ddp)
        for poisoned in (None, module[1].weight, module[0].weight):
            _backward(ddp)
            if poisoned is not None:
                with torch.no_grad():
                    poisoned.main_grad[0, 0] = float("nan")
            ddp.finish_grad_sync()
            assert deferred_grad_checks.pending_checks() == 2 and not decided
            if poisoned is None:
                _step(ddp, opt)
                assert deferred_grad_checks.pending_checks() == 0 and decided
                decided.clear()
            else:
                with pytest.raises(RuntimeError, match="found NaN in local grad norm for bucket #0"):
                    _step(ddp, opt)
                decided.clear()
    finally:
        deferred_grad_checks.reset()
        _unroute()


def test_megatron_cores_check_runs_at_once_in_other_rerun_modes_and_with_instances(ddp_model, routed, monkeypatch):
    """Several distributed-optimizer instances (a second collective): megatron-core's check runs in
    ``finish_grad_sync``. A rerun mode other than ``disabled`` (it decides re-runs from the result at once) is not
    deferrable either (only that decision is checked here: those modes need megatron-core's rerun loop)."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    ddp = ddp_model
    group = ddp.bucket_groups[0]
    assert deferred_grad_checks.deferrable(group)
    monkeypatch.setattr(group.ddp_config, "num_distributed_optimizer_instances", 2)
    assert not deferred_grad_checks.deferrable(group)
    _backward(ddp, float("nan"))
    with pytest.raises(RuntimeError, match="found NaN"):
        ddp.finish_grad_sync()
    assert deferred_grad_checks.pending_checks() == 0
    monkeypatch.setattr(group.ddp_config, "num_distributed_optimizer_instances", 1)
    machine = get_rerun_state_machine()
    monkeypatch.setattr(machine, "mode", RerunMode.REPORT_DETERMINISM_STATS)
    assert not deferred_grad_checks.deferrable(group)


@pytest.mark.parametrize("poison_rank", [None, 0, 1], ids=["clean", "nan_on_rank0", "nan_on_rank1"])
def test_two_data_parallel_ranks_both_stop_before_their_step(tmp_path, poison_rank):
    """DP = 2 (torchrun, gloo): the rank whose local gradient is NaN raises megatron-core's own error and the other
    rank one that says another rank did, both at the optimizer step and before it changed a parameter (megatron-core's
    check raises on the bad rank only and leaves the other in the collective). Clean gradients: both ranks step,
    their parameters equal to megatron-core's synchronous check's run."""
    from tests.distributed import run_torchrun

    routed = run_torchrun("tests.grad_check_workers:two_rank_check", tmp_path / "routed", nproc=2, timeout=180,
                          poison_rank=poison_rank, routed=True, steps=2)
    assert all(r["deferred"] and r["pending"] == 0 for r in routed)
    if poison_rank is None:
        plain = run_torchrun("tests.grad_check_workers:two_rank_check", tmp_path / "plain", nproc=2, timeout=180,
                             poison_rank=None, routed=False, steps=2)
        assert all(r["raised_at"] is None for r in routed + plain)
        assert [r["params"] for r in routed] == [r["params"] for r in plain]
        assert routed[0]["params"] == routed[1]["params"]
        return
    bad, good = routed[poison_rank], routed[1 - poison_rank]
    assert bad["raised_at"] == good["raised_at"] == "step" and not bad["changed"] and not good["changed"]
    assert "found NaN in local grad norm for bucket #0" in bad["error"], bad["error"]
    assert "another data-parallel rank found a NaN or Inf" in good["error"], good["error"]


def test_tensor_parallel_ranks_keep_megatron_cores_check(tmp_path):
    """TP = 2, DP = 1: a NaN would reach the tensor-parallel peer by collectives outside the data-parallel group, so
    the check is not deferred: the bad rank raises in ``finish_grad_sync``, as without the route."""
    from tests.distributed import run_torchrun

    results = run_torchrun("tests.grad_check_workers:two_rank_check", tmp_path, nproc=2, timeout=180,
                           poison_rank=1, routed=True, steps=1, tp=2)
    assert not any(r["deferred"] for r in results)
    assert results[1]["raised_at"] == "finish_grad_sync" and "found NaN" in results[1]["error"]
    assert results[0]["raised_at"] is None


def test_route_on_by_default_and_installed_by_its_switch(monkeypatch):
    from megatron_glm5 import fusions

    monkeypatch.delenv(fusions.DEFERRED_GRAD_CHECKS_ENV, raising=False)
    assert fusions.enabled(fusions.DEFERRED_GRAD_CHECKS_ENV)
    monkeypatch.setenv(fusions.DEFERRED_GRAD_CHECKS_ENV, "0")
    assert not fusions.enabled(fusions.DEFERRED_GRAD_CHECKS_ENV)
    monkeypatch.setenv(fusions.DEFERRED_GRAD_CHECKS_ENV, "1")
    try:
        routed = fusions.install_fusions()
        assert routed["deferred_grad_checks"] and routed["deferred_loss_checks"] and routed["rerun_decision"]
    finally:
        _unroute()


def test_probe_passes():
    compat._probe_deferred_grad_checks()
    compat._probe_deferred_loss_checks()


# --------------------------------------------------------------------------------------------------------------------
# The forward loss checks (Megatron-LM's loss_func) decided at the same step
# --------------------------------------------------------------------------------------------------------------------

LOSS_CHECKS = ((torch.isnan, "found NaN in local forward loss calculation"),
               (torch.isinf, "found Inf in local forward loss calculation"))


def _loss_checks(loss: torch.Tensor) -> None:
    """Megatron-LM's ``loss_func`` checks (``pretrain_gpt.py``, ``--check-for-nan-in-loss-and-grad``)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    for reject, message in LOSS_CHECKS:
        get_rerun_state_machine().validate_result(result=loss, rejection_func=reject, message=message,
                                                  tolerance=0.0, fatal=True)


def _iteration(ddp, optimizer, bad_loss: float | None = None, no_step: bool = False) -> None:
    """One training iteration as Megatron-LM's ``train_step`` runs it: the rerun state machine's iteration, the
    forward, its loss checks (``loss_func``), the backward, ``finish_grad_sync``, the optimizer step. ``bad_loss``
    is added to the loss through no parameter: the loss is NaN / Inf while the gradients stay finite."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    assert machine.should_run_forward_backward(None)
    try:
        ddp.zero_grad_buffer()
        loss = ddp(torch.randn(3, 8, generator=torch.Generator().manual_seed(1))).square().sum()
        if bad_loss is not None:
            loss = loss + torch.tensor(bad_loss)
        _loss_checks(loss)
        loss.backward()
    finally:
        assert not machine.should_run_forward_backward(None)  # the iteration ends, raised or not
    ddp.finish_grad_sync()
    if not no_step:
        _step(ddp, optimizer)


def _megatron_cores_loss_error(loss: torch.Tensor, reject) -> str:
    from megatron.core.rerun_state_machine import RerunStateMachine, get_rerun_state_machine

    message = dict((r, m) for r, m in LOSS_CHECKS)[reject]
    with pytest.raises(RuntimeError) as err:
        compat.unpatched(RerunStateMachine, "validate_result")(get_rerun_state_machine(), loss, reject, message)
    return str(err.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_bad_loss_raises_megatron_cores_error_at_the_step_once_grad_checks_are_deferred(ddp_model, routed, bad):
    """The first iteration checks its losses at once (no gradient check deferred yet); later ones at the optimizer
    step, first of that iteration's checks, with megatron-core's error word for word (the rerun state machine's
    iteration of the loss), and no parameter changed. The gradients are finite: only the loss
    check can stop this step."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    ddp, opt = ddp_model, _sgd(ddp_model)
    _iteration(ddp, opt)
    assert deferred_grad_checks.pending_checks() == 0
    machine = get_rerun_state_machine()
    assert machine.should_run_forward_backward(None)
    ddp.zero_grad_buffer()
    loss = ddp(torch.randn(3, 8, generator=torch.Generator().manual_seed(1))).square().sum() + torch.tensor(bad)
    _loss_checks(loss)  # no raise here
    assert deferred_grad_checks.pending_checks() == 2
    loss.backward()
    assert not machine.should_run_forward_backward(None)
    ddp.finish_grad_sync()
    assert deferred_grad_checks.pending_checks() == 3
    assert all(torch.isfinite(p.main_grad).all() for p in ddp.module.parameters())
    before = [p.detach().clone() for p in ddp.module.parameters()]
    with pytest.raises(RuntimeError) as err:
        _step(ddp, opt)
    assert all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters())), "a parameter changed"
    assert deferred_grad_checks.pending_checks() == 0
    reject = torch.isnan if bad != bad else torch.isinf
    assert str(err.value) == _megatron_cores_loss_error(loss, reject)  # word for word megatron-core's


def test_good_losses_are_deferred_and_step_as_without_the_route(ddp_model, routed):
    ddp = ddp_model
    start = [p.detach().clone() for p in ddp.module.parameters()]
    opt = _sgd(ddp)
    pending = []
    for _ in range(3):
        _iteration(ddp, opt, no_step=True)
        pending.append(deferred_grad_checks.pending_checks())  # two loss checks and the gradient check
        _step(ddp, opt)
        assert deferred_grad_checks.pending_checks() == 0
    assert pending == [1, 3, 3] and deferred_grad_checks._grad_checks["deferred"] == 3
    routed_params = _restart_without_the_route(ddp, start)
    opt = _sgd(ddp)
    for _ in range(3):
        _iteration(ddp, opt)
    assert all(torch.equal(a, p) for a, p in zip(routed_params, ddp.module.parameters()))


def test_loss_checks_deferred_only_in_a_training_forward_after_deferred_grad_checks(ddp_model, routed, monkeypatch):
    """Deferred: a loss that requires a gradient, under grad mode, once a gradient check was deferred and none ran at
    once. At once: the first iteration, an evaluation forward (``torch.no_grad``), another rejection function, a
    process where a gradient check ran at once (that layout's NaN gradients do not wait for the step)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    loss = torch.ones((), requires_grad=True) * 2
    assert not deferred_grad_checks.loss_deferrable(machine, loss, torch.isnan)  # no gradient check yet
    _iteration(ddp_model, _sgd(ddp_model))
    assert deferred_grad_checks.loss_deferrable(machine, loss, torch.isnan)
    assert deferred_grad_checks.loss_deferrable(machine, loss, torch.isinf)
    assert not deferred_grad_checks.loss_deferrable(machine, loss.detach(), torch.isnan)
    assert not deferred_grad_checks.loss_deferrable(machine, loss.reshape(1), torch.isnan)  # printed as a tensor
    assert not deferred_grad_checks.loss_deferrable(machine, loss, lambda x: bool(torch.isnan(x)))
    with torch.no_grad():
        assert not deferred_grad_checks.loss_deferrable(machine, loss, torch.isnan)
    leaf = torch.tensor(float("nan"), requires_grad=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="found NaN in local forward loss"):
        _loss_checks(leaf * 1.0)  # an evaluation's loss: computed under no_grad, it requires no gradient: at once
    assert not deferred_grad_checks.loss_deferrable(machine, loss.as_subclass(_Printed), torch.isnan)
    group = ddp_model.bucket_groups[0]
    group.ddp_config.num_distributed_optimizer_instances = 2  # now a gradient check runs at once
    try:
        _iteration(ddp_model, _sgd(ddp_model))
    finally:
        group.ddp_config.num_distributed_optimizer_instances = 1
    assert deferred_grad_checks._grad_checks["at_once"] == 1
    assert not deferred_grad_checks.loss_deferrable(machine, loss, torch.isnan)


class _Printed(torch.Tensor):
    """A tensor subclass: megatron-core's message would print its repr, not its number."""


def test_a_loss_check_left_pending_is_decided_at_the_next_iteration_and_the_route_turns_off(ddp_model, routed,
                                                                                             caplog):
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    ddp, opt = ddp_model, _sgd(ddp_model)
    _iteration(ddp, opt)
    _iteration(ddp, opt, bad_loss=float("nan"), no_step=True)  # a loop that skips its step
    bad_iteration = get_rerun_state_machine().current_iteration + 1  # as megatron-core's messages count
    assert deferred_grad_checks.pending_checks() == 3
    with caplog.at_level("WARNING", logger="megatron_glm5"), pytest.raises(
            RuntimeError, match="found NaN in local forward loss calculation") as err:
        _iteration(ddp, opt)
    assert f"iteration {bad_iteration}:" in str(err.value)  # the iteration of the loss, not the one deciding it
    assert "no torch optimizer step between two iterations' loss checks" in caplog.text
    assert deferred_grad_checks.pending_checks() == 0
    with pytest.raises(RuntimeError, match="found Inf in local forward loss"):
        _iteration(ddp, opt, bad_loss=float("inf"))  # at once now: the route is off


@pytest.mark.parametrize("loss_poison_rank", [0, 1], ids=["rank0", "rank1"])
def test_two_data_parallel_ranks_stop_before_their_step_on_one_ranks_nan_loss(tmp_path, loss_poison_rank):
    """DP = 2: one rank's loss is NaN while every gradient stays finite. Its loss check waits for the step, its flag
    rides on the gradient check's all-reduced one, and both ranks stop before their step: that rank with
    megatron-core's loss error, the other with the other-rank error (megatron-core's check leaves it in the
    gradient collective)."""
    from tests.distributed import run_torchrun

    results = run_torchrun("tests.grad_check_workers:two_rank_check", tmp_path, nproc=2, timeout=180,
                           poison_rank=None, routed=True, steps=2, loss_poison_rank=loss_poison_rank)
    bad, good = results[loss_poison_rank], results[1 - loss_poison_rank]
    assert bad["raised_at"] == good["raised_at"] == "step" and not bad["changed"] and not good["changed"]
    assert "found NaN in local forward loss calculation" in bad["error"], bad["error"]
    assert "another data-parallel rank found a NaN or Inf in its local forward loss" in good["error"], good["error"]
    assert all(r["pending"] == 0 for r in results)


def test_no_loss_or_gradient_check_is_deferred_with_an_optimizer_cuda_graph(ddp_model, routed):
    """``--optimizer-cuda-graph``: Megatron-LM wraps ``optimizer.step`` before the first iteration; the captured
    step runs no pre-hook that could decide (and with no warm-up the first step is the capture), so from the
    wrapper's construction on every check runs at once."""
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    ddp, opt = ddp_model, _sgd(ddp_model)
    _iteration(ddp, opt)
    assert deferred_grad_checks.loss_deferrable(get_rerun_state_machine(), torch.ones((), requires_grad=True) * 2,
                                                torch.isnan)
    OptimizerCudaGraphWrapper(opt.step, cuda_graph_warmup_steps=0)
    assert compat.optimizer_cuda_graph_used() and not deferred_grad_checks.deferrable(ddp.bucket_groups[0])
    with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
        _iteration(ddp, opt, bad_loss=float("nan"))  # raised in the forward, as without the route
    assert deferred_grad_checks.pending_checks() == 0


def test_pending_loss_checks_are_decided_before_a_gradient_check_that_runs_at_once(ddp_model, routed):
    """A layout that stops deferring mid-iteration (here a second distributed-optimizer instance appears): the
    iteration's deferred loss checks are decided before megatron-core's gradient check, so a NaN loss still raises
    before the gradient collective, with its own error."""
    ddp, opt = ddp_model, _sgd(ddp_model)
    _iteration(ddp, opt)
    group = ddp.bucket_groups[0]
    group.ddp_config.num_distributed_optimizer_instances = 2
    try:
        with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
            _iteration(ddp, opt, bad_loss=float("nan"))
    finally:
        group.ddp_config.num_distributed_optimizer_instances = 1
    assert deferred_grad_checks.pending_checks() == 0 and deferred_grad_checks._grad_checks["at_once"] == 1
