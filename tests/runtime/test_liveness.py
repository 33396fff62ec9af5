"""Liveness is read from the process itself (/proc: pid, start time, state): a stopped process
still runs, a zombie does not, a reused pid is not taken for the process it replaced; a kill is
confirmed before it returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dualpath.runtime.liveness import ProcId, is_running, kill_confirmed, start_time

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc")


def test_a_process_is_running_until_killed_and_confirmed_gone() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        me = ProcId.of(proc.pid)
        assert me.start and is_running(me)
        os.kill(proc.pid, signal.SIGSTOP)  # stopped is alive: the heartbeat tells a stall
        assert is_running(me)
        assert not is_running(ProcId(proc.pid, str(int(me.start) + 1)))  # another process
        assert kill_confirmed(me)
        assert not is_running(me)
        assert start_time(proc.pid) is None  # our child: reaped too, no zombie left
    finally:
        if is_running(me):
            proc.kill()
            proc.wait()
    assert kill_confirmed(me)  # killing what is gone already is a no-op
    assert not is_running(ProcId(proc.pid, ""))  # never seen: never running
