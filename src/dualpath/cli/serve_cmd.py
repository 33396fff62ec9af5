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
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--backend", default="local", help="inference backend (only: local)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="weights of the tiny model; sampling")
    p.add_argument(
        "--api-key", action="append", default=[], metavar="[TENANT=]KEY", help="repeatable"
    )
    p.add_argument("--max-batch-seqs", type=int, default=32, help="sequences per step")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="new tokens per step")
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
        f"(backend {opts.backend}, device {opts.device})",
        flush=True,
    )
    return run_server(backend, opts)
