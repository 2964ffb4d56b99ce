"""Routed experts as two grouped GEMMs (``torch.nn.functional.grouped_mm``), stored exactly like ``SequentialMLP``.

Without Transformer Engine megatron-core 0.19.2 runs routed experts through ``SequentialMLP`` (a host sync and a
Python loop over experts); :class:`TorchGroupedMLP` *is* a ``SequentialMLP`` (same submodules, parameter names and
checkpoints) whose ``forward`` runs two ``grouped_mm`` over the expert weights as one ``[E, N, K]`` tensor (a view:
the module keeps each linear's expert weights in one storage), with a fallback to the per-expert loop where
``grouped_mm`` cannot run (logged once per reason). Expert TP, router probabilities, how the weights reach the GEMM,
zero-token experts, DDP's parameter-gather hooks, the paths and what is refused: ``docs/design/grouped_experts.md``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.moe.experts import SequentialMLP

from ..fusions import (EXPERT_WGRAD_GEMMS_ENV, FUSED_SWIGLU_ENV, GROUPED_WGRAD_ACCUMULATION_ENV,
                       ZERO_GROUPS_KERNEL_ENV, enabled, weighted_bias_swiglu_impl)
from ..kernels._common import HostValues
from ..kernels.grouped_wgrad_accum import accumulate_groups
from ..optim_fusions import wgrad_gemm_accum_fp32
from ..kernels.zero_groups import zero_empty_groups, zero_empty_groups_reference

Impl = Literal["auto", "grouped_mm", "sequential"]
IMPLS: tuple[str, ...] = ("auto", "grouped_mm", "sequential")

# torch.nn.functional.grouped_mm is the public wrapper of torch._grouped_mm (the only name in older releases).
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm

_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()  # each distinct message once per process


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        _log.info(message)


# --------------------------------------------------------------------------------------------------------------------
# What torch's grouped_mm runs
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def _cpu_grouped_mm(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU ``grouped_mm`` accepts ``dtype`` (a tiny probe, once per dtype)."""
    try:
        x, w = torch.zeros(8, 8, dtype=dtype), torch.zeros(2, 8, 8, dtype=dtype)
        _grouped_mm(x, w, offs=torch.tensor([4, 8], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs ``dtype`` on ``device``. On CUDA: bf16 on sm >= 80 (torch's
    documented contract; fp16 only on sm 9x-11x with cuBLASLt >= 13.3, not used here). On CPU: whatever the installed
    torch accepts (2.14: fp32, bf16, fp16)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return dtype == torch.bfloat16 and _cuda_capability(index) >= (8, 0)
    if device.type == "cpu":
        return _cpu_grouped_mm(dtype)
    return False


def _aligned(dims: Sequence[int], dtype: torch.dtype) -> bool:
    """``grouped_mm`` needs every non-unit stride of its operands to be a multiple of 16 bytes."""
    return all(d * dtype.itemsize % 16 == 0 for d in dims)


# --------------------------------------------------------------------------------------------------------------------
# Grouped linear: y[rows of e] = x[rows of e] @ W_e^T
# --------------------------------------------------------------------------------------------------------------------


def co_locate(weights: Sequence[torch.nn.Parameter]) -> bool:
    """Move equally shaped parameters into one ``[E, *shape]`` storage, back to back in list order, so that
    :func:`stacked` can view them instead of copying (called once, at build time, before DDP or an optimizer sees
    the parameters; each keeps its object, attributes and values). Meta tensors are left alone. Returns whether the
    weights were moved."""
    w0 = weights[0]
    if w0.device.type == "meta" or any(w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device
                                       for w in weights):
        return False
    block = torch.empty((len(weights), *w0.shape), dtype=w0.dtype, device=w0.device)
    with torch.no_grad():
        for e, w in enumerate(weights):
            block[e].copy_(w)
            w.data = block[e]
    return True


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(weights)``, as a view where the weights lie back to back in list order in one storage (as
    :func:`co_locate` left them; checked at every call, since a later ``.data`` swap, e.g. megatron-core's distributed
    optimizer putting the parameters into its flat buffer, moves them), else as a copy."""
    w0 = weights[0]
    n, ptr, off = w0.numel(), w0.untyped_storage().data_ptr(), w0.storage_offset()
    for e, w in enumerate(weights):
        if (w.shape != w0.shape or w.dtype != w0.dtype or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != ptr or w.storage_offset() != off + e * n):
            _log_once("megatron-glm5 MoE experts: the expert weights are not back to back in one storage (e.g. "
                      "megatron-core's distributed optimizer or a CPU-initialised model moved them), so the grouped "
                      "GEMMs stack a copy of them per call")
            return torch.stack(weights)
    return w0.as_strided((len(weights), *w0.shape), (n, *w0.stride()), off)


def _zero_empty_groups(dw: torch.Tensor, empty, kernel: bool = False) -> torch.Tensor:
    """Zero the weight gradients of zero-token experts: ``empty`` is a tuple of indices (host counts: only those
    slices are written) or a bool ``[E]`` device mask (device counts, no sync: one masked pass over ``dw``, or with
    ``kernel`` the Triton kernel that writes only the empty slices, :mod:`megatron_glm5.kernels.zero_groups`)."""
    if isinstance(empty, torch.Tensor):
        return zero_empty_groups(dw, empty) if kernel else zero_empty_groups_reference(dw, empty)
    for e in empty:
        dw[e].zero_()
    return dw


def _main_grads(weights: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """The weights' fp32 ``main_grad`` where megatron-core's DDP gave every one of them one and lets a layer add its
    gradient itself (``grad_added_to_main_grad``, as its linear layers do under ``gradient_accumulation_fusion``);
    else None (Megatron-FSDP, ``zero_out_wgrad``, no DDP)."""
    mains = []
    for w in weights:
        m = getattr(w, "main_grad", None)
        if (not isinstance(m, torch.Tensor) or not hasattr(w, "grad_added_to_main_grad")
                or hasattr(w, "__fsdp_param__") or getattr(w, "zero_out_wgrad", False)
                or m.dtype != torch.float32 or m.shape != w.shape):
            return None
        mains.append(m)
    return mains


def _empty_mask(empty, groups: int, device: torch.device) -> torch.Tensor:
    """``empty`` as a bool ``[E]`` mask on ``device`` (host indices are copied from pinned memory, no stream sync)."""
    if isinstance(empty, torch.Tensor):
        return empty
    mask = torch.zeros(groups, dtype=torch.bool)
    mask[list(empty)] = True
    return mask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask


PER_EXPERT_WGRAD_MIN_MEAN_ROWS = 4096
"""Mean rows per local expert from which the backward computes the weight gradients with one GEMM per expert
(:func:`per_expert_row_ends`). The one measurement is at this mean (H200, ``scripts/bench/bench_expert_wgrad.py``:
16 experts x 4096 +- 80 rows; fc1 ``[4096, 6144]`` 4.87 vs 5.61 ms, fc2 ``[6144, 2048]`` 2.81 vs 2.77 ms). Below it
nothing was measured, and the route's host cost (an ``addmm`` launch per expert) does not shrink with the rows, so
the grouped GEMM runs there. Tests lower it to reach the route at small shapes."""


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is being captured into a CUDA graph (never asks CUDA for a CPU tensor)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _refuse_capture() -> None:
    raise RuntimeError("TorchGroupedMLP: the routed experts' per-expert weight-gradient GEMMs read their row ranges "
                       "on the host and cannot be captured into a CUDA graph; for a capture turn them off "
                       "(MEGATRON_GLM5_EXPERT_WGRAD_GEMMS=0) for the warm-up and the capture alike")


class RowEnds:
    """The groups' row ends on the host, for the backward's per-expert GEMMs; one per forward, read once and shared
    by its fc1 and fc2. Host counts (:meth:`from_counts`) are summed on the host: nothing is copied, no event.
    Device offsets are copied to pinned memory in the forward behind an event recorded on their device's stream, with
    no sync there, and :meth:`read` waits for that event only. After a plain forward the copy has normally finished
    long before the backward, so the wait returns at once. Not so under an activation recompute that runs this
    forward again inside the backward and backpropagates that run (megatron-core's reentrant checkpoint of full
    recompute, :mod:`megatron_glm5.core.mlp_chunks`): the event is then on work just queued, and the host waits until
    the GPU has reached the recomputed expert offsets. Not for CUDA graph capture: the event wait and the host read
    cannot be captured, and :func:`per_expert_row_ends` refuses there."""

    def __init__(self, offs: torch.Tensor | Sequence[int]):
        """``offs``: the row ends, on a CUDA device (copied: :class:`~megatron_glm5.kernels._common.HostValues`) or on
        the host (a CPU tensor or ints, kept)."""
        self._values: HostValues | None = None
        self._ends: list[int] | None = None
        if isinstance(offs, torch.Tensor):
            self._values = HostValues(offs)
        else:
            self._ends = [int(e) for e in offs]

    @classmethod
    def from_counts(cls, counts: torch.Tensor | Sequence[int]) -> RowEnds:
        """From per-expert token counts already on the host (a CPU tensor or ints): no device round trip."""
        if isinstance(counts, torch.Tensor):
            if counts.device.type != "cpu":
                raise ValueError(f"RowEnds.from_counts: expected host counts, got a tensor on {counts.device}; pass "
                                 "the device offsets to RowEnds(offs)")
            counts = counts.tolist()
        return cls(list(itertools.accumulate(int(c) for c in counts)))

    def read(self) -> list[int]:
        if self._ends is None:
            self._ends = self._values.get()
        return self._ends


def per_expert_row_ends(tokens_per_expert: torch.Tensor | Sequence[int], offs: torch.Tensor, rows: int,
                        experts: int) -> RowEnds | None:
    """The forward's choice of the weight-gradient route: a :class:`RowEnds` for one GEMM per expert, or None for the
    grouped GEMM. None without autograd (no backward reads it) and below :data:`PER_EXPERT_WGRAD_MIN_MEAN_ROWS` mean
    rows per expert (unmeasured there). Host counts give their ends directly, device counts ``RowEnds(offs)``.

    Refused under CUDA graph capture (:class:`RowEnds` cannot be captured, and the per-expert row slices would be
    frozen into the graph) rather than falling back to the grouped GEMM: the warm-up before a capture is not captured
    and so takes this route, and the grouped route's first call is not capturable (the weight-gradient add builds
    its pointer table with a pageable copy, which capture rejects: seen on an H200); with the switch off for both
    the grouped route is warmed up before it is captured."""
    if not torch.is_grad_enabled() or rows < PER_EXPERT_WGRAD_MIN_MEAN_ROWS * experts:
        return None
    if _capturing(offs.device):
        _refuse_capture()
    if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device.type != "cpu":
        return RowEnds(offs)
    return RowEnds.from_counts(tokens_per_expert)


def _accumulate_per_expert(dy: torch.Tensor, x: torch.Tensor, mains: Sequence[torch.Tensor],
                           ends: Sequence[int]) -> None:
    """``mains[e] += dy_e^T @ x_e`` for each expert with rows: one GEMM per expert whose epilogue adds the fp32
    product into ``main_grad`` (:func:`megatron_glm5.optim_fusions.wgrad_gemm_accum_fp32`, what megatron-core's
    linear layers do under ``gradient_accumulation_fusion``). No bf16 weight gradient is written or read again, and
    a zero-token expert's ``main_grad`` is not touched."""
    start = 0
    for main, end in zip(mains, ends):
        if end > start:
            wgrad_gemm_accum_fp32(x[start:end], dy[start:end], main)
        start = end


def _placeholders(weight: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The weight gradients handed to autograd when they went into ``main_grad``, as megatron-core's linear layers
    return them (DDP's hook sees ``grad_added_to_main_grad``, skips its add and drops them): ``n`` distinct views of
    one uninitialised ``weight``-shaped block, never written. Distinct tensor objects in ``weight``'s layout, so that
    autograd's AccumulateGrad takes each as ``.grad`` without a copy (it copies a tensor referenced elsewhere): one
    ``[N, K]`` allocation per call instead of ``n``."""
    block = weight.new_empty(weight.shape)
    return [block.view(block.shape) for _ in range(n)]


class _GroupedLinear(torch.autograd.Function):
    """``y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ weights[e]^T`` for ``E`` weights ``[N, K]`` (``nn.Linear``
    layout). ``x``: ``[T, K]``, rows sorted by expert; ``offs``: int32 ``[E]`` row ends, ``offs[-1] == T``; ``empty``:
    the zero-token experts (see :func:`_zero_empty_groups`). Returns ``[T, N]``. The weights as one ``[E, N, K]``
    tensor: a view where :class:`TorchGroupedMLP` co-located them, else a copy made again in backward instead of
    being saved (:func:`stacked`). With ``accumulate`` and DDP's ``main_grad`` on every weight (:func:`_main_grads`)
    the weight gradients are added to ``main_grad`` and autograd gets placeholders, as megatron-core's linear layers
    do under ``gradient_accumulation_fusion``: with ``row_ends`` (:class:`RowEnds`) by one GEMM per expert adding
    its fp32 product (:func:`_accumulate_per_expert`; placeholders: :func:`_placeholders`), else by the grouped GEMM's
    bf16 gradient added in one launch (:mod:`megatron_glm5.kernels.grouped_wgrad_accum`; placeholders: that
    gradient's slices). A backward with ``row_ends`` under CUDA graph capture is refused."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, empty, zero_kernel: bool, accumulate: bool,
                row_ends: RowEnds | None, *weights: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # grouped_mm's stride rule; a no-op for the dispatcher's tokens and the activation
        ctx.save_for_backward(x, offs, *weights)
        ctx.empty, ctx.zero_kernel, ctx.accumulate, ctx.row_ends = empty, zero_kernel, accumulate, row_ends
        # DDP's attributes are read from the parameters themselves: a non-reentrant checkpoint gives the backward
        # detached copies of the saved tensors, without main_grad
        ctx.params = weights if accumulate else ()
        if x.shape[0] == 0:  # a rank with no tokens: grouped_mm rejects an empty contraction in backward
            return x.new_empty(0, weights[0].shape[0])
        return _grouped_mm(x, stacked(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[6:])
        dx, dws = None, [None] * len(weights)
        if x.shape[0] == 0:
            if need_x:
                dx = torch.zeros_like(x)
            if need_w:
                dws = [torch.zeros_like(w) for w in weights]
            return dx, None, None, None, None, None, *dws
        dy = dy.contiguous()
        if need_x:
            dx = _grouped_mm(dy, stacked(weights), offs=offs)  # [T, K]
        if need_w:
            mains = _main_grads(ctx.params) if ctx.accumulate else None
            if mains is not None and ctx.row_ends is not None:
                if _capturing(dy.device):  # a forward outside the capture, its backward inside
                    _refuse_capture()
                _accumulate_per_expert(dy, x, mains, ctx.row_ends.read())
                dws = _placeholders(weights[0], len(weights))
            elif mains is not None:
                dw = _grouped_mm(dy.t(), x, offs=offs)  # [E, N, K]: per group dy_e^T @ x_e
                accumulate_groups(dw, mains, _empty_mask(ctx.empty, len(weights), dw.device))
                # the placeholders are the GEMM's own slices, so nothing more is allocated; an empty expert's slice
                # is left unwritten
                dws = list(dw.unbind(0))
            else:
                dw = _grouped_mm(dy.t(), x, offs=offs)
                dws = list(_zero_empty_groups(dw, ctx.empty, ctx.zero_kernel).unbind(0))
            if mains is not None:
                for w in ctx.params:
                    w.grad_added_to_main_grad = True
        return dx, None, None, None, None, None, *dws


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], offs: torch.Tensor, empty=(),
                   zero_kernel: bool = False, accumulate: bool = False,
                   row_ends: RowEnds | None = None) -> torch.Tensor:
    """Differentiable grouped ``x @ W_e^T`` (see :class:`_GroupedLinear`; ``zero_kernel``: see
    :func:`_zero_empty_groups`; ``accumulate``: weight gradients into DDP's ``main_grad``, with ``row_ends`` by one
    GEMM per expert)."""
    return _GroupedLinear.apply(x, offs, empty, zero_kernel, accumulate, row_ends, *weights)


# --------------------------------------------------------------------------------------------------------------------
# The experts module
# --------------------------------------------------------------------------------------------------------------------


class TorchGroupedMLP(SequentialMLP):
    """``SequentialMLP`` (same submodules, parameters and checkpoint layout) whose forward runs every local expert in
    two ``torch.nn.functional.grouped_mm`` calls (module docstring). ``impl``: ``"auto"`` (grouped where torch runs
    it, else ``SequentialMLP.forward``), ``"grouped_mm"`` (raise where it cannot run), ``"sequential"``.

    Weight gradients into DDP's ``main_grad`` (``accumulate_wgrad``): with ``wgrad_gemms``
    (``MEGATRON_GLM5_EXPERT_WGRAD_GEMMS``, on by default) one GEMM per expert where :func:`per_expert_row_ends` picks
    it for the forward, else the grouped GEMM plus one add. The per-expert route was measured at one point only, a
    mean of 4096 rows per expert over 16 experts (see :data:`PER_EXPERT_WGRAD_MIN_MEAN_ROWS`); below that mean the
    grouped GEMM runs, and how the two compare there is unmeasured."""

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None, name: str | None = None,
                 impl: Impl = "auto"):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        if impl not in IMPLS:
            raise ValueError(f"TorchGroupedMLP impl: expected one of {list(IMPLS)}, got {impl!r}")
        self.impl = impl
        cfg = self.config
        bad = [f"{flag}={value!r} ({why})" for flag, value, why in (
            ("add_bias_linear", cfg.add_bias_linear, "expert biases; GLM-5.x experts have none"),
            ("fp8", cfg.fp8, "quantized GEMMs"),
            ("fp4", cfg.fp4, "quantized GEMMs"),
            ("use_te_activation_func", cfg.use_te_activation_func, "a Transformer Engine activation module"),
            ("delay_wgrad_compute", cfg.delay_wgrad_compute, "weight gradients are computed in backward here"),
        ) if value]
        if cfg.bias_activation_fusion and not (cfg.gated_linear_unit and cfg.activation_func in (F.silu, quick_gelu)):
            bad.append("bias_activation_fusion=True with an activation other than SwiGLU / quick-GEGLU (megatron-core "
                       "fuses only those with the router probabilities)")
        if bad:
            raise ValueError("TorchGroupedMLP (moe_grouped_gemm=True without Transformer Engine) does not support "
                             + "; ".join(bad) + "; turn these off or build with moe_grouped_gemm=False")
        self.activation_recompute = (cfg.recompute_granularity == "selective"
                                     and "moe_act" in (cfg.recompute_modules or ()))
        first = self.local_experts[0]
        self._linear_types = (type(first.linear_fc1), type(first.linear_fc2))
        self.fused_swiglu = enabled(FUSED_SWIGLU_ENV)
        self.zero_groups_kernel = enabled(ZERO_GROUPS_KERNEL_ENV)
        self.accumulate_wgrad = bool(cfg.gradient_accumulation_fusion) and enabled(GROUPED_WGRAD_ACCUMULATION_ENV)
        self.wgrad_gemms = self.accumulate_wgrad and enabled(EXPERT_WGRAD_GEMMS_ENV)
        # one [E, N, K] storage per linear, so the grouped GEMMs view the weights instead of stacking them per call
        for name in ("linear_fc1", "linear_fc2"):
            co_locate([getattr(e, name).weight for e in self.local_experts])

    def extra_repr(self) -> str:
        return f"num_local_experts={self.num_local_experts}, impl={self.impl!r}"

    # ---- path choice -----------------------------------------------------------------------------------------------

    def _sequential_reason(self, x: torch.Tensor) -> str | None:
        """Why this forward cannot run the grouped GEMMs (None when it can)."""
        if self.impl == "sequential":
            return "impl='sequential'"
        fc1, fc2 = self._linear_types
        modules = []
        for expert in self.local_experts:
            if type(expert.linear_fc1) is not fc1 or type(expert.linear_fc2) is not fc2:
                return "its expert linears were replaced after the build (e.g. LoRA adapters)"
            modules += (expert, expert.linear_fc1, expert.linear_fc2)
        for m in modules:
            if m._forward_hooks or m._forward_pre_hooks_with_kwargs or m._backward_hooks or m._backward_pre_hooks:
                return "its expert modules carry forward / keyword / backward hooks the grouped path would skip"
            if getattr(m, "gtp_remat_size", 1) > 1:
                return "its expert weights are GTP-sharded (gtp_weight_remat_size > 1)"
        w1, w2 = self.local_experts[0].linear_fc1.weight, self.local_experts[0].linear_fc2.weight
        if not grouped_mm_supported(x.device, x.dtype):
            return f"torch grouped_mm does not run {x.dtype} on {x.device.type}"
        if (w1.dtype, w1.device, w2.dtype, w2.device) != (x.dtype, x.device, x.dtype, x.device):
            return f"the expert weights ({w1.dtype} on {w1.device}) differ from the tokens ({x.dtype} on {x.device})"
        if not _aligned((*w1.shape, *w2.shape), x.dtype):
            return f"weight shapes {tuple(w1.shape)} / {tuple(w2.shape)} break grouped_mm's 16-byte stride rule"
        return None

    def _run_pre_hooks(self) -> None:
        """The expert modules' plain forward pre-hooks (megatron DDP's wait for the parameter all-gather under
        ``overlap_param_gather``): their ``forward`` is not called on the grouped path."""
        for expert in self.local_experts:
            for m in (expert, expert.linear_fc1, expert.linear_fc2):
                for hook in tuple(m._forward_pre_hooks.values()):
                    if hook(m, ()) is not None:
                        raise RuntimeError(f"TorchGroupedMLP: a forward pre-hook on {type(m).__name__} rewrites its "
                                           "input, which the grouped GEMM cannot apply; build with "
                                           "moe_grouped_gemm=False")

    # ---- forward ---------------------------------------------------------------------------------------------------

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """``permuted_local_hidden_states``: ``[T, H]`` rows sorted by local expert; ``tokens_per_expert``: ``[E]``
        counts summing to ``T`` (host or device); ``permuted_probs``: ``[T]`` router probs. Returns
        ``(output [T, H], None)`` like ``SequentialMLP``."""
        x, probs = permuted_local_hidden_states, permuted_probs
        reason = self._sequential_reason(x)
        if reason is not None:
            if self.impl == "grouped_mm":
                raise RuntimeError(f"TorchGroupedMLP(impl='grouped_mm') cannot run: {reason}")
            _log_once(f"megatron-glm5 MoE experts: TorchGroupedMLP runs SequentialMLP's per-expert loop ({reason})")
            return super().forward(x, tokens_per_expert, probs)
        _log_once(f"megatron-glm5 MoE experts: torch grouped_mm ({x.dtype}, {x.device.type})")
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale the input, then probs of 1
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        self._run_pre_hooks()
        offs, empty = _offsets(tokens_per_expert, x.device)
        w1 = [e.linear_fc1.weight for e in self.local_experts]
        w2 = [e.linear_fc2.weight for e in self.local_experts]
        zk, acc = self.zero_groups_kernel, self.accumulate_wgrad
        # the row ends for the backward's per-expert weight-gradient GEMMs, or None for the grouped GEMM
        ends = per_expert_row_ends(tokens_per_expert, offs, x.shape[0], len(w1)) if self.wgrad_gemms else None
        h = grouped_linear(x, w1, offs, empty, zk, acc, ends)  # [T, 2F/etp]
        if self.activation_recompute:  # "moe_act" in recompute_modules: as TEGroupedMLP
            # fp8=None: megatron-core's CheckpointWithoutOutput treats any non-None value, False included, as fp8
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            a = self.activation_checkpoint.checkpoint(self._activation, h, probs)
            y = grouped_linear(a, w2, offs, empty, zk, acc, ends)
            self.activation_checkpoint.discard_output_and_register_recompute(y)
        else:
            y = grouped_linear(self._activation(h, probs), w2, offs, empty, zk, acc, ends)  # [T, H]
        return y, None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """megatron-core ``MLP.forward``'s activation with ``per_token_scale=probs`` (``transformer/mlp.py``), without
        bias: the fused weighted SwiGLU / quick-GEGLU under ``bias_activation_fusion``, else the GLU with its clamp
        and linear offset, times the probs, cast back to ``h``'s dtype."""
        cfg = self.config
        if cfg.bias_activation_fusion:
            if cfg.activation_func == F.silu:  # the fused Triton kernel unless MEGATRON_GLM5_FUSED_SWIGLU=0
                impl = weighted_bias_swiglu_impl if self.fused_swiglu else fused_bias_swiglu.weighted_bias_swiglu_impl
                return impl(h, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store)
            return weighted_bias_quick_geglu_impl(h, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store,
                                                  cfg.glu_linear_offset, cfg.activation_func_clamp_value)
        if cfg.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            if (limit := cfg.activation_func_clamp_value) is not None:
                gate = gate.clamp(min=None, max=limit)
                up = up.clamp(min=-limit, max=limit)
            a = cfg.activation_func(gate) * (up + cfg.glu_linear_offset)
        else:
            a = cfg.activation_func(h)
        return (a * probs.unsqueeze(-1)).to(a.dtype)


def _offsets(tokens_per_expert: torch.Tensor, device: torch.device):
    """(int32 row ends on ``device``, zero-token experts). Host counts (megatron-core's dispatchers) are summed on the
    host and copied from pinned memory without a stream sync; device counts stay on the device (no host sync)."""
    offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    if tokens_per_expert.device.type == "cpu":
        empty = tuple(i for i, c in enumerate(tokens_per_expert.tolist()) if c == 0)
        if device.type == "cuda":
            offs = offs.pin_memory().to(device, non_blocking=True)
        return offs, empty
    return offs.to(device), tokens_per_expert.to(device) == 0
