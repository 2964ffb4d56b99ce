"""Sparse-MLA forward schedules side by side (one H200, issue 22's forward rows): each variant's time, TFLOP/s and
its output / LSE difference from the first row's (the reference: the previous default), at 16K tokens and 64 heads
(random causal sets, GLM-5 and NoPE latents), the 16-head grouped kernel (4 queries x 16 heads per CTA) on random and
90 %-local sets, and the 16-head per-query ``ws`` kernel. ``pp`` is the default at 64 MMA rows
(``pick_fwd_variant``); its opt-in builds (named barriers, the persistent grid of ``SMS`` CTAs) have rows of their
own.

Variants are (label, factory, args) over the factories of ``megatron_glm5.kernels.sparse_mla_fwd``; the first row of
each table is the reference the others are compared with.

    source .gpu/install.sh && python scripts/bench/sweep_sparse_fwd.py --workers 16 --out fwd.md
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dsa_kernels import (  # noqa: E402
    causal_random_indices, local_mix_indices, precompile_step, run_sweep_sections, timed,
)

FWD = "megatron_glm5.kernels.sparse_mla_fwd"
SCALE = 1.0 / 16

PP_DEFAULT = "pp 216/216/72 (default: entries prefetched, no storage syncs)"
PP = (216, 216, 72)
SMS = 132  # the H200's SMs: the persistent grid's CTAs (a constant, so that scripts/tl_cache.py can build it ahead)
# (label, factory, extra args after (heads, d_qk, d_v, scale)); the reference first. pp's positional options:
# group, nreg, smem_mask, p1_copy_first, slot_prefetch, storage_sync, named_exchange, ctas;
# ws's: block_i, group, nreg.
VARIANTS_64 = [
    ("pp, eleventh session's default (reference)", "_jit_fwd_pp", (1, PP, True, True, False, True)),
    (PP_DEFAULT, "_jit_fwd_pp", (1, PP)),
    ("pp, entries prefetched only", "_jit_fwd_pp", (1, PP, True, True, True, True)),
    ("pp, named barriers for the exchanges", "_jit_fwd_pp", (1, PP, True, True, True, False, True)),
    ("pp, persistent grid", "_jit_fwd_pp", (1, PP, True, True, True, False, False, SMS)),
    ("pp, persistent grid and named barriers", "_jit_fwd_pp", (1, PP, True, True, True, False, True, SMS)),
    ("pp 208/208/88", "_jit_fwd_pp", (1, (208, 208, 88))),
    ("pp 216/200/88", "_jit_fwd_pp", (1, (216, 200, 88))),
    ("pp 224/208/72", "_jit_fwd_pp", (1, (224, 208, 72))),
    ("ws 256/168/80", "_jit_fwd_ws", (64, 1, (256, 168, 80))),
]
VARIANTS_NOPE = [
    ("pp, eleventh session's default (reference)", "_jit_fwd_pp", (1, PP, True, True, False, True)),
    (PP_DEFAULT, "_jit_fwd_pp", (1, PP)),
    ("pp, named barriers for the exchanges", "_jit_fwd_pp", (1, PP, True, True, True, False, True)),
    ("pp, persistent grid", "_jit_fwd_pp", (1, PP, True, True, True, False, False, SMS)),
]
VARIANTS_16_GROUPED = [
    ("pp grouped, eleventh session's default (reference)", "_jit_fwd_pp", (4, PP, True, True, False, True)),
    ("pp grouped (default)", "_jit_fwd_pp", (4, PP)),
    ("pp grouped, named barriers for the exchanges", "_jit_fwd_pp", (4, PP, True, True, True, False, True)),
    ("pp grouped, persistent grid", "_jit_fwd_pp", (4, PP, True, True, True, False, False, SMS)),
    ("ws grouped 256/168/80", "_jit_fwd_ws", (64, 4, (256, 168, 80))),
]
VARIANTS_16 = [  # the per-query kernel at 16 heads (16-row mma.sync tiles): the default without grouping
    ("ws 16 heads (default)", "_jit_fwd_ws", (64, 1, None)),
]


def kernels_to_build() -> list[tuple]:
    cases = [(FWD, f, (64, 576, 512, SCALE, *a)) for _, f, a in VARIANTS_64]
    cases += [(FWD, f, (16, 576, 512, SCALE, *a)) for _, f, a in VARIANTS_16_GROUPED]
    cases += [(FWD, f, (64, 512, 512, SCALE, *a)) for _, f, a in VARIANTS_NOPE]
    cases += [(FWD, f, (16, 576, 512, SCALE, *a)) for _, f, a in VARIANTS_16]
    return cases


def _compare(lines, label, ms, flops, out, lse, ref):
    if ref is None:
        err_o = err_l = "-"
    else:
        err_o = f"{float((out.float() - ref[0].float()).abs().max()):.1e}"
        fin = torch.isfinite(ref[1])
        same_inf = bool(torch.equal(fin, torch.isfinite(lse)))
        err = float((lse[fin] - ref[1][fin]).abs().max()) if bool(fin.any()) else 0.0
        err_l = f"{err:.1e}" + ("" if same_inf else " (inf rows differ)")
    lines.append(f"| {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err_o} | {err_l} |")


def section_fwd64(seq: int = 16384, d_qk: int = 576, variants=None, heads: int = 64) -> list[str]:
    """64 heads, random causal sets: the per-query kernels (one CTA per token); ``d_qk`` 512: the NoPE latent."""
    from megatron_glm5.kernels._common import row_valid_len

    mod = importlib.import_module(FWD)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq, heads, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(seq, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = causal_random_indices(seq, 2048, torch.device("cuda"))
    vlen = row_valid_len(idx)
    flops = 2 * float(vlen.sum()) * heads * (d_qk + 512)
    lines = [f"S = {seq}, {heads} heads, d_qk {d_qk}, random causal top-2048 sets", "",
             "| variant | fwd ms | TFLOP/s | out max diff | lse max diff |", "|---|---|---|---|---|"]
    ref = None
    for label, fac, args in variants or VARIANTS_64:
        try:
            kern = getattr(mod, fac)()(heads, d_qk, 512, SCALE, *args)
            ms = timed(lambda: kern(q, kv, idx, vlen))
            out, lse = kern(q, kv, idx, vlen)
        except Exception as err:  # report, go on
            lines.append(f"| {label} | FAILED {err!r} |||| "[:300])
            continue
        _compare(lines, label, ms, flops, out, lse, ref)
        if ref is None:
            ref = (out, lse)
    return lines


def section_nope64(seq: int = 16384) -> list[str]:
    """64 heads, the NoPE latent of GLM-5.3-Flash (d_qk = d_v = 512)."""
    return section_fwd64(seq, 512, VARIANTS_NOPE)


def section_ws16(seq: int = 16384) -> list[str]:
    """16 heads, the per-query ``ws`` kernel (the forward without grouping)."""
    return section_fwd64(seq, 576, VARIANTS_16, heads=16)


def section_fwd16(seq: int = 16384) -> list[str]:
    """16 heads, grouped kernel (4 queries per CTA over the union of their sets), random and 90 %-local sets."""
    from megatron_glm5.kernels.index_groups import group_union_indices, grouped_rows

    mod = importlib.import_module(FWD)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(seq, 16, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(seq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    lines = ["| variant | sets | fwd ms | TFLOP/s | out max diff | lse max diff |", "|---|---|---|---|---|---|"]
    for loc in (None, 0.9):
        dev = torch.device("cuda")
        idx = causal_random_indices(seq, 2048, dev) if loc is None else local_mix_indices(seq, 2048, dev, loc)
        flops = 2 * float((idx >= 0).sum()) * 16 * (576 + 512)
        _, rows, lengths = grouped_rows(idx, 16, 4, group_union_indices(idx, 4, key_bound=seq), seq)
        ref = None
        for label, fac, args in VARIANTS_16_GROUPED:
            tag = f"{label} | {'random' if loc is None else f'local {loc}'}"
            try:
                kern = getattr(mod, fac)()(16, 576, 512, SCALE, *args)
                ms = timed(lambda: kern(q, kv, rows, lengths))
                out, lse = kern(q, kv, rows, lengths)
            except Exception as err:
                lines.append(f"| {tag} | FAILED {err!r} |||| "[:300])
                continue
            _compare(lines, tag, ms, flops, out, lse, ref)
            if ref is None:
                ref = (out, lse)
    return lines


def section_gather(seq: int = 16384) -> list[str]:
    """How much the gather costs: every row selects 2048 valid keys, either random over the whole sequence (each
    CTA gathers its own rows from L2) or the same 2048 keys for every row (the rows stay hot in L2 and largely in
    L1); equal FLOPs, so the time difference is what the gather's locality buys."""
    mod = importlib.import_module(FWD)
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(seq, 64, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(seq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    rand = torch.rand(seq, seq, device="cuda", generator=g).topk(2048, dim=-1).indices.int().contiguous()
    same = torch.arange(2048, device="cuda", dtype=torch.int32).expand(seq, 2048).contiguous()
    vlen = torch.full((seq,), 2048, device="cuda", dtype=torch.int32)
    flops = 2 * float(seq * 2048) * 64 * (576 + 512)
    lines = ["| variant | sets | fwd ms | TFLOP/s |", "|---|---|---|---|"]
    picked = ("ws 256/168/80", PP_DEFAULT)
    for label, fac, args in [v for v in VARIANTS_64 if v[0] in picked]:
        kern = getattr(mod, fac)()(64, 576, 512, SCALE, *args)
        for name, idx in (("random 2048 of all keys", rand), ("the same 2048 keys", same)):
            ms = timed(lambda: kern(q, kv, idx, vlen))
            lines.append(f"| {label} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="fwd64,nope64,fwd16,ws16")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--precompile-only", action="store_true", help="build the variants' kernels and stop")
    args = ap.parse_args()
    stop = precompile_step(kernels_to_build(), args.workers, args.precompile_only)
    if stop is not None:
        return stop
    sections = {k[len("section_"):]: v for k, v in globals().items() if k.startswith("section_")}
    run_sweep_sections(args.sections, sections, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
