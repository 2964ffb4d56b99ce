"""Zeroing the empty groups' slices of a grouped weight gradient (:mod:`megatron_glm5.kernels.zero_groups`) against
its oracle (``masked_fill_``), on CPU in Triton's interpreter: no group, some and all groups empty, a group size that
is not a multiple of the block, bf16 and fp32, the other groups' values untouched bit for bit; through
``grouped_linear``'s backward with a zero-token expert (device counts) the same weight gradients as the masked pass; a
mutation (the flag's test inverted) is caught; the kernel compiles to an sm_90 cubin."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_checks import compile_sm90, mutant_env, passed, run_in_interpreter

_SCRIPT = textwrap.dedent('''
    import torch
    from tests.triton_checks import kernel_module

    k = kernel_module("zero_groups")  # or the mutation check's changed copy
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((5, 7, 3), (4, 4096 + 13), (3, 2, 4096)):
            for flags in ([0] * shape[0], [1] * shape[0], [i % 2 for i in range(shape[0])]):
                dw = torch.randn(shape, generator=g).to(dtype)
                empty = torch.tensor(flags, dtype=torch.bool)
                assert k.zero_empty_groups_supported(dw, empty)
                ours = k.zero_empty_groups(dw.clone(), empty)
                ref = k.zero_empty_groups_reference(dw.clone(), empty)
                assert torch.equal(ours, ref), (dtype, shape, flags)
                assert torch.equal(ours[~empty], dw[~empty])  # the others untouched
                print(dtype, shape, flags, "ok")
    # what it does not take falls back to the oracle: a non-contiguous gradient
    dw = torch.randn(4, 6, 5).transpose(1, 2)
    empty = torch.tensor([True, False, False, True])
    assert not k.zero_empty_groups_supported(dw, empty)
    assert torch.equal(k.zero_empty_groups(dw.clone(), empty), k.zero_empty_groups_reference(dw.clone(), empty))
    print("OK")
''')

_GROUPED = textwrap.dedent('''
    import torch
    from megatron_glm5.moe.grouped_experts import grouped_linear

    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 0])  # two zero-token experts
    x = torch.randn(int(counts.sum()), 12, generator=g)
    w = [torch.randn(8, 12, generator=g).requires_grad_() for _ in range(4)]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    grads = []
    for zero_kernel in (False, True):
        y = grouped_linear(x, w, offs, counts == 0, zero_kernel)
        grads.append(torch.autograd.grad((y * y).sum(), w))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert grads[1][1].abs().max() == 0 and grads[1][3].abs().max() == 0
    print("OK")
''')


def test_zero_groups_matches_the_oracle_in_triton_interpreter():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_SCRIPT))


def test_an_inverted_flag_is_caught(tmp_path):
    pytest.importorskip("triton")
    r = run_in_interpreter(_SCRIPT, **mutant_env(tmp_path, "zero_groups", "tl.load(EMPTY + group) != 0",
                                                 "tl.load(EMPTY + group) == 0"))
    assert r.returncode != 0 and "AssertionError" in r.stderr


def test_grouped_linear_backward_with_the_kernel():
    pytest.importorskip("triton")
    import torch

    from megatron_glm5.moe.grouped_experts import grouped_mm_supported

    if not grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("torch grouped_mm does not run float32 on this CPU")
    assert passed(run_in_interpreter(_GROUPED))


def test_zero_groups_compiles_for_sm90():
    pytest.importorskip("triton")
    from megatron_glm5.kernels import zero_groups

    kernel = zero_groups._triton()
    compile_sm90(kernel, {"DW": "*bf16", "EMPTY": "*u8", "per_group": "i32"}, {"BLOCK": zero_groups.BLOCK})
