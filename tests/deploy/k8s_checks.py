"""The checker of the deploy/k8s overlays: renders one with ``kubectl kustomize`` and checks what
a cluster would show only at run time (side-car addresses, probes, resources, secrets, shared
memory, the router and its monitoring, images), each failure an AssertionError naming the object.
Containers are read as the kubelet starts them: ``$(VAR)`` expanded, ``dualpath`` argv parsed."""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from dualpath.cli.main import build_parser
from dualpath.config import CLUSTER_PRESETS

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
IMAGE = "ghcr.io/dualpath/dualpath-vllm"
POD_IP = "<status.podIP>"  # the downward API's value, known only at run time
TOKEN_ENV = "DUALPATH_SIDECAR_TOKEN_FILE"
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
HTTP_PATHS = {"vllm": {"/health"}, "router": {"/health"}}  # what each serves to a probe
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# the readiness and liveness probe each server must have
PROBED_BY = {"vllm": "httpGet", "router": "httpGet", "sidecar": "tcpSocket", "store": "tcpSocket"}
CONNECTOR = {
    "kv_connector": "DualPathConnector",
    "kv_connector_module_path": "dualpath.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}

Doc = dict[str, Any]


@cache
def render(overlay: str) -> list[Doc]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rendered(overlay: str) -> list[Doc]:
    return copy.deepcopy(render(overlay))


# --- the rendered objects, as the kubelet would start them ------------------------------------


@dataclass(frozen=True)
class Pod:
    """The pod template of workload ``name`` (``Kind/name``) and the ConfigMaps it can read."""

    name: str
    labels: dict[str, str]
    spec: Doc
    config_maps: dict[str, dict[str, str]]

    @property
    def containers(self) -> list[Doc]:
        return [*self.spec.get("initContainers", []), *self.spec.get("containers", [])]

    def container(self, role: str) -> Doc | None:
        found = [c for c in self.containers if role_of(c) == role]
        assert len(found) <= 1, f"{self.name}: {len(found)} {role} containers"
        return found[0] if found else None

    def where(self, c: Doc) -> str:
        return f"{self.name} container {c['name']}"

    def env(self, c: Doc) -> dict[str, str]:
        """``c``'s environment: envFrom, then env in order, each expanded with what precedes."""
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            ref = source.get("configMapRef", {}).get("name")
            assert ref in self.config_maps, f"{self.where(c)}: envFrom ConfigMap {ref} is missing"
            env.update({source.get("prefix", "") + k: v for k, v in self.config_maps[ref].items()})
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                env[e["name"]] = self._field(c, src["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                env[e["name"]] = self.config_maps[ref["name"]][ref["key"]]
            else:  # a secretKeyRef: a value the manifests never see
                env[e["name"]] = f"<{e['name']}>"
        return env

    def _field(self, c: Doc, path: str) -> str:
        if path == "status.podIP":
            return POD_IP
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        assert label, f"{self.where(c)}: field {path} is not resolved by this test"
        assert label[1] in self.labels, f"{self.where(c)}: the pod has no label {label[1]}"
        return self.labels[label[1]]

    def argv(self, c: Doc) -> list[str]:
        env = self.env(c)
        return [expand(str(a), env) for a in [*c.get("command", []), *c.get("args", [])]]

    def volume(self, name: str) -> Doc:
        found = [v for v in self.spec.get("volumes", []) if v["name"] == name]
        assert found, f"{self.name}: no volume {name}"
        return found[0]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable's value, ``$$`` a ``$``, an
    undefined one left as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        text,
    )


def role_of(c: Doc) -> str:
    command = [str(a) for a in c.get("command", [])]
    if command[:2] == ["vllm", "serve"]:
        return "vllm"
    if command[:1] == ["dualpath"] and len(command) > 1:
        return command[1]  # sidecar, router
    if "dualpath.kv.mooncake_server" in command:
        return "store"
    return ""


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc | None:
    return next((d for d in of_kind(docs, kind) if d["metadata"]["name"] == name), None)


def pods(docs: list[Doc]) -> list[Pod]:
    maps = {m["metadata"]["name"]: dict(m.get("data") or {}) for m in of_kind(docs, "ConfigMap")}
    found = []
    for d in docs:
        template = (d.get("spec") or {}).get("template")
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job") and template:
            labels = template.get("metadata", {}).get("labels", {})
            name = f"{d['kind']}/{d['metadata']['name']}"
            found.append(Pod(name, labels, template["spec"], maps))
    return found


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``name`` (``--x V`` or ``--x=V``; the last one), None if absent."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


@cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def cli(pod: Pod, c: Doc) -> argparse.Namespace:
    """``dualpath …`` of container ``c`` parsed by our own CLI: every flag must exist."""
    argv = pod.argv(c)
    try:
        return _parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(
            f"{pod.where(c)}: {' '.join(argv)!r} is not a valid dualpath command line"
        ) from None


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A Service's selector (a plain map: empty selects no pod) or a label selector
    (matchLabels, matchExpressions: empty selects every pod)."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        if not selector:
            return False
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def reach(docs: list[Doc], url: str) -> tuple[Doc, list[Pod], Doc]:
    """The Service that ``url``'s host names, the pods it selects, its port ``url``'s port."""
    parts = urlsplit(url)
    svc = named(docs, "Service", parts.hostname or "")
    assert svc is not None, f"{url}: no Service {parts.hostname}"
    ports = [p for p in svc["spec"].get("ports", []) if p["port"] == parts.port]
    assert ports, f"{url}: Service/{parts.hostname} has no port {parts.port}"
    selected = [p for p in pods(docs) if selects(svc["spec"].get("selector") or {}, p.labels)]
    return svc, selected, ports[0]


def target(pod: Pod, port: Doc) -> Doc | None:
    """The container of ``pod`` that Service port ``port`` lands on (targetPort: name or number)."""
    want = port.get("targetPort", port["port"])
    for c in pod.containers:
        if any(want in (p.get("name"), p["containerPort"]) for p in c.get("ports", [])):
            return c
    return None


def mount_of(c: Doc, path: str) -> Doc | None:
    """The volume mount of ``c`` that holds ``path`` (the deepest)."""
    holding = [
        m
        for m in c.get("volumeMounts", [])
        if PurePosixPath(path).is_relative_to(PurePosixPath(m["mountPath"]))
    ]
    return max(holding, key=lambda m: len(m["mountPath"]), default=None)


def secret_key_at(pod: Pod, c: Doc, path: str) -> str | None:
    """The key of the Secret whose file ``path`` is in ``c`` (mounted read-only), else None."""
    m = mount_of(c, path)
    if m is None or not m.get("readOnly"):
        return None
    secret = pod.volume(m["name"]).get("secret")
    if secret is None:
        return None
    rel = str(PurePosixPath(path).relative_to(m["mountPath"]))
    items = secret.get("items")
    if items is None:
        return rel
    return next((i["key"] for i in items if i["path"] == rel), None)


def quantity(text: object) -> float:
    """A Kubernetes quantity ("512Mi", "2", "250m") as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    assert m, f"quantity {text!r} is invalid"
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    scale |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(m[1]) * scale[m[2]]


@dataclass(frozen=True)
class Node:
    """A node pod, the id and the side-car list of its vLLM connector."""

    pod: Pod
    node: int
    sidecars: list[str]


def nodes_of(docs: list[Doc]) -> dict[int, Node]:
    found: dict[int, Node] = {}
    for pod in pods(docs):
        vllm = pod.container("vllm")
        if vllm is None:
            continue
        text = flag(pod.argv(vllm), "--kv-transfer-config")
        assert text is not None, f"{pod.where(vllm)}: no --kv-transfer-config"
        try:
            config = json.loads(text)
        except ValueError as err:
            raise AssertionError(
                f"{pod.where(vllm)}: --kv-transfer-config {text!r}: {err}"
            ) from None
        for key, want in CONNECTOR.items():
            assert config.get(key) == want, f"{pod.where(vllm)}: {key} {config.get(key)!r}"
        extra = config.get("kv_connector_extra_config") or {}
        node, sidecars = extra.get("node"), extra.get("sidecars")
        assert isinstance(node, int), f"{pod.where(vllm)}: the connector's node is {node!r}"
        assert isinstance(sidecars, list), f"{pod.where(vllm)}: no sidecars list"
        assert node not in found, f"{pod.name}: node {node} is also {found[node].pod.name}"
        found[node] = Node(pod, node, sidecars)
    return found


def router_of(docs: list[Doc]) -> tuple[Pod, Doc, argparse.Namespace]:
    routers = [(p, c) for p in pods(docs) for c in p.containers if role_of(c) == "router"]
    assert len(routers) == 1, f"{len(routers)} router containers"
    pod, c = routers[0]
    return pod, c, cli(pod, c)


# --- the checks: each an AssertionError naming the object ------------------------------------


def check_nodes(docs: list[Doc]) -> None:
    """1. Each connector's own side-car address reaches its own pod's side-car, whose node and
    kind are the connector's; node ids 0..P+D-1 once each; vLLM and side-car agree."""
    _, _, router = router_of(docs)
    num_p, num_d = len(router.prefill), len(router.decode)
    nodes = nodes_of(docs)
    for node, n in sorted(nodes.items()):
        pod, vllm = n.pod, n.pod.container("vllm")
        sidecar = pod.container("sidecar")
        assert vllm is not None and sidecar is not None, f"{pod.name}: no side-car container"
        assert len(n.sidecars) == num_p + num_d, f"{pod.name}: {len(n.sidecars)} sidecars"
        assert n.sidecars == nodes[min(nodes)].sidecars, f"{pod.name}: another sidecars list"
        url = n.sidecars[node] if node < len(n.sidecars) else "(none)"
        svc, selected, port = reach(docs, url)
        assert [p.name for p in selected] == [pod.name], (
            f"{pod.name}: sidecars[{node}] = {url} selects {[p.name for p in selected]}, "
            "not this pod"
        )
        assert target(pod, port) is sidecar, (
            f"{pod.name}: sidecars[{node}] = {url} lands on port {port.get('targetPort')}, "
            "not its side-car container's"
        )
        assert svc["spec"].get("publishNotReadyAddresses") is True, (
            f"Service/{svc['metadata']['name']}: not-ready pods unpublished, so no vLLM "
            "instance reaches the side-cars it needs to become ready"
        )
        args = cli(pod, sidecar)
        kind = "pe" if node < num_p else "de"
        assert args.node == node, f"{pod.where(sidecar)}: --node {args.node}, connector {node}"
        assert args.kind == kind, f"{pod.where(sidecar)}: --kind {args.kind}, node {node} is {kind}"
        assert args.host == POD_IP == args.snic_host, f"{pod.where(sidecar)}: not on the pod IP"
        argv = pod.argv(vllm)
        assert argv[2] == args.model_dir, (
            f"{pod.name}: vLLM serves {argv[2]}, side-car {args.model_dir}"
        )
        for vllm_flag, value in (
            ("--block-size", args.block_tokens),
            ("--dtype", args.dtype),
            ("--kv-cache-dtype", args.kv_cache_dtype),
        ):
            got = flag(argv, vllm_flag)
            assert got == str(value), f"{pod.name}: vLLM {vllm_flag} {got}, side-car {value}"
        for needed in ("--no-enable-prefix-caching", "--enable-prompt-tokens-details"):
            assert needed in argv, f"{pod.where(vllm)}: no {needed}"
        _, stores, store_port = reach(docs, args.store.replace("mooncake://", "tcp://"))
        assert len(stores) == 1, f"{pod.where(sidecar)}: --store {args.store} selects {stores}"
        landed = target(stores[0], store_port)
        assert landed is not None and role_of(landed) == "store", f"{args.store}: not the store"
    want = list(range(num_p + num_d))
    assert sorted(nodes) == want, f"node ids {sorted(nodes)}: want {want}, each once"


def check_probes(docs: list[Doc]) -> None:
    """2. Every probe on a port the container declares (the one its process listens on, where
    it names one) and, over HTTP, on a path it serves; each server has its probes."""
    for pod in pods(docs):
        for c in pod.containers:
            ports = {p["containerPort"]: p.get("name") for p in c.get("ports", [])}
            listens = flag(pod.argv(c), "--port")
            role = role_of(c)
            if listens is not None:
                assert int(listens) in ports, f"{pod.where(c)}: --port {listens} undeclared"
            kinds: dict[str, str] = {}
            for name in PROBES:
                for handler, h in (c.get(name) or {}).items():
                    if not isinstance(h, dict) or "port" not in h:
                        continue
                    kinds[name] = handler
                    number = next((k for k, v in ports.items() if h["port"] in (k, v)), None)
                    assert number is not None, (
                        f"{pod.where(c)}: {name} on port {h['port']!r}, not one it declares "
                        f"{sorted(ports)}"
                    )
                    assert listens is None or number == int(listens), (
                        f"{pod.where(c)}: {name} on port {number}, it listens on {listens}"
                    )
                    if handler == "httpGet":
                        served = HTTP_PATHS.get(role, set())
                        assert h.get("path") in served, (
                            f"{pod.where(c)}: {name} GET {h.get('path')}, it serves "
                            f"{sorted(served) or 'no HTTP'}"
                        )
            for name in ("readinessProbe", "livenessProbe"):
                if role in PROBED_BY:
                    assert kinds.get(name) == PROBED_BY[role], (
                        f"{pod.where(c)}: no {PROBED_BY[role]} {name}"
                    )


def check_resources(docs: list[Doc]) -> None:
    """3. Every container requests CPU and memory and has a memory limit no lower; a vLLM
    instance given GPUs runs over all of them (tensor × pipeline parallel)."""
    for pod in pods(docs):
        for c in pod.containers:
            res = c.get("resources") or {}
            requests, limits = res.get("requests") or {}, res.get("limits") or {}
            for r in ("cpu", "memory"):
                assert r in requests, f"{pod.where(c)}: no resources.requests.{r}"
            assert "memory" in limits, f"{pod.where(c)}: no resources.limits.memory"
            assert quantity(limits["memory"]) >= quantity(requests["memory"]), pod.where(c)
            gpus = int(limits.get("nvidia.com/gpu", 0))
            if gpus and role_of(c) == "vllm":
                argv = pod.argv(c)
                tp = int(flag(argv, "--tensor-parallel-size") or 1)
                pp = int(flag(argv, "--pipeline-parallel-size") or 1)
                assert tp * pp == gpus, f"{pod.where(c)}: {gpus} GPUs, TP {tp} × PP {pp}"


def check_secrets(docs: list[Doc]) -> None:
    """4. No secret value in the manifests; whoever talks to side-cars reads the token from
    the mounted Secret, and the router its API keys."""

    def secretish(name: str) -> bool:
        return any(w in name.upper() for w in SECRET_WORDS)

    for s in of_kind(docs, "Secret"):
        assert not s.get("data") and not s.get("stringData"), (
            f"Secret/{s['metadata']['name']} carries values: the operator creates it"
        )
    for m in of_kind(docs, "ConfigMap"):
        for key in m.get("data") or {}:
            assert not secretish(key), f"ConfigMap/{m['metadata']['name']}: {key}"
    for pod in pods(docs):
        for c in pod.containers:
            for e in c.get("env", []):
                if not secretish(e["name"]) or "value" not in e:
                    continue
                is_file = e["name"].endswith("_FILE") and secret_key_at(pod, c, e["value"])
                assert is_file, f"{pod.where(c)}: env {e['name']} has a literal value"
            argv = pod.argv(c)
            for a in argv:
                assert a.split("=")[0] not in ("--api-key", "--sidecar-token"), (
                    f"{pod.where(c)}: a secret on its command line ({a.split('=')[0]})"
                )
            if role_of(c) in ("vllm", "sidecar", "router"):
                path = pod.env(c).get(TOKEN_ENV, "")
                assert secret_key_at(pod, c, path) == "sidecar-token", (
                    f"{pod.where(c)}: {TOKEN_ENV}={path!r} is not the Secret's sidecar-token "
                    "mounted read-only"
                )
            if role_of(c) == "router":
                path = flag(argv, "--api-key-file") or ""
                assert secret_key_at(pod, c, path) == "api-keys", (
                    f"{pod.where(c)}: --api-key-file {path!r} is not the Secret's api-keys"
                )


def check_shared_memory(docs: list[Doc]) -> None:
    """5. vLLM and its side-car share the node buffer (a Memory emptyDir at /dev/shm that
    holds it), the buffer's lock file (the side-car's TMPDIR) and the checkpoint."""
    for n in nodes_of(docs).values():
        pod, vllm, sidecar = n.pod, n.pod.container("vllm"), n.pod.container("sidecar")
        assert vllm is not None and sidecar is not None, f"{pod.name}: no side-car container"
        shm = [mount_of(c, "/dev/shm") for c in (vllm, sidecar)]
        assert all(m is not None and m["mountPath"] == "/dev/shm" for m in shm), (
            f"{pod.name}: /dev/shm is not a mount of both vllm and sidecar"
        )
        names = {m["name"] for m in shm if m is not None}
        assert len(names) == 1, f"{pod.name}: vllm and sidecar mount {sorted(names)} at /dev/shm"
        empty = pod.volume(names.pop()).get("emptyDir")
        assert empty is not None and empty.get("medium") == "Memory", (
            f"{pod.name}: /dev/shm is not an emptyDir of medium Memory"
        )
        buffer_bytes = cli(pod, sidecar).buffer_mib * 2**20
        assert quantity(empty.get("sizeLimit", "0")) > buffer_bytes, (
            f"{pod.name}: the /dev/shm sizeLimit {empty.get('sizeLimit')} does not hold the "
            f"{buffer_bytes} bytes of the node buffer"
        )
        for what, path in (
            ("TMPDIR (the buffer's lock)", pod.env(sidecar).get("TMPDIR", "/tmp")),
            ("the checkpoint", cli(pod, sidecar).model_dir),
        ):
            theirs, ours = mount_of(sidecar, path), mount_of(vllm, path)
            assert (
                theirs is not None
                and ours is not None
                and (theirs["name"], theirs["mountPath"]) == (ours["name"], ours["mountPath"])
            ), f"{pod.name}: {what} {path} is not on a volume both containers mount alike"


def check_router_and_monitoring(docs: list[Doc]) -> None:
    """6. The router's --prefill/--decode/--sidecar reach the node pods in node order, its
    preset has their P/D, and a PodMonitor scrapes the router's and every vLLM's /metrics."""
    router_pod, router_c, router = router_of(docs)
    nodes = nodes_of(docs)
    num_p = len(router.prefill)
    for i, url in enumerate([*router.prefill, *router.decode]):
        which = f"router --{'prefill' if i < num_p else 'decode'} {url}"
        _, selected, port = reach(docs, url)
        want = [nodes[i].pod.name] if i in nodes else ["node " + str(i)]
        assert [p.name for p in selected] == want, f"{which}: selects {[p.name for p in selected]}"
        landed = target(selected[0], port)
        assert landed is not None and role_of(landed) == "vllm", f"{which}: not vLLM's port"
    assert router.sidecar == nodes[0].sidecars, (
        f"router --sidecar {router.sidecar}: the connectors have {nodes[0].sidecars}"
    )
    cluster = CLUSTER_PRESETS[router.preset].cluster
    assert (cluster.num_prefill_nodes, cluster.num_decode_nodes) == (
        num_p,
        len(router.decode),
    ), f"router --preset {router.preset}: another P/D than its node lists"
    monitors = of_kind(docs, "PodMonitor")
    assert monitors, "no PodMonitor"
    scraped = [(router_pod, router_c)] + [
        (n.pod, c) for n in nodes.values() if (c := n.pod.container("vllm")) is not None
    ]
    for pod, c in scraped:
        names = {p.get("name") for p in c.get("ports", [])}
        ok = any(
            selects(m["spec"]["selector"], pod.labels)
            and e.get("port") in names
            and e.get("path", "/metrics") == "/metrics"
            for m in monitors
            for e in m["spec"].get("podMetricsEndpoints", [])
        )
        assert ok, f"{pod.where(c)}: no PodMonitor scrapes its /metrics"


def check_images(docs: list[Doc]) -> None:
    """The image kustomize sets (images:), with the overlay's tag."""
    for pod in pods(docs):
        for c in pod.containers:
            name, _, tag = c["image"].rpartition(":")
            assert name == IMAGE and tag and tag != "latest", f"{pod.where(c)}: {c['image']}"


CHECKS: list[Callable[[list[Doc]], None]] = [
    check_nodes,
    check_probes,
    check_resources,
    check_secrets,
    check_shared_memory,
    check_router_and_monitoring,
    check_images,
]
