"""``dualpath sidecar`` and ``dualpath router``: the pieces of DualPath over vLLM started one by
one, each on its own node (docs/deploy.md). ``serve --engine vllm`` starts them all for you."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from dualpath.cli.common import add_config_args, build_config
from dualpath.cli.serve_cmd import add_api_key_file_arg


def add_sidecar_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "sidecar",
        help="a node's side-car for DualPath over vLLM: its buffer, storage reads and writes, "
        "KV to other nodes (docs/deploy.md)",
    )
    p.add_argument("--node", type=int, required=True, help="node id: prefill 0..P-1, decode P..")
    p.add_argument("--kind", choices=("pe", "de"), required=True, help="pe: prefill; de: decode")
    p.add_argument("--host", required=True, help="this node's compute-network (CNIC) address")
    p.add_argument("--port", type=int, default=7100, help="its TCP port (default 7100)")
    p.add_argument("--snic-host", default="", help="its storage-network address (default --host)")
    p.add_argument(
        "--store",
        required=True,
        metavar="URL",
        help="the KV store every node shares: mooncake://MASTER:PORT, or a directory on a "
        "shared file system",
    )
    p.add_argument("--model-dir", required=True, help="the checkpoint vLLM serves (its shape)")
    p.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype (default bfloat16)")
    p.add_argument(
        "--block-tokens",
        type=int,
        default=0,
        help="vLLM's --block-size (default: the model's on CPU: 128 for MLA in bf16, else 32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's --kv-cache-dtype of this node's instance (auto, fp8, fp8_e4m3, fp8_e5m2)",
    )
    p.add_argument("--buffer-mib", type=int, default=64, help="the node buffer, MiB (64)")
    p.add_argument(
        "--vllm-python",
        help="the Python that runs vLLM (its version names the KV layout; default: .venv-vllm)",
    )
    p.add_argument(
        "--snic-mb-per-s",
        type=float,
        default=0.0,
        help="emulate the SNIC's rate in software (default 0: the NIC's own)",
    )
    add_token_args(p, side_car=True)
    p.set_defaults(func=run_sidecar)


def add_token_args(p: argparse.ArgumentParser, side_car: bool) -> None:
    p.add_argument(
        "--sidecar-token-file",
        metavar="PATH",
        default="",
        help="the secret every side-car request carries, shared by the deployment's side-cars, "
        "vLLM instances and router (default: $DUALPATH_SIDECAR_TOKEN_FILE, "
        "$DUALPATH_SIDECAR_TOKEN)",
    )
    if side_car:
        p.add_argument(
            "--no-token",
            action="store_true",
            help="serve a non-loopback --host without a token (anyone on that network may "
            "read and overwrite the node's KV)",
        )


def use_token_file(path: str) -> str:
    """``--sidecar-token-file``: this process's token from then on (its children's too);
    the token ("" : none), checked readable now."""
    import os

    from dualpath.integrations.vllm.token import (
        TOKEN_ENV,
        TOKEN_FILE_ENV,
        read_token_file,
        sidecar_token,
    )

    if path:
        read_token_file(path)
        os.environ.pop(TOKEN_ENV, None)
        os.environ[TOKEN_FILE_ENV] = path
    return sidecar_token()


def run_sidecar(args: argparse.Namespace) -> int:
    import ipaddress

    from dualpath.integrations.vllm.launch import engine_name, find_vllm_python
    from dualpath.integrations.vllm.processes import unlink_buffer
    from dualpath.integrations.vllm.sidecar import NodeSidecar
    from dualpath.integrations.vllm.standalone import kv_transfer_config, sidecar_spec
    from dualpath.kv.weights import checkpoint_digest

    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is invalid: must be 1..65535")
    token = use_token_file(args.sidecar_token_file)
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:  # a host name
        loopback = args.host == "localhost"
    if not token and not loopback and not args.no_token:
        raise ValueError(
            f"--host {args.host} without a side-car token: give --sidecar-token-file (the "
            "same secret on every node, router and vLLM instance), or --no-token"
        )
    engine = engine_name(find_vllm_python(args.vllm_python))
    run_dir = Path(tempfile.mkdtemp(prefix="dualpath-sidecar-"))
    try:
        spec, facts = sidecar_spec(
            args.node,
            args.kind,
            args.host,
            args.port,
            args.model_dir,
            args.dtype,
            args.block_tokens,
            args.buffer_mib,
            args.store,
            engine,
            checkpoint_digest(args.model_dir),
            run_dir,
            args.snic_host,
            args.snic_mb_per_s * 1e6,
            args.kv_cache_dtype,
        )
        print(
            f"dualpath sidecar: node {spec.node} ({spec.kind}) at {spec.control}, "
            f"{spec.num_slots} slots, store {args.store}, engine {engine}",
            flush=True,
        )
        print(
            "  vLLM on this node: vllm serve MODEL --block-size "
            f"{spec.block_tokens} --kv-cache-dtype {spec.cache_dtype} "
            "--no-enable-prefix-caching --kv-transfer-config "
            f"'{kv_transfer_config(spec.node, ['tcp://HOST:PORT of every side-car, node 0 first'])}'",
            flush=True,
        )
        # a segment of this very name is a dead side-car's of this machine (its name carries
        # this process's pid: a restarted container's side-car is pid 1 again)
        unlink_buffer(spec)
        NodeSidecar(spec, facts).serve_forever()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def add_router_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "router",
        help="the DualPath router over vLLM instances and side-cars started by hand "
        "(docs/deploy.md)",
    )
    add_config_args(p, default_preset="tiny-1p1d")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        required=True,
        help="a prefill instance (node 0, 1, … in order; repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        required=True,
        help="a decode instance (nodes after the prefill ones; repeatable)",
    )
    p.add_argument(
        "--sidecar",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        required=True,
        help="every node's side-car (repeatable)",
    )
    p.add_argument("--system", default="dualpath", help="dualpath (default) or basic")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--store-host",
        default="127.0.0.1",
        help="this host's address toward a Mooncake Store's master (its client)",
    )
    p.add_argument(
        "--hbm-tokens",
        type=int,
        default=0,
        help="KV tokens one decode instance holds (default: from its /metrics)",
    )
    p.add_argument("--read-side", default="policy", choices=("policy", "pe", "de"))
    p.add_argument("--api-key", action="append", default=[], metavar="[TENANT=]KEY")
    add_api_key_file_arg(p)
    add_token_args(p, side_car=False)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    import dataclasses

    import httpx

    from dualpath.cli.serve_cmd import _api_keys, _warn_exposure
    from dualpath.frontend.guard import ConnectionLimits
    from dualpath.frontend.http_server import http_server
    from dualpath.integrations.vllm.app import create_app
    from dualpath.integrations.vllm.assembly import build_router, router_policy
    from dualpath.integrations.vllm.router import RouterOptions
    from dualpath.integrations.vllm.standalone import deployment_from_sidecars, hbm_tokens_of

    use_token_file(args.sidecar_token_file)
    policy = router_policy(build_config(args), args.system)
    opts = RouterOptions(
        api_keys=_api_keys(args.api_key, args.api_key_file),
        request_timeout_s=args.request_timeout_s,
        default_max_tokens=args.default_max_tokens,
    )
    try:
        model = httpx.get(args.decode[0].rstrip("/") + "/v1/models", timeout=10).json()
        model_id = str(model["data"][0]["id"])
        dep = deployment_from_sidecars(args.sidecar, args.prefill, args.decode, model_id, 0)
        hbm = args.hbm_tokens or hbm_tokens_of(
            httpx.get(args.decode[0].rstrip("/") + "/metrics", timeout=10).text, dep.block_tokens
        )
    except (httpx.HTTPError, KeyError, IndexError, OSError) as err:
        raise ValueError(f"cannot read the deployment: {type(err).__name__}: {err}") from None
    dep = dataclasses.replace(dep, hbm_tokens=hbm, router_store_host=args.store_host)
    kv_root = dep.nodes[0].kv_root or dep.nodes[0].store
    flow, router = build_router(dep, policy, kv_root, args.read_side, opts)
    try:
        print(
            f"dualpath router: {len(args.prefill)}P{len(args.decode)}D of {model_id} "
            f"({dep.engine}), store {dep.nodes[0].store}; on http://{args.host}:{args.port} "
            f"(system {args.system})",
            file=sys.stderr,
            flush=True,
        )
        _warn_exposure(args.host, opts.metrics_open, bool(opts.api_keys))
        http = http_server(
            create_app(router), args.host, args.port, args.log_level, 5.0, ConnectionLimits()
        )
        http.run()
    finally:
        flow.close()
    return 0
