"""Emulated NIC pacers: exact link time, HIGH ≈ 99% / LOW floor, LOW takes idle capacity."""

from __future__ import annotations

import threading

import pytest

from dualpath.runtime.pacer import NicPacer, Pacer
from dualpath.types import TrafficClass


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, delay: float) -> None:
        self.slept.append(delay)
        self.now += delay


def test_transfer_takes_bytes_over_rate_of_link_time() -> None:
    clock = FakeClock()
    pacer = Pacer(1_000_000, quantum_s=0.5, clock=clock, sleep=clock.sleep)  # one quantum each
    pacer.transfer(250_000, TrafficClass.LOW)
    assert clock.now == pytest.approx(0.25)
    assert pacer.stats.bytes_by_class[TrafficClass.LOW] == 250_000
    assert pacer.stats.busy_s == pytest.approx(0.25)
    clock.now += 1.0  # idle time is not banked: the next transfer still takes its link time
    pacer.transfer(100_000, TrafficClass.HIGH)
    assert clock.now == pytest.approx(1.35)
    assert pacer.stats.total_bytes == 350_000


def test_high_gets_about_99_percent_and_low_is_never_starved() -> None:
    pacer = Pacer(50e6, quantum_s=0.001)  # 50 KB quanta
    pacer.grant_log = []
    start = threading.Barrier(2)

    def run(klass: TrafficClass) -> None:
        start.wait()
        pacer.transfer(10_000_000 if klass is TrafficClass.HIGH else 5_000_000, klass)

    threads = [threading.Thread(target=run, args=(k,)) for k in TrafficClass]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = pacer.grant_log
    high_at = [i for i, k in enumerate(log) if k is TrafficClass.HIGH]
    contended = log[high_at[0] : high_at[-1]]
    low_while_contended = contended.count(TrafficClass.LOW)
    assert log.count(TrafficClass.HIGH) == 200 and log.count(TrafficClass.LOW) == 100
    assert 1 <= low_while_contended <= 4  # ≈ 1% of 200 HIGH quanta, but not zero
    last_high = high_at[-1]
    assert all(k is TrafficClass.LOW for k in log[last_high + 1 :])  # LOW takes the idle link


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="rate_bytes_per_s"):
        Pacer(0)
    with pytest.raises(ValueError, match="low_weight"):
        Pacer(1e6, low_weight=1.0)
    nic = NicPacer.of(1e9, "cnic0")
    assert nic.tx.name == "cnic0.tx" and nic.rx.rate_bytes_per_s == 1e9
