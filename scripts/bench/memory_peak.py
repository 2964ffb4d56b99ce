"""Benchmark: what one fwd+bwd step of the GLM-5-shaped slice holds on the GPU at its peak, by source line. CUDA only.

Why: under full recompute the peak of a long sequence is one layer's recomputed activations in its backward
(``RESULTS_step.md``, long context); which of them dominate decides what to shrink. The step is
``bench_offload.py``'s (same slice, same settings); torch's allocator history records every allocation with its Python
stack, the events are replayed to find the peak of allocated bytes, and the blocks live at that moment are grouped by
the innermost frames outside torch (:func:`live_at_peak`, CPU-tested). Prints and appends a markdown table (bytes,
bytes per token, count) per ``--seqs`` entry.

``--leftover`` instead reports what a step leaves allocated and who holds it; ``--cycles``, the tensors only reference
cycles keep.

    python scripts/bench/memory_peak.py [--recompute full] [--seqs 32768 65536] [--leftover | --cycles] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from collections import defaultdict
from typing import Iterable

GB = 1e9
_MAX_ENTRIES = 2_000_000  # allocator events kept per trace
_TORCH_PATHS = ("/torch/", "/contextlib.py", "/functools.py", "/typing.py", "/abc.py")


def _site(frames: list[dict], depth: int) -> str:
    """The ``depth`` innermost frames outside torch (``file:line name``), innermost first; ``?`` if none."""
    keep = []
    for fr in frames:
        name = fr.get("filename", "?")
        if any(p in name for p in _TORCH_PATHS):
            continue
        short = name.split("/site-packages/")[-1].split("/work/main/")[-1]
        for marker in ("megatron_glm5/", "megatron/core/", "scripts/bench/", "bridge/"):
            if marker in short:
                short = short[short.index(marker):]
                break
        keep.append(f"{short}:{fr.get('line', '?')} {fr.get('name', '?')}")
        if len(keep) == depth:
            break
    return " <- ".join(keep) or "?"


_FREE = "free_requested"  # torch's allocated-bytes counter drops here (a block still used by another stream is
# reused only at "free_completed", but it no longer counts as allocated)


def live_at_peak(events: Iterable[dict], baseline: int = 0) -> tuple[int, list[dict]]:
    """Replay an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][device]``) the way torch counts
    allocated bytes: ``alloc`` adds a block, ``free_requested`` removes it (a block allocated before recording began
    only lowers the running total). Returns the peak of ``baseline`` + allocated bytes (``max_memory_allocated`` over
    the trace) and the events of the blocks live at that peak (recorded blocks only)."""
    events = list(events)
    cur = peak = baseline
    peak_at = -1
    for i, ev in enumerate(events):
        action = ev.get("action")
        if action == "alloc":
            cur += ev["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif action == _FREE:
            cur -= ev["size"]
    return peak, live_at_end(events[:peak_at + 1])


def live_at_end(events: Iterable[dict]) -> list[dict]:
    """The recorded blocks still allocated when the trace ends (what a step leaves behind)."""
    live: dict[int, dict] = {}
    for ev in events:
        if ev.get("action") == "alloc":
            live[ev["addr"]] = ev
        elif ev.get("action") == _FREE:
            live.pop(ev["addr"], None)
    return list(live.values())


def group_by_site(blocks: list[dict], depth: int = 2) -> list[tuple[str, int, int]]:
    """``(site, bytes, count)`` of the blocks, largest first (:func:`_site`)."""
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in blocks:
        entry = sizes[_site(ev.get("frames") or [], depth)]
        entry[0] += ev["size"]
        entry[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in sizes.items()), key=lambda r: -r[1])


def _describe(obj, depth: int = 3, seen=None) -> str:
    """Who holds ``obj``: its Python referrers up to ``depth`` levels (an object's ``__dict__`` named by its owner's
    type and the key). Holders outside Python (an autograd graph node) do not show up."""
    import gc
    import types

    seen = set() if seen is None else seen
    parts = []
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or isinstance(ref, types.FrameType) or ref is seen:
            continue
        seen.add(id(ref))
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj]
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
            label = f"{type(owners[0]).__name__}.{keys[0] if keys else '?'}" if owners else f"dict[{keys[:3]}]"
            parts.append(label + (f" <- ({_describe(owners[0], depth - 1, seen)})" if owners and depth > 1 else ""))
        else:
            attrs = [k for k, v in getattr(ref, "__dict__", {}).items() if v is obj] if hasattr(ref, "__dict__") else []
            label = type(ref).__name__ + (f".{attrs[0]}" if attrs else "")
            parts.append(label + (f" <- ({_describe(ref, depth - 1, seen)})" if depth > 1 else ""))
        if len(parts) == 4:
            break
    return "; ".join(parts) or "no Python referrer"


def _label(obj) -> str:
    """A garbage object in a few words: a frame by its function and line, a function by its qualified name, else
    its type."""
    import types

    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename.rsplit('/', 2)[-1]}:{obj.f_lineno})"
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        return f"function {getattr(obj, '__qualname__', '?')}"
    if isinstance(obj, BaseException):
        return f"exception {type(obj).__name__}"
    return type(obj).__name__


def tensors_in_cycles(run, is_tensor=None) -> list[tuple[int, str, list[str]]]:
    """Run ``run()`` with the collector off, then collect with ``DEBUG_SAVEALL``: the tensors only reference cycles
    kept alive, as ``(bytes, shape, [the garbage objects that refer to it])``, largest first. ``is_tensor`` picks
    which tensors count (default: CUDA tensors)."""
    import gc

    import torch

    is_tensor = is_tensor or (lambda t: t.is_cuda)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    ids = {id(o) for o in garbage}
    found = []
    for obj in garbage:
        if isinstance(obj, torch.Tensor) and is_tensor(obj):
            refs = [_label(r) for r in gc.get_referrers(obj) if id(r) in ids]
            found.append((obj.untyped_storage().nbytes(), str(tuple(obj.shape)), refs))
    del garbage
    gc.collect()
    return sorted(found, key=lambda f: -f[0])


def cycles(model, seq: int) -> list[str]:
    """The CUDA tensors a step leaves in reference cycles, and what refers to them (:func:`tensors_in_cycles`)."""
    from bench_offload import release, step

    found = tensors_in_cycles(lambda: step(model, seq))
    lines = [f"CUDA tensors held only by reference cycles after a {seq}-token step: {len(found)}, "
             f"{sum(f[0] for f in found) / GB:.3f} GB of storage", ""]
    for size, shape, refs in found[:12]:
        lines.append(f"- {shape}, {size / GB:.3f} GB: {'; '.join(refs[:4]) or 'no garbage referrer'}")
    release()
    return lines + [""]


def _saved_tensors(node) -> list[tuple[str, object]]:
    """The tensors an autograd node keeps: built-in nodes' ``_saved_*`` attributes, a custom Function's
    ``saved_tensors``, the tensors set on its ``ctx`` (released ones raise and are skipped), an ``AccumulateGrad``
    node's leaf."""
    import torch

    found = []
    names = [n for n in dir(node) if n.startswith("_saved_")] + ["saved_tensors", "variable"]  # AccumulateGrad's leaf
    for name in names:
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError):
            continue
        for v in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(v, torch.Tensor):
                found.append((name, v))
    for name, v in getattr(node, "__dict__", {}).items():
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                found.append((f"ctx.{name}", t))
    return found


def graph_holders(objects: Iterable, wanted) -> list[tuple[str, str, object]]:
    """Walk every autograd graph reachable from ``objects`` (tensors with a ``grad_fn``, autograd nodes) and return
    ``(root, node and attribute, tensor)`` for each saved tensor where ``wanted(tensor)``; ``root`` names the Python
    object the walk started from (its type, the tensor's shape). Each node is visited once."""
    import torch

    seen: set[int] = set()
    found = []
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            start, root = obj.grad_fn, f"tensor {tuple(obj.shape)}"
        elif isinstance(obj, torch.autograd.graph.Node):
            start, root = obj, f"node {type(obj).__name__}"
        else:
            continue
        stack = [start] if start is not None else []
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            for attr, t in _saved_tensors(node):
                if wanted(t):
                    found.append((root, f"{node.name()}.{attr}", t))
            stack.extend(fn for fn, _ in getattr(node, "next_functions", ()) if fn is not None)
    return found


def _active_blocks() -> list[dict]:
    """The allocator's allocated blocks now (``address``, ``size``, allocation ``frames`` where history was on)."""
    import torch

    blocks = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                blocks.append(dict(address=b.get("address", addr), size=b["size"], frames=b.get("frames") or []))
            addr += b["size"]
    return blocks


def leftover(model, seq: int, depth: int) -> list[str]:
    """What a step leaves allocated, before and after ``gc.collect()``, by allocation site, and who holds what
    survives the collection: a Python object (its referrers), a tensor saved in an autograd graph reachable from a
    Python object (:func:`graph_holders`), or neither."""
    import gc

    import torch
    from bench_offload import release, step

    release()
    before = {b["address"] for b in _active_blocks()}
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=_MAX_ENTRIES)
    try:
        step(model, seq)
        torch.cuda.synchronize()
        uncollected = [b for b in _active_blocks() if b["address"] not in before]
        gc.collect()
        kept = [b for b in _active_blocks() if b["address"] not in before]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    def table(title: str, blocks: list[dict]) -> list[str]:
        rows = [f"{title}: {sum(b['size'] for b in blocks) / GB:.3f} GB in {len(blocks)} blocks", "",
                "| allocated at | GB | blocks |", "|---|---|---|"]
        rows += [f"| `{site}` | {size / GB:.3f} | {n} |" for site, size, n in group_by_site(blocks, depth)[:12]]
        return rows + [""]

    lines = [f"### Left by a {seq}-token step", ""] + table("Before a collection", uncollected)
    lines += table("After `gc.collect()`", kept)
    spans = sorted((b["address"], b["address"] + b["size"]) for b in kept if b["size"] >= 1 << 20)

    def wanted(t) -> bool:
        if not (isinstance(t, torch.Tensor) and t.is_cuda):
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(lo <= ptr < hi for lo, hi in spans)

    objects = gc.get_objects()
    direct = [o for o in objects if isinstance(o, torch.Tensor) and wanted(o)]
    lines.append(f"Tensors (1 MB blocks and up) among Python's objects: {len(direct)}")
    ours = {id(objects), id(direct)}  # this function's own lists are not holders
    lines += [f"- {tuple(t.shape)} {t.dtype}: {_describe(t, seen=set(ours))}" for t in direct[:8]]
    held = graph_holders(objects, wanted)
    lines += ["", f"Saved in autograd graphs reachable from Python objects: {len(held)}"]
    lines += [f"- {tuple(t.shape)} {t.dtype}: {where}, graph of {root}" for root, where, t in held[:12]]
    del objects, direct, held
    release()
    return lines + [""]


def measure(model, seq: int, depth: int, top: int, chunks: int) -> list[str]:
    import torch
    from bench_offload import release, step

    release()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=_MAX_ENTRIES)
    try:
        step(model, seq)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    if len(trace) >= _MAX_ENTRIES:
        raise SystemExit(f"memory_peak.py: the allocator trace filled its {_MAX_ENTRIES} entries at {seq} tokens, so "
                         "its oldest events are gone; raise _MAX_ENTRIES")
    peak, blocks = live_at_peak(trace, baseline)
    left = live_at_end(trace)
    release()
    rows = group_by_site(blocks, depth)
    lines = [f"### {seq} tokens: peak {peak / GB:.2f} GB by the trace, {torch.cuda.max_memory_allocated() / GB:.2f} GB "
             f"by torch.cuda.max_memory_allocated; before the step {baseline / GB:.2f} GB (parameters, gradients)",
             "", f"{len(trace)} allocator events; {len(blocks)} recorded blocks live at the peak, "
             f"{sum(b['size'] for b in blocks) / GB:.2f} GB.", "",
             "| source (innermost frames outside torch) | GB | KB per token | blocks |", "|---|---|---|---|"]
    for site, size, count in rows[:top]:
        lines.append(f"| `{site}` | {size / GB:.3f} | {size / seq / 1e3:.1f} | {count} |")
    rest = rows[top:]
    if rest:
        size = sum(r[1] for r in rest)
        lines.append(f"| {len(rest)} other sources | {size / GB:.3f} | {size / seq / 1e3:.1f} | "
                     f"{sum(r[2] for r in rest)} |")
    lines += ["", f"Left allocated after the step: {sum(b['size'] for b in left) / GB:.3f} GB in {len(left)} blocks"
              + "".join(f"; `{site}` {size / GB:.3f} GB" for site, size, _ in group_by_site(left, depth)[:5]), ""]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recompute", choices=["none", "full"], default="full")
    p.add_argument("--backend", choices=["megatron", "tilelang"], default="tilelang")
    p.add_argument("--offload", action="store_true", help="with the activation-offload window")
    p.add_argument("--seqs", type=int, nargs="+", default=[32768])
    p.add_argument("--mlp-chunks", type=int, default=1, help="RuntimePolicy.mlp_chunks_for_training")
    p.add_argument("--depth", type=int, default=2, help="frames per source")
    p.add_argument("--top", type=int, default=30, help="rows per table")
    p.add_argument("--cycles", action="store_true",
                   help="instead of the peak: the CUDA tensors a step leaves in reference cycles, and what refers to "
                        "them (frames name the function)")
    p.add_argument("--leftover", action="store_true",
                   help="instead of the peak: what a step leaves allocated before and after a collection, and who "
                        "holds it (Python referrers, autograd graphs)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("memory_peak.py needs a CUDA device")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_offload import build, step
    from report import emit

    from megatron_glm5 import fusions
    from megatron_glm5.parallel import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel()
    model = build(args.offload, args.recompute, args.backend, args.mlp_chunks)
    step(model, 2048)  # kernels compiled, gradients allocated: the trace then holds the step alone
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"## Peak GPU memory by source ({datetime.date.today()}, commit {commit or 'n/a'}, "
             f"{torch.cuda.get_device_name(0)}, recompute {args.recompute}, backend {args.backend}, "
             f"offload {'on' if args.offload else 'off'}, MLP chunks {args.mlp_chunks} (by length: "
             f"{fusions.enabled(fusions.MLP_CHUNKS_BY_LENGTH_ENV)}); bench_offload.py's slice, one fwd+bwd)", ""]
    for seq in args.seqs:
        if args.cycles:
            lines += cycles(model, seq)
        elif args.leftover:
            lines += leftover(model, seq, args.depth)
        else:
            lines += measure(model, seq, args.depth, args.top, args.mlp_chunks)
        print(f"measured {seq} tokens", flush=True)
    emit(lines, args.out)
    destroy_model_parallel()


if __name__ == "__main__":
    main()
