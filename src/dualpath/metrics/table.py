"""Compact text table of run summaries for CLI output. Formatting only; no I/O."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from dualpath.metrics.summary import RunSummary


def _num(value: float, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if math.isnan(value) or math.isinf(value) else f"{value * scale:.{digits}f}"


# (header, cell) per column; times in s except TPOT in ms.
_COLUMNS: tuple[tuple[str, Callable[[RunSummary], str]], ...] = (
    ("turns", lambda s: str(s.num_turns)),
    ("agents", lambda s: str(s.num_agents)),
    ("JCT s", lambda s: _num(s.jct_s, digits=1)),
    ("agent JCT p50 s", lambda s: _num(s.agent_jct.p50, digits=1)),
    ("TTFT p50 s", lambda s: _num(s.ttft.p50, digits=3)),
    ("TTFT p99 s", lambda s: _num(s.ttft.p99, digits=3)),
    ("TTST p50 s", lambda s: _num(s.ttst.p50, digits=3)),
    ("TPOT p50 ms", lambda s: _num(s.tpot.p50, scale=1e3, digits=1)),
    (
        "q/al/rd/pf s",
        lambda s: "/".join(
            _num(v, digits=2)
            for v in (
                s.breakdown.queue_s,
                s.breakdown.alloc_s,
                s.breakdown.read_s,
                s.breakdown.prefill_s,
            )
        ),
    ),
    ("prompt tok/s", lambda s: _num(s.prompt_tokens_per_s, digits=0)),
    ("out tok/s", lambda s: _num(s.output_tokens_per_s, digits=0)),
    ("hit %", lambda s: _num(s.hit_ratio, scale=100, digits=1)),
)


def format_summary(summaries: Mapping[str, RunSummary]) -> str:
    """One row per named run (in the mapping's order), aligned columns; "-" for no data.
    The q/al/rd/pf column is the mean TTFT breakdown: queue/alloc/read/prefill."""
    header = ["system", *(name for name, _ in _COLUMNS)]
    rows = [[name, *(cell(s) for _, cell in _COLUMNS)] for name, s in summaries.items()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])
