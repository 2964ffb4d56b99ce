"""AdamW on fp32 main parameters that also writes their 16-bit model copies, in one pass (Triton).

Why: megatron-core's mixed-precision optimizer steps torch's AdamW on the fp32 main parameters, then copies every
main parameter into its bf16 model parameter (``_copy_main_params_to_model_params``: without apex one ``copy_`` per
tensor, 161 launches and 3.6 ms per step of the GLM-5 slice in issue 23's round-9 profile). The copy reads all main
parameters again (4 bytes each, about 10 GB on the slice) right after Adam wrote them. Here the Adam pass writes the
16-bit copy from the register it already holds: 2 bytes more per element in Adam, 6 fewer in all.

The arithmetic is torch's fused CUDA AdamW (``FusedAdamMathFunctor`` with ``ADAM_MODE::ADAMW`` in
``ATen/native/cuda/fused_adam_utils.cuh``, torch >= 2.8: the moment updates as ``fma``), in fp32, operation for
operation, as its sm_90 code does it (read in torch 2.14's ``libtorch_cuda.so`` with ``cuobjdump``: the weight
decay ``param * -(lr * wd) + param`` is one ``FFMA``, the divisions and the square roots are IEEE-rounded):

    bc1 = 1 - powf(beta1, step);  bc2_sqrt = sqrtf(1 - powf(beta2, step));  step_size = lr / bc1
    param = fma(param, -(lr * wd), param)            (where wd, rounded to fp32, is not 0)
    m = fma(m, beta1, fma(g, -beta1, g));  v = fma(v, beta2, fma(g * g, -beta2, g * g))
    param = param - (m * step_size) / (sqrtf(v) / bc2_sqrt + eps)

with ``lr``, ``beta1``, ``beta2``, ``wd``, ``eps`` rounded to fp32 first and ``step`` the parameter's fp32 step
count after torch's increment (:func:`adamw_step` increments it as torch does, ``_foreach_add_(steps, 1)``). Each
``fma``, division and square root is rounded once (``tl.fma``, ``tl.div_rn``, ``tl.sqrt_rn``). ``powf`` is not
libdevice's (Triton's ``pow``: another algorithm, through ``ex2.approx.ftz``, which disagrees with CUDA's ``powf``
in the last bit at some step counts): the two powers per tensor come from torch's own ``pow`` kernel
(:func:`bias_powers`, ``std::pow(float, float)`` as in the fused kernel: one small launch per group). The 16-bit
copy is the updated parameter rounded to nearest even (``cvt.rn``, as torch's ``copy_``).

Contract (:func:`adamw_step`): per parameter, ``param``, ``grad``, ``exp_avg``, ``exp_avg_sq``: fp32, contiguous,
one shape, on one device; ``step``: a one-element fp32 tensor there; ``model`` (optional): a contiguous bf16 / fp16
tensor of the same shape, or None. Updates ``param``, ``exp_avg``, ``exp_avg_sq`` and ``step`` in place and writes
``model`` where given; leaves ``grad`` alone (no grad scaler: bf16 / fp32 training). Oracle:
:func:`adamw_step_reference` (the same operations in torch, each rounded to fp32 once: an ``fma`` through float64,
whose product of two fp32 values is exact). :func:`matches_torch` runs both the kernel and torch's
``_fused_adamw_`` on probe tensors and compares them bit for bit (the route checks each new configuration with it
before it takes a step); ``tests/gpu/test_fused_adamw_gpu.py`` does the same over steps, step counts and real
optimizers. The CPU tests run the kernel in Triton's interpreter (whose ``fma`` rounds twice and whose bf16 cast
truncates: the kernel rounds by hand there; within a few ulps of the oracle) and check the compiled sm_90 code's
rounding (``tests/test_fused_adamw.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from megatron_glm5.kernels._common import triton_kernels, triton_runs_on

BLOCK = 2048  # elements per program
_MODEL_DTYPES = (torch.bfloat16, torch.float16)
_CHUNKS: dict[tuple, torch.Tensor] = {}  # (device, sizes) -> int32 [chunks] tensor index of each program
_ADDRESSES: dict[tuple, torch.Tensor] = {}  # (device, addresses, sizes) -> int64 [T, 8] per-tensor table
_BETAS: dict[tuple, torch.Tensor] = {}  # (device, beta1, beta2) -> fp32 [1, 2] on the device
_MAX_CACHED = 8


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
    for step in steps:
        step.add_(1)
    powers = bias_powers(steps, hyper).cpu() if steps else None
    for i, (p, g, m, v, model) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, models)):
        bc1 = f32(1.0) - powers[i, 0]
        bc2_sqrt = torch.sqrt(f32(1.0) - powers[i, 1])
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


def bias_powers(steps: Sequence[torch.Tensor], hyper: AdamWHyper) -> torch.Tensor:
    """``[T, 2]`` fp32 on the steps' device: ``beta1 ** step`` and ``beta2 ** step`` per tensor (betas rounded to
    fp32), by torch's elementwise ``pow`` of two tensors, whose CUDA kernel is ``std::pow(float, float)``, the
    function torch's fused AdamW calls for its bias corrections. Two launches (the steps gathered, the power)."""
    device = steps[0].device
    h = hyper.fp32()
    key = (str(device), h["beta1"], h["beta2"])
    betas = _BETAS.get(key)
    if betas is None:
        if len(_BETAS) >= _MAX_CACHED:
            _BETAS.clear()
        betas = torch.tensor([[h["beta1"], h["beta2"]]], dtype=torch.float32)
        if device.type == "cuda":
            betas = betas.pin_memory()
        betas = _BETAS[key] = betas.to(device, non_blocking=True)
    counts = torch.cat([s.reshape(1) for s in steps]).reshape(-1, 1)
    return torch.pow(betas, counts)


def _tables(params, grads, exp_avgs, exp_avg_sqs, steps, models) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 8]`` int64 per tensor (addresses of param, grad, exp_avg, exp_avg_sq, model or 0, then the element
    count, the first chunk, whether all five addresses are 16-byte aligned) and ``[C]`` int32 chunks (the tensor of
    each program), on the parameters' device. The chunk table depends on the sizes only (it is the large one: a
    program per 2048 elements); the per-tensor table on the addresses too (DDP's buffers and the optimizer state do
    not move, so both are built once)."""
    device = params[0].device
    sizes = tuple(p.numel() for p in params)
    addresses = tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if model is None else model.data_ptr())
                      for p, g, m, v, model in zip(params, grads, exp_avgs, exp_avg_sqs, models))
    pinned = device.type == "cuda"  # from pinned memory: no host sync, even on the first call
    per = [(n + BLOCK - 1) // BLOCK for n in sizes]
    chunks = _CHUNKS.get((str(device), sizes))
    if chunks is None:
        if len(_CHUNKS) >= _MAX_CACHED:
            _CHUNKS.clear()
        rows = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(per))
        chunks = _CHUNKS[(str(device), sizes)] = (rows.pin_memory() if pinned else rows).to(device, non_blocking=True)
    key = (str(device), addresses, sizes)
    table = _ADDRESSES.get(key)
    if table is None:
        if len(_ADDRESSES) >= _MAX_CACHED:
            _ADDRESSES.clear()
        first = np.concatenate(([0], np.cumsum(per)[:-1])).tolist()
        aligned = [int(all(x % 16 == 0 for x in a)) for a in addresses]
        rows = torch.tensor([(*a, n, f, al) for a, n, f, al in zip(addresses, sizes, first, aligned)],
                            dtype=torch.int64)
        table = _ADDRESSES[key] = (rows.pin_memory() if pinned else rows).to(device, non_blocking=True)
    return table, chunks


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
    powers = bias_powers(steps, hyper)
    h = hyper.fp32()
    model_dtype = next((m.dtype for m in models if m is not None), torch.bfloat16)
    _triton()[(chunks.shape[0],)](
        tensors, chunks, powers, h["lr"], h["beta1"], h["beta2"], h["eps"], h["lr_wd"],
        WEIGHT_DECAY=h["wd"] != 0.0, HALF=model_dtype == torch.float16, INTERPRETED=not params[0].is_cuda,
        BLOCK=BLOCK, num_warps=4)


def matches_torch(device: torch.device, hyper: AdamWHyper, model_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`adamw_step` gives torch's ``_fused_adamw_`` followed by ``copy_`` bit for bit on this device and
    torch, for ``hyper`` (and its weight decay at 0): probe tensors across chunk boundaries with gradients from 1e-6
    to 1, at step counts 1..1969. One host sync."""
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [257] * 48 + [2 * BLOCK + 3]
    for wd in {hyper.weight_decay, 0.0}:
        h = AdamWHyper(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, wd)
        lists = []
        for k, n in enumerate(sizes):
            lists.append((torch.randn(n, device=device, generator=g) * 0.05,
                          torch.randn(n, device=device, generator=g) * 10.0 ** (k % 7 - 6),
                          torch.randn(n, device=device, generator=g) * 1e-3,
                          torch.rand(n, device=device, generator=g) * 1e-6,
                          torch.tensor(float(41 * k), device=device)))
        ours = [[t.clone() for t in row] for row in lists]
        theirs = [[t.clone() for t in row] for row in lists]
        models = [torch.empty(n, device=device, dtype=model_dtype) for n in sizes]
        adamw_step(*[[row[i] for row in ours] for i in range(5)], models, h)
        steps = [row[4] for row in theirs]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_([row[0] for row in theirs], [row[1] for row in theirs], [row[2] for row in theirs],
                            [row[3] for row in theirs], [], steps, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                            weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        for a, b, model in zip(ours, theirs, models):  # bits, not values: -0.0 and NaN payloads count too
            if not all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b)):
                return False
            if not torch.equal(model.view(torch.int16), b[0].to(model_dtype).view(torch.int16)):
                return False
    return True


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _update(param, grad, exp_avg, exp_avg_sq, model, offs, n, has_model, step_size, bc2_sqrt, beta1, beta2, eps,
                lr_wd, WEIGHT_DECAY: tl.constexpr, MASKED: tl.constexpr, HALF: tl.constexpr,
                INTERPRETED: tl.constexpr):
        mask = offs < n if MASKED else None
        p = tl.load(param + offs, mask=mask)
        g = tl.load(grad + offs, mask=mask)
        m = tl.load(exp_avg + offs, mask=mask)
        v = tl.load(exp_avg_sq + offs, mask=mask)
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
        if has_model:
            if HALF:
                tl.store(model + offs, p.to(tl.float16), mask=mask)
            elif INTERPRETED:  # the interpreter truncates fp32 -> bf16: round to nearest even by hand
                u = p.to(tl.uint32, bitcast=True)
                tl.store(model + offs, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16,
                                                                                                bitcast=True),
                         mask=mask)
            else:  # cvt.rn.bf16.f32
                tl.store(model + offs, p.to(tl.bfloat16), mask=mask)

    globals()["update"] = _update  # a module global: neither Triton's compiler nor its interpreter sees closures

    @triton.jit
    def adamw_kernel(TENSORS, CHUNKS, POWERS, lr, beta1, beta2, eps, lr_wd, WEIGHT_DECAY: tl.constexpr,
                     HALF: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(CHUNKS + row).to(tl.int64)
        start = (row - tl.load(TENSORS + 8 * t + 6)).to(tl.int64) * BLOCK
        n = tl.load(TENSORS + 8 * t + 5) - start  # elements of this program's chunk (BLOCK but in the last)
        param = tl.load(TENSORS + 8 * t).to(tl.pointer_type(tl.float32)) + start
        grad = tl.load(TENSORS + 8 * t + 1).to(tl.pointer_type(tl.float32)) + start
        exp_avg = tl.load(TENSORS + 8 * t + 2).to(tl.pointer_type(tl.float32)) + start
        exp_avg_sq = tl.load(TENSORS + 8 * t + 3).to(tl.pointer_type(tl.float32)) + start
        model_address = tl.load(TENSORS + 8 * t + 4)
        model = model_address.to(tl.pointer_type(tl.float16 if HALF else tl.bfloat16)) + start
        has_model = model_address != 0

        bc1 = 1.0 - tl.load(POWERS + 2 * t)
        bc2_sqrt = tl.sqrt_rn(1.0 - tl.load(POWERS + 2 * t + 1))
        step_size = tl.div_rn(lr, bc1)
        offs = tl.arange(0, BLOCK)
        # A full chunk of a tensor whose addresses are 16-byte aligned (the host's flag): no mask, alignment hints,
        # 16-byte accesses. Otherwise masked scalar accesses (a mask of unknown alignment keeps them scalar anyway).
        if (n >= BLOCK) & (tl.load(TENSORS + 8 * t + 7) != 0):
            update(tl.multiple_of(param, 16), tl.multiple_of(grad, 16), tl.multiple_of(exp_avg, 16),
                   tl.multiple_of(exp_avg_sq, 16), tl.multiple_of(model, 16), offs, n, has_model, step_size,
                   bc2_sqrt, beta1, beta2, eps, lr_wd, WEIGHT_DECAY, False, HALF, INTERPRETED)
        else:
            update(param, grad, exp_avg, exp_avg_sq, model, offs, n, has_model, step_size, bc2_sqrt, beta1, beta2,
                   eps, lr_wd, WEIGHT_DECAY, True, HALF, INTERPRETED)

    return adamw_kernel


__all__ = ["AdamWHyper", "BLOCK", "adamw_step", "adamw_step_reference", "adamw_step_supported", "bias_powers",
           "matches_torch"]
