"""`dualpath bench`: replay a small agentic workload through the real runtime, as processes on
this host (``--runtime local``) or as Ray actors over a Ray cluster's nodes (``--runtime ray``).

Each system runs on its own empty KV store (so no system inherits another's hits), with the
emulated SNICs slow enough that loading dominates; reports JCT, TTFT/TTST/TPOT, bytes per
path and achieved SNIC utilisation through ``dualpath.metrics`` (the simulator's metric code).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dualpath.cli.common import add_config_args, build_config
from dualpath.config import Config, config_for
from dualpath.metrics import RunSummary, format_summary, summarize

# the runtime as a testbed: the tiny model on an emulated GPU slower than a small host, its
# SNICs slow enough that loading binds (docs/runtime.md "Emulated GPU time")
DEFAULT_PRESET = "tiny-testbed"


@dataclass(frozen=True, slots=True)
class BenchRun:
    system: str
    summary: RunSummary
    result: Any  # dualpath.runtime.result.RunResult (runtime imports stay lazy)


def run_runtime_systems(
    config: Config,
    systems: list[str],
    num_turns: int,
    token_scale: float = 0.25,
    max_gen_tokens: int = 4,
    kv_root: str = "./.dualpath/kv",
    *,
    progress: bool = True,
    transport: str = "shm",
    runtime: str = "local",
    ray_address: str = "",
    transfer_window: int = 16,
    gpu_time: str = "emulated",
) -> list[BenchRun]:
    """Run every system on the same agents; each on a fresh store under ``kv_root``. With
    ``runtime="ray"`` one Ray session (``ray_address``, or a local instance) serves them all
    (``transfer_window``, ``gpu_time``: see ``RuntimeOptions``)."""
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.workload.scripts import small_trajectories

    def options(system: str, root: str) -> RuntimeOptions:
        return RuntimeOptions(
            system=system,
            kv_root=root,
            transport=transport,
            runtime=runtime,
            ray_address=ray_address,
            transfer_window=transfer_window,
            gpu_time=gpu_time,
        )

    for s in systems:
        config_for(config, options(s, kv_root).spec)  # ValueErrors before anything starts
    block = config.scheduler.block_tokens
    trajs = small_trajectories(config.workload, block, num_turns, token_scale, max_gen_tokens)
    num_turns_total = sum(len(t.turns) for t in trajs)
    runs = []
    Path(kv_root).mkdir(parents=True, exist_ok=True)
    session = contextlib.ExitStack()
    if runtime == "ray":
        from dualpath.runtime.ray_launcher import ray_session

        num_nodes = config.cluster.num_prefill_nodes + config.cluster.num_decode_nodes
        session.enter_context(ray_session(ray_address, num_nodes))
    with session:
        for system in systems:
            root = tempfile.mkdtemp(prefix=f"bench-{system}-", dir=kv_root)
            try:
                result = _run_system(
                    config, trajs, num_turns_total, progress, options(system, root)
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs.append(BenchRun(system, summarize(result.records, "offline"), result))
    return runs


def _run_system(
    config: Config, trajs: Any, num_turns_total: int, progress: bool, options: Any
) -> Any:
    """One system's run (its own KV root in ``options``): the ``RunResult``."""
    from dualpath.progress import bar as progress_bar
    from dualpath.runtime.session import Runtime
    from dualpath.workload.scripts import agent_scripts

    agents = agent_scripts(trajs, config.model.vocab_size, config.workload.seed)
    with (
        progress_bar(num_turns_total, options.system, "turn", disable=not progress) as bar,
        Runtime(config, options) as rt,
    ):
        return rt.run(agents, on_turn=lambda _: bar.update(1))


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def format_runs(runs: list[BenchRun]) -> str:
    lines = [format_summary({r.system: r.summary for r in runs}), ""]
    for r in runs:
        mb = {k: round(v / 1e6, 1) for k, v in r.result.bytes_by_path.items()}
        agg, busy = r.result.snic_aggregate_utilisation, r.result.snic_busy_utilisation
        lines.append(
            f"{r.system:<9} MB per path {mb}  SNIC utilisation: aggregate {_pct(agg)}, "
            f"per busy SNIC {_pct(busy)}  requeued {r.result.requeued}"
        )
    for r in runs:
        if r.result.gpu_use:
            lines.append(f"{r.system:<9} {format_gpu_use(r.result.gpu_use)}")
    base = next((r for r in runs if r.system == "basic"), None)
    for r in runs:
        if base is not None and r is not base:
            lines.append(f"JCT basic / {r.system} = {base.summary.jct_s / r.summary.jct_s:.2f}x")
    return "\n".join(lines)


def format_gpu_use(gpu_use: dict[str, Any]) -> str:
    """Per engine, the share of its passes (PE) or decode steps (DE) whose host compute took
    longer than their emulated GPU time (then the host, not the emulated GPU, bound them)."""
    cells = [f"{name} {u.overrun_share:.0%} of {u.passes}" for name, u in gpu_use.items()]
    return "emulated GPU time, passes overrun: " + ", ".join(cells)


def add_gpu_time_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--gpu-time",
        default=default,
        choices=("emulated", "host"),
        help=f"emulated: every pass, computed for real, ends no earlier than the cost model's "
        f"time on the preset's hardware (docs/runtime.md); host: the host's compute time "
        f"(default {default})",
    )


def finite_float(text: str) -> float:
    """argparse type: a finite float (inf and nan are user mistakes, never a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a finite number")
    return value


# each emulated GPU's HBM is an mmap'd pool in host memory: cap it so a typo cannot swap the host
MAX_RUNTIME_KV_BYTES = 1 << 30
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def check_runnable(config: Config, hbm_tokens: int = 65536, dtype: str = "float32") -> None:
    """ValueError (one line) when the runtime cannot run ``config``'s model (design §13): a
    dense GQA model whose KV dtype is the engines' ``dtype``, and an HBM pool of
    ``hbm_tokens`` within the host-memory cap."""
    m = config.model
    why = []
    if m.attention != "gqa":
        why.append(f"attention={m.attention!r} (needs 'gqa')")
    need = KV_DTYPE_BYTES.get(dtype, 4)
    if m.kv_dtype_bytes != need:
        why.append(f"kv_dtype_bytes={m.kv_dtype_bytes} (needs {need}, {dtype})")
    if why:
        raise ValueError(
            f"preset/model {m.name!r} cannot run on the local runtime: {'; '.join(why)} "
            "(use a tiny-* preset, e.g. --preset tiny-1p1d, or --model-dir CHECKPOINT)"
        )
    pool = hbm_tokens * m.num_layers * m.kv_bytes_per_token_per_layer
    if pool > MAX_RUNTIME_KV_BYTES:
        raise ValueError(
            f"--hbm-tokens {hbm_tokens} is invalid for {m.name!r}: each engine's KV pool would "
            f"take {pool / 2**30:.1f} GiB of host memory (at most {MAX_RUNTIME_KV_BYTES / 2**30:g} "
            "GiB; lower --hbm-tokens)"
        )


def check_kv_root(kv_root: str) -> None:
    """ValueError (one line) unless ``kv_root`` can be created and written."""
    path = Path(kv_root)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ValueError(f"--kv-root {kv_root!r} is invalid: not writable ({reason})") from None


def check_transport_library(transport: str) -> None:
    """ValueError (one line) when ``transport`` needs a library that cannot be imported, before
    any process starts (in an engine it would be a traceback per process)."""
    if transport != "mooncake":
        return
    from dualpath.kv.transport.mooncake import load_engine_class

    try:
        load_engine_class()
    except ImportError as err:
        cause = " ".join(str(err.__cause__ or err).split())
        raise ValueError(
            f"--transport mooncake needs the Mooncake Transfer Engine, which cannot be imported "
            f"({cause}): pip install mooncake-transfer-engine-non-cuda (the 'mooncake' extra: "
            "pip install -e '.[mooncake]') and apt-get install libibverbs1"
        ) from None


def resolve_runtime(args: argparse.Namespace) -> str:
    """The KV transport for ``--runtime`` / ``--transport`` / ``--ray-address``; ValueError
    (one line) on a bad combination, a missing Ray or transport library, or an unreachable
    ``--ray-address``."""
    if args.runtime not in ("local", "ray"):
        raise ValueError(f"--runtime {args.runtime!r} is invalid: must be 'local' or 'ray'")
    check_transport_library(str(args.transport or ""))
    if args.runtime == "local":
        if args.ray_address:
            raise ValueError("--ray-address is only valid with --runtime ray")
        return str(args.transport or "shm")
    from dualpath.runtime.ray_launcher import check_address, require_ray

    require_ray()
    if args.transport == "shm":
        raise ValueError(
            "--transport shm is invalid with --runtime ray: shared memory cannot cross nodes "
            "(use tcp or mooncake)"
        )
    if args.ray_address:
        check_address(args.ray_address)
    return str(args.transport or "tcp")


def run_bench(args: argparse.Namespace) -> int:
    transport = resolve_runtime(args)
    config = build_config(args)
    check_runnable(config)
    for name in ("token_scale", "snic_mb_per_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {value} is invalid: must be > 0")
    for name in ("agents", "max_gen"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} is invalid: must be >= 1")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ValueError(
            "`dualpath bench` needs the runtime extra (torch): run `make run`, or "
            "pip install torch==2.13.0 -e '.[runtime]'"
        ) from None
    check_kv_root(args.kv_root)
    if args.snic_mb_per_s is not None:
        hw = replace(config.hardware, snic_bytes_per_s=args.snic_mb_per_s * 1e6)
        config = replace(config, hardware=hw)
    if args.agents is not None:
        config = replace(config, workload=replace(config.workload, num_agents=args.agents))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise ValueError("--systems is empty: give e.g. basic,dualpath")
    if args.turns < 1:
        raise ValueError(f"--turns {args.turns} is invalid: must be >= 1")
    runs = run_runtime_systems(
        config,
        systems,
        args.turns,
        args.token_scale,
        args.max_gen,
        args.kv_root,
        progress=not args.no_progress,
        transport=transport,
        runtime=args.runtime,
        ray_address=args.ray_address or "",
        gpu_time=args.gpu_time,
    )
    print(format_runs(runs))
    if args.json:
        out = {
            r.system: {
                **r.summary.to_dict(),
                "bytes_by_path": r.result.bytes_by_path,
                "snic_aggregate_utilisation": _num(r.result.snic_aggregate_utilisation),
                "snic_busy_utilisation": _num(r.result.snic_busy_utilisation),
                "gpu_overrun_share": {
                    k: _num(u.overrun_share) for k, u in r.result.gpu_use.items()
                },
            }
            for r in runs
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("bench", help="run the real multi-process runtime (tiny model, CPU)")
    add_config_args(p, default_preset=DEFAULT_PRESET)
    p.add_argument(
        "--runtime",
        default="local",
        help="local (processes on this host) or ray (actors per node; see docs/deploy.md)",
    )
    p.add_argument(
        "--ray-address",
        help="Ray cluster to join (HOST:PORT of its head); default: start a local Ray instance",
    )
    p.add_argument("--agents", type=int, help="number of agents (workload.num_agents)")
    p.add_argument("--turns", type=int, default=12, help="turns per agent (default 12)")
    p.add_argument(
        "--systems",
        default="basic,dualpath",
        help="basic, layer, dpl, dualpath, oracle; d2p, dram-tier (docs/peers.md)",
    )
    p.add_argument(
        "--token-scale",
        type=finite_float,
        default=0.25,
        help="scale of the appends of docs/design.md §9",
    )
    p.add_argument("--max-gen", type=int, default=4, help="cap on generated tokens per turn")
    p.add_argument(
        "--snic-mb-per-s",
        type=finite_float,
        help="emulated SNIC bandwidth, MB/s (default: the preset's; tiny-testbed's 10 MB/s "
        "makes loading dominate)",
    )
    p.add_argument(
        "--kv-root", default="./.dualpath/kv", help="KV store root (default ./.dualpath/kv)"
    )
    p.add_argument(
        "--transport",
        help="KV transport: shm, tcp or mooncake (default: shm locally, tcp with Ray)",
    )
    add_gpu_time_arg(p, "emulated")
    p.add_argument("--json", help="also write the summaries to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench)
