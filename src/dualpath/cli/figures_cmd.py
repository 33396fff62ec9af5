"""`dualpath figures --out DIR [--quick] [--from DIR]`: paper-style PNGs and report.md.

Draws from a ``FigureData`` provider (docs/online.md): saved JSON results (``--from``), or the
simulator-backed one (``dualpath.cli.sim_figures.make_figure_data``). Owns the figure list,
the tables and the data files; no simulation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dualpath.cli.common import add_cache_args, add_ray_arg, cache_from_args
from dualpath.metrics import plots
from dualpath.metrics.breakdown import series_stats

DEFAULT_WORKERS = min(2, os.cpu_count() or 1)


class FigureData(Protocol):
    """Where the figures' numbers come from. Every method returns plain JSON-able data (the
    schemas of the ``plots`` functions, listed in docs/online.md); an empty list/dict means
    "not available" and that figure is skipped."""

    def offline_jct(self) -> list[dict[str, Any]]: ...
    def pd_sweep(self) -> list[dict[str, Any]]: ...
    def online_latency(self) -> list[dict[str, Any]]: ...
    def capacity(self) -> list[dict[str, Any]]: ...
    def ttft_breakdown(self) -> list[dict[str, Any]]: ...
    def ablation(self) -> list[dict[str, Any]]: ...
    def snic_balance(self) -> dict[str, list[list[float]]]: ...
    def attention_balance(self) -> dict[str, list[list[float]]]: ...
    def meta(self) -> dict[str, Any]: ...


DATA_NAMES = (
    "offline_jct",
    "pd_sweep",
    "online_latency",
    "capacity",
    "ttft_breakdown",
    "ablation",
    "snic_balance",
    "attention_balance",
    "meta",
)
_SERIES = ("snic_balance", "attention_balance", "meta")  # dict-valued, not row lists


class JsonFigureData:
    """Reads ``<name>.json`` for each name in ``DATA_NAMES`` from a folder (as written by
    ``save_figure_data``); a missing file means that data is unavailable."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def _load(self, name: str) -> Any:
        path = self.folder / f"{name}.json"
        empty: Any = {} if name in _SERIES else []
        if not path.exists():
            return empty
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, type(empty)):
            raise ValueError(f"{path}: expected a JSON {type(empty).__name__}")
        return data

    def offline_jct(self) -> list[dict[str, Any]]:
        return list(self._load("offline_jct"))

    def pd_sweep(self) -> list[dict[str, Any]]:
        return list(self._load("pd_sweep"))

    def online_latency(self) -> list[dict[str, Any]]:
        return list(self._load("online_latency"))

    def capacity(self) -> list[dict[str, Any]]:
        return list(self._load("capacity"))

    def ttft_breakdown(self) -> list[dict[str, Any]]:
        return list(self._load("ttft_breakdown"))

    def ablation(self) -> list[dict[str, Any]]:
        return list(self._load("ablation"))

    def snic_balance(self) -> dict[str, list[list[float]]]:
        return dict(self._load("snic_balance"))

    def attention_balance(self) -> dict[str, list[list[float]]]:
        return dict(self._load("attention_balance"))

    def meta(self) -> dict[str, Any]:
        return dict(self._load("meta"))


def save_figure_data(data: FigureData, folder: str | Path) -> list[Path]:
    """Write every non-empty item of ``data`` to ``folder/<name>.json`` (re-plot with --from)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DATA_NAMES:
        value = getattr(data, name)()
        if value:
            path = out / f"{name}.json"
            path.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
            written.append(path)
    return written


def pivot(
    rows: Sequence[dict[str, Any]], keys: Sequence[str], value: str = "jct_s"
) -> list[dict[str, Any]]:
    """One row per distinct ``keys`` tuple with a ``<system> <value>`` column per system,
    plus ``speedup <system>`` = first system's value / this system's (first-seen orders)."""
    systems = plots.unique([r["system"] for r in rows])
    groups = plots.unique([tuple(r[k] for k in keys) for r in rows])
    lookup = {(tuple(r[k] for k in keys), r["system"]): r.get(value) for r in rows}
    out = []
    for group in groups:
        row: dict[str, Any] = dict(zip(keys, group, strict=True))
        base = lookup.get((group, systems[0]))
        for system in systems:
            row[f"{system} {value}"] = lookup.get((group, system))
        for system in systems[1:]:
            v = lookup.get((group, system))
            row[f"speedup {system}"] = base / v if base and v else None
        out.append(row)
    return out


def capacity_text(rows: Sequence[dict[str, Any]]) -> str:
    """ "<setting>: DualPath/Basic = r×" for each setting holding both systems; a capacity
    that is only a lower bound (the grid's end) says so and yields no plain ratio."""
    parts = []
    for setting in plots.unique([r.get("setting", "") for r in rows]):
        mine = {r["system"]: r for r in rows if r.get("setting", "") == setting}
        basic, dual = mine.get("Basic"), mine.get("DualPath")
        if not (basic and dual and basic.get("capacity_aps") and dual.get("capacity_aps")):
            continue
        b, d = basic["capacity_aps"], dual["capacity_aps"]
        lower_b = str(basic.get("bound", "")).startswith("lower")
        lower_d = str(dual.get("bound", "")).startswith("lower")
        if lower_b and lower_d:
            text = f"both meet the SLO at every grid load (capacity >= {min(b, d):g} APS): no ratio"
        elif lower_d:
            text = f"DualPath/Basic >= {d / b:.2f}× (DualPath meets the SLO at the grid's end)"
        elif lower_b:
            text = f"DualPath/Basic <= {d / b:.2f}× (Basic meets the SLO at the grid's end)"
        else:
            text = f"DualPath/Basic = {d / b:.2f}× (grid resolution: see upper_aps)"
        parts.append(f"{setting}: {text}".strip(": "))
    return "Capacity = highest APS meeting the SLO. " + "; ".join(parts)


def series_table(series: dict[str, list[list[float]]]) -> list[dict[str, Any]]:
    """Mean and peak of each max/avg series, with its sample count."""
    rows = []
    for label, pts in series.items():
        stats = series_stats([(float(t), float(v)) for t, v in pts])
        rows.append(
            {
                "series": label,
                "mean max/avg": stats["mean"],
                "peak max/avg": stats["max"],
                "samples": stats["count"],
            }
        )
    return rows


def ablation_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``speedup`` = first row's JCT / this row's."""
    base = rows[0].get("jct_s")
    return [{**r, "speedup": base / r["jct_s"] if base and r.get("jct_s") else None} for r in rows]


@dataclass(frozen=True, slots=True)
class _Figure:
    name: str  # FigureData method and PNG stem
    title: str
    text: str
    # (data, path, meta, title) → what was drawn
    draw: Callable[[Any, Path, dict[str, Any], str], plots.FigureInfo] | None
    table: Callable[[Any], list[dict[str, Any]]]


def figure_title(fig: _Figure, meta: dict[str, Any]) -> str:
    """'<figure title>: <its setting>' (``meta["settings"][name]``), else the title alone."""
    setting = (meta.get("settings") or {}).get(fig.name, "")
    return f"{fig.title}: {setting}" if setting else fig.title


FIGURES = (
    _Figure(
        "offline_jct",
        "Offline JCT",
        "Job completion time of an offline batch (lower is better); speedup over the first system.",
        lambda d, p, m, t: plots.plot_offline_jct(d, p, t),
        lambda d: pivot(d, ("model", "mal", "agents")),
    ),
    _Figure(
        "pd_sweep",
        "P/D sweep",
        "JCT per prefill/decode node ratio.",
        lambda d, p, m, t: plots.plot_pd_sweep(d, p, t),
        lambda d: pivot(d, ("pd",)),
    ),
    _Figure(
        "online_latency",
        "Online latency vs load",
        "TTFT, TTST and TPOT per arrival rate (statistic: see settings); dashed lines: SLO.",
        lambda d, p, m, t: plots.plot_latency_vs_aps(
            d, p, m.get("slo_ttft_s", 4.0), m.get("slo_tpot_s", 0.050), t
        ),
        list,
    ),
    _Figure("capacity", "Online capacity", "", None, list),
    _Figure(
        "ttft_breakdown",
        "TTFT breakdown",
        "Mean TTFT split into queueing, allocation, KV read and prefill per arrival rate.",
        lambda d, p, m, t: plots.plot_ttft_breakdown(d, p, t),
        list,
    ),
    _Figure(
        "ablation",
        "Ablation",
        "Each step adds one technique (docs/design.md §11); labels are speedups over the first.",
        lambda d, p, m, t: plots.plot_ablation(d, p, t),
        ablation_table,
    ),
    _Figure(
        "snic_balance",
        "Storage-NIC balance",
        "Max/avg SNIC throughput across nodes in sliding windows (1.0 = even); windows in "
        "which no SNIC read anything are gaps, not balance.",
        lambda d, p, m, t: plots.plot_snic_balance(d, p, t),
        series_table,
    ),
    _Figure(
        "attention_balance",
        "Attention balance",
        "Max/avg attention time across the GPUs of an EP group, per forward; gaps: no "
        "forward with attention work.",
        lambda d, p, m, t: plots.plot_attention_balance(d, p, t),
        series_table,
    ),
)


def make_report(data: FigureData, out: str | Path, progress: bool = False) -> list[Path]:
    """Draw every available figure into ``out``, save the data under ``out/data`` and write
    ``out/report.md``. Returns the files written (PNGs, then report.md). ``progress``: one
    line per figure on stderr."""
    folder = Path(out)
    meta = data.meta()
    sections, written = [], []
    if meta.get("notes"):
        sections.append(plots.ReportSection("Settings", None, str(meta["notes"])))
    for i, fig in enumerate(FIGURES, 1):
        if progress:
            print(f"figure {i}/{len(FIGURES)}: {fig.name}", file=sys.stderr, flush=True)
        value = getattr(data, fig.name)()
        if not value:
            sections.append(plots.ReportSection(fig.title, None, "(no data)"))
            continue
        image = None
        if fig.draw is not None:
            title = figure_title(fig, meta)
            written.append(fig.draw(value, folder / f"{fig.name}.png", meta, title).path)
            image = f"{fig.name}.png"
        text = capacity_text(value) if fig.name == "capacity" else fig.text
        sections.append(plots.ReportSection(fig.title, image, text, fig.table(value)))
    save_figure_data(data, folder / "data")
    title = str(meta.get("title", "DualPath evaluation"))
    written.append(plots.write_report_md(sections, folder / "report.md", title=title))
    return written


def add_figures_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("figures", help="draw the evaluation figures and report.md")
    p.add_argument("--out", default="runs/figures", help="output folder (default: runs/figures)")
    p.add_argument("--quick", action="store_true", help="small, fast settings (smoke test)")
    p.add_argument(
        "--from",
        dest="data_dir",
        metavar="DIR",
        help="re-plot saved JSON results (a previous OUT/data)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"parallel simulations (default {DEFAULT_WORKERS}; 1: one by one, in this process)",
    )
    add_ray_arg(p)
    add_cache_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=run_figures)


def resolve_provider(args: argparse.Namespace) -> FigureData:
    """--from DIR → JsonFigureData; else the simulator-backed provider."""
    if getattr(args, "data_dir", None):
        if not Path(args.data_dir).is_dir():
            raise ValueError(f"--from {args.data_dir}: not a folder")
        return JsonFigureData(args.data_dir)
    from dualpath.cli.sim_figures import make_figure_data

    workers, ray_address = int(getattr(args, "workers", 1)), getattr(args, "ray_address", None)
    if workers < 1:
        raise ValueError(f"--workers={workers} is invalid: must be >= 1")
    provider: FigureData = make_figure_data(
        quick=bool(getattr(args, "quick", False)),
        workers=workers,
        ray_address=ray_address,
        progress=not getattr(args, "no_progress", True),
        cache=cache_from_args(args),
    )
    return provider


def run_figures(args: argparse.Namespace, data: FigureData | None = None) -> int:
    """Entry point of `dualpath figures`; ``data`` overrides the provider (tests, scripts)."""
    t0 = time.perf_counter()
    provider = resolve_provider(args) if data is None else data
    progress = not getattr(args, "no_progress", True)
    for path in make_report(provider, args.out, progress):
        print(path)
    cache = getattr(provider, "cache", None)
    where = f"; {cache.describe()}" if cache is not None else ""
    print(f"figures: wall {time.perf_counter() - t0:.1f} s{where}", file=sys.stderr)
    return 0
