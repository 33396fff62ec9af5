"""`dualpath serve` (OpenAI-compatible HTTP server) and `dualpath loadgen` (its load generator)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.cli.common import add_config_args, build_config

if TYPE_CHECKING:
    from dualpath.frontend.guard import ConnectionLimits


def _api_keys(values: list[str], files: list[str] | None = None) -> dict[str, str]:
    """``KEY`` or ``TENANT=KEY``; a key without a tenant is its own tenant. ``files``: more of
    them, one per line (``--api-key-file``: a mounted secret; blank and ``#`` lines skipped;
    an error names the file and line, never the key)."""
    keys: dict[str, str] = {}

    def add(entry: str, where: str) -> None:
        tenant, _, key = entry.rpartition("=")
        if not key:
            raise ValueError(f"{where} is invalid: expected KEY or TENANT=KEY")
        keys[key] = tenant or f"key{len(keys)}"

    for v in values:
        add(v, f"--api-key {v!r}")
    for path in files or []:
        try:
            lines = [line.strip() for line in Path(path).read_text().splitlines()]
        except OSError as err:
            raise ValueError(f"--api-key-file {path}: cannot read it ({err.strerror})") from None
        entries = [(no, ln) for no, ln in enumerate(lines, 1) if ln and not ln.startswith("#")]
        if not entries:
            raise ValueError(f"--api-key-file {path}: no key in it")
        for no, line in entries:
            add(line, f"--api-key-file {path}:{no}")
    return keys


def add_api_key_file_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="more API keys, one [TENANT=]KEY per line (a mounted secret; repeatable)",
    )


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server over the DualPath runtime (chat, completions, metrics)",
    )
    add_config_args(p, default_preset="tiny-1p1d")
    p.add_argument(
        "--model-dir",
        help="local HF checkpoint (config.json, *.safetensors, tokenizer.json): Llama, Qwen2 or "
        "Qwen3; default: the preset's built-in tiny model",
    )
    p.add_argument(
        "--init-tiny-checkpoint",
        action="store_true",
        help="demo: if --model-dir has no config.json, first write a tiny random Llama "
        "checkpoint and tokenizer there (no hub access needed)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--system",
        default="dualpath",
        help="basic, layer, dpl, dualpath (default), oracle; d2p, dram-tier (docs/peers.md)",
    )
    p.add_argument("--kv-root", default="./.dualpath/kv", help="the persistent KV store's root")
    p.add_argument("--hbm-tokens", type=int, default=65536, help="KV tokens per engine's HBM")
    p.add_argument(
        "--snic-mb-per-s", type=float, help="emulated SNIC bandwidth, MB/s (default: the preset's)"
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (engine i on GPU i %% count), or cuda:N"
    )
    p.add_argument(
        "--dtype", help="float32 (default) or bfloat16; --engine vllm: bfloat16 (default), float16"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads per engine (default: the host's cores shared by the engines)",
    )
    p.add_argument(
        "--gpu-time",
        default="host",
        help="host (default: a pass takes the host's compute time; on CUDA the GPU's) or "
        "emulated (no faster than the preset's GPU by the cost model, docs/runtime.md)",
    )
    p.add_argument(
        "--runtime",
        default="local",
        help="local (processes on this host) or ray (Ray actors; with --engine vllm: each "
        "node's side-car and vLLM instance on the Ray node offering dualpath_node<n>)",
    )
    p.add_argument(
        "--ray-address", default="", help="--runtime ray: HEAD:PORT (default: a local Ray)"
    )
    p.add_argument(
        "--transport", help="KV transport: shm, tcp or mooncake (default: shm locally, tcp on Ray)"
    )
    p.add_argument(
        "--block-tokens", type=int, help="Full Block size in tokens (default: the preset's)"
    )
    p.add_argument("--seed", type=int, default=0, help="weights of the tiny model; sampling")
    p.add_argument(
        "--api-key", action="append", default=[], metavar="[TENANT=]KEY", help="repeatable"
    )
    add_api_key_file_arg(p)
    p.add_argument(
        "--metrics-open",
        action="store_true",
        help="serve /metrics without a key for a scraper on loopback (default: with --api-key "
        "set, /metrics needs a key like /v1/*: its counters cover every tenant)",
    )
    p.add_argument(
        "--tool-parser",
        "--tool-call-parser",
        dest="tool_parser",
        default="auto",
        help="how the model writes tool calls (as vLLM's --tool-call-parser): hermes (<tool_call> "
        "JSON: Qwen 2.5/3, Hermes, the default template), llama3_json, mistral, deepseek_v3, "
        "qwen3_coder (XML), or auto (default: from the chat template / model type)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="",
        help="split the model's <think>...</think> into reasoning_content (chat) and reasoning "
        "items (Responses), as vLLM's: qwen3 or deepseek_r1 (default: none, all content)",
    )
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=300.0,
        help="every request ends this long after it arrived, at the latest (a 504, or an "
        "error event in a stream); default 300",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    c = p.add_argument_group("connections (docs/serving.md)")
    c.add_argument(
        "--max-connections",
        type=int,
        default=2048,
        help="open connections at most (kept below the descriptor limit); at the "
        "cap the oldest idle one is closed, else a new one gets a 503",
    )
    c.add_argument(
        "--max-connections-per-client",
        type=int,
        default=512,
        help="open connections of one client IP at most (0: no cap)",
    )
    c.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="a request's headers complete within this (else 408)",
    )
    c.add_argument(
        "--body-timeout-s",
        type=float,
        default=10.0,
        help="longest pause between two reads of a request body (else 408)",
    )
    c.add_argument(
        "--keepalive-s",
        type=float,
        default=75.0,
        help="idle keep-alive, seconds (default 75: longer than clients keep an idle "
        "connection, e.g. aiohttp's 15-60 s, httpx's 5 s, so that a client never sends on a "
        "connection the server is closing)",
    )
    c.add_argument(
        "--keepalive-requests",
        type=int,
        default=1000,
        help="requests per connection before it is closed",
    )
    c.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=128 << 10,
        help="a tool call's or JSON schema's grammar, bytes at most (else 400)",
    )
    c.add_argument(
        "--grammar-budget-s",
        type=float,
        default=2.0,
        help="a new grammar compiles within this (else 400); compiled ones are cached by hash",
    )
    v = p.add_argument_group("--engine vllm (docs/vllm.md)")
    v.add_argument(
        "--engine",
        default="runtime",
        choices=("runtime", "vllm"),
        help="runtime (default): our own engine; vllm: vLLM prefill and decode instances with "
        "the DualPath connector, behind the DualPath router",
    )
    v.add_argument("--vllm-python", help="the Python that runs vLLM (default: .venv-vllm)")
    v.add_argument(
        "--served-model-name",
        default="",
        help="the model id clients name, as vLLM's flag (default: the checkpoint folder's name)",
    )
    v.add_argument(
        "--no-access-log",
        action="store_true",
        help="no line per request on stderr (status, duration, x-request-id)",
    )
    v.add_argument(
        "--vllm-block-tokens",
        type=int,
        default=0,
        help="vLLM block size (default: the model's: 128 for MLA on CPU, else 32)",
    )
    v.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="KV cache GiB per instance")
    v.add_argument("--vllm-max-model-len", type=int, default=4096)
    v.add_argument("--vllm-buffer-mib", type=int, default=64, help="each node buffer, MiB")
    v.add_argument("--vllm-log-dir", help="keep each process's log here")
    v.add_argument(
        "--read-side",
        default="policy",
        choices=("policy", "pe", "de"),
        help="policy (default): the scheduler's read side; pe / de: force every read there",
    )
    v.add_argument(
        "--vllm-arg", action="append", default=[], help="one more argument for every instance"
    )
    v.add_argument(
        "--vllm-prefill-arg",
        action="append",
        default=[],
        help="one more argument for the prefill instances (e.g. --tensor-parallel-size=2)",
    )
    v.add_argument(
        "--vllm-decode-arg",
        action="append",
        default=[],
        help="one more argument for the decode instances",
    )
    v.add_argument(
        "--cluster",
        default="",
        metavar="NAME",
        help="place each node on a node of `dualpath cluster up --name NAME` (its own network "
        "namespace, kernel-shaped NICs, KV moved by Mooncake TE; docs/deploy.md)",
    )
    v.add_argument(
        "--store",
        default="",
        metavar="URL",
        help="the KV store: a directory (default: --kv-root), mooncake://HOST:PORT (a Mooncake "
        "Store master), or `mooncake` with --cluster: one started on the cluster's storage host",
    )
    v.add_argument(
        "--vllm-max-restarts",
        type=int,
        default=3,
        help="restarts of each instance or side-car that dies (default 3); one death more: "
        "the deployment exits non-zero (0: at the first death)",
    )
    p.set_defaults(func=run_serve)


# flags of our own engine (serve/server.py): with --engine vllm a value other than the default
# is a start-up error naming the flag (the vLLM instances have their own: --vllm-block-tokens …)
_RUNTIME_ONLY = (
    ("transport", "--transport"),
    ("threads", "--threads"),
    ("gpu_time", "--gpu-time"),
    ("hbm_tokens", "--hbm-tokens"),
    ("block_tokens", "--block-tokens"),
    ("max_grammar_bytes", "--max-grammar-bytes"),
    ("grammar_budget_s", "--grammar-budget-s"),
)


def _serve_defaults() -> dict[str, Any]:
    root = argparse.ArgumentParser()
    add_serve_parser(root.add_subparsers())
    return vars(root.parse_args(["serve"]))


def refuse_runtime_flags(args: argparse.Namespace) -> None:
    """A ValueError naming the first flag set that only our own engine honours."""
    defaults = _serve_defaults()
    for dest, flag in _RUNTIME_ONLY:
        value = getattr(args, dest)
        if value != defaults[dest]:
            raise ValueError(
                f"{flag} {value} has no meaning with --engine vllm (a flag of "
                "the runtime engine): leave it out"
            )
    if args.device not in ("cpu", "cuda"):
        raise ValueError(
            f"--device {args.device}: --engine vllm takes cpu or cuda (the GPUs "
            "are chosen with CUDA_VISIBLE_DEVICES)"
        )


def run_serve_vllm(args: argparse.Namespace, config: object) -> int:
    """``serve --engine vllm``: the preset's P and D as vLLM instances behind the router."""
    from pathlib import Path

    from dualpath.integrations.vllm.launch import serve_vllm
    from dualpath.integrations.vllm.router import RouterOptions
    from dualpath.integrations.vllm.setup import VllmOptions

    if not args.model_dir:
        raise ValueError("--engine vllm needs --model-dir DIR (an HF checkpoint vLLM can load)")
    refuse_runtime_flags(args)
    if args.runtime not in ("local", "ray"):
        raise ValueError(f"--runtime {args.runtime!r} is invalid: must be local or ray")
    if args.runtime == "ray" and not args.ray_address:
        raise ValueError(
            "--engine vllm --runtime ray needs --ray-address HEAD:PORT (a Ray cluster whose "
            "node n offers the resource dualpath_node<n>: dualpath cluster ray starts one)"
        )
    if args.ray_address and args.runtime != "ray":
        raise ValueError("--ray-address is invalid without --runtime ray")
    if args.ray_address:
        from dualpath.deploy.ray_address import check_gcs_address

        check_gcs_address(args.ray_address)  # before anything is looked for or started
    if not args.request_timeout_s > 0:
        raise ValueError(f"--request-timeout-s {args.request_timeout_s} is invalid: must be > 0")
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens {args.default_max_tokens} is invalid: must be >= 1")
    router_opts = RouterOptions(
        api_keys=_api_keys(args.api_key, args.api_key_file),
        metrics_open=args.metrics_open,
        request_timeout_s=args.request_timeout_s,
        default_max_tokens=args.default_max_tokens,
    )
    cluster = config.cluster  # type: ignore[attr-defined]
    opts = VllmOptions(
        model_dir=args.model_dir,
        num_prefill=cluster.num_prefill_nodes,
        num_decode=cluster.num_decode_nodes,
        host=args.host,
        port=args.port,
        kv_root=args.kv_root,
        dtype=args.dtype or "bfloat16",
        block_tokens=args.vllm_block_tokens,
        max_model_len=args.vllm_max_model_len,
        kv_cache_gib=args.vllm_kv_cache_gib,
        buffer_mib=args.vllm_buffer_mib,
        snic_bytes_per_s=args.snic_mb_per_s * 1e6 if args.snic_mb_per_s else 0.0,
        vllm_python=args.vllm_python,
        device=args.device,
        log_dir=args.vllm_log_dir,
        extra_vllm_args=tuple(args.vllm_arg),
        prefill_vllm_args=tuple(args.vllm_prefill_arg),
        decode_vllm_args=tuple(args.vllm_decode_arg),
        read_side=args.read_side,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        seed=args.seed,
        max_restarts=args.vllm_max_restarts,
        cluster=args.cluster,
        store_url=args.store,
        served_model_name=args.served_model_name,
        ray_address=args.ray_address if args.runtime == "ray" else "",
        access_log=not args.no_access_log,
    )
    if args.init_tiny_checkpoint and not (Path(args.model_dir) / "config.json").exists():
        from dualpath.frontend.checkpoint import write_tiny_checkpoint

        # vLLM's CPU attention needs head_dim >= 32: 4 layers, hidden 256, 4 heads (2 KV)
        write_tiny_checkpoint(
            args.model_dir,
            seed=args.seed,
            num_layers=4,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=512,
        )
        print(f"dualpath serve: wrote a tiny random checkpoint to {args.model_dir}", flush=True)
    _warn_exposure(args.host, router_opts.metrics_open, bool(router_opts.api_keys))
    try:
        return serve_vllm(
            opts, config, args.system, router_opts, args.log_level, connection_limits(args)
        )
    except RuntimeError as err:  # a process of the deployment did not start: why, first
        first, _, rest = str(err).partition("\n")
        print(f"dualpath serve: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return 1


def _warn_exposure(host: str, metrics_open: bool, has_keys: bool) -> None:
    from dualpath.serve.server import ServeOptions

    if not ServeOptions(host=host).is_loopback:
        print(f"dualpath serve: warning: listening on {host}, not loopback", file=sys.stderr)
        if metrics_open and has_keys:
            print(
                "dualpath serve: warning: --metrics-open: /metrics needs no key from any host",
                file=sys.stderr,
            )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    from dualpath.frontend.guard import ConnectionLimits

    return ConnectionLimits(
        max_connections=args.max_connections,
        max_per_client=args.max_connections_per_client,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        keepalive_s=args.keepalive_s,
        keepalive_requests=args.keepalive_requests,
    )


def run_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dualpath.cli.runtime_cmd import check_kv_root, check_runnable, resolve_runtime
    from dualpath.frontend.grammars import GrammarLimits
    from dualpath.serve.server import ServeOptions, build_backend, resolve_config, run_server

    config = build_config(args)
    if args.snic_mb_per_s is not None:
        if not args.snic_mb_per_s > 0:
            raise ValueError(f"--snic-mb-per-s {args.snic_mb_per_s} is invalid: must be > 0")
        hw = replace(config.hardware, snic_bytes_per_s=args.snic_mb_per_s * 1e6)
        config = replace(config, hardware=hw)
    if args.engine == "vllm":
        return run_serve_vllm(args, config)
    if args.block_tokens is not None:
        if args.block_tokens < 1:
            raise ValueError(f"--block-tokens {args.block_tokens} is invalid: must be >= 1")
        config = replace(
            config, scheduler=replace(config.scheduler, block_tokens=args.block_tokens)
        )
    if args.hbm_tokens < 1:
        raise ValueError(f"--hbm-tokens {args.hbm_tokens} is invalid: must be >= 1")
    transport = resolve_runtime(args)
    if args.init_tiny_checkpoint:
        if not args.model_dir:
            raise ValueError("--init-tiny-checkpoint needs --model-dir DIR")
        from pathlib import Path

        if not (Path(args.model_dir) / "config.json").exists():
            from dualpath.frontend.checkpoint import write_tiny_checkpoint

            write_tiny_checkpoint(args.model_dir, seed=args.seed)
            print(f"dualpath serve: wrote a tiny random checkpoint to {args.model_dir}")
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype or "float32",
        seed=args.seed,
        api_keys=_api_keys(args.api_key, args.api_key_file),
        metrics_open=args.metrics_open,
        system=args.system,
        kv_root=args.kv_root,
        hbm_tokens=args.hbm_tokens,
        runtime=args.runtime,
        ray_address=args.ray_address,
        transport=transport,
        threads=args.threads,
        gpu_time=args.gpu_time,
        default_max_tokens=args.default_max_tokens,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        request_timeout_s=args.request_timeout_s,
        log_level=args.log_level,
        limits=connection_limits(args),
        grammar=GrammarLimits(args.max_grammar_bytes, args.grammar_budget_s),
    )
    config = resolve_config(config, opts)
    check_runnable(config, opts.hbm_tokens, opts.dtype)
    check_kv_root(opts.kv_root)
    backend = build_backend(config, opts)
    _warn_exposure(opts.host, opts.metrics_open, bool(opts.api_keys))
    topo = f"{config.cluster.num_prefill_nodes}P{config.cluster.num_decode_nodes}D"
    print(
        f"dualpath serve: {backend.model_name} on http://{opts.host}:{opts.port}/v1 "
        f"(DualPath runtime {opts.runtime}, {config.name} {topo}, system {opts.system}, "
        f"device {opts.device}, {opts.dtype})",
        flush=True,
    )
    return run_server(backend, opts)


def add_loadgen_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "loadgen", help="replay agent trajectories or a Mooncake trace against an OpenAI endpoint"
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default="none", help="bearer key sent to the server")
    p.add_argument("--api", default="chat", help="chat (default) or completions")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--agents", type=int, help="agents as docs/design.md §9 (with --turns)")
    src.add_argument("--trace", help="Mooncake JSONL trace")
    p.add_argument("--turns", type=int, default=8, help="turns per agent (default 8)")
    p.add_argument("--concurrency", type=int, default=8, help="agents / sessions at once")
    p.add_argument("--token-scale", type=float, default=0.05, help="scale of prompt lengths")
    p.add_argument("--max-gen", type=int, default=16, help="cap on generated tokens per turn")
    p.add_argument(
        "--speedup", type=float, default=0.0, help="trace: arrivals ÷ this (0: closed loop)"
    )
    p.add_argument("--limit", type=int, help="trace: first N requests only")
    p.add_argument("--duration", type=float, help="start no new turn after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a turn early")
    p.add_argument("--json", help="write the summary (and the options) to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_loadgen)


def run_loadgen(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from pathlib import Path

    from dualpath.frontend.loadgen import LoadGenerator, LoadgenOptions, format_summary
    from dualpath.progress import bar as progress_bar
    from dualpath.workload.scripts import chat_scripts, trace_scripts

    opts = LoadgenOptions(
        url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        api_key=args.api_key,
        api=args.api,
        ignore_eos=not args.no_ignore_eos,
        duration_s=args.duration,
    )
    if args.trace:
        if not Path(args.trace).is_file():
            raise ValueError(f"--trace {args.trace}: no such file")
        scripts = trace_scripts(
            args.trace, args.token_scale, args.max_gen, args.speedup, args.limit
        )
    else:
        scripts = chat_scripts(
            args.agents, args.turns, args.token_scale, args.max_gen, seed=args.seed
        )
    total = sum(len(s.turns) for s in scripts)
    bar = progress_bar(total, "loadgen", "req", disable=args.no_progress)
    try:
        result = asyncio.run(LoadGenerator(opts).run(scripts, on_request=lambda: bar.update(1)))
    finally:
        bar.close()
    summary = result.summary()
    print(format_summary(summary))
    if args.json:
        out = {"options": {k: v for k, v in vars(args).items() if k != "func"}, "summary": summary}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if summary["errors"] == 0 else 1
