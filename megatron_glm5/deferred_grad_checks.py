"""megatron-core's DDP gradient checks without the host sync at the end of every backward, decided before the
optimizer updates any parameter.

Why: with Megatron-LM's default ``--check-for-nan-in-loss-and-grad``, DDP's ``finish_grad_sync`` computes each
bucket's local gradient norm and megatron-core's ``RerunStateMachine.validate_result`` tests it on the host
(``if torch.isnan(norm)``). The host then waits for the GPU to drain the whole backward, and everything it queues
next before the optimizer's first long kernel (the rest of ``finalize_model_grads``, megatron-core's walks over the
parameters, the clip's norm, Adam's launch) is time the GPU idles: about 7 ms per step of the one-GPU GLM-5 slice
(issue 23, round 9's profile, "GPU idle ended by the norm, the clip and Adam's launch").

What :func:`check_grads_deferred` does instead: the same norms (each bucket's ``grad_data.norm(p=2)``) are copied to
host memory behind an event (:class:`~megatron_glm5.kernels._common.HostValues`: pinned, non-blocking), and
megatron-core's own ``check_grads`` is replayed on those host values by :func:`resolve_pending`: the same rerun
state machine, rejection functions, messages, validation log file and ``RuntimeError``. :func:`resolve_pending`
runs
* before any torch optimizer's ``step`` (a global step pre-hook,
  :func:`megatron_glm5.compat.route_deferred_grad_checks`): megatron-core's optimizers step torch optimizers
  (torch's Adam / SGD; apex's and TE's fused Adam subclass them), so a NaN gradient still raises before a parameter
  changes, in the same iteration, after the host has queued the optimizer's preparation (the GPU has the clip's
  norm still to run when the host waits there);
* at the same bucket group's next check, for a loop that steps no torch optimizer (it raises one backward later).

With several data-parallel ranks the gradient collective carries a local NaN to every rank before any rank has
decided its check. So each rank also all-reduces (MAX) whether any of its norms is NaN / Inf, on a side stream (the
compute stream never waits for it; NCCL orders it after the collectives queued before): at the decision the rank
whose gradients were bad raises megatron-core's error, and every other rank raises one that says another rank did,
all before their optimizer steps (where megatron-core's own check leaves the other ranks waiting in the gradient
collective). Only NaN / Inf spread; the non-fatal "unexpectedly large" check stays local, as megatron-core's is.

Taken only where that reaches every rank the NaN can reach before an update: a gradient collective over the whole
job (one process, or pure data parallelism; with tensor, pipeline or expert parallelism a NaN also travels by the
other groups' collectives, e.g. the sequence-parallel norm gradients and the gradient norm's all-reduce, to ranks
outside the flag's group, so megatron-core's check runs there as it is), megatron-core's rerun mode ``disabled``
(``--rerun-mode disabled``; Megatron-LM's default is ``validate_results``, whose re-run of a rejected iteration is
decided in ``should_run_forward_backward`` right after the backward, so the checks run at once there: issue 23
round 15 found the route idle in the step bench for that reason), one distributed-optimizer instance, and no CUDA graph of the optimizer step (``--optimizer-cuda-graph``: a replayed step runs no pre-hook).
A backward whose bucket group finds its previous check still pending (no torch optimizer stepped in between: a
custom loop, a skipped step) decides it and turns the route off for the process (logged once). Not under CUDA graph
capture.

The forward's loss checks (Megatron-LM's ``loss_func``: ``validate_result(loss, torch.isnan, ...)`` and the same
with ``torch.isinf``, one host sync each per micro-batch; :func:`validate_result_deferred`) are decided at the same
point, before the gradient checks of their iteration, once the gradient checks have been deferred (so the first
iteration checks its losses at once, and a layout whose gradient checks run at once keeps its loss checks at once
too). Only for a loss that will be back-propagated (it requires a gradient: a training forward; evaluation and
forward-only log-probs run under ``torch.no_grad`` and check at once). The flag ``rejection_func(loss)`` goes to the
host as the norms do; only a rejected one replays megatron-core's ``validate_result``, on a detached copy of the loss
taken at the check (Megatron-LM divides the loss in place afterwards), in the iteration it came from: the same log
file entry and the same error, word for word (a 0-dim loss, which its message formats as a number). Over
several data-parallel ranks the flags ride on the next gradient check's all-reduced NaN / Inf flag, so a NaN loss
whose gradients stay finite (a NaN under the loss mask) stops every rank before its step too. A loss check of an
earlier iteration still pending (no torch optimizer stepped since) is decided at the next one, and the route turns
off.

Under Megatron-LM's default rerun mode, ``validate_results``, megatron-core does not raise at a rejected check: in
the initial run of an iteration it records the failure and asks for a re-run, which ``should_run_forward_backward``
decides right after the forward-backward (an all-reduce of ``rerun_requested``). There the NaN / Inf checks of the
initial run (Megatron-LM's loss checks and DDP's bucket checks, 0-dim plain tensors) are queued instead, each with a
copy of its result (:func:`validation_deferrable`), and replayed through megatron-core's own ``validate_result``, in
their order, when ``should_run_forward_backward`` starts (:func:`before_rerun_decision`, through
:func:`megatron_glm5.compat.route_rerun_decision`), before it reads or resets anything: the same failed call (its
message and sequence number), initial result, log file entry and re-run. One host wait per step there, after the
host has queued the whole backward, instead of one per check; any other check, a check of another iteration, the
optimizer's pre-hook or a re-run state decides the queue first.

Tests: ``tests/test_deferred_grad_checks.py`` (megatron-core's DDP on the CPU: the raise before the parameters
change, the messages, the fallbacks); ``tests/gpu/test_deferred_grad_checks_gpu.py`` (no host sync under torch's
sync debug mode).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from megatron_glm5.kernels._common import HostValues


@dataclass
class PendingCheck:
    """One deferred ``check_grads``: the bucket norms (and, over several ranks, whether any rank's were NaN / Inf)
    on their way to the host, and how to replay the check."""

    norms: HostValues  # this rank's bucket norms
    dtype: torch.dtype  # the norms' own dtype (the replay gets them back exactly)
    replay: Callable[[Any], None]  # megatron-core's check_grads bound to its flags, given a stand-in bucket group
    group: int  # id() of the bucket group checked: its next check means a later backward
    any_rank: HostValues | None  # the all-reduced NaN / Inf flag (several ranks), else None

    def decide(self) -> None:
        """megatron-core's check on the host values; over several ranks, then the other ranks' flag."""
        norms = self.norms.get()
        self.replay(SimpleNamespace(buckets=[SimpleNamespace(grad_data=_HostNorm(torch.tensor(v, dtype=self.dtype)))
                                             for v in norms]))
        if self.any_rank is not None and self.any_rank.get()[0] > 0:
            raise RuntimeError(
                "megatron-glm5: another data-parallel rank found a NaN or Inf in its local forward loss or gradient "
                f"norm before the gradient collective of a bucket group of {len(norms)} bucket(s) (that rank "
                "raised megatron-core's error); this rank's reduced gradients carry it, so it stops before its "
                "optimizer step too")


@dataclass
class PendingLossCheck:
    """One deferred ``validate_result`` of a forward loss: whether ``rejection_func`` rejected it, on its way to the
    host, and megatron-core's ``validate_result`` on a copy of the loss to replay if it did."""

    rejected: HostValues
    replay: Callable[[], None]
    iteration: int  # the rerun state machine's iteration of the check

    def decide(self) -> None:
        if self.rejected.get()[0]:
            self.replay()


@dataclass
class PendingValidation:
    """One NaN / Inf ``validate_result`` of an initial run under ``validate_results``, replayed as it was called."""

    replay: Callable[[], None]
    iteration: int

    def decide(self) -> None:
        self.replay()


_pending: list[PendingCheck | PendingLossCheck | PendingValidation] = []
_side_streams: dict[Any, Any] = {}
_log = logging.getLogger("megatron_glm5")
_turned_off: list[str] = []  # why the route stopped deferring in this process (empty: it defers)
# Gradient checks decided later / at once in this process: loss checks are deferred only once the former happened
# and never the latter.
_grad_checks = {"deferred": 0, "at_once": 0, "unflagged": 0}  # unflagged: deferred over several ranks, no flag
_loss_flags: list[torch.Tensor] = []  # deferred loss flags not yet carried by a gradient check's all-reduced flag
_deciding: list[bool] = []  # non-empty while resolve_pending runs


class _HostNorm:
    """Stands for a bucket's ``grad_data`` in the replay: its ``norm(p=2)`` is the value computed on the device."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def norm(self, p=2) -> torch.Tensor:
        assert p == 2, "megatron-core's check_grads takes the 2-norm"
        return self.value


def _collective(bucket_group: Any) -> tuple[Any, int] | None:
    """``(process group, size)`` of the bucket group's gradient collective where it spans the whole job (module
    docstring); None otherwise, or where there is a second collective (several distributed-optimizer instances)."""
    config = getattr(bucket_group, "ddp_config", None)
    if config is None or getattr(config, "num_distributed_optimizer_instances", 1) != 1:
        return None
    group = getattr(bucket_group, "intra_distributed_optimizer_instance_group", None)
    if group is None:
        group = getattr(bucket_group, "data_parallel_group", None)
    if group is None:
        return None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return (group, group.size()) if group.size() == world else None


def deferrable(bucket_group: Any) -> bool:
    """Whether this bucket group's check may be decided later (module docstring): rerun mode ``disabled``, one
    gradient collective over the whole job, gradient buffers on one device, no optimizer CUDA graph, no CUDA graph
    capture, and the route not turned off."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    if _turned_off or get_rerun_state_machine().mode != RerunMode.DISABLED or _collective(bucket_group) is None:
        return False
    buffers = [b.grad_data for b in bucket_group.buckets]
    if not buffers or len({t.device for t in buffers}) != 1:
        return False
    from megatron_glm5.compat import optimizer_cuda_graph_used

    if optimizer_cuda_graph_used():
        return False
    return not (buffers[0].is_cuda and torch.cuda.is_current_stream_capturing())


def _turn_off(reason: str) -> None:
    if not _turned_off:
        _log.warning("megatron-glm5: DDP's gradient checks run at the end of each backward again (%s)", reason)
    _turned_off.append(reason)


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _any_rank_flag(values: torch.Tensor, process_group: Any) -> HostValues:
    """Whether any rank's ``values`` (norms, and Inf for each rejected loss) hold a NaN / Inf (all-reduced MAX), on
    its way to the host. On CUDA the flag is
    formed and reduced on a side stream that first waits for the norms, so the compute stream never waits for the
    collective."""
    if not values.is_cuda:
        flag = (~torch.isfinite(values)).any().float().reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=process_group)
        return HostValues(flag)
    side = _side_stream(values.device)
    side.wait_stream(torch.cuda.current_stream(values.device))
    with torch.cuda.stream(side):
        flag = (~torch.isfinite(values)).any().float().reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=process_group)
        host = HostValues(flag)  # copied and its event recorded on the side stream
    values.record_stream(side)
    return host


def check_grads_deferred(original: Callable, bucket_group: Any, check_for_nan_or_inf: bool,
                         check_for_large: bool) -> None:
    """megatron-core's ``_ParamAndGradBucketGroup.check_grads`` (``original``) decided later where
    :func:`deferrable`, else at once by ``original``. A check of this bucket group still pending is from an earlier
    backward with no torch optimizer step since: it is decided now, and the route turns itself off. The pending checks
    of the other bucket groups of this backward (DDP's expert-parallel groups, other buffers) are left to the
    optimizer step."""
    if any(isinstance(check, PendingCheck) and check.group == id(bucket_group) for check in _pending):
        _turn_off("no torch optimizer step between two backwards: a custom loop, a skipped or graphed step")
        resolve_pending()
    if not deferrable(bucket_group):
        _grad_checks["at_once"] += 1
        if not all(isinstance(check, PendingValidation) for check in _pending):
            resolve_pending()  # loss checks deferred before the layout stopped deferring: decided first, in order
        # (queued validations stay queued: this check's own validate_result calls queue behind them, in order)
        _loss_flags.clear()
        return original(bucket_group, check_for_nan_or_inf, check_for_large)
    _grad_checks["deferred"] += 1
    process_group, size = _collective(bucket_group)
    with torch.no_grad():
        norms = torch.stack([b.grad_data.norm(p=2) for b in bucket_group.buckets])  # megatron-core's expression
        values = norms.float()
        any_rank = None
        if check_for_nan_or_inf and size > 1:
            flagged = values
            if _loss_flags:  # any rejected loss of this iteration travels as one Inf next to the norms
                rejected = torch.cat(_loss_flags).any().reshape(1).to(values.device)
                flagged = torch.cat([values, torch.where(rejected, float("inf"), 0.0).to(values.dtype)])
            any_rank = _any_rank_flag(flagged, process_group)
        elif size > 1:
            _grad_checks["unflagged"] += 1
        _loss_flags.clear()  # carried to every rank by this flag (one rank: nothing to carry)

    def replay(stand_in: Any) -> None:
        original(stand_in, check_for_nan_or_inf, check_for_large)

    _pending.append(PendingCheck(HostValues(values), norms.dtype, replay, id(bucket_group), any_rank))


def loss_deferrable(machine: Any, result: Any, rejection_func: Callable) -> bool:
    """Whether this ``validate_result`` is a forward loss check that may be decided at the optimizer step (module
    docstring): megatron-core's NaN / Inf rejection of a 0-dim plain tensor loss that requires a gradient, rerun mode
    ``disabled``, not under CUDA graph capture, no optimizer CUDA graph, the route on, gradient checks deferred in
    this process and none run at once, and over several ranks each of them carrying the NaN / Inf flag the loss
    flags ride on."""
    from megatron.core.rerun_state_machine import RerunMode

    if _turned_off or rejection_func not in (torch.isnan, torch.isinf) or machine.mode != RerunMode.DISABLED:
        return False
    # a plain tensor: the message formats it as its number (a subclass would print its repr, with grad_fn)
    if type(result) is not torch.Tensor or result.dim() != 0 or not result.requires_grad:
        return False
    if not torch.is_grad_enabled() or (result.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    from megatron_glm5.compat import deferred_grad_checks_routed, optimizer_cuda_graph_used

    if not deferred_grad_checks_routed() or optimizer_cuda_graph_used():  # nothing would decide it
        return False
    return _grad_checks["deferred"] > 0 and not _grad_checks["at_once"] and not _grad_checks["unflagged"]


def validation_deferrable(machine: Any, result: Any, rejection_func: Callable) -> bool:
    """Whether this ``validate_result`` may wait for ``should_run_forward_backward`` (module docstring): rerun mode
    ``validate_results`` in an initial run past the first iteration with no re-run requested yet, megatron-core's NaN /
    Inf rejection of a 0-dim plain tensor, the decision route installed, not under CUDA graph capture."""
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    if _turned_off or rejection_func not in (torch.isnan, torch.isinf) or machine.mode != RerunMode.VALIDATE_RESULTS:
        return False
    if machine.state != RerunState.INITIAL_RUN or machine.rerun_requested or not machine.first_iteration_complete:
        return False
    if type(result) is not torch.Tensor or result.dim() != 0:
        return False
    if result.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    from megatron_glm5.compat import rerun_decision_routed

    return rerun_decision_routed()


def validate_result_deferred(original: Callable, machine: Any, result: Any, rejection_func: Callable, message: str,
                             comparison_func: Callable | None = None, tolerance: float = 0.0,
                             fatal: bool = True) -> Any:
    """megatron-core's ``RerunStateMachine.validate_result`` (``original``) decided at the optimizer step where
    :func:`loss_deferrable`, else at once. A loss check of an earlier iteration still pending means no torch
    optimizer stepped since: everything pending is decided now and the route turns off. Under ``validate_results``
    the NaN / Inf checks of an initial run are queued for ``should_run_forward_backward`` instead
    (:func:`validation_deferrable`)."""
    if validation_deferrable(machine, result, rejection_func):
        iteration = machine.current_iteration
        if any(getattr(check, "iteration", iteration) != iteration for check in _pending):
            resolve_pending()  # an earlier iteration's (a loop without should_run_forward_backward): first, in order
        with torch.no_grad():
            value = result.detach().clone()  # Megatron-LM divides the loss in place after its checks

        def replay_validation() -> None:
            original(machine, value, rejection_func, message, comparison_func, tolerance, fatal)

        _pending.append(PendingValidation(replay_validation, iteration))
        return None
    if not loss_deferrable(machine, result, rejection_func):
        resolve_pending()  # anything pending is older: decided first, in order
        return original(machine, result, rejection_func, message, comparison_func, tolerance, fatal)
    iteration = machine.current_iteration
    if any(isinstance(check, PendingLossCheck) and check.iteration != iteration for check in _pending):
        _turn_off("no torch optimizer step between two iterations' loss checks: a custom loop or a skipped step")
        resolve_pending()
        return original(machine, result, rejection_func, message, comparison_func, tolerance, fatal)
    with torch.no_grad():
        value = result.detach().clone()  # Megatron-LM divides the loss in place after its checks
        rejected = rejection_func(value).reshape(1)
    _loss_flags.append(rejected)

    def replay() -> None:
        now = machine.current_iteration
        machine.current_iteration = iteration
        try:
            original(machine, value, rejection_func, message, comparison_func, tolerance, fatal)
        finally:
            machine.current_iteration = now

    _pending.append(PendingLossCheck(HostValues(rejected), replay, iteration))


def resolve_pending() -> None:
    """Decide every deferred check, oldest first, waiting for its values if the GPU has not reached them; raises
    megatron-core's error for the first one rejected (the others are dropped with it: the run stops there). A call
    from inside a decision (a replayed ``check_grads`` goes through the routed ``validate_result``) does nothing: the
    outer call decides the rest in order."""
    if _deciding:
        return
    _deciding.append(True)
    try:
        while _pending:
            check = _pending.pop(0)
            try:
                check.decide()
            except BaseException:
                _pending.clear()
                _loss_flags.clear()
                raise
    finally:
        _deciding.clear()


def before_rerun_decision(original: Callable, machine: Any, data_iterator: Any) -> bool:
    """megatron-core's ``RerunStateMachine.should_run_forward_backward`` (``original``) after the queued checks are
    replayed, in order, while the machine is still in the state they were made in (it resets the call counts and
    reduces ``rerun_requested`` first thing). Under ``disabled`` nothing is queued here: its deferred checks wait for
    the optimizer step, as before."""
    if any(isinstance(check, PendingValidation) for check in _pending):
        resolve_pending()
    return original(machine, data_iterator)


def reset() -> None:
    """Forget every pending check, flag and count, and turn the route back on (tests; a restarted run in the same
    process)."""
    _pending.clear()
    _loss_flags.clear()
    _deciding.clear()
    _turned_off.clear()
    _grad_checks.update(deferred=0, at_once=0, unflagged=0)
    from megatron_glm5 import compat

    compat._optimizer_graphs_built.clear()


def pending_checks() -> int:
    """How many checks wait for :func:`resolve_pending` (for tests and logs)."""
    return len(_pending)


def before_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """torch's global optimizer step pre-hook: the pending checks are decided before the step changes a parameter
    (not while a CUDA graph captures the step: there is nothing pending then, as :func:`deferrable` refuses once
    megatron-core's optimizer graph wrapper has run)."""
    if _pending and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        resolve_pending()


__all__ = ["PendingCheck", "PendingLossCheck", "PendingValidation", "before_optimizer_step", "before_rerun_decision",
           "check_grads_deferred", "deferrable", "loss_deferrable", "pending_checks", "reset", "resolve_pending",
           "validate_result_deferred", "validation_deferrable"]
