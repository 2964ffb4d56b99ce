"""LoRA layers: megatron-core linears with adapters (:mod:`megatron_glm5.lora` builds them, its docstring has the
layout table). Each adapted linear is an instance of ``Lora<Kind><BaseClass>``, a subclass of its own class swapped
in place, so parameter names, ``isinstance`` checks and ``backward_dw`` stay the base's; the adapter lives in the
child modules ``lora_A`` / ``lora_B``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.nn.functional as F

from .dsa.hooks import install_weight_reader
from .dsa.hooks import linear_weight as hooks_linear_weight


class LoraFactor(torch.nn.Module):
    """One LoRA factor: a ``weight`` only (so that names read ``...lora_A.weight`` as in peft)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def extra_repr(self) -> str:
        return f"{list(self.weight.shape)}"


_BASE_ONLY = contextvars.ContextVar("glm5_lora_base_only", default=False)


@contextlib.contextmanager
def base_only() -> Iterator[None]:
    """While active, adapted linears leave their adapters out of ``sharded_state_dict`` (the model then describes
    exactly its base weights: HF import / export through the bridge's table)."""
    token = _BASE_ONLY.set(True)
    try:
        yield
    finally:
        _BASE_ONLY.reset(token)


class LoraLinear:
    """Mixin for an adapted megatron-core linear (subclassed in front of its class, see :func:`_lora_class`).

    Attributes set by :func:`add_lora`: ``lora_A`` / ``lora_B`` (:class:`LoraFactor`), ``lora_dropout``,
    ``lora_scaling``, ``lora_rank``, ``lora_alpha``, ``lora_name`` (logical module name)."""

    lora_kind: str = ""
    lora_A: LoraFactor
    lora_B: LoraFactor
    lora_scaling: float
    lora_rank: int
    lora_alpha: float
    lora_name: str
    lora_swiglu: bool = False

    def lora_delta(self) -> torch.Tensor:
        """``alpha/r * B @ A`` in this rank's layout of the base weight (a column slice, a row slice or whole)."""
        return self.lora_scaling * (self.lora_B.weight @ self.lora_A.weight)

    def _lora_tp(self):
        return self.tp_group if self.tp_group is not None and self.tp_group.size() > 1 else None

    def _lora_sharded(self, prefix, sharded_offsets, metadata, axis_map):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        if _BASE_ONLY.get():
            state = {k: v for k, v in state.items() if not k.startswith("lora_")}
        dp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        tp = self.tp_group if self.tp_group is not None else ps.get_tensor_model_parallel_group()
        out = make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets, tp_group=tp,
                                                  dp_cp_group=dp)
        key = f"{prefix}lora_B.weight"
        if self.lora_swiglu and key in out:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False),
                                                    tp_group=self.tp_group, dp_group=dp)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora={self.lora_kind} r={self.lora_rank} alpha={self.lora_alpha}"


def _no_extra_inputs(module, weight, runtime_gather_output) -> None:
    if weight is not None or runtime_gather_output:
        raise NotImplementedError(
            f"{module.lora_name}: a LoRA-adapted linear computes with its own weight and output layout; "
            "weight= / runtime_gather_output=True are not supported"
        )


class LoraColumn(LoraLinear):
    """Column-parallel base: ``A`` replicated on the input's SP rows, the rank-R activation all-gathered, ``B``
    sharded like the output. Routed experts (``explicit_expert_comm``): no sequence collectives; ``A``'s gradient
    is all-reduced over the expert-TP group by autograd."""

    lora_kind = "column"

    def _lora_input_factor(self) -> torch.Tensor:
        a = self.lora_A.weight
        tp = self._lora_tp()
        if self.explicit_expert_comm and tp is not None:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            a = copy_to_tensor_model_parallel_region(a, group=tp)
        return a

    def forward(self, input_, weight=None, runtime_gather_output=None):
        _no_extra_inputs(self, weight, runtime_gather_output)
        out, bias = super().forward(input_)
        h = F.linear(self.lora_dropout(input_), self._lora_input_factor())  # [s_l, b, R]
        if not self.explicit_expert_comm and self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        return out + self.lora_scaling * F.linear(h, self.lora_B.weight), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._lora_sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0, "lora_B.weight": 0})


class LoraWeightRead(LoraColumn):
    """``linear_kv_up_proj``: absorbed attention reads its weight (:func:`linear_weight`). ``A`` enters through
    ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) because each TP rank's heads see
    only part of its gradient; it is therefore *not* tagged ``sequence_parallel``."""

    lora_kind = "weight_read"

    def _lora_input_factor(self) -> torch.Tensor:
        a = self.lora_A.weight
        tp = self._lora_tp()
        if tp is not None:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            a = copy_to_tensor_model_parallel_region(a, group=tp)
        return a

    def lora_weight(self) -> torch.Tensor:
        """``W + alpha/r * B_local @ A``: this rank's rows of the effective weight, differentiable in A and B."""
        return self.weight + self.lora_scaling * (self.lora_B.weight @ self._lora_input_factor())


class LoraRow(LoraLinear):
    """Row-parallel base: ``A`` sharded like the input, its rank-R partial sums reduce-scattered to the SP rows
    (all-reduced without SP), ``B`` replicated. Routed experts: the partial sums travel with the base output (the
    dispatcher combines them); ``B``'s gradient is all-reduced over the expert-TP group by autograd."""

    lora_kind = "row"

    def forward(self, input_):
        out, bias = super().forward(input_)
        h = F.linear(self.lora_dropout(input_), self.lora_A.weight)  # [s, b, R], partial over TP
        b = self.lora_B.weight
        tp = self._lora_tp()
        if tp is not None:
            from megatron.core.tensor_parallel import mappings

            if self.explicit_expert_comm:
                b = mappings.copy_to_tensor_model_parallel_region(b, group=tp)
            elif self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=tp)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=tp)
        return out + self.lora_scaling * F.linear(h, b), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._lora_sharded(prefix, sharded_offsets, metadata, {"weight": 1, "lora_A.weight": 1})


class LoraDuplicated(LoraLinear):
    """Duplicated (TP-replicated) base on the SP rows: both factors replicated, tagged like the base weight."""

    lora_kind = "duplicated"

    def _lora_tp(self):
        return None

    def lora_weight(self) -> torch.Tensor:
        return self.weight + self.lora_delta()

    def forward(self, x):
        out = super().forward(x)
        delta = self.lora_scaling * F.linear(F.linear(self.lora_dropout(x), self.lora_A.weight), self.lora_B.weight)
        if isinstance(out, tuple):
            return out[0] + delta, *out[1:]
        return out + delta

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        if not _BASE_ONLY.get():
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {k: v for k, v in self.state_dict(prefix="", keep_vars=True).items() if not k.startswith("lora_")}
        dp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, sharded_offsets=sharded_offsets,
                                                   tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=dp)


_CLASSES: dict[tuple[type, type], type] = {}


def _lora_class(mixin: type, base: type) -> type:
    """``class Lora<Base>(mixin, base)``, one per pair, registered in this module (picklable by name)."""
    key = (mixin, base)
    if key not in _CLASSES:
        name = f"{mixin.__name__}{base.__name__}"
        cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _CLASSES[key] = cls
    return _CLASSES[key]


def _kind_of(module, target: str) -> type:
    """The mixin for a base linear, by megatron-core class; a clear error for anything else."""
    from .compat import modelopt_linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, LoraLinear):
        raise ValueError(f"{module.lora_name} already has a LoRA adapter (add_lora was applied twice)")
    if isinstance(module, modelopt_linear()):
        return LoraDuplicated
    if isinstance(module, ColumnParallelLinear):
        if module.gather_output:
            raise NotImplementedError(f"LoRA on a column-parallel linear with gather_output=True ({target})")
        return LoraWeightRead if target == "linear_kv_up_proj" else LoraColumn
    if isinstance(module, RowParallelLinear):
        if not module.input_is_parallel:
            raise NotImplementedError(f"LoRA on a row-parallel linear with input_is_parallel=False ({target})")
        return LoraRow
    try:  # Transformer Engine, when installed (same (out, bias) contract; not exercised in CI, which has no TE)
        from megatron.core.extensions import transformer_engine as te

        if getattr(te, "HAVE_TE", False):
            if isinstance(module, getattr(te, "TEGroupedLinear", ())):
                raise NotImplementedError(
                    "LoRA on grouped-GEMM experts (TEGroupedMLP) is not supported; build the model with "
                    "moe_grouped_gemm=False (SequentialMLP experts)"
                )
            if isinstance(module, te.TELinear) and getattr(module, "parallel_mode", None) == "duplicated":
                return LoraDuplicated
            if isinstance(module, te.TEColumnParallelLinear):
                return LoraWeightRead if target == "linear_kv_up_proj" else LoraColumn
            if isinstance(module, te.TERowParallelLinear):
                return LoraRow
    except ImportError:  # pragma: no cover
        pass
    raise NotImplementedError(f"LoRA does not know how to adapt {type(module).__name__} ({target})")


def _lora_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The DSA attention's weight reader (:mod:`megatron_glm5.dsa.hooks`): the LoRA-adapted effective weight
    (differentiable), None for a module without an adapter."""
    if isinstance(module, (LoraWeightRead, LoraDuplicated)):
        return module.lora_weight()
    if isinstance(module, LoraLinear):
        raise NotImplementedError(f"{module.lora_name}: reading the effective weight of a {module.lora_kind} "
                                  "adapter is not supported")
    return None


install_weight_reader(_lora_weight)
linear_weight = hooks_linear_weight  # the weight ``module`` computes with, LoRA delta included when adapted


__all__ = ["LoraColumn", "LoraDuplicated", "LoraFactor", "LoraLinear", "LoraRow", "LoraWeightRead", "base_only",
           "linear_weight"]
