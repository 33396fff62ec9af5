"""`dualpath figures`: the report from a data provider, re-plotted from its saved data, and
the tables beside the figures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from tests.metrics.figure_inputs import ABLATION, BREAKDOWN, LATENCY, OFFLINE, PD, SERIES

from dualpath.cli import figures_cmd


class FakeData:
    """A FigureData provider from the synthetic inputs above (capacity included)."""

    def offline_jct(self) -> list[dict[str, Any]]:
        return [dict(r) for r in OFFLINE]

    def pd_sweep(self) -> list[dict[str, Any]]:
        return [dict(r) for r in PD]

    def online_latency(self) -> list[dict[str, Any]]:
        return [dict(r) for r in LATENCY]

    def capacity(self) -> list[dict[str, Any]]:
        return [
            {"setting": "DS 27B 1P1D", "system": "Basic", "capacity_aps": 0.3},
            {"setting": "DS 27B 1P1D", "system": "DualPath", "capacity_aps": 0.5},
        ]

    def ttft_breakdown(self) -> list[dict[str, Any]]:
        return [dict(r) for r in BREAKDOWN]

    def ablation(self) -> list[dict[str, Any]]:
        return [dict(r) for r in ABLATION]

    def snic_balance(self) -> dict[str, list[list[float]]]:
        return {k: [list(p) for p in v] for k, v in SERIES.items()}

    def attention_balance(self) -> dict[str, list[list[float]]]:
        return {}  # unavailable: skipped

    def meta(self) -> dict[str, Any]:
        return {"title": "Test report", "slo_ttft_s": 4.0, "notes": "synthetic numbers"}


def test_make_report_and_replot_from_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    figures_cmd.add_figures_parser(parser.add_subparsers())
    args = parser.parse_args(["figures", "--out", str(tmp_path / "a")])
    assert figures_cmd.run_figures(args, data=FakeData()) == 0
    printed = capsys.readouterr().out.split()
    pngs = sorted(p.name for p in (tmp_path / "a").glob("*.png"))
    assert pngs == sorted(
        f"{n}.png"
        for n in (
            "offline_jct",
            "pd_sweep",
            "online_latency",
            "ttft_breakdown",
            "ablation",
            "snic_balance",
        )
    )
    assert printed[-1].endswith("report.md")
    report = (tmp_path / "a" / "report.md").read_text()
    assert report.startswith("# Test report")
    assert "DualPath/Basic = 1.67×" in report
    assert "## Attention balance\n\n(no data)" in report
    assert "| model | mal | agents | Basic jct_s | DualPath jct_s | Oracle jct_s |" in report
    # re-plot from the saved data: same report
    again = parser.parse_args(
        ["figures", "--out", str(tmp_path / "b"), "--from", str(tmp_path / "a" / "data")]
    )
    assert figures_cmd.run_figures(again) == 0
    assert (tmp_path / "b" / "report.md").read_text() == report


def test_pivot_and_tables() -> None:
    table = figures_cmd.pivot(PD, ("pd",))
    assert table[1] == {
        "pd": "1P2D",
        "Basic jct_s": 10.0,
        "DualPath jct_s": 4.0,
        "speedup DualPath": 2.5,
    }
    assert figures_cmd.ablation_table(ABLATION)[2]["speedup"] == pytest.approx(10 / 6.5)
    rows = figures_cmd.series_table({"x": [[0.0, 1.0], [1.0, 2.0]]})
    assert rows == [{"series": "x", "mean max/avg": 1.5, "peak max/avg": 2.0, "samples": 2}]


def test_json_provider_errors(tmp_path: Path) -> None:
    (tmp_path / "pd_sweep.json").write_text("{not json")
    (tmp_path / "ablation.json").write_text('{"a": 1}')
    data = figures_cmd.JsonFigureData(tmp_path)
    assert data.offline_jct() == [] and data.snic_balance() == {}
    with pytest.raises(ValueError, match=r"cannot read .*pd_sweep\.json"):
        data.pd_sweep()
    with pytest.raises(ValueError, match="expected a JSON list"):
        data.ablation()
    args = argparse.Namespace(data_dir=str(tmp_path / "missing"), quick=False, out=str(tmp_path))
    with pytest.raises(ValueError, match="not a folder"):
        figures_cmd.resolve_provider(args)
