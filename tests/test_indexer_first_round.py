"""The select's first radix round counted by the logits kernel (``MEGATRON_GLM5_INDEXER_FUSED_HIST``): the torch
oracle of the count (``first_round_histogram``) and its key (``select_score_key``) against first principles, and the
interface's wiring of the two kernels (fakes: the kernels themselves are compared on the GPU,
``tests/gpu/test_kernels_gpu.py::test_fused_first_round_*``)."""

from __future__ import annotations

import importlib

import pytest
import torch

im = importlib.import_module("megatron_glm5.kernels.indexer_topk")  # the package exports a same-named function


def test_score_key_orders_like_the_floats_and_merges_the_zeros():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(5000, generator=g) * 10.0 ** torch.randint(-40, 38, (5000,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38])])
    x = x[torch.isfinite(x) | torch.isinf(x)]
    order = torch.argsort(x, stable=True)
    xs, ks = x[order], im.select_score_key(x)[order]
    assert (ks[1:] >= ks[:-1]).all()
    same_value = xs[1:] == xs[:-1]  # includes -0.0 == +0.0
    assert torch.equal(ks[1:] == ks[:-1], same_value)
    assert im.select_score_key(torch.tensor([0.0]))[0] == im.select_score_key(torch.tensor([-0.0]))[0] == 0x80000000


def test_first_round_histogram_counts_each_rows_clamped_range():
    g = torch.Generator().manual_seed(1)
    t_len, t_kv, n_rows, row0 = 40, 33, 17, 9
    logits = torch.randn(n_rows, t_kv, generator=g) * 3
    logits[:, ::5] = 0.0
    logits[:, 1::7] = -0.0
    starts = torch.randint(-5, 40, (t_len,), generator=g, dtype=torch.int32)
    ends = torch.randint(-5, 45, (t_len,), generator=g, dtype=torch.int32)
    got = im.first_round_histogram(logits, starts, ends, row0)
    assert got.dtype == torch.int32 and got.shape == (n_rows, 256)
    for r in range(n_rows):
        s = min(max(int(starts[row0 + r]), 0), t_kv)
        e = max(min(int(ends[row0 + r]), t_kv), s)  # the select's clamp
        want = [0] * 256
        for j in range(s, e):
            bits = int(logits[r, j].view(torch.int32)) & 0xFFFFFFFF
            mag = bits & 0x7FFFFFFF
            key = 0x80000000 - mag if bits >> 31 else 0x80000000 + mag
            want[key >> 24] += 1
        assert got[r].tolist() == want, r


def test_switch_reads_the_environment_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv(im.INDEXER_FUSED_HIST_ENV, raising=False)
    assert im.fused_first_round() is im.INDEXER_FUSED_HIST is False
    monkeypatch.setenv(im.INDEXER_FUSED_HIST_ENV, "1")
    assert im.fused_first_round()
    monkeypatch.setenv(im.INDEXER_FUSED_HIST_ENV, "yes")
    with pytest.raises(ValueError, match="MEGATRON_GLM5_INDEXER_FUSED_HIST='yes'"):
        im.fused_first_round()


@pytest.mark.parametrize("on", [False, True])
def test_interface_hands_the_counts_from_the_logits_kernel_to_the_select(monkeypatch, on):
    calls = []

    def logits_factory(*args):
        def run(*tensors):
            calls.append(("logits", args, [tuple(t.shape) for t in tensors[6:]]))
            tensors[6].fill_(1.0)
            if len(tensors) > 7:
                tensors[7].fill_(0)
        return run

    def select_factory(*args, **kwargs):
        def run(*tensors):
            calls.append(("select", args, kwargs, tuple(tensors[1].shape)))
            tensors[-1].fill_(0)
        return run

    monkeypatch.setattr(im, "_jit_logits_plain", lambda: logits_factory)
    monkeypatch.setattr(im, "_jit_select", lambda: select_factory)
    monkeypatch.setenv(im.INDEXER_FUSED_HIST_ENV, "1" if on else "0")
    monkeypatch.delenv(im.LOGITS_OVERLAP_ENV, raising=False)
    t = 10
    q = torch.zeros(t, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(t, 128, dtype=torch.bfloat16)
    w = torch.zeros(t, 32)
    starts = torch.zeros(t, dtype=torch.int32)
    ends = torch.arange(1, t + 1, dtype=torch.int32)
    im.indexer_topk_interface(q, k, w, starts, ends, 4, chunk_rows=4)  # chunks of 4, 4, 2 rows
    logits_calls = [c for c in calls if c[0] == "logits"]
    select_calls = [c for c in calls if c[0] == "select"]
    if on:
        assert logits_calls[0][1] == (32, 128, 128, 128, 2, 0, True)
        assert [c[2] for c in logits_calls] == [[(4, t), (4, 256)], [(4, t), (4, 256)], [(2, t), (2, 256)]]
        assert select_calls[0][1:3] == ((4,), {"pre_hist": True})
        assert [c[3] for c in select_calls] == [(4, 256), (4, 256), (2, 256)]
    else:
        assert logits_calls[0][1] == (32, 128) and [c[2] for c in logits_calls] == [[(4, t)], [(4, t)], [(2, t)]]
        # no counts: the select's second argument is the bounds' starts
        assert select_calls[0][1:3] == ((4,), {}) and [c[3] for c in select_calls] == [(t,), (t,), (t,)]


@pytest.mark.parametrize("raw, heads, expect", [
    (None, 32, ("plain", (32, 128))),
    ("", 32, ("plain", (32, 128))),
    ("3", 32, ("overlap", (32, 128, 64, 128, 2, 3))),
    ("4", 32, ("overlap", (32, 128, 64, 128, 2, 4))),
    ("0", 32, ("plain", (32, 128))),
    ("3", 16, ("plain", (16, 128))),  # not a screened shape: the plain kernel, the switch logged once
])
def test_logits_kernel_honours_the_overlap_switch_at_the_screened_shape(monkeypatch, caplog, raw, heads, expect):
    monkeypatch.setattr(im, "_jit_logits_plain", lambda: lambda *a: ("plain", a))
    monkeypatch.setattr(im, "_jit_logits_overlap", lambda: lambda *a: ("overlap", a))
    if raw is None:
        monkeypatch.delenv(im.LOGITS_OVERLAP_ENV, raising=False)
    else:
        monkeypatch.setenv(im.LOGITS_OVERLAP_ENV, raw)
    monkeypatch.setattr(im, "_IGNORED", set())
    with caplog.at_level("WARNING", logger="megatron_glm5"):
        assert im.logits_kernel(heads, 128) == expect
    assert (im.LOGITS_OVERLAP_ENV in caplog.text) == (raw == "3" and heads == 16), caplog.text


def test_overlap_switch_refuses_other_stage_counts(monkeypatch):
    monkeypatch.setenv(im.LOGITS_OVERLAP_ENV, "2")
    with pytest.raises(ValueError, match="MEGATRON_GLM5_LOGITS_OVERLAP='2'"):
        im.logits_overlap_stages()


def test_counted_first_round_is_refused_off_the_screened_shapes():
    with pytest.raises(ValueError, match="screened indexer shapes"):
        im.logits_kernel(16, 128, hist=True)
