"""The scheduler's components on their own, without processes: durability's held reports,
recovery's choices (which turns a dead engine costs, how a lost turn resumes), the pass
budget, token streams, and the loop's structure (one handler per message a runtime process
sends the scheduler, components that never reach one another)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dualpath.ledger import Phase
from dualpath.policy import PendingPrefill
from dualpath.runtime import messages
from dualpath.runtime.requests import Req
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler.durability import Durability
from dualpath.runtime.scheduler.passes import kv_budget_tokens
from dualpath.runtime.scheduler.recovery import Recovery, resume
from dualpath.runtime.scheduler.streams import Streams

RUNTIME = Path(__file__).resolve().parents[2] / "src" / "dualpath" / "runtime"


def _req(
    rid: int,
    *,
    output: int = 4,
    phase: Phase = Phase.DECODING,
    pe: int = 0,
    de: int = 2,
    sampling: SamplingParams | None = None,
) -> Req:
    req = Req(rid, rid, 0, (5, 6, 7, 8), output, ("k0",), 0, 0.0, sampling=sampling)
    req.phase, req.pe, req.de = phase, pe, de
    return req


def test_a_resend_waits_only_for_the_blocks_in_flight_that_it_would_hit() -> None:
    d = Durability()
    d.acked_key("early")  # an ack may come before the DE's DecodeDoneMsg
    assert d.pending(["early", "a", "b"]) == {"a", "b"}
    # a finished turn's blocks: "early" is durable already
    assert d.handed(7, ["early", "a", "b"]) == {"a", "b"}
    assert d.in_flight == {"a", "b"}
    assert not d.hold(["early", "c"], "other conversation")  # nothing of it in flight: goes now
    assert d.hold(["early", "a"], "resend 1") and d.hold(["early", "a", "b"], "resend 2")
    assert d.busy
    assert d.acked_key("a") == ["resend 1"]  # resend 2 still needs "b"
    assert d.acked_key("b") == ["resend 2"] and not d.busy
    assert not d.hold(["a", "b"], "late")  # durable now: never held


def test_lost_writes_release_every_held_submission_in_order() -> None:
    d = Durability()
    d.handed(1, ["x", "y"])
    assert d.hold(["y"], 2) and d.hold(["x"], 1)
    assert d.lost([5, 6]) == [2, 1] and not d.busy and not d.in_flight


def test_a_turn_live_when_a_storage_worker_died_is_never_waited_for() -> None:
    """Both storage workers died while turn 5 was decoding: the writes they had taken are
    lost (never acknowledged). When turn 5 finishes after the respawn, a resend of its
    conversation must not wait for its blocks (it would wait until request_timeout_s)."""
    d = Durability()
    d.lost([5, 6])
    assert d.handed(5, ["lost-with-the-worker", "requeued"]) == set()
    assert not d.hold(["lost-with-the-worker"], "resend") and not d.busy
    assert d.handed(8, ["after"]) == {"after"}  # a turn begun after the respawn waits as ever
    d.forget(6)  # turn 6 was aborted: nothing kept for it
    assert d.suspect == set()


def test_a_dead_engine_costs_the_turns_that_still_need_it() -> None:
    reading = _req(1, phase=Phase.READING, pe=0, de=3)
    ready_elsewhere = _req(2, phase=Phase.READY, pe=1, de=3)
    decoding_on_it = _req(3, phase=Phase.DECODING, pe=0, de=2)
    decoding_elsewhere = _req(4, phase=Phase.DECODING, pe=0, de=3)  # its PE is done with it
    in_pass_elsewhere = _req(5, phase=Phase.IN_PASS, pe=1, de=2)
    queued = _req(6, phase=Phase.QUEUED, pe=0)
    waiting_for_slots = _req(7, phase=Phase.SCHEDULED, pe=0, de=3)
    reqs = [
        in_pass_elsewhere,
        queued,
        decoding_elsewhere,
        decoding_on_it,
        ready_elsewhere,
        reading,
        waiting_for_slots,
    ]
    got = [(r.request_id, free) for r, free in Recovery.orphans(0, reqs)]
    assert got == [(1, False), (7, True)]  # the storage worker may still write request 1's
    got = [(r.request_id, free) for r, free in Recovery.orphans(2, reqs)]
    assert got == [(3, True), (5, False)]  # PE 1 may still write request 5's slots


def test_recovery_looks_for_dead_processes_at_most_every_50_ms() -> None:
    rec = Recovery()
    assert rec.due(1.0) and not rec.due(1.04) and rec.due(1.05)


def test_a_streaming_turn_resumes_after_the_tokens_its_client_has() -> None:
    sampling = SamplingParams(temperature=1.0, seed=3)
    req = _req(1, output=5, sampling=sampling)
    req.first_token, req.streamed = 40, [41, 42]
    plan = resume(req, context=(5, 6), streaming=True)
    assert not plan.finished and plan.resumed == (40, 41, 42)
    assert plan.append == (7, 8, 40, 41, 42) and plan.output_tokens == 2
    assert plan.sampling is not None and plan.sampling.first_index == 3
    assert plan.sampling.history == (40, 41, 42)
    scripted = resume(req, context=(5, 6), streaming=False)  # nothing was delivered
    assert (scripted.resumed, scripted.append, scripted.output_tokens) == ((), (7, 8), 5)


@pytest.mark.parametrize(("streamed", "stops"), [([41, 42, 43, 44], ()), ([41], (41,))])
def test_a_turn_whose_delivered_tokens_end_it_is_finished_not_resubmitted(
    streamed: list[int], stops: tuple[int, ...]
) -> None:
    req = _req(1, output=5, sampling=SamplingParams(stop_token_ids=stops))
    req.first_token, req.streamed = 40, streamed
    plan = resume(req, context=(), streaming=True)
    assert plan.finished and plan.resumed == (40, *streamed)


def test_the_pass_budget_keeps_one_page_per_chunk_it_can_hold() -> None:
    one = (PendingPrefill(0, 0, 64),)
    # 40 pages, layerwise: a window of 2 layers → 20 pages; one chunk keeps one back
    assert kv_budget_tokens(one, 40, 4, 16, layerwise=True) == 19 * 16
    assert kv_budget_tokens(one, 40, 4, 16, layerwise=False) == 9 * 16  # all 4 layers
    many = tuple(PendingPrefill(i, 0, 16) for i in range(5))
    assert kv_budget_tokens(many, 40, 4, 16, layerwise=True) == 15 * 16  # 5 chunks fit


def test_a_stream_ends_with_its_done_report() -> None:
    streams, seen = Streams(), []
    req = _req(7)
    streams.watch(7, lambda rid, toks, done: seen.append((rid, toks, done)))
    streams.emit(req, (1,), False)
    streams.emit(req, (1, 2), True)
    streams.emit(req, (1, 2, 3), True)  # after done: nobody listens
    assert seen == [(7, (1,), False), (7, (1, 2), True)] and not streams.watches(7)


def _sent_to_scheduler() -> set[str]:
    """Message classes a runtime process (or the scheduler's own threads: ``WakeMsg``) puts on
    the results queue (``results.put(X(...))``)."""
    names: set[str] = set()
    for path in [*RUNTIME.glob("*.py"), *RUNTIME.glob("scheduler/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "put"
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "results"
                and node.args
                and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Name)
            ):
                names.add(node.args[0].func.id)
    return names


def test_every_message_to_the_scheduler_has_one_handler() -> None:
    from dualpath.runtime.scheduler import Scheduler

    sent = _sent_to_scheduler()
    assert {"ReadDoneMsg", "TokensMsg", "ErrorMsg"} <= sent  # the scan finds them
    handled = Scheduler.handled_messages()
    assert {cls.__name__ for cls in handled} == sent
    assert all(getattr(messages, cls.__name__) is cls for cls in handled)


COMPONENTS = {  # module → the component class it defines (the loop's parts)
    "intake": "Intake",
    "passes": "Passes",
    "decodes": "Decodes",
    "durability": "Durability",
    "writes": "Writes",
    "recovery": "Recovery",
    "streams": "Streams",
    "inbox": "Inbox",
}


def test_the_components_never_reach_one_another() -> None:
    """The scheduler's components never call each other: no component module imports
    another's class, and the loop builds none of them from another (each gets the core, the
    slots and pools, the launcher's ports; the handlers hand one's result to the next)."""
    classes = set(COMPONENTS.values())
    for mod, own in COMPONENTS.items():
        tree = ast.parse((RUNTIME / "scheduler" / f"{mod}.py").read_text())
        imported = {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assert not (imported & classes), f"{mod}.py imports {imported & classes}"
        assert own in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    loop = ast.parse((RUNTIME / "scheduler" / "loop.py").read_text())
    attrs = set(COMPONENTS)
    built = 0
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in classes:
            continue
        built += 1
        args = [*node.args, *(k.value for k in node.keywords)]
        used = {
            a.attr
            for arg in args
            for a in ast.walk(arg)
            if isinstance(a, ast.Attribute) and a.attr in attrs
        }
        assert not used, f"{node.func.id} is built from {used}"
    assert built == len(classes)  # the scan sees every component being built
    wiring = ast.parse((RUNTIME / "scheduler" / "handlers.py").read_text())
    made = {
        n.func.id
        for n in ast.walk(wiring)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in classes
    }
    assert not made, f"the handlers build {made}: they only wire what the loop built"


def test_the_scheduler_declares_no_attributes_it_does_not_set() -> None:
    """One class, no base that declares its attributes for another file to use."""
    from dualpath.runtime.scheduler import Scheduler

    assert Scheduler.__bases__ == (object,)
    assert not getattr(Scheduler, "__annotations__", {})
