"""GLM-5.3-Flash's KDA linear attention: the torch reference and our megatron-core layer (CPU, fp32).

* Reference: the chunked (WY) form equals the recurrent definition token by token, forward and gradients, across
  several chunks, for bshd and packed (THD) sequences; it equals transformers' own torch fallback
  (``chunk_kimi_delta_attention``); the causal convolution equals ``F.conv1d`` per sequence; the gate's two forms.
* Layer: ``KimiDeltaAttention`` built by our spec, weights loaded through the bridge rows (in-memory naming), equals
  transformers' ``Glm5NextTextLinearAttention``: output, input gradient and every parameter gradient within 1e-5 (at
  80 tokens, two chunks); THD packing equals transformers per document; a left-padded batch given as a dense mask
  equals transformers' padding mask on the real rows.
* Kernel choice: ``kda_kernel="fla"`` without CUDA / without flash-linear-attention is refused with the remedy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_glm5.glm5_next import kda_reference as ref
from megatron_glm5.glm5_next.config import parse_glm5_next_config
from tests.glm5_next_fixtures import (
    HIDDEN,
    build_layer,
    hf_grads_as_mcore,
    hf_layer_state,
    hf_text_config,
    load_from_hf,
    mcore_config,
    randomize,
    rel_diff,
    tiny_raw,
)

TOL = 1e-5
KDA, DSA = "linear_attention", "indexed_attention"
RAW = tiny_raw(layer_types=[KDA, DSA, DSA, KDA], indexer_types=["full", "full", "shared", "full"])


def _inputs(b, t, h, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(b, t, h, d, generator=gen))
    beta = torch.rand(b, t, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_chunked_reference_equals_recurrent_form(packed):
    """130 tokens (three chunks of 64) per sequence; packed: four documents, boundaries inside chunks."""
    q, k, v, g, beta = _inputs(2, 130, 2, 8)
    cu = None
    if packed:
        q, k, v, g, beta = (x.reshape(1, 260, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu = torch.tensor([0, 37, 64, 190, 260])
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    chunked = ref.chunk_kda(*leaves, cu_seqlens=cu)
    w = torch.randn(chunked.shape, generator=torch.Generator().manual_seed(1))
    (chunked * w).sum().backward()
    grads_c = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    recurrent = ref.recurrent_kda(*leaves, cu_seqlens=cu)
    (recurrent * w).sum().backward()
    assert rel_diff(chunked, recurrent) <= TOL
    for name, gc, x in zip("qkvgb", grads_c, leaves):
        assert ((gc - x.grad).abs().max() / x.grad.abs().max()).item() <= 1e-4, f"grad {name}"
    if packed:  # documents are independent: each equals its own run
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = ref.chunk_kda(*(x[:, s:e] for x in (q, k, v, g, beta)))
            assert rel_diff(chunked[:, s:e], alone) <= 1e-6


def test_chunked_reference_equals_transformers_fallback():
    from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention, l2norm

    q, k, v, g, beta = _inputs(2, 130, 3, 8, seed=2)
    want, _ = chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert rel_diff(ref.chunk_kda(q, k, v, g, beta), want) <= 1e-6
    assert torch.equal(ref.l2norm(q), l2norm(q))


def test_causal_conv_equals_conv1d_per_sequence():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 90, 12, generator=gen), torch.randn(12, 4, generator=gen)
    cu = torch.tensor([0, 2, 41, 90])
    got = ref.causal_conv(x, w, ref.segment_positions(cu, 90))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = F.silu(F.conv1d(x[:, s:e].transpose(1, 2), w[:, None], padding=3, groups=12)[..., : e - s])
        assert rel_diff(got[:, s:e], want.transpose(1, 2)) <= 1e-6


def test_gate_forms_match_transformers():
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

    for lower in (-5.0, None):
        hf = Glm5NextTextForgetGate(hf_text_config(tiny_raw(linear_lower_bound=lower)))
        randomize(hf, 4)
        x = torch.randn(2, 7, HIDDEN)
        got = ref.kda_gate(hf.f_b_proj(hf.f_a_proj(x)), hf.A_log, hf.dt_bias, lower)
        assert rel_diff(got, hf(x)) <= 1e-6
        assert (got < 0).all() and (lower is None or (got > lower).all())


# --------------------------------------------------------------------------------------------------------------------
# our layer vs transformers
# --------------------------------------------------------------------------------------------------------------------


def make_pair(seed=0, **config):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    arch = parse_glm5_next_config(RAW)
    hf = Glm5NextTextLinearAttention(hf_text_config(RAW), 0)
    randomize(hf, seed)
    layer = build_layer(mcore_config(RAW, **config), 0, arch.layer_types, arch.indexer_types, "dense", "megatron")
    filled = load_from_hf(layer, hf_layer_state(hf, "self_attn."), arch, 0, only="self_attention.")
    assert set(filled) == {n for n, _ in layer.self_attention.named_parameters(prefix="self_attention")}
    return arch, hf, layer.self_attention


def _x(b, s, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, HIDDEN, generator=gen), torch.randn(b, s, HIDDEN, generator=gen)


def _check_grads(attn, hf, arch, x_ours, x_hf):
    want = hf_grads_as_mcore(hf, "self_attn.", arch, 0, only="self_attention.")
    got = {n: p.grad for n, p in attn.named_parameters(prefix="self_attention")}
    assert set(got) == set(want)
    for name, g in got.items():
        err = ((g - want[name]).abs().max() / want[name].abs().max()).item()
        assert err <= TOL, f"grad {name}: {err:.2e}"
    assert rel_diff(x_ours.grad.transpose(0, 1), x_hf.grad) <= TOL


def test_layer_matches_transformers(model_parallel):
    arch, hf, attn = make_pair(seed=0)
    x, g = _x(2, 80, seed=5)
    x_hf = x.clone().requires_grad_()
    want = hf(x_hf)
    x_ours = x.transpose(0, 1).clone().requires_grad_()
    got, bias = attn(x_ours)
    assert bias is None and got.shape == (80, 2, HIDDEN)
    assert rel_diff(got.transpose(0, 1), want) <= TOL
    (want * g).sum().backward()
    (got.transpose(0, 1) * g).sum().backward()
    _check_grads(attn, hf, arch, x_ours, x_hf)


def test_thd_packing_equals_transformers_per_document(model_parallel):
    _, hf, attn = make_pair(seed=1)
    lengths = [30, 3, 67]
    cu = torch.tensor([0, 30, 33, 100], dtype=torch.int32)
    x, _ = _x(1, 100, seed=6)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=67, max_seqlen_kv=67)
    with torch.no_grad():
        packed, _ = attn(x[0][:, None], packed_seq_params=psp)
        for i, n in enumerate(lengths):
            a = int(cu[i])
            assert rel_diff(packed[a : a + n, 0], hf(x[:, a : a + n])[0]) <= TOL, f"doc {i}"


def test_left_padding_mask_matches_transformers(model_parallel):
    """Row 1 left-padded by 7 tokens: a dense causal + padding mask for us, the 2-D padding mask for transformers
    (which zeroes pad inputs); real rows and their gradients agree."""
    arch, hf, attn = make_pair(seed=2)
    b, s, pad = 2, 40, 7
    x, g = _x(b, s, seed=7)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :pad] = False
    g = g * valid[..., None]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None] & valid[:, None, :] & valid[:, :, None]
    x_hf = x.clone().requires_grad_()
    want = hf(x_hf, attention_mask=valid)
    x_ours = x.transpose(0, 1).clone().requires_grad_()
    got, _ = attn(x_ours, attention_mask=~allowed[:, None])
    got = got.transpose(0, 1)
    assert rel_diff(got * valid[..., None], want * valid[..., None]) <= TOL
    (want * g).sum().backward()
    (got * g).sum().backward()
    _check_grads(attn, hf, arch, x_ours, x_hf)


def test_fla_kernel_refusals(model_parallel, monkeypatch):
    from megatron_glm5.glm5_next import kda as kda_mod

    _, _, attn = make_pair(seed=3)
    x = torch.randn(8, 1, HIDDEN)
    attn.kernel = "auto"  # CPU tensors: the torch path whatever is installed
    out_auto, _ = attn(x)
    attn.kernel = "torch"
    assert torch.equal(attn(x)[0], out_auto)
    attn.kernel = "fla"
    monkeypatch.setattr(kda_mod, "fla_chunk_kda", lambda: None)
    with pytest.raises(ImportError, match="pip install flash-linear-attention"):
        attn(x)
    monkeypatch.setattr(kda_mod, "fla_chunk_kda", lambda: object())
    with pytest.raises(ValueError, match="CUDA tensors only"):
        attn(x)
