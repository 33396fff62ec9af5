"""What the operator signals' tests share: the Grafana dashboard, the SNIC read-queue gauges,
the metric names a ``/metrics`` page has or declares, and those a PromQL query names."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dualpath.json"
QUEUE = (
    "dualpath:snic_read_requests_waiting",
    "dualpath:snic_read_bytes_waiting",
    "dualpath:snic_read_requests_in_flight",
    "dualpath:snic_read_bytes_in_flight",
)


def exported_names(url: str) -> set[str]:
    """The sample names ``url``'s ``/metrics`` has or declares (a counter family with no sample
    yet, such as the restarts before any: its ``# TYPE`` line)."""
    names = set()
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            suffixes = {"histogram": ["_bucket", "_sum", "_count"]}  # (a counter's: _total)
            names.update(family + s for s in suffixes.get(kind, [""]))
        elif line and not line.startswith("#"):
            names.add(line.split("{")[0].split(" ")[0])
    return names


def metric_names(expr: str) -> set[str]:
    """The DualPath metrics a PromQL query names."""
    return set(re.findall(r"\b(dualpath:[a-z_]+)", expr))
