"""deploy/k8s: every overlay rendered by ``kubectl kustomize`` and checked for what a cluster
would show only at run time: a node's side-car address that reaches another pod, a probe on a
port nobody declares, a secret value in a manifest. Rendering only: no cluster, no image.

The containers' command lines are checked as the kubelet would start them: ``$(VAR)``
expanded from their environment (the ConfigMap, the downward API's pod labels; the pod's IP
stays a placeholder), and ``dualpath sidecar`` / ``dualpath router`` parsed by our own CLI.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable

import pytest
from tests.deploy.k8s_checks import (
    CHECKS,
    OVERLAYS,
    Doc,
    check_nodes,
    check_probes,
    check_resources,
    check_router_and_monitoring,
    check_secrets,
    check_shared_memory,
    named,
    of_kind,
    rendered,
    router_of,
)

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")


def test_the_documented_overlays_exist() -> None:
    assert {"cpu-1p1d", "gpu-2p4d"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_overlay_passes(overlay: str, check: Callable[[list[Doc]], None]) -> None:
    check(rendered(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_shape_is_its_name(overlay: str) -> None:
    shape = re.search(r"(\d+)p(\d+)d", overlay)
    assert shape, f"{overlay}: name it …-<P>p<D>d"
    _, _, router = router_of(rendered(overlay))
    assert (len(router.prefill), len(router.decode)) == (int(shape[1]), int(shape[2]))


# --- the checker catches a broken manifest -----------------------------------------------------


def _config_map(docs: list[Doc]) -> Doc:
    return of_kind(docs, "ConfigMap")[0]


def _node0(docs: list[Doc]) -> Doc:
    d = named(docs, "Deployment", "dualpath-node-0")
    assert d is not None
    return d


def _container(d: Doc, name: str) -> Doc:
    spec = d["spec"]["template"]["spec"]
    return next(
        c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name
    )


def _swap_sidecars(docs: list[Doc]) -> None:
    data = _config_map(docs)["data"]
    data["DUALPATH_SIDECARS"] = json.dumps(json.loads(data["DUALPATH_SIDECARS"])[::-1])


def _drop_resources(docs: list[Doc]) -> None:
    del _container(_node0(docs), "sidecar")["resources"]


def _literal_token(docs: list[Doc]) -> None:
    router = named(docs, "Deployment", "dualpath-router")
    assert router is not None
    _container(router, "router")["env"].append({"name": "DUALPATH_SIDECAR_TOKEN", "value": "x"})


def _private_shm(docs: list[Doc]) -> None:
    node = _node0(docs)
    node["spec"]["template"]["spec"]["volumes"].append(
        {"name": "own-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    )
    for m in _container(node, "vllm")["volumeMounts"]:
        if m["mountPath"] == "/dev/shm":
            m["name"] = "own-shm"


def _probe_elsewhere(docs: list[Doc]) -> None:
    _container(_node0(docs), "vllm")["readinessProbe"]["httpGet"]["path"] = "/v1/models"


def _prefill_is_decode(docs: list[Doc]) -> None:
    router = named(docs, "Deployment", "dualpath-router")
    assert router is not None
    args = _container(router, "router")["args"]
    i, j = args.index("--prefill"), args.index("--decode")
    args[i + 1], args[j + 1] = args[j + 1], args[i + 1]


BREAKS = [
    (_swap_sidecars, check_nodes, r"dualpath-node-0: sidecars\[0\] = tcp://dualpath-node-1"),
    (_drop_resources, check_resources, r"dualpath-node-0 container sidecar: no resources"),
    (_literal_token, check_secrets, r"dualpath-router container router: env DUALPATH_SIDECAR_T"),
    (_private_shm, check_shared_memory, r"dualpath-node-0: vllm and sidecar mount"),
    (_probe_elsewhere, check_probes, r"dualpath-node-0 container vllm: readinessProbe GET /v1"),
    (_prefill_is_decode, check_router_and_monitoring, r"router --prefill http://dualpath-node-1"),
]


@pytest.mark.parametrize(
    ("breaks", "check", "message"), BREAKS, ids=[b[0].__name__ for b in BREAKS]
)
def test_checker_catches_a_broken_manifest(
    breaks: Callable[[list[Doc]], None], check: Callable[[list[Doc]], None], message: str
) -> None:
    docs = rendered("cpu-1p1d")
    check(docs)  # whole, it passes
    breaks(docs)
    with pytest.raises(AssertionError, match=message):
        check(docs)
