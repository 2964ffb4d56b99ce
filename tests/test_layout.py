"""TokenLayout: packed (THD) ranges and positions, its bad-input check, and the zigzag CP split against key_order."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_glm5.dsa.layout import TokenLayout


def _thd(cu: list[int], padded: list[int] | None = None) -> PackedSeqParams:
    t = lambda v: None if v is None else torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t(cu), cu_seqlens_kv=t(cu), cu_seqlens_q_padded=t(padded),
                           cu_seqlens_kv_padded=t(padded), max_seqlen_q=8, max_seqlen_kv=8)


def test_thd_uses_padded_boundaries_and_leaves_the_tail_empty():
    layout = TokenLayout.build(10, 1, torch.device("cpu"), _thd([0, 3, 7], padded=[0, 4, 8]))
    assert layout.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 0]
    assert layout.starts.tolist() == [0, 0, 0, 0, 4, 4, 4, 4, 8, 9]
    assert layout.ends.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 8, 9]  # rows past cu[-1]: empty range


def test_thd_cu_seqlens_past_the_input_is_refused():
    with pytest.raises(RuntimeError, match="cu_seqlens ends past the packed input's 6 tokens"):
        TokenLayout.build(6, 1, torch.device("cpu"), _thd([0, 4, 8]))


@pytest.mark.parametrize("cp_size", [2, 3])
def test_zigzag_cp_rows_and_key_order_agree(cp_size):
    local, batch = 4, 2
    full = local * cp_size
    ranks = [TokenLayout.build_zigzag_cp(local, batch, r, cp_size, torch.device("cpu")) for r in range(cp_size)]
    per_rank = [lay.positions[:local] for lay in ranks]  # same positions for every batch entry
    # Every sequence position is held by exactly one rank, and key_order puts the rank-major gather back in order.
    assert sorted(torch.cat(per_rank).tolist()) == list(range(full))
    order = TokenLayout.key_order(local, cp_size, torch.device("cpu"))
    assert torch.cat(per_rank)[order].tolist() == list(range(full))
    for lay, pos in zip(ranks, per_rank):
        assert lay.num_key_rows == batch * full
        b = torch.arange(batch).repeat_interleave(local)
        assert torch.equal(lay.starts.long(), b * full)
        assert torch.equal(lay.ends.long(), b * full + pos.repeat(batch) + 1)  # causal in the global position


def test_flatten_unflatten_round_trip():
    layout = TokenLayout.build(5, 3, torch.device("cpu"))
    x = torch.randn(5, 3, 2)
    rows = layout.flatten(x)
    assert torch.equal(rows[1 * 5 + 2], x[2, 1])  # batch-major rows
    assert torch.equal(layout.unflatten(rows), x)
    with pytest.raises(ValueError, match=r"expected \[s=5, b=3"):
        layout.flatten(x[:4])
