"""Emulated NIC pacers: exact link time, HIGH ≈ 99% / LOW floor, LOW takes idle capacity."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dualpath.kv.pacer import NicPacer, Pacer
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


def _charge_shared(link: object, nbytes: int) -> None:
    Pacer(10e6, "shared", link=link).transfer(nbytes, TrafficClass.LOW)  # type: ignore[arg-type]


def test_a_shared_link_serialises_transfers_of_two_processes(tmp_path: Path) -> None:
    import multiprocessing as mp
    import time

    from dualpath.kv.pacer import SharedLink

    ctx = mp.get_context("spawn")
    link = SharedLink.create(ctx, str(tmp_path / "link.lock"))
    start = time.monotonic()
    procs = [ctx.Process(target=_charge_shared, args=(link, 1_000_000)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    mine = Pacer(10e6, "shared", link=link)  # this process sees both processes' charges
    assert mine.stats.bytes_by_class[TrafficClass.LOW] == 2_000_000
    assert mine.stats.busy_s == pytest.approx(0.2)
    # one link: the two 0.1 s transfers were reserved one after the other, not side by side
    assert link.state[0] - start >= 0.2  # the link's reservation horizon


def _hold_link_lock(link: object, held: object) -> None:
    """Take the link's lock the way a grant does, say so, and never let go."""
    import time

    with Pacer(10e6, "shared", link=link)._cond:  # type: ignore[arg-type]
        held.set()  # type: ignore[attr-defined]
        time.sleep(600)


@pytest.mark.timeout(60)
def test_a_process_killed_holding_the_link_lock_does_not_stall_the_link(tmp_path: Path) -> None:
    import multiprocessing as mp
    import os
    import signal

    from dualpath.kv.pacer import SharedLink

    ctx = mp.get_context("spawn")
    link = SharedLink.create(ctx, str(tmp_path / "link.lock"))
    held = ctx.Event()
    holder = ctx.Process(target=_hold_link_lock, args=(link, held))
    holder.start()
    try:
        assert held.wait(timeout=30)
        mine = Pacer(10e6, "shared", link=link)
        blocked = threading.Thread(
            target=mine.transfer, args=(100_000, TrafficClass.LOW), daemon=True
        )
        blocked.start()
        blocked.join(timeout=0.5)
        assert blocked.is_alive()  # the lock really is held: the transfer waits behind it
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)  # dies inside its critical section
        holder.join(timeout=10)
        blocked.join(timeout=10)
        assert not blocked.is_alive()  # the kernel released the dead holder's lock
        mine.transfer(100_000, TrafficClass.LOW)  # and the link keeps pacing
        assert mine.stats.bytes_by_class[TrafficClass.LOW] == 200_000
        # both transfers reserved their link time (2 × 100 kB at 10 MB/s); how closely the
        # wall clock follows it is benchmarks/bench_host.py's to measure
        assert mine.stats.busy_s == pytest.approx(0.02)
    finally:
        if holder.is_alive():
            holder.kill()
        holder.join(timeout=10)


def test_transfer_all_paces_every_link_and_a_dead_owners_ticket_is_skipped() -> None:
    import dualpath.kv.pacer as pacer_mod
    from dualpath.kv.pacer import transfer_all

    class _Local:  # SharedLink's shape over in-process state (no other process needed)
        def __init__(self) -> None:
            self.state = [0.0] * pacer_mod._STATE_LEN
            self.lock = threading.Lock()

    a, b = _Local(), _Local()
    dead = 2**22 + 4321  # beyond pid_max: no such process
    # a LOW ticket of a dead process heads link b's queue (it died while queued)
    b.state[pacer_mod._NEXT + 1] = 1.0
    b.state[pacer_mod._OWNER + pacer_mod._RING] = dead
    links = [Pacer(50e6, "a", link=a), Pacer(10e6, "b", link=b)]  # type: ignore[arg-type]
    transfer_all(links, 100_000, TrafficClass.LOW)
    assert links[0].stats.bytes_by_class[TrafficClass.LOW] == 100_000  # charged on both links
    assert links[1].stats.bytes_by_class[TrafficClass.LOW] == 100_000
    assert links[1].stats.busy_s == pytest.approx(0.01)
    assert b.state[pacer_mod._HEAD + 1] == 2.0  # the dead ticket and ours both passed
