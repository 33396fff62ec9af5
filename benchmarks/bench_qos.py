"""The traffic manager on real packets: the PEs' per-layer hidden-state exchange across two
prefill nodes while DualPath's KV traffic fills their compute NICs, with and without the two
tc classes (arXiv 2602.21548 §5.3; docs/operations.md).

Run (root): .venv/bin/python benchmarks/bench_qos.py [--seconds 10] [--cnic-mbit 128]

A one-host cluster of the 2P4D preset (``dualpath cluster``: one network namespace per node,
CNICs shaped by the kernel). In p0 and p1 a PE process runs the runtime's ``HiddenExchange``
over the collectives' own marked TCP transport (``make_collective_transport``): passes of
``--layers`` layers, each layer ``--compute-ms`` of emulated GPU time (a sleep, as the
runtime's emulated GPU) and then the all-gather of ``--tokens`` tokens' hidden states
(float32, 256 wide). On every node a KV process moves 256 KiB blocks with the runtime's
unmarked TCP KV transport, four in flight, in DualPath's pattern: the DE read path
(d0, d1 → p0; d2, d3 → p1: DE buffer → PE HBM) and the PD transfer (p0 → d0, p1 → d2: PE
HBM → DE buffer), so each PE's CNIC is full both ways. Four cases, run in ``--rounds``
interleaved rounds and pooled:

  idle        no KV traffic (the CNICs shaped by one queue, tbf)
  busy host   about as many KV bytes, but between decode nodes only: no KV on a PE's CNIC.
              The control for this host's CPU, which the network stack shares with the PEs
  one queue   KV traffic, every CNIC one queue (tbf, as without a traffic manager)
  classes     KV traffic, every CNIC with the traffic manager's two classes (htb:
              collectives 99% guaranteed, KV a 1% floor and every idle byte)

Two choices keep this host's CPUs out of what is measured (on a GPU node the collective is
driven by the GPU and KV is moved by the NIC, neither by a busy host CPU): the PE processes
run SCHED_FIFO (``--pe-priority``), and the KV movers are pinned to CPU 0 and the PEs to the
other CPUs (``--pin``, default; the kernel processes a packet mostly on its sender's CPU, so
the KV traffic's stack stays off the PEs' CPU). ``busy host`` checks what is left: with
``--no-pin`` it shows the KV stack slowing the exchange without sharing a link with it.

Printed per case: the exchange's per-layer latency (p50, p99: from a layer's send to the
last peer's states received), the PE pass time (compute + exchange, p50), the job time (the
passes the PEs run in ``--seconds``: mean pass time × 1000 passes, a fixed job), and KV
throughput on the PEs' CNICs (kernel counters, both directions, Mbit/s per PE). Then the goals:
exchange p99 with the classes <= 1.5x idle, without them >= 5x idle, KV throughput with the
classes >= 90% of without. Then the simulator on the same preset with ``sim.traffic_manager``
on and off (``--no-sim`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

PRESET = "ds660b-2p4d"
HIDDEN = 256
BLOCK_BYTES = 256 * 1024
KV_WINDOW = 4
KV_PATTERN = {"p0": ["d0"], "p1": ["d2"], "d0": ["p0"], "d1": ["p0"], "d2": ["p1"], "d3": ["p1"]}
# the control: about as many KV bytes through this host's network stack, none on a PE's CNIC
OFF_PE_PATTERN = {"d0": ["d1"], "d1": ["d2"], "d2": ["d0"]}
JOB_PASSES = 1000
PIN = False  # set from --pin by the driver


# ----------------------------------------------------------------------------- worker roles
def _send(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _recv() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the driver is gone
    return json.loads(line)


def _pin(args: argparse.Namespace, role: str) -> None:
    """With ``--pin`` on a host of >= 2 CPUs: KV movers on CPU 0, PEs on the others (their
    packets are processed mostly on the sending CPU: the KV stack stands in for a NIC)."""
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        os.sched_setaffinity(0, cpus[:1] if role == "kv" else cpus[1:])


def role_pe(args: argparse.Namespace) -> None:
    """One PE: announce the exchange region, take the peers', run timed passes."""
    import torch

    from dualpath.kv.transport import make_collective_transport
    from dualpath.kv.transport.base import RegionHandle
    from dualpath.runtime.exchange import HiddenExchange, region_bytes
    from dualpath.runtime.messages import ExchangePlan

    torch.set_num_threads(1)
    _pin(args, "pe")
    if args.pe_priority == "fifo":
        # a GPU's collective is not scheduled by a busy host CPU: keep this host's scheduler
        # (eight processes on two cores) out of the latency being measured
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    # named as the cluster's segments, so that `cluster down` removes it after a crash
    shm = SharedMemory(f"dp{args.name}-x{os.getpid()}", create=True, size=region_bytes(2))
    xport = make_collective_transport("tcp")
    assert xport is not None and shm.buf is not None
    handle = xport.register(shm.name, shm.buf)
    ex = HiddenExchange(args.engine, xport, handle, shm.buf, (0, 1), lambda p, n: None, 30.0)
    _send(
        {
            "region": [handle.endpoint, handle.name, handle.address, handle.size_bytes],
            "pid": os.getpid(),
        }
    )
    peers = _recv()
    regions = tuple(RegionHandle(*r) for r in peers["regions"])
    pids = tuple(peers["pids"])
    go = _recv()
    time.sleep(max(0.0, go["start_unix"] - time.time()))
    h = torch.ones(args.tokens, HIDDEN)
    layer_s: list[float] = []
    pass_s: list[float] = []
    end = go["start_unix"] + go["seconds"]
    n, more = 0, True
    while more:
        n += 1
        plan = ExchangePlan(n, (0, 1), regions, pids, (args.tokens, args.tokens))
        step = ex.run_pass(plan, HIDDEN)
        t_pass = time.perf_counter()
        for layer in range(args.layers):
            time.sleep(args.compute_ms / 1e3)  # the layer's emulated GPU time
            last = layer == args.layers - 1
            if last and args.engine == 0:  # PE 0 decides for both whether another pass
                h[0, 0] = 1.0 if time.time() < end else 0.0  # comes: its clock, its states
            t0 = time.perf_counter()
            got = step(layer, h)
            layer_s.append(time.perf_counter() - t0)
            if len(got) != 1:
                raise RuntimeError("the peer PE was lost")
            if last:
                more = bool((h if args.engine == 0 else got[0])[0, 0] == 1.0)
        pass_s.append(time.perf_counter() - t_pass)
    _send({"layer_s": layer_s, "pass_s": pass_s})
    _recv()  # wait for the peer to finish before tearing the region down
    ex.close()
    xport.close()
    shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def role_kv(args: argparse.Namespace) -> None:
    """One node's KV mover: a registered buffer (its HBM or DRAM buffer) that peers write
    into, and writes of 256 KiB blocks to the targets it is given, four in flight."""
    from dualpath.kv.transport import make_transport
    from dualpath.kv.transport.base import RegionHandle

    _pin(args, "kv")
    xport = make_transport("tcp")  # unmarked: KV falls into the default (low) class
    buf = bytearray(KV_WINDOW * BLOCK_BYTES * 4)
    local = xport.register(f"kv-{os.getpid()}", memoryview(buf))
    _send({"region": [local.endpoint, local.name, local.address, local.size_bytes]})
    order = _recv()
    targets = [RegionHandle(*r) for r in order["targets"]]
    time.sleep(max(0.0, order["start_unix"] - time.time()))
    end = order["start_unix"] + order["seconds"]
    moved = 0
    inflight: list[Any] = []
    i = 0
    while time.time() < end:
        if len(inflight) >= KV_WINDOW:
            inflight.pop(0).wait()
            moved += BLOCK_BYTES
        dst = targets[i % len(targets)]
        slot = i % (KV_WINDOW * 4)
        inflight.append(
            xport.write(local, slot * BLOCK_BYTES, dst, slot * BLOCK_BYTES, BLOCK_BYTES)
        )
        i += 1
    for t in inflight:
        t.wait()
        moved += BLOCK_BYTES
    _send({"bytes": moved})
    _recv()
    xport.close()


# ----------------------------------------------------------------------------------- driver
def _start(state: Any, node: str, role: str, *extra: str) -> subprocess.Popen[str]:
    from dualpath.deploy import cluster

    env = {**os.environ, "DUALPATH_KV_HOST": state.address(node, "cnic")}
    env.pop("DUALPATH_KV_DSCP", None)
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", role, *extra]
    argv.append("--pin" if PIN else "--no-pin")
    return cluster.popen(
        state, node, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def _tell(proc: subprocess.Popen[str], obj: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


def _hear(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> dict[str, Any]:
    assert proc.stdout is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not box or not box[0]:
        raise RuntimeError(f"worker {proc.args[-3:]} said nothing (exit {proc.poll()})")
    return json.loads(box[0])


def _pct(values: list[float], q: float) -> float:
    from dualpath.deploy.qosprobe import percentile

    return percentile(values, q)


def run_case(
    state: Any, args: argparse.Namespace, pattern: dict[str, list[str]]
) -> dict[str, float]:
    from dualpath.deploy import cluster

    pes = [
        _start(
            state,
            f"p{e}",
            "pe",
            "--engine",
            str(e),
            "--tokens",
            str(args.tokens),
            "--name",
            args.name,
            "--layers",
            str(args.layers),
            "--compute-ms",
            str(args.compute_ms),
        )
        for e in (0, 1)
    ]
    movers = {n: _start(state, n, "kv") for n in pattern}
    procs = [*pes, *movers.values()]
    try:
        hello = [_hear(p) for p in pes]
        regions = [h["region"] for h in hello]
        for p in pes:
            _tell(p, {"regions": regions, "pids": [h["pid"] for h in hello]})
        kv_regions = {n: _hear(p)["region"] for n, p in movers.items()}
        start = time.time() + 1.0
        for n, p in movers.items():  # KV starts 1 s early: its queues are standing
            _tell(
                p,
                {
                    "targets": [kv_regions[t] for t in pattern[n]],
                    "start_unix": start,
                    "seconds": args.seconds + 1.0,
                },
            )
        before = cluster.status(state.spec.name)
        for p in pes:
            _tell(p, {"start_unix": start + 1.0, "seconds": args.seconds})
        results = [_hear(p, args.seconds + 120) for p in pes]
        after = cluster.status(state.spec.name)
        moved = sum(_hear(p, 60)["bytes"] for p in movers.values())
        for p in procs:
            _tell(p, {})
    finally:
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    cnic = 0
    for b, a in zip(before["nodes"], after["nodes"], strict=True):
        if a["kind"] == "prefill":
            cnic += sum(a["cnic"][k] - b["cnic"][k] for k in ("rx_bytes", "tx_bytes"))
    return {
        "layer_s": [x for r in results for x in r["layer_s"]],
        "pass_s": [x for r in results for x in r["pass_s"]],
        "cnic_bytes": cnic,
        "kv_bytes": moved,
        # the PEs' counters span about their run plus KV's early second
        "seconds": args.seconds + 1.0,
        "pe_seconds": args.seconds,
    }


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, float]:
    """One case's rounds pooled: percentiles over every layer and pass, rates over all time."""
    layer = [x for r in runs for x in r["layer_s"]]
    passes = [x for r in runs for x in r["pass_s"]]
    seconds = sum(r["seconds"] for r in runs)
    pe_seconds = sum(r["pe_seconds"] for r in runs)
    per_pe_pass_bytes = args.layers * args.tokens * HIDDEN * 4
    return {
        "layer_p50_us": _pct(layer, 50) * 1e6,
        "layer_p99_us": _pct(layer, 99) * 1e6,
        "pass_p50_ms": _pct(passes, 50) * 1e3,
        "job_s": statistics.fmean(passes) * JOB_PASSES,
        # what the exchange itself puts on each PE's CNIC, each way
        "exchange_mbit": len(passes) / 2 * per_pe_pass_bytes * 8 / pe_seconds / 1e6,
        "pe_cnic_mbit": sum(r["cnic_bytes"] for r in runs) * 8 / seconds / 2 / 1e6,
        "kv_mbit_app": sum(r["kv_bytes"] for r in runs) * 8 / seconds / 1e6,
    }


def simulate(agents: int) -> list[str]:
    """The simulator on the same preset (paper-scale rates), traffic manager on and off:
    DualPath's JCT and the collectives' slowdown (their time over their time at full CNIC
    rate, ``counters.collective_slowdown``)."""
    import dualpath

    lines = []
    for tm in ("true", "false"):
        cfg = dualpath.Config.from_preset(
            PRESET, [f"workload.num_agents={agents}", f"sim.traffic_manager={tm}"]
        )
        row = dualpath.simulate(cfg, "dualpath").frame().iloc[0]
        lines.append(
            f"  sim.traffic_manager={tm:5}  JCT {row['jct_s']:8.1f} s   collective slowdown "
            f"{row['counters.collective_slowdown']:.3f}x   prefill passes "
            f"{int(row['counters.prefill_passes'])}"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--role", choices=("pe", "kv"), help=argparse.SUPPRESS)
    p.add_argument("--engine", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=10.0, help="each case's PE run (default 10)")
    p.add_argument("--cnic-mbit", type=float, default=128.0, help="every CNIC (default 128)")
    p.add_argument("--layers", type=int, default=4, help="layers per pass (default 4: tiny)")
    p.add_argument("--tokens", type=int, default=4, help="tokens per PE per pass (default 4)")
    p.add_argument("--compute-ms", type=float, default=5.0, help="GPU time per layer (default 5)")
    p.add_argument("--name", default="bq", help="the cluster's name (default bq)")
    p.add_argument(
        "--pe-priority",
        choices=("fifo", "normal"),
        default="fifo",
        help="the PE processes' CPU scheduling (default fifo: real-time, root)",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of the cases (default 2)")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KV movers on CPU 0, PEs on the other CPUs (the KV stack as a NIC)",
    )
    p.add_argument("--no-sim", action="store_true", help="skip the simulator comparison")
    p.add_argument("--sim-agents", type=int, default=128, help="the simulator's agents (128)")
    args = p.parse_args()
    global PIN
    PIN = args.pin
    if args.role == "pe":
        role_pe(args)
        return 0
    if args.role == "kv":
        role_kv(args)
        return 0

    from dualpath.deploy import cluster

    reason = cluster.can_make_namespaces()
    if reason:
        print(f"bench_qos: {reason}", file=sys.stderr)
        return 2
    spec = cluster.ClusterSpec.from_preset(PRESET, name=args.name, cnic_cap_mbit=args.cnic_mbit)
    state = cluster.up(spec, replace=True)
    rows: dict[str, dict[str, float]] = {}
    try:
        msg = (
            f"# bench_qos: preset {PRESET} on one host, CNIC {args.cnic_mbit:g} Mbit/s, "
            f"{args.layers} layers x {args.compute_ms:g} ms, {args.tokens} tokens "
            f"({args.tokens * HIDDEN * 4} B per peer per layer), {args.seconds:g} s per case"
        )
        print(msg, flush=True)
        cases = (
            ("idle", {}, False),
            ("busy host", OFF_PE_PATTERN, False),
            ("one queue", KV_PATTERN, False),
            ("classes", KV_PATTERN, True),
        )
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in cases}
        for k in range(args.rounds):  # rounds interleave: drift on the host hits every case
            for label, pattern, tm in cases:
                cluster.set_traffic_manager(args.name, tm)
                print(f"  round {k + 1}/{args.rounds}: {label} ...", file=sys.stderr, flush=True)
                runs[label].append(run_case(state, args, pattern))
        rows = {label: summarise(r, args) for label, r in runs.items()}
    finally:
        cluster.down(args.name)
    head = (
        f"{'case':10} {'layer p50 µs':>13} {'layer p99 µs':>13} {'pass p50 ms':>12} "
        f"{'job s':>7} {'exchange Mbit/s':>16} {'PE CNIC Mbit/s':>15} {'KV Mbit/s':>10}"
    )
    print(head)
    for label, r in rows.items():
        print(
            f"{label:10} {r['layer_p50_us']:13.0f} {r['layer_p99_us']:13.0f} "
            f"{r['pass_p50_ms']:12.2f} {r['job_s']:7.2f} {r['exchange_mbit']:16.1f} "
            f"{r['pe_cnic_mbit']:15.1f} "
            f"{r['kv_mbit_app']:10.1f}"
        )
    idle, busy, one, cls = (rows[k] for k in ("idle", "busy host", "one queue", "classes"))
    ratios = (
        cls["layer_p99_us"] / idle["layer_p99_us"],
        one["layer_p99_us"] / idle["layer_p99_us"],
        cls["kv_mbit_app"] / one["kv_mbit_app"],
    )
    goals = (ratios[0] <= 1.5, ratios[1] >= 5.0, ratios[2] >= 0.9)
    print(
        f"exchange p99 / idle: classes {ratios[0]:.2f}x (goal <= 1.5: "
        f"{'met' if goals[0] else 'MISSED'}), one queue {ratios[1]:.1f}x (goal >= 5: "
        f"{'met' if goals[1] else 'MISSED'}); KV throughput classes / one queue "
        f"{ratios[2]:.3f} (goal >= 0.9: {'met' if goals[2] else 'MISSED'})"
    )
    print(
        f"against the busy-host control (the same KV bytes through this host's stack, none on "
        f"a PE's CNIC): classes p99 {cls['layer_p99_us'] / busy['layer_p99_us']:.2f}x, "
        f"one queue {one['layer_p99_us'] / busy['layer_p99_us']:.1f}x"
    )
    if not args.no_sim:
        print(f"simulator, same preset at paper-scale rates ({args.sim_agents} agents):")
        for line in simulate(args.sim_agents):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
