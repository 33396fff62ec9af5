"""Online capacity benchmark (design §12): DualPath/Basic capacity ratios on DS 27B 1P1D and
DS 660B 2P4D, and TTST/TPOT of both systems at a common APS.

    .venv/bin/python benchmarks/bench_online.py [--quick] [--mals 32k,48k,64k] [--workers 2]
        [--presets ds660b-2p4d,ds27b-1p1d] [--bracket ds660b-2p4d/basic=1:2 ...]
        [--probe-log runs/online_probes.jsonl] [--out runs/bench_online.json]

Each setting is a (preset, MAL) pair: both presets at every MAL of ``--mals`` (default 32K,
48K and 64K). Each capacity probe is one seeded online run (Poisson arrivals, stop rule with a
60 s window and 180 s lookback; SLO mean TTFT ≤ 4 s, mean TPOT ≤ 50 ms, judged in windows)
whose warm-up and horizon are derived from the setting's workload (``steady_settings``:
agents live whole lives; ``--quick``: a fixed 300 s horizon). A capacity above the system's
storage bound is an error, never a row (``StorageBound.check``); each row carries the bound.
Prints progress per probe (wall time included) and a final table; nothing is tuned to the
paper's numbers.

``--bracket NAME/SYSTEM=LO:HI`` replaces the first bracket of one capacity search (the
bisection and its tolerance are unchanged; a bracket one halving step of the default's
``lo`` apart from the answer skips the probes that only shrink the bracket). With
``--probe-log`` every probe's verdict is appended to a JSON-lines file and a probe already
in it (same setting, system, APS and horizon) is reused instead of simulated again, so an
interrupted search can be resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from dualpath.config import apply_overrides, preset
from dualpath.metrics.capacity import find_capacity
from dualpath.sim.online import OnlineSettings, run_online, steady_settings, storage_bound

# (preset, first bracket lo, hi): the bracket grows/shrinks by itself if wrong.
SETTINGS = (("ds660b-2p4d", 4.0, 16.0), ("ds27b-1p1d", 2.0, 8.0))
SYSTEMS = ("basic", "dualpath")


def _settings(quick: bool, setting: str) -> OnlineSettings:
    if quick:
        return OnlineSettings(aps=1.0, horizon_s=300.0, window_s=30.0, lookback_s=90.0)
    base = OnlineSettings(aps=1.0, window_s=60.0, lookback_s=180.0)
    return steady_settings(_config(setting), base)


def _config(setting: str):  # type: ignore[no-untyped-def]
    name, mal = setting.split("@")
    return apply_overrides(preset(name), [f"workload.mal={mal}", "workload.seed=1"])


def _probe_key(name: str, system: str, aps: float, quick: bool) -> str:
    return f"{name}|{system}|{aps!r}|{_settings(quick, name).horizon_s!r}"


def _read_probe_log(path: str) -> dict[str, dict]:
    if not path or not Path(path).exists():
        return {}
    seen = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            seen[row["key"]] = row
    return seen


def _capacity_job(
    name: str, system: str, lo: float, hi: float, quick: bool, probe_log: str = ""
) -> dict:
    t0 = time.time()
    seen = _read_probe_log(probe_log)
    config, settings = _config(name), _settings(quick, name)

    bound = storage_bound(config, system)

    def passes(aps: float) -> bool:
        if aps > bound.aps:  # no steady state above the storage bound (studies.capacity)
            print(f"  {name} {system:<8} aps={aps:7.3f} fail (above the storage bound)")
            return False
        key = _probe_key(name, system, aps, quick)
        if key in seen:
            row = seen[key]
            print(f"  {name} {system:<8} aps={aps:7.3f} {row['verdict']} (reused)", flush=True)
            return bool(row["passed"])
        t1 = time.time()
        r = run_online(config, system, dataclasses.replace(settings, aps=aps))
        verdict = "PASS" if r.passed else "fail"
        print(
            f"  {name} {system:<8} aps={aps:7.3f} {verdict} "
            f"stop={r.stop_reason}@{r.stopped_at_s:.0f}s ttft={r.slo_check.ttft_s:.3f}s "
            f"tpot={r.slo_check.tpot_s * 1e3:.1f}ms agents={r.num_agents} "
            f"probe wall={time.time() - t1:.0f}s wall={time.time() - t0:.0f}s",
            flush=True,
        )
        if probe_log:
            row = {"key": key, "passed": r.passed, "verdict": verdict, "wall_s": time.time() - t1}
            with open(probe_log, "a") as f:
                f.write(json.dumps({**row, "stop": r.stop_reason, "at_s": r.stopped_at_s}) + "\n")
        return r.passed

    res = find_capacity(passes, lo, hi, rel_tol=0.1, max_iter=9)
    bound.check(res.capacity_aps, f"{name} {system}")
    return {
        "setting": name,
        "system": system,
        "wall_s": time.time() - t0,
        **res.to_dict(),
        "storage_bound_aps": bound.aps,
        "warmup_s": settings.warmup_s,
        "horizon_s": settings.horizon_s,
    }


def _latency_job(name: str, system: str, aps: float, quick: bool) -> dict:
    r = run_online(_config(name), system, dataclasses.replace(_settings(quick, name), aps=aps))
    s = r.summary
    return {
        "setting": name,
        "system": system,
        "aps": aps,
        "stop": r.stop_reason,
        "ttft_mean_s": s.ttft.mean,
        "ttst_mean_s": s.ttst.mean,
        "ttst_p90_s": s.ttst.p90,
        "tpot_mean_s": s.tpot.mean,
        "tpot_p90_s": s.tpot.p90,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mals", default="32k,48k,64k", help="comma-separated MALs")
    ap.add_argument("--out", default="runs/bench_online.json")
    ap.add_argument("--presets", default=",".join(name for name, _, _ in SETTINGS))
    ap.add_argument(
        "--bracket",
        action="append",
        default=[],
        metavar="NAME/SYSTEM=LO:HI",
        help="first bracket of one capacity search (default: the preset's)",
    )
    ap.add_argument("--probe-log", default="", help="JSON-lines file of probe verdicts to reuse")
    args = ap.parse_args(argv)
    known = {name: (lo, hi) for name, lo, hi in SETTINGS}
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets or any(p not in known for p in presets):
        print(f"bench_online: error: --presets={args.presets!r} is invalid: use {sorted(known)}")
        return 2
    brackets: dict[tuple[str, str], tuple[float, float]] = {}
    for spec in args.bracket:
        try:
            target, span = spec.split("=")
            pname, system = target.split("/")
            lo_s, hi_s = span.split(":")
            lo, hi = float(lo_s), float(hi_s)
        except ValueError:
            lo = hi = -1.0
            pname = system = ""
        if pname not in known or system not in SYSTEMS or not 0 < lo < hi:
            print(f"bench_online: error: --bracket={spec!r} is invalid: use NAME/SYSTEM=LO:HI")
            return 2
        brackets[(pname, system)] = (lo, hi)
    mals = [m.strip().lower() for m in args.mals.split(",") if m.strip()]
    bad = [m for m in mals if m not in ("32k", "48k", "64k")]
    if bad or not mals:
        print(f"bench_online: error: --mals={args.mals!r} is invalid: use 32k, 48k, 64k")
        return 2
    settings = [
        (f"{name}@{mal}", lo, hi) for mal in mals for name, lo, hi in SETTINGS if name in presets
    ]
    t0 = time.time()
    with ProcessPoolExecutor(args.workers) as pool:
        futs = [
            pool.submit(
                _capacity_job,
                name,
                system,
                *brackets.get((name.split("@")[0], system), (lo, hi)),
                args.quick,
                args.probe_log,
            )
            for name, lo, hi in settings
            for system in SYSTEMS
        ]
        caps = [f.result() for f in futs]
        common = {}
        for name, _, _ in settings:
            basic = next(c for c in caps if c["setting"] == name and c["system"] == "basic")
            common[name] = round(0.8 * basic["capacity_aps"], 3)
        lat_futs = [
            pool.submit(_latency_job, name, system, common[name], args.quick)
            for name, _, _ in settings
            for system in SYSTEMS
        ]
        lats = [f.result() for f in lat_futs]
    print("\nsetting        system    capacity_aps  upper_aps  storage_bound  probes  wall_s")
    for c in caps:
        print(
            f"{c['setting']:<18} {c['system']:<8} {c['capacity_aps']:12.3f} "
            f"{c['upper_aps'] or float('inf'):10.3f} {c['storage_bound_aps']:14.3f} "
            f"{len(c['probes']):7d} {c['wall_s']:7.0f}"
        )
        print(f"  storage bound {c['setting']} {c['system']}: capacity <= bound: ok")
    ratios = {}
    for name, _, _ in settings:
        by = {c["system"]: c["capacity_aps"] for c in caps if c["setting"] == name}
        ratios[name] = by["dualpath"] / by["basic"] if by["basic"] > 0 else float("nan")
        print(f"capacity ratio DualPath/Basic {name}: {ratios[name]:.2f}x")
    print("\nsetting        system    aps     TTFT mean  TTST mean  TTST p90  TPOT mean  TPOT p90")
    for r in lats:
        print(
            f"{r['setting']:<18} {r['system']:<8} {r['aps']:6.2f} {r['ttft_mean_s']:9.3f}s "
            f"{r['ttst_mean_s']:9.3f}s {r['ttst_p90_s']:8.3f}s {r['tpot_mean_s'] * 1e3:8.2f}ms "
            f"{r['tpot_p90_s'] * 1e3:7.2f}ms"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"capacity": caps, "latency": lats, "ratios": ratios}, indent=1))
    print(f"\nwrote {out}; total wall {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
