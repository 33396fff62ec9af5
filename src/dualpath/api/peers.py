"""DualPath against the KV-reuse designs the field ships (docs/peers.md): one study over
presets, a DRAM-tier size sweep and a TTL sweep, its report.md, JSON, CSV and figures.

Every simulation goes through the shared result cache (``sim.cache``), so a second run, or a
study that shares points with ``dualpath sweep``, simulates only what is new.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.api.grid import Axis, Choice, Sweep, sweep
from dualpath.api.simulation import write_csv
from dualpath.config.systems import SYSTEMS
from dualpath.sim.cache import code_version
from dualpath.sim.report import TABLE_ORDER, storage_read_bytes
from dualpath.sim.results import SimResult
from dualpath.types import KVPath

# every system of the table but the paper's two steps between Basic and DualPath
PEER_SYSTEMS = tuple(n for n in TABLE_ORDER if n not in ("layer", "dpl"))
PEERS = ("recompute", "d2p", "both-read", "dram-tier")  # the field's designs, as shipped
WHAT_IFS = ("d2p-evictable",)  # beyond what the field ships: reported beside the verdict
DEFAULT_PRESETS = ("ds660b-2p4d", "ds27b-1p1d")
TIER_BYTES = (0.0, 40e9, 100e9, 250e9, 500e9, 1e12)  # DRAM per node, 0 … 1 TB
TTLS_S = (0.0, 30.0, 120.0, 480.0, 1800.0)
# the resources a run can be bound by: (name, utilisation classes whose max is its load). A
# DE GPU is busy whenever it decodes anything, however small its batch: its busy share is
# shown beside, not taken as a bound
RESOURCES = (
    ("PE SNIC read", ("pe_snic_read",)),
    ("DE SNIC read", ("de_snic_read",)),
    ("DE SNIC write", ("de_snic_write",)),
    ("PE CNIC", ("pe_cnic_tx", "pe_cnic_rx")),
    ("DE CNIC", ("de_cnic_tx", "de_cnic_rx")),
    ("PE DRAM", ("pe_dram",)),
    ("DE DRAM", ("de_dram",)),
    ("PE GPU", ("pe_gpu",)),
)
BOUND_AT = 0.5  # below this mean utilisation no resource binds: decode, waits or rules do


def binding_resource(result: SimResult) -> tuple[str, float]:
    """The resource class with the highest mean utilisation over the run, and that value;
    ("decode / waits", the value) when none reaches ``BOUND_AT`` (the run is bound by its
    decode steps, or waits on its own rules: a TTL, HBM held)."""
    u = result.utilisation
    loads = [(max(u[c]["mean"] for c in classes), name) for name, classes in RESOURCES]
    value, name = max(loads)
    return (name if value >= BOUND_AT else "decode / waits"), value


@dataclass(frozen=True, slots=True)
class PeerStudy:
    """``main``: presets × MALs × agent counts × systems; ``tiers``: (series, sweep over the
    DRAM per node) for dram-tier (its own node's tier, and with peer pull) and for
    dualpath-resident given the same DRAM; ``ttls``: d2p over its TTL. Both sweeps run on
    the first preset, MAL and agent count."""

    main: Sweep
    tiers: tuple[tuple[str, Sweep], ...] = ()
    ttls: tuple[tuple[str, Sweep], ...] = ()

    def main_rows(self) -> list[dict[str, Any]]:
        rows = []
        for p in self.main.points:
            res = p.simulation.results
            basic = res.get("basic")
            for name in _ordered(res):
                r = res[name]
                bound, load = binding_resource(r)
                hits = sum(rec.hit_tokens for rec in r.records)
                reused = r.counters.get("reused_tokens", 0)
                rows.append(
                    {
                        "point": p.label,
                        "system": name,
                        "jct_s": r.jct_s,
                        "speedup_vs_basic": basic.jct_s / r.jct_s if basic else None,
                        "storage_read_tb": storage_read_bytes(r) / 1e12,
                        "pe_snic_read_tb": r.path_bytes.get(KVPath.STORAGE_TO_PE_BUFFER, 0.0)
                        / 1e12,
                        "de_snic_read_tb": r.path_bytes.get(KVPath.STORAGE_TO_DE_BUFFER, 0.0)
                        / 1e12,
                        "de_snic_write_tb": r.path_bytes.get(KVPath.DE_TO_STORAGE, 0.0) / 1e12,
                        "reused_share": reused / (hits + r.counters.get("recomputed_tokens", 0))
                        if hits
                        else 0.0,
                        "pe_snic_read": r.utilisation["pe_snic_read"]["mean"],
                        "de_snic_read": r.utilisation["de_snic_read"]["mean"],
                        "pe_gpu": r.utilisation["pe_gpu"]["mean"],
                        "de_gpu": r.utilisation["de_gpu"]["mean"],
                        "binding": bound,
                        "binding_load": load,
                    }
                )
        return rows

    def verdicts(self) -> list[dict[str, Any]]:
        """Per main point: DualPath against the best of the field's designs present, and
        dualpath-resident against DualPath."""
        out = []
        for p in self.main.points:
            res = p.simulation.results
            peers = [n for n in PEERS if n in res]
            row: dict[str, Any] = {"point": p.label}
            if "dualpath" in res and peers:
                best = min(peers, key=lambda n: res[n].jct_s)
                row.update(
                    best_peer=best,
                    best_peer_jct_s=res[best].jct_s,
                    dualpath_jct_s=res["dualpath"].jct_s,
                    dualpath_vs_best_peer=res[best].jct_s / res["dualpath"].jct_s,
                    best_peer_binding=binding_resource(res[best])[0],
                )
            if "dualpath" in res and "dualpath-resident" in res:
                row["resident_vs_dualpath"] = res["dualpath"].jct_s / res["dualpath-resident"].jct_s
            for name in WHAT_IFS:
                if name in res and "dualpath" in res:
                    row[f"dualpath_vs_{name}"] = res[name].jct_s / res["dualpath"].jct_s
            out.append(row)
        return out

    def sweep_rows(self, which: str) -> list[dict[str, Any]]:
        """One row per (series, point) of the ``tiers`` or ``ttls`` sweep."""
        rows = []
        for series, study in self.tiers if which == "tiers" else self.ttls:
            for p in study.points:
                for r in p.simulation.results.values():
                    rows.append(
                        {
                            "point": p.label,
                            "system": series,
                            "jct_s": r.jct_s,
                            "storage_read_tb": storage_read_bytes(r) / 1e12,
                            "reused_tokens": r.counters.get("reused_tokens", 0),
                            "binding": binding_resource(r)[0],
                        }
                    )
        return rows

    def report(self) -> str:
        """report.md: the tables, the verdicts and what each column means."""
        base = self.main.points[0].config
        lines = [
            "# DualPath against the field's KV-reuse designs",
            "",
            f"Offline JCT (all agents start together), seed {base.workload.seed}; "
            "the designs and their parameters: docs/peers.md.",
            "",
            "| point | system | JCT s | ×Basic | SNIC read TB PE/DE | SNIC write TB "
            "| hits found w/o storage | SNIC rd PE/DE | GPU PE/DE | binding resource |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.main_rows():
            sp = "-" if r["speedup_vs_basic"] is None else f"{r['speedup_vs_basic']:.2f}"
            lines.append(
                f"| {r['point']} | {r['system']} | {r['jct_s']:.1f} | {sp} | "
                f"{r['pe_snic_read_tb']:.2f}/{r['de_snic_read_tb']:.2f} | "
                f"{r['de_snic_write_tb']:.2f} | {r['reused_share']:.0%} | "
                f"{r['pe_snic_read']:.0%}/{r['de_snic_read']:.0%} | "
                f"{r['pe_gpu']:.0%}/{r['de_gpu']:.0%} | {r['binding']} "
                f"({r['binding_load']:.0%}) |"
            )
        lines += ["", "## DualPath against the best of the field's designs", ""]
        for v in self.verdicts():
            if "best_peer" in v:
                lines.append(
                    f"- {v['point']}: best peer {v['best_peer']} {v['best_peer_jct_s']:.1f} s "
                    f"(bound by {v['best_peer_binding']}), DualPath {v['dualpath_jct_s']:.1f} s: "
                    f"DualPath {v['dualpath_vs_best_peer']:.2f}× its speed"
                    + (
                        f"; dualpath-resident {v['resident_vs_dualpath']:.2f}× DualPath's"
                        if "resident_vs_dualpath" in v
                        else ""
                    )
                    + "".join(
                        f"; against {n} (a what-if) DualPath {v[f'dualpath_vs_{n}']:.2f}×"
                        for n in WHAT_IFS
                        if f"dualpath_vs_{n}" in v
                    )
                )
        for which, head in (("tiers", "DRAM per node"), ("ttls", "d2p TTL")):
            rows = self.sweep_rows(which)
            if not rows:
                continue
            lines += ["", f"## {head}", ""]
            lines += ["| point | system | JCT s | storage read TB | binding |"]
            lines += ["|---|---|---|---|---|"]
            for r in rows:
                lines.append(
                    f"| {r['point']} | {r['system']} | {r['jct_s']:.1f} | "
                    f"{r['storage_read_tb']:.2f} | {r['binding']} |"
                )
        lines += [
            "",
            "Columns: *SNIC read TB PE/DE*: bytes read through the prefill / decode nodes' "
            "storage NICs; *SNIC write TB*: bytes persisted; *hits found "
            "w/o storage*: share of the hit tokens served from an HBM, a DRAM tier or a "
            "decode node (recompute: of those it would have hit); *binding resource*: the "
            "resource class with the highest mean utilisation (DE GPUs left out: busy whenever "
            f"they decode anything; none at {BOUND_AT:.0%} or more: *decode / waits*).",
        ]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "main": self.main_rows(),
            "verdicts": self.verdicts(),
            "tiers": self.sweep_rows("tiers"),
            "ttls": self.sweep_rows("ttls"),
            "main_sweep": self.main.to_json(),
            "code_version": code_version(),
        }

    def write(self, out: str | Path) -> list[Path]:
        """report.md, peers.json, peers.csv and the figures (peers_jct.png, and
        peers_tiers.png / peers_ttls.png where those sweeps ran)."""
        from dualpath.sim.plots import plot_lines, plot_speedups

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        files = [folder / "report.md", folder / "peers.json", folder / "peers.csv"]
        files[0].write_text(self.report(), encoding="utf-8")
        files[1].write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        write_csv(files[2], self.main_rows())
        points = [p.label for p in self.main.points]
        systems = _ordered({n: None for p in self.main.points for n in p.simulation.results})
        speedup = {
            (r["point"], r["system"]): r["speedup_vs_basic"]
            for r in self.main_rows()
            if r["speedup_vs_basic"] is not None
        }
        files.append(folder / "peers_jct.png")
        plot_speedups(points, systems, speedup, files[-1], "DualPath and the field's designs")
        for which, xlabel in (("tiers", "DRAM per node"), ("ttls", "d2p TTL (s)")):
            series: dict[str, list[tuple[str, float]]] = {}
            for r in self.sweep_rows(which):
                series.setdefault(r["system"], []).append((r["point"], r["jct_s"]))
            if series:
                files.append(folder / f"peers_{which}.png")
                plot_lines(series, files[-1], f"Offline JCT over the {xlabel}", xlabel)
        return files


def _ordered(names: Mapping[str, Any]) -> list[str]:
    rank = {n: i for i, n in enumerate(TABLE_ORDER)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))


def _bytes_label(value: float) -> str:
    return "0" if value == 0 else (f"{value / 1e12:g}TB" if value >= 1e12 else f"{value / 1e9:g}GB")


def compare_peers(
    presets: Sequence[str] = DEFAULT_PRESETS,
    *,
    agents: Sequence[int] = (1024,),
    mals: Sequence[str] = ("64k",),
    systems: Sequence[str] = PEER_SYSTEMS,
    tier_bytes: Sequence[float] = TIER_BYTES,
    ttls_s: Sequence[float] = TTLS_S,
    overrides: Sequence[str] = (),
    cache: Any = None,
    workers: int = 1,
    progress: bool = False,
) -> PeerStudy:
    """Run the study (see ``PeerStudy``); empty ``tier_bytes`` / ``ttls_s`` skip a sweep."""
    for name in systems:
        if name not in SYSTEMS:
            raise ValueError(f"system {name!r} is unknown: one of {', '.join(SYSTEMS)}")
    axes = [
        Axis("preset", tuple(Choice(n, (f"preset={n}",)) for n in presets)),
        Axis("fixed", (Choice("", tuple(overrides)),), hidden=True),
        Axis("workload.mal", tuple(Choice(m, (f"workload.mal={m}",)) for m in mals)),
        Axis(
            "workload.num_agents",
            tuple(Choice(str(a), (f"workload.num_agents={a}",)) for a in agents),
        ),
    ]
    kw = {"cache": cache, "workers": workers, "progress": progress}
    main = sweep(presets[0], axes, list(systems), **kw)
    first = [
        f"preset={presets[0]}",
        *overrides,
        f"workload.mal={mals[0]}",
        f"workload.num_agents={agents[0]}",
    ]
    base = Axis("base", (Choice("", tuple(first)),), hidden=True)
    sizes = Axis(
        "reuse.dram_bytes",
        tuple(
            Choice(_bytes_label(b), (f"reuse.dram_tier_bytes={b:g}", f"reuse.resident_bytes={b:g}"))
            for b in tier_bytes
        ),
    )
    tiers: list[tuple[str, Sweep]] = []
    if tier_bytes and "dram-tier" in systems:
        for series, pull in (("dram-tier", "false"), ("dram-tier + peer pull", "true")):
            fixed = Axis("pull", (Choice("", (f"reuse.dram_tier_peer_pull={pull}",)),), True)
            tiers.append((series, sweep(presets[0], [base, fixed, sizes], ["dram-tier"], **kw)))
    if tier_bytes and "dualpath-resident" in systems:
        tiers.append(
            ("dualpath-resident", sweep(presets[0], [base, sizes], ["dualpath-resident"], **kw))
        )
    ttls: list[tuple[str, Sweep]] = []
    ttl = Axis(
        "reuse.d2p_ttl_s", tuple(Choice(f"{t:g}", (f"reuse.d2p_ttl_s={t:g}",)) for t in ttls_s)
    )
    for series in ("d2p", "d2p-evictable"):
        if ttls_s and series in systems:
            ttls.append((series, sweep(presets[0], [base, ttl], [series], **kw)))
    return PeerStudy(main, tuple(tiers), tuple(ttls))
