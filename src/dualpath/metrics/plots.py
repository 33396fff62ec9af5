"""Paper-style evaluation figures (PNG) from plain dicts and lists, and report.md.

Knows no simulator types: every function takes rows (list of dicts) or series
({label: [(time_s, value), ...]}) and writes one PNG. matplotlib is imported inside the
functions (object API, Agg canvas, no pyplot state), so importing this module stays light.
Each function returns a ``FigureInfo`` (titles, axis labels, legend entries) for checks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 120
Row = Mapping[str, Any]
Series = Mapping[str, Sequence[Sequence[float]]]

# Fixed colours for the systems of design §11, under every name a plot gives them (the
# simulator's names, the figures' labels, the ablation's steps): one system, one colour in
# every PNG of `sim`, `sweep`, `tune` and `figures`. Other labels cycle through the rest.
_BASIC, _LAYER, _DPL, _DUALPATH, _ORACLE = "#8c8c8c", "#9467bd", "#ff7f0e", "#1f77b4", "#2ca02c"
_SYSTEM_COLOURS = {
    "Basic": _BASIC,
    "basic": _BASIC,
    "+Layer": _LAYER,
    "layer": _LAYER,
    "+DPL": _DPL,
    "dpl": _DPL,
    "DPL": _DPL,
    "DPL (RR)": _DPL,
    "+Sched": _DUALPATH,
    "DualPath": _DUALPATH,
    "dualpath": _DUALPATH,
    "Oracle": _ORACLE,
    "oracle": _ORACLE,
}
_OTHER_COLOURS = ("#d62728", "#17becf", "#bcbd22", "#e377c2", "#8c564b", "#7f7f7f")
_COMPONENT_COLOURS = {
    "queue": "#d62728",
    "alloc": "#ff7f0e",
    "read": "#1f77b4",
    "prefill": "#2ca02c",
}


@dataclass(frozen=True, slots=True)
class AxesInfo:
    title: str
    xlabel: str
    ylabel: str
    legend: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FigureInfo:
    """What was drawn: the PNG path, the figure title and each axes' labels."""

    path: Path
    title: str
    axes: tuple[AxesInfo, ...]


RowsPlot = Callable[[Sequence[Row], str | Path], FigureInfo]
SeriesPlot = Callable[[Series, str | Path], FigureInfo]


def colour(label: str, labels: Sequence[str]) -> str:
    """Colour of a system label: fixed for design §11 systems, else by position in ``labels``."""
    if label in _SYSTEM_COLOURS:
        return _SYSTEM_COLOURS[label]
    others = [x for x in labels if x not in _SYSTEM_COLOURS]
    return (
        _OTHER_COLOURS[others.index(label) % len(_OTHER_COLOURS)] if label in others else "#000000"
    )


def unique(values: Sequence[Any]) -> list[Any]:
    """Distinct values in first-seen order (never set order)."""
    out: list[Any] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def _num(value: Any) -> float:
    """A row value as float; None or missing → NaN (the point is not drawn)."""
    return math.nan if value is None else float(value)


def require_keys(rows: Sequence[Row], keys: Sequence[str], what: str) -> None:
    """ValueError naming the first row and key missing (user-supplied JSON may be wrong)."""
    if not rows:
        raise ValueError(f"{what}: no rows to plot")
    for i, row in enumerate(rows):
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"{what}: row {i} lacks {', '.join(missing)} (has {sorted(row)})")


def new_figure(
    nrows: int, ncols: int, width_in: float, height_in: float
) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    width_in = max(width_in, 3.6)  # room for titles and legends
    fig = Figure(figsize=(width_in * ncols, height_in * nrows), dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save(fig: Figure, path: str | Path, title: str) -> FigureInfo:
    """Give ``fig`` its title, write the PNG (parents created), describe what was drawn."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    fig.savefig(out, dpi=DPI, bbox_inches="tight", facecolor="white")
    infos = []
    for ax in fig.axes:
        legend = ax.get_legend()
        texts = tuple(t.get_text() for t in legend.get_texts()) if legend is not None else ()
        infos.append(AxesInfo(ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), texts))
    return FigureInfo(out, title, tuple(infos))


def label_bar(ax: Axes, bar: Any, text: str, fontsize: int, rotation: int = 0) -> None:
    """Write ``text`` just above a bar (matplotlib Rectangle)."""
    x, top = bar.get_x() + bar.get_width() / 2, bar.get_height()
    ax.annotate(
        text,
        (x, top),
        xytext=(0, 2),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=fontsize,
        rotation=rotation,
    )


def grouped_bars(
    ax: Axes,
    groups: Sequence[str],
    systems: Sequence[str],
    values: Mapping[tuple[str, str], float],
    speedup_labels: bool = True,
) -> None:
    """Bars per group (x) and system (side by side). With ``speedup_labels`` every bar but
    the first system's shows its speedup over the first system of its group (baseline/value)."""
    width = 0.8 / max(1, len(systems))
    for j, system in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(groups))]
        ys = [values.get((g, system), math.nan) for g in groups]
        bars = ax.bar(
            xs,
            ys,
            width,
            label=system,
            color=colour(system, systems),
            edgecolor="black",
            linewidth=0.4,
        )
        if not speedup_labels or j == 0:
            continue
        for bar, group, y in zip(bars, groups, ys, strict=True):
            base = values.get((group, systems[0]), math.nan)
            if y > 0 and base > 0 and not math.isnan(y + base):
                label_bar(ax, bar, f"{base / y:.2f}×", fontsize=7, rotation=90)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # room for the labels
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot_offline_jct(
    rows: Sequence[Row], path: str | Path, title: str = "Offline batch: job completion time"
) -> FigureInfo:
    """rows: {"model": str, "mal": str|int, "agents": int, "system": str, "jct_s": float}.
    One panel per model (stacked); x = (MAL, agents); bars per system with speedup over the first."""
    require_keys(rows, ("model", "mal", "agents", "system", "jct_s"), "plot_offline_jct")
    models = unique([r["model"] for r in rows])
    systems = unique([r["system"] for r in rows])
    num_groups = len(unique([(r["mal"], r["agents"]) for r in rows]))
    fig, axes = new_figure(len(models), 1, min(12.0, 1.2 + 0.9 * num_groups), 3.6)
    for ax, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        groups = unique([f"MAL {r['mal']}\n{r['agents']} agents" for r in mine])
        values = {
            (f"MAL {r['mal']}\n{r['agents']} agents", r["system"]): _num(r["jct_s"]) for r in mine
        }
        grouped_bars(ax, groups, systems, values)
        ax.set_title(f"{model} (bar labels: speedup over {systems[0]})")
        ax.set_xlabel("max agent context length (MAL), agents")
        ax.set_ylabel("JCT (s)")
    return save(fig, path, title)


def plot_pd_sweep(
    rows: Sequence[Row], path: str | Path, title: str = "P/D ratio sweep: job completion time"
) -> FigureInfo:
    """rows: {"pd": str (e.g. "1P2D"), "system": str, "jct_s": float}; x = P/D in first-seen order."""
    require_keys(rows, ("pd", "system", "jct_s"), "plot_pd_sweep")
    groups = unique([str(r["pd"]) for r in rows])
    systems = unique([r["system"] for r in rows])
    fig, axes = new_figure(1, 1, 1.5 + 1.1 * len(groups), 3.8)
    grouped_bars(
        axes[0], groups, systems, {(str(r["pd"]), r["system"]): _num(r["jct_s"]) for r in rows}
    )
    axes[0].set_xlabel("prefill nodes P, decode nodes D")
    axes[0].set_ylabel("JCT (s)")
    axes[0].set_title(f"lower is better (bar labels: speedup over {systems[0]})")
    return save(fig, path, title)


_LATENCY_PANELS = (
    ("ttft_s", "TTFT (s)", 1.0, "ttft"),
    ("ttst_s", "TTST (s)", 1.0, None),
    ("tpot_s", "TPOT (ms)", 1e3, "tpot"),
)


_MARKERS = ("o", "s", "^", "D", "v")
_LINESTYLES = ("-", "--", "-.", ":")


def _latency_scale(ax: Axes, ys: Sequence[float], limit: float) -> None:
    """Linear from 0 with the SLO line in view; log when values run past 5× the SLO
    (past capacity TTFT grows without bound and would flatten everything else)."""
    top = max([*ys, 0.0 if math.isnan(limit) else limit])
    if not math.isnan(limit) and top > 5 * limit and min(ys) > 0:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.text(
            0.99, 0.01, "log scale", transform=ax.transAxes, ha="right", va="bottom", fontsize=7
        )
    else:
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)


def plot_latency_vs_aps(
    rows: Sequence[Row],
    path: str | Path,
    slo_ttft_s: float = 4.0,
    slo_tpot_s: float = 0.050,
    title: str = "Online serving: latency vs load",
) -> FigureInfo:
    """rows: {"system": str, "aps": float, "ttft_s", "ttst_s", "tpot_s": float|None,
    optional "model": str}. One row of three panels (TTFT, TTST, TPOT) per model; a line per
    system over APS; dashed SLO lines on TTFT and TPOT. None values are skipped."""
    require_keys(rows, ("system", "aps", "ttft_s", "ttst_s", "tpot_s"), "plot_latency_vs_aps")
    models = unique([r.get("model", "") for r in rows])
    systems = unique([r["system"] for r in rows])
    fig, axes = new_figure(len(models), 3, 3.8, 3.2)
    slo = {"ttft": slo_ttft_s, "tpot": slo_tpot_s * 1e3}
    for m, model in enumerate(models):
        mine = sorted(
            (r for r in rows if r.get("model", "") == model), key=lambda r: float(r["aps"])
        )
        for p, (key, label, scale, slo_key) in enumerate(_LATENCY_PANELS):
            ax = axes[3 * m + p]
            ys: list[float] = []
            for j, system in enumerate(systems):
                pts = [
                    (float(r["aps"]), _num(r[key]) * scale) for r in mine if r["system"] == system
                ]
                ys += [y for _, y in pts if not math.isnan(y)]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        marker=_MARKERS[j % len(_MARKERS)],
                        ls=_LINESTYLES[j % len(_LINESTYLES)],
                        ms=4,
                        label=system,
                        color=colour(system, systems),
                    )
            limit = slo.get(slo_key or "", math.nan)
            if not math.isnan(limit):
                unit = "s" if slo_key == "ttft" else "ms"
                ax.axhline(limit, ls="--", color="red", lw=1, label=f"SLO {limit:g} {unit}")
            _latency_scale(ax, ys, limit)
            ax.set_xlabel("load (agents/s, APS)")
            ax.set_ylabel(label)
            ax.set_title(f"{model} {label.split()[0]}".strip())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return save(fig, path, title)


def plot_ttft_breakdown(
    rows: Sequence[Row], path: str | Path, title: str = "Where TTFT goes (mean per turn)"
) -> FigureInfo:
    """rows: {"system": str, "aps": float, "queue_s", "alloc_s", "read_s", "prefill_s": float}.
    One panel per system (shared y); stacked bars of the four components per APS."""
    keys = ("queue_s", "alloc_s", "read_s", "prefill_s")
    require_keys(rows, ("system", "aps", *keys), "plot_ttft_breakdown")
    systems = unique([r["system"] for r in rows])
    fig, axes = new_figure(1, len(systems), 1.5 + 0.6 * len(unique([r["aps"] for r in rows])), 3.6)
    totals = [sum(_num(r[k]) for k in keys) for r in rows]
    top = max((t for t in totals if not math.isnan(t)), default=0.0)
    for ax, system in zip(axes, systems, strict=True):
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: float(r["aps"]))
        xs = list(range(len(mine)))
        bottom = [0.0] * len(mine)
        for key in keys:
            ys = [_num(r[key]) for r in mine]
            name = key.removesuffix("_s")
            ax.bar(
                xs,
                ys,
                0.6,
                bottom=bottom,
                label=name,
                color=_COMPONENT_COLOURS[name],
                edgecolor="black",
                linewidth=0.4,
            )
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        ax.set_xticks(xs, [f"{float(r['aps']):g}" for r in mine], fontsize=8)
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
        ax.set_title(str(system))
        ax.set_xlabel("load (agents/s, APS)")
        ax.set_ylabel("mean TTFT component (s)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return save(fig, path, title)


def plot_ablation(
    rows: Sequence[Row], path: str | Path, title: str = "Ablation: job completion time"
) -> FigureInfo:
    """rows: {"system": str, "jct_s": float} in ablation order (Basic, +Layer, +DPL, +Sched);
    each bar labelled with its speedup over the first row."""
    require_keys(rows, ("system", "jct_s"), "plot_ablation")
    fig, axes = new_figure(1, 1, 1.6 + 1.0 * len(rows), 3.8)
    ax = axes[0]
    names = [str(r["system"]) for r in rows]
    ys = [_num(r["jct_s"]) for r in rows]
    bars = ax.bar(
        range(len(rows)),
        ys,
        0.6,
        color=[colour(n, names) for n in names],
        edgecolor="black",
        linewidth=0.4,
        label=f"JCT (labels: speedup over {names[0]})",
    )
    for bar, y in zip(bars, ys, strict=True):
        if y > 0 and ys[0] > 0:
            label_bar(ax, bar, f"{ys[0] / y:.2f}×", fontsize=9)
    ax.set_xticks(range(len(rows)), names)
    # room above the tallest bar for its label; the legend outside the axes (inside, it
    # covered the labels)
    ax.set_ylim(0, max((y for y in ys if not math.isnan(y)), default=1.0) * 1.18)
    ax.set_xlabel("system (each adds one technique)")
    ax.set_ylabel("JCT (s)")
    ax.set_title("lower is better", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    return save(fig, path, title)


def with_gaps(
    pts: Sequence[Sequence[float]], factor: float = 3.0
) -> tuple[list[float], list[float]]:
    """x, y of a time series with a NaN inserted wherever consecutive times lie more than
    ``factor`` × the median spacing apart, so that a line is broken over a stretch with no
    data instead of drawn across it."""
    xs = [float(p[0]) for p in pts]
    ys = [float(p[1]) for p in pts]
    if len(xs) < 3:
        return xs, ys
    gaps = sorted(b - a for a, b in itertools.pairwise(xs))
    limit = factor * gaps[len(gaps) // 2]
    out_x, out_y = [xs[0]], [ys[0]]
    for i in range(1, len(xs)):
        if limit > 0 and xs[i] - xs[i - 1] > limit:
            out_x.append((xs[i] + xs[i - 1]) / 2)
            out_y.append(math.nan)
        out_x.append(xs[i])
        out_y.append(ys[i])
    return out_x, out_y


def _ratio_lines(series: Series, path: str | Path, ylabel: str, title: str) -> FigureInfo:
    if not series:
        raise ValueError(f"{title}: no series to plot")
    labels = list(series)
    fig, axes = new_figure(1, 1, 6.5, 3.4)
    ax = axes[0]
    for label in labels:
        pts = series[label]
        if pts:
            xs, ys = with_gaps(pts)
            ax.plot(xs, ys, lw=1, label=label, color=colour(label, labels))
    ax.axhline(1.0, ls=":", color="black", lw=0.8, label="even (max = avg)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title("max/avg, 1.0 = perfectly even; gaps: no data (nothing to balance)", fontsize=9)
    ax.set_ylim(bottom=0.95)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path, title)


def plot_snic_balance(
    series: Series, path: str | Path, title: str = "Storage-NIC load balance across nodes"
) -> FigureInfo:
    """series: {label (e.g. "DualPath", "Round robin"): [(time_s, max/avg), ...]}."""
    return _ratio_lines(series, path, "SNIC throughput max/avg", title)


def plot_attention_balance(
    series: Series, path: str | Path, title: str = "Attention load balance across EP GPUs"
) -> FigureInfo:
    """series: {label: [(time_s, max/avg of per-GPU attention time in one forward), ...]}."""
    return _ratio_lines(series, path, "attention time max/avg", title)


@dataclass(frozen=True, slots=True)
class ReportSection:
    """One figure of report.md: heading, image (path relative to the report), a sentence on
    how to read it, and its numbers as rows (columns: keys in first-seen order)."""

    title: str
    image: str | None
    text: str = ""
    table: Sequence[Row] = ()


def format_cell(value: Any) -> str:
    """Numbers to 4 significant digits; None/NaN → "-"; everything else str()."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown_table(rows: Sequence[Row]) -> str:
    """A GitHub markdown table of ``rows`` ("" if there are none)."""
    if not rows:
        return ""
    columns = unique([k for r in rows for k in r])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report_md(
    sections: Sequence[ReportSection], path: str | Path, title: str = "DualPath evaluation"
) -> Path:
    """Write report.md: a title, then per section its heading, image, text and table."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", ""]
    for s in sections:
        parts += [f"## {s.title}", ""]
        if s.image:
            parts += [f"![{s.title}]({s.image})", ""]
        if s.text:
            parts += [s.text, ""]
        table = markdown_table(s.table)
        if table:
            parts += [table, ""]
    out.write_text("\n".join(parts), encoding="utf-8")
    return out
