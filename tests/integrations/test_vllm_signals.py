"""What an operator watches: each node's SNIC read queue on the router's ``/metrics`` (requests
and bytes waiting, bytes in flight: the signal the paper's scheduler decides on, arXiv
2602.21548 §4) moves while a turn's hits are read and returns to zero; the Grafana dashboard
in ``deploy/grafana/`` queries only metrics the router exports. Real side-cars whose SNICs are
paced in software (so a read takes a while), fake vLLM instances (``fake_vllm``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integrations.fake_vllm import FakeInstances, RouterServer, sidecars
from tests.integrations.signals import DASHBOARD, QUEUE, exported_names, metric_names

from dualpath.integrations.vllm.router import RouterOptions

SNIC_RATE = 200_000  # bytes/s: ~40 blocks of this fake model read in about 2 s
PROMPT = "Read the file, run the tests, fix the bug, then tell me what changed. " * 18


@pytest.fixture()
def router(tmp_path: Path) -> Iterator[RouterServer]:
    with sidecars(
        tmp_path, buffer_mib=2, max_model_len=2048, snic_bytes_per_s=SNIC_RATE
    ) as launched:
        fakes = FakeInstances(launched.deployment, str(tmp_path / "kv"))
        s = RouterServer(launched, RouterOptions(), fakes)
        try:
            yield s
        finally:
            s.close()


def _samples(url: str) -> dict[str, float]:
    """Every sample of ``/metrics``: name with its labels → value."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def _chat(url: str) -> httpx.Response:
    body = {"model": "model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_the_snic_read_queue_moves_while_hits_are_read_and_returns_to_zero(
    router: RouterServer,
) -> None:
    assert _chat(router.url).status_code == 200  # cold: its blocks are persisted
    deadline = time.monotonic() + 30
    while _total(_samples(router.url), "dualpath:kv_writes_pending") > 0:
        assert time.monotonic() < deadline, "the first turn's writes did not land"
        time.sleep(0.1)
    idle = _samples(router.url)
    for name in QUEUE:
        assert f'{name}{{kind="pe",node="0"}}' in idle and f'{name}{{kind="de",node="1"}}' in idle
        assert _total(idle, name) == 0, name

    answer: list[httpx.Response] = []
    again = threading.Thread(target=lambda: answer.append(_chat(router.url)))
    again.start()
    seen = dict.fromkeys(QUEUE, 0.0)
    while again.is_alive():
        now = _samples(router.url)
        for name in QUEUE:
            seen[name] = max(seen[name], _total(now, name))
        time.sleep(0.02)
    again.join()
    assert answer[0].status_code == 200, answer[0].text
    hit = answer[0].json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit > 0
    # a read of the hit blocks moved on one SNIC while the turn waited for it
    block = router.flow.dep.nodes[0].layout.full_block_bytes
    assert seen["dualpath:snic_read_requests_in_flight"] == 1
    assert seen["dualpath:snic_read_bytes_in_flight"] == hit // 32 * block
    after = _samples(router.url)
    for name in QUEUE:
        assert _total(after, name) == 0, f"{name} did not return to zero"
    side = "pe" if _total(after, 'dualpath:reads_total{side="pe"}') else "de"
    assert _total(after, f'dualpath:reads_total{{side="{side}"}}') == 1
    # the side-car's own time: the read's bytes at the paced SNIC rate, at least, in the store
    node = "0" if side == "pe" else "1"
    store_s = after[
        f'dualpath:snic_read_seconds_total{{kind="{side}",node="{node}",stage="store"}}'
    ]
    assert store_s >= 0.9 * (hit // 32 * block) / SNIC_RATE
    assert _total(after, "dualpath:snic_read_seconds_total") < 30  # nothing else was counted


def test_every_dashboard_query_names_a_metric_the_router_exports(router: RouterServer) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(metric_names(e) for e in exprs), "a query without a DualPath metric"
    assert _chat(router.url).status_code == 200
    exported = exported_names(router.url)
    missing = sorted(n for e in exprs for n in metric_names(e) if n not in exported)
    assert not missing, f"the dashboard queries metrics the router does not export: {missing}"
    # the two paths' balance and the SNIC queues are on it
    queried = {n for e in exprs for n in metric_names(e)}
    assert {"dualpath:reads_total", "dualpath:kv_bytes_total", *QUEUE[::3]} <= queried
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"


def test_the_dashboard_checker_catches_a_metric_nobody_exports(router: RouterServer) -> None:
    exported = exported_names(router.url)
    assert {"dualpath:snic_read_bytes_waiting", "dualpath:restarts_total"} <= exported
    assert not metric_names("rate(dualpath:no_such_thing_total[5m])") <= exported
