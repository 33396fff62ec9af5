"""DualPath inside vLLM: DualPath vs Basic through `dualpath serve --engine vllm`, storage-bound,
and the router's cost against talking to one vLLM instance directly.

Run: .venv/bin/python benchmarks/bench_vllm.py [--agents 16 --turns 6 --snic-mb-per-s 2 ...]
     .venv/bin/python benchmarks/bench_vllm.py --model deepseek-v3 --tp 2 --variants basic,dualpath

Writes a tiny random checkpoint to a temporary folder (``--model``: llama, 4 layers, hidden
256, head_dim 64; deepseek-v3, MLA + MoE, 3 layers, the 576-wide latent; gemma3, sliding-window
and full layers), each instance with vLLM's flags for ``--tp`` / ``--pp`` /
``--prefill-tp`` / ``--decode-tp`` / ``--kv-cache-dtype``, then starts, one after the other, on
127.0.0.1:

  basic      serve --engine vllm --system basic: 1 prefill + 1 decode vLLM instance, every hit
             read through the prefill node's emulated SNIC
  dualpath   serve --engine vllm --system dualpath: the policy reads each request's hits
             through the prefill or the decode node's SNIC (the second path)
  vllm       one plain vLLM instance (its own prefix cache, no connector): the peer
  router     serve --engine vllm --system dualpath with the SNICs unpaced: against `vllm` at
             concurrency 1, what the P/D split and the router add per request

A variant with the suffix ``-after`` (dualpath-after, router-after) runs the router with
``DUALPATH_HANDOVER=after``: across nodes, the prefill's KV goes to the decode node after the
prefill answered instead of layer by layer while it runs (the before/after of one run).

With --cluster, every deployment runs on the nodes of a cluster this script makes (`dualpath
cluster up`: one network namespace per node, SNICs shaped by the kernel to --snic-mb-per-s, not
by our pacer), its KV in Mooncake Store on the cluster's storage host, KV between nodes by
Mooncake TE; the plain vLLM instance runs on the prefill node, and `stockpd` is vLLM's own
disaggregated serving (NixlConnector, benchmarks/stock_pd.py) on the same two nodes. The
concurrency-1 runs (vllm, router, stockpd) get the cluster again with SNICs of 2 Gbit/s: they
measure latency, not storage. Each storage-bound run prints its kernel-counted SNIC bytes per
node and its storage bound (the hit bytes ÷ the SNIC bandwidth its system can use: one SNIC
for Basic, both for DualPath).

Each of basic / dualpath gets a fresh KV store and replays the same design §9 agents (scaled)
through `dualpath loadgen` at --agents concurrent sessions (every turn of every agent: the
job JCT compares them); vllm / router replay --overhead-agents agents at concurrency 1. Prints
job JCT, TTFT / TPOT p50 and p99, errors, the store's hit ratio, KV MB per load path and the router's
seconds per request by stage (from /metrics), the host's load before each run, and the
DualPath/Basic JCT ratio. The figures mean something only on a quiet host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from dualpath.frontend.checkpoint import write_tiny_checkpoint
from dualpath.frontend.loadgen import LoadGenerator, LoadgenOptions
from dualpath.integrations.vllm.flow import HANDOVER_ENV
from dualpath.integrations.vllm.launch import find_vllm_python
from dualpath.net import free_port
from dualpath.workload.scripts import chat_scripts

MODELS = ("llama", "deepseek-v3", "gemma3")


def _checkpoint(root: Path, model: str) -> Path:
    """The tiny random checkpoint of ``model`` (``MODELS``)."""
    arch = {"llama": "llama", "deepseek-v3": "deepseek_v3", "gemma3": "gemma3"}[model]
    return write_tiny_checkpoint(
        root / f"{model}-tiny",
        arch=arch,
        num_layers=3 if arch == "deepseek_v3" else 4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=688,
    )


def _vllm_args(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """vLLM's flags for every instance, the prefill and the decode instances."""
    every = [f"--kv-cache-dtype={args.kv_cache_dtype}"] if args.kv_cache_dtype else []
    if args.pp > 1:
        every.append(f"--pipeline-parallel-size={args.pp}")
    prefill = [f"--tensor-parallel-size={args.prefill_tp or args.tp}"]
    decode = [f"--tensor-parallel-size={args.decode_tp or args.tp}"]
    return every, prefill, decode


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``url/health`` answers 200 (400 s at most; the log's tail if the process exits)."""
    from stock_pd import wait_healthy  # type: ignore[import-not-found]

    wait_healthy(url, proc, log, 400.0)


CLUSTER = "bench"  # the cluster --cluster makes (and removes)


def _serve(
    ckpt: Path,
    kv_root: Path,
    system: str,
    snic: float,
    log: Path,
    cluster: bool = False,
    vllm: tuple[list[str], list[str], list[str]] = ([], [], []),
    handover: str = "",
) -> tuple[Any, str]:
    """``handover``: the router's ``DUALPATH_HANDOVER`` ("": its default, layerwise)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "dualpath.cli.main",
        "serve",
        "--engine",
        "vllm",
        "--model-dir",
        str(ckpt),
        "--port",
        str(port),
        "--kv-root",
        str(kv_root),
        "--system",
        system,
        "--dtype",
        "bfloat16",
        "--vllm-max-model-len",
        "4096",
        *[f"--vllm-arg={a}" for a in vllm[0]],
        *[f"--vllm-prefill-arg={a}" for a in vllm[1]],
        *[f"--vllm-decode-arg={a}" for a in vllm[2]],
    ]
    if cluster:
        cmd += ["--cluster", CLUSTER, "--store", "mooncake"]
    elif snic:
        cmd += ["--snic-mb-per-s", str(snic)]
    env = {**os.environ, HANDOVER_ENV: handover} if handover else None
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, log)
    return proc, url


def _plain(
    ckpt: Path, log: Path, cluster: bool = False, vllm: list[str] | None = None
) -> tuple[Any, str]:
    """One plain vLLM instance (vLLM's own block size and prefix cache, the prefill
    instances' parallelism): on 127.0.0.1, or on the cluster's prefill node."""
    ns, host, port = "", "127.0.0.1", free_port()
    if cluster:
        node = _cluster_node("p0")
        ns, host, port = node.namespace, node.cnic_addr, 8100
    cmd = [
        find_vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ckpt),
        "--served-model-name",
        ckpt.name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
        *(vllm or []),
    ]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    from dualpath.integrations.vllm.setup import Parallelism, core_masks

    ranks = Parallelism.from_args(vllm or []).world
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": core_masks([ranks], os.cpu_count() or 1)[0],
    }
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://{host}:{port}"
    _wait(url, proc, log)
    return proc, url


def _cluster_node(name: str) -> Any:
    from dualpath.deploy.cluster import ClusterState

    return ClusterState.load(CLUSTER).spec.node(name)


def _cluster(snic_mbit: float) -> None:
    """Cluster ``CLUSTER`` (tiny-1p1d's 1P1D and storage host) with SNICs of ``snic_mbit``."""
    from dualpath.deploy import cluster

    cluster.down(CLUSTER)
    cluster.up(cluster.ClusterSpec.from_preset("tiny-1p1d", name=CLUSTER, snic_mbit=snic_mbit))


def _snic_bytes() -> dict[str, tuple[int, int]]:
    """The kernel's count of bytes each node received (its storage reads) and sent (its
    writes) on its SNIC."""
    from dualpath.deploy import cluster

    return {
        n["node"]: (int(n["snic"]["rx_bytes"]), int(n["snic"]["tx_bytes"]))
        for n in cluster.status(CLUSTER)["nodes"]
        if n["kind"] != "store"
    }


def _stockpd(ckpt: Path, log_dir: Path) -> tuple[Any, str]:
    """vLLM's own disaggregated serving on the cluster's two nodes (benchmarks/stock_pd.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stock_pd import StockPD, ensure_overlay  # type: ignore[import-not-found]

    p0, d0 = _cluster_node("p0"), _cluster_node("d0")
    overlay = ensure_overlay()  # NIXL for vLLM's instances only (runs/nixl-overlay)
    pd = StockPD(
        ckpt,
        prefill=(p0.namespace, p0.cnic_addr),
        decode=(d0.namespace, d0.cnic_addr),
        log_dir=log_dir,
        overlay=overlay,
    ).start()
    return pd, pd.url


def _stop(proc: Any) -> None:
    if not isinstance(proc, subprocess.Popen):  # StockPD
        proc.stop()
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _metrics(url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"kv_mb": {}, "stage_s": {}, "store": {}, "sidecar_s": {}}
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('dualpath:kv_bytes_total{path="'):
            out["kv_mb"][line.split('"')[1]] = float(line.rsplit(" ", 1)[1]) / 1e6
        elif line.startswith('dualpath:router_stage_seconds_total{stage="'):
            out["stage_s"][line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("dualpath:snic_read_seconds_total{"):  # summed over the nodes
            stage = line.split('stage="')[1].split('"')[0]
            out["sidecar_s"][stage] = out["sidecar_s"].get(stage, 0.0) + float(line.split()[-1])
        elif line.startswith(
            ("dualpath:prefix_cache_hits_total ", "dualpath:prefix_cache_queries_total ")
        ):
            name, value = line.split()
            out["store"][name.split(":")[1].removesuffix("_total")] = float(value)
    return out


ROUTER_STAGES = ("tokenize", "place_and_read", "cnic_kv")  # every wait of the router's own


def _router_own_s(
    m: dict[str, dict[str, float]], n: int, cluster: bool, layerwise: bool = True
) -> tuple[float, float]:
    """Per request: the seconds the router's own stages took (``ROUTER_STAGES``: everything
    between the client's request and the decode's, but the prefill instance's answer), less
    the time the bytes they moved take at line rate (storage reads on the SNIC, KV between
    nodes on the CNIC; on one host the links are unpaced: none); and that link time. With
    the layerwise hand-over the KV toward the decode node moves while the prefill runs: none
    of its link time is taken off (what the router still waits for counts as its own)."""
    waited = sum(m["stage_s"].get(k, 0.0) for k in ROUTER_STAGES) / n
    if not cluster:
        return waited, 0.0
    p0 = _cluster_node("p0")
    from dualpath.deploy.cluster import ClusterState

    spec = ClusterState.load(CLUSTER).spec
    kv = m["kv_mb"]
    snic_mb = kv.get("storage_to_pe_buffer", 0.0) + kv.get("storage_to_de_buffer", 0.0)
    cnic_mb = kv.get("de_buffer_to_pe_hbm", 0.0)
    if not layerwise:
        cnic_mb += kv.get("pe_hbm_to_de_buffer", 0.0)
    link = (
        snic_mb * 1e6 / spec.rate_bytes_per_s(p0.name, "snic")
        + cnic_mb * 1e6 / spec.rate_bytes_per_s(p0.name, "cnic")
    ) / n
    return waited - link, link


def _run(url: str, scripts: Any, concurrency: int, model: str) -> dict[str, Any]:
    warm = chat_scripts(2, 2, 0.05, 8, seed=99)
    asyncio.run(LoadGenerator(LoadgenOptions(url, model=model, concurrency=2)).run(warm))
    load = os.getloadavg()[0]
    res = asyncio.run(
        LoadGenerator(LoadgenOptions(url, model=model, concurrency=concurrency)).run(scripts)
    )
    return {**res.summary(), "host_load": load}


def _line(name: str, s: dict[str, Any]) -> str:
    ms = 1e3
    return (
        f"{name:<9} job JCT {s['job_jct_s']:6.1f} s  TTFT p50/p99 "
        f"{s['ttft_s']['p50'] * ms:7.1f}/{s['ttft_s']['p99'] * ms:7.1f} ms  TPOT p50/p99 "
        f"{s['tpot_s']['p50'] * ms:5.1f}/{s['tpot_s']['p99'] * ms:5.1f} ms  req/s "
        f"{s['requests_per_s']:5.2f}  requests {s['requests']}  errors {s['errors']}  hit "
        f"{s['hit_ratio']:.3f}  host load {s['host_load']:.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=16, help="concurrent agent sessions")
    ap.add_argument("--turns", type=int, default=10)
    # the longest agent stays below the tiny checkpoint's 4,096 positions (its BPE makes ≈ 2.6
    # tokens of a word: at 0.08 one agent of 16 passes them, and vLLM answers it with a 400)
    ap.add_argument("--token-scale", type=float, default=0.05)
    ap.add_argument("--max-gen", type=int, default=16)
    ap.add_argument("--snic-mb-per-s", type=float, default=2.0, help="emulated SNIC per node")
    ap.add_argument("--overhead-agents", type=int, default=4)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--json", help="write every summary here")
    ap.add_argument("--model", default="llama", choices=MODELS, help="the tiny checkpoint's family")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism of every instance")
    ap.add_argument("--prefill-tp", type=int, default=0, help="the prefill instances' (--tp)")
    ap.add_argument("--decode-tp", type=int, default=0, help="the decode instances' (--tp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallelism of every instance")
    ap.add_argument("--kv-cache-dtype", default="", help="vLLM's --kv-cache-dtype (e.g. fp8)")
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="each deployment on the nodes of a cluster of network namespaces, SNICs "
        "shaped by the kernel, the store in Mooncake Store (needs root)",
    )
    args = ap.parse_args()
    if args.cluster:
        from dualpath.deploy.cluster import can_make_namespaces

        if (reason := can_make_namespaces()) is not None:
            raise SystemExit(f"--cluster: {reason}")
        args.variants = args.variants if args.variants != DEFAULT_VARIANTS else CLUSTER_VARIANTS
    try:
        _main(args)
    finally:
        if args.cluster:
            from dualpath.deploy import cluster

            cluster.down(CLUSTER)


DEFAULT_VARIANTS = "basic,dualpath,vllm,router"
CLUSTER_VARIANTS = "basic,dualpath,vllm,router,stockpd"
FAST_SNIC_MBIT = 2000.0  # the concurrency-1 runs of --cluster: latency, not storage


def _main(args: argparse.Namespace) -> None:
    scripts = chat_scripts(args.agents, args.turns, args.token_scale, args.max_gen, 32, seed=0)
    solo = chat_scripts(args.overhead_agents, 3, args.token_scale, args.max_gen, 32, seed=1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _checkpoint(Path(tmp), args.model)
        vllm = _vllm_args(args)
        print(
            f"model {args.model} (tiny), vLLM flags: every {vllm[0]}, prefill {vllm[1]}, "
            f"decode {vllm[2]}",
            flush=True,
        )
        for name in [v for v in args.variants.split(",") if v]:
            log = Path(tmp) / f"{name}.log"
            # "-after": the router's earlier hand-over across nodes (every block after the
            # prefill, not layer by layer), for a before/after in one run
            base, _, handover = name.partition("-")
            if handover not in ("", "after"):
                raise SystemExit(f"--variants: {name!r}: the only suffix is -after")
            storage_bound = base in ("basic", "dualpath")
            if args.cluster:  # a fresh cluster per deployment: measured, a concurrency-1
                # router's storage reads took 83 ms instead of 16 on the namespaces a plain
                # vLLM instance had just left
                _cluster(args.snic_mb_per_s * 8 if storage_bound else FAST_SNIC_MBIT)
            before = _snic_bytes() if args.cluster else {}
            if storage_bound:
                proc, url = _serve(
                    ckpt,
                    Path(tmp) / f"kv-{name}",
                    base,
                    args.snic_mb_per_s,
                    log,
                    args.cluster,
                    vllm,
                    handover,
                )
                work, conc = scripts, args.agents
            elif base == "router":
                proc, url = _serve(
                    ckpt,
                    Path(tmp) / f"kv-{name}",
                    "dualpath",
                    0.0,
                    log,
                    args.cluster,
                    vllm,
                    handover,
                )
                work, conc = solo, 1
            elif name == "vllm":
                proc, url = _plain(ckpt, log, args.cluster, [*vllm[0], *vllm[1]])
                work, conc = solo, 1
            elif name == "stockpd" and args.cluster:
                proc, url = _stockpd(ckpt, Path(tmp) / "stockpd")
                work, conc = solo, 1
            else:
                raise SystemExit(
                    f"--variants: {name!r} is not basic, dualpath, vllm, router "
                    "or (with --cluster) stockpd"
                )
            try:
                s = _run(url, work, conc, ckpt.name)
                if name not in ("vllm", "stockpd"):
                    s["metrics"] = _metrics(url)
            finally:
                _stop(proc)
            results[name] = s
            print(_line(name, s), flush=True)
            if args.cluster and storage_bound:
                after = _snic_bytes()
                s["snic_rx_mb"] = {n: (after[n][0] - before[n][0]) / 1e6 for n in sorted(after)}
                s["snic_tx_mb"] = {n: (after[n][1] - before[n][1]) / 1e6 for n in sorted(after)}
                # the busiest SNIC direction at full rate: no schedule finishes sooner
                busiest = max([*s["snic_rx_mb"].values(), *s["snic_tx_mb"].values()])
                s["nic_bound_s"] = busiest / args.snic_mb_per_s
                kv = s["metrics"]["kv_mb"]
                hit_mb = kv.get("storage_to_pe_buffer", 0.0) + kv.get("storage_to_de_buffer", 0.0)
                snics = 1 if base == "basic" else len(after)  # DualPath reads through every node's
                s["storage_bound_s"] = hit_mb / (snics * args.snic_mb_per_s)
                print(
                    " " * 10
                    + "kernel: SNIC MB received per node: "
                    + "  ".join(f"{n} {mb:.1f}" for n, mb in s["snic_rx_mb"].items())
                    + ", sent: "
                    + "  ".join(f"{n} {mb:.1f}" for n, mb in s["snic_tx_mb"].items())
                    + f";  storage bound {s['storage_bound_s']:.1f} s ({hit_mb:.1f} MB of hits "
                    f"÷ {snics} × {args.snic_mb_per_s:g} MB/s), JCT ÷ bound "
                    f"{s['job_jct_s'] / max(1e-9, s['storage_bound_s']):.2f};  busiest SNIC "
                    f"direction {s['nic_bound_s']:.1f} s",
                    flush=True,
                )
            if "metrics" in s:
                m = s["metrics"]
                hits = m["store"].get("prefix_cache_hits", 0.0)
                asked = max(1.0, m["store"].get("prefix_cache_queries", 0.0))
                print(" " * 10 + f"store hit ratio (router): {hits / asked:.3f}")
                print(
                    " " * 10
                    + "KV MB by path: "
                    + "  ".join(f"{k} {v:.1f}" for k, v in sorted(m["kv_mb"].items())),
                    flush=True,
                )
                n = max(1, s["requests"] + 2 * 2)  # + the warm-up's requests
                print(
                    " " * 10
                    + "router s/request by stage: "
                    + "  ".join(
                        f"{k} {v / n * 1e3:.1f} ms" for k, v in sorted(m["stage_s"].items())
                    )
                )
                if base != "router":  # storage-bound: its reads wait for the SNIC's queue
                    continue
                own, link = _router_own_s(m, n, args.cluster, handover != "after")
                s["router_own_ms"], s["link_ms"] = own * 1e3, link * 1e3
                print(
                    " "
                    * 10
                    + f"router's own: {own * 1e3:.1f} ms/request (tokenize, place and read, "
                    f"KV hand-over: {(own + link) * 1e3:.1f} ms, less the bytes' time at line "
                    f"rate {link * 1e3:.1f} ms); a storage read in its side-car: queued "
                    f"{m['sidecar_s'].get('queued', 0.0) / n * 1e3:.1f} ms, in the store "
                    f"{m['sidecar_s'].get('store', 0.0) / n * 1e3:.1f} ms",
                    flush=True,
                )
    for dualpath in ("dualpath", "dualpath-after"):
        if "basic" in results and dualpath in results:
            ratio = results["basic"]["job_jct_s"] / results[dualpath]["job_jct_s"]
            print(
                f"{'DualPath' if dualpath == 'dualpath' else 'DualPath (hand-over after)'} / "
                f"Basic job JCT speed-up: {ratio:.2f}x (SNIC {args.snic_mb_per_s} MB/s per "
                f"node, {args.agents} agents × {args.turns} turns)"
            )
    if "vllm" in results and "router" in results:
        v, r = results["vllm"], results["router"]
        print(
            f"concurrency 1: TTFT p50 {r['ttft_s']['p50'] * 1e3:.1f} ms through DualPath "
            f"(router, prefill, KV hand-off, decode) vs {v['ttft_s']['p50'] * 1e3:.1f} ms "
            f"vLLM direct; TPOT p50 {r['tpot_s']['p50'] * 1e3:.1f} vs "
            f"{v['tpot_s']['p50'] * 1e3:.1f} ms"
        )
    if "stockpd" in results:
        p = results["stockpd"]
        print(
            f"concurrency 1: vLLM's stock PD (NixlConnector) TTFT p50 "
            f"{p['ttft_s']['p50'] * 1e3:.1f} ms, TPOT p50 {p['tpot_s']['p50'] * 1e3:.1f} ms"
        )
        for router in ("router", "router-after"):
            if router in results:
                r = results[router]
                print(
                    f"concurrency 1: TTFT p50 through the {router} ÷ stock PD's: "
                    f"{r['ttft_s']['p50'] / p['ttft_s']['p50']:.2f}; the router's own "
                    f"{r['router_own_ms']:.1f} ms/request"
                )
    print(f"host: {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
