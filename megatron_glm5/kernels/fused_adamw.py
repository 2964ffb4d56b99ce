"""AdamW on fp32 main parameters that also writes their 16-bit model copies, in one pass (Triton).

Why: megatron-core's mixed-precision optimizer steps torch's AdamW on the fp32 main parameters, then copies every
main parameter into its bf16 model parameter (``_copy_main_params_to_model_params``: without apex one ``copy_`` per
tensor, 161 launches and 3.6 ms per step of the GLM-5 slice in issue 23's round-9 profile). The copy reads all main
parameters again (4 bytes each, about 10 GB on the slice) right after Adam wrote them. Here the Adam pass writes the
16-bit copy from the register it already holds: 2 bytes more per element in Adam, 6 fewer in all.

The arithmetic is torch's fused CUDA AdamW (``FusedAdamMathFunctor`` with ``ADAM_MODE::ADAMW`` in
``ATen/native/cuda/fused_adam_utils.cuh``, torch >= 2.8: the moment updates as ``fma``), in fp32, operation for
operation, as its sm_90 code does it (checked in torch 2.14's ``libtorch_cuda.so`` with ``cuobjdump``: the weight
decay ``param * -(lr * wd) + param`` is one ``FFMA``, the divisions and the square root are IEEE-rounded):

    bc1 = 1 - powf(beta1, step);  bc2_sqrt = sqrtf(1 - powf(beta2, step));  step_size = lr / bc1
    param = fma(param, -(lr * wd), param)            (where wd, rounded to fp32, is not 0)
    m = fma(m, beta1, fma(g, -beta1, g));  v = fma(v, beta2, fma(g * g, -beta2, g * g))
    param = param - (m * step_size) / (sqrtf(v) / bc2_sqrt + eps)

with ``lr``, ``beta1``, ``beta2``, ``wd``, ``eps`` rounded to fp32 first and ``step`` the parameter's fp32 step
count after torch's increment (:func:`adamw_step` increments it as torch does, ``_foreach_add_(steps, 1)``). Each
``fma``, division and square root is rounded once (``tl.fma``, ``tl.div_rn``, ``tl.sqrt_rn``); ``powf`` is
libdevice's, which nvcc links for CUDA's ``powf`` too. The 16-bit copy is the updated parameter rounded to nearest
even (``cvt.rn``, as torch's ``copy_``).

Contract (:func:`adamw_step`): per parameter, ``param``, ``grad``, ``exp_avg``, ``exp_avg_sq``: fp32, contiguous,
one shape, on one device; ``step``: a one-element fp32 tensor there; ``model`` (optional): a contiguous bf16 / fp16
tensor of the same shape, or None. Updates ``param``, ``exp_avg``, ``exp_avg_sq`` and ``step`` in place and writes
``model`` where given; leaves ``grad`` alone (no grad scaler: bf16 / fp32 training). Oracle:
:func:`adamw_step_reference` (the same operations in torch, each rounded to fp32 once: an ``fma`` through float64,
whose product of two fp32 values is exact). The bitwise check against torch's own ``_fused_adamw_`` followed by
``copy_`` is ``tests/gpu/test_fused_adamw_gpu.py``; the CPU tests run the kernel in Triton's interpreter (whose
``fma`` rounds twice, whose bf16 cast truncates and which has no libdevice ``pow``: the kernel takes other paths
there, within a few ulps) and check the compiled sm_90 code's rounding (``tests/test_fused_adamw.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from megatron_glm5.kernels._common import triton_kernels, triton_runs_on

BLOCK = 2048  # elements per program
_MODEL_DTYPES = (torch.bfloat16, torch.float16)
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, pointers and sizes) -> (tensors, chunks)
_MAX_TABLES = 32


@dataclass(frozen=True)
class AdamWHyper:
    """One parameter group's scalars, as torch's fused kernel takes them (Python floats; rounded to fp32 there)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def fp32(self) -> dict[str, float]:
        """The kernel's scalars: each rounded to fp32 (``static_cast<float>`` of the double), and ``lr * wd`` as the
        fp32 product of the two (one ``FMUL`` in torch's kernel)."""
        f = {k: float(np.float32(v)) for k, v in (("lr", self.lr), ("beta1", self.beta1), ("beta2", self.beta2),
                                                  ("eps", self.eps), ("wd", self.weight_decay))}
        f["lr_wd"] = float(np.float32(f["lr"]) * np.float32(f["wd"]))
        return f


def _fma32(a: torch.Tensor, b, c) -> torch.Tensor:
    """``fma(a, b, c)`` in fp32, rounded once (the product of two fp32 values is exact in float64; the sum is rounded
    to float64 and then to fp32, which equals one rounding but in rare double-rounding ties)."""
    a64 = a.double()
    b64 = b.double() if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=torch.float64)
    c64 = c.double() if isinstance(c, torch.Tensor) else torch.tensor(c, dtype=torch.float64)
    return (a64 * b64 + c64).float()


def adamw_step_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                         steps: Sequence[torch.Tensor], models: Sequence[torch.Tensor | None],
                         hyper: AdamWHyper) -> None:
    """The oracle: the module docstring's operations in torch, in place, each rounded to fp32 once."""
    h = hyper.fp32()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    for p, g, m, v, step, model in zip(params, grads, exp_avgs, exp_avg_sqs, steps, models):
        step.add_(1)
        s = step.reshape(()).float().item()
        bc1 = f32(1.0) - f32(float(np.power(np.float32(h["beta1"]), np.float32(s))))
        bc2_sqrt = torch.sqrt(f32(1.0) - f32(float(np.power(np.float32(h["beta2"]), np.float32(s)))))
        step_size = f32(h["lr"]) / bc1
        x = p.float()
        if h["wd"] != 0.0:
            x = _fma32(x, -h["lr_wd"], x)
        gf = g.float()
        m.copy_(_fma32(m, h["beta1"], _fma32(gf, -h["beta1"], gf)))
        g2 = gf * gf
        v.copy_(_fma32(v, h["beta2"], _fma32(g2, -h["beta2"], g2)))
        denom = torch.sqrt(v) / bc2_sqrt + f32(h["eps"])
        x = x - (m * step_size) / denom
        p.copy_(x)
        if model is not None:
            model.copy_(x)


def adamw_step_supported(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                         steps: Sequence[torch.Tensor], models: Sequence[torch.Tensor | None]) -> bool:
    """Whether the kernel takes these tensors (the module docstring's contract)."""
    if not params or _triton() is None:
        return False
    device = params[0].device
    if not triton_runs_on(params[0]):
        return False
    for p, g, m, v, s, model in zip(params, grads, exp_avgs, exp_avg_sqs, steps, models, strict=True):
        for t in (p, g, m, v):
            if t.dtype != torch.float32 or t.device != device or not t.is_contiguous() or t.shape != p.shape:
                return False
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != device:
            return False
        if model is not None and (model.dtype not in _MODEL_DTYPES or model.device != device
                                  or not model.is_contiguous() or model.shape != p.shape):
            return False
    dtypes = {m.dtype for m in models if m is not None}
    return len(dtypes) <= 1


def _tables(params, grads, exp_avgs, exp_avg_sqs, steps, models) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 6]`` int64 addresses per tensor (param, grad, exp_avg, exp_avg_sq, step, model or 0) and ``[C, 3]``
    int64 chunks (tensor, first element, element count), on the parameters' device. Cached per list of addresses
    and sizes: the main parameters, their state and DDP's gradient buffers do not move."""
    device = params[0].device
    addresses = tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), s.data_ptr(),
                       0 if model is None else model.data_ptr())
                      for p, g, m, v, s, model in zip(params, grads, exp_avgs, exp_avg_sqs, steps, models))
    key = (str(device), addresses, tuple(p.numel() for p in params))
    cached = _TABLES.get(key)
    if cached is not None:
        return cached
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    sizes = torch.tensor(key[2], dtype=torch.int64)
    per = (sizes + BLOCK - 1) // BLOCK
    which = torch.repeat_interleave(torch.arange(len(params)), per)
    first = torch.repeat_interleave(per.cumsum(0) - per, per)
    start = (torch.arange(int(per.sum())) - first) * BLOCK
    chunks = torch.stack((which, start, torch.clamp(sizes[which] - start, max=BLOCK)), dim=1)
    tensors = torch.tensor(addresses, dtype=torch.int64).reshape(len(params), 6)
    if device.type == "cuda":  # from pinned memory: no host sync, even on the first call
        chunks, tensors = chunks.pin_memory(), tensors.pin_memory()
    cached = _TABLES[key] = (tensors.to(device, non_blocking=True), chunks.to(device, non_blocking=True))
    return cached


def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor],
               models: Sequence[torch.Tensor | None], hyper: AdamWHyper, *, checked: bool = False) -> None:
    """One AdamW step of one parameter group with the 16-bit copies written (module docstring): the kernel where it
    takes the tensors, else the oracle. Empty parameters count a step and are otherwise skipped, as in torch.
    ``checked``: the caller has seen :func:`adamw_step_supported` say yes for these tensors (skips its checks)."""
    if not params:
        return
    if not checked and not adamw_step_supported(params, grads, exp_avgs, exp_avg_sqs, steps, models):
        adamw_step_reference(params, grads, exp_avgs, exp_avg_sqs, steps, models, hyper)
        return
    torch._foreach_add_(list(steps), 1)  # every step count, as torch's (its kernel then skips empty tensors)
    keep = [i for i, p in enumerate(params) if p.numel()]
    params, grads, exp_avgs, exp_avg_sqs, steps, models = (
        [seq[i] for i in keep] for seq in (params, grads, exp_avgs, exp_avg_sqs, steps, models))
    if not params:
        return
    tensors, chunks = _tables(params, grads, exp_avgs, exp_avg_sqs, steps, models)
    h = hyper.fp32()
    model_dtype = next((m.dtype for m in models if m is not None), torch.bfloat16)
    _triton()[(chunks.shape[0],)](
        tensors, chunks, h["lr"], h["beta1"], h["beta2"], h["eps"], h["lr_wd"],
        WEIGHT_DECAY=h["wd"] != 0.0, HALF=model_dtype == torch.float16, INTERPRETED=not params[0].is_cuda,
        BLOCK=BLOCK, num_warps=4)


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(TENSORS, CHUNKS, lr, beta1, beta2, eps, lr_wd, WEIGHT_DECAY: tl.constexpr,
                     HALF: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(CHUNKS + 3 * row)
        start = tl.load(CHUNKS + 3 * row + 1)
        n = tl.load(CHUNKS + 3 * row + 2)
        param = tl.load(TENSORS + 6 * t).to(tl.pointer_type(tl.float32)) + start
        grad = tl.load(TENSORS + 6 * t + 1).to(tl.pointer_type(tl.float32)) + start
        exp_avg = tl.load(TENSORS + 6 * t + 2).to(tl.pointer_type(tl.float32)) + start
        exp_avg_sq = tl.load(TENSORS + 6 * t + 3).to(tl.pointer_type(tl.float32)) + start
        step = tl.load(tl.load(TENSORS + 6 * t + 4).to(tl.pointer_type(tl.float32)))
        model_address = tl.load(TENSORS + 6 * t + 5)

        if INTERPRETED:  # the interpreter has no libdevice: an approximation (the CPU tests allow a few ulps)
            pow1 = tl.exp2(step * tl.log2(beta1 + tl.zeros([1], tl.float32)))
            pow2 = tl.exp2(step * tl.log2(beta2 + tl.zeros([1], tl.float32)))
        else:
            pow1 = tl.extra.libdevice.pow(beta1, step)
            pow2 = tl.extra.libdevice.pow(beta2, step)
        bc1 = 1.0 - pow1
        bc2_sqrt = tl.sqrt_rn(1.0 - pow2)
        step_size = tl.div_rn(lr, bc1)

        offs = tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(param + offs, mask=mask, other=0.0)
        g = tl.load(grad + offs, mask=mask, other=0.0)
        m = tl.load(exp_avg + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
        if WEIGHT_DECAY:
            p = tl.fma(p, -lr_wd, p)
        m = tl.fma(m, beta1, tl.fma(g, -beta1, g))
        g2 = g * g
        v = tl.fma(v, beta2, tl.fma(g2, -beta2, g2))
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(m * step_size, denom)
        tl.store(param + offs, p, mask=mask)
        tl.store(exp_avg + offs, m, mask=mask)
        tl.store(exp_avg_sq + offs, v, mask=mask)
        if model_address != 0:
            if HALF:
                tl.store(model_address.to(tl.pointer_type(tl.float16)) + start + offs, p.to(tl.float16), mask=mask)
            else:
                if INTERPRETED:  # the interpreter truncates fp32 -> bf16: round to nearest even by hand
                    u = p.to(tl.uint32, bitcast=True)
                    copy = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                else:  # cvt.rn.bf16.f32
                    copy = p.to(tl.bfloat16)
                tl.store(model_address.to(tl.pointer_type(tl.bfloat16)) + start + offs, copy, mask=mask)

    return adamw_kernel


__all__ = ["AdamWHyper", "BLOCK", "adamw_step", "adamw_step_reference", "adamw_step_supported"]
