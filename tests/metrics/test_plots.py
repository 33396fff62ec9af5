"""Every figure function writes a readable PNG (labelled axes, legend) from small inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.metrics.figure_inputs import ABLATION, BREAKDOWN, LATENCY, OFFLINE, PD, SERIES

from dualpath.metrics import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(info: plots.FigureInfo) -> None:
    data = info.path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert info.title
    for ax in info.axes:
        assert ax.xlabel and ax.ylabel and ax.legend, ax
        assert "(" in ax.ylabel or "max/avg" in ax.ylabel  # a unit or a ratio


def test_offline_jct(tmp_path: Path) -> None:
    info = plots.plot_offline_jct(OFFLINE, tmp_path / "offline.png")
    assert_png(info)
    assert [ax.title.split()[:2] for ax in info.axes] == [["DS", "27B"], ["DS", "660B"]]
    assert info.axes[0].ylabel == "JCT (s)"
    assert info.axes[0].legend == ("Basic", "DualPath", "Oracle")


def test_pd_sweep(tmp_path: Path) -> None:
    info = plots.plot_pd_sweep(PD, tmp_path / "pd.png")
    assert_png(info)
    assert info.axes[0].legend == ("Basic", "DualPath")


def test_latency_vs_aps_has_slo_lines(tmp_path: Path) -> None:
    info = plots.plot_latency_vs_aps(LATENCY, tmp_path / "lat.png", slo_ttft_s=4.0)
    assert_png(info)
    assert [ax.ylabel for ax in info.axes] == ["TTFT (s)", "TTST (s)", "TPOT (ms)"]
    assert "SLO 4 s" in info.axes[0].legend and "SLO 50 ms" in info.axes[2].legend
    assert all(ax.xlabel == "load (agents/s, APS)" for ax in info.axes)


def test_latency_rows_per_model(tmp_path: Path) -> None:
    rows = [{**r, "model": m} for m in ("A", "B") for r in LATENCY]
    info = plots.plot_latency_vs_aps(rows, tmp_path / "lat2.png")
    assert len(info.axes) == 6 and info.axes[3].title == "B TTFT"


def test_ttft_breakdown(tmp_path: Path) -> None:
    info = plots.plot_ttft_breakdown(BREAKDOWN, tmp_path / "bd.png")
    assert_png(info)
    assert [ax.title for ax in info.axes] == ["Basic", "DualPath"]
    assert info.axes[0].legend == ("queue", "alloc", "read", "prefill")


def test_ablation(tmp_path: Path) -> None:
    info = plots.plot_ablation(ABLATION, tmp_path / "ab.png")
    assert_png(info)
    assert "speedup over Basic" in info.axes[0].legend[0]


@pytest.mark.parametrize("fn", [plots.plot_snic_balance, plots.plot_attention_balance])
def test_balance_series(tmp_path: Path, fn: plots.SeriesPlot) -> None:
    info = fn(SERIES, tmp_path / "bal.png")
    assert_png(info)
    assert info.axes[0].xlabel == "time (s)"
    assert info.axes[0].legend[:2] == ("DualPath", "Round robin")


def test_missing_key_is_a_one_line_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row 0 lacks jct_s"):
        plots.plot_ablation([{"system": "Basic"}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="no rows"):
        plots.plot_pd_sweep([], tmp_path / "x.png")


def test_report_md(tmp_path: Path) -> None:
    sections = [
        plots.ReportSection("Ablation", "ab.png", "Lower is better.", ABLATION),
        plots.ReportSection("Empty", None, "nothing", []),
    ]
    text = plots.write_report_md(sections, tmp_path / "report.md").read_text()
    assert "## Ablation" in text and "![Ablation](ab.png)" in text
    assert "| system | jct_s |" in text and "| +DPL | 6.5 |" in text
    assert plots.format_cell(None) == "-" and plots.format_cell(1 / 3) == "0.3333"


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, dualpath.metrics.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
