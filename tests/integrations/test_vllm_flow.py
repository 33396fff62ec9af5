"""The router's flow without vLLM or HTTP: real side-car processes, buffers and store.

A request given up while something may still write into its slots (a storage read's thread
in the side-car, a prefill that has not answered) gives them back only once that is over:
never slots that a later request could be handed while the old write lands in them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from tests.integrations.fake_vllm import sidecars

from dualpath.config import config_for, preset
from dualpath.config.systems import system_spec
from dualpath.integrations.vllm import flow as flow_mod
from dualpath.integrations.vllm.flow import TurnFlow
from dualpath.integrations.vllm.node import call
from dualpath.kv.store import block_keys
from dualpath.policy import make_policy
from dualpath.types import ReadSide


def _flow(launched: Any, kv_root: str, sidecar: Any = call) -> TurnFlow:
    config = config_for(preset("tiny-1p1d"), system_spec("dualpath"))
    return TurnFlow(
        launched.deployment, make_policy(config), kv_root, sidecar=sidecar, force_side=ReadSide.DE
    )


def _seed_store(flow: TurnFlow, tokens: list[int]) -> None:
    """Blocks of ``tokens`` in the store, as an earlier turn would have left them."""
    bs = flow.dep.block_tokens
    keys = block_keys(tokens, bs, flow.dep.namespace(""))
    for key in keys:
        flow.store.write_block(key, bytes(flow.full_block_bytes))


def test_a_request_cut_off_during_its_read_frees_its_slots_after_the_read(
    tmp_path: Path,
) -> None:
    with sidecars(tmp_path, buffer_mib=4) as launched:
        gate = threading.Event()

        def slow(path: str, op: dict[str, Any]) -> dict[str, Any]:
            if op["op"] == "read":
                gate.wait(30)  # the read is still landing in the slots
            return call(path, op)

        flow = _flow(launched, str(tmp_path / "kv"), slow)
        try:
            tokens = list(range(3, 3 + 4 * flow.dep.block_tokens + 5))
            _seed_store(flow, tokens)
            de = flow.buffers[1]
            start = de.num_free

            async def cut_off() -> int:
                task = asyncio.ensure_future(flow.place(tokens, 4, ""))
                while de.num_free == start:  # slots taken, the read under way
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
                task.cancel()  # the client left, or its deadline passed
                with pytest.raises(asyncio.CancelledError):
                    await task
                held = start - de.num_free  # still held: the read writes into them
                gate.set()
                for _ in range(300):
                    if de.num_free == start:
                        break
                    await asyncio.sleep(0.01)
                return held

            held = asyncio.run(cut_off())
            assert held == -(-len(tokens) // flow.dep.block_tokens)
            assert de.num_free == start  # given back once the read was over
        finally:
            gate.set()
            flow.close()


def test_a_prefill_cut_off_keeps_its_slots_for_a_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flow_mod, "PREFILL_GRACE_S", 0.3)
    with sidecars(tmp_path, buffer_mib=4) as launched:
        flow = _flow(launched, str(tmp_path / "kv"))
        try:
            de = flow.buffers[1]
            start = de.num_free

            async def cut_off() -> list[int]:
                prep = await flow.place(list(range(5, 80)), 4, "")
                flow.prefilling(prep)  # sent to the prefill instance, no answer yet
                flow.release(prep)  # then given up
                seen = [start - de.num_free]
                await asyncio.sleep(0.6)
                seen.append(start - de.num_free)
                return seen

            during, after = asyncio.run(cut_off())
            assert during == 3 and after == 0
        finally:
            flow.close()


def test_both_nodes_slots_are_asked_for_at_once_and_none_kept_on_a_failure(
    tmp_path: Path,
) -> None:
    """Across nodes a request takes slots on its DE and its PE node together
    (``_alloc_both``): both granted; or, when one node's buffer stays full (a 503) or the
    client leaves while one waits, the other node's slots go back: nothing stays leased."""
    from dualpath.integrations.vllm.flow import FlowError

    with sidecars(tmp_path, buffer_mib=4) as launched:
        flow = _flow(launched, str(tmp_path / "kv"))
        flow.slot_deadline_s = 0.5
        try:
            pe, de = flow.buffers[0], flow.buffers[1]
            pe_start, de_start = pe.num_free, de.num_free

            async def run() -> None:
                de_got, pe_got = await flow._alloc_both(1, 0, 3, 11)
                assert len(de_got) == len(pe_got) == 3
                assert (pe.num_free, de.num_free) == (pe_start - 3, de_start - 3)
                flow._release(0, pe_got, 11)
                flow._release(1, de_got, 11)
                for _ in range(100):  # (released off the event loop)
                    if (pe.num_free, de.num_free) == (pe_start, de_start):
                        break
                    await asyncio.sleep(0.01)
                hog = pe.alloc(pe.num_free, 99)  # the PE node's buffer full
                assert hog
                with pytest.raises(FlowError) as err:
                    await flow._alloc_both(1, 0, 3, 12)
                assert err.value.status == 503 and "node 0" in err.value.message
                waiting = asyncio.ensure_future(flow._alloc_both(1, 0, 3, 13))
                await asyncio.sleep(0.2)  # the DE slots granted, the PE ones waited for
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                for _ in range(100):
                    if de.num_free == de_start:
                        break
                    await asyncio.sleep(0.01)
                pe.release(hog, 99)

            asyncio.run(run())
            assert (pe.num_free, de.num_free) == (pe_start, de_start)
        finally:
            flow.close()
