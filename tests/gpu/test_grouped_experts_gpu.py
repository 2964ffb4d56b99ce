"""GPU checks of the grouped-GEMM routed experts (``TorchGroupedMLP``: torch ``grouped_mm``, bf16) against
megatron-core's ``SequentialMLP`` forward on the same module and weights (H200:
``pytest tests/gpu/test_grouped_experts_gpu.py -s``).

* bf16, 16 experts, hidden 1024, expert ffn 512, fused weighted SwiGLU, two zero-token experts: output and gradients
  (tokens, probs, every weight) of both paths against an fp32 run of the same weights. The grouped path must be as
  close to fp32 as the sequential one (within 2x + 2e-3, relative to the largest value), and the zero-token experts'
  weight gradients must be exactly 0.
* Device-side token counts: forward + backward run with ``torch.cuda.set_sync_debug_mode("error")``, so any host
  sync raises. Host counts (megatron-core's dispatchers) go through pinned memory, also without a sync.
* A small GLM-5.2 (``build_model``, bf16, default policy: ``moe_grouped_gemm="auto"`` means grouped on CUDA + bf16
  without Transformer Engine)
  against the same weights with ``SequentialMLP``: the loss agrees to 1e-2, the bf16 noise floor of
  ``test_backends_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


pytestmark = pytest.mark.gpu

COUNTS = [300, 0, 517, 128, 64, 1, 700, 256, 0, 333, 412, 90, 150, 222, 48, 379]  # 16 experts, two empty


def _experts(dtype=torch.bfloat16):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_glm5.providers import GLMLocalSpecProvider

    config = TransformerConfig(
        num_layers=1, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=512, moe_ffn_hidden_size=512,
        num_moe_experts=len(COUNTS), moe_router_topk=8, moe_grouped_gemm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        perform_initialization=False, gradient_accumulation_fusion=False, bias_activation_fusion=True,
        moe_token_dispatcher_type="allgather",
    )
    build = GLMLocalSpecProvider().grouped_mlp_modules(True)
    module = build(len(COUNTS), config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.02)
    return module


def _inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS)
    x = torch.randn(rows, 1024, generator=gen).cuda()
    probs = torch.rand(rows, generator=gen).cuda()
    dy = torch.randn(rows, 1024, generator=gen).cuda() * 0.01
    return x, probs, dy


def _run(module, impl: str, x, counts, probs, dy) -> dict[str, torch.Tensor]:
    module.impl = impl
    module.zero_grad(set_to_none=True)
    dtype = module.local_experts[0].linear_fc1.weight.dtype
    xg = x.detach().to(dtype).requires_grad_(True)
    pg = probs.clone().requires_grad_(True)
    y, _ = module(xg, counts, pg)
    y.backward(dy.to(dtype))
    out = {"out": y.detach(), "x": xg.grad, "probs": pg.grad}
    out.update({n: p.grad for n, p in module.named_parameters()})
    return {k: v.float() for k, v in out.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_bf16_grouped_matches_sequential_against_fp32(parallel):
    module = _experts()
    ref_module = _experts(torch.float32)  # the same (bf16-rounded) weights in fp32: the SequentialMLP path
    ref_module.load_state_dict(module.state_dict())
    x, probs, dy = _inputs()
    counts = torch.tensor(COUNTS)
    grouped = _run(module, "grouped_mm", x, counts, probs, dy)
    sequential = _run(module, "sequential", x, counts, probs, dy)
    ref = _run(ref_module, "sequential", x, counts, probs, dy)
    report = {k: (_rel(grouped[k], ref[k]), _rel(sequential[k], ref[k])) for k in ref if ref[k].abs().max() > 0}
    weights = [v for k, v in report.items() if k.endswith(".weight")]
    print("max |diff| / max |fp32| (grouped / sequential): "
          + ", ".join(f"{k} {report[k][0]:.1e} / {report[k][1]:.1e}" for k in ("out", "x", "probs"))
          + f", weights {max(g for g, _ in weights):.1e} / {max(s for _, s in weights):.1e}")
    bad = {k: v for k, v in report.items() if v[0] > 2 * v[1] + 2e-3}
    assert not bad, f"grouped bf16 further from fp32 than sequential bf16: {bad}"
    for e, n in enumerate(COUNTS):
        if n == 0:
            assert not grouped[f"local_experts.{e}.linear_fc1.weight"].any()
            assert not grouped[f"local_experts.{e}.linear_fc2.weight"].any()


@pytest.mark.parametrize("where", ["device", "host"])
def test_no_host_sync(parallel, where):
    module = _experts()
    x, probs, dy = _inputs(seed=2)
    counts = torch.tensor(COUNTS)
    if where == "device":
        counts = counts.cuda()
    want = _run(module, "grouped_mm", x, torch.tensor(COUNTS), probs, dy)  # warm-up (compiles the fused SwiGLU)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run(module, "grouped_mm", x, counts, probs, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_small_model_grouped_vs_sequential(parallel):
    from megatron_glm5.config import RuntimePolicy, parse_hf_config
    from megatron_glm5.model import build_model
    from megatron_glm5.moe.grouped_experts import TorchGroupedMLP
    from megatron_glm5.testing import small_glm52_config

    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        pytest.skip("with Transformer Engine, moe_grouped_gemm='auto' keeps SequentialMLP ('on' gives TEGroupedMLP)")
    arch = parse_hf_config(small_glm52_config())
    policy = dict(params_dtype=torch.bfloat16, dsa_kernel_backend="tilelang", use_cpu_initialization=True)
    torch.manual_seed(0)
    seq = build_model(arch, RuntimePolicy(moe_grouped_gemm="off", **policy)).cuda()
    grp = build_model(arch, RuntimePolicy(**policy)).cuda()  # "auto": on with CUDA + bf16
    assert any(isinstance(m, TorchGroupedMLP) for m in grp.modules())
    grp.load_state_dict(seq.state_dict())
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, arch.vocab_size, (2, 1024), generator=gen).cuda()
    pos = torch.arange(1024, device="cuda")[None].expand(2, 1024)
    losses = []
    for model in (seq, grp):
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        losses.append(loss.item())
    print(f"loss sequential {losses[0]:.5f} grouped {losses[1]:.5f}")
    assert abs(losses[0] - losses[1]) <= 1e-2
    name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    g_s, g_g = dict(seq.named_parameters())[name].grad.float(), dict(grp.named_parameters())[name].grad.float()
    cos = F.cosine_similarity(g_s.flatten(), g_g.flatten(), dim=0).item()
    assert cos > 0.99, f"{name}: cosine similarity of the gradients {cos:.4f}"
