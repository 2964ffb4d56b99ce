"""Plot sparse-MLA TFLOP/s against sequence length and heads, ours and megatron-core's, from a
``bench_dsa_kernels.py`` report (its "(a) sparse MLA" table). Writes an SVG with no plotting library needed.

    python scripts/bench/plot_kernels.py scripts/bench/kernels_round2/kernels.md scripts/bench/RESULTS_kernels.svg
"""

from __future__ import annotations

import argparse
import math
import re
import sys

COLORS = {("ours", 64): "#1f77b4", ("mcore", 64): "#aec7e8", ("ours", 16): "#d62728", ("mcore", 16): "#ff9896"}
PANEL_W, PANEL_H, MARGIN = 360, 260, 50


def parse_sparse_table(text: str) -> list[dict]:
    """Rows of the "(a) sparse MLA" table: ``{"S", "H", "fwd": (ours, mcore), "bwd": (ours, mcore)}`` in TFLOP/s."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("## (a) sparse MLA"):
            in_table = True
            continue
        if in_table and line.startswith("## "):
            break
        if not (in_table and line.startswith("| ") and re.match(r"\| \d", line)):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 7 or "FAILED" in line:
            continue
        if len(cells) > 11 and not cells[11].startswith("random"):
            continue  # rows on index sets with locality: the plot keeps the random ones (one line per series)
        fwd = [float(x) for x in cells[3].split("/")]
        bwd = [float(x) for x in cells[6].split("/")]
        rows.append({"S": int(cells[0]), "H": int(cells[1]), "fwd": tuple(fwd), "bwd": tuple(bwd)})
    if not rows:
        raise ValueError("no '(a) sparse MLA' rows found: is this a bench_dsa_kernels.py report?")
    return rows


def _panel(rows: list[dict], key: str, x0: float, title: str) -> list[str]:
    seqs = sorted({r["S"] for r in rows})
    top = max(max(r[key]) for r in rows) * 1.15
    lo, hi = math.log2(seqs[0]), math.log2(seqs[-1])

    def px(s: int) -> float:
        return x0 + MARGIN + (math.log2(s) - lo) / max(hi - lo, 1e-9) * (PANEL_W - 2 * MARGIN)

    def py(v: float) -> float:
        return MARGIN + (1 - v / top) * (PANEL_H - 2 * MARGIN)

    out = [f'<text x="{x0 + PANEL_W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{x0 + MARGIN}" y1="{PANEL_H - MARGIN}" x2="{x0 + PANEL_W - MARGIN}" y2="{PANEL_H - MARGIN}" '
           'stroke="black"/>',
           f'<line x1="{x0 + MARGIN}" y1="{MARGIN}" x2="{x0 + MARGIN}" y2="{PANEL_H - MARGIN}" stroke="black"/>']
    for s in seqs:
        out.append(f'<text x="{px(s):.1f}" y="{PANEL_H - MARGIN + 16}" text-anchor="middle" font-size="11">'
                   f'{s // 1024}K</text>')
    step = 100 if top > 300 else 50
    for v in range(0, int(top) + 1, step):
        out.append(f'<text x="{x0 + MARGIN - 6}" y="{py(v) + 4:.1f}" text-anchor="end" font-size="11">{v}</text>')
        out.append(f'<line x1="{x0 + MARGIN}" y1="{py(v):.1f}" x2="{x0 + PANEL_W - MARGIN}" y2="{py(v):.1f}" '
                   'stroke="#eee"/>')
    for (who, heads), color in COLORS.items():
        pts = sorted((r["S"], r[key][0 if who == "ours" else 1]) for r in rows if r["H"] == heads)
        if not pts:
            continue
        path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="3" fill="{color}"/>' for s, v in pts]
    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{PANEL_H - 10}" text-anchor="middle" font-size="11">tokens</text>')
    return out


def render_svg(rows: list[dict], caption: str = "") -> str:
    width, height = 2 * PANEL_W, PANEL_H + 60
    body = _panel(rows, "fwd", 0, "sparse MLA forward, TFLOP/s") + _panel(rows, "bwd", PANEL_W, "backward, TFLOP/s")
    for i, ((who, heads), color) in enumerate(COLORS.items()):
        x = 60 + i * 160
        label = f"{'megatron-glm5' if who == 'ours' else 'megatron-core'}, {heads} heads"
        body.append(f'<rect x="{x}" y="{PANEL_H + 8}" width="12" height="12" fill="{color}"/>')
        body.append(f'<text x="{x + 16}" y="{PANEL_H + 18}" font-size="11">{label}</text>')
    if caption:
        body.append(f'<text x="{width / 2}" y="{PANEL_H + 45}" text-anchor="middle" font-size="10">{caption}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>' + "".join(body) + "</svg>\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="a bench_dsa_kernels.py markdown report")
    ap.add_argument("out", help="the SVG to write")
    ap.add_argument("--caption", default="")
    args = ap.parse_args(argv)
    with open(args.report) as f:
        rows = parse_sparse_table(f.read())
    with open(args.out, "w") as f:
        f.write(render_svg(rows, args.caption))
    print(f"wrote {args.out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
