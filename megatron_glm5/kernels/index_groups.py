"""Neighbouring queries' top-k sets merged into one union per group: the index layout of the grouped sparse-MLA
forward (``sparse_mla_fwd.py``, ``group`` > 1), where one CTA serves ``group`` consecutive queries, so each gathered
key row feeds ``group x heads`` rows of MMA (at 16 heads per rank, 4 queries fill the 64-row tensor-core tile that one
query leaves three-quarters empty) and a key shared by several of them is gathered once.

Layout: row ``g`` of the result holds, in ascending key order, every valid key of queries ``g * group ..
g * group + group - 1``, each as ``key | (members << MEMBER_SHIFT)`` where bit ``i`` of ``members`` says that query
``g * group + i`` selected the key; -1 pads the tail.

Built on the GPU by one Triton program per group, with no host sync (rows ``union_width`` wide: the sparse-MLA
kernels stop at each row's length, so the width costs memory, not work): each member's keys set bits in that
member's bitmap (relaxed atomic ORs, L2-resident scratch), then the group's key range is scanned 2048 keys at a time;
a key is in the union where any member's bit is set, its slot the running count. 0.51 ms at 16K tokens, 4 x 2048
keys per group, on one H200; sorting the ``group x K`` composite keys instead (in registers with ``tl.sort``, or by
torch's segmented sort) took 3.85 / 3.23 ms (``docs/design/kernels_round2.md``).
The torch oracle :func:`group_union_indices_reference` (sort, scatter; 9.55 ms at 16K) runs where Triton does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_glm5.kernels._common import HostValues, next_power_of_2, triton_kernels, triton_runs_on

MEMBER_SHIFT = 24
KEY_LIMIT = 1 << MEMBER_SHIFT  # keys must fit below the member bits
MAX_GROUP = 31 - MEMBER_SHIFT  # member bits 24..30; bit 31 (sign) stays clear, so -1 remains the only negative value
UNION_WARPS = 4  # H200, 16K tokens: 0.51 ms (8 warps 0.57); 64K: 3.77 ms (scripts/bench/RESULTS_kernels.md)
_SCRATCH_BYTES = 256 << 20  # the bitmaps' scratch per launch; more groups run in more launches
_BITMAP_BLOCK_WORDS = 64  # 32-bit words (2048 keys) per step of the bitmap scan


def _check(indices: torch.Tensor, group: int) -> None:
    if indices.dtype != torch.int32 or indices.dim() != 2:
        raise TypeError(f"indices must be int32 [T, K], got {indices.dtype} {tuple(indices.shape)}")
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group must be in [1, {MAX_GROUP}], got {group}")


def union_width(k: int, group: int) -> int:
    """The kernels' union row width: ``group x K`` entries rounded up to the power of two the kernels' tiles need."""
    return next_power_of_2(group * next_power_of_2(max(k, 1)))


def _key_bound(indices: torch.Tensor, key_bound: int | None) -> int:
    if key_bound is None:  # one host sync; the sparse-MLA callers pass T_kv
        key_bound = int(indices.max()) + 1 if indices.numel() else 0
    return max(0, min(int(key_bound), KEY_LIMIT))


def group_union_indices(
    indices: torch.Tensor,
    group: int,
    *,
    key_bound: int | None = None,
    num_warps: int = UNION_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(union int32 [ceil(T / group), U], length int32 [ceil(T / group)])`` from top-k ``indices`` int32 ``[T, K]``.

    A slot is used when ``0 <= key < key_bound`` (the sparse-MLA kernels pass ``T_kv``; None: the largest key + 1,
    one host sync; never above ``KEY_LIMIT``); a key listed twice by one query counts once. ``U`` is at least the
    longest union (:func:`union_width` from the kernels, no host sync; the longest from the oracle); every entry of
    a row past its length is -1. ``num_warps``: a sweep's knob."""
    _check(indices, group)
    t_len, k = indices.shape
    n_grp = -(-t_len // group)
    if n_grp == 0 or k == 0 or not triton_runs_on(indices) or _triton() is None:
        return group_union_indices_reference(indices, group, key_bound=key_bound)
    bound = _key_bound(indices, key_bound)
    dev = indices.device
    width = union_width(k, group)
    length = torch.empty(n_grp, dtype=torch.int32, device=dev)
    union = torch.full((n_grp, width), -1, dtype=torch.int32, device=dev)
    n_words = max(1, -(-bound // 32))
    per_launch = max(1, min(n_grp, _SCRATCH_BYTES // (4 * group * n_words)))
    scratch = torch.zeros(per_launch, group, n_words, dtype=torch.int32, device=dev)  # left zeroed by each program
    idx = indices if indices.stride(1) == 1 else indices.contiguous()
    for g0 in range(0, n_grp, per_launch):
        _triton()[(min(per_launch, n_grp - g0),)](
            idx, union, length, scratch, g0, t_len, k, idx.stride(0), bound, n_words, GROUP=group,
            KP=next_power_of_2(k), WIDTH=width, SHIFT=MEMBER_SHIFT, BLOCK_W=_BITMAP_BLOCK_WORDS, num_warps=num_warps)
    return union, length


def group_union_indices_reference(
    indices: torch.Tensor, group: int, *, key_bound: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of :func:`group_union_indices` in plain torch; ``U`` is the longest union (at least 1), which
    costs one host sync."""
    _check(indices, group)
    bound = KEY_LIMIT if key_bound is None else _key_bound(indices, key_bound)
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
    valid = (rows >= 0) & (rows < bound)
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


GROUPED_HEADS = 16  # the heads per rank the grouped kernels were measured at (4 queries x 16 heads = 64 rows)
# The grouped backward's break-even sharing (valid (query, key) pairs per union entry), its 0.5 ms union rebuild
# included: H200, 16K tokens, 16 heads, 0.81x at 1.93 (random sets), 1.05x at 2.27, 1.65x at 3.26
# (scripts/bench/RESULTS_kernels.md, round 2, second session).
GROUPED_BWD_MIN_SHARING = 2.25
# The most query tokens per call the grouped route takes. Measured with the ping-pong forward (H200, 16 heads,
# forward + backward against the per-query kernels): 16K 1.02x / 1.66x on random / 90 %-local sets, 32K 1.00x /
# 1.64x, 64K 0.98x / 1.60x; one forward + backward's extra memory over its inputs at 64K 1.50 GiB against 2.15
# per-query (with the ws forward; the union is dropped after the forward). Past 64K the union build grows faster than the kernels (3.8 ms at 64K, 12.4
# at 128K): not measured, so per-query there (scripts/bench/RESULTS_kernels.md, round 2, fourth session).
GROUPED_MAX_TOKENS = 65536


def grouped_group(heads: int, *, deterministic: bool, with_target: bool, tokens: int) -> int:
    """The group the autograd path uses for these heads: ``64 // heads`` at :data:`GROUPED_HEADS` heads and at most
    :data:`GROUPED_MAX_TOKENS` query tokens, 1 (the per-query kernels) otherwise or where the grouped backward has no
    variant (deterministic dKV, attention target)."""
    if heads != GROUPED_HEADS or deterministic or with_target or tokens > GROUPED_MAX_TOKENS:
        return 1
    return 64 // heads


@dataclass
class SharingProbe:
    """How many valid (query, key) pairs each union entry serves, measured in the forward and read by the backward
    without a host sync (:class:`~megatron_glm5.kernels._common.HostValues`)."""

    values: HostValues

    @classmethod
    def start(cls, valid_len: torch.Tensor, union_len: torch.Tensor) -> "SharingProbe":
        return cls(HostValues(torch.stack([valid_len.sum(dtype=torch.int64), union_len.sum(dtype=torch.int64)])))

    def sharing(self) -> float:
        pairs, entries = self.values.get()
        return pairs / entries if entries else 0.0


@triton_kernels
def _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def bitmap(IDX, UNION, LENGTH, SCRATCH, g0, t_len, k, stride_t, bound, n_words, GROUP: tl.constexpr,
               KP: tl.constexpr, WIDTH: tl.constexpr, SHIFT: tl.constexpr, BLOCK_W: tl.constexpr):
        # One program per group: each member's keys set bits in its own zeroed bitmap (relaxed atomic ORs to L2),
        # then the group's key range is scanned a block of words at a time: a key is in the union where any
        # member's bit is set, its slot the running count of such keys (ascending key order, as in the oracle).
        # The program zeroes the words it read, so the scratch serves the next launch as it was given.
        gl = tl.program_id(0)
        g = g0 + gl
        i = tl.arange(0, WIDTH)
        member = i // KP
        query = g * GROUP + member
        ok = (member < GROUP) & (i % KP < k) & (query < t_len)
        key = tl.load(IDX + query.to(tl.int64) * stride_t + i % KP, mask=ok, other=-1)
        ok = ok & (key >= 0) & (key < bound)
        maps = SCRATCH + gl.to(tl.int64) * GROUP * n_words
        tl.atomic_or(maps + member * n_words + (key >> 5), 1 << (key & 31), mask=ok, sem="relaxed")
        lo = tl.min(tl.where(ok, key, bound), axis=0) >> 5
        hi = tl.max(tl.where(ok, key, -1), axis=0) >> 5  # -1 >> 5 == -1: an empty group scans nothing
        tl.debug_barrier()
        row = UNION + g.to(tl.int64) * WIDTH
        bit = tl.arange(0, 32)
        w_off = tl.arange(0, BLOCK_W)
        count = 0
        for w0 in range(lo, hi + 1, BLOCK_W):
            w = w0 + w_off
            inb = w <= hi
            members = tl.zeros([BLOCK_W, 32], dtype=tl.int32)
            for m in tl.static_range(GROUP):
                word = tl.load(maps + m * n_words + w, mask=inb, other=0, cache_modifier=".cg")
                members |= ((word[:, None] >> bit[None, :]) & 1) << m
            tl.debug_barrier()  # the words are replicated over warps: every copy is read before any is cleared
            for m in tl.static_range(GROUP):
                tl.store(maps + m * n_words + w, tl.zeros([BLOCK_W], dtype=tl.int32), mask=inb)
            present = tl.reshape((members != 0).to(tl.int32), [BLOCK_W * 32])
            slot = count + tl.cumsum(present, axis=0) - 1
            entry = tl.reshape((w[:, None] * 32 + bit[None, :]) | (members << SHIFT), [BLOCK_W * 32])
            tl.store(row + slot, entry, mask=present != 0)
            count += tl.sum(present, axis=0)
        tl.store(LENGTH + g, count)

    return bitmap


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


def grouped_tile_rows(heads: int, group: int, row_tiles: tuple[int, ...] = (64,)) -> int:
    """The MMA rows of a grouped kernel's CTA, ``group * heads``, which must be one of the kernel's ``row_tiles``
    (64; the backward also takes 32); group 1 is the per-query layout (no member bits), so never grouped."""
    if group < 2 or group * heads not in row_tiles:
        tiles = " or ".join(map(str, row_tiles))
        raise ValueError(f"grouped sparse MLA needs group >= 2 and group * heads == {tiles}, got group={group} "
                         f"(group 0 resolves to 64 // heads), heads={heads}")
    return group * heads


def grouped_rows(
    indices: torch.Tensor,
    heads: int,
    group: int,
    union: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_bound: int | None = None,
    row_tiles: tuple[int, ...] = (64,),
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(group, union rows, union lengths)`` for the sparse-MLA kernels' grouped mode: ``group`` 0 means
    ``64 // heads``; ``group * heads`` must be one of ``row_tiles`` (the kernel's MMA row tiles: 64, or for the
    backward also 32); ``union`` is a prebuilt :func:`group_union_indices` result (else it is built here, keys below
    ``key_bound``: the kernels' ``T_kv``)."""
    group = group or 64 // max(heads, 1)
    grouped_tile_rows(heads, group, row_tiles)
    rows, lengths = union if union is not None else group_union_indices(indices, group, key_bound=key_bound)
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
