"""The ``tilelang`` backend's own logic on CPU (its torch path): absorption / de-absorption, fp32 RoPE, GLM indexer
projections, top-k padding, THD, the absorbed weights' source, refusals.

What these tests are not: independent evidence for the attention math. On CPU both backends run the same torch
reference (:mod:`megatron_glm5.dsa.reference`: ``indexer_topk`` and ``sparse_mla``), so agreeing with the
``megatron`` backend checks only the glue around it; a bug in the reference would pass here. The independent check
is against transformers, for both backends (``tests/test_model_parity.py``: logits, top-k sets, THD packing,
gradients). TP=2 + SP is in test_parallel.py; the kernels themselves run on the GPU machine (tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_glm5.config import parse_hf_config
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config
from megatron_glm5.dsa.tilelang_attention import TileLangMLASelfAttention


@pytest.fixture
def pair(model_parallel):
    arch = parse_hf_config(tiny_glm52_config())
    torch.manual_seed(0)
    mega = build_model(arch, default_cpu_policy())
    tile = build_model(arch, default_cpu_policy(), backend="tilelang")
    assert set(mega.state_dict()) == set(tile.state_dict()), "both backends share parameter names"
    tile.load_state_dict(mega.state_dict())
    assert all(isinstance(layer.self_attention, TileLangMLASelfAttention) for layer in tile.decoder.layers)
    return arch, mega, tile


def _loss_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    pos = kw.pop("pos", torch.arange(ids.shape[1])[None].expand_as(ids))
    loss = model(ids, pos, None, labels=ids, **kw)
    loss.float().sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seq", [64, 10], ids=["sparse", "shorter-than-topk"])
def test_tilelang_glue_agrees_with_megatron_backend_on_the_shared_reference(pair, seq):
    """Loss and gradients of the two backends' different glue around one shared torch reference (module
    docstring)."""
    arch, mega, tile = pair
    ids = torch.randint(0, arch.vocab_size, (2, seq), generator=torch.Generator().manual_seed(3))
    l1, g1 = _loss_and_grads(mega, ids)
    l2, g2 = _loss_and_grads(tile, ids)
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    assert set(g1) == set(g2)
    for n in g1:
        err = (g2[n] - g1[n]).abs().max() / g1[n].abs().max().clamp_min(1e-12)
        assert err <= 1e-6, f"{n}: {err:.2e}"


def test_topk_is_fixed_width_and_padded(pair):
    arch, _, tile = pair
    seen = []
    hook = tile.decoder.layers[0].self_attention.register_forward_hook(lambda m, i, o: seen.append(o[2]))
    try:
        with torch.no_grad():
            tile(torch.randint(0, arch.vocab_size, (1, 10)), torch.arange(10)[None], None)
    finally:
        hook.remove()
    topk = seen[0]
    assert topk.shape == (10, arch.index_topk) and topk.dtype == torch.int32
    for t in range(10):  # row t has t+1 causal candidates, the rest is -1
        assert sorted(topk[t, : t + 1].tolist()) == list(range(t + 1))
        assert (topk[t, t + 1 :] == -1).all()


def test_thd_glue_agrees_with_megatron_backend_on_the_shared_reference(pair):
    """THD layout handling of the two backends (against transformers: test_model_parity.py)."""
    arch, mega, tile = pair
    lens = [40, 7, 33]
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, arch.vocab_size, (1, sum(lens)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 40, 47, 80], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40, max_seqlen_kv=40)
    with torch.no_grad():
        a = mega(ids, pos, None, packed_seq_params=psp)
        b = tile(ids, pos, None, packed_seq_params=psp)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_absorbed_weights_follow_kv_up_proj(pair):
    """W_kc / W_vc are read from linear_kv_up_proj.weight on every forward (a LoRA delta there must reach them)."""
    arch, _, tile = pair
    attn = tile.decoder.layers[0].self_attention
    ids = torch.randint(0, arch.vocab_size, (1, 32))
    pos = torch.arange(32)[None]
    with torch.no_grad():
        before = tile(ids, pos, None)
        attn.linear_kv_up_proj.weight.mul_(1.5)
        after = tile(ids, pos, None)
    assert (after - before).abs().max() > 1e-3
    tile(ids, pos, None, labels=ids).sum().backward()
    assert attn.linear_kv_up_proj.weight.grad is not None and attn.linear_kv_up_proj.weight.grad.abs().sum() > 0


def test_inference_cache_is_refused(pair):
    _, _, tile = pair
    attn = tile.decoder.layers[0].self_attention
    with pytest.raises(NotImplementedError, match="training and forward only"):
        attn(torch.zeros(4, 1, 128), inference_context=object())
