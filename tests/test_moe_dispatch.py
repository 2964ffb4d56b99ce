"""megatron-core's all-gather dispatcher without host syncs (:mod:`megatron_glm5.moe_dispatch`), on CPU with the
gather-sum permutation in Triton's interpreter: against megatron-core's own ``dispatch_postprocess`` on a real
``MoEAllGatherTokenDispatcher``, the same permuted rows, mapping, probabilities and counts (bitwise), the same
combined output and gradients for the tokens and the routing probabilities, counts left on the device's side (a
tensor, never a host list), what it does not take left to megatron-core, and a routing map without exactly ``topk``
experts per token stopped by the assert instead of being permuted."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_checks import passed, run_in_interpreter

_SCRIPT = textwrap.dedent('''
    import torch
    from megatron_glm5.cpu import enable_cpu_mode
    enable_cpu_mode()
    from megatron_glm5.parallel import ensure_process_group, initialize_model_parallel
    ensure_process_group()
    initialize_model_parallel()
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_glm5 import compat, fusions, moe_dispatch

    original = MoEAllGatherTokenDispatcher.dispatch_postprocess
    routed = fusions.install_fusions()
    assert routed["moe_permute"] and routed["moe_device_counts"], routed
    assert MoEAllGatherTokenDispatcher.dispatch_postprocess is not original
    calls = []
    real = moe_dispatch.sync_free_applies
    moe_dispatch.sync_free_applies = lambda *a: (calls.append(real(*a)), calls[-1])[1]

    tokens, experts, topk, hidden = 29, 6, 2, 40
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts,
                            moe_router_topk=topk, moe_token_dispatcher_type="allgather", add_bias_linear=False,
                            use_cpu_initialization=True, params_dtype=torch.float32)

    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    def dispatcher():
        return MoEAllGatherTokenDispatcher(experts, list(range(experts)), cfg,
                                           pg_collection=get_default_pg_collection())

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, experts, generator=g)
    top = scores.topk(topk, 1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs0 = torch.zeros(tokens, experts).scatter_(1, top, torch.rand(tokens, topk, generator=g))
    x0 = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(tokens * topk, hidden, generator=g)  # stands in for the experts

    def run(fn):
        d = dispatcher()
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        h, p = d.dispatch_preprocess(x, routing_map, probs)
        h, p = d.token_dispatch(h, p)
        permuted, counts, local_probs = fn(d, h, p)
        state = (d.local_map.clone(), d.reversed_local_input_permutation_mapping.clone(), d.routing_map)
        out = d.combine_postprocess(d.token_combine(d.combine_preprocess(permuted * w * local_probs[:, None])))
        (out * out.flip(0)).sum().backward()
        return permuted, counts, local_probs, state, out, x.grad, probs.grad

    ours = run(lambda d, h, p: d.dispatch_postprocess(h, p))
    assert calls == [True], calls
    mcore = run(lambda d, h, p: original(d, h, p))
    assert isinstance(ours[1], torch.Tensor) and mcore[1].device.type == "cpu"
    assert ours[1].dtype == mcore[1].dtype == torch.long and torch.equal(ours[1], mcore[1])
    for name, a, b in zip(("permuted", "local_probs"), (ours[0], ours[2]), (mcore[0], mcore[2])):
        assert a.shape == b.shape and torch.equal(a, b), name
    assert torch.equal(ours[3][0], mcore[3][0]) and torch.equal(ours[3][1], mcore[3][1])
    assert ours[3][2] is None and mcore[3][2] is None
    for name, a, b in zip(("out", "dx", "dprobs"), ours[4:], mcore[4:]):
        err = float((a - b).abs().max() / b.abs().max())
        print(name, err)
        assert err < 1e-6, (name, err)

    # what it does not take goes to megatron-core's method: capacity (token dropping)
    cfg.moe_expert_capacity_factor = 1.0
    d = dispatcher()
    h, p = d.dispatch_preprocess(x0, routing_map, probs0)
    d.dispatch_postprocess(*d.token_dispatch(h, p))
    assert calls[-1] is False, calls
    cfg.moe_expert_capacity_factor = None

    # a routing map that breaks "exactly topk per token" is stopped, not permuted
    broken = routing_map.clone()
    broken[0] = False
    d = dispatcher()
    h, p = d.dispatch_preprocess(x0, broken, probs0)
    try:
        d.dispatch_postprocess(*d.token_dispatch(h, p))
    except RuntimeError as e:
        assert "exactly topk" in str(e), e
    else:
        raise AssertionError("a routing map without topk experts per token was permuted")
    print("OK")
''')


def test_sync_free_dispatch_matches_megatron_core():
    pytest.importorskip("triton")
    assert passed(run_in_interpreter(_SCRIPT))


def test_switch_off_keeps_megatron_cores_method():
    pytest.importorskip("triton")
    script = textwrap.dedent('''
        from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
        from megatron_glm5 import fusions
        original = MoEAllGatherTokenDispatcher.dispatch_postprocess
        routed = fusions.install_fusions()
        assert routed["moe_permute"] and not routed["moe_device_counts"], routed
        assert MoEAllGatherTokenDispatcher.dispatch_postprocess is original
        print("OK")
    ''')
    assert passed(run_in_interpreter(script, MEGATRON_GLM5_MOE_DEVICE_COUNTS="0"))
