"""Which fused kernels replace torch / megatron-core elementwise code in the model, and their switches, in one place.

Each is on by default unless marked experimental (measured on the H200: issue 23, ``scripts/bench/RESULTS_step.md``).
Each falls back to the path it replaces on any input it does not take (CPU tensors, other dtypes, megatron-core's
bias / FP8-store / CPU-offload variants), so turning one on never changes what runs on the CPU. Each switch is an
environment variable read when a module or block spec is built (``0`` or ``1``; anything else is refused):

* ``MEGATRON_GLM5_FUSED_RMSNORM`` - :class:`megatron_glm5.providers.TorchNorm`'s RMSNorm as one Triton kernel each way
  (:mod:`megatron_glm5.kernels.rms_norm`; same numerics up to rare one-ulp flips).
* ``MEGATRON_GLM5_FUSED_SWIGLU`` - megatron-core ``MLP``'s fused SwiGLU (dense MLP, shared and routed experts, the
  routing-probability-weighted form) and :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP`'s, as one Triton
  kernel each way (:mod:`megatron_glm5.kernels.swiglu`): the numerics of megatron-core's compiled ``jit_fuser`` path,
  without needing ``torch.compile``. Routed into megatron-core through :func:`megatron_glm5.compat.route_mlp_swiglu`.
* ``MEGATRON_GLM5_FUSED_GRAD_NORM`` - megatron-core's gradient norm without apex / TE (``local_multi_tensor_l2_norm``:
  one torch kernel and one host sync per gradient tensor, 162 syncs per step of the GLM-5 slice) as torch's foreach
  norm, left on the device (:func:`multi_tensor_l2_norm`; megatron-core reads the total once, as before). Routed
  through :func:`megatron_glm5.compat.route_grad_norm`; apex's and TE's kernels are left alone.
* ``MEGATRON_GLM5_FUSED_MULTI_TENSOR_SCALE`` - megatron-core's multi-tensor scale without apex / TE
  (``local_multi_tensor_scale``: ``dst.copy_(src * scale)``, a product into a temporary and a copy per tensor), used
  for the gradient clip and the fp16 main -> model parameter copies, as torch's foreach ops (:func:`multi_tensor_scale`,
  bitwise equal). Routed through :func:`megatron_glm5.compat.route_multi_tensor_scale`. bf16 training's main -> model
  copies do not use it: megatron-core copies them one ``copy_`` per tensor, and one foreach copy instead was measured
  no faster (issue 23, round 8).
* ``MEGATRON_GLM5_DEVICE_GRAD_CLIP`` - with the gradient norm above, megatron-core's gradient
  norm stays on the device (:func:`megatron_glm5.optim_fusions.grad_norm_on_device`: without apex / TE it ends in a
  host read) and the clip scales the gradients with a kernel that reads the coefficient on the device and writes
  nothing when it is not below one (:mod:`megatron_glm5.kernels.grad_clip`): the host queues the clip and the
  optimizer step while the norm is computed. The clipped gradients are megatron-core's host path's: the same fp32
  squared norm, its square root in double (Python's ``pow`` there, which is within one ulp of the correctly rounded
  root), the coefficient rounded to fp32 as its Python float is (equal for all of 200000 sampled norms, and the norm
  too once rounded to fp32 as Megatron-LM's log does). The norm is returned as a one-element fp64 tensor, as
  megatron-core's tensor branch does with TE. Alone it did not measurably gain (issue 23 round 9: the host's own
  work after the norm outlasted the norm on the GPU); on by default since round 15 with the deferred checks below,
  which keep the host ahead there.
  Routed through :func:`megatron_glm5.compat.route_device_grad_clip`.
* ``MEGATRON_GLM5_DEFERRED_GRAD_CHECKS`` (on since issue 23 round 15; with the device clip: GLM-5 slice step 419.9
  -> 414.0 ms on one H200, losses identical) - megatron-core's DDP
  gradient checks (Megatron-LM's default ``--check-for-nan-in-loss-and-grad``: each bucket's local gradient norm
  tested on the host, so the host waits for the whole backward at its end) decided on host copies of the same norms
  just before the optimizer's step, by megatron-core's own check (:mod:`megatron_glm5.deferred_grad_checks`): a NaN
  or Inf gradient still raises megatron-core's error before any parameter changes, and the host queues the
  optimizer's preparation while the backward still runs. Over several data-parallel ranks one small all-reduce
  (on a side stream) tells every rank whether any rank's norms were NaN / Inf, and all of them stop before their
  step (megatron-core's check leaves the other ranks waiting in the gradient collective). Only where the gradient
  collective spans the whole job (one process, or pure data parallelism: with tensor, pipeline or expert
  parallelism a NaN also travels outside that group), in rerun mode ``disabled`` (``--rerun-mode disabled``), with
  one distributed-optimizer instance and no optimizer CUDA graph; elsewhere megatron-core's check runs as it is.
  Under Megatron-LM's default rerun mode, ``validate_results`` (where megatron-core decides a re-run rather than
  raising), the NaN / Inf checks of an initial run (the loss checks, the bucket checks) are instead replayed in order
  when ``should_run_forward_backward`` starts, megatron-core's decision point: one host wait per step. With
  ``MEGATRON_GLM5_DEVICE_GRAD_CLIP`` the optimizer phase then has no host sync left (issue 23, round 9: the host's
  work there is GPU idle time). The forward loss checks of Megatron-LM's ``loss_func`` (NaN and Inf, one host sync
  each per micro-batch) are decided at the same point once the gradient checks are deferred, before them and with the
  same error; over several ranks their flags ride on the gradient checks'
  all-reduced one. Routed through :func:`megatron_glm5.compat.route_deferred_grad_checks`,
  :func:`megatron_glm5.compat.route_deferred_loss_checks` and :func:`megatron_glm5.compat.route_rerun_decision`.
* ``MEGATRON_GLM5_CACHED_ROUTER_WALKS`` - megatron-core's two per-step walks over every module after the backward
  (router expert-bias update, temporary-tensor reset) over the router modules only, found once
  (:mod:`megatron_glm5.finalize_walks`; megatron-core's own functions, same result). H200, GLM-5 slice: 2.95 -> 0.69
  ms of host time per step, at a point where the GPU has nothing queued. Routed through
  :func:`megatron_glm5.compat.route_finalize_walks`.
* ``MEGATRON_GLM5_MASK_RANGES_KERNEL`` - the dense attention mask's per-row key ranges
  (:mod:`megatron_glm5.dsa.masks`) in one Triton pass (:mod:`megatron_glm5.kernels.mask_ranges`) instead of about 25
  torch kernels per micro-batch; element for element equal to the torch passes. H200: 56 vs 1148 us per
  ``[1, 8192, 8192]`` bool mask, 147 vs 4343 at 16K; the GLM-5 slice's step 464.4 -> 462.0 ms. Read at each call.
* ``MEGATRON_GLM5_FUSED_ROPE`` - the ``tilelang`` attention's four RoPE + concatenations (query, latent keys, indexer
  query and key) as one Triton kernel each way (:mod:`megatron_glm5.kernels.rope_cat`, :func:`rope_cat`; bitwise
  equal to the torch expressions on the GPU).
* ``MEGATRON_GLM5_FUSED_MOE_PERMUTE`` - megatron-core's
  un-fused MoE token permutation (the all-gather dispatcher's ``permute`` / ``unpermute``) with the sums as
  gathers (:mod:`megatron_glm5.kernels.moe_permute`): no atomic adds, fp32 sums, deterministic. Routed through
  :func:`megatron_glm5.compat.route_moe_permute`.
* ``MEGATRON_GLM5_MOE_DEVICE_COUNTS`` - with the MoE permutation above, megatron-core's all-gather dispatcher without
  its two host syncs per MoE layer where every expert is local and every token has exactly ``topk`` experts
  (:func:`megatron_glm5.moe_dispatch.dispatch_postprocess`: ``tokens_per_expert`` stays on the device). Routed through
  :func:`megatron_glm5.compat.route_dispatch_postprocess`.
* ``MEGATRON_GLM5_ZERO_GROUPS_KERNEL`` - with device token counts,
  :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP` zeroes the zero-token experts' weight gradients with a
  Triton kernel that writes only their slices (:mod:`megatron_glm5.kernels.zero_groups`) instead of a masked pass
  over every expert's gradient. H200: 62.9 vs 1055.9 us per ``[16, 4096, 6144]`` gradient; the GLM-5 slice's step
  512.1 -> 501.4 ms.
* ``MEGATRON_GLM5_GROUPED_SPARSE_MLA`` - the ``tilelang`` attention's sparse MLA at 16 heads per rank with
  one kernel program per 4 neighbouring queries over the union of their top-k sets
  (:mod:`megatron_glm5.kernels.index_groups`; the backward too where the sets share enough keys, measured per call
  without a host sync). H200, forward + backward with the ping-pong forward: 1.02x / 1.05x / 1.66x at 16K on
  random sets and with 50 / 90 % of each set in a shared recency window, 0.98x / 1.03x / 1.60x at 64K; the GLM-5
  slice's step 486.3 -> 483.2 ms (a randomly initialised indexer: few shared keys). On since the kernel, backend
  and RL GPU tests passed with it (issue 22, third session), for calls of up to 64K query tokens
  (``index_groups.GROUPED_MAX_TOKENS``, raised from 16K in the fourth session): a trained indexer's sets were not
  measured, nor longer calls (the union build grows faster than the kernels: 3.8 ms at 64K, 12.4 at 128K).
* ``MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION`` - megatron-core's
  ``gradient_accumulation_fusion`` without apex: the linear layers' weight-gradient GEMM adds its fp32 result into
  ``main_grad`` (:data:`megatron_glm5.optim_fusions.WGRAD_ACCUMULATION`, through
  :func:`megatron_glm5.compat.route_wgrad_accumulation`). Takes effect where the run asks for the fusion (Megatron-LM's
  default; ``--no-gradient-accumulation-fusion`` still turns it off; the Python API's ``RuntimePolicy`` asks for it
  only with apex, since it needs DDP's ``main_grad`` on every weight).
* ``MEGATRON_GLM5_GROUPED_WGRAD_ACCUMULATION`` - with
  ``gradient_accumulation_fusion`` and DDP's ``main_grad`` on every expert weight,
  :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP` adds each grouped weight gradient into the experts'
  ``main_grad`` in one Triton launch that skips the zero-token experts
  (:mod:`megatron_glm5.kernels.grouped_wgrad_accum`; its oracle, DDP's per-expert ``add_``, is bitwise the same),
  instead of handing DDP's hook one bf16 gradient per expert (16 adds per grouped GEMM, after a zeroing pass).
  H200: 979.7 vs 1540.3 us per ``[16, 4096, 6144]`` gradient, 493.2 vs 808.4 per ``[16, 6144, 2048]``; the GLM-5
  slice's step 476.5 -> 475.4 ms (within its noise).
* ``MEGATRON_GLM5_EXPERT_WGRAD_GEMMS`` - with the accumulation above,
  :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP` computes each expert's weight gradient with its own GEMM
  whose epilogue adds the fp32 product into ``main_grad`` (what megatron-core's linear layers do under
  ``gradient_accumulation_fusion``), instead of the grouped GEMM's bf16 gradient plus the add; the row ends reach
  the host by a pinned copy in the forward, which the backward waits for (no sync in the forward; under recompute
  the wait is on just-queued work), or from host counts directly; at least 4096 mean rows per expert
  (``PER_EXPERT_WGRAD_MIN_MEAN_ROWS``, the one measured point), refused under CUDA graph capture. H200, 16 experts
  x ~4096 rows: 4.87 vs 5.61 ms per
  ``[16, 4096, 6144]`` gradient, 2.81 vs 2.77 per ``[16, 6144, 2048]``; the GLM-5 slice's step -6.5 ms by the median
  (459.9 vs 466.4) in one call, 467.1 vs 471.1 (50 iterations) in another. The fp32 sum is also more accurate (no
  bf16 rounding of the gradient).
* ``MEGATRON_GLM5_SPLIT_RECOMPUTE`` - with ``mlp_chunks_for_training > 1`` under full recompute, a layer's recompute
  split at the attention / MLP boundary (:mod:`megatron_glm5.core.split_recompute`): the MLP half is backpropagated
  in chunks from its kept input before the attention half is recomputed, so the backward's peak is the larger half's
  instead of their sum and the MLP is not computed a third time; one more hidden-state-sized tensor per layer is kept
  from the forward to the backward per micro-batch in flight (offloaded with the layer inputs when activation offload
  is on; under pipeline parallelism the split is used only with offload). Not a kernel: the schedule of a recompute.
* ``MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH`` - with the split recompute, each call runs at most one MLP chunk per
  ``split_recompute.MIN_CHUNK_TOKENS`` (16384) tokens, in its first pass too (mHC layers run that pass whole, as
  before): short sequences, which fit anyway, then do not pay for small chunk GEMMs. H200, GLM-5 slice, full
  recompute, 4 chunks: +9.1 / +3.4 / +1.5 % over no chunks at 16K / 32K / 64K before, -0.2 / +0.2 / +0.1 % with it
  (+3.5 / +3.2 / +1.9 % with activation offload); 458752 tokens still train. Not under expert parallelism (an expert
  group's ranks must agree).
* ``MEGATRON_GLM5_KEY_BLOCK_DKV`` - the sparse-MLA backward forms dKV by key blocks instead of fp32 atomics where
  that measured faster (``kernels.sparse_mla_dkv.key_blocks_pay``: at most 16 heads and 8K tokens per rank, or past
  8K a call whose dense work, bounded in the forward by ``kernels.key_block_work``, is at most
  ``KEY_BLOCKS_MAX_DENSE_PER_SPARSE`` times the selected pairs (4.8 on GLM-5's latent, 4.5 on GLM-5.3-Flash's NoPE
  one); no attention target; no float atomics, deterministic by construction). Backward 2.04x / 1.67x / 1.20x the
  atomic one on 4K / 8K / 16K-token sequences (H200, 16 heads); GLM-5 slice step 413.2 ms, 1.56x megatron-core's
  kernel path in the same run.
* ``MEGATRON_GLM5_FUSED_ADAM`` - megatron-core's torch-fallback Adam
  (no TE / apex ``FusedAdam``) with torch's ``fused=True`` (:func:`megatron_glm5.optim_fusions.use_fused_adam`,
  through :func:`megatron_glm5.compat.route_fused_adam`).
* ``MEGATRON_GLM5_ADAM_MODEL_COPY`` - with the fused Adam above, megatron-core's mixed-precision optimizer
  (``Float16OptimizerWithFloat16Params``) steps AdamW with one Triton kernel per parameter group that also writes the
  bf16 model parameters, instead of torch's fused AdamW followed by one ``copy_`` per parameter
  (:mod:`megatron_glm5.adam_model_copy`, :mod:`megatron_glm5.kernels.fused_adamw`: torch's fused AdamW arithmetic,
  operation for operation, checked against torch's kernel on the device before its first step). Bit for bit torch's
  step and copies (H200 GPU tests; the step bench's 20 losses equal); 1.45x torch's AdamW plus copies at 336 M
  parameters, GLM-5 slice step 410.4 -> 407.5 ms. Routed through :func:`megatron_glm5.compat.route_adam_model_copy`.

Measured on the GLM-5 slice (issue 23, ``scripts/bench/RESULTS_step.md``).

The DSA kernels' own experimental options are not model fusions and are read at each call instead (through
:func:`megatron_glm5.kernels._common.env_switch`: unset or empty keeps the module default), so that a benchmark
variant can set them: ``MEGATRON_GLM5_PP_OPTIONS`` (:func:`megatron_glm5.kernels.sparse_mla_fwd.pp_options`),
``MEGATRON_GLM5_LOGITS_OVERLAP`` and ``MEGATRON_GLM5_INDEXER_FUSED_HIST`` (:mod:`megatron_glm5.kernels.indexer_topk`).
"""

from __future__ import annotations

import logging
import os

import torch

from megatron_glm5 import adam_model_copy, compat, deferred_grad_checks, finalize_walks
from megatron_glm5.kernels.moe_permute import (
    expert_rows,
    moe_permute_supported,
    permute_tokens,
    sorted_token_indices,
    unpermute_tokens,
)
from megatron_glm5.kernels.rope_cat import rope_cat_reference, rope_cat_supported
from megatron_glm5.kernels.rope_cat import rope_cat as _rope_cat_kernel
from megatron_glm5.kernels.swiglu import swiglu, swiglu_supported, weighted_swiglu
from megatron_glm5.moe_dispatch import dispatch_postprocess
from megatron_glm5.kernels.grad_clip import scale_below_one
from megatron_glm5.optim_fusions import WGRAD_ACCUMULATION, grad_norm_on_device, use_fused_adam

FUSED_RMSNORM_ENV = "MEGATRON_GLM5_FUSED_RMSNORM"
FUSED_SWIGLU_ENV = "MEGATRON_GLM5_FUSED_SWIGLU"
FUSED_MOE_PERMUTE_ENV = "MEGATRON_GLM5_FUSED_MOE_PERMUTE"
FUSED_GRAD_NORM_ENV = "MEGATRON_GLM5_FUSED_GRAD_NORM"
FUSED_ROPE_ENV = "MEGATRON_GLM5_FUSED_ROPE"
FUSED_MULTI_TENSOR_SCALE_ENV = "MEGATRON_GLM5_FUSED_MULTI_TENSOR_SCALE"
MASK_RANGES_KERNEL_ENV = "MEGATRON_GLM5_MASK_RANGES_KERNEL"
DEVICE_GRAD_CLIP_ENV = "MEGATRON_GLM5_DEVICE_GRAD_CLIP"
CACHED_ROUTER_WALKS_ENV = "MEGATRON_GLM5_CACHED_ROUTER_WALKS"
DEFERRED_GRAD_CHECKS_ENV = "MEGATRON_GLM5_DEFERRED_GRAD_CHECKS"
FUSED_WGRAD_ENV = "MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION"
FUSED_ADAM_ENV = "MEGATRON_GLM5_FUSED_ADAM"
ADAM_MODEL_COPY_ENV = "MEGATRON_GLM5_ADAM_MODEL_COPY"
MOE_DEVICE_COUNTS_ENV = "MEGATRON_GLM5_MOE_DEVICE_COUNTS"
ZERO_GROUPS_KERNEL_ENV = "MEGATRON_GLM5_ZERO_GROUPS_KERNEL"
GROUPED_SPARSE_MLA_ENV = "MEGATRON_GLM5_GROUPED_SPARSE_MLA"
GROUPED_WGRAD_ACCUMULATION_ENV = "MEGATRON_GLM5_GROUPED_WGRAD_ACCUMULATION"
EXPERT_WGRAD_GEMMS_ENV = "MEGATRON_GLM5_EXPERT_WGRAD_GEMMS"
SPLIT_RECOMPUTE_ENV = "MEGATRON_GLM5_SPLIT_RECOMPUTE"
MLP_CHUNKS_BY_LENGTH_ENV = "MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH"
KEY_BLOCK_DKV_ENV = "MEGATRON_GLM5_KEY_BLOCK_DKV"
_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()
_DEFAULTS = {FUSED_RMSNORM_ENV: "1", FUSED_SWIGLU_ENV: "1", FUSED_MOE_PERMUTE_ENV: "1", FUSED_GRAD_NORM_ENV: "1",
             FUSED_ROPE_ENV: "1", FUSED_WGRAD_ENV: "1", FUSED_ADAM_ENV: "1", MOE_DEVICE_COUNTS_ENV: "1",
             ZERO_GROUPS_KERNEL_ENV: "1", GROUPED_SPARSE_MLA_ENV: "1", GROUPED_WGRAD_ACCUMULATION_ENV: "1",
             SPLIT_RECOMPUTE_ENV: "1", MLP_CHUNKS_BY_LENGTH_ENV: "1", FUSED_MULTI_TENSOR_SCALE_ENV: "1",
             MASK_RANGES_KERNEL_ENV: "1", DEVICE_GRAD_CLIP_ENV: "1", CACHED_ROUTER_WALKS_ENV: "1",
             DEFERRED_GRAD_CHECKS_ENV: "1", ADAM_MODEL_COPY_ENV: "1",
             EXPERT_WGRAD_GEMMS_ENV: "1", KEY_BLOCK_DKV_ENV: "1"}


def enabled(env: str) -> bool:
    """A fusion's switch: its default (module docstring) unless the variable says ``0`` or ``1``."""
    value = os.environ.get(env, _DEFAULTS[env]).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{env}={value!r}: expected 0 (torch / megatron-core path) or 1 (fused kernel); "
                         f"default {_DEFAULTS[env]}")
    return value == "1"


def _rows(input: torch.Tensor) -> torch.Tensor | None:
    if input.dim() not in (2, 3):
        return None
    return input.reshape(-1, input.shape[-1])


def rope_cat(x: torch.Tensor, rest: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rope_first: bool,
             out_dtype: torch.dtype | None = None, fused: bool = False) -> torch.Tensor:
    """``cat([rope(x), rest])`` (``rope_first``) or ``cat([rest, rope(x)])`` in ``out_dtype``: the Triton kernel when
    ``fused`` (the caller's ``MEGATRON_GLM5_FUSED_ROPE``, read when it was built) and it takes the tensors, else the
    torch expressions."""
    if fused and rope_cat_supported(x, rest, cos):
        return _rope_cat_kernel(x, rest, cos, sin, rope_first=rope_first, out_dtype=out_dtype)
    return rope_cat_reference(x, rest, cos, sin, rope_first=rope_first, out_dtype=out_dtype)


def bias_swiglu_impl(input: torch.Tensor, bias, fp8_input_store: bool = False, cpu_offload_input: bool = False):
    """megatron-core's ``bias_swiglu_impl`` (same signature and result): the fused kernel where it applies."""
    if bias is None and not fp8_input_store and not cpu_offload_input:
        y = _rows(input)
        if y is not None and swiglu_supported(y):
            out = swiglu(y)
            return out if input.dim() == 2 else out.view(input.shape[0], input.shape[1], -1)
    from megatron.core.fusions import fused_bias_swiglu

    return fused_bias_swiglu.bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)


def weighted_bias_swiglu_impl(input: torch.Tensor, bias, weights: torch.Tensor, fp8_input_store: bool = False):
    """megatron-core's ``weighted_bias_swiglu_impl`` (``weights [rows, 1]``, the routing probabilities): the fused
    kernel where it applies."""
    if bias is None and not fp8_input_store:
        y = _rows(input)
        if y is not None and weights.numel() == y.shape[0] and swiglu_supported(y, w := weights.reshape(-1, 1)):
            out = weighted_swiglu(y, w)
            return out if input.dim() == 2 else out.view(input.shape[0], input.shape[1], -1)
    from megatron.core.fusions import fused_bias_swiglu

    return fused_bias_swiglu.weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs=None, num_out_tokens: int | None = None,
            fused: bool = False, drop_and_pad: bool = False, tokens_per_expert=None, align_size: int = 0):
    """megatron-core's ``moe_utils.permute`` (same signature and results): the gather-sum kernels where they apply
    (no probabilities, no drop-and-pad, not TE's fused path)."""
    if (probs is None and not fused and not drop_and_pad and num_out_tokens is not None and routing_map.dim() == 2
            and moe_permute_supported(tokens)):
        rows = expert_rows(routing_map)
        sorted_indices = sorted_token_indices(rows, int(num_out_tokens))
        return permute_tokens(tokens, sorted_indices, rows), None, sorted_indices, None, tokens_per_expert
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.permute(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad, tokens_per_expert,
                             align_size)


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape, probs=None,
              routing_map=None, fused: bool = False, drop_and_pad: bool = False, pad_offsets=None):
    """megatron-core's ``moe_utils.unpermute`` (same signature and result): the gather-sum kernel where it applies
    (the routing map given, no probabilities, no drop-and-pad, not TE's fused path)."""
    if (probs is None and routing_map is not None and not fused and not drop_and_pad and pad_offsets is None
            and routing_map.dim() == 2 and tuple(restore_shape) == (routing_map.shape[0], permuted_tokens.shape[-1])
            and moe_permute_supported(permuted_tokens)):
        return unpermute_tokens(permuted_tokens, sorted_indices, expert_rows(routing_map))
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.unpermute(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused,
                               drop_and_pad, pad_offsets)


def multi_tensor_l2_norm(chunk_size: int, noop_flag, tensor_lists, per_tensor: bool = False, *args):
    """megatron-core's ``local_multi_tensor_l2_norm`` (``amp_C.multi_tensor_l2norm``'s contract: the L2 norm of all
    tensors of ``tensor_lists[0]`` as a one-element fp32 tensor, and no per-tensor norms) without a host sync."""
    tensors = list(tensor_lists[0])
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    total = torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True)
    return total.float().reshape(1), None


def multi_tensor_scale(chunk_size: int, noop_flag, tensor_lists, scale: float | torch.Tensor) -> None:
    """megatron-core's ``local_multi_tensor_scale`` (``amp_C.multi_tensor_scale``'s contract: ``dst = src * scale``
    cast to ``dst``'s dtype, for ``tensor_lists = [srcs, dsts]``; ``noop_flag`` unused, as there) with torch's foreach
    ops and the same result bit for bit: in place (the gradient clip) one ``_foreach_mul_``; a copy at scale 1 (the
    main -> model parameters: ``src * 1`` is ``src``) one casting ``_foreach_copy_``; otherwise both. ``scale``: a
    Python number (megatron-core's callers), or a one-element fp32 tensor (``multi_tensor_scale_tensor``'s contract:
    never read on the host). Lists that alias one another only in part take the per-pair loop, whose order the result
    then depends on."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(())  # the foreach ops take a tensor scale as 0-dim
    n = min(len(src), len(dst))  # zip's pairing, as the fallback
    src, dst = src[:n], dst[:n]
    if not n:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif {id(t) for t in src} & {id(t) for t in dst}:
        for s, d in zip(src, dst):
            d.copy_(s * scale)
    elif not isinstance(scale, torch.Tensor) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def clip_scale_tensor(chunk_size: int, noop_flag, tensor_lists, scale: torch.Tensor) -> None:
    """``multi_tensor_scale_tensor`` for megatron-core's gradient clip, its only caller: the coefficient there is
    clamped to at most one, so the gradients are scaled in place only where it is below one (NaN: not at all, as
    megatron-core's host path), with the coefficient never read on the host (:mod:`megatron_glm5.kernels.grad_clip`).
    Lists that are not the same tensors in place take :func:`multi_tensor_scale`."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if len(src) == len(dst) and all(s is d for s, d in zip(src, dst)):
        scale_below_one(dst, scale)
    else:
        multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)


def install_fusions() -> dict[str, bool]:
    """Route megatron-core's MLP SwiGLU, gradient-norm fallback, MoE permutation, weight-gradient accumulation and
    torch-fallback Adam through this module (each unless its switch says ``0``); called by
    :func:`megatron_glm5.core.mla_spec.prepare_runtime` before either GLM family builds a layer spec. Returns what
    is routed (a routing, once installed, stays for the process)."""
    if enabled(FUSED_SWIGLU_ENV):
        compat.route_mlp_swiglu(bias_swiglu_impl, weighted_bias_swiglu_impl)
    if enabled(FUSED_GRAD_NORM_ENV):
        compat.route_grad_norm(multi_tensor_l2_norm)
    if enabled(FUSED_MULTI_TENSOR_SCALE_ENV):
        compat.route_multi_tensor_scale(multi_tensor_scale)
    if enabled(FUSED_MOE_PERMUTE_ENV):
        compat.route_moe_permute(permute, unpermute)
        if enabled(MOE_DEVICE_COUNTS_ENV):
            compat.route_dispatch_postprocess(dispatch_postprocess)
    if enabled(FUSED_WGRAD_ENV):
        compat.route_wgrad_accumulation(WGRAD_ACCUMULATION)
    if enabled(FUSED_ADAM_ENV):
        compat.route_fused_adam(use_fused_adam)
        if enabled(ADAM_MODEL_COPY_ENV):
            compat.route_adam_model_copy(adam_model_copy.step_with_model_copies)
    if enabled(DEVICE_GRAD_CLIP_ENV) and enabled(FUSED_GRAD_NORM_ENV):
        compat.route_device_grad_clip(grad_norm_on_device, clip_scale_tensor)
    if enabled(DEFERRED_GRAD_CHECKS_ENV):
        compat.route_deferred_grad_checks(deferred_grad_checks.check_grads_deferred,
                                          deferred_grad_checks.before_optimizer_step)
        compat.route_deferred_loss_checks(deferred_grad_checks.validate_result_deferred)
        compat.route_rerun_decision(deferred_grad_checks.before_rerun_decision)
    if enabled(CACHED_ROUTER_WALKS_ENV):
        compat.route_finalize_walks(finalize_walks.update_router_expert_bias,
                                    finalize_walks.reset_model_temporary_tensors, finalize_walks.model_changed)
    routed = {"swiglu": compat.mlp_swiglu_routed(), "moe_permute": compat.moe_permute_routed(),
              "grad_norm": compat.grad_norm_routed(), "multi_tensor_scale": compat.multi_tensor_scale_routed(),
              "wgrad_accumulation": compat.wgrad_accumulation_routed(),
              "adam": compat.fused_adam_routed(), "adam_model_copy": compat.adam_model_copy_routed(),
              "device_grad_clip": compat.device_grad_clip_routed(),
              "deferred_grad_checks": compat.deferred_grad_checks_routed(),
              "deferred_loss_checks": compat.deferred_loss_checks_routed(),
              "rerun_decision": compat.rerun_decision_routed(),
              "router_walks": compat.finalize_walks_routed(),
              "moe_device_counts": compat.dispatch_postprocess_routed()}
    own = {"RMSNorm": enabled(FUSED_RMSNORM_ENV), "RoPE": enabled(FUSED_ROPE_ENV)}
    message = ("megatron-glm5 fusions (Triton kernels where Triton runs): "
               + ", ".join(f"{k} {'fused' if v else 'torch'}" for k, v in own.items()) + ", "
               + ", ".join(f"{k} {'fused' if v else 'megatron-core'}" for k, v in routed.items()))
    if message not in _logged:
        _logged.add(message)
        _log.info(message)
    return routed
