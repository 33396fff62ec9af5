"""A node's storage worker is full duplex, as its SNIC is: a block write is not queued behind
a read in progress (a DualPath decode node reads hits for PEs while it persists the blocks
the agent's next turn waits for)."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import uuid
from pathlib import Path

from dualpath.config import preset
from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.ledger import Topology
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.messages import (
    PersistedMsg,
    PersistMsg,
    ReadDoneMsg,
    ReadMsg,
    ReadyMsg,
    StopMsg,
)
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.storage import StorageWorker

READ_BLOCKS = 8


def test_a_persist_completes_while_a_long_read_is_in_flight(tmp_path: Path) -> None:
    config = preset("tiny-testbed")
    options = RuntimeOptions(system="dualpath", kv_root=str(tmp_path / "kv"))
    env0 = ProcEnv(config, options, Topology.from_config(config), (), (), None, (), 0.0, 0)
    block = env0.layout.full_block_bytes
    # the SNIC's read direction takes ~1 s for the read; a write of one block ~1/8 of that
    rate = READ_BLOCKS * block / 1.0
    config = dataclasses.replace(
        config, hardware=dataclasses.replace(config.hardware, snic_bytes_per_s=rate)
    )
    spec = BufferSpec(f"dpt-{uuid.uuid4().hex[:8]}", READ_BLOCKS + 1, block)
    owner = SlotBuffer.create(spec, threading.Lock())
    results: queue.Queue[object] = queue.Queue()
    inbox: queue.Queue[object] = queue.Queue()
    try:
        env = ProcEnv(
            config,
            options,
            Topology.from_config(config),
            (spec,),
            (threading.Lock(),),
            results,
            (inbox,),
            time.monotonic(),
            os.getppid(),
        )
        store = env.store()
        keys = tuple(f"{i:02x}" + uuid.uuid4().hex for i in range(READ_BLOCKS))
        for key in keys:
            assert store.write_block(key, os.urandom(block))
        worker = StorageWorker(env, 0)
        thread = threading.Thread(target=worker.serve, args=(inbox,), daemon=True)
        thread.start()
        assert isinstance(results.get(timeout=10), ReadyMsg)
        read_slots, write_slots = owner.alloc(READ_BLOCKS), owner.alloc(1)
        assert read_slots is not None and write_slots is not None
        inbox.put(ReadMsg(7, keys, tuple(read_slots)))
        time.sleep(0.05)  # the read is in progress (it takes ~1 s at this SNIC rate)
        owner.slot(write_slots[0])[:] = os.urandom(block)
        inbox.put(PersistMsg("ff" + uuid.uuid4().hex, write_slots[0]))
        order = [type(results.get(timeout=20)) for _ in range(2)]
        inbox.put(StopMsg())
        thread.join(10)
        assert not thread.is_alive()
        assert order == [PersistedMsg, ReadDoneMsg]
    finally:
        owner.close()
