"""Activation offload (:mod:`megatron_glm5.offload`): with offload on, loss and gradients are bitwise those without
it under every recompute mode (interleaved micro-batches), the indexer still runs once per full layer and micro-batch,
the layer inputs and the kept top-k really leave the device (on CPU: into a separate buffer and back), views of one
storage share one copy, weights and small tensors stay, nothing outlives its graph, and with TP each rank keeps only
its share of the replicated top-k."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from megatron_glm5 import offload
from megatron_glm5.config import RuntimePolicy, parse_hf_config
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.offload import ActivationOffload, activation_offload_for
from megatron_glm5.testing import tiny_glm52_config

from .distributed import run_torchrun

SEQ = 48  # > index_topk (16): DSA is sparse
FULL_1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL_2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
BLOCK_1 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=["core_attn"])


def _pair(backend: str, recompute: dict, **config):
    raw = tiny_glm52_config(**config)  # IndexShare [full, shared, full, shared]
    arch = parse_hf_config(raw)
    torch.manual_seed(0)
    reference = build_model(arch, default_cpu_policy(**recompute), backend=backend)
    model = build_model(arch, default_cpu_policy(activation_offload=True, activation_offload_min_numel=0, **recompute),
                        backend=backend)
    model.load_state_dict(reference.state_dict())
    return raw, arch, reference, model


def _run(model, microbatches, layer_inputs: list | None = None):
    """Forward every micro-batch, then backward each (the 1F1B / VPP order). ``layer_inputs`` collects
    ``(layer_number, data_ptr, nbytes)`` of each decoder layer's input storage during the forwards."""
    model.train()
    model.zero_grad(set_to_none=True)
    hooks = []
    if layer_inputs is not None:
        def seen(layer, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            layer_inputs.append((layer.layer_number, x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()))

        hooks = [layer.register_forward_pre_hook(seen, with_kwargs=True) for layer in model.decoder.layers]
    pos = torch.arange(SEQ)[None].expand(microbatches[0].shape[0], SEQ)
    losses = [model(ids, pos, attention_mask=None, labels=ids).sum() for ids in microbatches]
    for h in hooks:
        h.remove()
    for loss in losses:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [loss.detach() for loss in losses], grads


def _assert_bitwise(got, expected):
    (losses, grads), (ref_losses, ref_grads) = got, expected
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), "losses differ with offload"
    assert set(grads) == set(ref_grads)
    bad = [n for n in ref_grads if not torch.equal(grads[n], ref_grads[n])]
    assert not bad, f"gradients differ with offload: {bad[:5]}"


@pytest.mark.parametrize(
    "recompute, mtp, chunk_first_layers",
    [
        ({}, 1, [1, 2, 3, 4]),
        (FULL_1, 1, [1, 2, 3, 4]),
        (FULL_2, 0, [1, 3]),  # megatron-core requires recompute_num_layers=1 with MTP
        (BLOCK_1, 1, [1, 2, 3, 4]),
        (SELECTIVE, 1, [1, 2, 3, 4]),
        (dict(FULL_1, mlp_chunks_for_training=2), 1, [1, 2, 3, 4]),  # the split recompute keeps each MLP input too
    ],
    ids=["no-recompute", "full-uniform-1", "full-uniform-2", "full-block-1", "selective-core_attn",
         "full-uniform-1-split"],
)
def test_offload_is_bitwise_and_moves_layer_inputs(model_parallel, indexer_calls, recompute, mtp, chunk_first_layers):
    raw, arch, reference, model = _pair("megatron", recompute, num_nextn_predict_layers=mtp)
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, raw["vocab_size"], (2, SEQ), generator=gen) for _ in range(2)]
    expected = _run(reference, mbs)
    indexer_calls[0] = 0
    inputs: list = []
    with offload.recording() as log:
        got = _run(model, mbs, inputs)
    _assert_bitwise(got, expected)
    assert indexer_calls[0] == (len(arch.full_indexer_layers) + mtp) * len(mbs), \
        "the indexer must run once per full layer and micro-batch"
    assert log.bytes_offloaded > 0
    assert log.loads == len(log.copies), "every copy comes back exactly once"
    assert 0 < log.prefetches < log.loads, "earlier windows are prefetched, the first one of a backward is not"
    copied = {(c["data_ptr"], c["nbytes"]) for c in log.copies}
    for number, ptr, nbytes in inputs:
        if number in chunk_first_layers:
            assert (ptr, nbytes) in copied, f"the input of layer {number} was not offloaded"
    topk_bytes = raw["index_topk"] * 4 * mbs[0].numel()  # int32 [T, index_topk]
    topk_copies = [c for c in log.copies if c["nbytes"] == topk_bytes and c["dtype"] == torch.int32]
    assert len(topk_copies) == (len(arch.full_indexer_layers) + mtp) * len(mbs), \
        "one host copy per top-k (shared layers, the next chunk and the replay reuse it)"


def test_tilelang_backend_full_recompute(model_parallel, indexer_calls):
    raw, arch, reference, model = _pair("tilelang", FULL_1)
    gen = torch.Generator().manual_seed(2)
    mbs = [torch.randint(0, raw["vocab_size"], (1, SEQ), generator=gen) for _ in range(2)]
    expected = _run(reference, mbs)
    indexer_calls[0] = 0
    with offload.recording() as log:
        got = _run(model, mbs)
    _assert_bitwise(got, expected)
    assert indexer_calls[0] == (len(arch.full_indexer_layers) + 1) * len(mbs)
    assert log.bytes_offloaded > 0


def test_forward_without_backward_leaves_nothing_behind(model_parallel):
    """An aborted step frees its host copies with its graph; a no-grad train-mode forward makes none."""
    raw, arch, _, model = _pair("megatron", FULL_1)
    ids = torch.randint(0, raw["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    model.train()
    with offload.recording() as log:
        with torch.no_grad():
            model(ids, pos, None, labels=ids)
        assert not log.copies
        loss = model(ids, pos, None, labels=ids).sum()
    assert log.copies
    live = [v[1] for v in offload._tls.copies.values()]
    assert any(ref() is not None for ref in live)
    del loss
    gc.collect()
    assert all(ref() is None for ref in live), "host copies outlived their graph"


def test_views_of_one_storage_share_one_copy():
    x = torch.randn(8, 64, requires_grad=True)
    def f(h):
        return (h[:, :32].sin() * h[:, 32:].cos()).sum()  # sin / cos save views of h's storage

    expected = torch.autograd.grad(f(x * 2), x)[0]
    with offload.recording() as log:
        with offload.window(ActivationOffload(min_numel=0)):
            y = f(x * 2)
        (got,) = torch.autograd.grad(y, x)
    assert torch.equal(got, expected)
    h_copies = [c for c in log.copies if c["nbytes"] == 8 * 64 * 4]
    assert len(h_copies) == 1, "two views of one storage must share one host copy"
    assert log.reused >= 1 and log.loads == len(log.copies)


def test_weights_and_small_tensors_stay():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    small = torch.randn(4, requires_grad=True)
    with offload.recording() as log:
        with offload.window(ActivationOffload(min_numel=64 * 256), module=lin):
            y = lin(x * 1).relu().sum() + (small * small).sum()  # saves W (param), x*1 (big), relu out (big), small
    copied = {c["data_ptr"] for c in log.copies}
    assert lin.weight.untyped_storage().data_ptr() not in copied
    assert small.untyped_storage().data_ptr() not in copied
    assert len(log.copies) == 2  # the linear's input and the ReLU's output
    y.backward()
    assert lin.weight.grad is not None and small.grad is not None


def test_hold_keeps_a_tensor_off_the_device_until_released():
    t = torch.arange(4096, dtype=torch.int32).view(64, 64)
    assert offload.hold(t) is t  # no window: nothing to do
    with offload.recording() as log:
        with offload.window(ActivationOffload(min_numel=0)):
            held = offload.hold(t)
    assert not isinstance(held, torch.Tensor) and len(log.copies) == 1
    back = offload.release(held)
    assert torch.equal(back, t) and back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_settings_come_from_the_policy_or_megatron_core_flags():
    config = SimpleNamespace(fine_grained_activation_offloading=False, offload_modules=[], min_offloaded_tensor_size=7)
    assert activation_offload_for(config) is None
    policy = RuntimePolicy(activation_offload=True, activation_offload_min_numel=5, activation_offload_shard_topk=False)
    assert activation_offload_for(config, policy) == ActivationOffload(min_numel=5, shard_replicated=False)
    config.fine_grained_activation_offloading, config.offload_modules = True, ["expert_fc1", "moe_act"]
    assert activation_offload_for(config) is None, "MoE-only names are megatron-core's own offloading"
    config.offload_modules = ["core_attn", "expert_fc1"]
    assert activation_offload_for(config) == ActivationOffload(min_numel=7)
    with pytest.raises(ValueError, match="activation_offload_min_numel"):
        RuntimePolicy(activation_offload_min_numel=-1)


def test_megatron_lm_flags_reach_the_layer_specs(model_parallel):
    """``pretrain_gpt.py --spec ... --fine-grained-activation-offloading --offload-modules core_attn`` builds every
    GLM layer (MTP included) with the window; without an attention-side name, none."""
    from megatron_glm5.config import build_transformer_config
    from megatron_glm5.spec import build_glm5_block_spec, build_glm5_mtp_spec

    arch = parse_hf_config(tiny_glm52_config())
    config = build_transformer_config(arch, default_cpu_policy())
    config.fine_grained_activation_offloading, config.offload_modules = True, ["core_attn"]
    config.min_offloaded_tensor_size = 4096
    specs = build_glm5_block_spec(config, indexer_types=arch.indexer_types).layer_specs
    specs.append(build_glm5_mtp_spec(config).layer_specs[0].submodules.mtp_model_layer)
    assert all(s.params["activation_offload"] == ActivationOffload(min_numel=4096) for s in specs)
    config.offload_modules = ["moe_act"]
    assert all("activation_offload" not in s.params
               for s in build_glm5_block_spec(config, indexer_types=arch.indexer_types).layer_specs)


@pytest.mark.slow
def test_tensor_parallel_ranks_keep_their_share_of_the_topk(tmp_path):
    results = run_torchrun("tests.offload_workers:tp_offload_case", tmp_path, nproc=2, raw=tiny_glm52_config(),
                           recompute=FULL_1)
    for rank, r in enumerate(results):
        assert r["loss_equal"] and r["grads_equal"], f"rank {rank}: {r}"
        assert r["sharded_copies"] > 0 and r["sharded_topk_share"] and all(s == 0.5 for s in r["sharded_topk_share"])
        assert r["loads"] == r["copies"]
