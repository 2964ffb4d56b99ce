"""The routed experts' weight gradients into fp32 ``main_grad`` on the GPU, the two ways ``TorchGroupedMLP`` can
(issue 23, round 9; GLM-5 slice shapes: 16 experts, 65536 routed rows of about 4096 per expert):

* A (round 8's default, ``MEGATRON_GLM5_EXPERT_WGRAD_GEMMS=0``): one grouped GEMM writes the bf16 ``[E, N, K]``
  gradient, then ``kernels.grouped_wgrad_accum`` adds it into each expert's ``main_grad``;
* B (the default since round 9): one ``torch.addmm(main_e, dy_e^T, x_e, out_dtype=float32, out=main_e)`` per expert,
  the fp32 product added in cuBLAS's epilogue (``optim_fusions.wgrad_gemm_accum_fp32``).

Prints a markdown table: CUDA-event ms per call (B's host launch time in brackets) and each one's largest
difference from the product in fp32 torch ops, relative to its largest entry.
Usage: ``python3 scripts/bench/bench_expert_wgrad.py`` (``scripts/gpu_checks.sh OUT expert_wgrad``).
"""
import time

import torch
import torch.nn.functional as F

from megatron_glm5.kernels.grouped_wgrad_accum import accumulate_groups

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
EXPERTS, ROWS = 16, 65536
SHAPES = (("fc1", 4096, 6144), ("fc2", 6144, 2048))  # (weight, N, K) of the slice's routed experts


def expert_rows() -> list[int]:
    """About ROWS / EXPERTS rows per expert, +-80, summing to ROWS (a fixed draw)."""
    g = torch.Generator().manual_seed(1)
    jitter = torch.randint(-80, 81, (EXPERTS,), generator=g)
    jitter -= jitter.sum() // EXPERTS
    jitter[-1] -= jitter.sum()
    counts = (torch.full((EXPERTS,), ROWS // EXPERTS) + jitter).tolist()
    assert sum(counts) == ROWS
    return counts


def timed(fn, reps: int = 20) -> tuple[float, float]:
    """(CUDA-event ms per call, host ms per call) after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host


def main() -> None:
    counts = expert_rows()
    ends = torch.tensor(counts).cumsum(0)
    offs = ends.to(torch.int32).cuda()
    starts = [0, *ends.tolist()[:-1]]
    print("| weight | N x K | A: grouped GEMM + add, ms | A: grouped GEMM alone | B: GEMM per expert, ms (host ms) "
          "| B / A | largest difference from the fp32 product (relative) |")
    print("|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16) * 0.01
        main_a, main_b = torch.zeros(EXPERTS, n, k, device="cuda"), torch.zeros(EXPERTS, n, k, device="cuda")
        mains_a, mains_b = list(main_a.unbind(0)), list(main_b.unbind(0))
        empty = torch.zeros(EXPERTS, dtype=torch.bool, device="cuda")

        def grouped() -> None:
            accumulate_groups(_grouped_mm(dy.t(), x, offs=offs), mains_a, empty)

        def per_expert() -> None:
            for e, (s, c) in enumerate(zip(starts, counts)):
                torch.addmm(mains_b[e], dy[s:s + c].t(), x[s:s + c], out_dtype=torch.float32, out=mains_b[e])

        t_a, _ = timed(grouped)
        t_gemm, _ = timed(lambda: _grouped_mm(dy.t(), x, offs=offs))
        t_b, host_b = timed(per_expert)
        main_a.zero_()
        main_b.zero_()
        grouped()
        per_expert()
        exact = torch.stack([dy[s:s + c].t().float() @ x[s:s + c].float() for s, c in zip(starts, counts)])
        scale = exact.abs().max()
        err_a = ((main_a - exact).abs().max() / scale).item()
        err_b = ((main_b - exact).abs().max() / scale).item()
        print(f"| {name} | {n} x {k} | {t_a:.3f} | {t_gemm:.3f} | {t_b:.3f} ({host_b:.3f}) | {t_b / t_a:.3f} | "
              f"A {err_a:.2e}, B {err_b:.2e} |")
        del x, dy, main_a, main_b, mains_a, mains_b, exact
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
