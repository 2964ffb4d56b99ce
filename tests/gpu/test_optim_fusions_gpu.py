"""Weight-gradient accumulation and fused Adam (``megatron_glm5.optim_fusions``) on the GPU, at the GLM-5 slice's
shapes: the accumulated GEMM against an fp64 oracle (closer to it than megatron-core's no-apex path, which rounds the
product to bf16 before adding), bitwise reproducible, and its time against that path (printed); torch's fused AdamW
against the foreach AdamW megatron-core falls back to (same update within fp32 rounding), kept fused across
``load_state_dict``."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.optim_fusions import use_fused_adam, wgrad_gemm_accum_fp32

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens,n_in,n_out", [(8192, 6144, 2048), (8192, 2048, 6144), (8192, 6144, 576)])
def test_wgrad_accumulation_against_fp64_and_speed(tokens, n_in, n_out):
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, n_in, device="cuda", generator=g).bfloat16()
    dy = torch.randn(tokens, n_out, device="cuda", generator=g).bfloat16()
    main = torch.randn(n_out, n_in, device="cuda", generator=g) * 10
    oracle = main.double() + dy.double().t() @ x.double()
    ours = main.clone()
    wgrad_gemm_accum_fp32(x, dy, ours)
    unfused = main + (dy.t() @ x).float()  # megatron-core without apex: a bf16 weight gradient, then main_grad += it
    scale = float(oracle.abs().max())
    err_ours = float((ours.double() - oracle).abs().max()) / scale
    err_unfused = float((unfused.double() - oracle).abs().max()) / scale
    again = main.clone()
    wgrad_gemm_accum_fp32(x, dy, again)
    assert torch.equal(again, ours)
    assert err_ours < 3e-5 and err_ours < err_unfused, (err_ours, err_unfused)

    buf = main.clone()
    t_ours = do_bench(lambda: wgrad_gemm_accum_fp32(x, dy, buf))
    t_unfused = do_bench(lambda: buf.add_(dy.t() @ x))
    print(f"\nwgrad [{tokens}x{n_in}] x [{tokens}x{n_out}] -> fp32 main_grad: error {err_ours:.1e} (unfused "
          f"{err_unfused:.1e}); {t_ours:.3f} ms vs {t_unfused:.3f} ms unfused ({t_unfused / t_ours:.2f}x)")


def test_fused_adamw_matches_foreach_and_survives_load_state_dict():
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(6144, 2048), (2048,), (16, 2048, 6144), (576, 6144)]
    base = [torch.randn(s, device="cuda", generator=g) for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g) * 1e-3 for s in shapes] for _ in range(3)]

    def run(fused: bool):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)
        if fused:
            assert use_fused_adam(opt)
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
        return params, opt

    ref, ref_opt = run(False)
    ours, opt = run(True)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, ref))
    print(f"\nfused vs foreach AdamW after 3 steps: max difference {worst:.1e} of scale")
    assert worst < 1e-6
    assert all(gr["fused"] and not gr["foreach"] for gr in opt.param_groups)

    opt.load_state_dict(ref_opt.state_dict())  # a checkpoint written by the unfused optimizer
    assert all(gr["fused"] and not gr["foreach"] for gr in opt.param_groups)
    assert all(st["step"].is_cuda for st in opt.state.values())
    opt.step()  # the fused kernel accepts the loaded state

    t_fused = do_bench(opt.step)
    t_foreach = do_bench(ref_opt.step)
    n = sum(p.numel() for p in ours) / 1e6
    print(f"AdamW step over {n:.0f} M fp32 parameters: fused {t_fused:.2f} ms vs foreach {t_foreach:.2f} ms "
          f"({t_foreach / t_fused:.2f}x)")
