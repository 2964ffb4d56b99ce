"""The union-of-neighbours index layout (``megatron_glm5.kernels.index_groups``) against per-query sets, on CPU."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.kernels.index_groups import KEY_LIMIT, MEMBER_SHIFT, group_union_indices, split_union


def _sets(indices: torch.Tensor) -> list[set[int]]:
    return [{v for v in row if 0 <= v < KEY_LIMIT} for row in indices.tolist()]


@pytest.mark.parametrize("group", [1, 2, 4, 7])
def test_union_holds_every_query_set_exactly(group):
    g = torch.Generator().manual_seed(group)
    t_len, k = 37, 24
    idx = torch.randint(0, 60, (t_len, k), generator=g, dtype=torch.int32)
    idx[3, 10:] = -1  # -1 tail
    idx[5] = -1  # a row without keys
    idx[7, 4] = idx[7, 2]  # a key listed twice by one query
    idx[9, 0] = KEY_LIMIT + 5  # out of range: unused
    union, length = group_union_indices(idx, group)
    assert union.dtype == torch.int32 and union.shape[0] == -(-t_len // group)
    assert split_union(union, group)[:t_len] == _sets(idx)
    keys = torch.where(union >= 0, union & (KEY_LIMIT - 1), -1)
    for r, n in enumerate(length.tolist()):
        row = keys[r]
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()
        assert torch.equal(row[:n], row[:n].sort().values) and row[:n].unique().numel() == n  # ascending, distinct


def test_union_of_identical_neighbours_is_one_set_with_all_bits():
    idx = torch.arange(16, dtype=torch.int32).expand(8, 16).contiguous()
    union, length = group_union_indices(idx, 4)
    assert length.tolist() == [16, 16] and (union[:, 16:] == -1).all()
    union = union[:, :16]
    assert ((union >> MEMBER_SHIFT) == 0b1111).all() and torch.equal(union[0] & (KEY_LIMIT - 1), torch.arange(16).int())


def test_union_rejects_bad_arguments():
    with pytest.raises(TypeError, match="int32"):
        group_union_indices(torch.zeros(4, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="group"):
        group_union_indices(torch.zeros(4, 4, dtype=torch.int32), 8)
    union, length = group_union_indices(torch.zeros(0, 4, dtype=torch.int32), 4)
    assert union.shape == (0, 1) and length.numel() == 0


def test_grouped_kernels_refuse_a_group_that_does_not_fill_64_rows():
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    q = torch.zeros(8, 32, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 576, dtype=torch.bfloat16)
    idx = torch.full((8, 64), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="group \\* heads == 64"):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512, group=4)
    out = torch.zeros(8, 32, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group \\* heads == 64"):
        sparse_mla_bwd_interface(q, kv, out, torch.zeros(8, 32), out, idx, 1 / 16, 512, group=3)
    with pytest.raises(ValueError, match="atomic dKV only"):
        sparse_mla_bwd_interface(q[:, :16].contiguous(), kv, out[:, :16].contiguous(), torch.zeros(8, 16),
                                 out[:, :16].contiguous(), idx, 1 / 16, 512, group=4, deterministic=True)


_UNION_KERNEL_SCRIPT = """
import torch
from megatron_glm5.kernels.index_groups import KEY_LIMIT, group_union_indices, group_union_indices_reference
for t_len, k, group, hi, seed in [(37, 24, 1, 60, 1), (37, 24, 4, 60, 3), (37, 24, 7, 60, 4), (13, 5, 3, 9, 5),
                                  (40, 64, 4, 100, 6)]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, hi, (t_len, k), generator=g, dtype=torch.int32)
    idx[3, k // 2:] = -1
    idx[5] = -1
    idx[7, 4 % k] = idx[7, 0]  # a key listed twice by one query
    idx[9, 0] = KEY_LIMIT + 5
    bound = None if seed % 2 else 70  # None: the largest key + 1 (capped at KEY_LIMIT); 70 drops some keys
    ref_union, ref_length = group_union_indices_reference(idx, group, key_bound=bound)
    width = ref_union.shape[1]
    union, length = group_union_indices(idx, group, key_bound=bound)
    assert torch.equal(length, ref_length), (t_len, k, group)
    assert torch.equal(union[:, :width], ref_union) and bool((union[:, width:] == -1).all()), (t_len, k, group)
print("OK")
"""


def test_union_kernel_matches_torch_oracle_in_interpreter():
    """The Triton union build (bitmaps, then a scan of the key range) equals the torch oracle, row for row, under
    Triton's interpreter: duplicates, -1 rows and tails, keys past ``key_bound``, groups of 1-7."""
    pytest.importorskip("triton")
    from tests.triton_checks import passed, run_in_interpreter

    assert passed(run_in_interpreter(_UNION_KERNEL_SCRIPT))


def test_union_kernel_compiles_for_sm90():
    """The union kernel compiles for sm_90 at the GLM-5 shape (4 x 2048 keys per group): relaxed atomic ORs, and the
    scan reads the bitmaps from L2 (``.cg``), where the ORs landed."""
    pytest.importorskip("triton")
    from tests.triton_checks import compile_sm90

    from megatron_glm5.kernels.index_groups import _triton

    sig = {"IDX": "*i32", "UNION": "*i32", "LENGTH": "*i32", "SCRATCH": "*i32", "g0": "i32", "t_len": "i32",
           "k": "i32", "stride_t": "i32", "bound": "i32", "n_words": "i32"}
    ptx = compile_sm90(_triton(), sig, dict(GROUP=4, KP=2048, WIDTH=8192, SHIFT=MEMBER_SHIFT, BLOCK_W=64))
    assert "relaxed.or.b32" in ptx and "ld.global.cg" in ptx and "bar.sync" in ptx


def test_sharing_probe_and_grouped_group():
    from megatron_glm5.kernels.index_groups import SharingProbe, grouped_group

    probe = SharingProbe.start(torch.tensor([2048, 2048, 1024, 0], dtype=torch.int32), torch.tensor([2560]))
    assert probe.sharing() == pytest.approx(5120 / 2560)
    assert SharingProbe.start(torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)).sharing() == 0.0
    assert grouped_group(16, deterministic=False, with_target=False, tokens=8) == 4
    assert grouped_group(64, deterministic=False, with_target=False, tokens=8) == 1
    assert grouped_group(16, deterministic=True, with_target=False, tokens=8) == 1
    assert grouped_group(16, deterministic=False, with_target=True, tokens=8) == 1


def test_grouped_route_is_on_by_default_switchable_and_bounded(monkeypatch):
    """The ``tilelang`` attention's grouped sparse MLA is the default (issue 22, third session: GPU tests green, the
    slice's step at parity); ``MEGATRON_GLM5_GROUPED_SPARSE_MLA=0`` keeps the per-query kernels; calls past
    ``GROUPED_MAX_TOKENS`` query tokens (64K: unmeasured past it) take the per-query kernels too."""
    from megatron_glm5 import fusions
    from megatron_glm5.kernels.index_groups import GROUPED_MAX_TOKENS, grouped_group

    monkeypatch.delenv(fusions.GROUPED_SPARSE_MLA_ENV, raising=False)
    assert fusions.enabled(fusions.GROUPED_SPARSE_MLA_ENV)
    monkeypatch.setenv(fusions.GROUPED_SPARSE_MLA_ENV, "0")
    assert not fusions.enabled(fusions.GROUPED_SPARSE_MLA_ENV)
    assert GROUPED_MAX_TOKENS == 65536
    assert grouped_group(16, deterministic=False, with_target=False, tokens=GROUPED_MAX_TOKENS) == 4
    assert grouped_group(16, deterministic=False, with_target=False, tokens=GROUPED_MAX_TOKENS + 1) == 1
    assert grouped_group(32, deterministic=False, with_target=False, tokens=8) == 1


def test_group_one_is_not_a_grouped_layout():
    """``group=0`` resolves to ``64 // heads``; at 64 heads that is 1, the per-query layout, which the grouped
    interfaces refuse (they used to run on union rows with member bits, every slot masked: zeros, no error)."""
    from megatron_glm5.kernels.sparse_mla_bwd import sparse_mla_bwd_interface
    from megatron_glm5.kernels.sparse_mla_fwd import sparse_mla_fwd_interface

    q = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 576, dtype=torch.bfloat16)
    idx = torch.full((8, 64), -1, dtype=torch.int32)
    out = torch.zeros(8, 64, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group >= 2"):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512, group=0)
    with pytest.raises(ValueError, match="group >= 2"):
        sparse_mla_bwd_interface(q, kv, out, torch.zeros(8, 64), out, idx, 1 / 16, 512, group=0)


def test_grouped_backward_is_loaded_with_the_build_the_backward_makes(monkeypatch):
    """``load_grouped_backward`` (called by the first grouped forward that needs gradients) makes the same kernel
    build call as the grouped backward's ``sparse_mla_bwd_interface``, once per parameter set: the backward, which
    takes the grouped kernel only once the sets share enough keys, then finds it loaded instead of stalling a step."""
    from megatron_glm5.kernels import sparse_mla_bwd as bwd

    builds = []

    class Built(Exception):
        pass

    def kernel(*args):
        raise Built

    monkeypatch.setattr(bwd, "_jit_bwd", lambda: lambda *a, **k: builds.append((a, k)) or kernel)
    monkeypatch.setattr(bwd, "_jit_delta", lambda: lambda *a: lambda out, g, lse: torch.zeros(lse.shape))
    monkeypatch.setattr(bwd, "_LOADED_GROUPED_BWD", set())
    t, heads, scale = 8, 16, 0.0625
    q = torch.zeros(t, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(t, 576, dtype=torch.bfloat16)
    idx = torch.arange(t, dtype=torch.int32)[:, None].expand(t, 64).contiguous()
    out = torch.zeros(t, heads, 512, dtype=torch.bfloat16)
    with pytest.raises(Built):
        bwd.sparse_mla_bwd_interface(q, kv, out, torch.zeros(t, heads), out, idx, scale, 512, group=64 // heads,
                                     union=group_union_indices(idx, 64 // heads, key_bound=t))
    bwd.load_grouped_backward(heads, 576, 512, scale, 64 // heads)
    bwd.load_grouped_backward(heads, 576, 512, scale, 64 // heads)
    assert len(builds) == 2 and builds[0] == builds[1]


def test_the_grouped_backward_is_loaded_only_where_a_backward_follows(monkeypatch):
    """``sparse_mla_autograd`` tells the forward whether a backward can follow (grad mode on and an input that
    requires grad), so a no-grad forward (an eval or rollout log-prob pass) builds no backward kernel."""
    from megatron_glm5.kernels import sparse_mla_bwd as bwd

    seen = []
    monkeypatch.setattr(bwd.SparseMLAFunction, "apply", staticmethod(lambda *a: seen.append(a[-1]) or (None, None)))
    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(4, 8, dtype=torch.int32)
    bwd.sparse_mla_autograd(q, kv, idx, 0.0625, grouped=True)  # nothing requires grad
    bwd.sparse_mla_autograd(q.requires_grad_(), kv, idx, 0.0625, grouped=True)
    with torch.no_grad():
        bwd.sparse_mla_autograd(q, kv, idx, 0.0625, grouped=True)
    assert seen == [False, True, False]
