"""megatron-core's two per-step module walks after the backward, over the modules they act on, found once.

Why: after every backward, megatron-core's ``finalize_model_grads`` calls ``_update_router_expert_bias`` and
``reset_model_temporary_tensors``. Each walks every module of every model chunk and asks each one for router
attributes (``hasattr`` through ``nn.Module.__getattr__``, an exception for each module that lacks them). On the GLM-5
slice (H200) that is 2.95 ms of host time per step while the GPU waits; 0.69 ms here (issue 23, round 8,
``scripts/bench/RESULTS_step.md``).

Here megatron-core's own functions run unchanged on a stand-in for each chunk whose ``modules()`` yields only the
modules that have one of :data:`ATTRS`, in the walk's order. One walk finds them. It runs again after any module is
registered or set to None, or a buffer or parameter of one of their names is registered (torch's global registration
hooks, through :mod:`megatron_glm5.compat`), and when a listed module has been freed. Everything megatron-core checks per call (``training``, ``frozen_expert_bias``, the config's flags, the
buffers themselves) it still reads at each call, so the result is the same by construction.

Not seen, as no registration hook fires: ``ModuleList.insert`` / ``Sequential.insert``, ``del`` / ``pop`` of a
submodule, writes to ``_modules``; and one of :data:`ATTRS` set as a plain attribute after the first step on a module
that had none of them (megatron-core's router sets ``expert_bias`` and ``qb_beta_accum`` in ``__init__``;
``reset_global_aux_loss_tracker`` is a method).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator

import torch

ATTRS = ("expert_bias", "reset_global_aux_loss_tracker", "qb_beta_accum")
"""What megatron-core's two walks ask each module for (``finalize_model_grads.py``, 0.19.2)."""

_generation = [0]  # bumped by the registrations that can change a walk's result (model_changed)
# chunk -> (generation, the modules by weak reference: a strong one would keep the chunk alive through the hooks its
# wrapper puts on every module)
_found: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[weakref.ref]]]" = weakref.WeakKeyDictionary()


def model_changed(module: torch.nn.Module, name: str, value: Any) -> None:
    """torch's global registration hooks call this for every module, buffer or parameter registered (or assigned
    again) anywhere. The next walk looks at every module again after a module is registered or removed (models are
    built, wrapped or changed; no module is registered at every step) or a buffer or parameter named as one of
    :data:`ATTRS`. Other registrations keep the list: megatron-core's router assigns a buffer at every forward."""
    if name in ATTRS or value is None or isinstance(value, torch.nn.Module):
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
        modules = [ref() for ref in hit[1]]
        if all(m is not None for m in modules):
            return modules
    generation = _generation[0]
    modules = [m for m in get_attr_wrapped_model(chunk, "modules")() if any(hasattr(m, a) for a in ATTRS)]
    _found[chunk] = (generation, [weakref.ref(m) for m in modules])
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
