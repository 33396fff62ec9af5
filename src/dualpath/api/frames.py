"""Flat rows of simulation results (every metric of the JSON, one column each) and the
pandas DataFrames built from them. pandas is optional (the ``analysis`` extra): it is
imported only when a frame is asked for, with a one-line error naming the extra."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dualpath.metrics import TurnRecord, latency
from dualpath.metrics.record import TIMELINE_FIELDS
from dualpath.sim.report import csv_row
from dualpath.sim.results import SimResult

if TYPE_CHECKING:
    import pandas as pd


def require_pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "DataFrames need pandas, which is not installed: pip install 'dualpath[analysis]' "
            "(`make run` installs it)"
        ) from None
    return pandas


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [2]} → {"a.b": 1, "c": [2]}: nested dicts become dotted
    columns (sorted keys: a stable column order); lists stay as they are."""
    if not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key in sorted(value, key=str):
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value[key], name))
    return out


def metric_row(result: SimResult, comparison: Mapping[str, float | None]) -> dict[str, Any]:
    """Every metric of one system's result: the summary CSV columns first (``report.
    CSV_COLUMNS``), then every field of ``SimResult.to_dict`` flattened (``summary.ttst_s.p50``,
    ``utilisation.de_snic_read.max``, ``counters.event_digest`` …)."""
    row = csv_row(result, comparison)
    full = result.to_dict()
    full.pop("system")
    row.update(flatten(full))
    return row


def turn_row(record: TurnRecord) -> dict[str, Any]:
    """One turn's record plus its latencies (s) as ``metrics.latency`` defines them (TTFT,
    TTST, TPOT, ITL; None where undefined) and the TTFT components (queue: arrival →
    scheduled; read: the storage read; prefill: first forward pass → first token)."""
    row: dict[str, Any] = {
        "agent_id": record.agent_id,
        "turn_index": record.turn_index,
        "request_id": record.request_id,
        "prompt_tokens": record.prompt_tokens,
        "hit_tokens": record.hit_tokens,
        "output_tokens": record.output_tokens,
        "read_side": record.read_side,
    }
    row.update({name: getattr(record, name) for name in TIMELINE_FIELDS})
    n = record.output_tokens
    row["ttft_s"] = latency.ttft_s(record.arrival_s, record.first_token_s)
    row["ttst_s"] = latency.ttst_s(record.first_token_s, record.second_token_s, n)
    row["tpot_s"] = latency.tpot_s(record.second_token_s, record.finish_s, n)
    row["itl_s"] = latency.itl_s(record.first_token_s, record.finish_s, n)
    row["queue_s"] = record.scheduled_s - record.arrival_s
    row["read_s"] = record.read_done_s - record.read_start_s
    row["prefill_s"] = record.first_token_s - record.prefill_start_s
    return row


def frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """A DataFrame of ``rows`` (columns in first-seen order)."""
    pandas = require_pandas()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return pandas.DataFrame(list(rows), columns=columns)
