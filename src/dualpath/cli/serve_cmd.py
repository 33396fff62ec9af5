"""`dualpath serve` (OpenAI-compatible HTTP server) and `dualpath loadgen` (its load generator)."""

from __future__ import annotations

import argparse
import sys

from dualpath.cli.common import add_config_args, build_config


def _api_keys(values: list[str]) -> dict[str, str]:
    """``KEY`` or ``TENANT=KEY``; a key without a tenant is its own tenant."""
    keys: dict[str, str] = {}
    for v in values:
        tenant, _, key = v.rpartition("=")
        if not key:
            raise ValueError(f"--api-key {v!r} is invalid: expected KEY or TENANT=KEY")
        keys[key] = tenant or f"key{len(keys)}"
    return keys


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics)")
    add_config_args(p, default_preset="tiny-1p1d")
    p.add_argument("--model-dir", help="local HF checkpoint (config.json, safetensors, tokenizer)")
    p.add_argument(
        "--init-tiny-checkpoint",
        action="store_true",
        help="demo: if --model-dir has no config.json, first write a tiny random Llama "
        "checkpoint and tokenizer there (no hub access needed)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--backend",
        default="local",
        help="local (default: in-process, any HF checkpoint) or runtime (the multi-process "
        "DualPath runtime: scheduler, storage workers, PE/DE engines; built-in tiny model)",
    )
    p.add_argument(
        "--system",
        default="dualpath",
        help="--backend runtime: basic, layer, dpl, dualpath, oracle",
    )
    p.add_argument("--kv-root", default="./.dualpath/kv", help="--backend runtime: KV store root")
    p.add_argument(
        "--hbm-tokens", type=int, default=65536, help="--backend runtime: KV tokens per engine"
    )
    p.add_argument(
        "--snic-mb-per-s",
        type=float,
        help="--backend runtime: emulated SNIC bandwidth, MB/s (default: the preset's)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="weights of the tiny model; sampling")
    p.add_argument(
        "--api-key", action="append", default=[], metavar="[TENANT=]KEY", help="repeatable"
    )
    p.add_argument("--max-batch-seqs", type=int, default=32, help="sequences per step")
    p.add_argument(
        "--max-batch-tokens", type=int, default=512, help="new tokens per step (prefill chunk)"
    )
    p.add_argument("--cache-blocks", type=int, default=4096, help="prefix cache capacity")
    p.add_argument("--block-tokens", type=int, default=16, help="prefix block size (default 16)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from dualpath.serve.local import LocalOptions
    from dualpath.serve.server import ServeOptions, build_backend, run_server

    config = build_config(args)
    if args.snic_mb_per_s is not None:
        if not args.snic_mb_per_s > 0:
            raise ValueError(f"--snic-mb-per-s {args.snic_mb_per_s} is invalid: must be > 0")
        from dataclasses import replace

        hw = replace(config.hardware, snic_bytes_per_s=args.snic_mb_per_s * 1e6)
        config = replace(config, hardware=hw)
    if args.backend == "runtime":
        from dualpath.cli.runtime_cmd import check_kv_root, check_runnable

        check_runnable(config)
        check_kv_root(args.kv_root)
    if args.init_tiny_checkpoint:
        if not args.model_dir:
            raise ValueError("--init-tiny-checkpoint needs --model-dir DIR")
        from pathlib import Path

        if not (Path(args.model_dir) / "config.json").exists():
            from dualpath.serve.checkpoint import write_tiny_checkpoint

            write_tiny_checkpoint(args.model_dir, seed=args.seed)
            print(f"dualpath serve: wrote a tiny random checkpoint to {args.model_dir}")
    local = LocalOptions(
        max_batch_seqs=args.max_batch_seqs,
        max_batch_tokens=args.max_batch_tokens,
        block_tokens=args.block_tokens,
        cache_blocks=args.cache_blocks,
        seed=args.seed,
    )
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        backend=args.backend,
        model_dir=args.model_dir,
        device=args.device,
        seed=args.seed,
        api_keys=_api_keys(args.api_key),
        local=local,
        system=args.system,
        kv_root=args.kv_root,
        hbm_tokens=args.hbm_tokens,
        default_max_tokens=args.default_max_tokens,
        log_level=args.log_level,
    )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    backend = build_backend(config, opts)
    if not opts.is_loopback:
        print(f"dualpath serve: warning: listening on {opts.host}, not loopback", file=sys.stderr)
    print(
        f"dualpath serve: {backend.model_name} on http://{opts.host}:{opts.port}/v1 "
        f"(backend {opts.backend}"
        + (f", system {opts.system}" if opts.backend == "runtime" else "")
        + f", device {opts.device})",
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
    src.add_argument("--agents", type=int, help="SPEC §9 agents (with --turns)")
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

    from tqdm import tqdm

    from dualpath.serve.loadgen import (
        LoadGenerator,
        LoadgenOptions,
        agent_scripts,
        format_summary,
        trace_scripts,
    )

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
        scripts = agent_scripts(
            args.agents, args.turns, args.token_scale, args.max_gen, seed=args.seed
        )
    total = sum(len(s.turns) for s in scripts)
    bar = tqdm(total=total, unit="req", disable=args.no_progress, file=sys.stderr)
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
