"""A dense mask's per-row key ranges in one Triton pass (:mod:`megatron_glm5.kernels.mask_ranges`) against its oracle
(the torch passes :mod:`megatron_glm5.dsa.masks` uses), on CPU in Triton's interpreter: causal, document and padding
masks (bool and additive float, a broadcast batch, strided views, a length that is not a multiple of the block), the
refused patterns (a future key, a gap) flagged alike; through ``key_ranges`` with the switch on; a mutation (the
causal check dropped) is caught; the kernel compiles to an sm_90 cubin."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_checks import compile_sm90, mutant_env, passed, run_in_interpreter

_SCRIPT = textwrap.dedent('''
    import torch
    from tests.triton_checks import kernel_module

    k = kernel_module("mask_ranges")  # or the mutation check's changed copy
    k.BLOCK = 16  # several column steps per row at test sizes

    def causal(s):
        return torch.ones(s, s, dtype=torch.bool).triu(1)

    cases = {}
    for s in (5, 37):
        docs = causal(s).expand(2, s, s).clone()
        docs[0, 17 % s:, :17 % s] = True  # a second document
        docs[1, :, :3] = True  # left padding: rows 0-2 allow nothing
        cases[f"docs{s}"] = docs
        cases[f"broadcast{s}"] = causal(s)[None]
        cases[f"additive{s}"] = torch.where(docs, float("-inf"), 0.0).to(torch.bfloat16)
        cases[f"strided{s}"] = causal(2 * s)[None, ::2, ::2]  # every other row and key
        future = docs.clone()
        future[0, 1, 2] = False  # row 1 also allows key 2: one run, but past the query
        cases[f"future{s}"] = future
        gap = causal(s)[None].clone()
        gap[0, s - 1, 1] = True  # two runs of keys
        cases[f"gap{s}"] = gap
    nan = torch.zeros(1, 6, 6)
    nan[0, 2, 0] = float("nan")  # not blocked, as in torch (mask < 0 is False)
    nan[0] = nan[0].masked_fill(causal(6), -1.0)
    cases["nan"] = nan
    for name, mask in cases.items():
        assert k.mask_ranges_supported(mask), name
        got, want = k.mask_ranges(mask), k.mask_ranges_reference(mask)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (name, a, b)
        print(name, "ok" if bool(want[2]) else "refused alike")
    assert not bool(k.mask_ranges(cases["future5"])[2]) and not bool(k.mask_ranges(cases["gap37"])[2])
    print("OK")
''')

_KEY_RANGES = textwrap.dedent('''
    import os
    import torch
    from megatron_glm5.dsa import masks

    s = 33
    docs = torch.ones(s, s, dtype=torch.bool).triu(1).expand(2, 1, s, s).clone()
    docs[0, :, 20:, :20] = True
    os.environ["MEGATRON_GLM5_MASK_RANGES_KERNEL"] = "0"
    want = masks._ranges(docs, s, 2)
    os.environ["MEGATRON_GLM5_MASK_RANGES_KERNEL"] = "1"
    got = masks._ranges(docs, s, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    print("OK")
''')


def test_mask_ranges_match_the_oracle_in_triton_interpreter():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_SCRIPT))


def test_key_ranges_with_the_kernel_switched_on():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_KEY_RANGES))


def test_a_dropped_causal_check_is_caught(tmp_path):
    pytest.importorskip("triton")
    r = run_in_interpreter(_SCRIPT, **mutant_env(tmp_path, "mask_ranges", "(hi - lo + 1 == n) & (hi <= t)",
                                                 "(hi - lo + 1 == n)"))
    assert r.returncode != 0 and "AssertionError" in r.stderr


@pytest.mark.parametrize("dtype", ["*u8", "*bf16", "*fp32"])
def test_mask_ranges_compiles_for_sm90(dtype):
    pytest.importorskip("triton")
    from megatron_glm5.kernels import mask_ranges

    compile_sm90(mask_ranges._triton(),
                 {"MASK": dtype, "STARTS": "*i64", "ENDS": "*i64", "BAD": "*u8", "S": "i32", "stride_b": "i64",
                  "stride_r": "i64", "stride_c": "i64"},
                 {"IS_FLOAT": dtype != "*u8", "BLOCK": mask_ranges.BLOCK})
