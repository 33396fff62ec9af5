"""Each piece of a DualPath deployment over vLLM started by hand on its own node (docs/deploy.md):
a side-car per node (``dualpath sidecar``), an operator's own ``vllm serve`` with our connector
on each node (``kv_transfer_config``), the router (``dualpath router``). No process starts
another; they find each other by address.

A side-car knows its node (``NodeSpec``) and the facts every piece must agree on (the weights'
digest, the KV shape and the engine: the store's namespace); it tells them to whoever asks
(``node.describe``). The connector and the router ask every side-car, so each of them is
configured with the side-cars' addresses only. ``serve --engine vllm`` runs the same side-car,
connector and router, started for the user on one host or on ``dualpath cluster up``'s nodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.node import NodeSpec, describe
from dualpath.integrations.vllm.setup import (
    CONNECTOR_MODULE,
    Deployment,
    Instance,
    ModelShape,
    kv_namespace,
)

DEFAULT_SIDECAR_PORT = 7100


def deployment_facts(weights_digest: str, shape: ModelShape, engine: str) -> dict[str, Any]:
    """What every piece must agree on, as a side-car tells it (``describe``)."""
    return {"weights_digest": weights_digest, "shape": dataclasses.asdict(shape), "engine": engine}


def sidecar_spec(
    node: int,
    kind: str,
    host: str,
    port: int,
    model_dir: str,
    dtype: str,
    block_tokens: int,
    buffer_mib: int,
    store: str,
    engine: str,
    weights_digest: str,
    run_dir: Path,
    snic_host: str = "",
    snic_bytes_per_s: float = 0.0,
    cache_dtype: str = "auto",
) -> tuple[NodeSpec, dict[str, Any]]:
    """The spec and facts of a side-car started by hand (``dualpath sidecar``): node ``node``
    of kind ``kind`` answering at ``host:port``, its buffer ``buffer_mib`` MiB of Full Blocks
    of the checkpoint at ``model_dir`` (its instances' ``--kv-cache-dtype`` ``cache_dtype``),
    its store ``store`` (a path, or mooncake://)."""
    shape = ModelShape.from_checkpoint(model_dir, dtype, cache_dtype)
    block_tokens = block_tokens or shape.default_block_tokens("cpu")
    full_block = shape.num_layers * block_tokens * shape.row_bytes
    num_slots = buffer_mib * 2**20 // full_block
    if num_slots < 1:
        raise ValueError(f"--buffer-mib {buffer_mib} holds no Full Block of {full_block} bytes")
    namespace = kv_namespace(weights_digest, shape, block_tokens, engine)
    kv_root = "" if "://" in store else store
    spec = NodeSpec(
        node,
        kind,
        f"dpv-n{node}-{os.getpid()}",
        num_slots,
        str(run_dir / "node.lock"),
        str(run_dir / "node.sock"),
        kv_root,
        shape.num_layers,
        block_tokens,
        shape.row_bytes,
        namespace,
        snic_bytes_per_s,
        host,
        port,
        snic_host or host,
        store if "://" in store else "",
        shape.cache_dtype,
    )
    return spec, deployment_facts(weights_digest, shape, engine)


def kv_transfer_config(node: int, sidecars: list[str]) -> str:
    """``vllm serve --kv-transfer-config`` of the instance on node ``node``: our connector,
    loaded by module path, given every node's side-car address."""
    return json.dumps(
        {
            "kv_connector": "DualPathConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"node": node, "sidecars": sidecars},
        }
    )


def deployment_from_sidecars(
    sidecars: list[str],
    prefill_urls: list[str],
    decode_urls: list[str],
    model: str,
    hbm_tokens: int,
) -> Deployment:
    """The router's view of a deployment started by hand: every node as its side-car describes
    it, prefill nodes ``0..P-1`` serving ``prefill_urls`` in order, decode nodes ``P..`` serving
    ``decode_urls``. ValueError naming what does not fit (nodes, kinds, facts that differ)."""
    described = [describe(a) for a in sidecars]
    specs = sorted((s for s, _ in described), key=lambda s: s.node)
    num_p, num_d = len(prefill_urls), len(decode_urls)
    want = [("pe" if i < num_p else "de") for i in range(num_p + num_d)]
    got = [s.kind for s in specs]
    if [s.node for s in specs] != list(range(len(specs))) or got != want:
        raise ValueError(
            f"the side-cars describe nodes {[(s.node, s.kind) for s in specs]}: "
            f"{num_p} --prefill and {num_d} --decode need nodes 0..{num_p - 1} "
            f"of kind pe and {num_p}..{num_p + num_d - 1} of kind de"
        )
    facts = described[0][1]
    for (spec, other), address in zip(described, sidecars, strict=True):
        if other != facts:
            raise ValueError(
                f"side-car {address} (node {spec.node}) was started for another "
                f"model or engine: {other} vs {facts}"
            )
    shape = ModelShape(**facts["shape"])
    instances = [
        Instance(s.node, s.kind, url.rstrip("/"))
        for s, url in zip(specs, [*prefill_urls, *decode_urls], strict=True)
    ]
    return Deployment(
        tuple(specs),
        tuple(instances),
        model,
        specs[0].block_tokens,
        facts["weights_digest"],
        shape,
        facts["engine"],
        hbm_tokens,
    )


_BLOCKS = re.compile(r'^vllm:cache_config_info\{.*?num_gpu_blocks="(\d+)"', re.MULTILINE)


def hbm_tokens_of(metrics_text: str, block_tokens: int) -> int:
    """KV tokens a vLLM instance holds, from its ``/metrics`` (``vllm:cache_config_info``'s
    ``num_gpu_blocks``); ValueError if it is not there."""
    found = _BLOCKS.search(metrics_text)
    if found is None:
        raise ValueError(
            "the decode instance's /metrics has no vllm:cache_config_info with "
            "num_gpu_blocks: pass --hbm-tokens"
        )
    return int(found.group(1)) * block_tokens
