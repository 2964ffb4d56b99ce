"""Activation offload on GLM-5.3-Flash (KDA + NoPE DSA layers in mHC streams, through the core's DSA decoder-layer
window): loss and gradients are bitwise those without offload under each recompute mode (interleaved micro-batches),
the KPool indexer still runs once per full DSA layer and micro-batch, and the layer inputs and the kept KPool top-k
(``index_topk + P - 1`` wide) really leave the device (on CPU: into a separate buffer and back). Before the shared
layer base, ``build_model`` refused offload for GLM-5.3-Flash."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5 import offload
from megatron_glm5.architectures import parse_architecture
from megatron_glm5.dsa.kpool_indexer import KPoolIndexer
from megatron_glm5.glm5_next.testing import tiny_flash_config
from megatron_glm5.model import build_model, default_cpu_policy

from .instrument import count_calls
from .test_offload import FULL_1, SELECTIVE, _assert_bitwise, _run

SEQ = 48  # > index_topk (16): DSA is sparse


@pytest.fixture
def kpool_calls(monkeypatch):
    """Count KPool indexer projections (both backends run them once per full DSA layer call)."""
    calls = [0]
    count_calls(monkeypatch, calls, KPoolIndexer, "project")
    return calls


def _pair(backend: str, recompute: dict):
    text = tiny_flash_config()["text_config"]  # KDA / full DSA / shared DSA / KDA, hc_mult 4, MTP 1
    arch = parse_architecture({"model_type": "glm5_next", **text})
    torch.manual_seed(0)
    reference = build_model(arch, default_cpu_policy(**recompute), backend=backend)
    model = build_model(arch, default_cpu_policy(activation_offload=True, activation_offload_min_numel=0, **recompute),
                        backend=backend)
    model.load_state_dict(reference.state_dict())
    return arch, reference, model


@pytest.mark.parametrize(
    "backend, recompute",
    [("megatron", {}), ("megatron", FULL_1), ("megatron", SELECTIVE), ("tilelang", FULL_1)],
    ids=["megatron-no-recompute", "megatron-full-uniform-1", "megatron-selective-core_attn",
         "tilelang-full-uniform-1"],
)
def test_flash_offload_is_bitwise(model_parallel, kpool_calls, backend, recompute):
    arch, reference, model = _pair(backend, recompute)
    assert all(layer.activation_offload is not None for layer in model.decoder.layers)
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, arch.vocab_size, (2, SEQ), generator=gen) for _ in range(2)]
    expected = _run(reference, mbs)
    kpool_calls[0] = 0
    inputs: list = []
    with offload.recording() as log:
        got = _run(model, mbs, inputs)
    _assert_bitwise(got, expected)
    full = len(arch.full_indexer_layers) + arch.num_nextn_predict_layers
    assert kpool_calls[0] == full * len(mbs), "the KPool indexer must run once per full DSA layer and micro-batch"
    assert log.bytes_offloaded > 0
    # at most once each: the torch KDA recurrence saves a few tensors for nodes whose output never reaches the loss;
    # their backward does not run, so those copies are freed with the graph without coming back (as the tensors
    # would be without offload)
    assert 0 < log.loads <= len(log.copies)
    copied = {(c["data_ptr"], c["nbytes"]) for c in log.copies}
    assert any((ptr, nbytes) in copied for _, ptr, nbytes in inputs), "no layer input was offloaded"
    topk_bytes = arch.topk_width * 4 * mbs[0].numel()  # int32 [T, index_topk + P - 1]
    topk_copies = [c for c in log.copies if c["nbytes"] == topk_bytes and c["dtype"] == torch.int32]
    assert len(topk_copies) == full * len(mbs), "one host copy per KPool top-k"
