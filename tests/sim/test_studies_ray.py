"""Studies over Ray (``sim.fanout``): `dualpath sweep`, `tune` and the figures' data on a local
two-raylet Ray cluster on loopback (``tests.procs.two_raylets``) write what the local process
pool writes, through the same result cache; tasks land on both raylets."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.cluster_utils")

from tests.procs import two_raylets  # noqa: E402

from dualpath.cli.main import main  # noqa: E402
from dualpath.sim.fanout import check_ray_address, study_pool  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """The two raylets' GCS address; this process is their driver while the module runs."""
    with two_raylets() as (c, _):
        yield str(c.address)


def _node_after(seconds: float) -> str:
    time.sleep(seconds)
    return str(ray.get_runtime_context().get_node_id())


def test_tasks_run_on_both_raylets(address: str) -> None:
    """Two one-CPU tasks at once on two one-CPU raylets: one on each."""
    with study_pool(1, address) as pool:
        nodes = {f.result(timeout=120) for f in [pool.submit(_node_after, 2.0) for _ in range(2)]}
    assert len(nodes) == 2
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == nodes


def _sweep(out: Path, extra: list[str]) -> dict[str, Any]:
    argv = ["sweep", "--preset", "ds27b-1p1d", "--pd", "1p1d,2p1d", "--mal", "32k"]
    argv += ["--agents", "3", "--systems", "basic,dualpath", "--no-progress", "--out", str(out)]
    assert main(argv + extra) == 0
    data: dict[str, Any] = json.loads((out / "sweep.json").read_text())
    return data


def test_sweep_over_ray_writes_what_the_process_pool_writes(address: str, tmp_path: Path) -> None:
    local = _sweep(tmp_path / "local", ["--workers", "2"])
    remote = _sweep(tmp_path / "ray", ["--ray-address", address])
    assert remote == local
    assert (tmp_path / "ray" / "sweep.csv").read_text() == (
        tmp_path / "local" / "sweep.csv"
    ).read_text()


def test_tune_over_ray_fills_the_cache_the_process_pool_reads(
    address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", "--preset", "ds27b-1p1d", "--nodes", "3", "--agents", "8", "--mal", "32k"]
    argv += ["--no-progress", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--ray-address", address]) == 0
    assert "2 shapes, 2 simulated, 0 from cache" in capsys.readouterr().out
    ranked = json.loads((tmp_path / "tune.json").read_text())["ranked"]
    assert main([*argv, "--workers", "1"]) == 0
    assert "2 shapes, 0 simulated, 2 from cache" in capsys.readouterr().out
    assert json.loads((tmp_path / "tune.json").read_text())["ranked"] == ranked


def test_bad_ray_address_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ValueError, match="is unreachable"):
        check_ray_address(dead)
    argv = ["sweep", "--preset", "ds27b-1p1d", "--agents", "3", "--out", str(tmp_path)]
    assert main([*argv, "--ray-address", "ray://x:1"]) == 2
    err = capsys.readouterr().err
    assert "--ray-address 'ray://x:1' is invalid" in err and len(err.strip().splitlines()) == 1


def _figures(data: Any) -> dict[str, Any]:
    names = ("offline_jct", "pd_sweep", "online_latency", "capacity", "ttft_breakdown")
    names += ("ablation", "snic_balance", "attention_balance")
    return {name: getattr(data, name)() for name in names}


def test_figure_data_prefetched_over_ray_equals_one_by_one(address: str) -> None:
    """Every figure's data from simulations run at once as Ray tasks equals the provider's
    own, one simulation after another (small settings)."""
    from dualpath.cli.sim_figures import FigureSettings, SimFigureData
    from dualpath.sim.online import OnlineSettings

    tiny = FigureSettings(
        offline=(("ds27b-1p1d", "32k", 4),),
        pd_presets=("ds27b-1p1d", "ds27b-2p1d"),
        pd_agents=4,
        ablation=("ds27b-1p1d", "32k", 4),
        online_preset="ds27b-1p1d",
        aps=(1.0, 2.0),
        online=OnlineSettings(aps=1.0, horizon_s=30.0, window_s=5.0, lookback_s=10.0),
        balance_preset="ds27b-1p1d",
        balance_agents=8,
        balance_horizon_s=10.0,
        capacity_search=False,
    )
    fetched = SimFigureData(tiny)
    fetched.prefetch(1, address, progress=False)
    assert len(fetched._jct) == 7 and len(fetched._online) == 4 and len(fetched._balance) == 2
    assert json.dumps(_figures(fetched)) == json.dumps(_figures(SimFigureData(tiny)))
