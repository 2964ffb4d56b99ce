"""Neighbouring queries' top-k sets merged into one union per group: the index layout of the grouped sparse-MLA
forward (``sparse_mla_fwd.py``, ``group`` > 1), where one CTA serves ``group`` consecutive queries, so each gathered
key row feeds ``group x heads`` rows of MMA (at 16 heads per rank, 4 queries fill the 64-row tensor-core tile that one
query leaves three-quarters empty) and a key shared by several of them is gathered once.

Layout: row ``g`` of the result holds, in ascending key order, every valid key of queries ``g * group ..
g * group + group - 1``, each as ``key | (members << MEMBER_SHIFT)`` where bit ``i`` of ``members`` says that query
``g * group + i`` selected the key; -1 pads the tail. Plain torch (sort, scatter): its cost is a sort of
``group x K`` keys per group, measured next to the kernels it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEMBER_SHIFT = 24
KEY_LIMIT = 1 << MEMBER_SHIFT  # keys must fit below the member bits
MAX_GROUP = 31 - MEMBER_SHIFT  # member bits 24..30; bit 31 (sign) stays clear, so -1 remains the only negative value


def group_union_indices(indices: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(union int32 [ceil(T / group), U], length int32 [ceil(T / group)])`` from top-k ``indices`` int32 ``[T, K]``
    (-1 or anything outside ``[0, KEY_LIMIT)`` is an unused slot; a key listed twice by one query counts once).
    ``U`` is the longest union (at least 1)."""
    if indices.dtype != torch.int32 or indices.dim() != 2:
        raise TypeError(f"indices must be int32 [T, K], got {indices.dtype} {tuple(indices.shape)}")
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group must be in [1, {MAX_GROUP}], got {group}")
    t_len, k = indices.shape
    dev = indices.device
    n_grp = -(-t_len // group)
    if n_grp == 0 or k == 0:
        empty = torch.full((n_grp, 1), -1, dtype=torch.int32, device=dev)
        return empty, torch.zeros(n_grp, dtype=torch.int32, device=dev)
    rows = torch.full((n_grp * group, k), -1, dtype=torch.int64, device=dev)
    rows[:t_len] = indices.long()
    rows = rows.view(n_grp, group * k)
    query = torch.arange(group, device=dev).repeat_interleave(k).expand(n_grp, -1)
    valid = (rows >= 0) & (rows < KEY_LIMIT)
    big = torch.iinfo(torch.int64).max
    # key-major composite so one query's repeats of a key sit side by side and are counted once
    comp, order = torch.where(valid, rows * group + query, big).sort(dim=-1)
    valid_s = comp != big
    key = torch.where(valid_s, comp // group, -1)
    bit = torch.where(valid_s, 1 << (comp % group), 0)
    repeat = torch.zeros_like(valid_s)
    repeat[:, 1:] = comp[:, 1:] == comp[:, :-1]
    bit = torch.where(repeat, 0, bit)
    first = valid_s.clone()
    first[:, 1:] &= key[:, 1:] != key[:, :-1]
    seg = (first.cumsum(dim=-1) - 1).clamp_min(0)  # union slot of each sorted entry
    members = torch.zeros_like(rows).scatter_add_(1, seg, bit)  # distinct bits: the sum is their OR
    dump = rows.shape[1]  # an extra column takes the writes of entries that start no union slot
    ukey = torch.full((n_grp, dump + 1), -1, dtype=torch.int64, device=dev)
    ukey.scatter_(1, torch.where(first, seg, dump), torch.where(first, key, -1))
    length = first.sum(dim=-1)
    width = max(1, int(length.max()))
    slot = torch.arange(width, device=dev)
    union = torch.where(slot < length[:, None], ukey[:, :width] | (members[:, :width] << MEMBER_SHIFT), -1)
    return union.to(torch.int32), length.to(torch.int32)


@dataclass(frozen=True)
class RowMap:
    """Which (query, head) a sparse-MLA kernel's MMA row ``h`` is, for the CTA of row ``t`` of its index tensor:
    head ``h0 + h`` of query ``t`` (``group`` 1), or head ``h % heads`` of query ``t * group + h // heads`` (grouped).
    Plain Python building TileLang expressions at trace time, so both layouts share one kernel body."""

    heads: int
    group: int

    def query(self, t, h):
        return t if self.group == 1 else t * self.group + h // self.heads

    def head(self, h0, h):
        return h0 + h if self.group == 1 else h % self.heads

    def live(self, t, h0, h, t_len):
        """The row holds a real (query, head): padded heads, or queries past the last, are never stored."""
        return h0 + h < self.heads if self.group == 1 else self.query(t, h) < t_len

    def load_query(self, T, t, h, t_len):
        """``query`` clamped for a load (the value of a dead row is masked by ``live``)."""
        return t if self.group == 1 else T.min(self.query(t, h), t_len - 1)

    def member(self, entry, h):
        """Whether row ``h``'s query selected a union entry (grouped layout; a non-negative entry)."""
        return ((entry >> (MEMBER_SHIFT + h // self.heads)) & 1) == 1


def grouped_rows(
    indices: torch.Tensor, heads: int, group: int, union: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(group, union rows, union lengths)`` for the sparse-MLA kernels' grouped mode: ``group`` 0 means
    ``64 // heads``; ``group * heads`` must be 64 (the MMA's row tile); ``union`` is a prebuilt
    :func:`group_union_indices` result (else it is built here)."""
    group = group or 64 // max(heads, 1)
    if group * heads != 64:
        raise ValueError(f"grouped sparse MLA needs group * heads == 64, got group={group}, heads={heads}")
    rows, lengths = union if union is not None else group_union_indices(indices, group)
    return group, rows, lengths


def split_union(union: torch.Tensor, group: int) -> list[set[int]]:
    """Each query's key set back from a union layout (a test oracle's view): ``group`` sets per union row."""
    sets: list[set[int]] = []
    for row in union.tolist():
        per = [set() for _ in range(group)]
        for v in row:
            if v < 0:
                continue
            key, members = v & (KEY_LIMIT - 1), v >> MEMBER_SHIFT
            for i in range(group):
                if members >> i & 1:
                    per[i].add(key)
        sets += per
    return sets
