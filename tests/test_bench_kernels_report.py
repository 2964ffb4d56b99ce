"""The DSA kernel benchmark's reporting without a GPU: the RL packed-batch table of ``bench_dsa_kernels.py`` and the
SVG plot of ``plot_kernels.py`` read back from a report in the benchmark's own format."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the bench scripts import their sibling ``report``
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


plot = _load("plot_kernels")
bench = _load("bench_dsa_kernels")

REPORT = """# DSA kernel benchmark

## (a) sparse MLA

| S | H | fwd ms (ours / mcore) | fwd TFLOP/s (ours / mcore) | fwd x | bwd ms (ours / mcore) | bwd TFLOP/s (ours / mcore) | bwd x | fwd+bwd ms (ours / mcore) | fwd+bwd x | out cos vs mcore |
|---|---|---|---|---|---|---|---|---|---|---|
| 4096 | 16 | 1.69 / 3.77 | 129.5 / 58.2 | 2.23 | 7.07 / 14.68 | 78.4 / 37.8 | 2.08 | 8.74 / 18.44 | 2.11 | 1.000000 |
| 4096 | 64 | 2.35 / 4.71 | 373.0 / 186.2 | 2.00 | 13.38 / 40.26 | 165.6 / 55.1 | 3.01 | 15.79 / 44.96 | 2.85 | 1.000000 |
| 16384 | 16 | FAILED: OOM |||||||||
| 16384 | 64 | 10.86 / 16.41 | 403.3 / 267.0 | 1.51 | 66.95 / 166.14 | 165.5 / 66.7 | 2.48 | 77.66 / 182.54 | 2.35 | 1.000000 |

## (b) indexer + top-k

| S | ours ms | mcore ms |
|---|---|---|
| 8192 | 2.32 | 8.08 |
"""


def test_plot_parses_the_sparse_table_and_skips_failed_rows():
    rows = plot.parse_sparse_table(REPORT)
    assert [(r["S"], r["H"]) for r in rows] == [(4096, 16), (4096, 64), (16384, 64)]
    assert rows[2]["fwd"] == (403.3, 267.0) and rows[2]["bwd"] == (165.5, 66.7)


def test_plot_writes_valid_svg_with_a_line_per_series(tmp_path):
    report = tmp_path / "kernels.md"
    report.write_text(REPORT)
    out = tmp_path / "plot.svg"
    assert plot.main([str(report), str(out), "--caption", "test"]) == 0
    root = ET.parse(out).getroot()
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    # fwd and bwd panels x (ours, mcore) x (64 heads; the 16-head series has one point, still a polyline)
    assert len(lines) == 8
    texts = "".join(e.text or "" for e in root.iter() if e.tag.endswith("text"))
    assert "megatron-core, 64 heads" in texts and "16K" in texts


def test_plot_rejects_a_report_without_the_table():
    with pytest.raises(ValueError, match="sparse MLA"):
        plot.parse_sparse_table("# nothing here\n")


def test_packed_report_rows_and_ratio():
    rows = [
        {"batch": "8 x 1K", "T": 8192, "H": 16, "ours_topk_ms": 1.65, "mc_topk_ms": 2.23, "ours_ms": 7.97, "mc_ms": 43.13},
        {"batch": "1 x 1K", "T": 1024, "H": 64, "ours_topk_ms": 0.23, "ours_ms": 1.9, "mcore_error": "x"},
        {"batch": "4 x 1K-8K", "H": 16, "error": "boom"},
    ]
    lines = bench.report_packed(rows)
    text = "\n".join(lines)
    assert "| 8 x 1K | 8192 | 16 | 1.65 / 2.23 | 7.97 / 43.13 | 5.41 |" in text
    assert "| 1 x 1K | 1024 | 64 | 0.23 / - | 1.90 / - | - |" in text
    assert "FAILED: boom" in text
    assert bench.report_packed([]) == []
    assert set(bench.PACKED_BATCHES) >= {"1 x 1K", "8 x 1K-8K"}
    assert all(4 <= len(v) <= 8 or v == [1024] for v in bench.PACKED_BATCHES.values())


# --------------------------------------------------------------------------------------------------------------------
# Index sets with locality (the stand-in for a trained indexer's top-k) and the group-sharing statistic
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("locality", [0.0, 0.5, 1.0])
def test_local_mix_indices_are_causal_distinct_and_minus_one_tailed(locality):
    import torch

    seq, topk = 700, 64
    idx = bench.local_mix_indices(seq, topk, torch.device("cpu"), locality, sinks=4, chunk=256)
    assert idx.shape == (seq, topk) and idx.dtype == torch.int32
    t = torch.arange(seq)[:, None]
    valid = idx >= 0
    assert (idx[valid.nonzero(as_tuple=True)] <= t.expand_as(idx)[valid]).all()  # causal
    assert torch.equal(valid.sum(dim=1), torch.clamp(torch.arange(seq) + 1, max=topk))  # min(t + 1, topk) valid
    assert torch.equal(valid, valid.cummin(dim=1).values)  # -1 only as a tail
    for r in (5, 63, 64, 300, 699):
        row = idx[r][idx[r] >= 0]
        assert row.unique().numel() == row.numel()


def test_local_mix_full_locality_is_sinks_plus_window():
    import torch

    seq, topk, sinks = 600, 64, 4
    idx = bench.local_mix_indices(seq, topk, torch.device("cpu"), 1.0, sinks=sinks, chunk=128)
    for r in (200, 599):
        expect = set(range(sinks)) | set(range(r - (topk - sinks) + 1, r + 1))
        assert set(idx[r].tolist()) == expect
    with pytest.raises(ValueError, match="locality"):
        bench.local_mix_indices(8, 4, torch.device("cpu"), 1.5)


def test_group_sharing_grows_with_locality():
    import torch

    seq, topk = 1024, 64
    shares = [bench.group_sharing(bench.local_mix_indices(seq, topk, torch.device("cpu"), loc), 4) for loc in (0, 0.5, 1)]
    assert 1.0 <= shares[0] < shares[1] < shares[2] <= 4.0
    assert shares[2] > 3.5 and shares[0] < 2.0  # random sets share only in the first rows (t < topk: all keys)
    same = torch.arange(64, dtype=torch.int32).expand(8, 64).contiguous()
    assert bench.group_sharing(same, 4) == pytest.approx(4.0)
    tail = same.clone()
    tail[:, 32:] = -1
    assert bench.group_sharing(tail, 4) == pytest.approx(4.0)  # -1 slots neither count nor form a key


def test_plot_keeps_only_random_index_rows():
    rows = plot.parse_sparse_table(REPORT.replace(
        "| 1.000000 |\n| 4096 | 64 |", "| 1.000000 | random (1.02x) |\n| 4096 | 64 |").replace(
        "| 16384 | 64 | 10.86", "| 16384 | 64 | 10.86").replace(
        "| 2.35 | 1.000000 |", "| 2.35 | 1.000000 | local 0.9 (3.40x) |"))
    assert [(r["S"], r["H"]) for r in rows] == [(4096, 16), (4096, 64)]


def test_ncu_source_summary_splits_warpgroups_at_setmaxnreg(tmp_path):
    """``ncu_source_summary.py`` cuts the SASS at each ``USETMAXREG`` and attributes stall samples, reasons and
    executed instructions per block to each warpgroup's region (a source page in ncu's CSV layout)."""
    mod = _load("ncu_source_summary")
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
    body = [
        ["0x0", "LDC R1, c[0x0][0x28]", "10", "10", "8", "0", "10", "0"],
        ["0x10", "USETMAXREG.DEALLOC.CTAPOOL 0x50", "0", "0", "4", "0", "0", "0"],
        ["0x20", "@!P0 BRA 0x30", "60", "60", "400", "60", "0", "60"],
        ["0x30", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", "0", "0", "4", "0", "0", "0"],
        ["0x40", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "30", "20", "800", "0", "30", "0"],
    ]
    path = tmp_path / "src.csv"
    rows = [["Kernel Name", "main_kernel"], header, *body]
    path.write_text("\n".join(",".join(f'"{c}"' for c in row) for row in rows))
    instructions = mod.load(str(path))
    lines = mod.summarise(instructions, blocks=4, top=2)
    assert lines[0] == "5 SASS instructions, 100 stall samples"
    regions = [line for line in lines if line.startswith("- region")]
    assert regions[0].startswith("- region 0 (prologue): 10.0% of samples, 2 instructions per warp per block; wait")
    assert "region 1 (SASS 1: USETMAXREG.DEALLOC" in regions[1] and "60.0% of samples, 101 instructions" in regions[1]
    assert "long_sb 100%" in regions[1]
    assert "30.0% of samples, 201 instructions per warp per block; wait 100%" in regions[2]
    assert "@!P0 BRA" in lines[-2] and "HGMMA" in lines[-1]
