"""Prometheus metrics for ``/metrics`` (names in vLLM's style, prefix ``dualpath:``).

Request-level histograms and counters are observed by the API; backend state (running and
waiting requests, prefix-cache tokens, bytes per load path, NIC utilisation, queue lengths,
requeues) is read from ``Backend.stats()`` at each scrape by a collector. One registry per app.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dualpath.frontend.backend import BackendStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


# The facts both servers report (``dualpath serve`` over our runtime, the vLLM router's
# ``integrations/vllm/collector.py``), built here once: one name, help text and label set each.
def kv_bytes_family(by_path: Mapping[str, float]) -> CounterMetricFamily:
    """KV bytes per load path (``types.KVPath`` values), in sorted order."""
    kv = CounterMetricFamily("dualpath:kv_bytes", "KV bytes moved per load path", labels=["path"])
    for path, value in sorted(by_path.items()):
        kv.add_metric([str(path)], value)
    return kv


def prefix_cache_families(query_tokens: float, hit_tokens: float) -> list[Metric]:
    """Prompt tokens looked up in the store, those loaded from it, and their ratio."""
    return [
        CounterMetricFamily(
            "dualpath:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (the store)",
            value=query_tokens,
        ),
        CounterMetricFamily(
            "dualpath:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (the store)",
            value=hit_tokens,
        ),
        GaugeMetricFamily(
            "dualpath:prefix_cache_hit_ratio",
            "Cached / queried prompt tokens",
            value=hit_tokens / max(query_tokens, 1),
        ),
    ]


def aborted_family(count: float) -> CounterMetricFamily:
    return CounterMetricFamily(
        "dualpath:num_aborted_requests",
        "Requests freed before finishing (client gone, an error, shutdown)",
        value=count,
    )


def persist_failed_family(count: float) -> CounterMetricFamily:
    return CounterMetricFamily(
        "dualpath:kv_persist_failed_blocks",
        "KV block writes dropped after failing (e.g. a full disk): not cached",
        value=count,
    )


class _BackendCollector(Collector):
    def __init__(self, stats: Callable[[], BackendStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "dualpath:num_requests_running", "Requests in the running batch", value=s.num_running
        )
        yield GaugeMetricFamily(
            "dualpath:num_requests_waiting", "Requests waiting to be admitted", value=s.num_waiting
        )
        yield from prefix_cache_families(s.prefix_query_tokens, s.prefix_hit_tokens)
        yield CounterMetricFamily(
            "dualpath:num_preemptions", "Requests requeued", value=s.num_preempted
        )
        yield aborted_family(s.num_aborted)
        yield persist_failed_family(s.num_persist_failed)
        yield kv_bytes_family(s.kv_bytes_by_path)
        util = GaugeMetricFamily(
            "dualpath:nic_utilization", "Busy fraction of each NIC", labels=["nic"]
        )
        for nic, busy in sorted(s.utilisation.items()):
            util.add_metric([nic], busy)
        yield util
        passes = CounterMetricFamily(
            "dualpath:gpu_passes",
            "Forward passes / decode steps held to emulated GPU time (--gpu-time emulated)",
            labels=["engine"],
        )
        overran = CounterMetricFamily(
            "dualpath:gpu_overrun_passes",
            "Of those, passes whose host compute took longer than their emulated GPU time",
            labels=["engine"],
        )
        share = GaugeMetricFamily(
            "dualpath:gpu_overrun_share",
            "Overran / held passes since start, per engine (the host, not the emulated GPU, bound)",
            labels=["engine"],
        )
        for engine, (n, late) in sorted(s.gpu_passes.items()):
            passes.add_metric([engine], n)
            overran.add_metric([engine], late)
            share.add_metric([engine], late / n if n else 0.0)
        yield passes
        yield overran
        yield share
        queues = GaugeMetricFamily("dualpath:queue_length", "Queue lengths", labels=["queue"])
        for name, value in sorted(s.queue_lengths.items()):
            queues.add_metric([name], value)
        yield queues


class ServeMetrics:
    """The app's registry and the request-level instruments."""

    def __init__(self, stats: Callable[[], BackendStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "dualpath:time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "dualpath:inter_token_latency_seconds",
            "Mean time between output tokens after the first, per request (metrics.latency)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dualpath:e2e_request_latency_seconds",
            "Request latency from arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("dualpath:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "dualpath:generation_tokens", "Generated tokens", registry=r
        )
        self.request_success = Counter(
            "dualpath:request_success",
            "Finished requests",
            labelnames=["finished_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "dualpath:request_errors", "Rejected requests", labelnames=["status"], registry=r
        )
        self.request_timeouts = Counter(
            "dualpath:request_timeouts", "Requests ended at request_timeout_s", registry=r
        )
        r.register(_BackendCollector(stats))
