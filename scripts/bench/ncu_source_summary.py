"""Where a warp-specialised kernel's warps wait, per warpgroup: a summary of ncu's per-instruction source page.

The CSV comes from ``ncu --section WarpStateStats --section SourceCounters --page source --print-source sass --csv``
(``scripts/bench/profile_bwd.py`` picks the launch). The SASS is cut into regions at each ``USETMAXREG`` (the first
instruction of each warpgroup's branch in our TileLang kernels), and for each region this prints its share of the
stall samples and its top stall reasons, the instructions it executes per warp per block (with ``--blocks``, the
number of index blocks one warp walks), then the instructions with the most samples.

    python scripts/bench/ncu_source_summary.py ncu.csv --blocks 524288 --top 30
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def load(path: str) -> list[dict]:
    """Each SASS instruction of the page: its text, stall samples, executions and samples per stall reason."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[head_at]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[head_at + 1:]:
        if len(r) < len(header):
            continue
        out.append({
            "src": r[col["Source"]].strip(),
            "samples": int(r[col["Warp Stall Sampling (All Samples)"]] or 0),
            "executed": int(r[col["Instructions Executed"]] or 0),
            "stalls": {s[len("stall_"):]: int(r[col[s]] or 0) for s in stalls},
        })
    return out


def summarise(instructions: list[dict], blocks: int = 0, top: int = 30) -> list[str]:
    total = sum(i["samples"] for i in instructions) or 1
    region, starts = 0, {0: "prologue"}
    regions = []
    for k, ins in enumerate(instructions):
        if "USETMAXREG" in ins["src"]:
            region += 1
            starts[region] = f"SASS {k}: {ins['src']}"
        regions.append(region)
    lines = [f"{len(instructions)} SASS instructions, {total} stall samples", ""]
    for rg in sorted(starts):
        members = [i for i, r in zip(instructions, regions) if r == rg]
        samples = sum(i["samples"] for i in members)
        reasons = collections.Counter()
        for i in members:
            reasons.update(i["stalls"])
        executed = sum(i["executed"] for i in members)
        per_block = f", {executed / blocks:.0f} instructions per warp per block" if blocks else ""
        top_reasons = ", ".join(f"{k} {v / max(samples, 1):.0%}" for k, v in reasons.most_common(5) if v)
        lines.append(f"- region {rg} ({starts[rg]}): {samples / total:.1%} of samples{per_block}; {top_reasons}")
    lines += ["", f"top {top} instructions by samples:", ""]
    for k in sorted(range(len(instructions)), key=lambda k: -instructions[k]["samples"])[:top]:
        ins = instructions[k]
        why = ", ".join(f"{a} {b}" for a, b in collections.Counter(ins["stalls"]).most_common(2) if b)
        lines.append(f"  {k:5d} r{regions[k]} {ins['samples'] / total:6.1%} {ins['src'][:64]:64s} {why}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--blocks", type=int, default=0,
                    help="index blocks walked per warp in total: CTAs x warps per warpgroup x blocks per CTA")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    instructions = load(args.csv)
    print("\n".join(summarise(instructions, args.blocks, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
