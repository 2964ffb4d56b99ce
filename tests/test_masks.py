"""Masks, positions and replayed top-k are honoured or refused, never silently ignored: dense masks become per-row
key ranges (causal, documents, padding), position ids must be the positions attention uses, a replayed top-k must be
causal and in range, and Megatron-LM flags whose document boundaries would not reach attention are refused."""

from __future__ import annotations

import argparse

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_glm5.config import GLM5ConfigError
from megatron_glm5.dsa.masks import key_ranges
from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint

S = 40  # > index_topk (16)


def _causal(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = blocked (megatron-core)


def test_key_ranges_of_causal_document_and_padding_masks():
    s = 6
    starts, ends = key_ranges(_causal(s), s, 2)  # broadcast over a batch of 2: global rows
    assert starts.tolist() == [0] * 6 + [6] * 6 and ends.tolist() == list(range(1, 13))
    docs = _causal(s).clone()
    docs[..., 3:, :3] = True
    assert [t.tolist() for t in key_ranges(docs, s, 1)] == [[0, 0, 0, 3, 3, 3], [1, 2, 3, 4, 5, 6]]
    left = _causal(s).clone()
    left[..., :2] = True  # two pad tokens on the left: their rows allow nothing (empty range)
    assert [t.tolist() for t in key_ranges(left, s, 1)] == [[0, 1, 2, 2, 2, 2], [0, 1, 3, 4, 5, 6]]
    additive = torch.zeros(1, 1, s, s).masked_fill(_causal(s), float("-inf"))  # HF-style float mask
    additive[..., 4:] = float("-inf")  # right padding: keys 4, 5 blocked for every row
    assert [t.tolist() for t in key_ranges(additive, s, 1)] == [[0] * 6, [1, 2, 3, 4, 4, 4]]


def test_key_ranges_in_several_passes_equal_one_pass(monkeypatch):
    from megatron_glm5.dsa import masks

    s = 40
    docs = _causal(s).expand(2, 1, s, s).clone()
    docs[0, :, 17:, :17] = True
    docs[1, :, :, :5] = True
    one = masks._ranges(docs, s, 2)
    from megatron_glm5.kernels import mask_ranges

    monkeypatch.setattr(mask_ranges, "ROW_CHUNK", 7)
    monkeypatch.setattr(mask_ranges, "CHUNK_ELEMENTS", 2 * 7 * s)  # 7 rows per pass: 6 passes, the last one short
    several = masks._ranges(docs, s, 2)
    assert all(torch.equal(a, b) for a, b in zip(one, several))
    assert one[0][0, 20].item() == 17 and one[0][1, 3].item() == 3  # a document start; a padded row's empty range


@pytest.mark.parametrize("where", ["future", "gap"])
def test_masks_that_are_not_one_causal_range_are_refused(where):
    mask = _causal(6).clone()
    if where == "future":
        mask[..., 1, 3] = False
    else:
        mask[..., 4, 1] = True  # row 4 allows 0, 2, 3, 4: two runs
    with pytest.raises(RuntimeError, match="every row must allow one contiguous range of keys"):
        key_ranges(mask, 6, 1)


def test_key_ranges_are_computed_once_per_mask_storage():
    mask = _causal(8)
    first = key_ranges(mask, 8, 1)
    assert key_ranges(mask.detach(), 8, 1) is first  # a recompute sees a detached view of the same storage
    mask[..., 7, 0] = True  # an in-place change is seen
    assert key_ranges(mask, 8, 1) is not first


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_glm52_config(), seed=3)


def _model(path, backend):
    from megatron_glm5 import from_hf_pretrained

    return from_hf_pretrained(path, backend=backend)


def _ids(n=S, seed=0):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_masks_and_positions_change_the_result_or_are_refused(tiny, backend, model_parallel):
    model = _model(tiny, backend)
    ids, pos = _ids(), torch.arange(S)[None]
    with torch.no_grad():
        plain = model(ids, pos, None)
        # Megatron-LM's default causal mask: the same logits
        assert torch.equal(model(ids, pos, _causal(S)), plain)
        # right padding (the last 8 keys blocked for every row): real rows equal the unpadded run
        right = _causal(S).clone()
        right[..., S - 8:] = True
        padded = model(ids, pos, right)
        short = model(ids[:, : S - 8], pos[:, : S - 8], None)
        assert (padded[:, : S - 8] - short).abs().max() < 1e-5
        assert not torch.equal(padded[:, S - 8:], plain[:, S - 8:]), "a padding mask must change the padded rows"
        # shifted positions cannot be honoured by MLA's RoPE: refused, not ignored
        with pytest.raises(RuntimeError, match="position_ids differ from the positions GLM-5.x attention uses"):
            model(ids, pos + 3, None)
        # left padding: tilelang takes RoPE positions from the mask, megatron-core's MLA cannot
        left = _causal(S).clone()
        left[..., :5] = True
        lpos = (torch.arange(S) - 5).clamp(min=0)[None]
        if backend == "tilelang":
            out = model(ids, lpos, left)
            assert (out[:, 5:] - model(ids[:, 5:], pos[:, : S - 5], None)).abs().max() < 1e-5
        else:
            with pytest.raises(RuntimeError, match="megatron backend takes masks whose allowed keys start"):
                model(ids, lpos, left)


def test_document_mask_equals_thd_packing(tiny, model_parallel):
    """Two documents in one row as a block-diagonal mask (tilelang) give the THD-packed result."""
    model = _model(tiny, "tilelang")
    ids = _ids()
    docs = _causal(S).clone()
    docs[..., 25:, :25] = True
    pos = torch.cat([torch.arange(25), torch.arange(S - 25)])[None]
    cu = torch.tensor([0, 25, S], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=25, max_seqlen_kv=25)
    with torch.no_grad():
        masked = model(ids, pos, docs)
        packed = model(ids, pos, None, packed_seq_params=psp)
        assert (masked - packed).abs().max() < 1e-5
        with pytest.raises(ValueError, match="either as THD packing .* or as a dense attention_mask"):
            model(ids, pos, docs, packed_seq_params=psp)


@pytest.mark.parametrize("backend", ["megatron", "tilelang"])
def test_given_topk_must_be_causal_and_in_range(tiny, backend, model_parallel):
    model = _model(tiny, backend)
    ids, pos = _ids(), torch.arange(S)[None]
    attention = model.decoder.layers[0].self_attention
    topk = torch.full((S, 16), -1, dtype=torch.int32)
    topk[:, 0] = torch.arange(S)  # each row attends to itself: valid
    injected = {}
    attention.register_forward_pre_hook(lambda m, a, kw: (a, {**kw, **injected}), with_kwargs=True)
    with torch.no_grad():
        injected.update(dsa_topk=topk, dsa_topk_trusted=False)
        model(ids, pos, None)
        future = topk.clone()
        future[3, 1] = 10  # a future key of row 3
        injected.update(dsa_topk=future)
        with pytest.raises(RuntimeError, match="neither -1 nor inside its query row's causal key range"):
            model(ids, pos, None)
        beyond = topk.clone()
        beyond[S - 1, 1] = S + 4  # past the sequence
        injected.update(dsa_topk=beyond)
        with pytest.raises(RuntimeError, match="neither -1 nor inside its query row's causal key range"):
            model(ids, pos, None)


@pytest.mark.parametrize("flags, message", [
    (dict(reset_attention_mask=True), "--reset-attention-mask: GLM-5.x DSA attention takes document boundaries"),
    (dict(reset_position_ids=True), "--reset-position-ids: .* use --dataloader-inter-document-masking"),
    (dict(reset_position_ids=True, reset_attention_mask=True), "--reset-attention-mask and --reset-position-ids"),
])
def test_megatron_lm_document_flags_that_would_be_ignored_are_refused(flags, message):
    from megatron_glm5.pretrain import check_data_flags
    from megatron_glm5.spec import check_document_masking

    args = argparse.Namespace(reset_attention_mask=False, reset_position_ids=False,
                              dataloader_inter_document_masking=False)
    vars(args).update(flags)
    with pytest.raises(GLM5ConfigError, match=message):
        check_document_masking(args)
    with pytest.raises(SystemExit, match=message):
        check_data_flags(args)
    args.dataloader_inter_document_masking = True  # THD packing: what Megatron-LM's pretrain_gpt.py does right
    check_document_masking(args)
    with pytest.raises(SystemExit, match="reads plain \\[b, s\\] micro-batches"):
        check_data_flags(args)


def test_device_check_messages_fit_cuda():
    """CUDA refuses device-assert messages of 255 bytes or more (the assert itself then fails with another error):
    the one helper every device check goes through enforces the limit on CPU too."""
    from megatron_glm5.device_check import check_on_device

    check_on_device(torch.tensor(True), "x" * 254)
    with pytest.raises(ValueError, match="longer than 254 bytes"):
        check_on_device(torch.tensor(True), "x" * 255)
