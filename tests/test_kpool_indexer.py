"""``megatron_glm5.dsa.kpool_indexer``: document boundaries recovered from a ``TokenLayout`` and the KPool selection
over it (pure torch, no megatron-core model).

* bshd, THD and dense-mask (left padding) layouts give their documents (gaps for padding);
* under zigzag context parallelism a rank's query rows select exactly the index sets of the whole-sequence run,
  although the rank may not hold a document's last rows;
* overlapping key ranges are refused.
"""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.dsa.kpool_indexer import kpool_select, layout_documents
from megatron_glm5.dsa.layout import TokenLayout
from megatron_glm5.dsa.reference import causal_bounds

H, D, P, TOPK = 8, 16, 4, 16


def _rows(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=gen), torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen),
            torch.randn(P, D, generator=gen), torch.rand(n, H, generator=gen) - 0.3)


def _sets(topk: torch.Tensor) -> list[set[int]]:
    return [set(r[r >= 0].tolist()) for r in topk]


def test_documents_of_each_layout():
    assert layout_documents(TokenLayout.build(10, 3, torch.device("cpu"))).tolist() == [0, 10, 20, 30]

    class Packed:
        qkv_format = "thd"
        cu_seqlens_q = torch.tensor([0, 7, 9, 20], dtype=torch.int32)
        cu_seqlens_q_padded = None

    assert layout_documents(TokenLayout.build(24, 1, torch.device("cpu"), Packed())).tolist() == [0, 7, 9, 20, 24]
    s, pad = 12, 3
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, :pad] = False
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None] & valid[:, None, :] & valid[:, :, None]
    layout = TokenLayout.build(s, 2, torch.device("cpu"), attention_mask=~allowed[:, None])
    assert layout_documents(layout).tolist() == [0, 12, 15, 24]  # [12, 15) is padding: a gap no query sees


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zigzag_cp_rank_selects_like_the_whole_sequence(cp_size):
    b, full = 2, 64
    local = full // cp_size
    q, k, gate, ape, w = _rows(b * full, seed=cp_size)
    whole = TokenLayout.build(full, b, torch.device("cpu"))
    want = kpool_select(q, k, gate, ape, w, whole, index_topk=TOPK, select_tail=True)
    order = TokenLayout.key_order(local, cp_size, torch.device("cpu"))  # gathered rank-major rows -> sequence order
    natural = torch.empty_like(order)
    natural[order] = torch.arange(order.numel())
    for rank in range(cp_size):
        layout = TokenLayout.build_zigzag_cp(local, b, rank, cp_size, torch.device("cpu"))
        pos = natural[rank * local:(rank + 1) * local]  # this rank's local rows -> sequence positions
        rows = (torch.arange(b)[:, None] * full + pos[None]).reshape(-1)
        got = kpool_select(q[rows], k, gate, ape, w[rows], layout, index_topk=TOPK, select_tail=True)
        assert got.shape == (b * local, TOPK + P - 1)
        assert _sets(got) == _sets(want[rows]), f"rank {rank}"


def test_overlapping_ranges_are_refused():
    layout = TokenLayout.build(8, 1, torch.device("cpu"))
    starts, ends = causal_bounds(torch.tensor([0, 8], dtype=torch.int32))
    starts = starts.clone()
    starts[6:] = 4  # rows 6, 7 start a "document" at 4 inside rows 0..5's document
    bad = TokenLayout(seqlen=8, batch=1, starts=starts, ends=ends, positions=layout.positions, key_seqlen=8,
                      key_positions=layout.key_positions)
    with pytest.raises(ValueError, match=r"key ranges starting at rows 0 and 4 overlap"):
        layout_documents(bad)
