"""PNG figures of simulation results (matplotlib, Agg backend): JCT and utilisation per system,
and JCT over a sweep grid. Writes only the file it is given."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from dualpath.metrics.plots import colour
from dualpath.sim.results import SimResult

_UTIL = (
    ("pe_snic_read", "PE SNIC rd"),
    ("de_snic_read", "DE SNIC rd"),
    ("pe_cnic_rx", "PE CNIC rx"),
    ("de_cnic_tx", "DE CNIC tx"),
    ("de_cnic_rx", "DE CNIC rx"),
    ("de_dram", "DE DRAM"),
    ("pe_gpu", "PE GPU"),
    ("de_gpu", "DE GPU"),
)


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: Mapping[str, SimResult], path: Path, title: str) -> None:
    """Left: JCT per system (s), labelled with the speed-up over Basic. Right: mean
    utilisation of each resource class per system (%)."""
    plt = _pyplot()
    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=(1, 2))
    jcts = [results[n].jct_s for n in names]
    bars = ax1.bar(names, jcts, color=[colour(n, names) for n in names])
    basic = results.get("basic")
    for bar, n in zip(bars, names, strict=True):
        label = f"{results[n].jct_s:.0f} s"
        if basic is not None:
            label += f"\n{basic.jct_s / results[n].jct_s:.2f}×"
        ax1.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax1.set_ylabel("job completion time (s)")
    ax1.set_xlabel("system")
    ax1.set_title("Offline JCT (lower is better)")
    ax1.set_ylim(0, max(jcts) * 1.25)
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        u = results[n].utilisation
        xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(_UTIL))]
        ax2.bar(
            xs, [100 * u[key]["mean"] for key, _ in _UTIL], width, label=n, color=colour(n, names)
        )
    ax2.set_xticks(range(len(_UTIL)), [label for _, label in _UTIL], rotation=20)
    ax2.set_ylabel("mean utilisation (%)")
    ax2.set_ylim(0, 105)
    ax2.set_title("Resource utilisation over the JCT")
    ax2.legend(title="system", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(
    points: Sequence[str],
    systems: Sequence[str],
    jct_s: Mapping[tuple[str, str], float],
    path: Path,
    title: str,
    xlabel: str = "grid point",
) -> None:
    """Grouped bars: JCT (s) per grid point, one bar per system; ``xlabel`` names what the
    tick labels are (the sweep's axes). A missing result is left out, never drawn as 0."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(points) * max(1, len(systems)) / 2), 4.8))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [k + (i - (len(systems) - 1) / 2) * width for k in range(len(points))]
        ys = [jct_s.get((p, s), math.nan) for p in points]
        ax.bar(xs, ys, width, label=s, color=colour(s, systems))
    ax.set_xticks(range(len(points)), points, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("job completion time (s)")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(title="system")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lines(
    series: Mapping[str, Sequence[tuple[str, float]]], path: Path, title: str, xlabel: str
) -> None:
    """One line per series over shared x tick labels (in the order first seen): JCT (s)."""
    plt = _pyplot()
    ticks: list[str] = []
    for points in series.values():
        for label, _ in points:
            if label not in ticks:
                ticks.append(label)
    names = list(series)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name in names:
        xs = [ticks.index(label) for label, _ in series[name]]
        ax.plot(xs, [v for _, v in series[name]], marker="o", label=name, color=colour(name, names))
    ax.set_xticks(range(len(ticks)), ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("job completion time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# the peers study's bars (docs/peers.md): the paper's systems in their usual colours, the
# field's designs in warm ones, ours beyond the paper in deep blue
_PEER_COLOURS = {
    "basic": "#7f7f7f",
    "recompute": "#d62728",
    "d2p": "#ff7f0e",
    "d2p-evictable": "#ffbb78",
    "both-read": "#e377c2",
    "dram-tier": "#8c564b",
    "dualpath": "#1f77b4",
    "dualpath-resident": "#17becf",
    "oracle": "#2ca02c",
}


def plot_speedups(
    points: Sequence[str],
    systems: Sequence[str],
    speedup: Mapping[tuple[str, str], float],
    path: Path,
    title: str,
) -> None:
    """Grouped bars: each system's speed-up over Basic (JCT(Basic) / JCT) per point, on a
    log axis (a design 20× slower and one 3× faster stay readable), 1 marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 2.4 * len(points)), 4.8))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [k + (i - (len(systems) - 1) / 2) * width for k in range(len(points))]
        ys = [speedup.get((p, s), math.nan) for p in points]
        ax.bar(xs, ys, width, label=s, color=_PEER_COLOURS.get(s, colour(s, systems)))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(points)), points, fontsize=8)
    ax.set_ylabel("speed-up over Basic (JCT ratio, log)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
