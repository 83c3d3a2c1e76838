"""Plain-text or markdown tables and the number formats of benchmarks/perf_model.py's report."""

from __future__ import annotations

import math


def table(title: str, header: list[str], rows: list[list], md: bool) -> str:
    cells = [[str(c) for c in r] for r in rows]
    if md:
        out = [
            f"\n**{title}**\n",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(out)
    w = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    out = [f"\n{title}", "  ".join(h.rjust(w[i]) for i, h in enumerate(header))]
    out += ["  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in cells]
    return "\n".join(out)


def fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "OOM"
    return f"{s:,.0f}" if s >= 100 else f"{s:.1f}"


def fx(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.2f}x"


def kl(L: int) -> str:
    return f"{L // 1024}K"
