"""Comparisons across systems and their table/CSV rows (pure; the CLI writes the files).

Speed-up over Basic = JCT(Basic) / JCT(system); fraction of Oracle = JCT(Oracle) / JCT(system)
(1.0 = as fast as the compute-bound limit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dualpath.sim.results import SimResult
from dualpath.sim.transfers import PATH_KINDS, REUSE_KINDS
from dualpath.types import KVPath

CSV_COLUMNS = (
    "system",
    "jct_s",
    "speedup_vs_basic",
    "fraction_of_oracle",
    "num_turns",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "pe_snic_read",
    "de_snic_read",
    "pe_cnic_tx",
    "pe_cnic_rx",
    "de_cnic_tx",
    "de_cnic_rx",
    "pe_dram",
    "de_dram",
    "pe_gpu",
    "de_gpu",
    "share_read_pe",
    "share_read_de",
    "share_read_none",
    *(f"bytes_{kind}" for kind in PATH_KINDS),  # the KV paths (types.KVPath), collectives
    *(f"bytes_{kind}" for kind in REUSE_KINDS),  # the reuse designs' hops (0 elsewhere)
)


def comparisons(results: Mapping[str, SimResult]) -> dict[str, dict[str, float | None]]:
    """Per system: speed-up over Basic and fraction of Oracle (None when that system is absent)."""
    basic = results.get("basic")
    oracle = results.get("oracle")
    out: dict[str, dict[str, float | None]] = {}
    for name, r in results.items():
        out[name] = {
            "speedup_vs_basic": basic.jct_s / r.jct_s if basic and r.jct_s > 0 else None,
            "fraction_of_oracle": oracle.jct_s / r.jct_s if oracle and r.jct_s > 0 else None,
        }
    return out


def _pct(summary: Mapping[str, Any], metric: str, key: str) -> float | None:
    value = summary.get(metric, {})
    return value.get(key) if isinstance(value, Mapping) else None


def csv_row(result: SimResult, comparison: Mapping[str, float | None]) -> dict[str, Any]:
    u = result.utilisation
    shares = result.read_side_shares
    row: dict[str, Any] = {
        "system": result.system,
        "jct_s": result.jct_s,
        "speedup_vs_basic": comparison.get("speedup_vs_basic"),
        "fraction_of_oracle": comparison.get("fraction_of_oracle"),
        "num_turns": result.num_turns,
        "ttft_p50_s": _pct(result.summary, "ttft_s", "p50"),
        "ttft_p99_s": _pct(result.summary, "ttft_s", "p99"),
        "tpot_mean_s": _pct(result.summary, "tpot_s", "mean"),
        "share_read_pe": shares.get("pe", 0.0),
        "share_read_de": shares.get("de", 0.0),
        "share_read_none": shares.get("none", 0.0),
    }
    for name in CSV_COLUMNS:
        if name in u:
            row[name] = u[name]["mean"]
        elif name.startswith("bytes_"):
            row[name] = result.path_bytes.get(name[len("bytes_") :], 0.0)
    return {name: row.get(name) for name in CSV_COLUMNS}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: Mapping[str, SimResult], title: str = "") -> str:
    """A fixed-width table of JCT, speed-ups, utilisation and read sides, one row per system."""
    comp = comparisons(results)
    w = max([9, *(len(name) for name in results)])
    head = (
        f"{'system':<{w}} {'JCT s':>9} {'×Basic':>7} {'Oracle':>7} {'SNIC PE/DE':>11} "
        f"{'CNIC PE/DE':>11} {'DRAM PE/DE':>11} {'GPU PE/DE':>11} {'DE reads':>8} "
        f"{'read TB':>7}"
    )
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for name, r in results.items():
        u = r.utilisation

        def pair(a: str, b: str, u: Mapping[str, Mapping[str, float]] = u) -> str:
            return f"{u[a]['mean']:.0%}/{u[b]['mean']:.0%}"

        cnic = (
            f"{max(u['pe_cnic_tx']['mean'], u['pe_cnic_rx']['mean']):.0%}/"
            f"{max(u['de_cnic_tx']['mean'], u['de_cnic_rx']['mean']):.0%}"
        )
        lines.append(
            f"{name:<{w}} {r.jct_s:>9.1f} {_fmt(comp[name]['speedup_vs_basic'], '.2f'):>7} "
            f"{_fmt(comp[name]['fraction_of_oracle'], '.0%'):>7} "
            f"{pair('pe_snic_read', 'de_snic_read'):>11} {cnic:>11} "
            f"{pair('pe_dram', 'de_dram'):>11} {pair('pe_gpu', 'de_gpu'):>11} "
            f"{r.read_side_shares.get('de', 0.0):>8.0%} {storage_read_bytes(r) / 1e12:>7.2f}"
        )
    return "\n".join(lines)


def results_json(
    results: Mapping[str, SimResult], extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``results.json`` payload: per-system results and comparisons (deterministic)."""
    comp = comparisons(results)
    return {
        **(dict(extra) if extra else {}),
        "systems": [name for name in results],
        "results": {name: r.to_dict() for name, r in results.items()},
        "comparisons": comp,
    }


# Basic, the field's designs beside it, the paper's steps to DualPath, beyond it, the limit
TABLE_ORDER = (
    "basic",
    "recompute",
    "d2p",
    "d2p-evictable",
    "both-read",
    "dram-tier",
    "layer",
    "dpl",
    "dualpath",
    "dualpath-resident",
    "oracle",
)


def storage_read_bytes(result: SimResult) -> float:
    """Bytes the run read from storage, through every node's storage NICs."""
    paths = result.path_bytes
    return paths.get(KVPath.STORAGE_TO_PE_BUFFER, 0.0) + paths.get(KVPath.STORAGE_TO_DE_BUFFER, 0.0)


def order_systems(names: Sequence[str]) -> list[str]:
    """Systems in the table's order (``config.systems``: the paper's five, then the field's
    designs and dualpath-resident)."""
    rank = {n: i for i, n in enumerate(TABLE_ORDER)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))
