"""The simulator-backed figure provider on tiny settings: every figure gets real data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dualpath.cli.figures_cmd import run_figures
from dualpath.cli.sim_figures import QUICK, SimFigureData, make_figure_data
from dualpath.sim.online import OnlineSettings

TINY = QUICK.__class__(
    offline=(("ds27b-1p1d", "32k", 8),),
    pd_presets=("ds27b-1p1d", "ds27b-2p1d"),
    pd_agents=8,
    ablation=("ds27b-1p1d", "32k", 8),
    online_preset="ds27b-1p1d",
    aps=(0.5, 1.0),
    online=OnlineSettings(aps=1.0, horizon_s=10.0, window_s=2.0, lookback_s=4.0),
    balance_preset="ds660b-2p4d",
    balance_agents=32,
    balance_horizon_s=10.0,
    capacity_search=False,
)


@pytest.mark.slow
def test_tiny_provider_feeds_every_figure(tmp_path: Path) -> None:
    data = SimFigureData(TINY)
    assert {r["system"] for r in data.offline_jct()} == {"Basic", "DualPath", "Oracle"}
    assert [r["pd"] for r in data.pd_sweep()] == ["1P1D", "1P1D", "2P1D", "2P1D"]
    lat = data.online_latency()
    assert len(lat) == 4 and all(r["ttft_s"] > 0 for r in lat)
    bd = data.ttft_breakdown()
    assert len(bd) == 4 and all(r["prefill_s"] > 0 for r in bd)
    assert [r["system"] for r in data.ablation()] == ["Basic", "+Layer", "+DPL", "+Sched"]
    assert all(r["capacity_aps"] in (0.0, 0.5, 1.0) for r in data.capacity())
    assert set(data.snic_balance()) == {"DualPath", "DPL (RR)"}
    assert all(v >= 1.0 for series in data.attention_balance().values() for _, v in series)
    args = argparse.Namespace(out=str(tmp_path / "figs"), quick=True, data_dir=None)
    assert run_figures(args, data) == 0
    out = tmp_path / "figs"
    pngs = {p.name for p in out.glob("*.png")}
    assert {"online_latency.png", "ttft_breakdown.png", "ablation.png"} <= pngs
    assert "(no data)" not in (out / "report.md").read_text()
    assert json.loads((out / "data" / "meta.json").read_text())["slo_ttft_s"] == 4.0


def test_make_figure_data_selects_settings() -> None:
    assert make_figure_data(quick=True, prefetch=False).s is QUICK
    assert make_figure_data(quick=False, prefetch=False).s.capacity_search
