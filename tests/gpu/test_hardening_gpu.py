"""GPU checks of the hardening fixes (run on the H200 machine: ``pytest tests/gpu/test_hardening_gpu.py -s``).

* Uniform recompute of 2-layer chunks with top-4 routing: the layer input of a chunk's second layer is recomputed
  through MoE, whose ``scatter_add_`` is not bitwise deterministic on GPU; the replayed top-k is accepted within the
  fingerprint tolerance (the old check required bit-equal inputs and killed the process with a device assert), the
  indexer runs once per full layer and micro-batch, and gradients differ from the no-recompute ones by no more
  than two no-recompute runs differ from each other (bf16 routing and top-k non-determinism).
* GPU defaults: ``from_hf_pretrained`` on CUDA gives a bf16 model on megatron-core's fused TileLang DSA kernels with
  megatron-core's fusions on.
* The ``tilelang`` backend with fp32 parameters on CUDA runs (one warning, exact torch path) instead of raising
  ``q must be torch.bfloat16``, and matches the ``megatron`` backend in fp32.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
SEQ = 1024  # > index_topk 256 of small_glm52_config


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    from megatron_glm5.testing import small_glm52_config, write_hf_checkpoint

    raw = small_glm52_config()
    return raw, write_hf_checkpoint(tmp_path_factory.mktemp("small"), raw, seed=0, dtype=torch.bfloat16,
                                    max_shard_bytes=64 << 20)


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_uniform_recompute_of_two_layer_chunks_with_top4_routing(parallel, backend, monkeypatch, indexer_calls):
    from megatron_glm5 import layer as layer_mod
    from megatron_glm5.config import RuntimePolicy, parse_hf_config
    from megatron_glm5.model import build_model
    from megatron_glm5.testing import small_glm52_config

    # every layer MoE and layers 0-2 full: chunk [0, 1]'s second layer is a full layer whose input is recomputed
    # through layer 0's MoE
    arch = parse_hf_config(small_glm52_config(num_nextn_predict_layers=0, num_experts_per_tok=4, first_k_dense_replace=0,
                                              indexer_types=["full", "full", "full", "shared"]))
    base = dict(params_dtype=torch.bfloat16, use_cpu_initialization=True)
    torch.manual_seed(0)
    reference = build_model(arch, RuntimePolicy(**base), backend=backend).cuda()
    model = build_model(arch, RuntimePolicy(**base, recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=2), backend=backend).cuda()
    model.load_state_dict(reference.state_dict())

    calls, replays = indexer_calls, {"total": 0, "inexact": 0}
    original_replay = layer_mod.replayed_topk

    def watching(layer, attn_input, layer_number):
        node = layer_mod._checkpoint_node()
        stored = getattr(node, layer_mod._STASH, {}).get(layer)
        if stored is not None:
            replays["total"] += 1
            replays["inexact"] += int(not torch.equal(layer_mod.fingerprint(attn_input), stored[1]))
        return original_replay(layer, attn_input, layer_number)

    monkeypatch.setattr(layer_mod, "replayed_topk", watching)

    gen = torch.Generator().manual_seed(3)
    mbs = [torch.randint(0, arch.vocab_size, (1, SEQ), generator=gen).cuda() for _ in range(3)]
    pos = torch.arange(SEQ, device="cuda")[None]

    def grads(m, interleaved):
        m.train()
        m.zero_grad(set_to_none=True)
        if interleaved:
            losses = [m(ids, pos, None, labels=ids).float().mean() for ids in mbs]
            for loss in losses:
                loss.backward()
        else:
            for ids in mbs:
                m(ids, pos, None, labels=ids).float().mean().backward()
        return {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}

    expected = grads(reference, False)
    again = grads(reference, False)  # bf16 MoE / top-k non-determinism: the noise floor of this comparison
    calls[0] = 0
    got = grads(model, True)
    torch.cuda.synchronize()  # a failed device-side fingerprint assert surfaces here
    print(f"\n[{backend}] replays {replays['total']}, with inputs that differ in the last bits: {replays['inexact']}; "
          f"indexer runs {calls[0]}")
    assert calls[0] == len(arch.full_indexer_layers) * len(mbs)
    assert replays["total"] == len(arch.full_indexer_layers) * len(mbs)
    def worst(a, b):
        return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item() for n in b)

    floor, diff = worst(again, expected), worst(got, expected)
    print(f"[{backend}] worst per-parameter relative gradient difference vs no recompute: {diff:.3e} "
          f"(two runs without recompute: {floor:.3e})")
    assert diff <= max(3 * floor, 1e-2), "recompute must give the no-recompute gradients within bf16 run-to-run noise"


def test_gpu_defaults_are_the_fast_path(parallel, small_checkpoint):
    from megatron.core.utils import _missing_tilelang_dsa_kernel_dependencies

    from megatron_glm5 import from_hf_pretrained

    _, path = small_checkpoint
    model = from_hf_pretrained(path)
    cfg = model.config
    print(f"\n[defaults] params {next(model.parameters()).dtype}, dsa_kernel_backend {cfg.dsa_kernel_backend}, "
          f"bias_activation_fusion {cfg.bias_activation_fusion}, bias_dropout_fusion {cfg.bias_dropout_fusion}")
    assert next(model.parameters()).dtype == torch.bfloat16 and next(model.parameters()).is_cuda
    assert cfg.bias_activation_fusion and cfg.bias_dropout_fusion
    expected = "none" if _missing_tilelang_dsa_kernel_dependencies() else "tilelang"
    assert cfg.dsa_kernel_backend == expected


def test_tilelang_backend_with_fp32_parameters_on_cuda(parallel, small_checkpoint):
    from megatron_glm5 import from_hf_pretrained

    _, path = small_checkpoint
    ids = torch.randint(0, 4096, (1, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.arange(SEQ, device="cuda")[None]
    tile = from_hf_pretrained(path, backend="tilelang", params_dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            ours = tile(ids, pos, None)
    assert any("run in bf16 and the model is torch.float32" in str(w.message) for w in caught)
    del tile
    mega = from_hf_pretrained(path, backend="megatron", params_dtype=torch.float32)
    with torch.no_grad():
        ref = mega(ids, pos, None)
    diff = (ours - ref).abs().max().item()
    print(f"\n[fp32 on CUDA] tilelang (torch path) vs megatron backend: max |logit diff| {diff:.3e}")
    assert diff < 1e-3
