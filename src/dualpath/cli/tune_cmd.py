"""`dualpath tune`: choose P/D (and nodes per EP group) for a node budget by simulation.

Candidates inside the planner's bottleneck-free range (design §5) are simulated first, then
the ones outside it. Each point is one offline simulation (objective: JCT) or one online run
at a fixed APS (objective: meet the SLO, then the lowest mean TTFT). Results go through the
shared result cache (``sim.cache``: ``--cache-dir``, default ``$DUALPATH_CACHE`` or
runs/cache) so a re-run, a wider search over the same budget, or a `dualpath sim` of the same
shape simulates only what is new. Jobs run in parallel processes or on Ray.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.cli.common import add_cache_args, add_config_args, add_ray_arg, cache_from_args
from dualpath.cli.sim_cmd import build_inputs
from dualpath.config import Config, apply_overrides
from dualpath.config.sim import SimConfig
from dualpath.metrics.slo import SLO
from dualpath.models.planner import as_fraction, plan
from dualpath.sim.cache import ResultCache, run_meta
from dualpath.sim.jobs import Job, offline_job, online_job, run_jobs
from dualpath.sim.online import OnlineResult, OnlineSettings
from dualpath.sim.results import SimResult


@dataclass(frozen=True, slots=True)
class Candidate:
    """One cluster shape: P prefill and D decode nodes, EP groups of so many nodes (0 = all)."""

    p: int
    d: int
    prefill_ep_nodes: int = 0
    decode_ep_nodes: int = 0

    @property
    def label(self) -> str:
        ep = ""
        if self.prefill_ep_nodes or self.decode_ep_nodes:
            ep = f" ep{self.prefill_ep_nodes or self.p}/{self.decode_ep_nodes or self.d}"
        return f"{self.p}P{self.d}D{ep}"

    def overrides(self) -> list[str]:
        return [
            f"cluster.num_prefill_nodes={self.p}",
            f"cluster.num_decode_nodes={self.d}",
            f"cluster.prefill_ep_nodes={self.prefill_ep_nodes}",
            f"cluster.decode_ep_nodes={self.decode_ep_nodes}",
        ]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(
    config: Config, nodes: int, search_ep: bool
) -> tuple[list[Candidate], list[Candidate]]:
    """(inside the bottleneck-free range, outside it), each by P ascending."""
    if nodes < 2:
        raise ValueError(f"--nodes={nodes} is invalid: must be >= 2 (one prefill, one decode)")
    inside: list[Candidate] = []
    outside: list[Candidate] = []
    for p in range(1, nodes):
        d = nodes - p
        shapes = [Candidate(p, d)]
        if search_ep:
            shapes += [
                Candidate(p, d, pe, de)
                for pe in _divisors(p)
                for de in _divisors(d)
                if (pe, de) != (p, d)
            ]
        (inside if plan(config, p, d).in_range else outside).extend(shapes)
    return inside, outside


def _job(config: Config, sim: SimConfig, system: str, mode: dict[str, Any]) -> Job:
    """The shared-cache job of one point: an offline simulation, or an online run at the
    mode's APS (``sim.cache``: the same entry `dualpath sim` / `online` would use)."""
    if mode["kind"] == "offline":
        return offline_job(config, system, sim)
    settings = OnlineSettings(
        aps=mode["aps"], horizon_s=mode["horizon_s"], slo=SLO(mode["ttft_s"], mode["tpot_s"])
    )
    return online_job(config, system, settings, sim)


def _point(result: Any, mode: dict[str, Any]) -> dict[str, Any]:
    """The figures the ranking and report need from one point's result."""
    if mode["kind"] == "offline":
        r: SimResult = result
        return {"jct_s": r.jct_s, "utilisation": r.utilisation, "num_turns": r.num_turns}
    o: OnlineResult = result
    s = o.summary
    return {
        "passed": o.passed,
        "ttft_s": s.ttft.mean,
        "tpot_s": s.tpot.mean if s.tpot.count else None,
        "stop": o.stop_reason,
        "agents": o.num_agents,
    }


def _score(row: dict[str, Any], mode: dict[str, Any]) -> tuple[float, ...]:
    """Lower is better: JCT offline; online, SLO passes first, then mean TTFT."""
    r = row["result"]
    if mode["kind"] == "offline":
        return (r["jct_s"],)
    return (0.0 if r["passed"] else 1.0, r["ttft_s"])


def _busiest(util: dict[str, dict[str, float]], n: int = 2) -> str:
    top = sorted(util.items(), key=lambda kv: (-kv[1]["mean"], kv[0]))[:n]
    return ", ".join(f"{name} {u['mean']:.0%}" for name, u in top)


def search(
    base: Config,
    sim: SimConfig,
    system: str,
    mode: dict[str, Any],
    shapes: list[tuple[Candidate, bool]],
    cache: ResultCache,
    workers: int,
    progress: bool,
    ray_address: str | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Rows for every shape (from the shared result cache or simulated now) and how many
    were simulated now."""
    rows: list[dict[str, Any]] = []
    jobs: list[Job] = []
    for cand, inside in shapes:
        config = apply_overrides(base, cand.overrides())
        job = _job(config, sim, system, mode)
        jobs.append(job)
        rows.append(
            {
                "shape": cand.label,
                "p": cand.p,
                "d": cand.d,
                "in_range": inside,
                "key": job.key,
                "prefill_ep_nodes": cand.prefill_ep_nodes,
                "decode_ep_nodes": cand.decode_ep_nodes,
            }
        )
    misses = cache.misses
    results = run_jobs(jobs, cache, workers, ray_address, progress, desc="tune")
    for row, result in zip(rows, results, strict=True):
        row["result"] = _point(result, mode)
    return rows, cache.misses - misses


def _plot(rows: list[dict[str, Any]], mode: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = "jct_s" if mode["kind"] == "offline" else "ttft_s"
    ordered = sorted(rows, key=lambda r: (r["p"] / r["d"], r["shape"]))
    values = [r["result"][metric] for r in ordered]
    colours = ["tab:blue" if r["in_range"] else "tab:gray" for r in ordered]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(ordered)), 3.6))
    xs = list(range(len(ordered)))
    ax.bar(xs, values, color=colours)
    ax.set_xticks(xs, [r["shape"] for r in ordered])
    ax.set_ylabel("JCT (s)" if metric == "jct_s" else "mean TTFT (s)")
    ax.set_xlabel("P/D (blue: inside the planner's bottleneck-free range)")
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def explain(
    best: dict[str, Any], ranked: list[dict[str, Any]], base: Config, mode: dict[str, Any]
) -> list[str]:
    """Why the best shape wins, in the planner's and the simulation's terms."""
    rep = plan(base, best["p"], best["d"])
    lines = [
        f"planner range for this hardware: {as_fraction(rep.lower)} ≤ P/D ≤ "
        f"{as_fraction(rep.upper)} (lower bound: {rep.lower_binding}; upper: {rep.upper_binding})",
        f"{best['shape']}: P/D = {as_fraction(best['p'] / best['d'])} is "
        + ("inside" if best["in_range"] else "outside")
        + " the range"
        + (
            ": every SNIC can be saturated with no CNIC or DRAM bottleneck, and DualPath's "
            f"I/O headroom over the PE path alone is (P+D)/P = {rep.ideal_io_speedup:.2f}x"
            if best["in_range"]
            else f"; at full storage bandwidth its busiest resource would be {rep.bottleneck.resource}"
        ),
    ]
    r = best["result"]
    if mode["kind"] == "offline":
        lines.append(
            f"simulated: JCT {r['jct_s']:.1f} s; busiest resources {_busiest(r['utilisation'])}"
        )
        if len(ranked) > 1:
            nxt = ranked[1]
            gain = nxt["result"]["jct_s"] / r["jct_s"] - 1
            lines.append(
                f"runner-up {nxt['shape']} is {gain:.1%} slower "
                f"(busiest: {_busiest(nxt['result']['utilisation'])})"
            )
        out = [x for x in ranked if not x["in_range"]]
        if best["in_range"] and out:
            lines.append(
                f"fastest outside the range: {out[0]['shape']} at {out[0]['result']['jct_s']:.1f} s"
            )
    else:
        verdict = "meets" if r["passed"] else "misses"
        lines.append(
            f"simulated at {mode['aps']:g} APS: {verdict} the SLO, mean TTFT {r['ttft_s']:.2f} s"
        )
    return lines


def run_tune(args: argparse.Namespace) -> int:
    base, sim = build_inputs(args)
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} is invalid: must be >= 1")
    if args.aps is not None:
        if not (args.aps > 0 and args.aps < float("inf")):
            raise ValueError(f"--aps={args.aps} is invalid: must be a finite number > 0")
        mode: dict[str, Any] = {
            "kind": "online",
            "aps": args.aps,
            "horizon_s": args.horizon_s,
            "ttft_s": args.ttft_slo,
            "tpot_s": args.tpot_slo,
        }
        SLO(args.ttft_slo, args.tpot_slo)
    else:
        mode = {"kind": "offline"}
    inside, outside = candidates(base, args.nodes, args.search_ep)
    shapes = [(c, True) for c in inside]
    if not args.inside_only or not inside:
        shapes += [(c, False) for c in outside]
    out = Path(args.out or f"runs/tune-{base.name}-{args.nodes}n-{mode['kind']}")
    t0 = time.perf_counter()
    rows, simulated = search(
        base,
        sim,
        args.system,
        mode,
        shapes,
        cache_from_args(args),
        args.workers,
        not args.no_progress,
        args.ray_address,
    )
    wall = time.perf_counter() - t0
    ranked = sorted(rows, key=lambda r: (_score(r, mode), r["shape"]))
    best = ranked[0]
    w = base.workload
    what = (
        f"{w.num_agents} agents, MAL {w.mal}"
        if mode["kind"] == "offline"
        else f"{args.aps:g} APS, MAL {w.mal}"
    )
    title = f"dualpath tune: {base.model.name}, {args.nodes} nodes, {what}, {args.system}"
    print(title)
    metric = "JCT s" if mode["kind"] == "offline" else "TTFT s"
    print(f"  {'rank':>4}  {'shape':<14} {'P/D':>5}  {'range':<7} {metric:>9}")
    for i, r in enumerate(ranked, 1):
        value = r["result"]["jct_s" if mode["kind"] == "offline" else "ttft_s"]
        flag = "" if mode["kind"] == "offline" or r["result"]["passed"] else "  (SLO missed)"
        print(
            f"  {i:>4}  {r['shape']:<14} {as_fraction(r['p'] / r['d']):>5}  "
            f"{'inside' if r['in_range'] else 'outside':<7} {value:>9.2f}{flag}"
        )
    print(f"best: {best['shape']}; runner-ups: {', '.join(r['shape'] for r in ranked[1:3]) or '-'}")
    for line in explain(best, ranked, base, mode):
        print("  " + line)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "run": run_meta(base),
        "title": title,
        "mode": mode,
        "system": args.system,
        "nodes": args.nodes,
        "best": best["shape"],
        "ranked": ranked,
    }
    (out / "tune.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    _plot(rows, mode, out / "tune.png", title)
    print(
        f"search: {len(rows)} shapes, {simulated} simulated, {len(rows) - simulated} from "
        f"cache, wall {wall:.1f} s; wrote {out}/tune.json, tune.png"
    )
    return 0


def add_tune_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("tune", help="pick P/D (and EP grouping) for a node budget by simulation")
    add_config_args(p)
    p.add_argument("--nodes", type=int, required=True, help="node budget: P + D")
    p.add_argument(
        "--system", default="dualpath", choices=("basic", "layer", "dpl", "dualpath", "oracle")
    )
    p.add_argument("--agents", type=int, help="offline: number of agents")
    p.add_argument("--mal", help="maximum agent context length: 32k, 48k or 64k")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument("--aps", type=float, help="online at this APS instead of offline JCT")
    p.add_argument("--horizon-s", type=float, default=600.0, help="online run length (600)")
    p.add_argument("--ttft-slo", type=float, default=4.0, help="online TTFT SLO in s (4)")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="online TPOT SLO in s (0.05)")
    p.add_argument(
        "--search-ep",
        action="store_true",
        help="also try every divisor of P and D as nodes per EP group",
    )
    p.add_argument(
        "--inside-only",
        action="store_true",
        help="skip shapes outside the planner's range (unless none is inside)",
    )
    p.add_argument("--workers", type=int, default=2, help="parallel processes (default 2)")
    add_ray_arg(p)
    add_cache_args(p)
    p.add_argument("--out", help="output folder (default: runs/tune-<preset>-<N>n-<mode>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_tune, systems=None, no_traffic_manager=False)
