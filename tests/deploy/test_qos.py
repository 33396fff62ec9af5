"""Fabric QoS generation (design §6): golden files for the defaults, tracking of every option."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.deploy.qos import (
    QosOptions,
    ets_weights,
    ib_low_share_floor,
    opensm_conf,
    roce_commands,
)

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("DUALPATH_REGEN_GOLDEN") == "1"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGEN:
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; DUALPATH_REGEN_GOLDEN=1 rewrites it"


def _opt(conf: str, key: str) -> str:
    match = re.search(rf"^{key} (.+)$", conf, re.MULTILINE)
    assert match, f"{key} missing"
    return match.group(1)


def test_default_opensm_is_the_papers() -> None:
    conf = opensm_conf(QosOptions())
    assert _opt(conf, "qos_max_vls") == "4"
    assert _opt(conf, "qos_high_limit") == "240"
    assert _opt(conf, "qos_vlarb_high") == "0:192,1:192,2:0,3:192"
    assert _opt(conf, "qos_vlarb_low") == "0:192,1:192,2:64,3:192"
    _golden("opensm_default.conf", conf)


def test_default_roce_golden() -> None:
    text = roce_commands(QosOptions(iface="ens1f0"))
    assert "--tcbw 33,33,1,33,0,0,0,0" in text
    assert "--dscp2prio set,26,3" in text and "--dscp2prio set,16,2" in text
    _golden("roce_default.sh", text)


def test_cli_writes_both_fabrics(capsys: pytest.CaptureFixture[str]) -> None:
    """The paper's arbiter for both fabrics, then how traffic is marked."""
    assert main(["qos"]) == 0
    out = capsys.readouterr().out
    assert _opt(out, "qos_high_limit") == "240"
    assert _opt(out, "qos_vlarb_low") == "0:192,1:192,2:64,3:192"
    assert "mlnx_qos -i IFACE --tsa ets,ets,ets,ets,ets,ets,ets,ets --tcbw 33,33,1,33" in out
    assert out.index("qos TRUE") < out.index("#!/bin/sh") < out.index("# Marking traffic")
    _golden("qos_both_default.txt", out)


def test_low_floor_arithmetic() -> None:
    # 4 KiB packets, 240 x 4 KiB of high-priority data per low-priority packet: 1/241
    assert ib_low_share_floor(240, 4096) == pytest.approx(1 / 241)
    assert ib_low_share_floor(255, 4096) == 0.0  # unlimited: low priority may starve
    assert ib_low_share_floor(0, 2048) == pytest.approx(0.5)  # one packet each way


def test_auto_high_limit_tracks_the_low_share() -> None:
    # 1%: 4096·0.99/0.01 bytes = 99 units of 4 KiB; 5%: 19 units
    assert QosOptions(high_limit=None, low_share=0.01).ib_high_limit == 99
    assert QosOptions(high_limit=None, low_share=0.05).ib_high_limit == 19
    for share in (0.01, 0.02, 0.05, 0.2):
        limit = QosOptions(high_limit=None, low_share=share).ib_high_limit
        assert ib_low_share_floor(limit, 4096) >= share
        assert ib_low_share_floor(limit + 1, 4096) < share


def test_outputs_track_options() -> None:
    base = opensm_conf(QosOptions())
    moved = opensm_conf(QosOptions(kv_lane=0, collective_weight=100, kv_low_weight=10))
    assert _opt(moved, "qos_vlarb_high") == "0:0,1:100,2:100,3:100"
    assert _opt(moved, "qos_vlarb_low") == "0:10,1:100,2:100,3:100"
    assert moved != base
    assert ets_weights(QosOptions(low_share=0.05)) == [32, 32, 5, 31, 0, 0, 0, 0]
    assert sum(ets_weights(QosOptions(num_vls=8, kv_lane=7, low_share=0.03))) == 100
    assert _opt(opensm_conf(QosOptions(num_vls=2, kv_lane=1)), "qos_sl2vl").startswith("0,1,0")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["qos", "--high-limit", "300"], "qos.high_limit=300"),
        (["qos", "--mtu", "1500"], "qos.mtu_bytes=1500"),
        (["qos", "--iface", "eth 0"], "qos.iface="),
        (["qos", "--set", "sim.traffic_manager=false"], "sim.traffic_manager=false"),
        (["qos", "--set", "sim.low_floor=0.7"], "qos.low_share=0.7"),
    ],
)
def test_bad_values_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_bad_high_limit_word_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["qos", "--high-limit", "lots"])
    assert exc.value.code == 2
    assert "'auto'" in capsys.readouterr().err


def test_out_file(tmp_path: Path) -> None:
    """``--fabric ib``: the reviewed output of both fabrics without its RoCE script."""
    out = tmp_path / "qos.conf"
    assert main(["qos", "--fabric", "ib", "--out", str(out)]) == 0
    both = (GOLDEN / "qos_both_default.txt").read_text()
    ib = both[: both.index("#!/bin/sh\n")] + both[both.index("# Marking traffic") :]
    assert out.read_text() == ib
    assert "mlnx_qos" not in ib and _opt(ib, "qos_high_limit") == "240"
