"""scripts/bench/memory_peak.py without a GPU: the allocator-trace replay and the grouping by source line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("memory_peak", ROOT / "scripts" / "bench" / "memory_peak.py")
mp = importlib.util.module_from_spec(_spec)
sys.modules["memory_peak"] = mp
_spec.loader.exec_module(mp)


def _frames(*sites):
    return [{"filename": f, "line": line, "name": name} for f, line, name in sites]


TORCH = ("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl")
MOE = ("/x/site-packages/megatron/core/transformer/moe/experts.py", 10, "forward")
ATT = ("/work/main/megatron_glm5/dsa/tilelang_attention.py", 20, "forward")
LAYER = ("/x/site-packages/megatron/core/transformer/transformer_layer.py", 30, "_forward_mlp")


def test_peak_and_live_set():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(TORCH, MOE, LAYER)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames(ATT)},
        {"action": "free_requested", "addr": 1, "size": 100},  # no longer allocated (torch's counter drops here)
        {"action": "alloc", "addr": 3, "size": 30, "frames": _frames(MOE)},
        {"action": "free_completed", "addr": 1, "size": 100},  # the block may be reused now: not counted twice
        {"action": "free_requested", "addr": 9, "size": 5},  # allocated before recording began
        {"action": "alloc", "addr": 4, "size": 120, "frames": _frames(ATT)},  # 1000 + 50 + 30 - 5 + 120 = 1195
        {"action": "free_requested", "addr": 4, "size": 120},
    ]
    peak, live = mp.live_at_peak(events, baseline=1000)
    assert peak == 1195
    assert sorted(ev["addr"] for ev in live) == [2, 3, 4]
    rows = mp.group_by_site(live, depth=1)
    assert rows[0] == ("megatron_glm5/dsa/tilelang_attention.py:20 forward", 170, 2)
    assert rows[1] == ("megatron/core/transformer/moe/experts.py:10 forward", 30, 1)


def test_earlier_peak_wins():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(MOE, LAYER)},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 2, "size": 60, "frames": []},
    ]
    peak, live = mp.live_at_peak(events)
    assert peak == 100 and [ev["addr"] for ev in live] == [1]
    (row,) = mp.group_by_site(live, depth=2)
    assert row == ("megatron/core/transformer/moe/experts.py:10 forward <- "
                   "megatron/core/transformer/transformer_layer.py:30 _forward_mlp", 100, 1)
    assert mp.group_by_site([events[2]]) == [("?", 60, 1)]


def test_tensors_in_cycles_names_the_cycle():
    import torch

    class Node:
        pass

    def make():
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle
        a.kept = torch.zeros(1000)
        plain = torch.ones(10)  # freed by reference counting: not reported
        del plain

    found = mp.tensors_in_cycles(make, is_tensor=lambda t: True)
    assert [(size, shape) for size, shape, _ in found] == [(4000, "(1000,)")]
    assert found[0][2] == ["Node"]

    def make_frame_cycle():
        def inner():
            t = torch.zeros(7)  # noqa: F841 - kept by the frame the exception's traceback holds
            try:
                raise ValueError("x")
            except ValueError as e:
                inner.kept = e  # exception -> traceback -> frame -> locals -> (via inner) the exception
        inner()

    found = mp.tensors_in_cycles(make_frame_cycle, is_tensor=lambda t: True)
    assert any(shape == "(7,)" and any(r.startswith("frame inner") for r in refs) for _, shape, refs in found)


def test_bench_offload_search_doubles_then_bisects():
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("bench_offload", ROOT / "scripts" / "bench" / "bench_offload.py")
    bo = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # bench_offload imports report
    spec.loader.exec_module(bo)
    tried = []

    def attempt(seq):  # fits up to 300000 tokens
        tried.append(seq)
        return dict(ok=seq <= 300000, error=None if seq <= 300000 else "GPU OOM", peak_gb=seq / 1e4, host_gb=0.0)

    args = SimpleNamespace(start=65536, max_seq=1 << 21, bisect_step=8192)
    best, rows = bo.longest(None, args, float("inf"), attempt)
    assert best == 294912  # 36 * 8192 fits, 37 * 8192 = 303104 does not
    assert tried[:4] == [65536, 131072, 262144, 524288] and len(tried) <= 4 + 6
    assert [seq for seq, _ in rows] == sorted(tried)
    best, _ = bo.longest(None, SimpleNamespace(start=65536, max_seq=1 << 21, bisect_step=0), float("inf"), attempt)
    assert best == 262144


def test_graph_holders_finds_saved_tensors_until_backward():
    import torch

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, extra):
            ctx.save_for_backward(x)
            ctx.extra = extra  # a tensor set on ctx: kept as long as the node lives
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            return dy * 2, None

    x = torch.randn(4, 8)
    w = torch.randn(8, 3, requires_grad=True)
    extra = torch.zeros(5)
    h = Keep.apply(x @ w, extra)
    y = h.sum()
    ptrs = {x.data_ptr(), extra.data_ptr()}
    wanted = lambda t: t.data_ptr() in ptrs  # noqa: E731
    found = mp.graph_holders([y, object()], wanted)
    where = sorted(w_ for _, w_, _ in found)
    assert any(w_.startswith("MmBackward0._saved_self") for w_ in where), where
    assert any(w_.endswith("ctx.extra") for w_ in where), where
    assert all(root == "tensor ()" for root, _, _ in found)
    y.backward()  # saved variables released; the ctx attribute stays while the node lives
    found = mp.graph_holders([y], wanted)
    assert [w_.split(".", 1)[1] for _, w_, _ in found] == ["ctx.extra"]
