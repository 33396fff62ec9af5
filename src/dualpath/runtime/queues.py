"""The runtime's process queues beyond ``multiprocessing``'s: one whose writers' lock survives a
writer killed while holding it, and how a retired worker's inbox is closed. No state."""

from __future__ import annotations

import multiprocessing.queues as mp_queues
from typing import Any

from dualpath.kv.pacer import LinkLock


class DeathSafeQueue(mp_queues.Queue):
    """``multiprocessing.Queue`` whose writers' lock is a ``LinkLock``: an engine killed by
    SIGKILL while its feeder thread writes leaves no lock taken for ever (a semaphore would,
    and every other process's messages would then wait behind it: a stuck run)."""

    def __init__(self, ctx: Any, write_lock: LinkLock) -> None:
        super().__init__(ctx=ctx)
        self._wlock = write_lock


def discard_queue(inbox: Any) -> None:
    """Close a retired worker's inbox (nobody reads it any more): what was still in it is
    dropped; the writer thread, if any, flushes and closes both ends."""
    inbox.close()
    inbox.cancel_join_thread()
    if inbox._thread is None:  # never written from here: no writer thread to close them
        inbox._reader.close()
        inbox._writer.close()
