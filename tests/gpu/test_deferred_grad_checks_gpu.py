"""megatron-core's DDP gradient checks decided before the optimizer step (:mod:`megatron_glm5.deferred_grad_checks`)
on CUDA: ``finish_grad_sync`` makes no host sync with the route (torch's sync debug mode; megatron-core's own check
syncs there), and a NaN gradient still raises megatron-core's error before the optimizer changes a parameter; the
same for Megatron-LM's forward loss checks (``validate_result`` on the loss with ``torch.isnan`` / ``torch.isinf``)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import compat, deferred_grad_checks

pytestmark = pytest.mark.gpu


def _unroute() -> None:
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper
    from megatron.core.rerun_state_machine import RerunStateMachine

    compat.remove_patches(((pgb._ParamAndGradBucketGroup, "check_grads", None),
                           (RerunStateMachine, "validate_result", None), (OptimizerCudaGraphWrapper, "__init__", None)))


@pytest.fixture
def ddp(parallel):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    deferred_grad_checks.reset()  # another module of the same process may have used the route
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=1)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=True), module)
    yield model
    deferred_grad_checks.reset()
    _unroute()


def _backward(model, poison: float | None = None) -> None:
    model.zero_grad_buffer()
    model(torch.randn(64, 256, device="cuda")).square().sum().backward()
    if poison is not None:
        with torch.no_grad():
            next(model.module.parameters()).main_grad[3, 5] = poison


def _finish_without_sync(model) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.finish_grad_sync()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_megatron_cores_check_syncs_and_the_route_does_not(ddp):
    _backward(ddp)
    with pytest.raises(RuntimeError, match="synchroniz"):
        _finish_without_sync(ddp)
    assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                             deferred_grad_checks.before_optimizer_step)
    _backward(ddp)
    _finish_without_sync(ddp)
    assert deferred_grad_checks.pending_checks() == 1
    deferred_grad_checks.resolve_pending()


def test_nan_gradient_raises_before_the_step_changes_a_parameter(ddp):
    assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                             deferred_grad_checks.before_optimizer_step)
    params = list(ddp.module.parameters())
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    _backward(ddp, float("nan"))
    _finish_without_sync(ddp)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = p.main_grad
    with pytest.raises(RuntimeError, match="found NaN in local grad norm for bucket #0"):
        opt.step()
    torch.cuda.synchronize()
    assert all(torch.equal(a, p) for a, p in zip(before, params))


def _loss_checks_without_sync(loss: torch.Tensor) -> None:
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    torch.cuda.set_sync_debug_mode("error")
    try:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            get_rerun_state_machine().validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                                      message=f"found {what} in local forward loss calculation")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_loss_checks_make_no_sync_and_a_nan_loss_raises_before_the_step(ddp):
    """Megatron-LM's loss checks sync the host once each without the route; with it (after one deferred gradient
    check) none do, and a NaN loss (finite gradients) raises megatron-core's error at the step, parameters unchanged."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                             deferred_grad_checks.before_optimizer_step)
    params = list(ddp.module.parameters())
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    machine = get_rerun_state_machine()

    def iteration(bad: float | None, routed: bool) -> None:
        assert machine.should_run_forward_backward(None)
        try:
            ddp.zero_grad_buffer()
            loss = ddp(torch.randn(64, 256, device="cuda")).square().sum()
            if bad is not None:
                loss = loss + torch.tensor(bad, device="cuda")
            torch.cuda.synchronize()
            if routed:
                _loss_checks_without_sync(loss)
            else:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    _loss_checks_without_sync(loss)
            loss.backward()
        finally:
            assert not machine.should_run_forward_backward(None)
        _finish_without_sync(ddp)
        for p in params:
            p.grad = p.main_grad
        try:
            opt.step()
        finally:
            for p in params:
                p.grad = None  # as megatron-core's optimizers leave them

    iteration(None, routed=False)  # no loss route yet
    assert compat.route_deferred_loss_checks(deferred_grad_checks.validate_result_deferred)
    iteration(None, routed=True)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
        iteration(float("nan"), routed=True)
    torch.cuda.synchronize()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
