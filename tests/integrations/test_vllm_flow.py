"""The router's flow and requests without vLLM or HTTP: real side-car processes, buffers and
store.

A request given up while something may still write into its slots (a storage read's thread
in the side-car, a prefill instance still inside a step) gives them back only once that is
over: never slots that a later request could be handed while the old write lands in them.
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
from dualpath.integrations.vllm.flow import TurnFlow
from dualpath.integrations.vllm.lease import Lease
from dualpath.integrations.vllm.node import BufferOwners, call, instance_owner
from dualpath.integrations.vllm.params import TransferParams
from dualpath.integrations.vllm.plan import StepPlanner
from dualpath.integrations.vllm.request import Outcome, Request
from dualpath.kv.buffer import UNPIN_FREES
from dualpath.kv.store import block_keys
from dualpath.policy import make_policy
from dualpath.types import ReadSide


def _flow(launched: Any, kv_root: str, sidecar: Any = call) -> TurnFlow:
    config = config_for(preset("tiny-1p1d"), system_spec("dualpath"))
    return TurnFlow(
        launched.deployment, make_policy(config), kv_root, sidecar=sidecar, force_side=ReadSide.DE
    )


def _request(flow: TurnFlow) -> Request:
    return Request(flow, flow.next_rid(), float("inf"))


async def _released(buf: Any, slots: list[int]) -> None:
    """Until the router's release of ``slots`` (off its event loop) has reached the buffer:
    each is free, or marked to be freed when its pin ends."""
    for _ in range(1000):
        if all(buf.owner_of(s) in (None, UNPIN_FREES) for s in slots):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"slots {slots} not released within 10 s")


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

            req = _request(flow)

            async def cut_off() -> int:
                task = asyncio.ensure_future(req.place(tokens, 4, ""))
                while de.num_free == start:  # slots taken, the read under way
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
                task.cancel()  # the client left, or its deadline passed
                with pytest.raises(asyncio.CancelledError):
                    await task
                req.close(Outcome.ABORTED)  # the router's one exit
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


def test_a_prefill_cut_off_frees_its_slots_once_its_instance_is_done(tmp_path: Path) -> None:
    """The prefill instance pins the request's slots in the first step that schedules it;
    the router gives the request up while a step still saves into them: they stay in use
    until the instance is done (the request left vLLM and the steps planned before ran),
    then they are free at once, with no timer."""
    with sidecars(tmp_path, buffer_mib=4) as launched:
        flow = _flow(launched, str(tmp_path / "kv"))
        owners = BufferOwners(dict(enumerate(launched.deployment.nodes)), instance_owner(0))
        try:
            de = flow.buffers[1]
            start = de.num_free
            req = _request(flow)
            tokens = list(range(5, 80))

            async def cut_off() -> list[int]:
                await req.place(tokens, 4, "")
                params = TransferParams.from_request(req.prefill_params())
                assert params is not None and params.save is not None
                assert params.save.lease == req.lease.tag
                req.prefilling()
                # (two steps at once: pipeline parallelism, as vLLM's batch queue runs them)
                planner = StepPlanner(flow.dep.block_tokens, owners, steps_in_flight=2)
                planner.matched_tokens("r", params, tokens, len(tokens), 0)
                meta = planner.step([("r", list(range(1, 4)), 0, 32)], [])  # a step saves
                assert meta.saves and not meta.lost
                planner.step([], [("r", None, False, 32, len(tokens) - 32)])  # and the next
                slots = list(params.save.slots)
                req.close(Outcome.ABORTED)  # then given up
                await _released(de, slots)  # (off the event loop): to be freed at the unpin
                seen = [start - de.num_free]
                planner.finished("r", params)  # vLLM aborted it: one step still running
                seen.append(start - de.num_free)
                planner.step_done()  # the steps' outputs came back
                planner.step_done()
                seen.append(start - de.num_free)
                return seen

            during, left, done = asyncio.run(cut_off())
            assert during == left == 3 and done == 0
        finally:
            owners.close()
            flow.close()


def test_a_prefill_whose_lease_is_gone_loads_nothing_and_saves_nothing(tmp_path: Path) -> None:
    """The router gave the request up before the prefill instance scheduled it: the pin
    fails, so the load is lost (vLLM recomputes) and no save writes into slots that another
    request may hold by now."""
    with sidecars(tmp_path, buffer_mib=4) as launched:
        flow = _flow(launched, str(tmp_path / "kv"))
        owners = BufferOwners(dict(enumerate(launched.deployment.nodes)), instance_owner(0))
        try:
            tokens = list(range(3, 3 + 4 * flow.dep.block_tokens + 5))
            _seed_store(flow, tokens)
            req = _request(flow)

            async def too_late() -> TransferParams | None:
                await req.place(tokens, 4, "")
                params = TransferParams.from_request(req.prefill_params())
                start = flow.buffers[1].num_free + len(req.de_slots)
                req.close(Outcome.ABORTED)
                for _ in range(1000):  # (released off the event loop)
                    if flow.buffers[1].num_free == start:
                        break
                    await asyncio.sleep(0.01)
                return params

            params = asyncio.run(too_late())
            assert params is not None and params.load is not None and params.save is not None
            planner = StepPlanner(flow.dep.block_tokens, owners)
            matched = planner.matched_tokens("r", params, tokens, len(tokens), 0)
            planner.allocated("r", matched)
            meta = planner.step([("r", list(range(1, 7)), 0, len(tokens))], [])
            assert meta.lost and not meta.loads and not meta.saves
        finally:
            owners.close()
            flow.close()


def test_a_lease_gives_back_a_grant_that_lands_after_it_closed() -> None:
    released: list[tuple[int, list[int], int]] = []
    lease = Lease(7, lambda node, slots, tag: released.append((node, slots, tag)))
    lease.took(1, [4, 5])
    lease.give_back(0)  # nothing on node 0
    assert released == []
    lease.close()
    assert released == [(1, [4, 5], 7)]
    lease.took(0, [9])  # an ask that was still in flight when the request ended
    assert released == [(1, [4, 5], 7), (0, [9], 7)]
    assert lease.held == {}


def test_both_nodes_slots_are_asked_for_at_once_and_none_kept_on_a_failure(
    tmp_path: Path,
) -> None:
    """Across nodes a request takes slots on its DE and its PE node together
    (``alloc_both``): both granted; or, when one node's buffer stays full (a 503) or the
    client leaves while one waits, the other node's slots are the lease's, and go back with
    it: nothing stays leased."""
    from dualpath.integrations.vllm.flow import FlowError

    with sidecars(tmp_path, buffer_mib=4) as launched:
        flow = _flow(launched, str(tmp_path / "kv"))
        flow.slot_deadline_s = 0.5
        try:
            pe, de = flow.buffers[0], flow.buffers[1]
            pe_start, de_start = pe.num_free, de.num_free

            async def run() -> None:
                lease = Lease(11, flow.release_slots)
                de_got, pe_got = await flow.alloc_both(1, 0, 3, lease)
                assert len(de_got) == len(pe_got) == 3
                assert (pe.num_free, de.num_free) == (pe_start - 3, de_start - 3)
                assert lease.held == {1: de_got, 0: pe_got}
                lease.close()
                for _ in range(100):  # (released off the event loop)
                    if (pe.num_free, de.num_free) == (pe_start, de_start):
                        break
                    await asyncio.sleep(0.01)
                hog = pe.alloc(pe.num_free, 99)  # the PE node's buffer full
                assert hog
                failed = Lease(12, flow.release_slots)
                with pytest.raises(FlowError) as err:
                    await flow.alloc_both(1, 0, 3, failed)
                assert err.value.status == 503 and "node 0" in err.value.message
                assert list(failed.held) == [1]  # the DE slots it got are the lease's ...
                failed.close()  # ... which the request's exit gives back
                left = Lease(13, flow.release_slots)
                waiting = asyncio.ensure_future(flow.alloc_both(1, 0, 3, left))
                await asyncio.sleep(0.2)  # the DE slots granted, the PE ones waited for
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                left.close()
                for _ in range(100):
                    if de.num_free == de_start:
                        break
                    await asyncio.sleep(0.01)
                pe.release(hog, 99)

            asyncio.run(run())
            assert (pe.num_free, de.num_free) == (pe_start, de_start)
        finally:
            flow.close()


def test_a_request_waiting_for_slots_is_woken_when_an_instance_frees_some(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's buffer is full; a decode instance frees slots (its own attachment of the
    buffer, as after a load): the buffer's doorbell wakes the router's slot queue. With its
    safety-net retries a minute apart, only the doorbell can hand the request its slots."""
    from dualpath.integrations.vllm import slotqueue
    from dualpath.integrations.vllm.node import attach_buffer

    monkeypatch.setattr(slotqueue, "POLL_S", 60.0)
    monkeypatch.setattr(slotqueue, "POLL_MAX_S", 60.0)
    with sidecars(tmp_path, buffer_mib=4) as launched:
        flow = _flow(launched, str(tmp_path / "kv"))
        instance = attach_buffer(launched.deployment.nodes[1])
        try:
            hog = instance.alloc(instance.num_free, instance_owner(1))
            assert hog

            async def run() -> list[int]:
                lease = Lease(5, flow.release_slots)
                ask = asyncio.ensure_future(flow.alloc(1, 2, lease))
                await asyncio.sleep(0.3)
                assert not ask.done() and flow.slot_waiters == 1
                await asyncio.to_thread(instance.release, hog[:2], instance_owner(1))
                async with asyncio.timeout(20):
                    got = await ask
                lease.close()
                return got

            assert sorted(asyncio.run(run())) == sorted(hog[:2])
            instance.release(hog[2:], instance_owner(1))
        finally:
            instance.close()
            flow.close()


def test_a_layerwise_hand_over_is_closed_before_its_slots_go_back(tmp_path: Path) -> None:
    """Across nodes the prefill's PE node pushes each saved layer into the DE slots on its
    own (no router call in between). A request given up on after its prefill began first
    closes that hand-over at the PE node's side-car (``handed``: every transfer waited
    for, later ones dropped), and only then are its DE slots free for another request."""
    with sidecars(tmp_path, buffer_mib=4) as launched:
        gate = threading.Event()
        asked: list[dict[str, Any]] = []

        def cnic(path: str, op: dict[str, Any]) -> dict[str, Any]:
            if op["op"] == "handed":  # the PE node's side-car, its transfers still landing
                asked.append(op)
                gate.wait(30)
                return {"missing": []}
            return call(path, op)

        flow = _flow(launched, str(tmp_path / "kv"), cnic)
        flow.networked = flow.layerwise = True  # (the hand-over's calls, on these side-cars)
        try:
            tokens = list(range(3, 3 + 2 * flow.dep.block_tokens + 5))
            de = flow.buffers[1]
            start = de.num_free
            req = _request(flow)

            async def give_up() -> tuple[int, int]:
                await req.place(tokens, 4, "")
                params = TransferParams.from_request(req.prefill_params())
                assert params is not None and params.save is not None
                forward = params.save.forward
                assert forward is not None and forward.slots == tuple(req.de_slots)
                req.prefilling()
                slots = list(req.de_slots)
                req.close(Outcome.ABORTED)  # the client left while the prefill ran
                await asyncio.sleep(0.3)
                held = start - de.num_free  # not back: the hand-over is not closed yet
                gate.set()
                await _released(de, slots)
                return held, len(asked)

            held, num_asked = asyncio.run(give_up())
            assert held == 3 and num_asked == 1
            assert asked[0]["job"] == f"{flow.boot}:{req.lease.tag}"
        finally:
            gate.set()
            flow.close()
