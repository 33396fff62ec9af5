"""PE / DE buffers (design §2): fixed-capacity shared memory cut into Full-Block slots.

Any process of the node (storage worker, engines, the scheduler on this host) attaches by
name and allocates under one lock. Full ⇒ ``alloc`` returns None and the caller retries
later (backpressure, nothing is dropped); ``alloc_wait`` waits with a sleeping backoff.

Each used slot carries an owner tag (an int64, 0: anonymous). Processes that hand slots to
each other without a message in between (the vLLM router leases a request's slots, the
decode instance claims them when it loads) move them with ``transfer``, all or nothing, and
give back only what they still hold with ``release``: a slot can never be freed under its
current holder, nor claimed by a request it was not leased to.

A process that reads or writes slots it does not hold (a prefill instance loading a request's
hits from, and saving its KV into, slots the router leased) *pins* them while it does
(``pin``, under the lease, all or none): a holder that releases a pinned slot meanwhile (the
router gave the request up) leaves it in use until the pin ends (``unpin``, or the pinner's
``release_owner`` when it died), so that no later holder is given a slot still being written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

PAGE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """Name and geometry of one node's buffer; picklable, sent to every process of the node."""

    name: str
    num_slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"buffer {self.name}: num_slots={self.num_slots} must be >= 1")
        if self.slot_bytes < 1:
            raise ValueError(f"buffer {self.name}: slot_bytes={self.slot_bytes} must be >= 1")

    @property
    def stride_bytes(self) -> int:
        """Slot stride, page-aligned so O_DIRECT storage reads land in a slot directly."""
        return -(-self.slot_bytes // PAGE_BYTES) * PAGE_BYTES

    @property
    def data_bytes(self) -> int:
        return self.num_slots * self.stride_bytes


ANONYMOUS = 0  # the owner tag of slots allocated without one
# the owner tag of a slot released while pinned: freed when its pin ends (no holder's tag is
# this: routers' leases are > 0, instances' small negative numbers)
UNPIN_FREES = -(2**62)


class SlotBuffer:
    """A shared-memory buffer of ``num_slots`` slots; after the data, each slot's owner tag
    (int64), its pinner's tag (int64, 0: not pinned), then the used-bitmap (one byte a
    slot)."""

    def __init__(self, spec: BufferSpec, lock: Any, shm: SharedMemory, owner: bool) -> None:
        self.spec = spec
        self._lock = lock
        self._shm = shm
        self._owner = owner
        buf = shm.buf
        assert buf is not None
        self.data = buf[: spec.data_bytes]
        tags_end = spec.data_bytes + 8 * spec.num_slots
        pins_end = tags_end + 8 * spec.num_slots
        self._owners = buf[spec.data_bytes : tags_end].cast("q")
        self._pins = buf[tags_end:pins_end].cast("q")
        self._used = buf[pins_end : pins_end + spec.num_slots]
        # called (outside the lock) after a call of this process freed slots: the vLLM
        # shell rings its node's doorbell (``kv.doorbell``) to wake whoever waits for them
        self.on_free: Callable[[], None] | None = None
        self._num_freed = 0  # (under the lock) slots freed by the call in progress

    @staticmethod
    def region_bytes(spec: BufferSpec) -> int:
        return spec.data_bytes + 17 * spec.num_slots

    @classmethod
    def create(cls, spec: BufferSpec, lock: Any) -> SlotBuffer:
        shm = SharedMemory(name=spec.name, create=True, size=cls.region_bytes(spec))
        return cls(spec, lock, shm, owner=True)

    @classmethod
    def attach(cls, spec: BufferSpec, lock: Any) -> SlotBuffer:
        shm = SharedMemory(name=spec.name)
        return cls(spec, lock, shm, owner=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SlotBuffer.attach, (self.spec, self._lock))

    def slot(self, index: int) -> memoryview:
        """The bytes of slot ``index`` (``slot_bytes`` long)."""
        start = index * self.spec.stride_bytes
        return self.data[start : start + self.spec.slot_bytes]

    def offset(self, index: int) -> int:
        """Byte offset of slot ``index`` inside the region (for transports)."""
        return index * self.spec.stride_bytes

    def alloc(self, num_slots: int, owner: int = ANONYMOUS) -> list[int] | None:
        """Reserve ``num_slots`` slots (lowest free first) for ``owner``, or None if they do
        not all fit."""
        if num_slots > self.spec.num_slots:
            raise ValueError(
                f"buffer {self.spec.name}: {num_slots} slots requested, capacity is "
                f"{self.spec.num_slots}: raise the buffer size"
            )
        if num_slots == 0:
            return []
        with self._lock:
            free = [i for i in range(self.spec.num_slots) if not self._used[i]]
            if len(free) < num_slots:
                return None
            got = free[:num_slots]
            for i in got:
                self._used[i] = 1
                self._owners[i] = owner
        return got

    def alloc_wait(self, num_slots: int, timeout_s: float, poll_s: float = 0.002) -> list[int]:
        """``alloc`` with a sleeping retry; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.alloc(num_slots)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise TimeoutError(f"buffer {self.spec.name}: no {num_slots} free slots")
            time.sleep(poll_s)

    def _free_one(self, i: int) -> None:
        """(Under the lock.)"""
        self._used[i] = 0
        self._owners[i] = ANONYMOUS
        self._pins[i] = 0
        self._num_freed += 1

    @contextlib.contextmanager
    def _freeing(self) -> Iterator[None]:
        """The lock, for a call that may free slots; ``on_free`` after it if one did."""
        with self._lock:
            self._num_freed = 0
            yield
            freed = self._num_freed
        if freed and self.on_free is not None:
            self.on_free()

    def _let_go(self, i: int) -> None:
        """(Under the lock.) Slot ``i``'s holder releases it: free, or once its pin ends."""
        if self._pins[i]:
            self._owners[i] = UNPIN_FREES
        else:
            self._free_one(i)

    def free(self, slots: list[int]) -> None:
        with self._freeing():
            for i in slots:
                if not self._used[i]:
                    raise ValueError(f"buffer {self.spec.name}: slot {i} freed twice")
                self._free_one(i)

    def transfer(self, slots: list[int], from_owner: int, to_owner: int) -> bool:
        """Hand ``slots`` from ``from_owner`` to ``to_owner``, all or none: False (nothing
        changed) unless every slot is in use and held by ``from_owner``."""
        with self._lock:
            if not all(self._used[i] and self._owners[i] == from_owner for i in slots):
                return False
            for i in slots:
                self._owners[i] = to_owner
        return True

    def adopt(self, slots: list[int], owner: int) -> list[int]:
        """``owner`` takes over those of ``slots`` in use, whoever held them (a storage
        worker accepting slots to persist); the ones taken."""
        with self._lock:
            got = [i for i in slots if self._used[i]]
            for i in got:
                self._owners[i] = owner
        return got

    def release(self, slots: list[int], owner: int) -> int:
        """Free those of ``slots`` that ``owner`` still holds (the others were handed on or
        freed already; a pinned one once its pin ends); how many it let go."""
        with self._freeing():
            mine = [i for i in slots if self._used[i] and self._owners[i] == owner]
            for i in mine:
                self._let_go(i)
        return len(mine)

    def release_owner(self, owner: int) -> int:
        """Free every slot ``owner`` holds, and end every pin it holds (its process died);
        how many slots it held."""
        with self._freeing():
            n = self.spec.num_slots
            mine = [i for i in range(n) if self._used[i] and self._owners[i] == owner]
            for i in mine:
                self._let_go(i)
            pinned = [i for i in range(n) if self._used[i] and self._pins[i] == owner]
            self._unpin(pinned)
        return len(mine)

    def pin(self, slots: list[int], holder: int, pinner: int) -> bool:
        """``pinner`` (not 0) reads or writes ``slots`` from now on, all or none: False
        (nothing changed) unless every slot is in use and held by ``holder``."""
        if pinner == ANONYMOUS:
            raise ValueError(f"buffer {self.spec.name}: a pin needs a pinner's tag, not 0")
        with self._lock:
            if not all(self._used[i] and self._owners[i] == holder for i in slots):
                return False
            for i in slots:
                self._pins[i] = pinner
        return True

    def unpin(self, slots: list[int], pinner: int) -> int:
        """``pinner`` is done with ``slots``: its pins end, and a slot its holder released
        meanwhile is freed; how many pins ended."""
        with self._freeing():
            mine = [i for i in slots if self._used[i] and self._pins[i] == pinner]
            self._unpin(mine)
        return len(mine)

    def _unpin(self, slots: list[int]) -> None:
        """(Under the lock.)"""
        for i in slots:
            self._pins[i] = 0
            if self._owners[i] == UNPIN_FREES:
                self._free_one(i)

    def owner_of(self, slot: int) -> int | None:
        """The owner tag of ``slot``, or None when it is free."""
        with self._lock:
            return int(self._owners[slot]) if self._used[slot] else None

    @property
    def num_free(self) -> int:
        with self._lock:
            return self.spec.num_slots - sum(self._used)

    def close(self) -> None:
        """Detach; the creator also unlinks the segment."""
        self.data.release()
        self._owners.release()
        self._pins.release()
        self._used.release()
        self._shm.close()
        if self._owner:
            self._shm.unlink()
