"""MoE token permutation with gather sums (:mod:`megatron_glm5.kernels.moe_permute`) and its routing into
megatron-core's token dispatcher (:mod:`megatron_glm5.fusions`, ``MEGATRON_GLM5_FUSED_MOE_PERMUTE``, on by default),
on CPU.

* :func:`expert_rows` / :func:`sorted_token_indices` reproduce megatron-core's ``permute`` order exactly (random
  routing maps, tokens routed nowhere, experts with no token).
* The gather-sum kernel against its fp32 oracle in Triton's interpreter (fp32 within 1e-6 of the scale, bf16 within
  a few ulps: the interpreter rounds differently from the GPU).
* Routed: ``permute`` / ``unpermute`` as the all-gather dispatcher calls them give megatron-core's outputs and
  gradients (fp32: within 1e-6; the sums only change order), and the kernels ran.
* The kernel compiles to an sm_90 cubin here; CPU tensors without the interpreter keep megatron-core's functions.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from megatron_glm5.kernels.moe_permute import expert_rows, gather_sum_reference, sorted_token_indices
from tests.triton_checks import compile_sm90, mutant_env, passed, run_in_interpreter


def _routing(tokens: int, experts: int, topk: int, seed: int, nowhere: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    m = torch.zeros(tokens, experts, dtype=torch.bool)
    m.scatter_(1, scores.topk(topk, dim=1).indices, True)
    m[:nowhere] = False  # tokens routed to none of this rank's experts (EP > 1)
    return m


@pytest.mark.parametrize("tokens,experts,topk,nowhere", [(50, 8, 2, 0), (33, 16, 8, 5), (7, 4, 1, 7), (64, 3, 3, 0)])
def test_rows_and_sorted_indices_match_megatron_permute(tokens, experts, topk, nowhere):
    from megatron.core.transformer.moe import moe_utils

    m = _routing(tokens, experts, topk, tokens + experts, nowhere)
    n = int(m.sum())
    x = torch.randn(tokens, 4)
    permuted, _, sorted_indices, _, _ = moe_utils.permute(x, m, num_out_tokens=n)
    rows = expert_rows(m)
    assert rows.dtype == torch.int32 and rows.shape == m.shape
    assert torch.equal(sorted_token_indices(rows, n), sorted_indices)
    assert torch.equal((rows >= 0), m) and sorted(rows[m].tolist()) == list(range(n))
    # each row holds its token: rows[t, e] points at a copy of x[t]
    for t, e in m.nonzero().tolist()[:20]:
        assert torch.equal(permuted[rows[t, e]], x[t])
    # the oracle of the sum side: megatron-core's unpermute in fp32
    y = torch.randn(n, 4, dtype=torch.float64)
    ref = moe_utils.unpermute(y, sorted_indices, restore_shape=(tokens, 4), routing_map=m)
    assert torch.allclose(gather_sum_reference(y, rows), ref, rtol=0, atol=1e-12)


_KERNEL = textwrap.dedent('''
    import torch
    from tests.triton_checks import kernel_module

    k = kernel_module("moe_permute")  # or the mutation check's changed copy

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    torch.manual_seed(0)
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 0.03)):
        for tokens, experts, topk, hidden, nowhere in ((40, 8, 2, 48, 3), (9, 16, 8, 3000, 0), (5, 2, 2, 16, 5)):
            scores = torch.rand(tokens, experts)
            m = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, 1).indices, True)
            m[:nowhere] = False
            rows = k.expert_rows(m)
            n = int(m.sum())
            src = (torch.randn(max(n, 1), hidden) * 3).to(dtype)[:n]
            assert k.moe_permute_supported(src if n else torch.zeros(1, hidden, dtype=dtype))
            out, ref = k.gather_sum(src, rows), k.gather_sum_reference(src, rows)
            assert out.shape == ref.shape == (tokens, hidden) and out.dtype == dtype
            if nowhere:
                assert out[:nowhere].abs().max() == 0, "a token routed nowhere must sum to zero"
            err = rel(out, ref) if n else 0.0
            print(dtype, tokens, experts, topk, hidden, nowhere, err)
            assert err < bound, (dtype, tokens, experts, hidden, err)
    print("OK")
''')

_ROUTED = textwrap.dedent('''
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron_glm5 import fusions
    from megatron_glm5.kernels import moe_permute as k

    calls = []
    real = k.gather_sum
    k.gather_sum = lambda *a: (calls.append(1), real(*a))[1]

    assert fusions.install_fusions()["moe_permute"]
    assert token_dispatcher.permute is fusions.permute and token_dispatcher.unpermute is fusions.unpermute
    torch.manual_seed(0)
    tokens, experts, topk, hidden = 24, 6, 2, 40
    scores = torch.rand(tokens, experts)
    m = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, 1).indices, True)
    m[:3] = False
    n = int(m.sum())
    x = torch.randn(tokens, hidden)
    w = torch.randn(n, hidden)  # stands in for the experts: permuted rows scaled elementwise

    def run(permute, unpermute):
        xi = x.clone().requires_grad_()
        permuted, probs, sorted_indices, pad, tpe = permute(xi, m, num_out_tokens=n, fused=False)
        assert probs is None and pad is None
        out = unpermute(permuted * w, sorted_indices, restore_shape=x.shape, routing_map=m, fused=False)
        (out * out.flip(0)).sum().backward()
        return permuted, sorted_indices, out, xi.grad

    ours = run(token_dispatcher.permute, token_dispatcher.unpermute)
    assert len(calls) == 2, calls  # the unpermute forward and the permute backward
    mcore = run(moe_utils.permute, moe_utils.unpermute)
    assert torch.equal(ours[0], mcore[0]) and torch.equal(ours[1], mcore[1])
    for name, a, b in zip(("out", "dx"), ours[2:], mcore[2:]):
        err = float((a - b).abs().max() / b.abs().max())
        print(name, err)
        assert err < 1e-6, (name, err)
    # what the kernel does not take goes to megatron-core: probabilities, drop-and-pad
    p = torch.rand(tokens, experts)
    a = fusions.permute(x, m, probs=p, num_out_tokens=n)
    b = moe_utils.permute(x, m, probs=p, num_out_tokens=n)
    assert all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))
    assert len(calls) == 2, calls
    print("OK")
''')


def _run(script: str, **env: str):
    return run_in_interpreter(script, MEGATRON_GLM5_FUSED_MOE_PERMUTE="1", **env)


def test_gather_sum_matches_the_oracle_in_triton_interpreter():
    pytest.importorskip("triton")
    assert passed(_run(_KERNEL))


def test_dispatcher_permutation_routed_to_the_kernel():
    pytest.importorskip("triton")
    assert passed(_run(_ROUTED))


def test_a_skipped_row_is_caught(tmp_path):
    """Mutation check: a kernel that sums only each token's first expert column fails the oracle bound."""
    pytest.importorskip("triton")
    r = _run(_KERNEL, **mutant_env(tmp_path, "moe_permute", "for e in range(0, experts):", "for e in range(0, 1):"))
    assert r.returncode != 0 and "AssertionError" in r.stderr


def test_on_by_default_and_cpu_tensors_keep_megatron_core(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from megatron_glm5 import fusions

    monkeypatch.delenv(fusions.FUSED_MOE_PERMUTE_ENV, raising=False)
    assert fusions.enabled(fusions.FUSED_MOE_PERMUTE_ENV)  # measured on the H200 (issue 23, round 3)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = _routing(12, 4, 2, 0)
    x = torch.randn(12, 8)
    a = fusions.permute(x, m, num_out_tokens=24)
    b = moe_utils.permute(x, m, num_out_tokens=24)
    assert a[1] is None and b[1] is None and torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


def test_gather_sum_compiles_for_sm90():
    pytest.importorskip("triton")
    from megatron_glm5.kernels import moe_permute

    kernel = moe_permute._triton()
    sig = {n: "i32" if n in ("stride_src", "stride_out", "hidden", "experts") else "*bf16" for n in kernel.arg_names}
    sig["ROWS"] = "*i32"
    compile_sm90(kernel, sig, {"BLOCK": 1024})
