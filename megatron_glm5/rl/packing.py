"""How a packed RL batch (``input_ids [T]``, ``cu_seqlens [n+1]``) becomes this rank's model input, and where every
token of it lands: the grid of (sample, position) pairs a rank's attention and routers see, which is what replayed
top-k and routing choices are sharded by.

Two layouts, chosen by context parallelism:

* **THD** (CP = 1): the sequences stay packed (``PackedSeqParams``, ``qkv_format="thd"``); the token axis is padded to
  a multiple of the TP size under sequence parallelism, the padding forming one extra sequence at the end (so
  megatron-core's THD RoPE and our causal ranges see a consistent packing). Model input ``[1, T_pad]``.
* **bshd zigzag** (CP > 1): the ``tilelang`` backend's context parallelism takes bshd input only, so each sequence is
  right-padded to a common length ``S`` (a multiple of ``2 * CP * TP``) and every CP rank takes megatron's
  load-balanced chunks ``r`` and ``2 CP - 1 - r`` of every row. Model input ``[n, S / CP]``. Right padding never
  changes a real token's output (causal attention; nothing attends to a later token), so the cost is only compute.

Either way the model's activations are ``[s, b, h]`` with ``s`` the rank's sequence length (``T_pad`` or ``S / CP``)
and ``b`` the batch (1 or ``n``); under sequence parallelism each TP rank holds rows ``[t s / TP, (t + 1) s / TP)`` of
it. :class:`RankPlan` describes that grid; a key row (the value of a top-k index) is ``cu_seqlens[i] + pos`` (THD) or
``i * S + pos`` (bshd): a global row of the flattened key axis, as :mod:`megatron_glm5.dsa.layout` defines it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True, slots=True)
class ParallelSizes:
    tp: int = 1
    tp_rank: int = 0
    sp: bool = False
    cp: int = 1
    cp_rank: int = 0

    @classmethod
    def of(cls, config) -> "ParallelSizes":
        """This rank's sizes from megatron-core's parallel state and the model config."""
        from megatron.core import parallel_state as ps

        tp = config.tensor_model_parallel_size
        cp = config.context_parallel_size
        return cls(
            tp=tp,
            tp_rank=ps.get_tensor_model_parallel_rank() if tp > 1 else 0,
            sp=bool(config.sequence_parallel) and tp > 1,
            cp=cp,
            cp_rank=ps.get_context_parallel_rank() if cp > 1 else 0,
        )


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """A packed batch of ``n`` sequences: ``input_ids`` int64 ``[T]``; ``cu_seqlens``, a host tuple of ``n + 1``
    ints."""

    input_ids: torch.Tensor
    cu_seqlens: tuple[int, ...]

    @classmethod
    def build(cls, input_ids: torch.Tensor, cu_seqlens) -> "PackedBatch":
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1:
            raise ValueError(f"input_ids must be a 1-D packed token tensor [T], got shape {tuple(ids.shape)}")
        cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and strictly increase (no empty sequence), got {cu}")
        if cu[-1] != ids.numel():
            raise ValueError(f"cu_seqlens ends at {cu[-1]} but input_ids has {ids.numel()} tokens")
        return cls(input_ids=ids.long(), cu_seqlens=tuple(cu))

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:])]

    def next_token_mask(self) -> torch.Tensor:
        """bool ``[T]``: True where the next token belongs to the same sequence (every token but each last one)."""
        mask = torch.ones(self.num_tokens, dtype=torch.bool)
        mask[torch.tensor(self.cu_seqlens[1:]) - 1] = False
        return mask

    def next_token_ids(self) -> torch.Tensor:
        """int64 ``[T]``: ``input_ids[t + 1]`` within each sequence, 0 at each sequence's last token."""
        nxt = torch.zeros_like(self.input_ids)
        nxt[:-1] = self.input_ids[1:]
        return torch.where(self.next_token_mask().to(nxt.device), nxt, torch.zeros_like(nxt))


@dataclass(frozen=True, slots=True)
class RankPlan:
    """This rank's view of a :class:`PackedBatch` (see module docstring).

    ``sample``/``position`` are int64 ``[s, b]``: the (sequence, position) of each activation row of the rank's
    sequence (all TP ranks of a CP rank share it), -1 / 0 on padding rows. ``key_base`` int64 ``[n]``: the key row of
    each sequence's position 0 (``cu_seqlens`` or ``i * S``)."""

    thd: bool
    batch: PackedBatch
    sizes: ParallelSizes
    seqlen: int  # s: the rank's (CP-local) sequence length
    width: int  # b
    padded_len: int  # THD: T_pad; bshd: S (full, pre-CP) row length
    sample: torch.Tensor
    position: torch.Tensor
    key_base: torch.Tensor

    @classmethod
    def build(cls, batch: PackedBatch, sizes: ParallelSizes) -> "RankPlan":
        n = len(batch.lengths)
        sp_div = sizes.tp if sizes.sp else 1
        if sizes.cp == 1:
            t_pad = _round_up(batch.num_tokens, sp_div)
            sample = torch.full((t_pad,), -1, dtype=torch.int64)
            position = torch.zeros(t_pad, dtype=torch.int64)
            for i, (a, b) in enumerate(zip(batch.cu_seqlens, batch.cu_seqlens[1:])):
                sample[a:b] = i
                position[a:b] = torch.arange(b - a)
            key_base = torch.tensor(batch.cu_seqlens[:-1], dtype=torch.int64)
            return cls(thd=True, batch=batch, sizes=sizes, seqlen=t_pad, width=1, padded_len=t_pad,
                       sample=sample[:, None], position=position[:, None], key_base=key_base)
        full = _round_up(max(batch.lengths), 2 * sizes.cp * sp_div)
        local = full // sizes.cp
        cols = zigzag_columns(full, sizes.cp, sizes.cp_rank)  # [local] positions of this CP rank
        lengths = torch.tensor(batch.lengths, dtype=torch.int64)
        position = cols[:, None].expand(local, n).clone()
        sample = torch.where(position < lengths[None, :], torch.arange(n)[None, :], torch.full_like(position, -1))
        key_base = torch.arange(n, dtype=torch.int64) * full
        return cls(thd=False, batch=batch, sizes=sizes, seqlen=local, width=n, padded_len=full,
                   sample=sample, position=position, key_base=key_base)

    # ---------------------------------------------------------------------------------------------------- rows

    @property
    def local_rows(self) -> slice:
        """The rows ``[s_l]`` of ``[s, b]`` this TP rank holds under sequence parallelism (all rows without SP)."""
        if not self.sizes.sp:
            return slice(0, self.seqlen)
        part = self.seqlen // self.sizes.tp
        return slice(self.sizes.tp_rank * part, (self.sizes.tp_rank + 1) * part)

    def key_rows(self) -> torch.Tensor:
        """int64 ``[s, b]``: each row's own key row (its causal range's last key), for rows of real tokens and padding
        alike (THD padding rows are their own sequence; bshd padding sits after its row's tokens)."""
        if self.thd:
            return torch.arange(self.seqlen, dtype=torch.int64)[:, None]
        return torch.arange(self.width, dtype=torch.int64)[None, :] * self.padded_len + self.position

    # ---------------------------------------------------------------------------------------------------- model input

    def model_inputs(self, device) -> dict:
        """kwargs for ``GPTModel.forward``: ``input_ids``/``position_ids`` ``[b, s]``, ``attention_mask=None``, the THD
        ``packed_seq_params`` (THD layout only)."""
        ids = self.batch.input_ids.to(device)
        if self.thd:
            t, t_pad = self.batch.num_tokens, self.seqlen
            tokens = torch.zeros(t_pad, dtype=torch.int64, device=device)
            tokens[:t] = ids
            cu = list(self.batch.cu_seqlens) + ([t_pad] if t_pad > t else [])
            position = self.position[:, 0].clone()
            if t_pad > t:
                position[t:] = torch.arange(t_pad - t)
            return dict(input_ids=tokens[None], position_ids=position.to(device)[None], attention_mask=None,
                        packed_seq_params=packed_seq_params(cu, device))
        n, full = self.width, self.padded_len
        grid = torch.zeros(n, full, dtype=torch.int64, device=device)
        for i, (a, b) in enumerate(zip(self.batch.cu_seqlens, self.batch.cu_seqlens[1:])):
            grid[i, : b - a] = ids[a:b]
        cols = self.position[:, 0].to(device)
        return dict(input_ids=grid[:, cols], position_ids=cols[None].expand(n, -1).contiguous(), attention_mask=None)

    def targets(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(target ids, valid)`` for the rank's output rows, in the order the logits come out (``[b, s]`` flattened
        batch-major): the next token of the same sequence, and whether there is one."""
        nxt = self.batch.next_token_ids()
        has = self.batch.next_token_mask()
        sample, pos = self.sample.t().reshape(-1), self.position.t().reshape(-1)  # [b * s]
        real = sample >= 0
        flat = torch.where(real, self.key_base_cu()[sample.clamp_min(0)] + pos, torch.zeros_like(pos))
        target = torch.where(real, nxt[flat], torch.zeros_like(flat))
        valid = real & has[flat]
        return target.to(device), valid.to(device)

    def key_base_cu(self) -> torch.Tensor:
        """Packed-token offset of each sequence (``cu_seqlens[:-1]``), whatever the layout."""
        return torch.tensor(self.batch.cu_seqlens[:-1], dtype=torch.int64)

    def packed_index(self) -> torch.Tensor:
        """int64 ``[b * s]`` (output-row order): the packed token each row holds, -1 on padding."""
        sample, pos = self.sample.t().reshape(-1), self.position.t().reshape(-1)
        return torch.where(sample >= 0, self.key_base_cu()[sample.clamp_min(0)] + pos, torch.full_like(pos, -1))


def zigzag_columns(full: int, cp: int, rank: int) -> torch.Tensor:
    """Sequence positions CP rank ``rank`` holds under megatron's load-balanced split (chunks r and 2 cp - 1 - r)."""
    chunk = full // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def packed_seq_params(cu_seqlens, device):
    """megatron-core ``PackedSeqParams`` for THD packing with these boundaries."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)
    longest = int(max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)
