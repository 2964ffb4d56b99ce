"""torchrun bodies for ``tests/test_deferred_grad_checks.py``: megatron-core's DDP over two data-parallel ranks
(gloo, CPU) with the gradient checks decided before the optimizer step."""

from __future__ import annotations

import types

import torch

from megatron_glm5 import compat, deferred_grad_checks
from megatron_glm5.parallel import initialize_model_parallel


def two_rank_check(rank: int, world_size: int, poison_rank: int | None, routed: bool, steps: int = 1,
                   tp: int = 1, loss_poison_rank: int | None = None) -> dict:
    """One backward per step (each rank its own batch) through megatron-core's DDP at DP = 2 (or TP = 2 and DP = 1:
    ``tp``), a NaN written into
    ``poison_rank``'s local gradient after the last backward (None: none), then ``finish_grad_sync`` and an SGD step.
    Each step's loss goes through Megatron-LM's two loss checks (``validate_result`` with ``torch.isnan`` and
    ``torch.isinf``) inside the rerun state machine's iteration; ``loss_poison_rank``'s last loss is NaN with finite
    gradients (a NaN added that no parameter feeds). Returns where each rank raised, the message, and whether a
    parameter changed in the step that raised."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(wait_event=lambda event: None)
    initialize_model_parallel(tensor_model_parallel_size=tp)
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    if routed:
        assert compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                                 deferred_grad_checks.before_optimizer_step)
        assert compat.route_deferred_loss_checks(deferred_grad_checks.validate_result_deferred)
    machine = get_rerun_state_machine()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=True), module)
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    result = {"raised_at": None, "error": None, "changed": None, "deferred": deferred_grad_checks.deferrable(
        ddp.bucket_groups[0]) if routed else False}
    for step in range(steps):
        ddp.zero_grad_buffer()
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        assert machine.should_run_forward_backward(None)
        loss = ddp(x).square().sum()
        if loss_poison_rank == rank and step == steps - 1:
            loss = loss + torch.tensor(float("nan"))
        try:
            for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                machine.validate_result(result=loss, rejection_func=reject, message=f"found {what} in local "
                                        "forward loss calculation", tolerance=0.0, fatal=True)
        except RuntimeError as err:
            result.update(raised_at="loss", error=str(err))
            break
        loss.backward()
        assert not machine.should_run_forward_backward(None)
        if poison_rank == rank and step == steps - 1:
            with torch.no_grad():
                params[0].main_grad[1, 2] = float("nan")
        before = [p.detach().clone() for p in params]
        try:
            ddp.finish_grad_sync()
        except RuntimeError as err:
            result.update(raised_at="finish_grad_sync", error=str(err))
            break
        for p in params:
            p.grad = p.main_grad
        try:
            opt.step()
        except RuntimeError as err:
            result.update(raised_at="step", error=str(err),
                          changed=any(not torch.equal(a, p) for a, p in zip(before, params)))
            break
        finally:
            for p in params:
                p.grad = None
    result["params"] = [p.detach().flatten().tolist() for p in params]
    result["pending"] = deferred_grad_checks.pending_checks()
    return result
