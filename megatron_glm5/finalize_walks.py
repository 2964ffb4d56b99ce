"""megatron-core's two per-step module walks after the backward, over the modules they act on, found once.

Why: after every backward, megatron-core's ``finalize_model_grads`` calls ``_update_router_expert_bias`` and
``reset_model_temporary_tensors``. Each walks every module of every model chunk and asks each one for router
attributes (``hasattr`` through ``nn.Module.__getattr__``, an exception for each module that lacks them). On the GLM-5
slice (H200) that is 2.95 ms of host time per step while the GPU waits; 0.69 ms here (issue 23, round 8,
``scripts/bench/RESULTS_step.md``).

Here megatron-core's own functions run unchanged on a stand-in for each chunk whose ``modules()`` yields only the
modules that have one of :data:`ATTRS`, in the walk's order. One walk finds them. It runs again after a module
with one of them in its tree, or a buffer or parameter of one of their names, is registered anywhere (torch's global
registration hooks, through :mod:`megatron_glm5.compat`), so a router added or swapped in later is found. Everything megatron-core checks per call
(``training``, ``frozen_expert_bias``, the config's flags, the buffers themselves) it still reads at each call, so
the result is the same by construction. Not seen: one of :data:`ATTRS` set as a plain attribute, after the first
step, on a module that had none of them (megatron-core's router sets all three in ``__init__``), and a router deleted
from the model with no module put in its place (its stale entry is still updated).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator

import torch

ATTRS = ("expert_bias", "reset_global_aux_loss_tracker", "qb_beta_accum")
"""What megatron-core's two walks ask each module for (``finalize_model_grads.py``, 0.19.2)."""

_generation = [0]  # bumped by every module / buffer / parameter registration in the process
_found: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[torch.nn.Module]]]" = weakref.WeakKeyDictionary()


def model_changed(module: torch.nn.Module, name: str, value: Any) -> None:
    """torch's global registration hooks call this for every module, buffer or parameter registered (or assigned
    again) anywhere: the next walk looks at every module again when the registration can change what it finds (a
    buffer or parameter named as one of :data:`ATTRS`, or a module with one of them in its tree). Other
    registrations (megatron-core and torch assign some buffers at every step) keep the list."""
    if name in ATTRS or (isinstance(value, torch.nn.Module) and any(
            any(hasattr(m, a) for a in ATTRS) for m in value.modules())):
        _generation[0] += 1


class _Chunk:
    """Stands for one model chunk where megatron-core calls ``get_attr_wrapped_model(chunk, 'modules')()``."""

    __slots__ = ("_modules",)

    def __init__(self, modules: list[torch.nn.Module]):
        self._modules = modules

    def modules(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules)


def router_modules(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``chunk`` (as megatron-core walks it) that have one of :data:`ATTRS`, in walk order."""
    from megatron.core.utils import get_attr_wrapped_model

    hit = _found.get(chunk)
    if hit is not None and hit[0] == _generation[0]:
        return hit[1]
    generation = _generation[0]
    modules = [m for m in get_attr_wrapped_model(chunk, "modules")() if any(hasattr(m, a) for a in ATTRS)]
    _found[chunk] = (generation, modules)
    return modules


def _stand_ins(model: list) -> list:
    return [_Chunk(router_modules(chunk)) if isinstance(chunk, torch.nn.Module) else chunk for chunk in model]


def update_router_expert_bias(original: Callable, model: list, config: Any, *args: Any, **kwargs: Any) -> None:
    """megatron-core's ``_update_router_expert_bias(model, config, ...)`` over the router modules only."""
    return original(_stand_ins(model), config, *args, **kwargs)


def reset_model_temporary_tensors(original: Callable, config: Any, model: list) -> None:
    """megatron-core's ``reset_model_temporary_tensors(config, model)`` over the router modules only."""
    return original(config, _stand_ins(model))


__all__ = ["ATTRS", "model_changed", "reset_model_temporary_tensors", "router_modules", "update_router_expert_bias"]
