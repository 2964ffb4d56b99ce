"""Grouped-GEMM routed experts (``TorchGroupedMLP``, ``torch.nn.functional.grouped_mm``) against megatron-core's
``SequentialMLP`` on CPU, fp32.

* What torch 2.14's ``grouped_mm`` does on CPU: fp32, bf16 and fp16 (not fp64), forward and autograd, per group
  bitwise equal to a per-expert matmul, including a zero-size group.
* The experts module, with hand-made counts including zero-token experts and a rank with no tokens: output and
  gradients (tokens, probs, every weight) equal ``SequentialMLP.forward`` on the same modules. A zero-token expert's
  weight gradient is exactly zero even when the GEMM leaves that group unwritten (as on B200).
* A real tiny GLM-5.2 model (build_model, IndexShare + MTP, one expert forced to zero tokens): logits, loss and every
  gradient equal the ``SequentialMLP`` model (measured: bitwise); also with ``moe_act`` recompute.
* Weight gradients into DDP's ``main_grad``: the grouped GEMM plus one add, and one GEMM per expert (its placeholders
  one ``[N, K]`` block that megatron-core's DDP hook drops, its row ends from host counts directly, one read shared by
  fc1 and fc2, refused under CUDA graph capture, not taken below the measured mean rows or without autograd), also under
  activation recompute (``torch.utils.checkpoint`` of both kinds, ``moe_act``).
* Checkpoints: the state_dict and sharded_state_dict layouts are identical, and megatron dist checkpoints saved with
  either module load into the other with the same logits.
* Path choice: LoRA-adapted experts and hooked linears run the per-expert loop; DDP-style forward pre-hooks run on the
  grouped path; unsupported configs are refused by flag name. Selection: ``RuntimePolicy.moe_grouped_gemm`` and
  Megatron-LM's ``config.moe_grouped_gemm`` pick the module in the spec (also GLM-5.3-Flash's), logged once.
* TP=2 (expert TP 2, stride-2 gate/up shards) and EP=2 under torchrun (gloo) give the single-process
  ``SequentialMLP`` loss and gradients.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from megatron_glm5.config import RuntimeEnvironment, RuntimePolicy, parse_hf_config, resolve_policy, runtime_kwargs
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.moe import grouped_experts as ge
from megatron_glm5.moe.grouped_experts import TorchGroupedMLP, grouped_linear, grouped_mm_supported
from megatron_glm5.testing import tiny_glm52_config

SEQ = 48
SILENT = 3  # expert forced to receive no token in every MoE layer
TOL = 1e-6
VOCAB = tiny_glm52_config()["vocab_size"]


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _build(grouped: str, seed: int = 0, **policy):
    torch.manual_seed(seed)
    return build_model(parse_hf_config(tiny_glm52_config()), default_cpu_policy(moe_grouped_gemm=grouped, **policy))


def _experts(model) -> list:
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def _silence_expert(model, expert: int = SILENT) -> None:
    """The sigmoid router picks top-k on score + expert_bias: a very negative bias means no token, ever."""
    for name, m in model.named_modules():
        if name.endswith("mlp.router"):
            m.expert_bias[expert] = -1e4


def _batch(vocab: int, seed: int = 7):
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(SEQ)[None].expand(2, SEQ)


def _run(model, ids, pos):
    """(logits, loss, {param: grad}, [tokens_per_expert of each MoE forward])."""
    counts = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: counts.append(args[1].clone())) for m in _experts(model)]
    try:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            logits = model(ids, pos, None)
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits, loss.detach(), grads, counts


class _GroupedCalls:
    """Counts calls of the module's grouped_mm (which path ran)."""

    def __init__(self, monkeypatch):
        self.n = 0
        original = ge._grouped_mm

        def counted(*a, **k):
            self.n += 1
            return original(*a, **k)

        monkeypatch.setattr(ge, "_grouped_mm", counted)


def _experts_config(**overrides):
    """A bare megatron-core config for standalone routed experts (hidden 64, 8 experts x ffn 32)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, add_bias_linear=False,
              params_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
              gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
              num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
              moe_token_dispatcher_type="allgather")
    kw.update(overrides)
    return TransformerConfig(**kw)


def _standalone_experts(config, grouped: bool = True):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_glm5.providers import GLMLocalSpecProvider

    build = GLMLocalSpecProvider().grouped_mlp_modules(grouped)
    torch.manual_seed(0)
    return build(config.num_moe_experts, config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _compare_paths(experts, counts: list[int], *, scale: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Run ``experts`` with impl grouped_mm and sequential on the same inputs; max |diff| of output and grads."""
    hidden = experts.local_experts[0].linear_fc1.weight.shape[1]
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(sum(counts), hidden, generator=gen) * scale
    p0 = torch.rand(sum(counts), generator=gen)
    tokens = torch.tensor(counts)
    got = {}
    for impl in ("grouped_mm", "sequential"):
        experts.impl = impl
        experts.zero_grad(set_to_none=True)
        x, probs = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        y, bias = experts(x, tokens, probs)
        assert bias is None
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1)))
        got[impl] = {"out": y.detach(), "x": x.grad, "probs": probs.grad,
                     **{n: p.grad for n, p in experts.named_parameters()}}
    experts.impl = "auto"
    a, b = got["grouped_mm"], got["sequential"]
    assert a.keys() == b.keys()
    assert all(v is not None for v in a.values()), [k for k, v in a.items() if v is None]
    return {k: _max_diff(a[k], b[k]) for k in a}, a


# --------------------------------------------------------------------------------------------------------------------
# torch's grouped_mm on CPU
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_grouped_mm_equals_per_expert_matmul(dtype):
    assert grouped_mm_supported(torch.device("cpu"), dtype)
    counts = [5, 0, 7, 4]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=gen).to(dtype).requires_grad_(True)
    w = [torch.randn(24, 16, generator=gen).to(dtype).requires_grad_(True) for _ in counts]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_linear(x, w, offs, empty=(1,))
    want = torch.cat([xe @ we.t() for xe, we in zip(x.split(counts), w)])
    assert torch.equal(y, want)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    got = torch.autograd.grad(y, [x, *w], dy)
    ref = torch.autograd.grad(want, [x, *w], dy)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not got[2].any(), "the zero-token expert's weight gradient is zero"


def test_cpu_grouped_mm_refuses_fp64():
    assert not grouped_mm_supported(torch.device("cpu"), torch.float64)


def test_empty_group_gradients_are_zeroed_even_if_the_gemm_leaves_them_unwritten(monkeypatch):
    """B200 (pytorch#172439) returns garbage for empty groups of the weight-gradient GEMM: emulate that with NaN and
    check both forms of ``empty`` (host indices, device mask) give an exact zero."""
    original = ge._grouped_mm

    def poisoned(a, b, offs=None, **k):
        out = original(a, b, offs=offs, **k)
        if a.dim() == 2 and b.dim() == 2:  # weight gradient [E, N, K]
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(ge, "_grouped_mm", poisoned)
    counts = torch.tensor([3, 0, 5, 0])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(8, 16, requires_grad=True)
    w = [torch.randn(32, 16, requires_grad=True) for _ in range(4)]
    for empty in ((1, 3), counts == 0):
        grads = torch.autograd.grad(grouped_linear(x, w, offs, empty).sum(), w)
        assert all(torch.isfinite(g).all() for g in grads)
        assert not grads[1].any() and not grads[3].any() and grads[0].abs().sum() > 0


def _ddp_like(weights):
    """What megatron-core's DDP gives each parameter: an fp32 ``main_grad`` and the ``grad_added_to_main_grad`` flag."""
    for i, w in enumerate(weights):
        w.main_grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(100 + i))
        w.grad_added_to_main_grad = False
    return [w.main_grad.clone() for w in weights]


def test_weight_gradients_added_to_main_grad_skip_empty_groups(monkeypatch):
    """With ``accumulate`` and DDP's ``main_grad`` on every weight, the grouped weight gradient is added into each
    expert's ``main_grad`` (bitwise what DDP's hook would add from the returned gradients), the empty
    experts' slices (NaN, as a GEMM that leaves them unwritten) never reach it, the flags tell DDP to skip its add,
    and the input gradient is unchanged."""
    original = ge._grouped_mm

    def poisoned(a, b, offs=None, **k):
        out = original(a, b, offs=offs, **k)
        if a.dim() == 2 and b.dim() == 2:
            out[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")
        return out

    monkeypatch.setattr(ge, "_grouped_mm", poisoned)
    counts = torch.tensor([3, 0, 5, 0])
    offs = counts.cumsum(0).to(torch.int32)
    x0 = torch.randn(8, 16)
    for empty in ((1, 3), counts == 0):
        w = [torch.randn(32, 16, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(4)]
        x = x0.clone().requires_grad_(True)
        plain = torch.autograd.grad(grouped_linear(x, w, offs, empty).sum(), [x, *w])
        base = _ddp_like(w)
        fused_dx = torch.autograd.grad(grouped_linear(x, w, offs, empty, accumulate=True).sum(), x)[0]
        assert torch.equal(fused_dx, plain[0])
        for e, (wi, b, g) in enumerate(zip(w, base, plain[1:])):
            assert wi.grad_added_to_main_grad
            assert torch.equal(wi.main_grad, b.add(g)), f"expert {e}"
        assert torch.equal(w[1].main_grad, base[1]) and torch.equal(w[3].main_grad, base[3])


def test_per_expert_weight_gradient_gemms_add_fp32_products_into_main_grad():
    """With ``row_ends`` the weight gradients are one GEMM per expert adding into ``main_grad``
    (``wgrad_gemm_accum_fp32``, bitwise), the zero-token experts' ``main_grad`` untouched, the flags set, the input
    gradient unchanged, and the sum that of the grouped path's gradients (to fp32 rounding); the placeholders handed
    to autograd have the weights' shape and dtype. The row ends are read once per forward."""
    from megatron_glm5.optim_fusions import wgrad_gemm_accum_fp32

    counts = [3, 0, 5, 0, 2]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(counts), 16, generator=gen).requires_grad_(True)
    dy = torch.randn(sum(counts), 32, generator=gen)
    w = [torch.randn(32, 16, generator=gen).requires_grad_(True) for _ in counts]
    plain = torch.autograd.grad(grouped_linear(x, w, offs, (1, 3)), [x, *w], dy)
    base = _ddp_like(w)
    ends = ge.RowEnds(offs)
    reads = []
    read = ends.read
    ends.read = lambda: reads.append(1) or read()
    y = grouped_linear(x, w, offs, (1, 3), accumulate=True, row_ends=ends)
    got = torch.autograd.grad(y, [x, *w], dy)
    assert torch.equal(got[0], plain[0]) and reads == [1]
    assert all(g.shape == wi.shape and g.dtype == wi.dtype for g, wi in zip(got[1:], w))
    start = 0
    for e, (wi, b, c) in enumerate(zip(w, base, counts)):
        want = b.clone()
        if c:
            wgrad_gemm_accum_fp32(x[start:start + c].detach(), dy[start:start + c], want)
        assert wi.grad_added_to_main_grad and torch.equal(wi.main_grad, want), e
        torch.testing.assert_close(wi.main_grad, b + plain[1 + e], rtol=1e-6, atol=1e-6)
        start += c
    assert torch.equal(w[1].main_grad, base[1]) and torch.equal(w[3].main_grad, base[3])
    assert ge.RowEnds(offs).read() == [3, 3, 8, 8, 10]


@pytest.fixture
def per_expert_route(monkeypatch) -> list[list[int]]:
    """The per-expert weight-gradient route at these tests' few rows (``PER_EXPERT_WGRAD_MIN_MEAN_ROWS`` 1); the
    row ends of each backward pass that took it."""
    monkeypatch.setattr(ge, "PER_EXPERT_WGRAD_MIN_MEAN_ROWS", 1)
    calls: list[list[int]] = []
    original = ge._accumulate_per_expert

    def counted(dy, x, mains, ends):
        calls.append(ends)
        return original(dy, x, mains, ends)

    monkeypatch.setattr(ge, "_accumulate_per_expert", counted)
    return calls


def test_per_expert_placeholders_are_one_block_that_ddp_drops(per_expert_route):
    """The per-expert route's placeholders: autograd's accumulation node takes each as the weight's ``.grad`` without
    a copy, all E of them views of one ``[N, K]`` storage (N*K elements, not E*N*K), and megatron-core's own DDP
    hook (its closure, registered on the accumulation node as DDP does) skips its add and drops them: ``main_grad``
    holds exactly the per-expert products although the placeholders are NaN when the hook runs."""
    from types import SimpleNamespace

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    from megatron_glm5.optim_fusions import wgrad_gemm_accum_fp32

    counts = [3, 0, 5, 2]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(counts), 16, generator=gen)
    dy = torch.randn(sum(counts), 32, generator=gen)
    w = [torch.randn(32, 16, generator=gen).requires_grad_(True) for _ in counts]
    base = _ddp_like(w)
    ready = []  # overlap_grad_reduce: DDP asserts a .grad for every weight, then tells its bucket
    bucket = SimpleNamespace(register_grad_ready=lambda param, force: ready.append(param))
    ddp = SimpleNamespace(param_to_bucket_group={p: bucket for p in w}, force_all_reduce=False,
                          ddp_config=SimpleNamespace(overlap_grad_reduce=True))
    seen, accs = [], []  # accs: the accumulation nodes kept alive with their hooks, as DDP's grad_accs

    def poison(param):
        def hook(*unused):
            g = param.grad
            seen.append((g.untyped_storage().data_ptr(), g.untyped_storage().nbytes(), g.shape, g.stride()))
            g.fill_(float("nan"))
        return hook

    for p in w:
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(poison(p))  # runs first: what the accumulation node left in .grad
        acc.register_hook(DistributedDataParallel._make_backward_post_hook(ddp, p))
        accs.append(acc)
    grouped_linear(x, w, offs, (1,), accumulate=True, row_ends=ge.RowEnds(offs)).backward(dy)
    assert len(per_expert_route) == 1 and len(seen) == len(w) and sorted(map(id, ready)) == sorted(map(id, w))
    assert {s[0] for s in seen} == {seen[0][0]}, "one storage for the E placeholders"
    assert all(s[1:] == (32 * 16 * 4, w[0].shape, w[0].stride()) for s in seen), seen
    assert all(p.grad is None and p.grad_added_to_main_grad for p in w)
    start = 0
    for e, (p, b, c) in enumerate(zip(w, base, counts)):
        want = b.clone()
        if c:
            wgrad_gemm_accum_fp32(x[start:start + c], dy[start:start + c], want)
        assert torch.equal(p.main_grad, want), e
        start += c


def test_row_ends_from_host_counts_do_not_read_the_offsets(per_expert_route):
    """Host counts (a CPU tensor or ints) give the row ends directly, with no event: the device offsets are not read
    (wrong here on purpose). Host offsets still work as before; device counts are refused by ``from_counts``."""
    wrong = torch.full((4,), 99, dtype=torch.int32)
    for counts in (torch.tensor([3, 0, 5, 2]), [3, 0, 5, 2]):
        ends = ge.per_expert_row_ends(counts, wrong, 10, 4)
        assert isinstance(ends, ge.RowEnds) and ends._values is None and ends.read() == [3, 3, 8, 10]
    assert ge.RowEnds(torch.tensor([3, 3, 8, 10], dtype=torch.int32)).read() == [3, 3, 8, 10]
    with pytest.raises(ValueError, match="expected host counts"):
        ge.RowEnds.from_counts(torch.zeros(4, device="meta"))


def test_per_expert_route_is_refused_under_cuda_graph_capture(monkeypatch, per_expert_route):
    """Under capture the forward's choice refuses the per-expert route (where it would take it) with the switch to
    turn off, and so does a backward holding row ends from an uncaptured forward, before touching ``main_grad``.
    Below the mean rows and without autograd the grouped GEMM is chosen without asking. The capture check never asks
    CUDA about a CPU tensor."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("asked CUDA"))
    assert not ge._capturing(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ge._capturing(torch.device("cuda"))
    counts = torch.tensor([3, 0, 5, 2])
    offs = counts.cumsum(0).to(torch.int32)
    assert ge.per_expert_row_ends(counts, offs, 10, 4) is not None
    monkeypatch.setattr(ge, "_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="cannot be captured.*MEGATRON_GLM5_EXPERT_WGRAD_GEMMS=0"):
        ge.per_expert_row_ends(counts, offs, 10, 4)
    monkeypatch.setattr(ge, "PER_EXPERT_WGRAD_MIN_MEAN_ROWS", 3)
    assert ge.per_expert_row_ends(counts, offs, 10, 4) is None
    with torch.no_grad():
        assert ge.per_expert_row_ends(counts, offs, 12, 4) is None
    x = torch.randn(10, 16)
    w = [torch.randn(32, 16, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(4)]
    base = _ddp_like(w)
    y = grouped_linear(x, w, offs, (1,), accumulate=True, row_ends=ge.RowEnds.from_counts(counts))
    with pytest.raises(RuntimeError, match="cannot be captured"):
        torch.autograd.grad(y.sum(), w)
    assert per_expert_route == [] and all(torch.equal(p.main_grad, b) for p, b in zip(w, base))


def test_per_expert_route_from_the_measured_mean_rows_only():
    """One GEMM per expert from ``PER_EXPERT_WGRAD_MIN_MEAN_ROWS`` mean rows per expert (the measured point); below
    it, and without autograd, the grouped GEMM."""
    experts, mean = 16, ge.PER_EXPERT_WGRAD_MIN_MEAN_ROWS
    counts = torch.full((experts,), mean)
    offs = counts.cumsum(0).to(torch.int32)
    assert ge.per_expert_row_ends(counts, offs, mean * experts, experts).read() == offs.tolist()
    assert ge.per_expert_row_ends(counts, offs, mean * experts - 1, experts) is None
    with torch.no_grad():
        assert ge.per_expert_row_ends(counts, offs, mean * experts, experts) is None


def test_weight_gradients_returned_without_main_grad():
    """``accumulate`` without DDP (no ``main_grad``), or with an fp16 ``main_grad``: gradients go back to autograd."""
    counts = torch.tensor([3, 2])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(5, 16)
    w = [torch.randn(32, 16, requires_grad=True) for _ in range(2)]
    want = torch.autograd.grad(grouped_linear(x, w, offs).sum(), w)
    got = torch.autograd.grad(grouped_linear(x, w, offs, accumulate=True).sum(), w)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _ddp_like(w)
    w[1].main_grad = w[1].main_grad.half()
    got = torch.autograd.grad(grouped_linear(x, w, offs, accumulate=True).sum(), w)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and not w[0].grad_added_to_main_grad


def test_stacked_views_co_located_weights_and_copies_otherwise():
    """``co_locate`` keeps each parameter (object, attributes, values) and puts them back to back; ``stacked`` then
    views that storage (no copy; in-place updates show through) and equals ``torch.stack``. Out of order, swapped
    out (as the distributed optimizer's buffer does) or differently shaped weights get a copy."""
    w = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(3)]
    for p in w:
        p.allreduce = False
    before = [p.detach().clone() for p in w]
    ids = [id(p) for p in w]
    assert ge.co_locate(w)
    assert [id(p) for p in w] == ids and all(p.allreduce is False for p in w)
    assert all(torch.equal(p, b) for p, b in zip(w, before))
    view = ge.stacked(w)
    assert torch.equal(view, torch.stack(w)) and view.data_ptr() == w[0].data_ptr()
    with torch.no_grad():
        w[2].add_(1.0)  # an optimizer step, in place
    assert torch.equal(ge.stacked(w)[2], w[2])
    for weights in (w[::-1], w[:1] + w[2:]):  # wrong order; a gap
        copy = ge.stacked(weights)
        assert torch.equal(copy, torch.stack(weights)) and copy.data_ptr() != w[0].data_ptr()
    w[1].data = w[1].detach().clone()  # moved out of the block
    copy = ge.stacked(w)
    assert torch.equal(copy, torch.stack(w)) and copy.data_ptr() != w[0].data_ptr()
    assert not ge.co_locate([torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2, 3))])
    meta = [torch.nn.Parameter(torch.empty(2, 2, device="meta")) for _ in range(2)]
    assert not ge.co_locate(meta)


def test_experts_module_co_locates_its_weights(model_parallel):
    """The built module's fc1 / fc2 weights are one storage each, so its grouped GEMMs read them without a copy."""
    experts = _standalone_experts(_experts_config())
    for name in ("linear_fc1", "linear_fc2"):
        weights = [getattr(e, name).weight for e in experts.local_experts]
        assert ge.stacked(weights).data_ptr() == weights[0].data_ptr(), name
        assert weights[0].untyped_storage().nbytes() == len(weights) * weights[0].nbytes, name


@pytest.mark.parametrize("wgrad_gemms", ["0", "1"])
def test_experts_module_accumulates_micro_batches_into_main_grad(model_parallel, monkeypatch, per_expert_route,
                                                                 wgrad_gemms):
    """``TorchGroupedMLP`` with ``gradient_accumulation_fusion``: two micro-batches (one with empty experts) leave in
    ``main_grad`` exactly what DDP's per-expert adds of the unfused path leave (with one weight-gradient GEMM per
    expert, ``MEGATRON_GLM5_EXPERT_WGRAD_GEMMS=1``: the same sums to fp32 rounding, the product added unrounded)."""
    monkeypatch.setenv("MEGATRON_GLM5_EXPERT_WGRAD_GEMMS", wgrad_gemms)
    from megatron.core.tensor_parallel import layers

    # the expert linears refuse the flag without apex when built (the grouped path never calls them)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    switch = "MEGATRON_GLM5_GROUPED_WGRAD_ACCUMULATION"
    monkeypatch.setenv(switch, "0")  # off when asked
    assert not _standalone_experts(_experts_config(gradient_accumulation_fusion=True)).accumulate_wgrad
    monkeypatch.delenv(switch)  # on by default (issue 23, round 6)
    fused = _standalone_experts(_experts_config(gradient_accumulation_fusion=True))
    plain = _standalone_experts(_experts_config())
    assert fused.accumulate_wgrad and not plain.accumulate_wgrad
    plain.load_state_dict(fused.state_dict())
    weights = {n: p for n, p in fused.named_parameters()}
    start = _ddp_like(list(weights.values()))
    sums = {n: s.clone() for n, s in zip(weights, start)}
    for seed, counts in ((0, [5, 0, 7, 3, 0, 9, 1, 6]), (1, [2, 4, 4, 4, 3, 3, 1, 10])):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(sum(counts), 64, generator=gen)
        probs = torch.rand(sum(counts), generator=gen)
        for m in (fused, plain):
            m.zero_grad(set_to_none=True)
            y, _ = m(x, torch.tensor(counts), probs)
            y.square().sum().backward()
        for n, p in plain.named_parameters():
            sums[n].add_(p.grad)
        assert all(p.grad_added_to_main_grad for p in weights.values())  # stays set, as DDP keeps it within a step
    assert fused.wgrad_gemms == (wgrad_gemms == "1")
    assert len(per_expert_route) == (4 if fused.wgrad_gemms else 0)  # fc1 and fc2, two micro-batches
    for n, p in weights.items():
        if fused.wgrad_gemms:
            torch.testing.assert_close(p.main_grad, sums[n], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(p.main_grad, sums[n]), n


def _accumulating_experts(monkeypatch, **config):
    """Standalone experts with ``gradient_accumulation_fusion`` (weight gradients into ``main_grad``, the
    per-expert route on by default) and DDP's attributes on every weight."""
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)  # the linears' build-time check (no apex)
    experts = _standalone_experts(_experts_config(gradient_accumulation_fusion=True, **config))
    assert experts.accumulate_wgrad and experts.wgrad_gemms
    _ddp_like(list(experts.parameters()))
    return experts


def _main_grad_run(experts, x0, p0, dy, forward) -> list[torch.Tensor]:
    """``main_grad`` reset to ``_ddp_like``'s start, one forward (``forward(x, probs)``) and backward; returns the
    input gradients and every ``main_grad``."""
    weights = list(experts.parameters())
    _ddp_like(weights)
    x, probs = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    forward(x, probs).backward(dy)
    return [x.grad, probs.grad, *(w.main_grad.clone() for w in weights)]


def test_fc1_and_fc2_share_one_row_ends_read(model_parallel, monkeypatch, per_expert_route):
    """One ``RowEnds`` per forward, read by fc1's and fc2's backward passes, its host list computed once."""
    made, reads = [], []

    class Counted(ge.RowEnds):
        def __init__(self, offs):
            super().__init__(offs)
            made.append(self)

        def read(self):
            ends = super().read()
            reads.append((self, ends))
            return ends

    monkeypatch.setattr(ge, "RowEnds", Counted)
    experts = _accumulating_experts(monkeypatch)
    counts = torch.tensor([5, 0, 7, 3, 0, 9, 1, 6])
    x, probs = torch.randn(31, 64), torch.rand(31)
    y, _ = experts(x, counts, probs)
    y.square().sum().backward()
    assert len(made) == 1 and [r for r, _ in reads] == [made[0], made[0]]
    assert reads[0][1] is reads[1][1] and per_expert_route == [reads[0][1]] * 2
    assert reads[0][1] == counts.cumsum(0).tolist()


@pytest.mark.parametrize("recompute", ["reentrant", "non-reentrant", "moe_act"])
def test_per_expert_route_under_activation_recompute(model_parallel, monkeypatch, per_expert_route, recompute):
    """The experts under activation recompute (``torch.utils.checkpoint`` around them, both kinds, or selective
    ``moe_act``) give bitwise the input gradients and ``main_grad`` of a plain run, both through the per-expert
    route."""
    from torch.utils.checkpoint import checkpoint

    extra = dict(recompute_granularity="selective", recompute_modules=["moe_act"]) if recompute == "moe_act" else {}
    plain, twin = _accumulating_experts(monkeypatch), _accumulating_experts(monkeypatch, **extra)
    twin.load_state_dict(plain.state_dict())
    assert twin.activation_recompute == (recompute == "moe_act")
    counts = torch.tensor([5, 0, 7, 3, 0, 9, 1, 6])
    gen = torch.Generator().manual_seed(3)
    x0, p0, dy = torch.randn(31, 64, generator=gen), torch.rand(31, generator=gen), torch.randn(31, 64, generator=gen)
    want = _main_grad_run(plain, x0, p0, dy, lambda x, p: plain(x, counts, p)[0])
    assert len(per_expert_route) == 2
    per_expert_route.clear()
    if recompute == "moe_act":
        forward = lambda x, p: twin(x, counts, p)[0]  # noqa: E731
    else:
        forward = lambda x, p: checkpoint(lambda a, b: twin(a, counts, b)[0], x, p,  # noqa: E731
                                          use_reentrant=recompute == "reentrant")
    got = _main_grad_run(twin, x0, p0, dy, forward)
    assert len(per_expert_route) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want)), [i for i, (a, b) in enumerate(zip(got, want))
                                                               if not torch.equal(a, b)]


def test_no_grad_forward_with_the_per_expert_route(model_parallel, monkeypatch, per_expert_route):
    """A forward under ``torch.no_grad()`` (the route on, as by default) builds no row ends and returns the output of
    a forward with gradients; a training forward and backward after it leave what they leave without it."""
    made = []

    class Counted(ge.RowEnds):
        def __init__(self, offs):
            super().__init__(offs)
            made.append(self)

    monkeypatch.setattr(ge, "RowEnds", Counted)
    experts = _accumulating_experts(monkeypatch)
    counts = torch.tensor([2, 4, 4, 4, 3, 3, 1, 10])
    gen = torch.Generator().manual_seed(5)
    x0, p0, dy = torch.randn(31, 64, generator=gen), torch.rand(31, generator=gen), torch.randn(31, 64, generator=gen)
    want = _main_grad_run(experts, x0, p0, dy, lambda x, p: experts(x, counts, p)[0])
    with torch.no_grad():
        y, _ = experts(x0, counts, p0)
    assert len(made) == 1 and not y.requires_grad
    per_expert_route.clear()
    got = _main_grad_run(experts, x0, p0, dy, lambda x, p: experts(x, counts, p)[0])
    assert len(made) == 2 and len(per_expert_route) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.enable_grad():
        assert torch.equal(experts(x0, counts, p0)[0].detach(), y)


def test_mlp_chunks_pass_the_accumulated_placeholders_on():
    """In the MLP recomputed in chunks (core/mlp_chunks.py) the grouped GEMMs add each chunk's weight gradient to
    ``main_grad`` (the last chunk's first, as the backward runs it) and the placeholders are passed on unsummed."""
    from megatron_glm5.core.mlp_chunks import chunked_mlp

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(7)
            self.w = torch.nn.ParameterList([torch.randn(32, 16, generator=gen) for _ in range(3)])
            self.accumulate = True

        def forward(self, x, padding_mask=None):
            rows = x.reshape(-1, 16)
            n = rows.shape[0]
            offs = torch.tensor([n // 2, n // 2, n], dtype=torch.int32)  # expert 1 empty
            y = grouped_linear(rows, list(self.w), offs, (1,), accumulate=self.accumulate)
            return y.reshape(*x.shape[:-1], 32), None

    mlp = Experts()
    x = torch.randn(8, 2, 16)
    base = _ddp_like(list(mlp.w))
    out, _ = chunked_mlp(mlp, x, 2)
    out.square().sum().backward()
    mlp.accumulate = False
    want = [b.clone() for b in base]
    for chunk in (x[4:], x[:4]):  # the backward's order: the last chunk's graph, then the recomputed first chunk
        grads = torch.autograd.grad(mlp(chunk)[0].square().sum(), list(mlp.w))
        for acc, g in zip(want, grads):
            acc.add_(g)
    for e, p in enumerate(mlp.w):
        assert p.grad_added_to_main_grad and torch.equal(p.main_grad, want[e]), e
    assert torch.equal(mlp.w[1].main_grad, base[1])


# --------------------------------------------------------------------------------------------------------------------
# The experts module against SequentialMLP
# --------------------------------------------------------------------------------------------------------------------


def test_experts_module_matches_sequential_with_zero_token_experts(model_parallel):
    experts = _experts(_build("on"))[0]
    assert isinstance(experts, TorchGroupedMLP) and experts.num_local_experts == 8
    diffs, grads = _compare_paths(experts, [5, 0, 7, 3, 0, 9, 1, 6])
    assert max(diffs.values()) <= TOL, {k: v for k, v in diffs.items() if v > TOL}
    for e in (1, 4):
        assert not grads[f"local_experts.{e}.linear_fc1.weight"].any()
        assert not grads[f"local_experts.{e}.linear_fc2.weight"].any()


def test_rank_without_tokens_gets_zero_weight_gradients(model_parallel):
    """All counts zero (possible under EP): empty output, and every expert parameter still receives a (zero)
    gradient, as with SequentialMLP (megatron's DDP buckets wait for every parameter)."""
    experts = _experts(_build("on"))[0]
    diffs, grads = _compare_paths(experts, [0] * 8)
    assert grads["out"].shape == (0, 128) and max(diffs.values()) == 0.0
    assert all(not g.any() for k, g in grads.items() if k.endswith(".weight"))


@pytest.mark.parametrize("fusion", [False, True], ids=["unfused-clamped", "fused-weighted-swiglu"])
def test_activation_paths_match_megatron_mlp(model_parallel, fusion):
    """The clamped GLU (GLM-5.3-Flash's swiglu_limit, inputs large enough that the clamp acts) and megatron-core's
    fused weighted SwiGLU (bias_activation_fusion) give SequentialMLP's results."""
    extra = dict(bias_activation_fusion=True) if fusion else dict(activation_func_clamp_value=1.0)
    experts = _standalone_experts(_experts_config(**extra))
    diffs, _ = _compare_paths(experts, [4, 6, 0, 5, 2, 7, 3, 1], scale=8.0)
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("flag", ["add_bias_linear", "use_te_activation_func", "delay_wgrad_compute", "fp8"])
def test_unsupported_configs_are_refused_by_flag(model_parallel, flag):
    config = _experts_config()
    setattr(config, flag, True)  # after megatron-core's own validation, which needs TE / fp8 recipes for some
    with pytest.raises(ValueError, match=rf"TorchGroupedMLP .*{flag}=True.*moe_grouped_gemm=False"):
        _standalone_experts(config)


def test_unknown_impl_is_refused(model_parallel):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_glm5.providers import GLMLocalSpecProvider

    build = GLMLocalSpecProvider().grouped_mlp_modules(True)
    with pytest.raises(ValueError, match=r"impl: expected one of \['auto', 'grouped_mm', 'sequential'\], got 'te'"):
        build(8, _experts_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups(), impl="te")


# --------------------------------------------------------------------------------------------------------------------
# A real tiny GLM-5.2 model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "moe_act-recompute"])
def test_model_matches_sequential_model(model_parallel, monkeypatch, recompute):
    """Same weights, one expert silenced: logits, loss and every gradient of the GLM-5.2 model (IndexShare, MTP,
    shared + routed experts). With selective ``moe_act`` recompute (which megatron-core allows only with
    ``moe_grouped_gemm``) the activation is recomputed in backward."""
    policy = dict(recompute_granularity="selective", recompute_modules=["moe_act"]) if recompute else {}
    seq, grp = _build("off"), _build("on", seed=1, **policy)
    assert {type(m) for m in _experts(seq)} == {ge.SequentialMLP}
    assert {type(m) for m in _experts(grp)} == {TorchGroupedMLP}
    assert all(m.activation_recompute == recompute for m in _experts(grp))
    grp.load_state_dict(seq.state_dict())
    for m in (seq, grp):
        _silence_expert(m)
    calls = _GroupedCalls(monkeypatch)
    ids, pos = _batch(VOCAB)
    logits_s, loss_s, grads_s, counts = _run(seq, ids, pos)
    assert calls.n == 0
    logits_g, loss_g, grads_g, counts_g = _run(grp, ids, pos)
    assert calls.n > 0, "the grouped path ran"
    assert counts and all(c[SILENT] == 0 and c.sum() > 0 for c in counts), "expert 3 got no token"
    assert all(torch.equal(a, b) for a, b in zip(counts, counts_g))
    assert grads_s.keys() == grads_g.keys()
    diffs = {n: _max_diff(grads_g[n], grads_s[n]) for n in grads_s}
    assert _max_diff(logits_g, logits_s) <= TOL and abs(loss_g - loss_s).item() <= TOL
    assert max(diffs.values()) <= TOL, {n: d for n, d in diffs.items() if d > TOL}
    silent = [n for n in grads_g if f"local_experts.{SILENT}." in n]
    assert silent and all(not grads_g[n].any() for n in silent)


def test_checkpoint_layouts_are_identical_and_interchange(model_parallel, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from tests.parallel_workers import load_weights

    def layout(model):
        out = {}
        for k, v in model.sharded_state_dict().items():
            if isinstance(v, ShardedTensor):
                out[k] = (v.key, v.local_shape, v.global_shape, v.global_offset, v.replica_id)
            elif isinstance(v, ShardedTensorFactory):
                out[k] = (v.key, tuple(v.data.shape), v.replica_id)
            else:
                out[k] = type(v).__name__
        return out

    seq, grp = _build("off", seed=0), _build("on", seed=1)
    sd_s, sd_g = seq.state_dict(), grp.state_dict()
    assert list(sd_s) == list(sd_g) and all(sd_s[k].shape == sd_g[k].shape for k in sd_s if torch.is_tensor(sd_s[k]))
    assert [n for n, _ in seq.named_parameters()] == [n for n, _ in grp.named_parameters()]
    assert layout(seq) == layout(grp)
    keys = {v[0] for v in layout(grp).values() if isinstance(v, tuple)}
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in keys, "SequentialMLP's global expert keys"
    ids, pos = _batch(VOCAB)

    def logits(model):
        with torch.no_grad():
            return model(ids, pos, None)

    for src, dst, name in ((seq, _build("on", seed=2), "sequential_to_grouped"),
                           (grp, _build("off", seed=3), "grouped_to_sequential")):
        path = tmp_path / name
        path.mkdir()
        dist_checkpointing.save(src.sharded_state_dict(), str(path))
        assert _max_diff(logits(dst), logits(src)) > 1e-3, "different initial weights"
        load_weights(dst, str(path))
        assert _max_diff(logits(dst), logits(src)) <= TOL, name


# --------------------------------------------------------------------------------------------------------------------
# Path choice: adapters, hooks
# --------------------------------------------------------------------------------------------------------------------


def test_lora_adapted_experts_run_the_per_expert_loop(model_parallel, monkeypatch):
    from megatron_glm5.lora import LoraConfig, add_lora

    seq, grp = _build("off"), _build("on", seed=1)
    grp.load_state_dict(seq.state_dict())
    ids, pos = _batch(VOCAB)
    with torch.no_grad():
        base = seq(ids, pos, None)
    for m in (seq, grp):
        add_lora(m, LoraConfig(r=4, alpha=8, init_lora_weights=False, seed=5))
    assert "local_experts.0.linear_fc1.lora_A" in "".join(n for n, _ in grp.named_parameters())
    calls = _GroupedCalls(monkeypatch)
    with torch.no_grad():
        out_s, out_g = seq(ids, pos, None), grp(ids, pos, None)
    assert calls.n == 0, "adapted experts must not take the grouped GEMMs (they would skip the adapters)"
    assert _max_diff(out_s, base) > 1e-3 and _max_diff(out_g, out_s) <= TOL


def test_forward_pre_hooks_run_and_post_hooks_fall_back(model_parallel, monkeypatch):
    """megatron DDP's overlap_param_gather waits in a forward pre-hook of each linear: the grouped path runs it.
    A forward (post) hook cannot be honoured by a grouped GEMM: that forward takes the per-expert loop."""
    experts = _experts(_build("on"))[0]
    calls = _GroupedCalls(monkeypatch)
    seen = []
    experts.local_experts[2].linear_fc1.register_forward_pre_hook(lambda m, args: seen.append(m))
    x, counts, probs = torch.randn(12, 128), torch.tensor([2, 1, 3, 0, 2, 1, 2, 1]), torch.rand(12)
    want, _ = ge.SequentialMLP.forward(experts, x, counts, probs)
    seen.clear()
    y, _ = experts(x, counts, probs)
    assert calls.n == 2 and seen == [experts.local_experts[2].linear_fc1] and _max_diff(y, want) <= TOL
    experts.local_experts[5].linear_fc2.register_forward_hook(lambda m, args, out: None)
    calls.n = 0
    y, _ = experts(x, counts, probs)
    assert calls.n == 0 and _max_diff(y, want) <= TOL
    experts.impl = "grouped_mm"
    with pytest.raises(RuntimeError, match="impl='grouped_mm'.*hooks"):
        experts(x, counts, probs)


def test_input_rewriting_pre_hook_is_refused(model_parallel):
    experts = _experts(_build("on"))[0]
    experts.local_experts[0].linear_fc1.register_forward_pre_hook(lambda m, args: (torch.zeros(1),))
    with pytest.raises(RuntimeError, match="rewrites its input"):
        experts(torch.randn(4, 128), torch.tensor([1, 1, 1, 1, 0, 0, 0, 0]), torch.rand(4))


# --------------------------------------------------------------------------------------------------------------------
# Selection: policy, Megatron-LM config, spec
# --------------------------------------------------------------------------------------------------------------------


def test_policy_auto_turns_grouped_gemm_on_for_cuda_bf16_without_te():
    """"auto": TorchGroupedMLP on CUDA + bf16; with Transformer Engine SequentialMLP stays (LoRA adapts it), and "on"
    selects megatron-core's TEGroupedMLP."""
    gpu = RuntimeEnvironment(cuda=True, mcore_tilelang_kernels=False, apex_gradient_accumulation_fusion=False)
    gpu_te = RuntimeEnvironment(cuda=True, mcore_tilelang_kernels=False, apex_gradient_accumulation_fusion=False,
                                transformer_engine=True)
    cpu = RuntimeEnvironment(cuda=False, mcore_tilelang_kernels=False, apex_gradient_accumulation_fusion=False)
    assert resolve_policy(RuntimePolicy(), gpu).moe_grouped_gemm == "on"
    assert resolve_policy(RuntimePolicy(), gpu_te).moe_grouped_gemm == "off"
    # deterministic mode keeps the GPU-verified bitwise-reproducible SequentialMLP unless asked otherwise
    assert resolve_policy(RuntimePolicy(deterministic_mode=True), gpu).moe_grouped_gemm == "off"
    assert resolve_policy(RuntimePolicy(deterministic_mode=True, moe_grouped_gemm="on"), gpu).moe_grouped_gemm == "on"
    assert resolve_policy(RuntimePolicy(moe_grouped_gemm="on"), gpu_te).moe_grouped_gemm == "on"
    assert runtime_kwargs(RuntimePolicy(), gpu)["moe_grouped_gemm"] is True
    assert runtime_kwargs(RuntimePolicy(params_dtype=torch.float32), gpu)["moe_grouped_gemm"] is False
    assert runtime_kwargs(RuntimePolicy(), cpu)["moe_grouped_gemm"] is False
    assert runtime_kwargs(RuntimePolicy(moe_grouped_gemm="on"), cpu)["moe_grouped_gemm"] is True
    assert runtime_kwargs(RuntimePolicy(moe_grouped_gemm="off"), gpu)["moe_grouped_gemm"] is False
    explicit = RuntimePolicy(dsa_kernel_backend="none", fusions=False, moe_grouped_gemm="on")
    assert resolve_policy(explicit, gpu) is explicit
    with pytest.raises(ValueError, match=r"moe_grouped_gemm: expected 'auto', 'on' or 'off', got True"):
        RuntimePolicy(moe_grouped_gemm=True)


def test_rl_provider_follows_megatron_lm_flag():
    import argparse

    from megatron_glm5.rl.provider import policy_from_args

    assert policy_from_args(argparse.Namespace(moe_grouped_gemm=True)).moe_grouped_gemm == "on"
    assert policy_from_args(argparse.Namespace(moe_grouped_gemm=False)).moe_grouped_gemm == "off"
    assert policy_from_args(argparse.Namespace()).moe_grouped_gemm == "off"


def test_spec_picks_the_module_from_config_moe_grouped_gemm(model_parallel, monkeypatch, caplog):
    """Megatron-LM's ``--moe-grouped-gemm`` sets ``config.moe_grouped_gemm``: without Transformer Engine
    megatron-core's local provider would silently keep SequentialMLP, ours builds TorchGroupedMLP over the same
    per-expert linears. Logged once per choice."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_glm5 import providers
    from megatron_glm5.config import build_transformer_config
    from megatron_glm5.glm5_next.spec import mlp_spec
    from megatron_glm5.spec import get_glm5_spec

    monkeypatch.setattr(providers, "_logged", set())
    config = build_transformer_config(parse_hf_config(tiny_glm52_config()), default_cpu_policy())
    experts = {}
    with caplog.at_level(logging.INFO, logger="megatron_glm5"):
        for flag in (False, True):
            config.moe_grouped_gemm = flag
            block = get_glm5_spec(config, provider=providers.GLMLocalSpecProvider())  # TE would keep TEGroupedMLP
            experts[flag] = block.layer_specs[1].submodules.mlp.keywords["submodules"].experts
            assert block.layer_specs[0].submodules.mlp.func.__self__.__name__ == "MLP"  # the dense layer
    assert experts[False].func is SequentialMLP and experts[True].func is TorchGroupedMLP
    assert experts[True].keywords == experts[False].keywords  # same per-expert linears
    assert caplog.text.count("MoE experts: TorchGroupedMLP (moe_grouped_gemm=True)") == 1
    assert caplog.text.count("MoE experts: SequentialMLP (moe_grouped_gemm=False)") == 1
    flash = mlp_spec(_experts_config(), "sparse", providers.GLMLocalSpecProvider())  # GLM-5.3-Flash's MoE spec
    assert flash.keywords["submodules"].experts.func is TorchGroupedMLP


# --------------------------------------------------------------------------------------------------------------------
# TP=2 (expert TP) and EP=2 under torchrun
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.parallel_workers import reference_run

    raw = tiny_glm52_config()
    weights = str(tmp_path_factory.mktemp("grouped_ref_weights"))
    loss, grads = reference_run(raw, weights)  # single process, SequentialMLP (CPU policy: grouped off)
    return raw, weights, loss, grads


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2-etp2", "ep2"])
def test_parallel_grouped_matches_single_process_sequential(reference, gloo_world, tmp_path, tp, ep):
    from tests.distributed import run_torchrun
    from tests.parallel_workers import grad_errors, load_sharded_grads

    raw, weights, ref_loss, ref_grads = reference
    grads_dir = tmp_path / "grads"
    grads_dir.mkdir()
    results = run_torchrun("tests.parallel_workers:parallel_case", tmp_path, nproc=2, raw=raw, weights=weights,
                           grads_out=str(grads_dir), tp=tp, pp=1, ep=ep, vocab=raw["vocab_size"],
                           moe_grouped_gemm="on")
    assert all(r["experts"] == ["TorchGroupedMLP"] for r in results)
    for r in results:
        assert abs(r["loss"] - ref_loss) <= 1e-6 * abs(ref_loss), f"loss {r['loss']} vs single-process {ref_loss}"
    errors = grad_errors(load_sharded_grads(raw, str(grads_dir)), ref_grads)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if e > 1e-5}
    assert not bad, f"max |grad diff| / max |grad| above 1e-5: {bad}"


# --------------------------------------------------------------------------------------------------------------------
# The benchmark script runs (tiny, CPU)
# --------------------------------------------------------------------------------------------------------------------


def test_benchmark_script_smoke(model_parallel, tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "bench_grouped_experts.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_experts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.md"
    bench.main(["--device", "cpu", "--dtype", "float32", "--tokens", "64", "--hidden", "64", "--ffn", "32",
                "--experts", "4", "--topk", "2", "--reps", "2", "--out", str(out)])
    text = out.read_text()
    assert "| SequentialMLP |" in text and "| TorchGroupedMLP |" in text and "max abs diff" in text
