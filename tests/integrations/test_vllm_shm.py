"""Which ``/dev/shm`` segments a process group holds, and which no live process maps: by
inode, so that a live semaphore (mapped under glibc's temporary name) is never taken for
a leftover, and nobody else's is removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dualpath.integrations.vllm.processes import group_segments, unlink_unmapped

CHILD = """
import multiprocessing as mp, sys, time
from multiprocessing.shared_memory import SharedMemory
lock = mp.get_context("spawn").Lock()
shm = SharedMemory(create=True, size=4096)
print(lock._semlock.name.lstrip("/"), shm.name, flush=True)
time.sleep(120)
"""


def test_a_live_semaphore_is_held_and_kept_and_a_killed_ones_segments_go() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout is not None
        sem, shm = child.stdout.readline().split()
        names = {f"sem.{sem}", shm}
        assert all(Path("/dev/shm", n).exists() for n in names)
        assert group_segments(child.pid) >= names  # the semaphore too, though unnamed in maps
        assert unlink_unmapped(set(names)) == []  # alive: nothing removed
        assert all(Path("/dev/shm", n).exists() for n in names)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 5
    while group_segments(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(unlink_unmapped(set(names))) == sorted(names)  # a SIGKILLed group's: gone
    assert not any(Path("/dev/shm", n).exists() for n in names)
