"""The AdamW kernel that writes the 16-bit model copies (``kernels/fused_adamw.py``) against torch's own fused AdamW
followed by ``copy_``, bit for bit, on CUDA: over several steps with a changing learning rate, with and without
weight decay, across chunk boundaries; the bias corrections at step counts 1..4096; megatron-core's
``Float16OptimizerWithFloat16Params`` through the route (``adam_model_copy.py``); and the time of one step of
~0.4 G parameters against torch's fused step plus the per-tensor copies."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import adam_model_copy, compat
from megatron_glm5.kernels import fused_adamw

pytestmark = pytest.mark.gpu

SIZES = (3_000_001, 37, 1, 70_000, 4096 * 3, fused_adamw.BLOCK + 1)


def _twins(sizes=SIZES, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ours, theirs = [], []
    for i, n in enumerate(sizes):
        p = torch.randn(n, device="cuda", generator=g) * (0.02 * (i + 1))
        ours.append(torch.nn.Parameter(p.clone()))
        theirs.append(torch.nn.Parameter(p.clone()))
    return ours, theirs


def _grads(params_pair, step, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    for a, b in zip(*params_pair):
        grad = torch.randn(a.shape, device="cuda", generator=g) * scale * (10.0 ** (step % 3 - 3))
        a.grad, b.grad = grad.clone(), grad.clone()


def _state_lists(opt, params):
    st = [opt.state[p] for p in params]
    return ([p.grad for p in params], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st],
            [s["step"] for s in st])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16),
                       b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16))


@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_kernel_is_torchs_fused_adamw_and_copy_bit_for_bit(weight_decay, model_dtype):
    assert compat.fused_adamw_arithmetic_known(), torch.__version__
    ours, theirs = _twins()
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, fused=True)
    opt_ours, opt_theirs = torch.optim.AdamW(ours, **kw), torch.optim.AdamW(theirs, **kw)
    models = [torch.empty(p.shape, device="cuda", dtype=model_dtype) for p in ours]
    models[2] = None  # a parameter without a 16-bit copy
    refs = [torch.empty(p.shape, device="cuda", dtype=model_dtype) for p in theirs]
    _grads((ours, theirs), 0)
    opt_ours.step(), opt_theirs.step()  # torch creates the state on both
    for step in range(1, 8):
        _grads((ours, theirs), step)
        lr = 3e-4 * (1.0 - step / 10)
        for o in (opt_ours, opt_theirs):
            o.param_groups[0]["lr"] = lr
        opt_theirs.step()
        for r, p in zip(refs, theirs):
            r.copy_(p.detach())
        grads, m, v, s = _state_lists(opt_ours, ours)
        assert fused_adamw.adamw_step_supported([p.data for p in ours], grads, m, v, s, models)
        fused_adamw.adamw_step([p.data for p in ours], grads, m, v, s, models,
                               fused_adamw.AdamWHyper(lr, 0.9, 0.95, 1e-8, weight_decay))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            sa, sb = opt_ours.state[a], opt_theirs.state[b]
            assert _bits_equal(a.data, b.data), (step, i, (a - b).abs().max().item())
            assert _bits_equal(sa["exp_avg"], sb["exp_avg"]) and _bits_equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
            assert torch.equal(sa["step"], sb["step"]) and float(sa["step"]) == step + 1
            if models[i] is not None:
                assert _bits_equal(models[i], refs[i]), (step, i)


@pytest.mark.parametrize("betas,stride", [((0.9, 0.95), 1), ((0.9, 0.999), 4), ((0.8, 0.98), 1)])
def test_bias_corrections_at_every_step_count(betas, stride):
    """4096 one-element parameters whose states stand at steps 0, stride, 2 stride, ... (up to 16380 at 0.999, where
    the second power has not underflowed): one step each, bit for bit torch's. The powers come from torch's ``pow``
    kernel (``fused_adamw.bias_powers``): a libdevice ``powf`` differed from CUDA's at some step counts."""
    n = 4096
    ours, theirs = _twins(sizes=(1,) * n)
    kw = dict(lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.01, fused=True)
    opt_ours, opt_theirs = torch.optim.AdamW(ours, **kw), torch.optim.AdamW(theirs, **kw)
    _grads((ours, theirs), 0)
    opt_ours.step(), opt_theirs.step()
    for k, (a, b) in enumerate(zip(ours, theirs)):
        opt_ours.state[a]["step"].fill_(k * stride)
        opt_theirs.state[b]["step"].fill_(k * stride)
    _grads((ours, theirs), 1)
    opt_theirs.step()
    grads, m, v, s = _state_lists(opt_ours, ours)
    fused_adamw.adamw_step([p.data for p in ours], grads, m, v, s, [None] * n,
                           fused_adamw.AdamWHyper(1e-3, *betas, 1e-8, 0.01))
    bad = [k * stride for k, (a, b) in enumerate(zip(ours, theirs)) if not _bits_equal(a.data, b.data)]
    assert not bad, f"step counts {bad[:20]} differ"


def test_tiny_zero_and_large_gradients_and_a_parameter_without_one():
    sizes = (70_000, 4096, 33)
    ours, theirs = _twins(sizes=sizes)
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt_ours, opt_theirs = torch.optim.AdamW(ours, **kw), torch.optim.AdamW(theirs, **kw)
    _grads((ours, theirs), 0)
    opt_ours.step(), opt_theirs.step()
    g = torch.randn(sizes[0], device="cuda")
    g[::3] = 0.0
    g[1::3] *= 1e-38  # subnormal squares and products
    g[2::3] *= 1e4
    ours[0].grad, theirs[0].grad = g.clone(), g.clone()
    ours[1].grad, theirs[1].grad = torch.zeros(sizes[1], device="cuda"), torch.zeros(sizes[1], device="cuda")
    ours[2].grad = theirs[2].grad = None  # torch skips it: no step, no state change
    opt_theirs.step()
    stepped = [p for p in ours if p.grad is not None]
    grads, m, v, s = _state_lists(opt_ours, stepped)
    fused_adamw.adamw_step([p.data for p in stepped], grads, m, v, s, [None] * len(stepped),
                           fused_adamw.AdamWHyper(3e-4, 0.9, 0.95, 1e-8, 0.1))
    for a, b in zip(ours, theirs):
        assert _bits_equal(a.data, b.data)
        sa, sb = opt_ours.state[a], opt_theirs.state[b]
        assert _bits_equal(sa["exp_avg"], sb["exp_avg"]) and _bits_equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert torch.equal(sa["step"], sb["step"])


def test_self_check_matches_torch_here():
    """The route's check of a configuration (``fused_adamw.matches_torch``): true on this GPU and torch for the
    slice's betas and Megatron-LM's defaults."""
    for hyper in (fused_adamw.AdamWHyper(3e-4, 0.9, 0.95, 1e-8, 0.1), fused_adamw.AdamWHyper(1e-4, 0.9, 0.999, 1e-8,
                                                                                            0.01)):
        assert fused_adamw.matches_torch(torch.device("cuda"), hyper)
        assert fused_adamw.matches_torch(torch.device("cuda"), hyper, torch.float16)


def _megatron_optimizer(params_bf16):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    config = OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, bf16=True, adam_beta1=0.9,
                             adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0)
    groups = [{"params": params_bf16[:3], "weight_decay": 0.1}, {"params": params_bf16[3:], "weight_decay": 0.0}]
    for p in params_bf16:  # what megatron-core's DDP gives each parameter
        p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
    inner = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    opt = Float16OptimizerWithFloat16Params(inner, config, None, lambda o, config=None: None)
    inner = opt.optimizer
    for group in inner.param_groups:  # the fp32 main parameters (megatron-core swaps them in)
        group["fused"] = True
    return opt


def test_megatron_cores_step_through_the_route_is_bit_for_bit(parallel):
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as owner

    make = lambda: [torch.nn.Parameter((torch.randn(n, device="cuda", generator=torch.Generator(  # noqa: E731
        device="cuda").manual_seed(n)) * 0.02).bfloat16()) for n in SIZES]
    a_params, b_params = make(), make()
    a, b = _megatron_optimizer(a_params), _megatron_optimizer(b_params)
    calls = []
    original = compat.unpatched(owner, "step_with_ready_grads")  # megatron-core's, routed or not
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(step)
        for pa, pb in zip(a_params, b_params):
            grad = torch.randn(pa.shape, device="cuda", generator=g) * 1e-3
            pa.main_grad.copy_(grad), pb.main_grad.copy_(grad)
        for opt in (a, b):
            opt.prepare_grads()
        original(b)
        chosen = adam_model_copy.plan(a)
        calls.append(chosen is not None)
        assert adam_model_copy.step_with_model_copies(original, a)
        for pa, pb in zip(a_params, b_params):
            assert torch.equal(pa.data.view(torch.int16), pb.data.view(torch.int16)), step
        for ma, mb in zip(sum(a.fp32_from_float16_groups, []), sum(b.fp32_from_float16_groups, [])):
            assert torch.equal(ma.view(torch.int32), mb.view(torch.int32)), step
            sa, sb = a.optimizer.state[ma], b.optimizer.state[mb]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    assert calls == [False, True, True, True, True]  # the first step is torch's: it creates the state


def test_kernel_is_faster_than_fused_adamw_and_the_copies():
    from triton.testing import do_bench

    sizes = [4096 * 2048] * 40 + [4096] * 120  # 335 M parameters, 160 tensors (the slice has 161)
    ours, theirs = _twins(sizes=sizes)
    opt_ours = torch.optim.AdamW(ours, lr=1e-4, weight_decay=0.1, fused=True)
    opt_theirs = torch.optim.AdamW(theirs, lr=1e-4, weight_decay=0.1, fused=True)
    _grads((ours, theirs), 0, scale=1e-3)
    opt_ours.step(), opt_theirs.step()
    models = [torch.empty(p.shape, device="cuda", dtype=torch.bfloat16) for p in ours]
    grads, m, v, s = _state_lists(opt_ours, ours)
    data = [p.data for p in ours]
    hyper = fused_adamw.AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.1)

    def torch_step():
        opt_theirs.step()
        for model, p in zip(models, theirs):
            model.copy_(p.detach())

    ms_torch = do_bench(torch_step, warmup=5, rep=50)
    ms_ours = do_bench(lambda: fused_adamw.adamw_step(data, grads, m, v, s, models, hyper), warmup=5, rep=50)
    n = sum(sizes)
    print(f"\n[fused_adamw] {n / 1e6:.0f} M parameters: torch fused AdamW + copy_ {ms_torch:.2f} ms, "
          f"one kernel {ms_ours:.2f} ms ({ms_torch / ms_ours:.2f}x; {30 * n / ms_ours / 1e9:.2f} TB/s at 30 B/param)")
    assert ms_ours < ms_torch
