"""Host wall time of megatron-core's / Megatron-LM's step phases, without a profiler (``bench_step.py --host-timers``).

The profiler's Python tracing inflates host time several-fold, so the optimizer phase's idle GPU gaps (issue 23) are
timed here with ``time.perf_counter`` around the functions themselves: no device sync is added, so each number is the
host time the call takes, which the GPU sees as idle wherever nothing is queued ahead of it (after DDP's gradient
check, which waits for the GPU).

Loaded through a ``sitecustomize`` that ``bench_step.py`` writes (``install()``; it then runs the ``sitecustomize``
it shadows, if any): each target module is patched right after it is first imported, before other modules bind its
functions by name. At exit each rank appends one JSON line to ``$GLM5_HOST_TIMERS_OUT``: ``{name: [ms of each call
in iterations past $GLM5_HOST_TIMERS_SKIP]}`` plus the iteration count. Inclusive times of host calls: what the GPU
sees as idle is at most this (a call may run while queued kernels keep the GPU busy).

Python's cyclic garbage collector is timed too (``gc.callbacks``): each collection of generation ``g`` is one call of
``gc.collect(gen g)`` in the record, and ``"gc"`` lists ``[iteration, generation, ms, collected]`` per collection of
generation 2 (a full collection walks every tracked object: a slow iteration in an otherwise steady run). At exit the
record also says what the collector tracks (``"heap"``: object count and the commonest types).
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from collections import defaultdict

# module -> attributes ("Class.method" for methods) whose calls are timed
TARGETS: dict[str, tuple[str, ...]] = {
    "megatron.training.training": ("train_step", "training_log"),
    "megatron.core.pipeline_parallel.schedules": ("forward_backward_no_pipelining",),
    "megatron.core.distributed.finalize_model_grads": (
        "finalize_model_grads", "_update_router_expert_bias", "reset_model_temporary_tensors"),
    "megatron.core.distributed.distributed_data_parallel": ("DistributedDataParallel.zero_grad_buffer",),
    "megatron.core.optimizer.clip_grads": ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"),
    "megatron.core.optimizer.optimizer": (
        "MegatronOptimizer._filter_grads_for_norm", "ChainedOptimizer.step", "MixedPrecisionOptimizer.prepare_grads",
        "MixedPrecisionOptimizer.step_with_ready_grads", "Float16OptimizerWithFloat16Params.zero_grad",
        "Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads",
        "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params"),
    "megatron.core.rerun_state_machine": ("RerunStateMachine.validate_result",),
    # our routes, bound by name where megatron-core's functions were (their rows would vanish otherwise)
    "megatron_glm5.optim_fusions": ("grad_norm_on_device",),
    "megatron_glm5.finalize_walks": ("router_modules",),
    # the sparse MLA's backward (the grouped kernel is taken once the top-k sets share enough keys)
    "megatron_glm5.kernels.sparse_mla_bwd": ("sparse_mla_bwd_interface", "load_grouped_backward"),
}
ITERATION = "train_step"  # each call starts an iteration
SKIP = int(os.environ.get("GLM5_HOST_TIMERS_SKIP", "3"))  # iterations not recorded (warm-up)
# GLM5_GC_FREEZE_AT=N: gc.collect() and gc.freeze() as iteration N starts (bench variant *-gc-freeze; 0: never)
FREEZE_AT = int(os.environ.get("GLM5_GC_FREEZE_AT", "0"))

_calls: dict[str, list[float]] = defaultdict(list)
_iteration = [0]
_full_collections: list[list] = []  # [iteration, generation, ms, collected] of each generation-2 collection
_gc_start = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _gc_start[0]) * 1e3
    generation = info.get("generation", -1)
    if _iteration[0] > SKIP:
        _calls[f"gc.collect(gen {generation})"].append(ms)
    if generation == 2:
        _full_collections.append([_iteration[0], generation, round(ms, 3), info.get("collected", 0)])


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if name == ITERATION:
            _iteration[0] += 1
            if _iteration[0] == FREEZE_AT:  # the experiment: collect once, then keep today's objects out of every walk
                gc.collect()
                gc.freeze()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if _iteration[0] > SKIP:
                _calls[name].append((time.perf_counter() - t0) * 1e3)

    return wrapper


def _patch(module) -> None:
    """Wrap the module's targets; one that moved (another release) is reported and skipped, never fatal."""
    for target in TARGETS[module.__name__]:
        owner, _, attr = target.rpartition(".")
        obj = getattr(module, owner, None) if owner else module
        fn = vars(obj).get(attr) if obj is not None else None
        if not callable(fn):  # also refuses staticmethod / classmethod objects (their wrapping would change them)
            print(f"[host_timers] {module.__name__}.{target}: not a plain function here, not timed", file=sys.stderr)
            continue
        setattr(obj, attr, _timed(target, fn))


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each module of :data:`TARGETS` right after it executes."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _dump() -> None:
    out = os.environ.get("GLM5_HOST_TIMERS_OUT")
    if not out or not _calls:
        return
    record = {"iterations": max(0, _iteration[0] - SKIP), "calls": dict(_calls), "gc": _full_collections,
              "heap": _heap()}
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


def _heap(top: int = 12) -> dict:
    """What the collector tracks now: the object count and the ``top`` commonest types (module-qualified)."""
    counts: dict[str, int] = defaultdict(int)
    objects = gc.get_objects()
    for obj in objects:
        t = type(obj)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    return {"objects": len(objects), "frozen": gc.get_freeze_count(),
            "top": sorted(counts.items(), key=lambda kv: -kv[1])[:top]}


def install() -> None:
    sys.meta_path.insert(0, _Finder())
    gc.callbacks.append(_on_gc)
    atexit.register(_dump)

