"""The block writes a storage node still owes (``storage_node.StorageNode``): keys counted from
the moment they are queued (or held for a persist job still arriving) until they are done, and
``settle``, the bounded wait for some of them. No I/O."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settled:
    """``settle``'s answer: whether any key was pending, and how many still are."""

    waited: bool
    pending: int


class PendingWrites:
    """A count per key (one key may be queued twice); thread-safe."""

    def __init__(self) -> None:
        self._done = threading.Condition(threading.Lock())
        self._keys: Counter[str] = Counter()

    def add(self, keys: Sequence[str]) -> None:
        """``keys`` pending until ``drop``."""
        with self._done:
            self._keys.update(keys)

    def drop(self, keys: Sequence[str]) -> None:
        """``keys`` (once each) no longer pending: written, skipped, failed or given up."""
        with self._done:
            for k in keys:
                self._keys[k] -= 1
                if self._keys[k] <= 0:
                    del self._keys[k]
            self._done.notify_all()

    @property
    def num_pending(self) -> int:
        """Pending writes, a key queued twice counted twice."""
        with self._done:
            return sum(self._keys.values())

    def settle(self, keys: Sequence[str], timeout_s: float) -> Settled:
        """Wait until none of ``keys`` is pending (at most ``timeout_s``)."""
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"settle: timeout_s={timeout_s!r} is invalid: must be a number >= 0")
        with self._done:
            waited = any(k in self._keys for k in keys)
            if waited:
                self._done.wait_for(lambda: not any(k in self._keys for k in keys), timeout_s)
            return Settled(waited, sum(k in self._keys for k in keys))
